//! Keep-alive connections to one PHP-FPM server (TCP or a unix socket), and sending a
//! request on one.
//!
//! Each open connection holds a PHP-FPM worker, idle ones included, so the pool keeps at
//! most as many idle connections as the server's cap allows, and closes them sooner than
//! HTTP ones. A pooled connection PHP-FPM closed meanwhile is noticed when taken, or when
//! the request written on it meets the close before any answer: the request then goes
//! out on another connection if none of it was written, or if it is idempotent without a
//! body.

use std::future::poll_fn;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::{HeaderMap, Response, StatusCode};
use tokio::net::{TcpStream, UnixStream};
use tokio_util::either::Either;

use super::exchange::{Exchange, ExchangeError};
use super::{FastCgiBody, FastCgiHead};
use crate::proxy::request_body::RequestBody;
use crate::upstream::attempt::{Try, Unsent, attempt};
use crate::upstream::detach::Exchanging;
use crate::upstream::idle::{IdlePool, Opener, PoolError};
use crate::upstream::places::{ConnectionPlaces, Place};

/// How long an idle connection (and the PHP-FPM worker it holds) is kept.
const IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle connections kept per server without a cap.
const MAX_IDLE_UNCAPPED: usize = 16;

/// Where a PHP-FPM server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Address {
    /// `host:port`.
    Tcp(String),
    Unix(PathBuf),
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Tcp(address) => f.write_str(address),
            Address::Unix(path) => write!(f, "{}", path.display()),
        }
    }
}

/// A connection to PHP-FPM.
pub(crate) type Connection = crate::upstream::idle::Connection<Either<TcpStream, UnixStream>>;

/// Why a request got no response from PHP-FPM.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FastCgiError {
    #[error("cannot connect to {address}: {source}")]
    Connect { address: String, source: io::Error },
    #[error("cannot connect to {0}: no answer within the connect timeout")]
    ConnectTimeout(String),
    #[error("no response headers in time")]
    Timeout,
    #[error("no place for a connection to an upstream server")]
    NoPlace,
    #[error(transparent)]
    Exchange(#[from] ExchangeError),
}

/// One PHP-FPM server: its address, its idle connections, its stderr log.
pub(crate) struct Endpoint {
    address: Address,
    connect_timeout: Duration,
    idle: Arc<IdlePool<Connection>>,
    /// When stderr was last logged, in milliseconds since `started`.
    stderr_logged: AtomicU64,
    started: Instant,
}

impl Endpoint {
    /// Keeps `connection` for the next request, unless something it was sent is unread,
    /// or a request waits for a place (then it goes to one for this server, or closes:
    /// `IdlePool::check_in`).
    pub(super) fn check_in(&self, connection: Connection) {
        if connection.read.is_empty() {
            self.idle.check_in(connection);
        }
    }

    /// Logs what a script wrote to stderr, at most one line a second per server.
    pub(super) fn log_stderr(&self, text: &[u8]) {
        let now = self.started.elapsed().as_millis() as u64;
        let last = self.stderr_logged.load(Ordering::Relaxed);
        if now.saturating_sub(last) < 1000 && last != 0 {
            return;
        }
        if self
            .stderr_logged
            .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        let line = String::from_utf8_lossy(text);
        let line = line.lines().next().unwrap_or_default();
        tracing::warn!(target: "fastcgi", server = %self.address, stderr = %line, "PHP wrote to stderr");
    }

    /// A new connection in `place`, opened before `until`, its timer set for `deadline`.
    async fn open_in(
        &self,
        place: Place,
        until: tokio::time::Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Connection, FastCgiError> {
        let opened = match &self.address {
            Address::Tcp(address) => tokio::time::timeout_at(until, TcpStream::connect(address))
                .await
                .map(|stream| {
                    stream.map(|stream| {
                        let _ = stream.set_nodelay(true);
                        Either::Left(stream)
                    })
                }),
            Address::Unix(path) => tokio::time::timeout_at(until, UnixStream::connect(path))
                .await
                .map(|stream| stream.map(Either::Right)),
        };
        match opened {
            Ok(Ok(stream)) => Ok(Connection::new(stream, place, deadline)),
            Ok(Err(source)) => Err(FastCgiError::Connect {
                address: self.address.to_string(),
                source,
            }),
            Err(_) => Err(FastCgiError::ConnectTimeout(self.address.to_string())),
        }
    }
}

/// The connections to one PHP-FPM server.
pub(crate) struct Pool {
    endpoint: Arc<Endpoint>,
}

impl Pool {
    /// A pool for `address` that keeps at most `max_idle` idle connections (the server's
    /// cap; `None`: no cap), its connections in `places`.
    pub(crate) fn new(
        address: Address,
        connect_timeout: Duration,
        max_idle: Option<usize>,
        places: &Arc<ConnectionPlaces>,
    ) -> Self {
        let idle = IdlePool::new(IDLE_TIMEOUT, max_idle.unwrap_or(MAX_IDLE_UNCAPPED), places);
        Pool {
            endpoint: Arc::new(Endpoint {
                address,
                connect_timeout,
                idle,
                stderr_logged: AtomicU64::new(0),
                started: Instant::now(),
            }),
        }
    }

    /// An active check: the status of a `GET` for the script `path` (PHP-FPM's
    /// `ping.path`, a status page, or a script) on a connection of its own.
    pub(crate) async fn check(&self, path: &str) -> Option<http::StatusCode> {
        let deadline = tokio::time::Instant::now() + self.endpoint.connect_timeout;
        let connection = self
            .endpoint
            .open_in(Place::uncounted(), deadline, deadline)
            .await
            .ok()?;
        let head = super::params::check_head(path);
        let mut exchange = Exchange::new(
            connection,
            self.endpoint.clone(),
            head.freeze(),
            RequestBody::empty(),
        );
        poll_fn(|cx| exchange.poll_head(cx))
            .await
            .ok()
            .map(|(status, _)| status)
    }

    /// Sends the request whose begin and parameter records are `head`, naming the plan's
    /// span as the try's in its `traceparent` ([`FastCgiHead::for_try`], on each
    /// connection), with its body, and waits for the response head until its deadline
    /// (then [`FastCgiError::Timeout`]); its `keep`, with `detach`, is what the request
    /// holds while PHP works on it: dropped before the answer (its client left), the
    /// exchange goes on in a task of its own until the deadline, its answer read and
    /// discarded for at most `timeout`, and only then is `keep` dropped.
    pub(crate) async fn send<K: Send + 'static>(
        &self,
        head: &FastCgiHead,
        plan: Try<'_, K>,
    ) -> Result<Response<FastCgiBody>, Unsent<FastCgiError>> {
        let endpoint = &self.endpoint;
        let span = plan.span;
        let (exchange, (status, headers)) = attempt(
            &endpoint.idle,
            Opener {
                timeout: endpoint.connect_timeout,
                open: |place, until, deadline| endpoint.open_in(place, until, deadline),
            },
            |connection, body| {
                Box::new(Exchange::new(
                    connection,
                    endpoint.clone(),
                    head.for_try(span),
                    body,
                ))
            },
            plan,
        )
        .await?;
        let mut response = Response::new(exchange.into_response_body());
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        Ok(response)
    }
}

impl PoolError for FastCgiError {
    fn no_place() -> Self {
        FastCgiError::NoPlace
    }

    fn timed_out() -> Self {
        FastCgiError::Timeout
    }
}

impl Exchanging for Exchange {
    type Head = (StatusCode, HeaderMap);
    type Error = ExchangeError;
    type Body = FastCgiBody;

    fn poll_head(&mut self, cx: &mut Context<'_>) -> Poll<Result<(StatusCode, HeaderMap), ExchangeError>> {
        Exchange::poll_head(self, cx)
    }

    /// A body PHP-FPM gets was read whole first: the deadline runs from the start.
    fn poll_deadline(&mut self, cx: &mut Context<'_>, _: Duration) -> Poll<()> {
        Exchange::poll_deadline(self, cx)
    }

    fn deadline(&self) -> Option<tokio::time::Instant> {
        Exchange::deadline(self)
    }

    fn into_response_body(self: Box<Self>) -> FastCgiBody {
        FastCgiBody { exchange: Some(self) }
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
