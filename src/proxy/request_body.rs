//! The request body on its way upstream, bounded by `server.max_body` and
//! `server.body_timeout` while it streams: a client cannot hold an upstream connection
//! by pausing, nor send more than the limit.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use super::spool::Spooled;
use crate::error::GatewayError;

/// Why a request body stopped streaming.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RequestBodyError {
    #[error("the request body exceeds server.max_body")]
    TooLarge,
    #[error("the client paused its request body longer than server.body_timeout")]
    TimedOut,
    #[error("reading the request body failed: {0}")]
    Client(#[from] hyper::Error),
    #[error("the request body could not be kept in a temporary file: {0}")]
    Spool(#[from] std::io::Error),
    #[error("no place came free for the request body's temporary file")]
    NoRoom,
}

pin_project! {
    /// A client's request body, streamed upstream, failing once it exceeds its limit or
    /// the client pauses longer than `pause_limit` while it is being read.
    pub(crate) struct RequestBody {
        // `None`: no body (a request rebuilt to be tried again).
        inner: Option<Incoming>,
        // A body read whole beforehand; then `inner` is `None`. Boxed: a request body
        // that streams (nearly all) need not be as large as a spooled one.
        spooled: Option<Box<Spooled>>,
        remaining: Option<u64>,
        pause_limit: Duration,
        // Armed (lazily, and reset rather than replaced) when a read has to wait.
        pause: Option<Pin<Box<Sleep>>>,
        // Whether `pause` measures the current wait (else it is armed at the next one).
        waiting: bool,
    }
}

impl RequestBodyError {
    /// The answer to a request whose body failed this way (`detail` for the log).
    pub(crate) fn answer(&self, detail: String) -> GatewayError {
        match self {
            RequestBodyError::TooLarge => GatewayError::BodyTooLarge,
            RequestBodyError::TimedOut => GatewayError::BodyTimeout,
            RequestBodyError::Client(_) => GatewayError::BadRequestBody(detail),
            RequestBodyError::Spool(error) if crate::room::exhausted(error) => GatewayError::OutOfDescriptors,
            RequestBodyError::Spool(_) => GatewayError::SpoolFailed(detail),
            RequestBodyError::NoRoom => GatewayError::NoBodyPlace,
        }
    }
}

impl RequestBody {
    pub(crate) fn new(inner: Incoming, limit: Option<u64>, pause_limit: Duration) -> Self {
        RequestBody {
            inner: Some(inner),
            spooled: None,
            remaining: limit,
            pause_limit,
            pause: None,
            waiting: false,
        }
    }
}

impl RequestBody {
    /// A body read whole beforehand ([`spool`](super::spool::spool)).
    pub(crate) fn spooled(spooled: Spooled) -> Self {
        RequestBody {
            spooled: Some(Box::new(spooled)),
            ..RequestBody::empty()
        }
    }

    /// A body with nothing in it.
    pub(crate) fn empty() -> Self {
        RequestBody {
            inner: None,
            spooled: None,
            remaining: None,
            pause_limit: Duration::ZERO,
            pause: None,
            waiting: false,
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = RequestBodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.project();
        let Some(inner) = this.inner.as_mut() else {
            return match this.spooled.as_mut() {
                Some(spooled) => Pin::new(spooled.as_mut()).poll_frame(cx).map_err(Into::into),
                None => Poll::Ready(None),
            };
        };
        let frame = match Pin::new(inner).poll_frame(cx) {
            Poll::Pending => {
                let deadline = || Instant::now() + *this.pause_limit;
                let pause = match this.pause {
                    Some(pause) if *this.waiting => pause,
                    Some(pause) => {
                        pause.as_mut().reset(deadline());
                        pause
                    }
                    None => this.pause.insert(Box::pin(tokio::time::sleep_until(deadline()))),
                };
                *this.waiting = true;
                return match pause.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(RequestBodyError::TimedOut))),
                    Poll::Pending => Poll::Pending,
                };
            }
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(Some(Ok(frame))) => frame,
        };
        *this.waiting = false;
        if let (Some(remaining), Some(data)) = (this.remaining.as_mut(), frame.data_ref()) {
            let len = data.len() as u64;
            if len > *remaining {
                return Poll::Ready(Some(Err(RequestBodyError::TooLarge)));
            }
            *remaining -= len;
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        match (&self.inner, &self.spooled) {
            (Some(inner), _) => inner.is_end_stream(),
            (None, Some(spooled)) => spooled.is_end_stream(),
            (None, None) => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.inner, &self.spooled) {
            (Some(inner), _) => inner.size_hint(),
            (None, Some(spooled)) => spooled.size_hint(),
            (None, None) => SizeHint::with_exact(0),
        }
    }
}
