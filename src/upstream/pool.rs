//! Keep-alive HTTP/1.1 connections to one upstream server, and sending a request on one
//! ([`super::exchange`]: floodgate's own HTTP/1.1 client, run in the request's task).
//!
//! A connection goes back to the pool when the response it carried has been read to its
//! end (by the client, or by [`discard`] for a response whose client left while a cap
//! counted the request), the whole request was written, and the server keeps it open; a
//! response dropped half-way takes its connection with it. Idle connections are kept for
//! [`IDLE_TIMEOUT`] ([`super::idle`]).
//!
//! A pooled connection the server closed meanwhile is noticed when taken, or when the
//! request written on it meets the close before any answer and before any of the request
//! body was read: the request then goes out on another connection. Any other failure is
//! the caller's.
//!
//! This replaces hyper's client, whose connection task, channels and response parsing
//! cost several thousand instructions per request more (docs/performance.md, "Choices
//! measured").

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONNECTION, HOST, USER_AGENT};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_util::either::Either;

use super::exchange::{Exchange, ExchangeError};
use super::idle::IdlePool;
use crate::proxy::request_body::RequestBody;

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
    Exchange(#[from] ExchangeError),
    #[error("no response headers in time")]
    Timeout,
}

/// TLS to a server: the client configuration and the name its certificate must have.
#[derive(Clone)]
pub(crate) struct Tls {
    pub(crate) connector: TlsConnector,
    pub(crate) server_name: ServerName<'static>,
}

/// A connection to an HTTP server, plain or over TLS.
pub(crate) type Connection = super::idle::Connection<Either<TcpStream, TlsStream<TcpStream>>>;

/// One upstream address and its idle connections.
pub(crate) struct Endpoint {
    /// `host:port`, as configured.
    address: String,
    connect_timeout: Duration,
    tls: Option<Tls>,
    idle: Arc<IdlePool<Connection>>,
}

impl Endpoint {
    pub(super) fn check_in(&self, connection: Connection) {
        self.idle.check_in(connection);
    }

    /// A new connection, its TLS handshake included, within `connect_timeout`, its timer
    /// set for `deadline`.
    async fn connect(&self, deadline: tokio::time::Instant) -> Result<Connection, SendError> {
        match tokio::time::timeout(self.connect_timeout, self.open()).await {
            Ok(Ok(stream)) => Ok(Connection::new(stream, deadline)),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(SendError::ConnectTimeout(self.address.clone())),
        }
    }

    async fn open(&self) -> Result<Either<TcpStream, TlsStream<TcpStream>>, SendError> {
        let address = &self.address;
        let stream = TcpStream::connect(address)
            .await
            .map_err(|source| SendError::Connect {
                address: address.to_owned(),
                source,
            })?;
        // Requests and responses are written whole; never wait to coalesce them.
        let _ = stream.set_nodelay(true);
        let Some(tls) = &self.tls else {
            return Ok(Either::Left(stream));
        };
        let stream = tls
            .connector
            .connect(tls.server_name.clone(), stream)
            .await
            .map_err(|source| SendError::Tls {
                address: address.to_owned(),
                source,
            })?;
        Ok(Either::Right(stream))
    }
}

/// The connections to one upstream server.
pub(crate) struct Pool {
    endpoint: Arc<Endpoint>,
}

/// Why a request failed, and the request itself when none of it was sent.
pub(crate) struct Unsent {
    pub(crate) error: SendError,
    pub(crate) request: Option<Request<RequestBody>>,
}

impl std::fmt::Debug for Unsent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unsent")
            .field("error", &self.error)
            .field("unsent", &self.request.is_some())
            .finish()
    }
}

impl Pool {
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

    /// An active check: the status of a `GET` for `target` on a connection of its own
    /// (closed when the check ends).
    pub(crate) async fn check(&self, target: &str) -> Option<StatusCode> {
        let deadline = tokio::time::Instant::now() + self.endpoint.connect_timeout;
        let connection = self.endpoint.connect(deadline).await.ok()?;
        let host = HeaderValue::from_str(&self.endpoint.address).ok()?;
        let request = Request::get(target)
            .header(HOST, host)
            .header(CONNECTION, "close")
            .header(USER_AGENT, "floodgate-health-check")
            .body(())
            .ok()?;
        let (parts, ()) = request.into_parts();
        let mut exchange = Exchange::new(connection, self.endpoint.clone(), &parts, RequestBody::empty());
        poll_fn(|cx| exchange.poll_head(cx))
            .await
            .ok()
            .map(|response| response.status())
    }

    /// Sends `request` (its target in origin form, its `Host` set) and waits for the
    /// response head until `deadline` (then [`SendError::Timeout`]). A request that was
    /// not sent (no connection could be made) comes back with the error.
    ///
    /// `keep` is what the request holds while the server works on it. With `detach` (a cap
    /// counts it), the server's work outlives a client that leaves: if this future is
    /// dropped before the response head and before `deadline` once the request is on its
    /// way, `keep` is taken, the answer awaited in a task of its own until `deadline`, the
    /// response read and discarded for at most `timeout` ([`discard`]), and only then is
    /// `keep` dropped.
    pub(crate) async fn send<K: Send + 'static>(
        &self,
        request: Request<RequestBody>,
        deadline: tokio::time::Instant,
        timeout: Duration,
        keep: &mut Option<K>,
        detach: bool,
    ) -> Result<Response<UpstreamBody>, Unsent> {
        let (parts, mut body) = request.into_parts();
        loop {
            let pooled = self
                .endpoint
                .idle
                .checkout(|connection| !connection.closed_while_idle());
            let reused = pooled.is_some();
            let connection = match pooled {
                Some(mut connection) => {
                    connection.deadline.as_mut().reset(deadline);
                    connection
                }
                None => {
                    match Box::pin(tokio::time::timeout_at(deadline, self.endpoint.connect(deadline))).await {
                        Ok(Ok(connection)) => connection,
                        Ok(Err(error)) => {
                            return Err(Unsent {
                                error,
                                request: Some(Request::from_parts(parts, body)),
                            });
                        }
                        Err(_elapsed) => return Err(timed_out()),
                    }
                }
            };
            let exchange = Box::new(Exchange::new(connection, self.endpoint.clone(), &parts, body));
            let mut detached = Detached {
                exchange: Some(exchange),
                keep: detach.then_some(&mut *keep),
                deadline,
                timeout,
            };
            let answer = poll_fn(|cx| {
                let exchange = detached.exchange.as_mut().expect("until answered");
                match exchange.poll_head(cx) {
                    Poll::Pending if exchange.poll_deadline(cx).is_ready() => Poll::Ready(Err(None)),
                    polled => polled.map_err(Some),
                }
            })
            .await;
            let exchange = detached.exchange.take().expect("until answered");
            match answer {
                Ok(response) => {
                    return Ok(response.map(|()| UpstreamBody {
                        exchange: Some(exchange),
                    }));
                }
                Err(Some(ExchangeError::Closed | ExchangeError::Io(_)))
                    if reused && exchange.unanswered_and_unread() =>
                {
                    body = exchange.into_body().expect("unread");
                }
                // Past the deadline the exchange is dropped, its connection closed.
                Err(None) => return Err(timed_out()),
                Err(Some(error)) => {
                    return Err(Unsent {
                        error: error.into(),
                        request: exchange.into_body().map(|body| Request::from_parts(parts, body)),
                    });
                }
            }
        }
    }
}

/// A try that ran out of time: what was sent of the request is lost.
fn timed_out() -> Unsent {
    Unsent {
        error: SendError::Timeout,
        request: None,
    }
}

/// An exchange awaited for its head; dropped before (its client left) with `keep` (a cap
/// counts the request) and before the deadline, it goes on in a task of its own.
struct Detached<'a, K: Send + 'static> {
    exchange: Option<Box<Exchange>>,
    keep: Option<&'a mut Option<K>>,
    deadline: tokio::time::Instant,
    timeout: Duration,
}

impl<K: Send + 'static> Drop for Detached<'_, K> {
    fn drop(&mut self) {
        let (Some(mut exchange), Some(keep)) = (self.exchange.take(), self.keep.take()) else {
            return;
        };
        let body = async move {
            poll_fn(|cx| exchange.poll_head(cx)).await.ok()?;
            Some(UpstreamBody {
                exchange: Some(exchange),
            })
        };
        go_on(body, keep, self.deadline, self.timeout);
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

/// A response body from an HTTP server, read from its exchange as the client takes it.
pub(crate) struct UpstreamBody {
    /// `None` once the exchange has been taken by a tunnel.
    exchange: Option<Box<Exchange>>,
}

impl UpstreamBody {
    /// The connection after a protocol switch, with what the server sent past its `101`.
    pub(crate) fn take_switched(&mut self) -> Option<Connection> {
        self.exchange.take()?.into_switched()
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = ExchangeError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.exchange.as_mut() {
            Some(exchange) => exchange
                .poll_data(cx)
                .map(|data| data.map(|data| data.map(Frame::data))),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.exchange.as_deref().is_none_or(Exchange::is_ended)
    }

    fn size_hint(&self) -> SizeHint {
        match self.exchange.as_deref() {
            Some(exchange) => exchange.size_hint(),
            None => SizeHint::with_exact(0),
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
    use hyper_util::rt::TokioIo;

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

    async fn send(pool: &Pool) -> Result<Response<UpstreamBody>, Unsent> {
        let timeout = Duration::from_secs(1);
        let deadline = tokio::time::Instant::now() + timeout;
        pool.send(request(), deadline, timeout, &mut None::<()>, false)
            .await
    }

    fn request() -> Request<RequestBody> {
        Request::get("/")
            .header("host", "app")
            .body(RequestBody::empty())
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

    async fn ok(pool: &Pool) {
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
