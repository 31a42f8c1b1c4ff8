//! Reading a response ahead of a slow client (docs/configuration.md#upstreamsnameresponse_buffer):
//! once the first part of a response has been handed to the client and more is to come, a
//! task reads the rest into up to `response_buffer` bytes while the client takes its time,
//! so that a response that fits is off the upstream (its connection back in the pool, its
//! server and concurrency-limit slots free, PHP's worker on to the next request) as soon as
//! the app has sent it, not when the client has read it. A larger one streams on at the
//! client's pace, under `server.send_timeout`. A response that comes whole in its first
//! part (most do) needs no task.
//!
//! What all responses read ahead hold together is bounded too ([`TOTAL`]): past it, a
//! response goes on at its client's pace, a frame at a time, so that many slow clients
//! cannot make floodgate hold `response_buffer` for each of them, nor stop the others.

use std::pin::Pin;
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError, mpsc};

use super::UpstreamBody;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a frame costs of the budget at least, so that tiny frames cannot queue without
/// bound.
const MIN_FRAME_COST: usize = 1024;
/// The most bytes all responses together hold read ahead of their clients.
const TOTAL: usize = 128 * 1024 * 1024;
/// What remains of [`TOTAL`]: each queued frame holds its cost until its client takes it
/// (or the frame is dropped with its response).
static READ_AHEAD: LazyLock<Arc<Semaphore>> = LazyLock::new(|| Arc::new(Semaphore::new(TOTAL)));

/// A frame read ahead, and its cost's place in [`TOTAL`].
type Queued = (Result<Frame<Bytes>, BoxError>, Option<OwnedSemaphorePermit>);

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
        frames: mpsc::UnboundedReceiver<Queued>,
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
    frames: mpsc::UnboundedSender<Queued>,
    budget: Arc<Semaphore>,
    limit: usize,
) {
    read_within(&mut body, frames, budget, limit, &READ_AHEAD).await;
}

/// [`read_into`] within `total`, which what every response reads ahead shares.
async fn read_within(
    body: &mut (impl Body<Data = Bytes, Error = BoxError> + Unpin),
    frames: mpsc::UnboundedSender<Queued>,
    budget: Arc<Semaphore>,
    limit: usize,
    total: &Arc<Semaphore>,
) {
    while let Some(frame) = body.frame().await {
        let failed = frame.is_err();
        let cost = cost(&frame, limit);
        let Ok(permits) = budget.acquire_many(cost).await else {
            return;
        };
        permits.forget();
        let shared = match total.clone().try_acquire_many_owned(cost) {
            Ok(shared) => Some(shared),
            Err(TryAcquireError::Closed) => return,
            // The total is spent: this response goes on at its client's pace, a frame
            // once the client has taken all before it (its room whole again).
            Err(TryAcquireError::NoPermits) => {
                let Ok(whole) = budget.acquire_many(limit as u32 - cost).await else {
                    return;
                };
                drop(whole);
                None
            }
        };
        if frames.send((frame, shared)).is_err() || failed {
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
                // The frame's place in the total goes back as the client takes it.
                let frame = ready!(frames.poll_recv(cx)).map(|(frame, _shared)| frame);
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http_body_util::StreamBody;

    use super::*;

    /// A body of `frames` frames of 1 KB.
    fn kilobytes(frames: usize) -> impl Body<Data = Bytes, Error = BoxError> + Unpin {
        StreamBody::new(futures_util::stream::iter(
            (0..frames).map(|_| Ok::<_, BoxError>(Frame::data(Bytes::from(vec![b'x'; 1024])))),
        ))
    }

    /// Responses read ahead no more than the total between them, whatever each one's own
    /// room; a frame's place comes back when its client takes it.
    #[tokio::test]
    async fn what_all_responses_read_ahead_is_bounded() {
        let total = Arc::new(Semaphore::new(4 * 1024));
        let read = |total: Arc<Semaphore>| {
            let (sender, frames) = mpsc::unbounded_channel();
            let budget = Arc::new(Semaphore::new(64 * 1024));
            let room = budget.clone();
            tokio::spawn(async move {
                read_within(&mut kilobytes(16), sender, room, 64 * 1024, &total).await;
            });
            (frames, budget)
        };
        // What `ReadAhead` does as its client takes a frame.
        let take = |(frames, budget): &mut (mpsc::UnboundedReceiver<Queued>, Arc<Semaphore>)| {
            let taken = frames.try_recv().expect("a frame");
            budget.add_permits(cost(&taken.0, 64 * 1024) as usize);
        };
        let settle = || tokio::time::sleep(Duration::from_millis(50));
        let a = read(total.clone());
        settle().await;
        assert_eq!(a.0.len(), 4, "A read up to the total");
        let mut b = read(total.clone());
        settle().await;
        assert_eq!(b.0.len(), 1, "B goes a frame at a time");
        take(&mut b);
        settle().await;
        assert_eq!(b.0.len(), 1, "B's next frame once its client took the last");
        drop(a);
        take(&mut b);
        settle().await;
        // The frame sent at its client's pace, then four read ahead within the total.
        assert_eq!(
            b.0.len(),
            5,
            "A's queued frames gave their place back when dropped"
        );
    }
}
