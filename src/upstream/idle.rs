//! The idle connections of one upstream server, whatever they speak (HTTP/1.1 or
//! FastCGI). The most recently used is taken first, so a busy gateway keeps only the
//! connections its concurrency needs; one idle for the idle timeout is closed then, by a
//! task that runs while connections are idle and wakes when the oldest is due, so that
//! neither requests on the newer ones nor the lack of any request keep it open.
//!
//! Each thread has its own idle connections: a connection registered with one worker's
//! runtime is waited on by that runtime, so a request served by another worker would take
//! each of its wake-ups from a second thread (`crate::workers`). A thread with none takes
//! another thread's rather than connect while one is idle, and gives it back to that
//! thread's list after its request.
//!
//! The pool also holds its server's requests waiting for a place among the process's
//! connection places (`places`), first come first served: while only they wait, a
//! connection done with its request is handed straight to the first of them
//! ([`Returns`]); otherwise it closes and its place goes to the first in line.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use thread_local::ThreadLocal;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;
use tokio::time::Sleep;

use super::places::{CloseIdle, ConnectionPlaces, Place};

/// How a request with no idle connection to its server gets one: a place among the
/// pool's places within `timeout` (the server's connect timeout), then `open` with the
/// place, when the timeout is up (the connection must be open by then) and the try's
/// deadline.
pub(super) struct Opener<O> {
    pub(super) timeout: Duration,
    pub(super) open: O,
}

/// Opens a connection to a server in a place: given the place, when the connect timeout
/// is up and the try's deadline.
pub(super) trait Open<S, E>:
    Fn(Place, tokio::time::Instant, tokio::time::Instant) -> Self::Opened
{
    type Opened: Future<Output = Result<Connection<S>, E>>;
}

impl<S, E, O, F> Open<S, E> for O
where
    O: Fn(Place, tokio::time::Instant, tokio::time::Instant) -> F,
    F: Future<Output = Result<Connection<S>, E>>,
{
    type Opened = F;
}

/// The errors a try gets from its pool rather than from its server.
pub(super) trait PoolError {
    /// No place for a new connection within the connect timeout.
    fn no_place() -> Self;
    /// The try's deadline passed.
    fn timed_out() -> Self;
}

/// A connection to a server: its stream, what was read on it and not yet used, and the
/// timer for the response head of the request on it. The timer is moved to each
/// request's deadline: moving a timer costs next to nothing, where one made per request
/// is registered with the runtime and removed again each time.
pub(crate) struct Connection<S> {
    pub(super) stream: S,
    pub(super) read: BytesMut,
    pub(super) deadline: Pin<Box<Sleep>>,
    /// The idle list of the thread it was made on, while another thread uses it: it goes
    /// back there, where its socket's events are received.
    home: Option<Weak<Mutex<IdleList<Connection<S>>>>>,
    /// Whether `deadline` belongs to another thread's runtime (one that borrowed the
    /// connection): its thread would fire it, and polling it once that runtime has shut
    /// down panics; the next request here gets a timer of its own.
    timer_elsewhere: bool,
    /// Given back when the connection closes.
    _place: Place,
}

impl<S: AsyncRead + Unpin + Send> IdlePool<Connection<S>> {
    /// The most recently used pooled connection the server has not closed, its timer
    /// moved to `deadline` (with `true`: reused), or else a new one from `opener`
    /// (`false`).
    pub(super) async fn take_or_connect<E: PoolError>(
        &self,
        deadline: tokio::time::Instant,
        opener: &Opener<impl Open<S, E>>,
    ) -> Result<(Connection<S>, bool), E> {
        if let Some(connection) = self.checkout_open(deadline) {
            return Ok((connection, true));
        }
        // Boxed: a connect (with TLS, a few KB) is rare beside a pooled connection, and
        // would otherwise be nested in every request's future.
        Box::pin(self.connect(deadline, opener)).await
    }

    /// A new connection in a place of its own, or one to the server that another request
    /// handed over while this one waited for a place (`true`). The wait is floodgate's,
    /// not the server's: the try's `deadline` moves on by it, and the connection must be
    /// open within the connect timeout of the request's asking.
    async fn connect<E: PoolError>(
        &self,
        deadline: tokio::time::Instant,
        opener: &Opener<impl Open<S, E>>,
    ) -> Result<(Connection<S>, bool), E> {
        let asked = tokio::time::Instant::now();
        let until = asked + opener.timeout;
        let place = match self.places.free() {
            Some(place) => place,
            None => match self.wait_for_place(until, || deadline + asked.elapsed()).await {
                Waited::Place(place) => place,
                Waited::Connection(connection) => return Ok((connection, true)),
                Waited::Nothing => return Err(E::no_place()),
            },
        };
        let deadline = deadline + asked.elapsed();
        let opened = tokio::time::timeout_at(deadline, (opener.open)(place, until, deadline));
        Ok((opened.await.unwrap_or(Err(E::timed_out()))?, false))
    }

    /// Waits, counted among the requests waiting for a place, until `until` at most: for
    /// a connection to this server handed over (or one already idle again), a place a
    /// connection idle to another server gives up, or a place given back. A connection
    /// gets its timer set for `deadline()`.
    async fn wait_for_place(
        &self,
        until: tokio::time::Instant,
        deadline: impl Fn() -> tokio::time::Instant,
    ) -> Waited<S> {
        let places = &*self.places;
        let mut waiter = self.returns.wait(places);
        // One that came back idle before this request was counted.
        if let Some(connection) = self.checkout_open(deadline()) {
            // One handed over meanwhile goes to the next request waiting, if any.
            if let Some(spare) = waiter.leave() {
                let _ = self.returns.give(places, spare);
            }
            return Waited::Connection(connection);
        }
        let mut place = None;
        while place.is_none() && places.close_an_idle_connection(self) {
            place = places.free();
        }
        if place.is_none() {
            tokio::select! {
                biased;
                Ok(connection) = &mut waiter.receiver => return Waited::Connection(connection.timed_anew(deadline())),
                given_back = places.given_back(until) => place = given_back,
            }
        }
        // One handed over meanwhile rather than a new one (its place goes back).
        match (waiter.leave(), place) {
            (Some(connection), _) => Waited::Connection(connection.timed_anew(deadline())),
            (None, Some(place)) => Waited::Place(place),
            (None, None) => {
                places.ran_out();
                Waited::Nothing
            }
        }
    }

    /// The most recently used pooled connection the server has not closed, its timer
    /// moved to `deadline`.
    #[inline(always)]
    fn checkout_open(&self, deadline: tokio::time::Instant) -> Option<Connection<S>> {
        let (mut connection, home) = self.checkout(|connection| !connection.closed_while_idle())?;
        if home.is_none() && !connection.timer_elsewhere {
            connection.deadline.as_mut().reset(deadline);
        } else {
            connection = connection.timed_anew(deadline);
        }
        connection.home = home;
        Some(connection)
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
        buf.put_slice(&self.read[..n]);
        self.read.advance(n);
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
    /// The connection with a timer of this thread's runtime, set for `deadline`: its
    /// timer was another request's, perhaps on another thread's runtime (a connection
    /// borrowed from or handed over by another thread).
    fn timed_anew(mut self, deadline: tokio::time::Instant) -> Self {
        self.deadline = Box::pin(tokio::time::sleep_until(deadline));
        self.timer_elsewhere = false;
        self
    }

    /// `stream`, in `place`, its timer set for `deadline`.
    pub(super) fn new(stream: S, place: Place, deadline: tokio::time::Instant) -> Self {
        Connection {
            stream,
            read: BytesMut::new(),
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
            home: None,
            timer_elsewhere: false,
            _place: place,
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

/// What a request waiting for a place got.
enum Waited<S> {
    Place(Place),
    Connection(Connection<S>),
    /// Nothing in time.
    Nothing,
}

/// A server's requests waiting for a place, first come first served: a connection to the
/// server done with its request goes straight to the first of them while only requests
/// for this server wait; with requests for others waiting it closes instead, so that a
/// flood of requests for one server cannot keep the places from the others'.
pub(super) struct Returns<C> {
    waiters: Mutex<Waiters<C>>,
}

struct Waiters<C> {
    next: u64,
    /// In the order they came, so by id.
    queue: VecDeque<(u64, oneshot::Sender<C>)>,
}

impl<C> Default for Returns<C> {
    fn default() -> Self {
        Returns {
            waiters: Mutex::new(Waiters {
                next: 0,
                queue: VecDeque::new(),
            }),
        }
    }
}

impl<C> Returns<C> {
    /// Counts a request as waiting for a place among `places`, and for a connection to
    /// this server, until it is given one or the waiter is dropped.
    pub(super) fn wait<'a>(&'a self, places: &'a ConnectionPlaces) -> Waiter<'a, C> {
        let (sender, receiver) = oneshot::channel();
        let mut waiters = lock(&self.waiters);
        // Counted among all before it is queued, and out of the queue before it is
        // uncounted: every request in the queue is counted among all.
        places.began_waiting();
        let id = waiters.next;
        waiters.next += 1;
        waiters.queue.push_back((id, sender));
        Waiter {
            returns: self,
            places,
            id,
            receiver,
        }
    }

    /// Gives `connection` to the first request waiting for it, if every request waiting
    /// for a place among `places` is for this server; back when none takes it.
    pub(super) fn give(&self, places: &ConnectionPlaces, mut connection: C) -> Result<(), C> {
        let mut waiters = lock(&self.waiters);
        // Counted under the lock, which a request of this server needs to leave the queue.
        while !waiters.queue.is_empty() && waiters.queue.len() >= places.waiting() {
            let (_, sender) = waiters.queue.pop_front().expect("not empty");
            // Uncounted at once: it waits no more (its request may take a moment to run).
            places.stopped_waiting();
            match sender.send(connection) {
                Ok(()) => return Ok(()),
                // Never while its waiter lives (it leaves the queue before the receiver
                // goes), but should it: the next one.
                Err(back) => connection = back,
            }
        }
        Err(connection)
    }
}

/// A request waiting for a place and for a connection to its server.
pub(super) struct Waiter<'a, C> {
    returns: &'a Returns<C>,
    places: &'a ConnectionPlaces,
    id: u64,
    pub(super) receiver: oneshot::Receiver<C>,
}

impl<C> Waiter<'_, C> {
    /// Out of the queue (and uncounted), unless given a connection: then the connection,
    /// given under the lock this takes, so in the receiver once the lock is had.
    pub(super) fn leave(&mut self) -> Option<C> {
        let mut waiters = lock(&self.returns.waiters);
        if let Ok(at) = waiters.queue.binary_search_by_key(&self.id, |(id, _)| *id) {
            waiters.queue.remove(at);
            self.places.stopped_waiting();
            return None;
        }
        drop(waiters);
        self.receiver.try_recv().ok()
    }
}

impl<C> Drop for Waiter<'_, C> {
    fn drop(&mut self) {
        // A connection given and not taken closes with the receiver.
        self.leave();
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
/// Where a connection another thread made goes back to.
type Home<C> = Weak<Mutex<IdleList<C>>>;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Idle connections of type `C`, each kept at most `timeout`, at most `max` of them on
/// each thread.
pub(super) struct IdlePool<C: Send> {
    timeout: Duration,
    max: usize,
    /// The places the server's connections hold, shared with every other server's pool
    /// (`server.max_connections`).
    places: Arc<ConnectionPlaces>,
    lists: ThreadLocal<SharedList<C>>,
    /// How many times a list that was empty got a connection: a search of the other
    /// threads' lists that found none looks again when this moved meanwhile (one may
    /// have come back to a list already searched).
    refilled: AtomicU64,
    /// Requests to the server waiting for a place, to which connections are handed over.
    returns: Returns<C>,
}

impl<C: Send + 'static> IdlePool<C> {
    /// A pool whose connections hold places among `places`, which may ask it to close an
    /// idle one for a request to another server.
    pub(super) fn new(timeout: Duration, max: usize, places: &Arc<ConnectionPlaces>) -> Arc<Self> {
        let pool = Arc::new(IdlePool {
            timeout,
            max,
            places: places.clone(),
            lists: ThreadLocal::new(),
            refilled: AtomicU64::new(0),
            returns: Returns::default(),
        });
        places.share_idle(Arc::downgrade(&pool) as Weak<dyn CloseIdle>);
        pool
    }
}

impl<C: Send> IdlePool<C> {
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
    /// that a new connection then waited for); with the other thread's list when it is
    /// that thread's. The others found on the way are closed (dropped).
    fn checkout(&self, mut usable: impl FnMut(&mut C) -> bool) -> Option<(C, Option<Home<C>>)> {
        let own = self.list();
        loop {
            let refilled = self.refilled.load(Ordering::Acquire);
            // This thread's own first, and again at each search: another thread may
            // have given back one it had borrowed from this thread meanwhile.
            if let Some(connection) = take_usable(own, &mut usable) {
                return Some((connection, None));
            }
            let found = self
                .lists
                .iter()
                .filter(|list| !Arc::ptr_eq(list, own))
                .find_map(|list| Some((take_usable(list, &mut usable)?, Some(Arc::downgrade(list)))));
            if found.is_some() || self.refilled.load(Ordering::Acquire) == refilled {
                return found;
            }
        }
    }
}

impl<C: Send> CloseIdle for IdlePool<C> {
    fn close_idle(&self) -> bool {
        self.lists.iter().any(|list| {
            let mut list = lock(list);
            let idle = !list.connections.is_empty();
            if idle {
                list.connections.remove(0);
            }
            idle
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

impl<S: AsyncRead + Unpin + Send + 'static> IdlePool<Connection<S>> {
    /// Keeps `connection` for the next request, unless a request waits for a place: then
    /// it goes straight to the first request for this server if only such requests wait,
    /// and otherwise closes, its place going to the first in line.
    pub(super) fn check_in(self: &Arc<Self>, connection: Connection<S>) {
        let places = &*self.places;
        if places.wanted() {
            // Closed (dropped) when not given.
            let _ = self.returns.give(places, self.leaving(connection, None));
            return;
        }
        self.keep_on_home_thread(connection);
        // One that began to wait meanwhile may have looked for idle ones already.
        if places.wanted()
            && let Some((connection, home)) = self.checkout(|connection| !connection.closed_while_idle())
        {
            let _ = self.returns.give(places, self.leaving(connection, home));
        }
    }

    /// `connection` (taken from `home`, another thread's list, if not this thread's),
    /// leaving this thread for a request that may be served by another: it goes back to
    /// the list of the thread whose runtime its socket is registered with.
    fn leaving(&self, mut connection: Connection<S>, home: Option<Home<Connection<S>>>) -> Connection<S> {
        connection.home = connection
            .home
            .take()
            .or(home)
            .or_else(|| Some(Arc::downgrade(self.list())));
        connection
    }

    /// Keeps `connection` for the next request, with those of the thread it was made on
    /// (closed if that thread's list is gone).
    fn keep_on_home_thread(self: &Arc<Self>, mut connection: Connection<S>) {
        match connection.home.take() {
            None => self.keep(self.list(), connection),
            Some(home) => {
                if let Some(home) = home.upgrade() {
                    connection.timer_elsewhere = true;
                    self.keep(&home, connection);
                }
            }
        }
    }
}

impl<C: Send + 'static> IdlePool<C> {
    /// Keeps `connection` in `shared`; the one idle longest there goes when `max` are.
    fn keep(self: &Arc<Self>, shared: &SharedList<C>, connection: C) {
        if self.max == 0 {
            return;
        }
        let start_sweep = {
            let mut list = lock(shared);
            if list.connections.len() >= self.max {
                list.connections.remove(0);
            }
            if list.connections.is_empty() {
                self.refilled.fetch_add(1, Ordering::Release);
            }
            list.connections.push(Idle {
                connection,
                since: Instant::now(),
            });
            !std::mem::replace(&mut list.swept, true)
        };
        if start_sweep {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn(sweep(Arc::downgrade(shared), self.timeout))),
                // Without a runtime (it is shutting down) no connection is used again
                // either; unmarked, a later check-in starts the sweep.
                Err(_) => lock(shared).swept = false,
            }
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

    type SocketPool = IdlePool<Connection<tokio::net::UnixStream>>;

    fn socket_pool() -> Arc<SocketPool> {
        IdlePool::new(Duration::from_secs(60), 4, &ConnectionPlaces::new(8))
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    fn later() -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_secs(60)
    }

    /// A connect that fails: the connections in these tests are pooled ones.
    async fn no_connect(
        _: Place,
        _: tokio::time::Instant,
        _: tokio::time::Instant,
    ) -> Result<Connection<tokio::net::UnixStream>, ()> {
        Err(())
    }

    impl PoolError for () {
        fn no_place() -> Self {}

        fn timed_out() -> Self {}
    }

    /// Opens nothing ([`no_connect`]).
    fn no_opener() -> Opener<fn(Place, tokio::time::Instant, tokio::time::Instant) -> NoConnect> {
        Opener {
            timeout: Duration::ZERO,
            open: |place, until, deadline| Box::pin(no_connect(place, until, deadline)),
        }
    }

    type NoConnect = Pin<Box<dyn Future<Output = Result<Connection<tokio::net::UnixStream>, ()>> + Send>>;

    fn check_in(pool: &Arc<IdlePool<i32>>, connection: i32) {
        pool.keep(pool.list(), connection);
    }

    /// Checks `connection` in from a thread of its own, into that thread's list.
    fn check_in_on_another_thread(pool: &Arc<IdlePool<i32>>, connection: i32) {
        let pool = pool.clone();
        std::thread::spawn(move || check_in(&pool, connection))
            .join()
            .unwrap();
    }

    /// The connection taken, and whether it was this thread's.
    fn taken(pool: &IdlePool<i32>, usable: impl FnMut(&mut i32) -> bool) -> Option<(i32, bool)> {
        pool.checkout(usable)
            .map(|(connection, home)| (connection, home.is_none()))
    }

    #[tokio::test]
    async fn the_newest_is_taken_first_the_oldest_goes_past_max_and_idle_ones_close() {
        let pool = IdlePool::new(Duration::from_millis(100), 2, &ConnectionPlaces::new(8));
        for connection in [1, 2, 3] {
            check_in(&pool, connection);
        }
        // At most two kept: the first went; the newest comes out first.
        assert_eq!(taken(&pool, |_| true), Some((3, true)));
        assert_eq!(taken(&pool, |_| true), Some((2, true)));
        assert_eq!(taken(&pool, |_| true), None);

        // An unusable one found on the way is closed, not kept.
        check_in(&pool, 4);
        check_in(&pool, 5);
        assert_eq!(taken(&pool, |c| *c == 4), Some((4, true)));
        assert_eq!(taken(&pool, |_| true), None);

        // Idle past the timeout: closed by the sweep, without any request coming.
        check_in(&pool, 6);
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(lock(pool.list()).connections.is_empty());
        assert!(!lock(pool.list()).swept, "the sweep ends once nothing is idle");
        assert_eq!(taken(&pool, |_| true), None);
    }

    #[test]
    fn a_thread_takes_its_own_connections_first_then_another_threads() {
        let pool = IdlePool::new(Duration::from_secs(60), 4, &ConnectionPlaces::new(8));
        check_in(&pool, 1);
        let other = pool.clone();
        std::thread::spawn(move || {
            check_in(&other, 2);
            check_in(&other, 3);
        })
        .join()
        .unwrap();
        // This thread's, though another thread's are newer.
        assert_eq!(taken(&pool, |_| true), Some((1, true)));
        // None of its own left: another thread's, the most recently used first.
        assert_eq!(taken(&pool, |_| true), Some((3, false)));
        assert_eq!(taken(&pool, |_| true), Some((2, false)));
        assert_eq!(taken(&pool, |_| true), None);
    }

    #[test]
    fn a_connection_another_thread_took_goes_back_to_the_thread_it_was_made_on() {
        let pool = socket_pool();
        runtime().block_on(async {
            let (ours, _server) = tokio::net::UnixStream::pair().unwrap();
            pool.check_in(Connection::new(ours, Place::uncounted(), later()));
            let other = pool.clone();
            std::thread::spawn(move || {
                runtime().block_on(async {
                    let (connection, reused) = other.take_or_connect(later(), &no_opener()).await.unwrap();
                    assert!(reused);
                    other.check_in(connection);
                    // Back in the first thread's list, not in this one's.
                    assert!(other.checkout(|_| true).unwrap().1.is_some());
                })
            })
            .join()
            .unwrap();
        });
    }

    #[test]
    fn a_connection_back_in_a_list_already_searched_is_found() {
        let pool = IdlePool::new(Duration::from_secs(60), 4, &ConnectionPlaces::new(8));
        // This thread's list first (a thread that ends leaves its list to the next thread
        // given its identity).
        assert_eq!(taken(&pool, |_| true), None);
        // Thread `first` gets its list (empty) before thread `second` (one unusable
        // connection, 0): the search goes through them in that order. While it looks at
        // the 0, `first` checks in 7, behind the search.
        let (hook, hooked_in) = std::sync::mpsc::channel::<()>();
        let (done, wait_done) = std::sync::mpsc::channel::<()>();
        let (listed, wait_listed) = std::sync::mpsc::channel::<()>();
        let first = std::thread::spawn({
            let pool = pool.clone();
            move || {
                check_in(&pool, 1);
                assert_eq!(taken(&pool, |_| true), Some((1, true)));
                listed.send(()).unwrap();
                hooked_in.recv().unwrap();
                check_in(&pool, 7);
                done.send(()).unwrap();
            }
        });
        wait_listed.recv().unwrap();
        check_in_on_another_thread(&pool, 0);
        let mut hooked = false;
        let found = taken(&pool, |connection| {
            if *connection == 0 && !hooked {
                hooked = true;
                hook.send(()).unwrap();
                wait_done.recv().unwrap();
            }
            *connection != 0
        });
        first.join().unwrap();
        assert_eq!(found, Some((7, false)));
    }

    /// A connection another thread borrowed comes home without the borrower's timer: the
    /// home thread's next request on it gets a timer of its own runtime, which fires
    /// though the borrower's runtime has ended.
    #[test]
    fn a_connection_back_home_does_not_keep_the_borrowers_timer() {
        let pool = socket_pool();
        let home = runtime();
        let (ours, _server) = home.block_on(async { tokio::net::UnixStream::pair().unwrap() });
        home.block_on(async { pool.check_in(Connection::new(ours, Place::uncounted(), later())) });
        let other = pool.clone();
        std::thread::spawn(move || {
            let borrower = runtime();
            borrower.block_on(async {
                let (connection, reused) = other.take_or_connect(later(), &no_opener()).await.unwrap();
                assert!(reused);
                other.check_in(connection);
            });
        })
        .join()
        .unwrap();
        let fired = home.block_on(async {
            let soon = tokio::time::Instant::now() + Duration::from_millis(20);
            let (mut connection, reused) = pool.take_or_connect(soon, &no_opener()).await.unwrap();
            assert!(reused);
            tokio::spawn(async move { connection.deadline.as_mut().await }).await
        });
        assert!(
            fired.is_ok(),
            "the deadline of a request on this thread: {fired:?}"
        );
    }

    /// A search of the other threads' lists that looks again looks at this thread's own
    /// list too: a connection borrowed from this thread may have come back there meanwhile.
    #[test]
    fn a_connection_back_in_this_threads_own_list_during_the_search_is_found() {
        let pool = IdlePool::new(Duration::from_secs(60), 4, &ConnectionPlaces::new(8));
        let own = pool.list().clone();
        // Another thread's list: one connection, which the server has closed (0).
        check_in_on_another_thread(&pool, 0);
        let mut hooked = false;
        let found = taken(&pool, |connection| {
            if *connection == 0 && !hooked {
                hooked = true;
                // Meanwhile another thread's request ends on a connection it had
                // borrowed from this thread: back home, in this thread's list.
                let pool = pool.clone();
                let own = own.clone();
                std::thread::spawn(move || pool.keep(&own, 7)).join().unwrap();
            }
            *connection != 0
        });
        assert_eq!(found, Some((7, true)));
    }

    #[tokio::test]
    async fn a_connection_goes_to_the_first_request_waiting_for_its_server_while_only_they_wait() {
        let places = ConnectionPlaces::new(1);
        let returns = Returns::<i32>::default();
        // Nobody waits: kept by the pool.
        assert_eq!(returns.give(&places, 1), Err(1));

        // First come, first served; one that stopped waiting is out of the queue.
        let mut first = returns.wait(&places);
        let gone = returns.wait(&places);
        let mut third = returns.wait(&places);
        drop(gone);
        assert_eq!(returns.give(&places, 1), Ok(()));
        assert_eq!(places.waiting(), 1, "one given a connection waits no more");
        assert_eq!(returns.give(&places, 2), Ok(()));
        assert_eq!((&mut first.receiver).await, Ok(1));
        assert_eq!((&mut third.receiver).await, Ok(2));
        drop((first, third));
        assert_eq!(places.waiting(), 0, "uncounted once done waiting");

        // With a request for another server waiting too, none is given: the connection
        // closes and its place goes to the first in line.
        let waiting = returns.wait(&places);
        let other = Returns::<i32>::default();
        let _other_waiting = other.wait(&places);
        assert_eq!(returns.give(&places, 3), Err(3));
        drop(waiting);
        assert_eq!(other.give(&places, 4), Ok(()));
    }
}
