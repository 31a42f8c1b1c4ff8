//! Worker threads (`server.workers` other than 1): each runs a single-threaded runtime and
//! serves the client connections handed to it from start to end, so that a connection's
//! requests, their timers and the pooled upstream connections they use stay on one thread,
//! without the cross-thread wake-ups and work-stealing bookkeeping of tokio's multi-thread
//! runtime (docs/performance.md, "Workers"). The thread that accepts connections hands
//! each to the worker with the fewest open.

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long a stopping worker waits for blocking tasks it started (a spooled body's
/// temporary file being created) before its thread ends anyway.
const BLOCKING_GRACE: Duration = Duration::from_secs(1);

/// Running worker threads; dropping this stops them, dropping the connections they still
/// serve, and waits for them to end (a blocking wait: drop it off the runtime's threads).
pub(crate) struct Workers {
    workers: Vec<Worker>,
    /// Where the search for the least busy worker starts, moved on at each connection so
    /// that ties go round.
    next: AtomicUsize,
    stop: CancellationToken,
    stopping: Arc<Stopping>,
    threads: Vec<JoinHandle<()>>,
}

/// How long a stopping worker waits for the others between looks at whether one of
/// them ended without saying so.
const STOPPING_LOOK: Duration = Duration::from_millis(50);

/// The two steps of stopping: every worker leaves its runtime's loop, and only once all
/// have does any shut its runtime down (dropping the tasks it still has). A task on one
/// worker may be using another's timers, sockets or Redis connection, which fail, or
/// panic, once that runtime is gone.
#[derive(Default)]
struct Stopping {
    /// Workers out of their loop, and whether their runtimes may shut down.
    state: Mutex<(usize, bool)>,
    changed: Condvar,
}

impl Stopping {
    fn state(&self) -> std::sync::MutexGuard<'_, (usize, bool)> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A worker is out of its loop; returns when every runtime may shut down.
    fn left_loop(&self) {
        let mut state = self.state();
        state.0 += 1;
        self.changed.notify_all();
        while !state.1 {
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    /// Lets the runtimes shut down once every one of `threads` is out of its loop (or
    /// ended: a worker that failed to start never entered it).
    fn release(&self, threads: &[JoinHandle<()>]) {
        let mut state = self.state();
        loop {
            let ended = threads.iter().filter(|thread| thread.is_finished()).count();
            if state.0 + ended >= threads.len() {
                break;
            }
            state = self
                .changed
                .wait_timeout(state, STOPPING_LOOK)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
        state.1 = true;
        self.changed.notify_all();
    }
}

struct Worker {
    runtime: Handle,
    /// Connections the worker serves.
    open: Arc<AtomicUsize>,
}

impl Workers {
    /// Starts `count` worker threads, named `worker-0`, `worker-1`, ...; on failure,
    /// those already started are stopped.
    pub(crate) fn start(count: usize) -> io::Result<Workers> {
        let mut workers = Workers {
            workers: Vec::with_capacity(count),
            next: AtomicUsize::new(0),
            stop: CancellationToken::new(),
            stopping: Arc::default(),
            threads: Vec::with_capacity(count),
        };
        for index in 0..count {
            let (started, runtime) = std::sync::mpsc::channel();
            let stopped = workers.stop.clone();
            let stopping = workers.stopping.clone();
            let open = Arc::<AtomicUsize>::default();
            // The runtime is made, run and dropped on its own thread: a runtime dropped on
            // the caller's (a thread that failed to start would drop it there) would be
            // dropped inside the caller's runtime, which panics.
            let thread = std::thread::Builder::new()
                .name(format!("worker-{index}"))
                .spawn(move || {
                    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                        Ok(runtime) => runtime,
                        Err(e) => {
                            let _ = started.send(Err(e));
                            return;
                        }
                    };
                    let _ = started.send(Ok(runtime.handle().clone()));
                    runtime.block_on(stopped.cancelled());
                    stopping.left_loop();
                    runtime.shutdown_timeout(BLOCKING_GRACE);
                })?;
            workers.threads.push(thread);
            let runtime = runtime
                .recv()
                .map_err(|_| io::Error::other("a worker thread ended while starting"))??;
            workers.workers.push(Worker { runtime, open });
        }
        Ok(workers)
    }

    pub(crate) fn count(&self) -> usize {
        self.workers.len()
    }

    /// Runs `connection` to its end on the worker with the fewest connections open, as a
    /// task of `tracker`.
    pub(crate) fn spawn<F>(&self, tracker: &TaskTracker, connection: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let worker = self.least_busy();
        let open = Open::count(&worker.open);
        tracker.spawn_on(
            async move {
                let _open = open;
                connection.await;
            },
            &worker.runtime,
        );
    }

    fn least_busy(&self) -> &Worker {
        let count = self.workers.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % count;
        (start..start + count)
            .map(|i| &self.workers[i % count])
            .min_by_key(|worker| worker.open.load(Ordering::Relaxed))
            .expect("at least one worker")
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop.cancel();
        self.stopping.release(&self.threads);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// One connection counted as open on a worker while it lives.
pub(crate) struct Open(Arc<AtomicUsize>);

impl Open {
    fn count(open: &Arc<AtomicUsize>) -> Open {
        open.fetch_add(1, Ordering::Relaxed);
        Open(open.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn connections_go_to_the_least_busy_worker_and_each_runs_on_one_thread() {
        let workers = Workers::start(3).unwrap();
        let tracker = TaskTracker::new();
        let (release, released) = tokio::sync::watch::channel(false);
        let (names_sent, mut names) = tokio::sync::mpsc::unbounded_channel();
        // Six long connections: two on each worker, whatever the order of ties.
        for _ in 0..6 {
            let mut released = released.clone();
            let names_sent = names_sent.clone();
            workers.spawn(&tracker, async move {
                let name = || std::thread::current().name().map(str::to_owned);
                let started_on = name();
                let _ = names_sent.send(started_on.clone());
                let _ = released.wait_for(|released| *released).await;
                // Still on the same thread: reported, since a panic here would end only
                // this task.
                let _ = names_sent.send(if name() == started_on { started_on } else { None });
            });
        }
        let mut seen = Vec::new();
        for _ in 0..6 {
            seen.push(names.recv().await.unwrap().unwrap());
        }
        seen.sort();
        assert_eq!(
            seen,
            [
                "worker-0", "worker-0", "worker-1", "worker-1", "worker-2", "worker-2"
            ]
        );
        let open: Vec<usize> = workers
            .workers
            .iter()
            .map(|worker| worker.open.load(Ordering::Relaxed))
            .collect();
        assert_eq!(open, [2, 2, 2]);
        release.send(true).unwrap();
        tracker.close();
        tracker.wait().await;
        drop(names_sent);
        let mut ended_on = Vec::new();
        while let Some(name) = names.recv().await {
            ended_on.push(name.expect("each connection ends on the thread it began on"));
        }
        ended_on.sort();
        assert_eq!(ended_on, seen);
        assert!(
            workers
                .workers
                .iter()
                .all(|worker| worker.open.load(Ordering::Relaxed) == 0)
        );
    }

    #[tokio::test]
    async fn dropping_the_workers_ends_their_threads_and_drops_what_they_still_serve() {
        let workers = Workers::start(2).unwrap();
        let tracker = TaskTracker::new();
        let (dropped_sent, dropped) = std::sync::mpsc::channel::<()>();
        workers.spawn(&tracker, async move {
            let _dropped = dropped_sent;
            std::future::pending::<()>().await;
        });
        tokio::task::spawn_blocking(move || drop(workers)).await.unwrap();
        // The sender went with the dropped connection: nothing is left to receive from.
        assert!(dropped.recv().is_err());
    }

    #[test]
    fn no_runtime_shuts_down_before_every_worker_has_left_its_loop() {
        let stopping = Arc::new(Stopping::default());
        let (events_sent, events) = std::sync::mpsc::channel();
        let quick = std::thread::spawn({
            let (stopping, events_sent) = (stopping.clone(), events_sent.clone());
            move || {
                stopping.left_loop();
                events_sent.send("quick shuts down").unwrap();
            }
        });
        let slow = std::thread::spawn({
            let stopping = stopping.clone();
            move || {
                // Still running a task when the other is out of its loop.
                std::thread::sleep(Duration::from_millis(100));
                events_sent.send("slow leaves its loop").unwrap();
                stopping.left_loop();
            }
        });
        let threads = [quick, slow];
        stopping.release(&threads);
        for thread in threads {
            thread.join().unwrap();
        }
        let order: Vec<_> = events.iter().collect();
        assert_eq!(order, ["slow leaves its loop", "quick shuts down"]);
    }

    #[test]
    fn a_worker_that_ended_without_leaving_its_loop_is_not_waited_for() {
        let stopping = Stopping::default();
        let ended = std::thread::spawn(|| {});
        while !ended.is_finished() {
            std::thread::yield_now();
        }
        stopping.release(&[ended]);
        assert!(stopping.state().1);
    }
}
