//! Group commit for the Redis store: while script calls are in flight, the decisions
//! that arrive queue up, and the next call carries all of them (each still decided
//! atomically and all-or-nothing on its own by the script). There is no timer: an idle
//! gateway sends each decision at once, a busy one amortizes the round trip and the
//! script call over many requests.
//!
//! Up to [`IN_FLIGHT`] calls are outstanding at once, pipelined on the one connection:
//! while Redis runs one batch, the next is already on its way, so Redis does not sit idle
//! while the gateway reads a reply and sends the next call. Redis runs them in the order
//! sent, each atomically.

use std::future::Future;
use std::time::Duration;

use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc, oneshot};

use super::redis::StoreError;
use super::{LimitCheck, LimitDecision};

/// Most requests one script call carries.
pub(crate) const MAX_BATCH: usize = 256;
/// Most script calls outstanding at once.
pub(crate) const IN_FLIGHT: usize = 2;

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
    /// The dispatcher ends when the `GroupCommit` is dropped; calls under way finish.
    pub(crate) fn start<F, Fut>(run: F) -> Self
    where
        F: Fn(Vec<Pending>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (queue, mut waiting) = mpsc::unbounded_channel::<Pending>();
        let slots = Arc::new(Semaphore::new(IN_FLIGHT));
        tokio::spawn(async move {
            loop {
                // Requests queue up while every slot is busy: that is what fills a batch.
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let Some(first) = waiting.recv().await else {
                    return;
                };
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
                    let call = run(batch);
                    tokio::spawn(async move {
                        call.await;
                        drop(slot);
                    });
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// Waits (bounded) until `condition` holds.
    async fn until(condition: impl Fn() -> bool) {
        tokio::time::timeout(Duration::from_secs(5), async {
            while !condition() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the condition came true");
    }

    #[tokio::test]
    async fn two_calls_are_in_flight_at_once_and_the_rest_queue_into_the_next() {
        // Each call records its batch size, then waits for a permit to answer.
        let batches = Arc::new(Mutex::new(Vec::new()));
        let release = Arc::new(Semaphore::new(0));
        let commit = Arc::new(GroupCommit::start({
            let (batches, release) = (batches.clone(), release.clone());
            move |batch: Vec<Pending>| {
                let (batches, release) = (batches.clone(), release.clone());
                async move {
                    batches.lock().unwrap().push(batch.len());
                    release.acquire().await.unwrap().forget();
                    for pending in batch {
                        let _ = pending.reply.send(Ok(Vec::new()));
                    }
                }
            }
        }));
        let submit = || {
            let commit = commit.clone();
            tokio::spawn(async move { commit.submit(&[], Duration::from_secs(5)).await })
        };
        let calls = || batches.lock().unwrap().clone();

        let first = submit();
        until(|| calls() == [1]).await;
        let second = submit();
        until(|| calls() == [1, 1]).await;
        // Both slots busy: these two wait, and go together in one call.
        let (third, fourth) = (submit(), submit());
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(calls(), [1, 1], "no third call while two are in flight");
        release.add_permits(1);
        until(|| calls() == [1, 1, 2]).await;
        release.add_permits(2);
        for request in [first, second, third, fourth] {
            assert!(request.await.unwrap().is_ok());
        }
    }
}
