//! Keep-alive HTTP/1.1 connections to one upstream server, and sending a request on one
//! ([`super::exchange`]: floodgate's own HTTP/1.1 client, run in the request's task).
//!
//! A connection goes back to the pool when the response it carried has been read to its
//! end (by the client, or by [`detach::discard`] for a response whose client left while
//! a cap counted the request), the whole request was written, and the server keeps it open; a
//! response dropped half-way takes its connection with it. Idle connections are kept for
//! [`IDLE_TIMEOUT`] ([`super::idle`]).
//!
//! A pooled connection the server closed meanwhile is noticed when taken, or when the
//! request written on it meets the close before any answer: the request then goes out on
//! another connection if none of it was written, or if it is idempotent without a body.
//! Any other failure is the caller's.
//!
//! This replaces hyper's client, whose connection task, channels and response parsing
//! cost several thousand instructions per request more (docs/performance.md, "Choices
//! measured").

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONNECTION, HOST, USER_AGENT};
use http::{HeaderValue, Method, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_util::either::Either;

use super::attempt::{Try, Unsent, attempt};
use super::detach::Exchanging;
use super::exchange::{Exchange, ExchangeError};
use super::h1::HttpHead;
use super::idle::{IdlePool, Opener, PoolError};
use super::places::{ConnectionPlaces, Place};
use crate::proxy::request_body::RequestBody;
use crate::trace::context::SpanId;

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
    #[error("no place for a connection to an upstream server")]
    NoPlace,
}

/// TLS to a server: the client configuration and the name its certificate must have.
#[derive(Clone)]
pub(crate) struct Tls {
    pub(crate) connector: TlsConnector,
    pub(crate) server_name: ServerName<'static>,
}

/// A connection to an HTTP server, plain or over TLS. A TLS session is boxed: it is a
/// few hundred bytes, which every move of a plain connection (into the exchange, back
/// into the pool) would otherwise copy too.
pub(crate) type Connection = super::idle::Connection<Stream>;

/// A connection's byte stream.
type Stream = Either<TcpStream, Box<TlsStream<TcpStream>>>;

/// One upstream address and its idle connections.
pub(crate) struct Endpoint {
    /// `host:port`, as configured.
    address: String,
    connect_timeout: Duration,
    tls: Option<Tls>,
    idle: Arc<IdlePool<Connection>>,
}

impl Endpoint {
    /// Keeps `connection` for the next request, unless a request waits for a place (then
    /// it goes to one for this server, or closes: `IdlePool::check_in`).
    pub(super) fn check_in(&self, connection: Connection) {
        self.idle.check_in(connection);
    }

    /// A new connection in `place`, opened before `until`, its timer set for `deadline`.
    async fn open_in(
        &self,
        place: Place,
        until: tokio::time::Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Connection, SendError> {
        match tokio::time::timeout_at(until, self.open()).await {
            Ok(Ok(stream)) => Ok(Connection::new(stream, place, deadline)),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(SendError::ConnectTimeout(self.address.clone())),
        }
    }

    async fn open(&self) -> Result<Stream, SendError> {
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
        Ok(Either::Right(Box::new(stream)))
    }
}

/// The connections to one upstream server.
pub(crate) struct Pool {
    endpoint: Arc<Endpoint>,
}

impl Pool {
    /// A pool for `address` (`host:port`), over TLS with `tls`, its connections in
    /// `places`.
    pub(crate) fn new(
        address: String,
        connect_timeout: Duration,
        tls: Option<Tls>,
        places: &Arc<ConnectionPlaces>,
    ) -> Self {
        Pool::with_idle_timeout(address, connect_timeout, tls, places, IDLE_TIMEOUT)
    }

    /// A pool that keeps idle connections for `idle_timeout` (tests: a short one).
    fn with_idle_timeout(
        address: String,
        connect_timeout: Duration,
        tls: Option<Tls>,
        places: &Arc<ConnectionPlaces>,
        idle_timeout: Duration,
    ) -> Self {
        let idle = IdlePool::new(idle_timeout, MAX_IDLE, places);
        Pool {
            endpoint: Arc::new(Endpoint {
                address,
                connect_timeout,
                tls,
                idle,
            }),
        }
    }

    /// An active check: the status of a `GET` for `target` on a connection of its own
    /// (closed when the check ends).
    pub(crate) async fn check(&self, target: &str) -> Option<StatusCode> {
        let deadline = tokio::time::Instant::now() + self.endpoint.connect_timeout;
        let connection = self
            .endpoint
            .open_in(Place::uncounted(), deadline, deadline)
            .await
            .ok()?;
        let mut head = HttpHead::writer(&Method::GET, &[target], 3);
        head.header(&HOST, &HeaderValue::from_str(&self.endpoint.address).ok()?);
        head.header(&CONNECTION, &HeaderValue::from_static("close"));
        head.header(&USER_AGENT, &HeaderValue::from_static("floodgate-health-check"));
        let head = head.finish(None);
        let span = SpanId([0; 8]);
        let mut exchange = Exchange::new(
            connection,
            self.endpoint.clone(),
            (&head, &span),
            RequestBody::empty(),
        );
        poll_fn(|cx| exchange.poll_head(cx))
            .await
            .ok()
            .map(|response| response.status())
    }

    /// Sends the request whose head is `head`, naming the plan's span as the try's in its
    /// `traceparent`, with its body, and waits for the response head until the plan's
    /// deadline, or later as the exchange moves it on while the body goes out (then
    /// [`SendError::Timeout`]). A request that did not reach the server comes back
    /// with the error; on a pooled connection the server had closed, it goes out again on
    /// another when nothing of it reached the server or it is `repeatable` (idempotent,
    /// without a body).
    ///
    /// The plan's `keep` is what the request holds while the server works on it. With
    /// `detach` (a cap counts it), the server's work outlives a client that leaves
    /// ([`detach::head`]).
    pub(crate) async fn send<K: Send + 'static>(
        &self,
        head: &HttpHead,
        plan: Try<'_, K>,
    ) -> Result<Response<UpstreamBody>, Unsent<SendError>> {
        let endpoint = &self.endpoint;
        let span = plan.span;
        let (exchange, response) = attempt(
            &endpoint.idle,
            Opener {
                timeout: endpoint.connect_timeout,
                open: |place, until, deadline| endpoint.open_in(place, until, deadline),
            },
            |connection, body| Box::new(Exchange::new(connection, endpoint.clone(), (head, span), body)),
            plan,
        )
        .await?;
        Ok(response.map(|()| exchange.into_response_body()))
    }
}

impl PoolError for SendError {
    fn no_place() -> Self {
        SendError::NoPlace
    }

    fn timed_out() -> Self {
        SendError::Timeout
    }
}

impl Exchanging for Exchange {
    type Head = Response<()>;
    type Error = ExchangeError;
    type Body = UpstreamBody;

    fn poll_head(&mut self, cx: &mut Context<'_>) -> Poll<Result<Response<()>, ExchangeError>> {
        Exchange::poll_head(self, cx)
    }

    fn poll_deadline(&mut self, cx: &mut Context<'_>, timeout: Duration) -> Poll<()> {
        Exchange::poll_deadline(self, cx, timeout)
    }

    fn deadline(&self) -> Option<tokio::time::Instant> {
        Exchange::deadline(self)
    }

    fn into_response_body(self: Box<Self>) -> UpstreamBody {
        UpstreamBody { exchange: Some(self) }
    }

    fn closed(error: &ExchangeError) -> bool {
        matches!(error, ExchangeError::Closed | ExchangeError::Io(_))
    }

    fn unanswered(&self) -> bool {
        Exchange::unanswered(self)
    }

    fn untouched(&self) -> bool {
        Exchange::untouched(self)
    }

    fn into_body(self: Box<Self>) -> Option<RequestBody> {
        Exchange::into_body(self)
    }
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

    /// A connection and its exchange move on every request (out of the pool, into the
    /// exchange, back): they stay small, a TLS session boxed apart. (An exchange holds
    /// the head its tries share and the head's end, 64 bytes, which spare a copy of the
    /// head per request.)
    #[test]
    fn a_connection_and_its_exchange_stay_small() {
        let connection = std::mem::size_of::<Connection>();
        let exchange = std::mem::size_of::<Exchange>();
        assert!(connection <= 104, "a connection is {connection} bytes");
        assert!(exchange <= 424, "an exchange is {exchange} bytes");
    }

    /// A server that answers before it has read the request and closes at once (a reset):
    /// the request cannot be written, but the answer it sent is what the client gets.
    #[tokio::test]
    async fn an_answer_sent_before_a_reset_is_read_though_the_request_could_not_be_written() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = Pool::new(
            listener.local_addr().unwrap().to_string(),
            Duration::from_secs(1),
            None,
            &ConnectionPlaces::new(8),
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        let (connection, accepted) = tokio::join!(
            pool.endpoint.open_in(Place::uncounted(), deadline, deadline),
            listener.accept()
        );
        let (mut server, _) = accepted.unwrap();
        tokio::io::AsyncWriteExt::write_all(
            &mut server,
            b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 0\r\n\r\n",
        )
        .await
        .unwrap();
        #[allow(deprecated)]
        server.set_linger(Some(Duration::ZERO)).unwrap();
        drop(server);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut head = HttpHead::writer(&Method::POST, &["/upload"], 1);
        head.header(&HOST, &HeaderValue::from_static("app"));
        let head = head.finish(None);
        let span = SpanId([1; 8]);
        let mut exchange = Exchange::new(
            connection.unwrap(),
            pool.endpoint.clone(),
            (&head, &span),
            RequestBody::empty(),
        );
        let answer = poll_fn(|cx| exchange.poll_head(cx)).await;
        assert_eq!(
            answer.map(|response| response.status()).ok(),
            Some(StatusCode::PAYLOAD_TOO_LARGE)
        );
    }

    /// Reads one request head from `stream`.
    fn read_head(stream: &mut TcpStream) {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            assert_eq!(stream.read(&mut byte).unwrap(), 1, "request head");
            head.push(byte[0]);
        }
    }

    async fn send(pool: &Pool) -> Response<UpstreamBody> {
        let timeout = Duration::from_secs(1);
        let deadline = tokio::time::Instant::now() + timeout;
        let mut head = HttpHead::writer(&Method::GET, &["/"], 1);
        head.header(&HOST, &HeaderValue::from_static("app"));
        let head = head.finish(None);
        let span = SpanId([1; 8]);
        let mut keep = None::<()>;
        let sent = pool.send(
            &head,
            Try {
                span: &span,
                body: RequestBody::empty(),
                repeatable: true,
                deadline,
                timeout,
                keep: &mut keep,
                detach: false,
                reached: None,
            },
        );
        match sent.await {
            Ok(response) => response,
            Err(unsent) => panic!("{}", unsent.error),
        }
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

        let pool = Pool::new(address, Duration::from_secs(1), None, &ConnectionPlaces::new(8));
        let response = send(&pool).await;
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "first");
        closed_tx.send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        closed_tx.send(()).unwrap();
        let response = send(&pool).await;
        let body = response.into_body().collect().await.unwrap().to_bytes();
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
        let response = send(pool).await;
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
        let pool = Pool::with_idle_timeout(
            address,
            Duration::from_secs(1),
            None,
            &ConnectionPlaces::new(8),
            limit,
        );
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
