//! Helpers for integration tests: a gateway in-process on port 0, a real upstream HTTP
//! server that describes what it received, HTTP clients, and raw-socket requests. Its
//! modules hold the rest: configurations (`config`), stub upstreams that answer as a test
//! says (`stub`), the binary as a child process (`process`), Redis and certificates.
#![allow(dead_code)]

pub(crate) mod redis_server;

pub(crate) mod config;

pub(crate) mod pebble;

pub(crate) mod php_fpm;

pub(crate) mod process;

pub(crate) mod stub;

pub(crate) mod tls;

use std::convert::Infallible;
use std::fmt::Display;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use config::GatewayToml;
use floodgate::{Config, Gateway};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A floodgate instance running in this process.
pub(crate) struct TestGateway {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    /// The HTTPS listener, with `[server.tls]`.
    pub tls: Option<SocketAddr>,
    /// The running gateway's state, for reloads.
    pub shared: std::sync::Arc<floodgate::service::Instance>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl TestGateway {
    /// Starts a gateway from `toml`: a [`GatewayToml`], or text with a `[server]` table of
    /// its own.
    pub(crate) async fn start(toml: impl Display) -> TestGateway {
        let text = toml.to_string();
        let config = Config::parse(Path::new("test.toml"), &text).unwrap_or_else(|e| panic!("{e}"));
        TestGateway::start_config(config).await
    }

    /// A gateway with one catch-all route to `upstream` ([`GatewayToml::proxy_to`]):
    /// `server_keys` added to `[server]`, `upstream_keys` to `[upstreams.app]`.
    pub(crate) async fn proxy_to(upstream: &Upstream, server_keys: &str, upstream_keys: &str) -> TestGateway {
        TestGateway::start(
            GatewayToml::new()
                .server(server_keys)
                .proxy_to(&upstream.url(), upstream_keys),
        )
        .await
    }

    /// Starts a gateway from an already loaded configuration.
    pub(crate) async fn start_config(config: Config) -> TestGateway {
        let gateway = Gateway::bind(config).await.expect("bind");
        let shared = gateway.shared().clone();
        let addr = gateway.local_addr();
        let admin = gateway.admin_addr();
        let tls = gateway.tls_addr();
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(gateway.serve(async {
            let _ = stopped.await;
        }));
        TestGateway {
            addr,
            admin,
            tls,
            shared,
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub(crate) fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    /// Starts the graceful shutdown; returns the task that completes when it is done.
    pub(crate) fn shutdown(&mut self) -> JoinHandle<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.take().expect("shut down once")
    }

    /// The value of one metric line (`name{labels}`), or 0 when absent.
    pub(crate) async fn metric(&self, series: &str) -> f64 {
        let (_, _, body) = get(&self.admin_url("/metrics")).await;
        body.lines()
            .find_map(|line| line.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
            .map_or(0.0, |value| value.trim().parse().unwrap())
    }

    /// Polls `series` until it reads `value`, at most `within`: what a worker thread counts
    /// may come a moment after the client saw the request or the connection end.
    pub(crate) async fn metric_becomes(&self, series: &str, value: f64, within: Duration) {
        let started = std::time::Instant::now();
        loop {
            let now = self.metric(series).await;
            if now == value {
                return;
            }
            assert!(
                started.elapsed() < within,
                "{series} is {now}, not {value}, after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for TestGateway {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A real upstream that answers with a description of the request it received:
/// a path ending in `/slow` with `?ms=N` waits N ms; a path ending in `/busy` with `?ms=N`
/// works N ms in a task of its own, which the gateway leaving does not stop (as PHP-FPM
/// finishes a script whose client left), and with `&stream=1` sends its head at once and
/// its body's end when done; `/big?bytes=N` streams N bytes;
/// `/echo` streams the body back; `/powered` answers with `X-Powered-By` and `Server`; `/status?code=N` answers N (after `ms=M` milliseconds); `/health` answers 200 or
/// what [`Upstream::set_health`] set; anything else describes the request as text.
/// It counts the connections it accepted and the request heads it received, keeps the
/// targets in the order received, the most requests it ever had in flight at once (a
/// request is in flight while it is worked on), and the `/ws` tunnels open.
/// Dropped, it stops listening and closes every connection.
pub(crate) struct Upstream {
    pub addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
    seen: Arc<Seen>,
    closed: tokio_util::sync::CancellationToken,
    task: JoinHandle<()>,
}

/// What an upstream saw of its requests.
#[derive(Default)]
struct Seen {
    /// The status `/health` answers (0: 200).
    health: std::sync::atomic::AtomicU16,
    targets: std::sync::Mutex<Vec<String>>,
    in_flight: AtomicUsize,
    most_in_flight: AtomicUsize,
    tunnels: AtomicUsize,
}

/// A request the upstream works on, counted in flight until dropped.
struct Working(Arc<Seen>);

impl Working {
    fn start(seen: &Arc<Seen>) -> Working {
        let now = seen.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        seen.most_in_flight.fetch_max(now, Ordering::SeqCst);
        Working(seen.clone())
    }
}

impl Drop for Working {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Upstream {
    pub(crate) async fn start() -> Upstream {
        Upstream::start_on(TcpListener::bind("127.0.0.1:0").await.unwrap())
    }

    /// An upstream on `listener` (to start one again on an address it left).
    pub(crate) fn start_on(listener: TcpListener) -> Upstream {
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Seen::default());
        let closed = tokio_util::sync::CancellationToken::new();
        let (accepted, received, seen_here, closing) = (
            connections.clone(),
            requests.clone(),
            seen.clone(),
            closed.clone(),
        );
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                accepted.fetch_add(1, Ordering::SeqCst);
                let received = received.clone();
                let seen = seen_here.clone();
                let service = service_fn(move |request: Request<Incoming>| {
                    let seen = seen.clone();
                    // Health checks are answered apart: they count as no request.
                    let health =
                        (request.uri().path() == "/health").then(|| seen.health.load(Ordering::SeqCst));
                    if health.is_none() {
                        received.fetch_add(1, Ordering::SeqCst);
                        seen.targets.lock().unwrap().push(request.uri().to_string());
                    }
                    async move {
                        if let Some(code) = health {
                            let mut response = Response::new(
                                Full::new(Bytes::new()).map_err(|never| match never {}).boxed(),
                            );
                            *response.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::OK);
                            return Ok(response);
                        }
                        let working = Working::start(&seen);
                        upstream_answer(request, working).await
                    }
                });
                let closing = closing.clone();
                tokio::spawn(async move {
                    // As many fields as the gateway forwards (32 KB of them).
                    let connection = hyper::server::conn::http1::Builder::new()
                        .max_headers(8192)
                        .serve_connection(TokioIo::new(stream), service)
                        .with_upgrades();
                    tokio::select! {
                        _ = connection => {}
                        () = closing.cancelled() => {}
                    }
                });
            }
        });
        Upstream {
            addr,
            connections,
            requests,
            seen,
            closed,
            task,
        }
    }

    /// Makes `/health` answer `status`.
    pub(crate) fn set_health(&self, status: u16) {
        self.seen.health.store(status, Ordering::SeqCst);
    }

    /// The request targets received so far, in order.
    pub(crate) fn targets(&self) -> Vec<String> {
        self.seen.targets.lock().unwrap().clone()
    }

    /// The most requests it had in flight at once (until each answer's head).
    /// `/ws` tunnels open now.
    pub(crate) fn open_tunnels(&self) -> usize {
        self.seen.tunnels.load(Ordering::SeqCst)
    }

    pub(crate) fn most_in_flight(&self) -> usize {
        self.seen.most_in_flight.load(Ordering::SeqCst)
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// TCP connections accepted so far.
    pub(crate) fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    /// Request heads received so far (whatever became of their bodies).
    pub(crate) fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
        self.closed.cancel();
    }
}

type UpstreamBody = http_body_util::combinators::BoxBody<Bytes, hyper::Error>;

fn query_number(request: &Request<Incoming>, name: &str) -> u64 {
    request
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .find_map(|pair| pair.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The answer to `request`, counted in flight while `working` is held.
async fn upstream_answer(
    mut request: Request<Incoming>,
    working: Working,
) -> Result<Response<UpstreamBody>, Infallible> {
    let path = request.uri().path().to_owned();
    let boxed = |b: Full<Bytes>| b.map_err(|never| match never {}).boxed();
    if path == "/ws" {
        // Accepts a protocol switch and echoes bytes, upper-cased, until the client closes.
        let upgrade = hyper::upgrade::on(&mut request);
        let seen = working.0.clone();
        tokio::spawn(async move {
            if let Ok(upgraded) = upgrade.await {
                seen.tunnels.fetch_add(1, Ordering::SeqCst);
                let mut io = TokioIo::new(upgraded);
                let mut buf = [0u8; 1024];
                while let Ok(n) = io.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    let upper: Vec<u8> = buf[..n].to_ascii_uppercase();
                    if io.write_all(&upper).await.is_err() {
                        break;
                    }
                }
                seen.tunnels.fetch_sub(1, Ordering::SeqCst);
            }
        });
        let response = Response::builder()
            .status(StatusCode::SWITCHING_PROTOCOLS)
            .header("connection", "upgrade")
            .header("upgrade", "websocket")
            .body(boxed(Full::new(Bytes::new())))
            .unwrap();
        return Ok(response);
    }
    if path.ends_with("/busy") {
        let work = Duration::from_millis(query_number(&request, "ms"));
        let (done, finished) = oneshot::channel();
        tokio::spawn(async move {
            tokio::time::sleep(work).await;
            drop(working);
            let _ = done.send(());
        });
        if query_number(&request, "stream") != 1 {
            let _ = finished.await;
            return Ok(Response::new(boxed(Full::new(Bytes::from_static(b"done\n")))));
        }
        let end = async move {
            let _ = finished.await;
            Ok(Frame::data(Bytes::from_static(b"done\n")))
        };
        return Ok(Response::new(
            StreamBody::new(futures_util::stream::once(end)).boxed(),
        ));
    }
    if path.ends_with("/slow") {
        tokio::time::sleep(Duration::from_millis(query_number(&request, "ms"))).await;
    }
    if path == "/big" {
        let total = query_number(&request, "bytes");
        let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
        let stream = futures_stream(total, chunk);
        return Ok(Response::new(StreamBody::new(stream).boxed()));
    }
    if path == "/powered" {
        // What legacy apps add: headers a gateway is asked to hide.
        let mut response = Response::new(boxed(Full::new(Bytes::from("powered\n"))));
        response
            .headers_mut()
            .insert("x-powered-by", HeaderValue::from_static("PHP/5.6.40"));
        response
            .headers_mut()
            .insert("server", HeaderValue::from_static("Apache/2.2"));
        return Ok(response);
    }
    if path == "/echo" {
        return Ok(Response::new(request.into_body().boxed()));
    }
    if path == "/status" {
        tokio::time::sleep(Duration::from_millis(query_number(&request, "ms"))).await;
        let mut response = Response::new(boxed(Full::new(Bytes::from_static(b"status\n"))));
        *response.status_mut() = StatusCode::from_u16(query_number(&request, "code") as u16).unwrap();
        return Ok(response);
    }
    let mut description = format!("{} {}\n", request.method(), request.uri());
    for (name, value) in request.headers() {
        description.push_str(&format!("{}: {}\n", name, value.to_str().unwrap_or("<binary>")));
    }
    let body = request
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    description.push_str(&format!("body-bytes: {}\n", body.len()));
    Ok(Response::builder()
        .header("x-upstream", "yes")
        .header("connection", "x-hop")
        .header("x-hop", "should-not-pass")
        .header("keep-alive", "timeout=5")
        .body(boxed(Full::new(Bytes::from(description))))
        .unwrap())
}

fn futures_stream(
    total: u64,
    chunk: Bytes,
) -> impl futures_core::Stream<Item = Result<Frame<Bytes>, hyper::Error>> + Send + 'static {
    let mut sent = 0u64;
    futures_util::stream::poll_fn(move |_| {
        if sent >= total {
            return std::task::Poll::Ready(None);
        }
        let n = (total - sent).min(chunk.len() as u64) as usize;
        sent += n as u64;
        std::task::Poll::Ready(Some(Ok(Frame::data(chunk.slice(..n)))))
    })
}

/// Lines of an upstream description that start with `name: `, values only.
pub(crate) fn header_lines<'a>(description: &'a str, name: &str) -> Vec<&'a str> {
    let prefix = format!("{name}: ");
    description
        .lines()
        .filter_map(|line| line.strip_prefix(prefix.as_str()))
        .collect()
}

pub(crate) fn http1_client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

pub(crate) fn h2c_client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new())
}

/// `get(url)` in a task of its own.
pub(crate) fn spawn_get(url: String) -> JoinHandle<(StatusCode, http::HeaderMap, String)> {
    tokio::spawn(async move { get(&url).await })
}

/// Waits until `condition` holds, failing with `what` after `within`.
pub(crate) async fn until(what: &str, within: Duration, condition: impl Fn() -> bool) {
    let started = std::time::Instant::now();
    while !condition() {
        assert!(started.elapsed() < within, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `GET url` over HTTP/1.1: status, headers, body.
pub(crate) async fn get(url: &str) -> (StatusCode, http::HeaderMap, String) {
    send(Request::get(url).body(Full::new(Bytes::new())).unwrap()).await
}

pub(crate) async fn send(request: Request<Full<Bytes>>) -> (StatusCode, http::HeaderMap, String) {
    let response = http1_client().request(request).await.expect("request");
    read_response(response).await
}

pub(crate) async fn read_response(response: Response<Incoming>) -> (StatusCode, http::HeaderMap, String) {
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.expect("body").to_bytes();
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

/// Writes `raw` to `addr` and reads until the server closes or 5 s pass.
pub(crate) async fn raw_request(addr: SocketAddr, raw: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(raw).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// A free TCP port on loopback, to be bound later (by a gateway, again after a restart, or
/// by pebble). No two calls in this process (every integration test) hand out the same
/// port: a port a test lets go of between a gateway's stop and its restart is otherwise
/// free to the next test that asks, which then holds it.
pub(crate) fn free_port() -> u16 {
    use std::hash::{BuildHasher, RandomState};
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU16, Ordering};
    // Below the kernel's ephemeral range (32768-60999 by default): a port `bind(":0")`
    // hands out and the test lets go can be taken meanwhile by any outgoing connection's
    // local end, and a gateway started again on it then fails with "address in use".
    const FIRST: u16 = 20_000;
    const COUNT: u16 = 12_000;
    static START: OnceLock<u16> = OnceLock::new();
    static HANDED_OUT: AtomicU16 = AtomicU16::new(0);
    let start =
        *START.get_or_init(|| (RandomState::new().hash_one(std::process::id()) % u64::from(COUNT)) as u16);
    loop {
        let next = HANDED_OUT.fetch_add(1, Ordering::Relaxed);
        assert!(next < COUNT, "every port from {FIRST} handed out once");
        let port = FIRST + (start + next) % COUNT;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// A client of `addr` that uploads without end and reads little: it announces a 100 MB
/// `POST /upload` body and keeps sending it in the background, each 16 KB `pause` apart,
/// through a socket with a 4 KB receive window. Its read half, for the answer.
pub(crate) async fn endless_upload(addr: SocketAddr, pause: Duration) -> tokio::net::tcp::OwnedReadHalf {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let stream = socket.connect(addr).await.unwrap();
    let (reading, mut writing) = stream.into_split();
    writing
        .write_all(b"POST /upload HTTP/1.1\r\nHost: h\r\nContent-Length: 100000000\r\n\r\n")
        .await
        .unwrap();
    tokio::spawn(async move {
        let part = vec![b'u'; 16 << 10];
        while writing.write_all(&part).await.is_ok() {
            tokio::time::sleep(pause).await;
        }
    });
    reading
}

/// A free TCP port on 127.0.0.1 with nothing listening (and, being below the ephemeral
/// range, none of the test's own outgoing connections taking it meanwhile).
pub(crate) fn closed_port() -> u16 {
    free_port()
}

/// Asks the gateway at `addr` for a WebSocket tunnel to the app's `/ws` (the test
/// [`Upstream`] accepts it): the response head, and the stream.
pub(crate) async fn websocket_upgrade(addr: SocketAddr) -> (String, TcpStream) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            b"GET /ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
              Sec-WebSocket-Version: 13\r\n\r\n",
        )
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    let read_head = async {
        while !head.ends_with(b"\r\n\r\n") {
            if stream.read(&mut byte).await.unwrap() == 0 {
                break;
            }
            head.push(byte[0]);
        }
    };
    tokio::time::timeout(Duration::from_secs(5), read_head)
        .await
        .expect("an answer to the upgrade");
    (String::from_utf8(head).unwrap(), stream)
}

/// A server whose connections are never accepted, their handshakes left waiting: the
/// listener's queue (of one) filled.
pub(crate) async fn unaccepting_server() -> (String, tokio::net::TcpListener, Vec<tokio::net::TcpStream>) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(0).unwrap();
    let address = listener.local_addr().unwrap();
    let mut queued = Vec::new();
    // The queue holds one or two whose handshakes completed; past those, a connect waits.
    for _ in 0..3 {
        match tokio::time::timeout(
            Duration::from_millis(200),
            tokio::net::TcpStream::connect(address),
        )
        .await
        {
            Ok(Ok(stream)) => queued.push(stream),
            _ => break,
        }
    }
    (format!("http://{address}"), listener, queued)
}
