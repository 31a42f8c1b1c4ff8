//! Group commit for the Redis store: while one script call is in flight, the decisions
//! that arrive queue up, and the next call carries all of them (each still decided
//! atomically and all-or-nothing on its own by the script). There is no timer: an idle
//! gateway sends each decision at once, a busy one amortizes the round trip and the
//! script call over many requests.

use std::future::Future;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::redis::StoreError;
use super::{LimitCheck, LimitDecision};

/// Most requests one script call carries.
pub(crate) const MAX_BATCH: usize = 256;

/// One request's checks waiting for the next call.
pub(crate) struct Pending {
    pub checks: Vec<LimitCheck>,
    pub reply: oneshot::Sender<Result<Vec<LimitDecision>, StoreError>>,
}

/// The queue in front of one store.
pub(crate) struct GroupCommit {
    queue: mpsc::UnboundedSender<Pending>,
}

impl GroupCommit {
    /// Starts the dispatcher: `run` decides one batch and answers every request in it.
    /// The dispatcher ends when the `GroupCommit` is dropped.
    pub(crate) fn start<F, Fut>(run: F) -> Self
    where
        F: Fn(Vec<Pending>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send,
    {
        let (queue, mut waiting) = mpsc::unbounded_channel::<Pending>();
        tokio::spawn(async move {
            while let Some(first) = waiting.recv().await {
                let mut batch = vec![first];
                while batch.len() < MAX_BATCH {
                    match waiting.try_recv() {
                        Ok(next) => batch.push(next),
                        Err(_) => break,
                    }
                }
                // A request that gave up (its deadline passed) is not decided: it must not
                // consume anything.
                batch.retain(|pending| !pending.reply.is_closed());
                if !batch.is_empty() {
                    run(batch).await;
                }
            }
        });
        GroupCommit { queue }
    }

    /// Queues `checks` for the next call and waits for its decisions, at most `deadline`.
    pub(crate) async fn submit(
        &self,
        checks: &[LimitCheck],
        deadline: Duration,
    ) -> Result<Vec<LimitDecision>, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Pending {
                checks: checks.to_vec(),
                reply,
            })
            .map_err(|_| StoreError::NotConnected)?;
        match tokio::time::timeout(deadline, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(StoreError::NotConnected),
            Err(_) => Err(StoreError::Timeout(deadline)),
        }
    }
}
