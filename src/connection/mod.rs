//! What a client connection shares with the requests it carries.
//!
//! * Whether a request is in flight: each request holds an [`InFlight`] token from the
//!   moment hyper hands it to the service until its response body is finished or dropped.
//!   [`serve_until_idle`] closes a connection that has held no token for
//!   `server.header_timeout`, which bounds, with one rule for HTTP/1.1 and HTTP/2 and for
//!   the proxy and admin listeners, the wait for a first request, a slowly sent head, a
//!   keep-alive connection left open and an HTTP/2 connection with no open stream.
//! * Whether a tunnel started (an upstream accepted an `Upgrade`): from then on the bytes
//!   on the connection are no longer HTTP, and [`framing`] stops inspecting them. The
//!   tunnel itself ([`Relay`]) is run by the connection's task once hyper hands the
//!   connection over, so that it stays a connection like any other: counted by
//!   `server.max_connections`, and waited for by a shutdown within its grace.
//! * On HTTP/2, whether a response waits for its client: the client's flow-control window
//!   decides when a stream's body goes out, so a client that never opens it holds the
//!   response, and what it holds upstream, with no write ever blocking.
//!   [`serve_until_idle`] closes a connection one of whose responses has waited for the
//!   client for `server.send_timeout` (as a blocked write does on HTTP/1.1).

#[allow(unsafe_code)] // borrows the socket's descriptor to duplicate it
pub(crate) mod disconnect;
pub(crate) mod fold;
#[allow(unsafe_code)] // reads into spare buffer capacity without zeroing it first
pub(crate) mod framing;
#[cfg(test)]
mod framing_diff;
mod linger;
pub(crate) mod send_timeout;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use std::error::Error as StdError;
use std::pin::Pin;
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

use hyper::body::{Body, Incoming};
use hyper::rt::bounds::Http2ServerConnExec;
use hyper::rt::{Read, Write};
use hyper::server::conn::{http1, http2};
use hyper::service::HttpService;

/// How long a connection closed for idleness may take to wind down (an HTTP/2 client
/// reading its GOAWAY) before it is dropped.
const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(1);

/// A tunnel's copying of bytes both ways, to its end.
pub(crate) type Relay = Pin<Box<dyn Future<Output = ()> + Send>>;

/// One connection's state, as its requests and its server task see it.
pub(crate) struct ConnectionState {
    open: AtomicUsize,
    /// When the last request ended, in microseconds since `opened`.
    last_end: AtomicU64,
    opened: Instant,
    tunnel: AtomicBool,
    /// The tunnel, until the connection's task takes it to run.
    relay: Mutex<Option<Relay>>,
    /// Whether an HTTP/2 response has been given (see [`InFlight::first_http2_response`]).
    answered_http2: AtomicBool,
    /// The client connection's socket, told when the connection closes before a request
    /// body ended (it then lingers: [`linger`]).
    socket: Option<Arc<disconnect::ClientSocket>>,
    /// On HTTP/2, each response's [`Progress`], for the stall check.
    http2: AtomicBool,
    progress: Mutex<Vec<Weak<Progress>>>,
}

/// Where an HTTP/2 response stands, as its body and the connection's stall check see it:
/// [`WAITING_FOR_CLIENT`] from when the body hands hyper data (or is made) until hyper
/// polls it again, which it does once the client's window has room; the check adds
/// [`SEEN_WAITING`], and finding both a check later means the client held the response
/// for at least that long.
type Progress = AtomicU8;
const WAITING_FOR_CLIENT: u8 = 1;
const SEEN_WAITING: u8 = 2;

impl ConnectionState {
    pub(crate) fn new() -> Arc<Self> {
        Self::with_socket(None)
    }

    /// The state of a connection to the proxy listener, on `socket`.
    pub(crate) fn on(socket: Arc<disconnect::ClientSocket>) -> Arc<Self> {
        Self::with_socket(Some(socket))
    }

    fn with_socket(socket: Option<Arc<disconnect::ClientSocket>>) -> Arc<Self> {
        Arc::new(ConnectionState {
            open: AtomicUsize::new(0),
            last_end: AtomicU64::new(0),
            opened: Instant::now(),
            tunnel: AtomicBool::new(false),
            relay: Mutex::new(None),
            answered_http2: AtomicBool::new(false),
            socket,
            http2: AtomicBool::new(false),
            progress: Mutex::new(Vec::new()),
        })
    }

    /// The connection speaks HTTP/2: its responses are watched for stalls.
    pub(crate) fn watch_http2_stalls(&self) {
        self.http2.store(true, Ordering::Relaxed);
    }

    /// Whether a response has waited for its client since the last check at least (see
    /// [`Progress`]); marks those that wait now for the next.
    fn stalled(&self) -> bool {
        let mut stalled = false;
        let mut progress = self.progress.lock().unwrap_or_else(PoisonError::into_inner);
        progress.retain(|response| {
            let Some(response) = response.upgrade() else {
                return false;
            };
            stalled |= response.fetch_or(SEEN_WAITING, Ordering::AcqRel) & SEEN_WAITING != 0
                && response.load(Ordering::Acquire) & WAITING_FOR_CLIENT != 0;
            true
        });
        stalled
    }

    /// The connection closes before a request body ended.
    pub(crate) fn closed_before_the_body_ended(&self) {
        if let Some(socket) = &self.socket {
            socket.linger_on_close();
        }
    }

    /// Whether a request of this connection has started a tunnel.
    pub(crate) fn tunnel_started(&self) -> bool {
        self.tunnel.load(Ordering::Acquire)
    }

    /// The tunnel a request started, to run once hyper has handed the connection over.
    pub(crate) fn take_tunnel(&self) -> Option<Relay> {
        if !self.tunnel_started() {
            return None;
        }
        self.relay.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// Whether a request is in flight.
    pub(crate) fn carries_requests(&self) -> bool {
        self.open.load(Ordering::Acquire) > 0
    }

    /// A request starts; it is in flight until the token is dropped.
    pub(crate) fn begin(self: &Arc<Self>) -> InFlight {
        self.open.fetch_add(1, Ordering::AcqRel);
        InFlight(self.clone())
    }

    /// A new HTTP/2 response's [`Progress`], registered for the stall check.
    fn watch_progress(&self) -> Arc<Progress> {
        let progress = Arc::new(Progress::new(0));
        let mut watched = self.progress.lock().unwrap_or_else(PoisonError::into_inner);
        // Those of finished requests go when the list would grow.
        if watched.len() == watched.capacity() {
            watched.retain(|response| response.strong_count() > 0);
        }
        watched.push(Arc::downgrade(&progress));
        progress
    }

    /// How long the connection has carried no request; `None` while one is in flight.
    pub(crate) fn idle_for(&self, now: Instant) -> Option<Duration> {
        if self.open.load(Ordering::Acquire) > 0 {
            return None;
        }
        let last_end = self.opened + Duration::from_micros(self.last_end.load(Ordering::Acquire));
        Some(now.saturating_duration_since(last_end))
    }
}

/// Serves `connection` (from `peer`, its requests tracked by `state`) until it ends. It
/// is closed gracefully when `shutdown` completes, and once it has carried no request
/// for `idle_limit`; with `stall_limit` (HTTP/2), closed at once when a response has
/// waited for its client that long at least (see [`Progress`]).
pub(crate) async fn serve_until_idle<C>(
    connection: C,
    state: &ConnectionState,
    (idle_limit, stall_limit): (Duration, Option<Duration>),
    shutdown: impl Future<Output = ()>,
    peer: SocketAddr,
) -> Result<(), hyper::Error>
where
    C: Graceful,
{
    tokio::pin!(connection);
    tokio::pin!(shutdown);
    let idle = tokio::time::sleep(idle_limit);
    tokio::pin!(idle);
    let mut stall_check = stall_limit.map(|limit| Box::pin(tokio::time::sleep(limit)));
    let rare = RareWakes::new();
    loop {
        let woken = std::future::poll_fn(|cx| {
            if let Poll::Ready(result) = connection.as_mut().poll(cx) {
                return Poll::Ready(Woken::Done(result));
            }
            rare.poll_if_woken(cx, |cx| {
                if shutdown.as_mut().poll(cx).is_ready() {
                    Poll::Ready(Woken::Shutdown)
                } else if idle.as_mut().poll(cx).is_ready() {
                    Poll::Ready(Woken::Idle)
                } else if let Some(check) = stall_check.as_mut()
                    && check.as_mut().poll(cx).is_ready()
                {
                    Poll::Ready(Woken::StallCheck)
                } else {
                    Poll::Pending
                }
            })
        })
        .await;
        match woken {
            Woken::Done(result) => return result,
            Woken::StallCheck => {
                if state.stalled() {
                    tracing::debug!(%peer, "closing an HTTP/2 connection whose client held a response for server.send_timeout");
                    return Ok(());
                }
                if let (Some(check), Some(limit)) = (stall_check.as_mut(), stall_limit) {
                    check.as_mut().reset(tokio::time::Instant::now() + limit);
                }
                rare.poll_next_time();
            }
            Woken::Shutdown => {
                connection.as_mut().graceful_shutdown();
                return connection.await;
            }
            Woken::Idle => {
                let now = tokio::time::Instant::now();
                match state.idle_for(now.into_std()) {
                    Some(idle_for) if idle_for >= idle_limit => {
                        tracing::debug!(%peer, "closing a connection with no request for server.header_timeout");
                        connection.as_mut().graceful_shutdown();
                        return tokio::time::timeout(IDLE_CLOSE_GRACE, connection.as_mut())
                            .await
                            .unwrap_or(Ok(()));
                    }
                    Some(idle_for) => idle.as_mut().reset(now + (idle_limit - idle_for)),
                    None => idle.as_mut().reset(now + idle_limit),
                }
                // Polled again, so that the timer wakes the task at its new deadline: tokio
                // does not promise that a reset `Sleep` keeps its waker.
                rare.poll_next_time();
            }
        }
    }
}

/// What a connection's wait ended on.
enum Woken {
    Done(Result<(), hyper::Error>),
    Shutdown,
    Idle,
    StallCheck,
}

/// The futures a connection's task waits for besides the connection itself (the shutdown
/// signal, the idle timer), polled only when one of them woke the task: the task wakes for
/// its connection several times a request, and polling them at each wake cost a few
/// hundred instructions a request (docs/performance.md#where-the-instructions-went-and-what-did-not-pay).
struct RareWakes {
    flag: Arc<RareFlag>,
    waker: Waker,
}

/// Set when a rare future wakes the task.
struct RareFlag {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Wake for RareFlag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl RareWakes {
    fn new() -> Self {
        let flag = Arc::new(RareFlag {
            // Polled first when the task first runs, so that they register.
            woken: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        RareWakes {
            waker: Waker::from(flag.clone()),
            flag,
        }
    }

    /// Runs `poll_rare` (which polls the rare futures with the context it is given) if one
    /// of them woke the task since it last ran, or [`Self::poll_next_time`] asked for it.
    fn poll_if_woken<T>(
        &self,
        cx: &Context<'_>,
        poll_rare: impl FnOnce(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        // Registered before the flag is read: a wake after the read wakes this task again.
        self.flag.task.register(cx.waker());
        if !self.flag.woken.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        poll_rare(&mut Context::from_waker(&self.waker))
    }

    /// Makes the next [`Self::poll_if_woken`] poll the rare futures.
    fn poll_next_time(&self) {
        self.flag.woken.store(true, Ordering::Release);
    }
}

/// A connection hyper serves, which can be asked to finish what it carries and close
/// (hyper-util's `GracefulConnection` is sealed and leaves out HTTP/1 with upgrades).
pub(crate) trait Graceful: Future<Output = Result<(), hyper::Error>> {
    fn graceful_shutdown(self: Pin<&mut Self>);
}

impl<I, S, B> Graceful for http1::Connection<I, S>
where
    S: HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn StdError + Send + Sync>>,
    I: Read + Write + Unpin + 'static,
    B: Body + 'static,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    fn graceful_shutdown(self: Pin<&mut Self>) {
        http1::Connection::graceful_shutdown(self);
    }
}

impl<I, S, B> Graceful for http1::UpgradeableConnection<I, S>
where
    S: HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn StdError + Send + Sync>>,
    I: Read + Write + Unpin + Send + 'static,
    B: Body + 'static,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    fn graceful_shutdown(self: Pin<&mut Self>) {
        http1::UpgradeableConnection::graceful_shutdown(self);
    }
}

impl<I, S, B, E> Graceful for http2::Connection<I, S, E>
where
    S: HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn StdError + Send + Sync>>,
    I: Read + Write + Unpin + 'static,
    B: Body + 'static,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
    E: Http2ServerConnExec<S::Future, B>,
{
    fn graceful_shutdown(self: Pin<&mut Self>) {
        http2::Connection::graceful_shutdown(self);
    }
}

impl<C: Graceful + ?Sized> Graceful for Pin<Box<C>> {
    fn graceful_shutdown(self: Pin<&mut Self>) {
        self.get_mut().as_mut().graceful_shutdown();
    }
}

/// A request's hold on its connection (see the module docs).
pub(crate) struct InFlight(Arc<ConnectionState>);

impl InFlight {
    /// The request's connection now carries a tunnel, `relay`: its bytes are no longer
    /// HTTP.
    pub(crate) fn start_tunnel(&self, relay: Relay) {
        *self.0.relay.lock().unwrap_or_else(PoisonError::into_inner) = Some(relay);
        self.0.tunnel.store(true, Ordering::Release);
    }

    /// Whether this request's HTTP/2 response is its connection's first (true once).
    pub(crate) fn first_http2_response(&self) -> bool {
        let answered = &self.0.answered_http2;
        !answered.load(Ordering::Relaxed) && !answered.swap(true, Ordering::Relaxed)
    }

    /// The progress of this request's response, watched on HTTP/2 (see [`Progress`]);
    /// `None` on HTTP/1.1, where a blocked write shows a client that does not read.
    pub(crate) fn watch_response(&self) -> Option<ResponseProgress> {
        if !self.0.http2.load(Ordering::Relaxed) {
            return None;
        }
        let progress = ResponseProgress(self.0.watch_progress());
        progress.waits_for_client();
        Some(progress)
    }
}

/// An HTTP/2 response's [`Progress`], as its body tells it.
#[derive(Debug)]
pub(crate) struct ResponseProgress(Arc<Progress>);

impl ResponseProgress {
    /// The response waits for the client: made, or some of its body handed to hyper.
    pub(crate) fn waits_for_client(&self) {
        self.0.store(WAITING_FOR_CLIENT, Ordering::Release);
    }

    /// hyper asks for more of the response's body: the client has room for it.
    pub(crate) fn polled(&self) {
        self.0.store(0, Ordering::Release);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let activity = &self.0;
        // Before the count drops, so that a connection seen idle has its last end written.
        let ended = u64::try_from(activity.opened.elapsed().as_micros()).unwrap_or(u64::MAX);
        activity.last_end.fetch_max(ended, Ordering::AcqRel);
        activity.open.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rare futures are polled when the task first runs, then only after one of them
    /// woke the task (which it then wakes), or when asked to; not when the connection woke it.
    #[test]
    fn rare_futures_are_polled_only_when_they_woke_the_task() {
        struct Task(std::sync::atomic::AtomicUsize);
        impl Wake for Task {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let task = Arc::new(Task(AtomicUsize::new(0)));
        let task_waker = Waker::from(task.clone());
        let cx = Context::from_waker(&task_waker);
        let rare = RareWakes::new();
        // How often the rare futures were polled, and the waker they were given.
        let polled = std::cell::RefCell::new((0, None::<Waker>));
        let poll = || {
            let _ = rare.poll_if_woken(&cx, |cx| {
                let mut polled = polled.borrow_mut();
                polled.0 += 1;
                polled.1 = Some(cx.waker().clone());
                Poll::<()>::Pending
            });
            polled.borrow().0
        };
        assert_eq!((poll(), poll(), poll()), (1, 1, 1), "polled once to register");
        assert_eq!(task.0.load(Ordering::SeqCst), 0);
        let waker = polled.borrow_mut().1.take().unwrap();
        waker.wake();
        assert_eq!(task.0.load(Ordering::SeqCst), 1, "their wake wakes the task");
        assert_eq!((poll(), poll()), (2, 2), "polled after it woke the task");
        rare.poll_next_time();
        assert_eq!(poll(), 3, "polled when asked to");
        assert_eq!(task.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn idle_counts_from_the_last_request_to_end() {
        let activity = ConnectionState::new();
        let start = activity.opened;
        assert_eq!(
            activity.idle_for(start + Duration::from_secs(3)),
            Some(Duration::from_secs(3)),
            "a connection is idle from the start"
        );
        let first = activity.begin();
        let second = activity.begin();
        drop(first);
        assert_eq!(activity.idle_for(Instant::now()), None, "one still in flight");
        drop(second);
        let idle = activity.idle_for(start + Duration::from_secs(60)).unwrap();
        assert!(idle < Duration::from_secs(60), "{idle:?}: counted from the end");
        assert!(idle > Duration::from_secs(59), "{idle:?}");
    }
}
