//! Worker threads (`server.workers` other than 1): each runs a single-threaded runtime and
//! serves the client connections handed to it from start to end, so that a connection's
//! requests, their timers and the pooled upstream connections they use stay on one thread,
//! without the cross-thread wake-ups and work-stealing bookkeeping of tokio's multi-thread
//! runtime (docs/performance.md, "Workers"). The thread that accepts connections hands
//! each to the worker with the fewest open.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long a stopping worker waits for blocking tasks it started (a spooled body's
/// temporary file being created) before its thread ends anyway.
const BLOCKING_GRACE: Duration = Duration::from_secs(1);

/// Running worker threads; dropping this stops them, dropping the connections they still
/// serve, and waits for them to end.
pub(crate) struct Workers {
    workers: Vec<Worker>,
    /// Where the search for the least busy worker starts, moved on at each connection so
    /// that ties go round.
    next: AtomicUsize,
    stop: CancellationToken,
    threads: Vec<JoinHandle<()>>,
}

struct Worker {
    runtime: Handle,
    /// Connections the worker serves.
    open: Arc<AtomicUsize>,
}

impl Workers {
    /// Starts `count` worker threads, named `worker-0`, `worker-1`, ...
    pub(crate) fn start(count: usize) -> io::Result<Workers> {
        let stop = CancellationToken::new();
        let mut workers = Vec::with_capacity(count);
        let mut threads = Vec::with_capacity(count);
        for index in 0..count {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            workers.push(Worker {
                runtime: runtime.handle().clone(),
                open: Arc::default(),
            });
            let stopped = stop.clone();
            let thread = std::thread::Builder::new()
                .name(format!("worker-{index}"))
                .spawn(move || {
                    runtime.block_on(stopped.cancelled());
                    runtime.shutdown_timeout(BLOCKING_GRACE);
                });
            match thread {
                Ok(thread) => threads.push(thread),
                Err(error) => {
                    // Those started stop with the partial set, dropped here.
                    drop(Workers {
                        workers,
                        next: AtomicUsize::new(0),
                        stop,
                        threads,
                    });
                    return Err(error);
                }
            }
        }
        Ok(Workers {
            workers,
            next: AtomicUsize::new(0),
            stop,
            threads,
        })
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
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// One connection counted as open on a worker while it lives.
struct Open(Arc<AtomicUsize>);

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
                let name = std::thread::current().name().map(str::to_owned);
                let _ = names_sent.send(name.clone());
                let _ = released.wait_for(|released| *released).await;
                assert_eq!(std::thread::current().name().map(str::to_owned), name);
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
}
