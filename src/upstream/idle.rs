//! The idle connections of one upstream server, whatever they speak (HTTP/1.1 or
//! FastCGI). The most recently used is taken first, so a busy gateway keeps only the
//! connections its concurrency needs; one idle for the idle timeout is closed then, by a
//! task that runs while connections are idle and wakes when the oldest is due, so that
//! neither requests on the newer ones nor the lack of any request keep it open.
//!
//! Each thread has its own idle connections: a connection registered with one worker's
//! runtime is waited on by that runtime, so a request served by another worker would take
//! each of its wake-ups from a second thread (`crate::workers`).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use thread_local::ThreadLocal;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// A connection to a server: its stream, what was read on it and not yet used, and the
/// timer for the response head of the request on it. The timer is moved to each
/// request's deadline: moving a timer costs next to nothing, where one made per request
/// is registered with the runtime and removed again each time.
pub(crate) struct Connection<S> {
    pub(super) stream: S,
    pub(super) read: BytesMut,
    pub(super) deadline: Pin<Box<Sleep>>,
}

impl<S: AsyncRead + Unpin + Send> IdlePool<Connection<S>> {
    /// The most recently used pooled connection the server has not closed, its timer
    /// moved to `deadline` (with `true`: reused), or else a new one from `connect`
    /// (`false`); `Err(None)` when none could be made before `deadline`.
    pub(super) async fn take_or_connect<F, E>(
        &self,
        deadline: tokio::time::Instant,
        connect: impl FnOnce() -> F,
    ) -> Result<(Connection<S>, bool), Option<E>>
    where
        F: Future<Output = Result<Connection<S>, E>>,
    {
        if let Some(mut connection) = self.checkout(|connection| !connection.closed_while_idle()) {
            connection.deadline.as_mut().reset(deadline);
            return Ok((connection, true));
        }
        // Boxed: a connect (with TLS, a few KB) is rare beside a pooled connection, and
        // would otherwise be nested in every request's future.
        match Box::pin(tokio::time::timeout_at(deadline, connect())).await {
            Ok(Ok(connection)) => Ok((connection, false)),
            Ok(Err(error)) => Err(Some(error)),
            Err(_elapsed) => Err(None),
        }
    }
}

/// Read as a byte stream (a tunnel's, after a protocol switch): what was read on it and
/// not yet used comes first.
impl<S: AsyncRead + Unpin> AsyncRead for Connection<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.read.is_empty() {
            return Pin::new(&mut self.stream).poll_read(cx, buf);
        }
        let n = self.read.len().min(buf.remaining());
        buf.put_slice(&self.read.split_to(n));
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Connection<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + Unpin> Connection<S> {
    /// `stream`, its timer set for `deadline`.
    pub(super) fn new(stream: S, deadline: tokio::time::Instant) -> Self {
        Connection {
            stream,
            read: BytesMut::new(),
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
        }
    }

    /// Whether the server closed the idle connection (or sent on it unasked).
    pub(super) fn closed_while_idle(&mut self) -> bool {
        let mut probe = [0u8; 1];
        let mut buffer = ReadBuf::new(&mut probe);
        let mut cx = Context::from_waker(Waker::noop());
        !matches!(
            Pin::new(&mut self.stream).poll_read(&mut cx, &mut buffer),
            Poll::Pending
        )
    }
}

struct Idle<C> {
    connection: C,
    since: Instant,
}

struct IdleList<C> {
    /// Most recently used last, so idle longest first.
    connections: Vec<Idle<C>>,
    /// Whether a [`sweep`] task is running; it ends once no connection is idle.
    swept: bool,
}

/// One thread's idle connections, shared with the sweep that closes them.
type SharedList<C> = Arc<Mutex<IdleList<C>>>;

fn lock<C>(list: &Mutex<IdleList<C>>) -> MutexGuard<'_, IdleList<C>> {
    list.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Idle connections of type `C`, each kept at most `timeout`, at most `max` of them on
/// each thread.
pub(super) struct IdlePool<C: Send> {
    timeout: Duration,
    max: usize,
    lists: ThreadLocal<SharedList<C>>,
}

impl<C: Send> IdlePool<C> {
    pub(super) fn new(timeout: Duration, max: usize) -> Self {
        IdlePool {
            timeout,
            max,
            lists: ThreadLocal::new(),
        }
    }

    /// This thread's idle connections.
    fn list(&self) -> &SharedList<C> {
        self.lists.get_or(|| {
            Arc::new(Mutex::new(IdleList {
                connections: Vec::new(),
                swept: false,
            }))
        })
    }

    /// The most recently used of this thread's connections for which `usable` holds, or
    /// else another thread's, so that no connection is made while one is idle (a PHP-FPM
    /// child stays with its connection while that is open: an idle one would hold a child
    /// that a new connection then waited for); the others found on the way are closed
    /// (dropped).
    pub(super) fn checkout(&self, mut usable: impl FnMut(&mut C) -> bool) -> Option<C> {
        let own = self.list();
        take_usable(own, &mut usable).or_else(|| {
            self.lists
                .iter()
                .filter(|list| !Arc::ptr_eq(list, own))
                .find_map(|list| take_usable(list, &mut usable))
        })
    }
}

/// The most recently used connection of `list` for which `usable` holds; the others found
/// on the way are closed (dropped).
fn take_usable<C>(list: &Mutex<IdleList<C>>, usable: &mut impl FnMut(&mut C) -> bool) -> Option<C> {
    let mut list = lock(list);
    while let Some(mut idle) = list.connections.pop() {
        if usable(&mut idle.connection) {
            return Some(idle.connection);
        }
    }
    None
}

impl<C: Send + 'static> IdlePool<C> {
    /// Keeps `connection` for the next request; the one idle longest goes when `max` are.
    pub(super) fn check_in(self: &Arc<Self>, connection: C) {
        if self.max == 0 {
            return;
        }
        let shared = self.list();
        let start_sweep = {
            let mut list = lock(shared);
            if list.connections.len() >= self.max {
                list.connections.remove(0);
            }
            list.connections.push(Idle {
                connection,
                since: Instant::now(),
            });
            !std::mem::replace(&mut list.swept, true)
        };
        // Without a runtime (it is shutting down) no connection is used again either.
        if start_sweep && let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(sweep(Arc::downgrade(shared), self.timeout));
        }
    }
}

/// Closes the connections of `list` as each has been idle for `limit`, sleeping until the
/// oldest is due; ends when none is idle (the next check-in starts another) or the pool
/// is gone.
async fn sweep<C>(list: Weak<Mutex<IdleList<C>>>, limit: Duration) {
    loop {
        let due = {
            let Some(list) = list.upgrade() else {
                return;
            };
            let mut list = lock(&list);
            let now = Instant::now();
            let expired = list
                .connections
                .partition_point(|idle| now.duration_since(idle.since) >= limit);
            list.connections.drain(..expired);
            match list.connections.first() {
                Some(oldest) => oldest.since + limit,
                None => {
                    list.swept = false;
                    return;
                }
            }
        };
        tokio::time::sleep_until(due.into()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_newest_is_taken_first_the_oldest_goes_past_max_and_idle_ones_close() {
        let pool = Arc::new(IdlePool::new(Duration::from_millis(100), 2));
        for connection in [1, 2, 3] {
            pool.check_in(connection);
        }
        // At most two kept: the first went; the newest comes out first.
        assert_eq!(pool.checkout(|_| true), Some(3));
        assert_eq!(pool.checkout(|_| true), Some(2));
        assert_eq!(pool.checkout(|_| true), None);

        // An unusable one found on the way is closed, not kept.
        pool.check_in(4);
        pool.check_in(5);
        assert_eq!(pool.checkout(|c| *c == 4), Some(4));
        assert_eq!(pool.checkout(|_| true), None);

        // Idle past the timeout: closed by the sweep, without any request coming.
        pool.check_in(6);
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(lock(pool.list()).connections.is_empty());
        assert!(!lock(pool.list()).swept, "the sweep ends once nothing is idle");
        assert_eq!(pool.checkout(|_| true), None);
    }

    #[test]
    fn a_thread_takes_its_own_connections_first_then_another_threads() {
        let pool = Arc::new(IdlePool::new(Duration::from_secs(60), 4));
        pool.check_in(1);
        let other = pool.clone();
        std::thread::spawn(move || {
            other.check_in(2);
            other.check_in(3);
        })
        .join()
        .unwrap();
        // This thread's, though another thread's are newer.
        assert_eq!(pool.checkout(|_| true), Some(1));
        // None of its own left: another thread's, the most recently used first.
        assert_eq!(pool.checkout(|_| true), Some(3));
        assert_eq!(pool.checkout(|_| true), Some(2));
        assert_eq!(pool.checkout(|_| true), None);
    }
}
