//! The request side of an exchange with a server, whatever the protocol: the bytes queued
//! for it (the head, then the body's as it comes, in the protocol's framing), the body
//! still to be read from the client, and whether any of it was read (a request whose body
//! was not touched can go out again on another connection).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use http_body::Body;
use tokio::io::AsyncWrite;

use crate::proxy::request_body::{RequestBody, RequestBodyError};

/// How a protocol puts a request body on the wire.
pub(super) trait BodyFraming {
    type Error: From<io::Error> + From<RequestBodyError>;

    /// Queues `data`, the next piece of the body, into `out`.
    fn data(&mut self, data: &[u8], out: &mut BytesMut) -> Result<(), Self::Error>;

    /// Queues the body's end into `out`.
    fn end(&mut self, out: &mut BytesMut) -> Result<(), Self::Error>;
}

/// A request on its way to a server.
pub(super) struct Sending<F> {
    /// Bytes to write.
    write: BytesMut,
    /// The request body still to be read; `None` once its end is queued.
    body: Option<RequestBody>,
    framing: F,
    /// Whether any of the request body was read.
    body_read: bool,
    /// Whether any byte went to the server: then it may have acted on the request.
    written: bool,
    /// Whether what was written may still sit in a TLS stream's buffer.
    unflushed: bool,
}

impl<F: BodyFraming> Sending<F> {
    /// `head` to write first, then `body` in `framing`.
    pub(super) fn new(head: BytesMut, body: RequestBody, framing: F) -> Self {
        Sending {
            write: head,
            body: Some(body),
            framing,
            body_read: false,
            written: false,
            unflushed: false,
        }
    }

    /// Whether the whole request has been written.
    pub(super) fn is_done(&self) -> bool {
        self.write.is_empty() && self.body.is_none() && !self.unflushed
    }

    /// Whether nothing of the request reached the server and none of its body was read:
    /// then it can go out again, whatever its method.
    pub(super) fn untouched(&self) -> bool {
        !self.written && !self.body_read
    }

    /// The request body (for another try), when the request is [`untouched`](Self::untouched).
    pub(super) fn into_body(self) -> Option<RequestBody> {
        if !self.untouched() {
            return None;
        }
        // A body that ended without data is as good as none.
        Some(self.body.unwrap_or_else(RequestBody::empty))
    }

    /// Writes what is queued to `stream`, and queues the body's frames as they come, until
    /// either would wait.
    pub(super) fn poll_write<S: AsyncWrite + Unpin>(
        &mut self,
        stream: &mut S,
        cx: &mut Context<'_>,
    ) -> Result<(), F::Error> {
        loop {
            // A body already ended (a request without one) ends in the same write as the
            // head before it.
            if self.body.as_ref().is_some_and(|body| body.is_end_stream()) {
                self.body = None;
                self.framing.end(&mut self.write)?;
            }
            if !self.write.is_empty() {
                match Pin::new(&mut *stream).poll_write(cx, &self.write)? {
                    Poll::Ready(0) => return Err(io::Error::from(io::ErrorKind::WriteZero).into()),
                    Poll::Ready(n) => {
                        // Advanced, not split off: splitting a buffer makes its storage
                        // shared, an allocation for bytes that are then dropped.
                        self.write.advance(n);
                        self.written = true;
                        self.unflushed = true;
                        continue;
                    }
                    Poll::Pending => return Ok(()),
                }
            }
            // A TLS stream may hold the last record back until flushed.
            if self.unflushed {
                match Pin::new(&mut *stream).poll_flush(cx)? {
                    Poll::Ready(()) => self.unflushed = false,
                    Poll::Pending => return Ok(()),
                }
            }
            let Some(body) = self.body.as_mut() else {
                return Ok(());
            };
            match Pin::new(body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data()
                        && !data.is_empty()
                    {
                        self.body_read = true;
                        self.framing.data(&data, &mut self.write)?;
                    }
                }
                Poll::Ready(None) => {
                    self.body = None;
                    self.framing.end(&mut self.write)?;
                }
                Poll::Ready(Some(Err(error))) => return Err(error.into()),
                Poll::Pending => return Ok(()),
            }
        }
    }
}
