//! Listeners and connections: accepts clients (HTTP/1.1 and h2c on one port; HTTPS with
//! HTTP/2 or HTTP/1.1 by ALPN on `server.tls.listen`), applies
//! connection-level limits (a connection with no request in flight for
//! `server.header_timeout` is closed, see `connection`; a write to the client without
//! progress for `server.send_timeout` closes it; head sizes), serves the
//! admin listener, and shuts down gracefully: stop accepting, let in-flight requests
//! finish within `server.shutdown_grace`, then return.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin;
use crate::client_ip::Peer;
use crate::config::Config;
use crate::connection::disconnect::{ClientSocket, Watched};
use crate::connection::framing::{AnswerRefusal, FramingGuard, HeadLimits, HeadRefusal, Protocol};
use crate::connection::send_timeout::SendTimeout;
use crate::connection::{ConnectionState, serve_until_idle};
use crate::logging::LogThrottle;
use crate::metrics::Metrics;
use crate::room::Room;
use crate::service::request_head::MAX_HEADER_BYTES;
use crate::service::state::GatewayState;
use crate::service::{Instance, handle};
use crate::upstream::places::ConnectionPlaces;
use crate::workers::Workers;

/// What the protocols' own parsers accept at most, above the service's limit on header
/// bytes ([`MAX_HEADER_BYTES`], the same for both) so that the service decides: room for
/// the request line besides for HTTP/1.1 (hyper's read buffer, which holds a whole head);
/// HTTP/2 counts 32 bytes more per field (RFC 9113 §6.5.2), so the smallest fields (`a:`,
/// 5 bytes as HTTP/1.1 writes them) take 33.
const MAX_HTTP1_HEAD: usize = 2 * MAX_HEADER_BYTES;
const MAX_HTTP2_HEADER_LIST: u32 = (MAX_HEADER_BYTES as u32 / 5) * 33 + 4096;
/// Fields an HTTP/1.1 head may hold: as many as fit in [`MAX_HEADER_BYTES`] (`a:` and its
/// line end take 4 bytes), so that heads are limited by size alone. hyper is given room
/// for fewer: the framing guard folds the rest ([`crate::connection::fold`]).
const MAX_HTTP1_FIELDS: usize = MAX_HEADER_BYTES / 4;
pub(crate) const HTTP1_LIMITS: HeadLimits = HeadLimits {
    bytes: MAX_HTTP1_HEAD,
    fields: MAX_HTTP1_FIELDS,
};

/// How long a starting gateway waits for Redis before serving under `on_error`, and for
/// its stored ACME certificate.
const STORE_STARTUP_WAIT: Duration = Duration::from_secs(1);

/// A bound, not yet serving, gateway instance.
pub struct Gateway {
    shared: Arc<Instance>,
    listener: TcpListener,
    tls_listener: Option<TcpListener>,
    admin_listener: TcpListener,
    /// The worker threads; `None` for one worker, which is the thread that accepts.
    workers: Option<Workers>,
    /// How many client connections may be open at once.
    connection_cap: usize,
}

impl Gateway {
    /// Binds the proxy and admin listeners of `config`.
    pub async fn bind(config: Config) -> io::Result<Gateway> {
        let listener = bind(config.server.listen, "server.listen").await?;
        let admin_listener = bind(config.server.admin_listen, "server.admin_listen").await?;
        let tls_listener = match &config.server.tls {
            Some(tls) => Some(bind(tls.listen, "server.tls.listen").await?),
            None => None,
        };
        let workers = start_workers(config.server.workers).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot start the worker threads (server.workers): {e}"),
            )
        })?;
        let metrics = Arc::new(Metrics::new());
        let open_files = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
        let connection_cap = connection_cap(config.server.max_connections, open_files);
        let upstream_places = ConnectionPlaces::new(upstream_connections(connection_cap, open_files));
        let state = GatewayState::new(config, &metrics, upstream_places)
            .map_err(|e| io::Error::other(format!("cannot set up the rate-limit store: {e}")))?;
        state.store.wait_ready(STORE_STARTUP_WAIT).await;
        if let Some(acme) = &state.acme {
            acme.wait_stored(STORE_STARTUP_WAIT).await;
        }
        Ok(Gateway {
            shared: Arc::new(Instance::new(
                state,
                metrics,
                tls_listener
                    .as_ref()
                    .and_then(|listener| listener.local_addr().ok())
                    .map(|addr| addr.port()),
                Room::for_connections(connection_cap),
            )),
            connection_cap,
            listener,
            tls_listener,
            admin_listener,
            workers,
        })
    }

    /// The threads that serve connections.
    pub fn workers(&self) -> usize {
        self.workers.as_ref().map_or(1, Workers::count)
    }

    /// The HTTPS listener's address, with `[server.tls]`.
    pub fn tls_addr(&self) -> Option<SocketAddr> {
        self.tls_listener
            .as_ref()
            .map(|listener| listener.local_addr().expect("a bound listener has an address"))
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    pub fn shared(&self) -> &Arc<Instance> {
        &self.shared
    }

    /// Serves until `shutdown` completes, then drains and returns.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        let Gateway {
            shared,
            listener,
            tls_listener,
            admin_listener,
            workers,
            connection_cap,
        } = self;
        let workers = workers.map(Arc::new);
        let connections = TaskTracker::new();
        let closing = CancellationToken::new();
        let admin = tokio::spawn(admin::serve(admin_listener, shared.clone()));
        let room = Arc::new(ConnectionRoom::new(
            connection_cap,
            shared.metrics.client_connections().clone(),
        ));

        let secure = async {
            match tls_listener {
                Some(listener) => {
                    accept_loop(
                        listener,
                        true,
                        shared.clone(),
                        workers.clone(),
                        (connections.clone(), room.clone()),
                        closing.clone(),
                    )
                    .await
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = shutdown => {}
            () = accept_loop(listener, false, shared.clone(), workers.clone(), (connections.clone(), room.clone()), closing.clone()) => {}
            () = secure => {}
        }
        shared.draining.store(true, Ordering::SeqCst);
        // Read now, so that a reload's shutdown_grace applies.
        let grace = shared.state.load().config.server.shutdown_grace;
        tracing::info!(in_flight = connections.len(), grace = ?grace, "shutting down: no longer accepting, draining");
        closing.cancel();
        connections.close();
        if tokio::time::timeout(grace, connections.wait()).await.is_err() {
            tracing::warn!(
                open = connections.len(),
                "shutdown grace elapsed; closing the remaining connections"
            );
        }
        admin.abort();
        // Stops the workers, with whatever connections outlived the grace: joining their
        // threads blocks, so not on this runtime's.
        if let Some(workers) = workers {
            let _ = tokio::task::spawn_blocking(move || drop(workers)).await;
        }
        let tracer = shared.state.load().tracer.clone();
        if let Some(tracer) = tracer {
            tracer.flush(TRACE_FLUSH).await;
        }
        tracing::info!("shut down");
    }
}

/// The worker threads for `server.workers` (`0`: one per CPU core); `None` for one worker,
/// which is the thread that accepts.
fn start_workers(configured: usize) -> io::Result<Option<Workers>> {
    let count = match configured {
        0 => std::thread::available_parallelism().map_or(1, |cores| cores.get()),
        count => count,
    };
    if count == 1 {
        return Ok(None);
    }
    Workers::start(count).map(Some)
}

/// How long the spans still queued at shutdown may take to go out.
const TRACE_FLUSH: Duration = Duration::from_secs(5);

async fn bind(addr: SocketAddr, key: &str) -> io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| io::Error::new(e.kind(), format!("cannot listen on {addr} ({key}): {e}")))
}

/// hyper's servers for the two protocols a connection may speak.
struct Builders {
    http1: http1::Builder,
    http2: http2::Builder<BoxedTasks>,
}

/// Runs each HTTP/2 stream as a task whose future is boxed before it is spawned: the
/// stream's future holds its request's (several KB), which `tokio::spawn` would otherwise
/// move whole several times on its way into the task.
#[derive(Clone, Copy)]
struct BoxedTasks;

impl<F> hyper::rt::Executor<F> for BoxedTasks
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, future: F) {
        tokio::spawn(Box::pin(future));
    }
}

fn connection_builders() -> Builders {
    let http1 = http1_builder();
    let mut http2 = http2::Builder::new(BoxedTasks);
    http2
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_HTTP2_HEADER_LIST);
    Builders { http1, http2 }
}

/// hyper's HTTP/1 server as floodgate runs it.
pub(crate) fn http1_builder() -> http1::Builder {
    let mut http1 = http1::Builder::new();
    // Slow heads are bounded by the connection's idle limit, the same for both protocols.
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_buf_size(HTTP1_LIMITS.bytes);
    http1
}

/// Raises the soft limit on open files to the hard one, as Go's runtime does: each client
/// connection takes a descriptor (two while it is forwarded), and the soft limit a
/// service manager sets (1,024 by default under systemd) would otherwise be a cap on
/// connections that a few hundred slow clients reach. Returns the limits before and
/// after, when raised.
pub fn raise_open_file_limit() -> Option<(u64, Option<u64>)> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let soft = limit.current?;
    if limit.maximum.is_some_and(|hard| hard <= soft) {
        return None;
    }
    let raised = rustix::process::Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    setrlimit(Resource::Nofile, raised).ok()?;
    Some((soft, limit.maximum))
}

/// How many client connections may be open at once: `configured`
/// (`server.max_connections`), or half the `open_files` limit (none: no cap), so that
/// the connections clients' requests open upstream, the site's files and the admin
/// listener still find descriptors when clients have taken their share.
fn connection_cap(configured: Option<usize>, open_files: Option<u64>) -> usize {
    configured.unwrap_or_else(|| {
        open_files.map_or(Semaphore::MAX_PERMITS, |files| {
            usize::try_from(files / 2)
                .unwrap_or(usize::MAX)
                .clamp(1, Semaphore::MAX_PERMITS)
        })
    })
}

/// Descriptors left for what is neither a client's, an upstream's nor a request's file:
/// listeners, the admin listener's clients, Redis, health checks, the runtime's own.
const RESERVED_DESCRIPTORS: u64 = 64;

/// How many connections to upstream servers may be open at once: one per client
/// connection of `connection_cap`, but no more than the `open_files` limit leaves once
/// the clients, the room's files ([`Room::for_connections`]) and [`RESERVED_DESCRIPTORS`]
/// have theirs; never fewer than half as many as client connections (a `max_connections`
/// set near the limit would otherwise leave the upstreams a handful).
fn upstream_connections(connection_cap: usize, open_files: Option<u64>) -> usize {
    let Some(files) = open_files else {
        return connection_cap;
    };
    let clients = connection_cap as u64;
    let room = 2 * Room::places_of_a_kind(connection_cap) as u64;
    let left = files.saturating_sub(clients + room + RESERVED_DESCRIPTORS);
    let places = left.max(clients / 2).min(clients);
    usize::try_from(places).unwrap_or(connection_cap).max(1)
}

/// Room for client connections on the proxy listeners (`server.max_connections`): while
/// it is full they accept no more, and new connections wait in the kernel's queue until
/// one closes, as HAProxy's `maxconn` does.
struct ConnectionRoom {
    places: Arc<Semaphore>,
    cap: usize,
    open: Gauge,
    /// Saying that the room is full.
    warned: LogThrottle,
}

impl ConnectionRoom {
    fn new(cap: usize, open: Gauge) -> ConnectionRoom {
        ConnectionRoom {
            places: Arc::new(Semaphore::new(cap)),
            cap,
            open,
            warned: LogThrottle::default(),
        }
    }

    /// A place for the next connection, once there is one.
    async fn place(&self) -> OwnedSemaphorePermit {
        if let Ok(place) = self.places.clone().try_acquire_owned() {
            return place;
        }
        if self.warned.ready() {
            tracing::warn!(
                max_connections = self.cap,
                "server.max_connections reached: new connections wait until one closes (logged once a minute at most)"
            );
        }
        self.places
            .clone()
            .acquire_owned()
            .await
            .expect("the places are never closed")
    }
}

/// An accepted connection's place in the [`ConnectionRoom`], given back when it closes.
struct Place {
    _permit: OwnedSemaphorePermit,
    open: Gauge,
}

impl Place {
    fn taken(permit: OwnedSemaphorePermit, open: &Gauge) -> Place {
        open.inc();
        Place {
            _permit: permit,
            open: open.clone(),
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.open.dec();
    }
}

/// Accepts connections on `listener` (the HTTPS one when `secure`) while `room` has
/// room, until dropped, and serves each on one of `workers`, or on this thread.
async fn accept_loop(
    listener: TcpListener,
    secure: bool,
    shared: Arc<Instance>,
    workers: Option<Arc<Workers>>,
    (connections, room): (TaskTracker, Arc<ConnectionRoom>),
    closing: CancellationToken,
) {
    let builders = Arc::new(connection_builders());
    let local_port = listener.local_addr().map_or(0, |address| address.port());
    let (mut last_warned, mut failed_accepts) = (None, 0u64);
    loop {
        let permit = room.place().await;
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning, and
                // say so once a second at most.
                failed_accepts += 1;
                if last_warned.is_none_or(|at: Instant| at.elapsed() >= Duration::from_secs(1)) {
                    tracing::warn!(error = %e, failed = failed_accepts, "accept failed (logged once a second at most)");
                    last_warned = Some(Instant::now());
                    failed_accepts = 0;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Read per connection, so that a reload's timeouts apply to new ones.
        let timeouts = {
            let server = &shared.state.load().config.server;
            Timeouts {
                idle: server.header_timeout,
                send: server.send_timeout,
            }
        };
        let place = Place::taken(permit, &room.open);
        let peer = Arc::new(Peer::new(peer, local_port, secure));
        let (shared, builders, closing) = (shared.clone(), builders.clone(), closing.clone());
        let Some(workers) = &workers else {
            // Boxed: the connection's future is several KB, and a task moves its future
            // (into the tracker's wrapper, into the task, and its stage again when it ends)
            // where it moves a box's pointer.
            connections.spawn(Box::pin(serve_connection(
                stream, peer, shared, builders, closing, timeouts, place,
            )));
            continue;
        };
        // Registered again with the worker's runtime, which then waits on its events.
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(e) => {
                tracing::debug!(error = %e, "cannot hand an accepted connection to a worker");
                continue;
            }
        };
        workers.spawn(&connections, async move {
            match TcpStream::from_std(stream) {
                Ok(stream) => {
                    Box::pin(serve_connection(
                        stream, peer, shared, builders, closing, timeouts, place,
                    ))
                    .await
                }
                Err(e) => tracing::debug!(error = %e, "a worker cannot take a connection"),
            }
        });
    }
}

/// A connection's timeouts, from the configuration it was accepted under.
#[derive(Debug, Clone, Copy)]
struct Timeouts {
    /// `server.header_timeout`: the longest time without a request in flight.
    idle: Duration,
    /// `server.send_timeout`.
    send: Duration,
}

async fn serve_connection(
    stream: TcpStream,
    peer: Arc<Peer>,
    shared: Arc<Instance>,
    builders: Arc<Builders>,
    closing: CancellationToken,
    timeouts: Timeouts,
    _place: Place,
) {
    let _ = stream.set_nodelay(true);
    let (stream, socket) = Watched::new(stream);
    if peer.tls {
        // Boxed: a plain connection's future need not have room for a handshake and a TLS
        // stream.
        Box::pin(serve_tls(
            stream,
            peer,
            socket.clone(),
            shared,
            builders,
            closing,
            timeouts,
        ))
        .await;
    } else {
        serve_http(stream, peer, socket.clone(), shared, &builders, closing, timeouts).await;
    }
    socket.linger().await;
}

/// Serves a connection to the HTTPS listener: its handshake, then HTTP over TLS.
async fn serve_tls(
    stream: Watched,
    peer: Arc<Peer>,
    socket: Arc<ClientSocket>,
    shared: Arc<Instance>,
    builders: Arc<Builders>,
    closing: CancellationToken,
    timeouts: Timeouts,
) {
    // A reload that removed [server.tls] leaves the listener (restart-only) without
    // certificates: its connections are closed.
    let Some(handshakes) = shared.state.load().tls.clone() else {
        return;
    };
    // A handshake is bounded like a request head.
    match tokio::time::timeout(timeouts.idle, handshakes.accept(stream)).await {
        Ok(Ok(Some(stream))) => serve_http(stream, peer, socket, shared, &builders, closing, timeouts).await,
        // A tls-alpn-01 challenge, answered.
        Ok(Ok(None)) => {}
        Ok(Err(error)) => {
            shared.metrics.record_tls_handshake_error();
            crate::tls::log_handshake_failure(peer.address, &error);
        }
        Err(_elapsed) => {
            shared.metrics.record_tls_handshake_error();
            let error = io::Error::new(
                io::ErrorKind::TimedOut,
                "not finished within server.header_timeout",
            );
            crate::tls::log_handshake_failure(peer.address, &error);
        }
    }
}

/// floodgate's answer to a head the framing guard refused on a connection from `peer`.
struct RefusalAnswer {
    shared: Arc<Instance>,
    peer: Arc<Peer>,
}

impl AnswerRefusal for RefusalAnswer {
    fn answer(&self, refusal: HeadRefusal) -> Bytes {
        self.shared.answer_unparsed_head(&self.peer, refusal)
    }
}

/// Serves HTTP/1.1 or HTTP/2 on `stream` until the connection ends.
async fn serve_http<S>(
    stream: S,
    tcp_peer: Arc<Peer>,
    socket: Arc<ClientSocket>,
    shared: Arc<Instance>,
    builders: &Builders,
    closing: CancellationToken,
    timeouts: Timeouts,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let peer = tcp_peer.address;
    let idle_limit = timeouts.idle;
    let connection_state = ConnectionState::on(socket.clone());
    let mut guard = FramingGuard::new(
        SendTimeout::new(stream, timeouts.send),
        HTTP1_LIMITS,
        connection_state.clone(),
        RefusalAnswer {
            shared: shared.clone(),
            peer: tcp_peer.clone(),
        },
    );
    // Its first bytes tell the protocol; a client that sends none within the idle limit,
    // or until shutdown, is let go.
    let protocol = tokio::select! {
        protocol = guard.protocol() => protocol,
        () = tokio::time::sleep(idle_limit) => return,
        () = closing.cancelled() => return,
    };
    let protocol = match protocol {
        Ok(protocol) => protocol,
        Err(e) => {
            tracing::debug!(%peer, error = %e, "connection ended before a request");
            return;
        }
    };
    let io = TokioIo::new(guard);
    let requests = connection_state.clone();
    let service = service_fn(|request| {
        handle(
            shared.clone(),
            tcp_peer.clone(),
            socket.clone(),
            requests.begin(),
            request,
        )
    });
    let result = match protocol {
        Protocol::Http1 => {
            let connection = builders.http1.serve_connection(io, service).with_upgrades();
            serve_until_idle(
                connection,
                &connection_state,
                (idle_limit, None),
                closing.cancelled(),
                peer,
            )
            .await
        }
        Protocol::Http2 => {
            // Boxed: HTTP/2's connection state is the larger, and every HTTP/1 connection's
            // task would otherwise be sized for it (idle connections: docs/performance.md#memory).
            let connection = Box::pin(builders.http2.serve_connection(io, service));
            connection_state.watch_http2_stalls();
            serve_until_idle(
                connection,
                &connection_state,
                (idle_limit, Some(timeouts.send)),
                closing.cancelled(),
                peer,
            )
            .await
        }
    };
    if let Err(e) = result {
        ended_with(&e, &shared, &tcp_peer);
    }
    if let Some(relay) = connection_state.take_tunnel() {
        relay.await;
    }
}

/// Logs how a connection from `peer` ended with `error`, and counts the head hyper
/// answered itself if that is why. Out of line: it would otherwise be inlined into every
/// connection's future, whose poll then stopped being inlined itself (+60 instructions a
/// request, callgrind).
#[cold]
#[inline(never)]
fn ended_with(error: &hyper::Error, shared: &Instance, peer: &Peer) {
    tracing::debug!(peer = %peer.address, %error, "connection ended with an error");
    if let Some(status) = answered_by_hyper(error) {
        shared.record_unparsed_head(peer, status);
    }
}

/// The status hyper's HTTP/1 server answered a request head it could not parse with (its
/// `Server::on_error`: `431` for a head too large, `400` for the rest; a head too large is
/// refused before hyper by floodgate's own limits, which answer it themselves).
fn answered_by_hyper(error: &hyper::Error) -> Option<u16> {
    if error.is_parse_too_large() {
        Some(431)
    } else if error.is_parse() && !error.is_parse_version_h2() && !error.is_parse_status() {
        Some(400)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_may_take_half_the_open_files_unless_configured() {
        assert_eq!(connection_cap(Some(300), Some(1024)), 300);
        assert_eq!(connection_cap(None, Some(1024)), 512);
        assert_eq!(connection_cap(None, Some(1)), 1);
        assert_eq!(connection_cap(None, None), Semaphore::MAX_PERMITS);
        assert_eq!(connection_cap(None, Some(u64::MAX)), Semaphore::MAX_PERMITS);
    }

    #[test]
    fn upstream_connections_take_what_clients_and_files_leave_of_the_open_files() {
        // Half of 1024 to clients, 128 to the room's files, 64 kept: 320 left.
        assert_eq!(upstream_connections(512, Some(1024)), 320);
        // Plenty of descriptors: one per client connection.
        assert_eq!(upstream_connections(300, Some(1 << 20)), 300);
        // Clients allowed nearly every descriptor: still half as many as them.
        assert_eq!(upstream_connections(1000, Some(1024)), 500);
        assert_eq!(upstream_connections(1, Some(4)), 1);
        assert_eq!(upstream_connections(64, None), 64);
    }

    #[test]
    fn the_open_file_limit_is_raised_to_the_hard_one() {
        use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
        let hard = getrlimit(Resource::Nofile).maximum;
        // Half the hard limit, not a small number: tests running meanwhile open files.
        let lowered = hard.map_or(1 << 20, |hard| hard / 2);
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(lowered),
                maximum: hard,
            },
        )
        .unwrap();
        assert_eq!(raise_open_file_limit(), Some((lowered, hard)));
        assert_eq!(getrlimit(Resource::Nofile).current, hard);
        assert_eq!(raise_open_file_limit(), None, "already at the hard limit");
    }

    /// The size of the future `f` returns, without calling it.
    fn future_size<A, B, C, D, E, G, H, F: Future>(_: impl Fn(A, B, C, D, E, G, H) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// A connection's future is moved into its box when the connection is accepted: a
    /// plain connection's has no room for a handshake or a TLS stream (boxed when taken).
    #[test]
    fn a_connections_future_stays_small() {
        let size = future_size(serve_connection);
        assert!(size <= 4 * 1024, "a connection's future is {size} bytes");
    }
}
