//! Reading a response ahead of a slow client (docs/configuration.md#upstreamsnameresponse_buffer):
//! once the first part of a response has been handed to the client and more is to come, a
//! task reads the rest into up to `response_buffer` bytes while the client takes its time,
//! so that a response that fits is off the upstream (its connection back in the pool, its
//! server and concurrency-limit slots free, PHP's worker on to the next request) as soon as
//! the app has sent it, not when the client has read it. A larger one streams on at the
//! client's pace, under `server.send_timeout`. A response that comes whole in its first
//! part (most do) needs no task.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::sync::{Semaphore, mpsc};

use super::UpstreamBody;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a frame costs of the budget at least, so that tiny frames cannot queue without
/// bound.
const MIN_FRAME_COST: usize = 1024;

/// A response body, read ahead of the client into a bounded buffer once it proves larger
/// than its first part.
pub(crate) struct ReadAhead {
    state: State,
    limit: usize,
    hint: SizeHint,
}

enum State {
    /// Read as the client asks, until the first part is out.
    Direct(UpstreamBody),
    /// The rest, read ahead by a task.
    Queued {
        frames: mpsc::UnboundedReceiver<Result<Frame<Bytes>, BoxError>>,
        /// Bytes that may still be read ahead: a frame takes its cost before it is
        /// queued, and gives it back when the client takes it.
        budget: Arc<Semaphore>,
    },
}

impl ReadAhead {
    /// `body`, to be read ahead into up to `limit` bytes.
    pub(crate) fn new(body: UpstreamBody, limit: usize) -> Self {
        ReadAhead {
            hint: body.size_hint(),
            state: State::Direct(body),
            limit,
        }
    }
}

/// Reads `body` into `frames` while `budget` has room; the body is dropped (with its
/// connection and slots) when read to its end, or when the client left.
async fn read_into(
    mut body: UpstreamBody,
    frames: mpsc::UnboundedSender<Result<Frame<Bytes>, BoxError>>,
    budget: Arc<Semaphore>,
    limit: usize,
) {
    while let Some(frame) = body.frame().await {
        let failed = frame.is_err();
        let Ok(permits) = budget.acquire_many(cost(&frame, limit)).await else {
            return;
        };
        permits.forget();
        if frames.send(frame).is_err() || failed {
            return;
        }
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
        let limit = self.limit;
        match &mut self.state {
            State::Direct(body) => {
                let frame = ready!(Pin::new(&mut *body).poll_frame(cx));
                if matches!(frame, Some(Ok(_))) && !body.is_end_stream() {
                    let budget = Arc::new(Semaphore::new(limit));
                    let (sender, frames) = mpsc::unbounded_channel();
                    let rest = std::mem::replace(
                        &mut self.state,
                        State::Queued {
                            frames,
                            budget: budget.clone(),
                        },
                    );
                    if let State::Direct(body) = rest {
                        tokio::spawn(read_into(body, sender, budget, limit));
                    }
                }
                Poll::Ready(frame)
            }
            State::Queued { frames, budget } => {
                let frame = ready!(frames.poll_recv(cx));
                if let Some(frame) = &frame {
                    budget.add_permits(cost(frame, limit) as usize);
                }
                Poll::Ready(frame)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.state {
            State::Direct(body) => body.is_end_stream(),
            State::Queued { .. } => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}

impl Drop for ReadAhead {
    /// The client left: a reader waiting for room stops, and drops the body.
    fn drop(&mut self) {
        if let State::Queued { budget, .. } = &self.state {
            budget.close();
        }
    }
}
