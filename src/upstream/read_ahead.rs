//! Reading a response ahead of a slow client (docs/configuration.md#upstreamsnameresponse_buffer):
//! a task reads the upstream's body into up to `response_buffer` bytes while the client
//! takes its time, so that a response that fits is off the upstream (its connection back
//! in the pool, its server and concurrency-limit slots free, PHP's worker on to the next
//! request) as soon as the app has sent it, not when the client has read it. A larger one
//! streams on at the client's pace, under `server.send_timeout`.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::sync::{Semaphore, mpsc};

use super::UpstreamBody;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a frame costs of the budget at least, so that tiny frames cannot queue without
/// bound.
const MIN_FRAME_COST: usize = 1024;

/// A response body read ahead into a bounded buffer by a task of its own.
pub(crate) struct ReadAhead {
    frames: mpsc::UnboundedReceiver<Result<Frame<Bytes>, BoxError>>,
    /// Bytes that may still be read ahead: a frame takes its size (at most the whole
    /// budget) before it is queued, and gives it back when the client takes it.
    budget: Arc<Semaphore>,
    limit: usize,
    hint: SizeHint,
}

impl ReadAhead {
    /// Starts reading `body` ahead into up to `limit` bytes.
    pub(crate) fn start(mut body: UpstreamBody, limit: usize) -> Self {
        let hint = body.size_hint();
        let budget = Arc::new(Semaphore::new(limit));
        // Bounded by the budget.
        let (sender, frames) = mpsc::unbounded_channel();
        let room = budget.clone();
        tokio::spawn(async move {
            while let Some(frame) = body.frame().await {
                let failed = frame.is_err();
                let Ok(permits) = room.acquire_many(cost(&frame, limit)).await else {
                    return;
                };
                permits.forget();
                // The client left: the body is dropped here, and read to its end in the
                // background when a cap counts the request (`UpstreamBody`'s drop).
                if sender.send(frame).is_err() || failed {
                    return;
                }
            }
            // Read to its end: the body goes now, with its connection and slots.
        });
        ReadAhead {
            frames,
            budget,
            limit,
            hint,
        }
    }
}

impl Drop for ReadAhead {
    /// The client left: a reader waiting for room stops, and drops the body.
    fn drop(&mut self) {
        self.budget.close();
    }
}

/// What `frame` takes of a budget of `limit` bytes while it waits for the client.
fn cost(frame: &Result<Frame<Bytes>, BoxError>, limit: usize) -> u32 {
    let size = frame
        .as_ref()
        .ok()
        .and_then(Frame::data_ref)
        .map_or(0, Bytes::len);
    size.max(MIN_FRAME_COST).min(limit) as u32
}

impl Body for ReadAhead {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = std::task::ready!(self.frames.poll_recv(cx));
        if let Some(frame) = &frame {
            self.budget.add_permits(cost(frame, self.limit) as usize);
        }
        Poll::Ready(frame)
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}
