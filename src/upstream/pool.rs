//! Keep-alive HTTP/1.1 connections to one upstream server, over hyper's `client::conn::http1`.
//!
//! A connection goes back to the pool when the response body it carried has been read
//! to its end (by the client, or by [`discard`] for a response whose client left while a
//! cap counted the request); a response dropped half-way takes its connection with it,
//! since hyper then closes it. Idle connections are kept for [`IDLE_TIMEOUT`]
//! ([`super::idle`]).
//!
//! A request that could not even be written, because the upstream had closed the idle
//! connection it was given, is sent again on another connection (hyper hands it back
//! untouched); any other failure is the caller's.
//!
//! This replaces hyper-util's general-purpose client, whose pool checkout, per-request
//! readiness task and extra channels cost measurably more CPU per request
//! (docs/performance.md, "Choices measured").

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::client::conn::TrySendError;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio::time::Sleep;
use tokio_rustls::TlsConnector;

use super::idle::IdlePool;

/// How long an idle connection is kept.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Most idle connections kept per upstream.
const MAX_IDLE: usize = 512;

/// Why a request got no response.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    #[error("cannot connect to {address}: {source}")]
    Connect { address: String, source: std::io::Error },
    #[error("cannot connect to {0}: no answer within the connect timeout")]
    ConnectTimeout(String),
    #[error("TLS with {address} failed: {source}")]
    Tls { address: String, source: std::io::Error },
    #[error(transparent)]
    Exchange(#[from] hyper::Error),
    #[error("no response headers in time")]
    Timeout,
}

/// TLS to a server: the client configuration and the name its certificate must have.
#[derive(Clone)]
pub(crate) struct Tls {
    pub(crate) connector: TlsConnector,
    pub(crate) server_name: ServerName<'static>,
}

/// One upstream address and its idle connections.
struct Endpoint<B> {
    /// `host:port`, as configured.
    address: String,
    connect_timeout: Duration,
    tls: Option<Tls>,
    idle: Arc<IdlePool<Connection<B>>>,
}

/// A connection to a server, with the timer that bounds each wait for a response head
/// on it. The timer is moved to each request's deadline: moving a timer later costs next
/// to nothing, where one made per request is registered with the runtime and removed
/// again each time.
struct Connection<B> {
    sender: SendRequest<B>,
    deadline: Pin<Box<Sleep>>,
}

impl<B> Connection<B> {
    /// `sender`'s connection, its timer set for `deadline`.
    fn new(sender: SendRequest<B>, deadline: tokio::time::Instant) -> Self {
        Connection {
            sender,
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
        }
    }
}

impl<B: Send + 'static> Endpoint<B> {
    /// The most recently used live connection.
    fn checkout(&self) -> Option<Connection<B>> {
        self.idle.checkout(|connection| !connection.sender.is_closed())
    }

    fn check_in(&self, connection: Connection<B>) {
        if !connection.sender.is_closed() {
            self.idle.check_in(connection);
        }
    }
}

impl<B> Endpoint<B>
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    /// A new connection, its TLS handshake included, within `connect_timeout` and before
    /// `deadline` (then [`SendError::Timeout`]).
    async fn connect(&self, deadline: tokio::time::Instant) -> Result<Connection<B>, SendError> {
        let opened = tokio::time::timeout(self.connect_timeout, self.open());
        match tokio::time::timeout_at(deadline, opened).await {
            Ok(Ok(Ok(sender))) => Ok(Connection::new(sender, deadline)),
            Ok(Ok(Err(error))) => Err(error),
            Ok(Err(_)) => Err(SendError::ConnectTimeout(self.address.clone())),
            Err(_) => Err(SendError::Timeout),
        }
    }

    async fn open(&self) -> Result<SendRequest<B>, SendError> {
        open(&self.address, self.tls.as_ref()).await
    }
}

/// A new HTTP/1.1 connection to `address` (`host:port`), over TLS with `tls`: the pool's
/// and the active health checks' (no deadline: the caller's).
pub(super) async fn open<B>(address: &str, tls: Option<&Tls>) -> Result<SendRequest<B>, SendError>
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = TcpStream::connect(address)
        .await
        .map_err(|source| SendError::Connect {
            address: address.to_owned(),
            source,
        })?;
    // Requests and responses are written whole; never wait to coalesce them.
    let _ = stream.set_nodelay(true);
    let Some(tls) = tls else {
        return handshake(stream).await;
    };
    let stream = tls
        .connector
        .connect(tls.server_name.clone(), stream)
        .await
        .map_err(|source| SendError::Tls {
            address: address.to_owned(),
            source,
        })?;
    handshake(stream).await
}

/// An HTTP/1.1 connection over `stream`, driven by a task of its own.
async fn handshake<B, S>(stream: S) -> Result<SendRequest<B>, SendError>
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        if let Err(error) = connection.with_upgrades().await {
            tracing::debug!(%error, "upstream connection ended with an error");
        }
    });
    Ok(sender)
}

/// The connections to one upstream, for requests with bodies of type `B`.
pub(crate) struct Pool<B> {
    endpoint: Arc<Endpoint<B>>,
}

impl<B> Pool<B>
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    /// A pool for `address` (`host:port`), over TLS with `tls`.
    pub(crate) fn new(address: String, connect_timeout: Duration, tls: Option<Tls>) -> Self {
        Pool::with_idle_timeout(address, connect_timeout, tls, IDLE_TIMEOUT)
    }

    /// A pool that keeps idle connections for `idle_timeout` (tests: a short one).
    fn with_idle_timeout(
        address: String,
        connect_timeout: Duration,
        tls: Option<Tls>,
        idle_timeout: Duration,
    ) -> Self {
        Pool {
            endpoint: Arc::new(Endpoint {
                address,
                connect_timeout,
                tls,
                idle: Arc::new(IdlePool::new(idle_timeout, MAX_IDLE)),
            }),
        }
    }

    /// Sends `request` (its target in origin form, its `Host` set) and waits for the
    /// response headers until `deadline` (then [`SendError::Timeout`]). A request that was
    /// not sent (no connection could be made) comes back with the error.
    ///
    /// `keep` is what the request holds while the server works on it. With `detach` (a cap
    /// counts it), the server's work outlives a client that leaves: if this future is
    /// dropped before the response head and before `deadline` once the request is on its
    /// way, `keep` is taken, the answer awaited in a task of its own until `deadline`, the
    /// response read and discarded for at most `timeout` ([`discard`]), and only then is
    /// `keep` dropped (see [`Detached`]).
    pub(crate) async fn send<K: Send + 'static>(
        &self,
        mut request: Request<B>,
        deadline: tokio::time::Instant,
        timeout: Duration,
        keep: &mut Option<K>,
        detach: bool,
    ) -> Result<Response<UpstreamBody<B>>, Unsent<B>> {
        loop {
            let (mut connection, reused) = match self.endpoint.checkout() {
                Some(mut connection) => {
                    connection.deadline.as_mut().reset(deadline);
                    (connection, true)
                }
                None => match Box::pin(self.endpoint.connect(deadline)).await {
                    Ok(connection) => (connection, false),
                    Err(SendError::Timeout) => return Err(timed_out()),
                    Err(error) => {
                        let request = Some(request);
                        return Err(Unsent { error, request });
                    }
                },
            };
            // A pooled connection has finished its last exchange: this waits at most for
            // its connection task to notice.
            if reused {
                let ready = tokio::select! {
                    biased;
                    ready = connection.sender.ready() => ready,
                    () = connection.deadline.as_mut() => return Err(timed_out()),
                };
                if ready.is_err() {
                    continue;
                }
            }
            let answer = connection.sender.try_send_request(request);
            let answer = match detach {
                false => tokio::select! {
                    biased;
                    answer = answer => answer,
                    () = connection.deadline.as_mut() => return Err(timed_out()),
                },
                true => {
                    let mut detached = Detached {
                        answer: Some(Box::pin(answer)),
                        connection: Some(connection),
                        keep: &mut *keep,
                        endpoint: &self.endpoint,
                        deadline,
                        timeout,
                    };
                    let Detached {
                        answer: Some(waiting),
                        connection: Some(held),
                        ..
                    } = &mut detached
                    else {
                        unreachable!("both set above");
                    };
                    // Dropped past its deadline, `detached` leaves nothing going on.
                    let answer = tokio::select! {
                        biased;
                        answer = waiting.as_mut() => answer,
                        () = held.deadline.as_mut() => return Err(timed_out()),
                    };
                    detached.answer = None;
                    connection = detached.connection.take().expect("taken only when dropped");
                    answer
                }
            };
            match answer {
                Ok(response) => return Ok(UpstreamBody::of(response, connection, &self.endpoint)),
                // Refused before any of it was written: the upstream had closed the pooled
                // connection meanwhile.
                Err(mut error) => match error.take_message() {
                    Some(unsent) if reused => request = unsent,
                    unsent => {
                        return Err(Unsent {
                            error: SendError::Exchange(error.into_error()),
                            request: unsent,
                        });
                    }
                },
            }
        }
    }
}

/// A try that ran out of time: what was sent of the request is lost.
fn timed_out<B>() -> Unsent<B> {
    Unsent {
        error: SendError::Timeout,
        request: None,
    }
}

/// What a request's response head comes to.
type HeadAnswer<B> = Result<Response<Incoming>, TrySendError<Request<B>>>;

/// The wait for a response head, boxed.
type BoxedHead<B> = Pin<Box<dyn Future<Output = HeadAnswer<B>> + Send>>;

/// The wait for the response head of a request a cap counts (see [`Pool::send`]), boxed so
/// that it can move: dropped before the answer and before the deadline (its client left),
/// it goes on in a task of its own, which takes `keep` and drops it only once the response
/// has been read and discarded ([`discard`]). Nothing is spawned while the client stays.
struct Detached<'a, B, K>
where
    B: Send + 'static,
    K: Send + 'static,
{
    /// `None` once answered.
    answer: Option<BoxedHead<B>>,
    /// The connection the request went out on, back to the caller once answered.
    connection: Option<Connection<B>>,
    keep: &'a mut Option<K>,
    endpoint: &'a Arc<Endpoint<B>>,
    /// The try's deadline: dropped past it, the exchange timed out.
    deadline: tokio::time::Instant,
    /// How long the rest of an answer no one waits for is read.
    timeout: Duration,
}

impl<B, K> Drop for Detached<'_, B, K>
where
    B: Send + 'static,
    K: Send + 'static,
{
    fn drop(&mut self) {
        let (Some(answer), Some(connection)) = (self.answer.take(), self.connection.take()) else {
            return;
        };
        let endpoint = self.endpoint.clone();
        let body = async move {
            let response = answer.await.ok()?;
            Some(UpstreamBody::of(response, connection, &endpoint).into_body())
        };
        go_on(body, self.keep, self.deadline, self.timeout);
    }
}

/// Goes on with an exchange whose client left, in a task of its own: takes `keep`, waits
/// for the response `body` until `deadline`, reads and discards it ([`discard`]), and
/// only then drops what it took. Past the deadline (read only now, on this rare path) the
/// try failed: nothing goes on, and `keep` stays with the caller, who answers the failure.
pub(super) fn go_on<B, K>(
    body: impl Future<Output = Option<B>> + Send + 'static,
    keep: &mut Option<K>,
    deadline: tokio::time::Instant,
    timeout: Duration,
) where
    B: Body + Send + Unpin + 'static,
    K: Send + 'static,
{
    if tokio::time::Instant::now() >= deadline {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let keep = keep.take();
    runtime.spawn(async move {
        if let Ok(Some(body)) = tokio::time::timeout_at(deadline, body).await {
            discard(body, keep, timeout).await;
        }
    });
}
/// Reads and drops the rest of a response no one waits for, for at most `timeout`, then
/// drops `keep` (what the request holds while the server works on it): the server is
/// done with a request once it has sent all of its response. Read to its end, the
/// connection goes back to the pool first.
pub(crate) async fn discard<B: Body + Unpin, K>(mut body: B, keep: K, timeout: Duration) {
    let rest = async { while let Some(Ok(_)) = body.frame().await {} };
    let _ = tokio::time::timeout(timeout, rest).await;
    drop(body);
    drop(keep);
}

/// Why a request failed, and the request itself when none of it was sent.
pub(crate) struct Unsent<B> {
    pub(crate) error: SendError,
    pub(crate) request: Option<Request<B>>,
}

impl<B> std::fmt::Debug for Unsent<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unsent")
            .field("error", &self.error)
            .field("unsent", &self.request.is_some())
            .finish()
    }
}

/// A response body from the upstream; once read to its end, its connection goes back
/// to the pool.
pub(crate) struct UpstreamBody<B: Send + 'static> {
    inner: Incoming,
    finished: bool,
    reuse: Option<(Connection<B>, Arc<Endpoint<B>>)>,
}

impl<B: Send + 'static> UpstreamBody<B> {
    /// The response whose head came on `connection` to `endpoint`.
    fn of(
        response: Response<Incoming>,
        connection: Connection<B>,
        endpoint: &Arc<Endpoint<B>>,
    ) -> Response<Self> {
        // After a protocol switch the connection belongs to the tunnel.
        let reuse =
            (response.status() != StatusCode::SWITCHING_PROTOCOLS).then(|| (connection, endpoint.clone()));
        response.map(|inner| UpstreamBody {
            inner,
            finished: false,
            reuse,
        })
    }

    /// Whether the body has been read to its end.
    pub(crate) fn is_finished(&self) -> bool {
        self.finished || self.inner.is_end_stream()
    }
}

impl<B: Send + 'static> Body for UpstreamBody<B> {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let frame = Pin::new(&mut self.inner).poll_frame(cx);
        match &frame {
            Poll::Ready(None) => self.finished = true,
            Poll::Ready(Some(Err(_))) => self.reuse = None,
            _ => {}
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B: Send + 'static> Drop for UpstreamBody<B> {
    fn drop(&mut self) {
        let Some((mut connection, pool)) = self.reuse.take() else {
            return;
        };
        if !self.is_finished() {
            return;
        }
        if connection.sender.is_ready() {
            pool.check_in(connection);
            return;
        }
        // The upstream answered before it had read the whole request body (an early 413 or
        // 401, say): the connection is free once the body has been sent, so it waits for
        // that apart from the pool, and checkouts never wait behind a slow upload.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if connection.sender.ready().await.is_ok() {
                    pool.check_in(connection);
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;

    use http_body_util::{BodyExt, Full};
    use hyper::service::service_fn;

    use super::*;

    /// Reads one request head from `stream`.
    fn read_head(stream: &mut TcpStream) {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            assert_eq!(stream.read(&mut byte).unwrap(), 1, "request head");
            head.push(byte[0]);
        }
    }

    async fn send(
        pool: &Pool<Full<Bytes>>,
    ) -> Result<Response<UpstreamBody<Full<Bytes>>>, Unsent<Full<Bytes>>> {
        let timeout = Duration::from_secs(1);
        let deadline = tokio::time::Instant::now() + timeout;
        pool.send(request(), deadline, timeout, &mut None::<()>, false)
            .await
    }

    fn request() -> Request<Full<Bytes>> {
        Request::get("/")
            .header("host", "app")
            .body(Full::default())
            .unwrap()
    }

    /// The upstream closes an idle connection the pool holds: the next request goes out
    /// on a new connection.
    #[tokio::test(flavor = "current_thread")]
    async fn a_connection_the_upstream_closed_is_not_used_again() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let (closed_tx, closed) = mpsc::channel();
        let server = std::thread::spawn(move || {
            let (mut first, _) = listener.accept().unwrap();
            read_head(&mut first);
            first
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst")
                .unwrap();
            // Wait until the pool has the connection back, then close it.
            closed.recv().unwrap();
            drop(first);
            closed.recv().unwrap();
            let (mut second, _) = listener.accept().unwrap();
            read_head(&mut second);
            second
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond")
                .unwrap();
        });

        let pool = Pool::new(address, Duration::from_secs(1), None);
        let response = send(&pool).await;
        let body = response.unwrap().into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "first");
        closed_tx.send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        closed_tx.send(()).unwrap();
        let response = send(&pool).await;
        let body = response.unwrap().into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "second");
        server.join().unwrap();
    }

    /// An upstream that answers `ok` to every request and counts its open connections.
    async fn counting_upstream() -> (String, Arc<AtomicUsize>) {
        struct Open(Arc<AtomicUsize>);
        impl Drop for Open {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let open = Arc::new(AtomicUsize::new(0));
        let count = open.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                let open = Open(count.clone());
                tokio::spawn(async move {
                    let ok = service_fn(|_| async {
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("ok"))))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), ok)
                        .await;
                    drop(open);
                });
            }
        });
        (address, open)
    }

    async fn ok(pool: &Pool<Full<Bytes>>) {
        let response = send(pool).await.unwrap();
        assert_eq!(response.into_body().collect().await.unwrap().to_bytes(), "ok");
    }

    /// Waits up to a second for the upstream to see `expected` open connections.
    async fn open_becomes(open: &AtomicUsize, expected: usize) -> usize {
        for _ in 0..100 {
            if open.load(Ordering::SeqCst) == expected {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        open.load(Ordering::SeqCst)
    }

    /// Reuse keeps the most recent connection busy; the others are closed once idle for
    /// the limit, and so is the last one when no request comes at all.
    #[tokio::test]
    async fn idle_connections_close_at_the_limit_whether_or_not_the_pool_is_asked() {
        let (address, open) = counting_upstream().await;
        let limit = Duration::from_millis(300);
        let pool = Pool::with_idle_timeout(address, Duration::from_secs(1), None, limit);
        // Three at once: three connections, all idle afterwards.
        futures_util::future::join_all((0..3).map(|_| ok(&pool))).await;
        assert_eq!(open.load(Ordering::SeqCst), 3);
        let started = std::time::Instant::now();
        while started.elapsed() < limit * 3 {
            ok(&pool).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            open_becomes(&open, 1).await,
            1,
            "connections idle for three times the limit are still open"
        );
        tokio::time::sleep(limit).await;
        assert_eq!(
            open_becomes(&open, 0).await,
            0,
            "a connection idle past the limit is still open when no request came"
        );
    }
}
