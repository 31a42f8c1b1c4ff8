//! Group commit for the Redis store: while a script call is in flight, the decisions
//! that arrive queue up, and the next call carries all of them (each still decided
//! atomically and all-or-nothing on its own by the script). There is no timer: an idle
//! gateway sends each decision at once, a busy one amortizes the round trip and the
//! script call over many requests.
//!
//! A busy gateway (the last call carried at least [`GATHER_AFTER`] requests) gathers
//! before a call with fewer than [`PIPELINE_MIN`] requests goes out: the dispatcher lets
//! the runtime run everything else that is ready and poll for I/O, up to
//! [`GATHER_TURNS`] times while more requests keep arriving, so that the requests read
//! in the same turn go in the same call instead of the next one: fewer, larger calls,
//! each of which costs Redis and the gateway a fixed overhead. A lightly loaded gateway
//! sends at once: there a turn brings few requests, and the wait would cost more than it
//! saves.
//!
//! A second call may go out, pipelined on the one connection, while the first is still
//! in flight, once [`PIPELINE_MIN`] requests wait for it: when Redis is the bottleneck it
//! then never sits idle while the gateway reads a reply and sends the next call, and when
//! it is not, calls stay large instead of splitting the same load into twice as many
//! (each call costs Redis and the gateway a fixed overhead). Redis runs the calls in the
//! order sent, each atomically.
//!
//! Each request carries its deadline, and the call that carries it must answer by the
//! earliest deadline in it: one timer per call, not one per request. A request never waits
//! longer than its own deadline, because the calls ahead of it end by deadlines earlier
//! than its own.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use thread_local::ThreadLocal;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::StoreError;
use crate::limit::{Decisions, LimitCheck};

/// Most requests one script call carries.
pub(crate) const MAX_BATCH: usize = 256;
/// Most script calls outstanding at once.
const IN_FLIGHT: usize = 2;
/// Fewest requests worth a call while another is in flight, or, when busy, without
/// first letting the runtime run what else is ready.
const PIPELINE_MIN: usize = 32;
/// Most runtime turns a call waits for more requests before it goes out.
const GATHER_TURNS: usize = 3;
/// Fewest requests in the last call for the next one to gather.
const GATHER_AFTER: usize = PIPELINE_MIN / 2;

/// One request's checks waiting for the next call.
pub(crate) struct Pending {
    pub checks: Vec<LimitCheck>,
    /// When the request stops waiting: it is answered by then, decided or not.
    pub deadline: Instant,
    pub reply: oneshot::Sender<Result<Decisions, StoreError>>,
}

/// Decides one batch by its deadline (the store's script call).
type Run = Arc<dyn Fn(Vec<Pending>, Instant) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// The queues in front of one store: one per thread, each in front of a dispatcher on
/// that thread's runtime, started by the thread's first request, so that a worker's
/// requests gather in its own runtime's turns as they would on a single thread
/// (`crate::workers`), and are answered there.
pub(crate) struct GroupCommit {
    queues: ThreadLocal<RefCell<mpsc::UnboundedSender<Pending>>>,
    run: Run,
    /// How long a request may wait for its decisions, queue and call together.
    timeout: Duration,
}

impl GroupCommit {
    /// A group commit whose dispatchers call `run(batch, deadline)` to decide one batch and
    /// answer every request in it by `deadline`, the earliest of theirs. A request still
    /// queued when its deadline passes is answered [`StoreError::Timeout`]. When the
    /// `GroupCommit` is dropped, each dispatcher decides what is queued and ends.
    pub(crate) fn start<F, Fut>(timeout: Duration, run: F) -> Self
    where
        F: Fn(Vec<Pending>, Instant) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        GroupCommit {
            queues: ThreadLocal::new(),
            run: Arc::new(move |batch, deadline| Box::pin(run(batch, deadline))),
            timeout,
        }
    }

    /// Queues `checks` for the next call and waits for its decisions, at most the timeout
    /// (the dispatcher answers every request by its deadline, or drops it, answered as not
    /// connected).
    pub(crate) async fn submit(&self, checks: &[LimitCheck]) -> Result<Decisions, StoreError> {
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            checks: checks.to_vec(),
            deadline: Instant::now() + self.timeout,
            reply,
        };
        let queue = self
            .queues
            .get_or(|| RefCell::new(dispatch(self.run.clone(), self.timeout)));
        let sent = queue.borrow().send(pending);
        if let Err(mpsc::error::SendError(pending)) = sent {
            // The dispatcher went with the runtime of a thread that has ended, whose
            // identity this one now has.
            let fresh = dispatch(self.run.clone(), self.timeout);
            fresh.send(pending).map_err(|_| StoreError::NotConnected)?;
            *queue.borrow_mut() = fresh;
        }
        answer.await.unwrap_or(Err(StoreError::NotConnected))
    }
}

/// Starts a dispatcher on this thread's runtime; it ends once its queue is dropped and
/// what was queued is decided.
fn dispatch(run: Run, timeout: Duration) -> mpsc::UnboundedSender<Pending> {
    let (queue, mut waiting) = mpsc::unbounded_channel::<Pending>();
    tokio::spawn(async move {
        let mut in_flight = FuturesUnordered::new();
        let mut batch: Vec<Pending> = Vec::new();
        let mut open = true;
        // Requests in the last call sent.
        let mut last_call = 0;
        loop {
            let worth_a_call =
                in_flight.is_empty() || (in_flight.len() < IN_FLIGHT && batch.len() >= PIPELINE_MIN);
            if !batch.is_empty() && worth_a_call {
                let busy = last_call >= GATHER_AFTER;
                if busy && in_flight.is_empty() && batch.len() < PIPELINE_MIN {
                    gather(&mut waiting, &mut batch).await;
                }
                // A request that gave up, or whose deadline passed while it waited, is
                // not decided: it must not consume anything.
                let now = Instant::now();
                let gone = |pending: &mut Pending| pending.reply.is_closed() || pending.deadline <= now;
                for pending in batch.extract_if(.., gone) {
                    let _ = pending.reply.send(Err(StoreError::Timeout(timeout)));
                }
                if let Some(deadline) = batch.iter().map(|pending| pending.deadline).min() {
                    last_call = batch.len();
                    in_flight.push(run(std::mem::take(&mut batch), deadline));
                }
                continue;
            }
            tokio::select! {
                Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
                next = waiting.recv(), if open && batch.len() < MAX_BATCH => match next {
                    Some(first) => {
                        batch.push(first);
                        take_waiting(&mut waiting, &mut batch);
                    }
                    None => open = false,
                },
                else => return,
            }
        }
    });
    queue
}

/// Moves the requests already queued into `batch`, up to [`MAX_BATCH`].
fn take_waiting(waiting: &mut mpsc::UnboundedReceiver<Pending>, batch: &mut Vec<Pending>) {
    while batch.len() < MAX_BATCH {
        match waiting.try_recv() {
            Ok(pending) => batch.push(pending),
            Err(_) => break,
        }
    }
}

/// Lets the runtime run the other tasks that are ready and poll for I/O, then takes the
/// requests they queued; again while that brought more, up to [`GATHER_TURNS`] turns or
/// [`PIPELINE_MIN`] requests.
async fn gather(waiting: &mut mpsc::UnboundedReceiver<Pending>, batch: &mut Vec<Pending>) {
    for _ in 0..GATHER_TURNS {
        let before = batch.len();
        tokio::task::yield_now().await;
        take_waiting(waiting, batch);
        if batch.len() == before || batch.len() >= PIPELINE_MIN {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tokio::io::AsyncReadExt;
    use tokio::net::UnixStream;
    use tokio::sync::Semaphore;
    use tokio::task::JoinHandle;

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

    /// A group commit whose calls record their batch sizes, then each wait for a permit
    /// from the semaphore to answer.
    struct HeldCalls {
        commit: Arc<GroupCommit>,
        batches: Arc<Mutex<Vec<usize>>>,
        release: Arc<Semaphore>,
    }

    impl HeldCalls {
        fn start(timeout: Duration) -> Self {
            let batches = Arc::new(Mutex::new(Vec::new()));
            let release = Arc::new(Semaphore::new(0));
            let commit = Arc::new(GroupCommit::start(timeout, {
                let (batches, release) = (batches.clone(), release.clone());
                move |batch: Vec<Pending>, _deadline| {
                    let (batches, release) = (batches.clone(), release.clone());
                    async move {
                        batches.lock().unwrap().push(batch.len());
                        release.acquire().await.unwrap().forget();
                        for pending in batch {
                            let _ = pending.reply.send(Ok(Decisions::new()));
                        }
                    }
                }
            }));
            HeldCalls {
                commit,
                batches,
                release,
            }
        }

        /// `n` requests (of no checks), each in its own task.
        fn submit(&self, n: usize) -> Vec<JoinHandle<Result<Decisions, StoreError>>> {
            (0..n)
                .map(|_| {
                    let commit = self.commit.clone();
                    tokio::spawn(async move { commit.submit(&[]).await })
                })
                .collect()
        }

        /// `now` requests queued in this turn of the runtime and `next` in the next one,
        /// each in its own task: one byte waits on a socket for each of the `next`, read
        /// when the runtime next polls for I/O, as a request's head would be.
        fn submit_over_two_turns(
            &self,
            now: usize,
            next: usize,
        ) -> Vec<JoinHandle<Result<Decisions, StoreError>>> {
            let mut requests: Vec<_> = (0..next)
                .map(|_| {
                    let (mut reader, writer) = UnixStream::pair().unwrap();
                    writer.try_write(b"x").unwrap();
                    let commit = self.commit.clone();
                    tokio::spawn(async move {
                        reader.read_exact(&mut [0]).await.unwrap();
                        drop(writer);
                        commit.submit(&[]).await
                    })
                })
                .collect();
            requests.extend(self.submit(now));
            requests
        }

        /// The sizes of the batches called so far.
        fn calls(&self) -> Vec<usize> {
            self.batches.lock().unwrap().clone()
        }
    }

    #[tokio::test]
    async fn a_second_call_goes_out_only_with_a_full_pipelined_batch() {
        let held = HeldCalls::start(Duration::from_secs(5));
        let calls = || held.calls();

        // An idle store sends the first request at once.
        let mut requests = held.submit(1);
        until(|| calls() == [1]).await;
        // While it is in flight, too few waiting requests do not make a second call...
        requests.extend(held.submit(PIPELINE_MIN - 1));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(calls(), [1]);
        // ...enough do.
        requests.extend(held.submit(1));
        until(|| calls() == [1, PIPELINE_MIN]).await;
        // Both in flight: more requests wait for a call to come back, then go together.
        requests.extend(held.submit(PIPELINE_MIN + 3));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            calls(),
            [1, PIPELINE_MIN],
            "no third call while two are in flight"
        );
        held.release.add_permits(1);
        until(|| calls() == [1, PIPELINE_MIN, PIPELINE_MIN + 3]).await;
        held.release.add_permits(2);
        for request in requests {
            assert!(request.await.unwrap().is_ok());
        }
    }

    #[tokio::test]
    async fn only_a_busy_store_waits_for_the_next_turn_s_requests() {
        let held = HeldCalls::start(Duration::from_secs(5));
        let calls = || held.calls();

        // Lightly loaded: what this turn queued goes at once, the next turn's requests
        // in the next call.
        let mut requests = held.submit_over_two_turns(1, 4);
        until(|| calls().len() == 1).await;
        assert_eq!(calls(), [1], "a lightly loaded store sends at once");
        held.release.add_permits(1);
        until(|| calls().len() == 2).await;
        assert_eq!(calls(), [1, 4]);
        held.release.add_permits(1);
        // A call of GATHER_AFTER requests...
        requests.extend(held.submit(GATHER_AFTER));
        until(|| calls().len() == 3).await;
        assert_eq!(calls(), [1, 4, GATHER_AFTER]);
        held.release.add_permits(1);
        for request in requests.drain(..) {
            assert!(request.await.unwrap().is_ok());
        }
        // ...and the next one takes the next turn's requests too.
        requests.extend(held.submit_over_two_turns(1, 4));
        until(|| calls().len() == 4).await;
        assert_eq!(calls(), [1, 4, GATHER_AFTER, 5], "a busy store gathers");
        held.release.add_permits(2);
        for request in requests {
            assert!(request.await.unwrap().is_ok());
        }
    }

    #[tokio::test]
    async fn a_request_whose_deadline_passes_in_the_queue_is_answered_without_a_call() {
        let held = HeldCalls::start(Duration::from_millis(50));
        let first = held.submit(1).remove(0);
        until(|| held.calls() == [1]).await;
        let queued = held.submit(1).remove(0);
        // The queued request's 50 ms pass while the first call is held. (Two permits: a
        // call wrongly made for it would answer too, rather than hang the test.)
        tokio::time::sleep(Duration::from_millis(100)).await;
        held.release.add_permits(2);
        assert!(first.await.unwrap().is_ok());
        assert!(matches!(queued.await.unwrap(), Err(StoreError::Timeout(_))));
        assert_eq!(held.calls(), [1], "no call for the expired request");
    }

    #[tokio::test]
    async fn requests_queued_when_the_store_is_dropped_are_still_decided() {
        let commit = GroupCommit::start(
            Duration::from_secs(5),
            |batch: Vec<Pending>, _deadline| async move {
                for pending in batch {
                    let _ = pending.reply.send(Ok(Decisions::new()));
                }
            },
        );
        let (reply, answer) = oneshot::channel();
        commit
            .queues
            .get_or(|| RefCell::new(dispatch(commit.run.clone(), commit.timeout)))
            .borrow()
            .send(Pending {
                checks: Vec::new(),
                deadline: Instant::now() + Duration::from_secs(5),
                reply,
            })
            .unwrap();
        drop(commit);
        let decided = tokio::time::timeout(Duration::from_secs(5), answer).await;
        assert!(matches!(decided, Ok(Ok(Ok(_)))));
    }

    #[test]
    fn each_threads_requests_are_gathered_and_called_on_that_thread() {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let commit = Arc::new(GroupCommit::start(Duration::from_secs(5), {
            let calls = calls.clone();
            move |batch: Vec<Pending>, _deadline| {
                let thread = std::thread::current().name().map(str::to_owned);
                calls
                    .lock()
                    .unwrap()
                    .push((thread.unwrap_or_default(), batch.len()));
                async move {
                    for pending in batch {
                        let _ = pending.reply.send(Ok(Decisions::new()));
                    }
                }
            }
        }));
        let threads: Vec<_> = [("a", 3), ("b", 2)]
            .into_iter()
            .map(|(name, requests)| {
                let commit = commit.clone();
                std::thread::Builder::new()
                    .name(name.to_owned())
                    .spawn(move || {
                        let runtime = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .unwrap();
                        runtime.block_on(async {
                            let submitted = (0..requests).map(|_| commit.submit(&[]));
                            for decided in futures_util::future::join_all(submitted).await {
                                assert!(decided.is_ok());
                            }
                        });
                    })
                    .unwrap()
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let mut calls = calls.lock().unwrap().clone();
        calls.sort();
        assert_eq!(calls, [("a".to_owned(), 3), ("b".to_owned(), 2)]);
    }
}
