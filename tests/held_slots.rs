//! How long a request holds its concurrency-limit slots (`algorithm = "concurrency"`) and
//! its server slot (`max_requests`): while the app works on it or its tunnel is open, not
//! while a client fails to read or has gone. A client that reads nothing of its response
//! (over HTTP/2, also one that opens its stream no window) is cut off after
//! `server.send_timeout`; a tunnel holds its slots until it closes, and
//! `server.tunnel_idle_timeout` closes one that carries nothing; a client that leaves
//! before its answer leaves its slots held until the upstream has answered.

use crate::common;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::common::config::GatewayToml;
use crate::common::{TestGateway, Upstream, get, h2c_client, until};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpSocket, TcpStream};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A gateway with `server` keys in `[server]`, `upstream` keys in `[upstreams.app]`, and
/// a concurrency limit of `limit` per client address when given.
async fn gateway(app: &Upstream, server: &str, upstream: &str, limit: Option<u32>) -> TestGateway {
    let Some(limit) = limit else {
        return TestGateway::proxy_to(app, server, upstream).await;
    };
    TestGateway::start(
        GatewayToml::new()
            .server(server)
            .upstream("app", &app.url(), upstream)
            .limit(
                "inflight",
                &format!(
                    r#"algorithm = "concurrency"
                    limit = {limit}
                    key = ["client_ip"]"#
                ),
            )
            .route(
                "app",
                r#"path_prefix = "/"
                upstream = "app"
                limits = ["inflight"]"#,
            ),
    )
    .await
}

// ---- send_timeout -------------------------------------------------------------------

/// A client socket that takes in little: the gateway's writes block soon after the
/// client stops reading.
async fn small_window_socket(addr: std::net::SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.connect(addr).await.unwrap()
}

/// The app allows one request at a time; A asks for 300 MB and reads none of it. With
/// `send_timeout = "1s"` A's connection is closed once the gateway's writes have made no
/// progress for a second, and the rest of A's response is read and discarded for at most
/// the upstream's `timeout` (1s): B, queued behind A, is served within a few seconds.
/// Without it, B waits out its `queue_timeout` (5s) and gets a 503.
async fn a_client_that_reads_nothing_frees_the_server_slot(client: Reader) {
    let app = Upstream::start().await;
    let gw = gateway(
        &app,
        "send_timeout = \"1s\"",
        "max_requests = 1\nqueue_timeout = \"5s\"\ntimeout = \"1s\"",
        None,
    )
    .await;
    let a = small_window_socket(gw.addr).await;
    let url = gw.url("/big?bytes=300000000");
    let _a: Box<dyn Send> = match client {
        Reader::Http1 => Box::new(unread_http1_response(a).await),
        Reader::Http2Deaf => Box::new(unread_http2_response(a, &url, 1 << 30, true).await),
        Reader::Http2NoWindow => Box::new(unread_http2_response(a, &url, 0, false).await),
    };
    until("A reached the app", Duration::from_secs(2), || {
        app.requests() == 1
    })
    .await;
    let started = Instant::now();
    let (status, _, body) = get(&gw.url("/b")).await;
    let waited = started.elapsed();
    assert_eq!(status, StatusCode::OK, "B after {waited:?}: {body}");
    assert!(waited < ms(4500), "B waited {waited:?}");
}

/// Sends a request for 300 MB on `stream` over HTTP/1.1, and never reads.
async fn unread_http1_response(mut stream: TcpStream) -> TcpStream {
    stream
        .write_all(b"GET /big?bytes=300000000 HTTP/1.1\r\nHost: app\r\n\r\n")
        .await
        .unwrap();
    stream
}

/// How the client of A fails to read its response.
enum Reader {
    /// Stops reading its HTTP/1.1 connection.
    Http1,
    /// Grants a large window over HTTP/2, then stops reading the socket.
    Http2Deaf,
    /// Reads its HTTP/2 connection, but opens the stream no window: no write blocks.
    Http2NoWindow,
}

/// Sends `GET url` over HTTP/2 on `stream`, granting the gateway a stream window of
/// `window` (the connection's is 1 GB), and stops reading the socket once the response
/// head is in when `deaf`. Returns what keeps the connection open.
async fn unread_http2_response(
    stream: TcpStream,
    url: &str,
    window: u32,
    deaf_after_head: bool,
) -> (
    hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    http::Response<hyper::body::Incoming>,
) {
    let deaf = Arc::new(AtomicBool::new(false));
    let io = Deaf {
        inner: stream,
        deaf: deaf.clone(),
    };
    let (mut sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(window)
        .initial_connection_window_size(1 << 30)
        .handshake(TokioIo::new(io))
        .await
        .unwrap();
    tokio::spawn(connection);
    let request = Request::get(url).body(Full::new(Bytes::new())).unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    deaf.store(deaf_after_head, Ordering::SeqCst);
    (sender, response)
}

/// A stream whose reads stop for good once `deaf` is set.
struct Deaf {
    inner: TcpStream,
    deaf: Arc<AtomicBool>,
}

impl AsyncRead for Deaf {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.deaf.load(Ordering::SeqCst) {
            return Poll::Pending;
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Deaf {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_client_that_reads_nothing_is_cut_off_after_send_timeout() {
    a_client_that_reads_nothing_frees_the_server_slot(Reader::Http1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_reads_nothing_is_cut_off_after_send_timeout() {
    a_client_that_reads_nothing_frees_the_server_slot(Reader::Http2Deaf).await;
}

/// The client reads its connection but opens its stream no flow-control window: the
/// response waits with no write blocked, and the connection is closed after
/// `send_timeout` all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_opens_no_window_is_cut_off_after_send_timeout() {
    a_client_that_reads_nothing_frees_the_server_slot(Reader::Http2NoWindow).await;
}

/// A client that reads steadily, however slowly, is not cut off: a response goes to
/// HTTP/2 a window's worth at a time, and `send_timeout` is how long one piece may wait
/// for room, not how long a file's 256 KB read takes to drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_but_steady_http2_reader_is_not_cut_by_send_timeout() {
    let site = tempfile::tempdir().unwrap();
    let content: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(site.path().join("big.bin"), &content).unwrap();
    let gw = TestGateway::start(
        GatewayToml::new()
            .server("send_timeout = \"1s\"")
            .route("site", &format!("root = \"{}\"", site.path().display())),
    )
    .await;
    // 16 KB of window, one frame's worth taken every 200 ms: 80 KB/s.
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .http2_only(true)
        .http2_initial_stream_window_size(16 * 1024)
        .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let response = client
        .request(
            Request::get(gw.url("/big.bin"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut received = Vec::new();
    while let Some(frame) = http_body_util::BodyExt::frame(&mut body).await {
        let frame = frame.expect("the body, whole");
        if let Some(data) = frame.data_ref() {
            received.extend_from_slice(data);
            tokio::time::sleep(ms(200 * data.len() as u64 / (16 * 1024))).await;
        }
    }
    assert!(
        received == content,
        "{} of {} bytes",
        received.len(),
        content.len()
    );
}

// ---- tunnels ------------------------------------------------------------------------

async fn open_tunnel(gw: &TestGateway) -> TcpStream {
    let (head, stream) = common::websocket_upgrade(gw.addr).await;
    assert!(head.starts_with("HTTP/1.1 101 "), "{head}");
    stream
}

/// One round trip through a tunnel to the app, which upper-cases what it receives.
async fn round_trip(stream: &mut TcpStream) {
    stream.write_all(b"ping").await.unwrap();
    let mut answer = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(2), stream.read_exact(&mut answer))
        .await
        .expect("an answer through the tunnel")
        .unwrap();
    assert_eq!(&answer, b"PING");
}

/// Closes a tunnel from the client's side and waits until the app saw it end.
async fn close_tunnel(app: &Upstream, mut stream: TcpStream, open_after: usize) {
    stream.shutdown().await.unwrap();
    drop(stream);
    until("the app saw the tunnel close", Duration::from_secs(2), || {
        app.open_tunnels() == open_after
    })
    .await;
}

/// Tries upgrades until one is accepted, within 2 s.
async fn upgrade_soon(gw: &TestGateway) -> TcpStream {
    let started = Instant::now();
    loop {
        let (head, stream) = common::websocket_upgrade(gw.addr).await;
        if head.starts_with("HTTP/1.1 101 ") {
            return stream;
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "still refused: {head}"
        );
        tokio::time::sleep(ms(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_tunnel_holds_its_concurrency_slot_until_it_closes() {
    let app = Upstream::start().await;
    let gw = gateway(&app, "", "", Some(2)).await;
    let mut first = open_tunnel(&gw).await;
    let second = open_tunnel(&gw).await;
    round_trip(&mut first).await;
    let (head, _) = common::websocket_upgrade(gw.addr).await;
    assert!(
        head.starts_with("HTTP/1.1 429 "),
        "a third tunnel while two are open: {head}"
    );
    close_tunnel(&app, second, 1).await;
    let mut third = upgrade_soon(&gw).await;
    round_trip(&mut third).await;
    round_trip(&mut first).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_tunnel_holds_its_server_slot_until_it_closes() {
    let app = Upstream::start().await;
    let gw = gateway(&app, "", "max_requests = 1\nqueue_timeout = \"500ms\"", None).await;
    let first = open_tunnel(&gw).await;
    let (head, _) = common::websocket_upgrade(gw.addr).await;
    assert!(
        head.starts_with("HTTP/1.1 503 "),
        "a second tunnel to a server with max_requests = 1: {head}"
    );
    close_tunnel(&app, first, 0).await;
    let mut second = upgrade_soon(&gw).await;
    round_trip(&mut second).await;
    assert_eq!(app.open_tunnels(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_with_no_traffic_for_tunnel_idle_timeout_is_closed() {
    let app = Upstream::start().await;
    let gw = gateway(&app, "tunnel_idle_timeout = \"1s\"", "", None).await;
    // Timed from before it opens: the gateway's idle clock starts as the 101 goes out.
    let opened = Instant::now();
    let mut idle = open_tunnel(&gw).await;
    let mut busy = open_tunnel(&gw).await;
    until("both tunnels open at the app", Duration::from_secs(2), || {
        app.open_tunnels() == 2
    })
    .await;
    // The busy one carries a round trip every 300 ms, for longer than two idle timeouts.
    let traffic = tokio::spawn(async move {
        let started = Instant::now();
        while started.elapsed() < ms(2500) {
            round_trip(&mut busy).await;
            tokio::time::sleep(ms(300)).await;
        }
        busy
    });
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(3), idle.read_to_end(&mut rest)).await;
    let closed = opened.elapsed();
    assert!(read.is_ok(), "the idle tunnel is still open after {closed:?}");
    assert!(rest.is_empty(), "{rest:?}");
    assert!(closed >= ms(1000), "closed after only {closed:?}");
    assert!(closed < ms(2500), "closed only after {closed:?}");
    until(
        "the app saw the idle tunnel close",
        Duration::from_secs(1),
        || app.open_tunnels() == 1,
    )
    .await;
    let mut busy = traffic.await.unwrap();
    round_trip(&mut busy).await;
    assert_eq!(app.open_tunnels(), 1);
}

// ---- clients that leave -------------------------------------------------------------

/// How long the app works on A's request.
const WORK: Duration = Duration::from_millis(1500);
/// When A leaves.
const LEAVES: Duration = Duration::from_millis(200);

/// What caps the app: a concurrency limit of 1, or `max_requests = 1`.
#[derive(Debug, Clone, Copy)]
enum Cap {
    Limit,
    MaxRequests,
}

/// How client A leaves.
#[derive(Debug, Clone, Copy)]
enum Leave {
    /// HTTP/1.1, the socket closed before the response head.
    CloseHttp1,
    /// HTTP/2, the stream reset (RST_STREAM) before the response head.
    ResetHttp2Stream,
    /// HTTP/1.1, the socket closed after the response head, while the body streams.
    CloseHttp1DuringBody,
}

/// A asks for work of 1.5 s and leaves at 200 ms; B asks right after. The app is still
/// working on A's request, so B is refused (a concurrency limit) or waits in the queue
/// (`max_requests`) until the app has answered A, and the app never has two at once.
async fn a_client_that_leaves_keeps_its_slot_until_the_app_answered(cap: Cap, leave: Leave) {
    let app = Upstream::start().await;
    let gw = match cap {
        Cap::Limit => gateway(&app, "", "", Some(1)).await,
        Cap::MaxRequests => gateway(&app, "", "max_requests = 1", None).await,
    };
    let start = Instant::now();
    let work = format!("/a/busy?ms={}", WORK.as_millis());
    match leave {
        Leave::CloseHttp1 | Leave::CloseHttp1DuringBody => {
            let mut a = TcpStream::connect(gw.addr).await.unwrap();
            let stream = if matches!(leave, Leave::CloseHttp1DuringBody) {
                "&stream=1"
            } else {
                ""
            };
            a.write_all(format!("GET {work}{stream} HTTP/1.1\r\nHost: app\r\n\r\n").as_bytes())
                .await
                .unwrap();
            until("A reached the app", Duration::from_secs(2), || {
                app.requests() == 1
            })
            .await;
            let mut buf = [0u8; 1024];
            let streamed = matches!(leave, Leave::CloseHttp1DuringBody);
            let wait = if streamed { Duration::from_secs(1) } else { LEAVES };
            let read = tokio::time::timeout(wait, a.read(&mut buf)).await;
            match leave {
                Leave::CloseHttp1DuringBody => {
                    let n = read.expect("the head at once").unwrap();
                    assert!(buf[..n].starts_with(b"HTTP/1.1 200 "));
                    tokio::time::sleep_until((start + LEAVES).into()).await;
                }
                _ => assert!(read.is_err(), "nothing answered yet: {read:?}"),
            }
            drop(a);
        }
        Leave::ResetHttp2Stream => {
            let client = h2c_client();
            let request = Request::get(gw.url(&work)).body(Full::new(Bytes::new())).unwrap();
            let a = tokio::spawn(async move { client.request(request).await.map(|r| r.status()) });
            until("A reached the app", Duration::from_secs(2), || {
                app.requests() == 1
            })
            .await;
            tokio::time::sleep_until((start + LEAVES).into()).await;
            assert!(!a.is_finished(), "nothing answered yet");
            a.abort();
        }
    }
    assert_eq!(app.requests(), 1, "A reached the app");
    // Let the gateway see A leave.
    tokio::time::sleep(ms(100)).await;
    let served = match cap {
        Cap::Limit => {
            let (status, _, _) = get(&gw.url("/b")).await;
            assert_eq!(
                status,
                StatusCode::TOO_MANY_REQUESTS,
                "B while the app still works on A's request"
            );
            loop {
                let (status, _, _) = get(&gw.url("/b")).await;
                if status == StatusCode::OK {
                    break start.elapsed();
                }
                assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
                assert!(
                    start.elapsed() < WORK + Duration::from_secs(2),
                    "B never admitted"
                );
                tokio::time::sleep(ms(20)).await;
            }
        }
        Cap::MaxRequests => {
            let (status, _, _) = get(&gw.url("/b")).await;
            assert_eq!(status, StatusCode::OK);
            start.elapsed()
        }
    };
    assert!(
        served >= WORK - ms(50),
        "B served at {served:?}, before the app answered A"
    );
    assert_eq!(app.most_in_flight(), 1, "the app had two requests at once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_client_that_leaves_keeps_its_concurrency_slot_until_the_app_answered() {
    a_client_that_leaves_keeps_its_slot_until_the_app_answered(Cap::Limit, Leave::CloseHttp1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_stream_reset_keeps_its_concurrency_slot_until_the_app_answered() {
    a_client_that_leaves_keeps_its_slot_until_the_app_answered(Cap::Limit, Leave::ResetHttp2Stream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_during_the_body_keeps_its_concurrency_slot_until_the_app_answered() {
    a_client_that_leaves_keeps_its_slot_until_the_app_answered(Cap::Limit, Leave::CloseHttp1DuringBody).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_client_that_leaves_keeps_its_server_slot_until_the_app_answered() {
    a_client_that_leaves_keeps_its_slot_until_the_app_answered(Cap::MaxRequests, Leave::CloseHttp1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_stream_reset_keeps_its_server_slot_until_the_app_answered() {
    a_client_that_leaves_keeps_its_slot_until_the_app_answered(Cap::MaxRequests, Leave::ResetHttp2Stream)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_during_the_body_keeps_its_server_slot_until_the_app_answered() {
    a_client_that_leaves_keeps_its_slot_until_the_app_answered(Cap::MaxRequests, Leave::CloseHttp1DuringBody)
        .await;
}

/// A request a cap counts that gets no response head within the upstream's `timeout` is
/// a `504` like any other, and its slot is free for the next request at once: nothing
/// goes on after the deadline.
#[tokio::test]
async fn a_counted_request_that_times_out_answers_504_and_frees_its_slot() {
    let app = Upstream::start().await;
    let gw = gateway(
        &app,
        "",
        "max_requests = 1\nqueue_timeout = \"200ms\"\ntimeout = \"300ms\"",
        Some(4),
    )
    .await;
    let (status, _, body) = get(&gw.url("/slow?ms=2000")).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "{body}");
    let (status, _, body) = get(&gw.url("/next")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

/// A response that waits for its app, not for its client, is never cut: an HTTP/2 client
/// that reads gets a body whose app pauses longer than `send_timeout` whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_response_waiting_for_its_app_is_not_cut_by_send_timeout() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut head = [0u8; 4096];
        let _ = stream.read(&mut head).await.unwrap();
        stream
            .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            .await
            .unwrap();
        tokio::time::sleep(ms(2500)).await;
        stream.write_all(b"6\r\nsecond\r\n0\r\n\r\n").await.unwrap();
        tokio::time::sleep(ms(1000)).await;
    });
    let gw = TestGateway::start(
        GatewayToml::new()
            .server("send_timeout = \"1s\"")
            .upstream("app", &upstream, "timeout = \"5s\"")
            .route("app", "upstream = \"app\""),
    )
    .await;
    let response = h2c_client()
        .request(
            Request::get(gw.url("/pausing"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .expect("the whole body")
        .to_bytes();
    assert_eq!(&body[..], b"firstsecond");
}

/// Under `max_requests` a request body is read whole before a server is asked, as nginx
/// buffers request bodies (and as PHP-FPM's always are): a client that trickles its upload
/// holds no slot meanwhile, and the app gets the whole body at once, its length declared.
#[tokio::test]
async fn under_max_requests_a_trickling_upload_holds_no_slot() {
    let app = Upstream::start().await;
    let gw = gateway(&app, "", "max_requests = 1\nqueue_timeout = \"300ms\"", None).await;
    let mut slow = TcpStream::connect(gw.addr).await.unwrap();
    slow.write_all(
        b"POST /upload HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\na\r\n0123456789\r\n",
    )
    .await
    .unwrap();
    tokio::time::sleep(ms(200)).await;
    // Another request meanwhile takes the one slot at once.
    let (status, _, seen) = get(&gw.url("/other")).await;
    assert_eq!(status, StatusCode::OK, "{seen}");
    assert_eq!(
        app.targets(),
        ["/other"],
        "the upload reached the app before its body was whole"
    );

    slow.write_all(b"a\r\nabcdefghij\r\n0\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        while !String::from_utf8_lossy(&answer).contains("body-bytes: 20") {
            let mut buffer = [0; 4096];
            let n = slow.read(&mut buffer).await.unwrap();
            assert!(n > 0, "closed: {}", String::from_utf8_lossy(&answer));
            answer.extend_from_slice(&buffer[..n]);
        }
    })
    .await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(read.is_ok(), "{answer}");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.contains("content-length: 20\n"),
        "the length, declared: {answer}"
    );
}
