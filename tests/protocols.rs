//! Protocols: HTTP/2 prior-knowledge clients, pooled keep-alive upstream
//! connections, and `Upgrade` (WebSocket) tunnels.

use crate::common;

use std::time::Duration;

use crate::common::config::GatewayToml;
use crate::common::{
    TestGateway, Upstream, h2c_client, header_lines, http1_client, raw_request, read_response,
};
use bytes::Bytes;
use http::{Request, StatusCode, Version};
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn gateway(upstream: &Upstream) -> TestGateway {
    TestGateway::proxy_to(upstream, "", "").await
}

/// An HTTP/2 client sends each cookie as its own `cookie` field, as browsers do (RFC 9113
/// §8.2.3); an HTTP/1.1 app must get them in one `Cookie` line, joined by `; `, and a
/// `cookie:` key part must find a cookie in any of the fields.
#[tokio::test]
async fn http2_cookie_crumbs_reach_the_upstream_as_one_cookie_line() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        GatewayToml::new()
            .upstream("app", &upstream.url(), "")
            .limit(
                "session",
                r#"algorithm = "fixed_window"
                limit = 1
                window = "1m"
                key = ["cookie:PHPSESSID"]"#,
            )
            .route(
                "app",
                r#"upstream = "app"
                limits = ["session"]"#,
            ),
    )
    .await;
    let client = h2c_client();
    let crumbs = |session: &str| {
        Request::get(gw.url("/cookies"))
            .header("cookie", "a=1")
            .header("cookie", format!("PHPSESSID={session}"))
            .header("cookie", "theme=dark")
            .body(Full::default())
            .unwrap()
    };

    let response = client.request(crumbs("abc")).await.expect("h2c request");
    assert_eq!(response.version(), Version::HTTP_2);
    let (status, _, seen) = read_response(response).await;
    assert_eq!(status, StatusCode::OK, "{seen}");
    assert_eq!(
        header_lines(&seen, "cookie"),
        ["a=1; PHPSESSID=abc; theme=dark"],
        "{seen}"
    );
    // The session cookie, read from the middle crumb, is the key: spent for abc, not for xyz.
    let again = client.request(crumbs("abc")).await.expect("h2c request");
    assert_eq!(again.status(), StatusCode::TOO_MANY_REQUESTS);
    let other = client.request(crumbs("xyz")).await.expect("h2c request");
    assert_eq!(other.status(), StatusCode::OK);
}

#[tokio::test]
async fn h2c_clients_are_proxied_to_an_http11_upstream() {
    let upstream = Upstream::start().await;
    let gw = gateway(&upstream).await;
    let client = h2c_client();

    let response = client.request(
        Request::get(gw.url("/h2/page?x=1"))
            .body(Full::default())
            .unwrap(),
    );
    let response = response.await.expect("h2c request");
    assert_eq!(response.version(), Version::HTTP_2);
    let (status, headers, seen) = read_response(response).await;
    assert_eq!(status, StatusCode::OK, "{seen}");
    assert_eq!(headers["x-upstream"], "yes");
    assert!(seen.starts_with("GET /h2/page?x=1\n"), "{seen}");
    let authority = gw.addr.to_string();
    assert_eq!(header_lines(&seen, "host"), [authority.as_str()], "{seen}");
    assert_eq!(
        header_lines(&seen, "x-forwarded-host"),
        [authority.as_str()],
        "{seen}"
    );
    assert_eq!(header_lines(&seen, "via"), ["2.0 floodgate"], "{seen}");
    assert_eq!(header_lines(&seen, "x-forwarded-for"), ["127.0.0.1"], "{seen}");

    // A request body, and many streams at once on the one HTTP/2 connection.
    let requests = (0..10).map(|i| {
        let request = Request::post(gw.url(&format!("/h2/post/{i}")))
            .body(Full::new(Bytes::from(vec![b'a'; 100 * i])))
            .unwrap();
        let sent = client.request(request);
        async move { read_response(sent.await.expect("h2c request")).await }
    });
    let answers = futures_util::future::join_all(requests).await;
    for (i, (status, _, seen)) in answers.into_iter().enumerate() {
        assert_eq!(status, StatusCode::OK, "{seen}");
        assert!(seen.starts_with(&format!("POST /h2/post/{i}\n")), "{seen}");
        assert!(seen.ends_with(&format!("body-bytes: {}\n", 100 * i)), "{seen}");
    }
}

#[tokio::test]
async fn upstream_connections_are_pooled_and_kept_alive() {
    let upstream = Upstream::start().await;
    let gw = gateway(&upstream).await;

    let client = http1_client();
    for i in 0..20 {
        let request = Request::get(gw.url(&format!("/n/{i}")))
            .body(Full::default())
            .unwrap();
        let (status, _, seen) = read_response(client.request(request).await.expect("request")).await;
        assert_eq!(status, StatusCode::OK, "{seen}");
    }
    assert_eq!(upstream.requests(), 20);
    assert_eq!(upstream.connections(), 1);

    // A client's `Connection: close` is about its own connection, not the pooled one.
    for i in 0..5 {
        let raw = raw_request(
            gw.addr,
            format!("GET /close/{i} HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(raw.starts_with("HTTP/1.1 200 "), "{raw}");
    }
    assert_eq!(upstream.requests(), 25);
    assert_eq!(upstream.connections(), 1);
}

async fn read_exactly(stream: &mut TcpStream, n: usize) -> String {
    let mut buf = vec![0u8; n];
    tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut buf))
        .await
        .expect("tunnel answered in time")
        .expect("tunnel read");
    String::from_utf8(buf).unwrap()
}

#[tokio::test]
async fn websocket_upgrade_is_tunnelled_both_ways() {
    let upstream = Upstream::start().await;
    let gw = gateway(&upstream).await;

    let (head, mut stream) = common::websocket_upgrade(gw.addr).await;
    assert!(head.starts_with("HTTP/1.1 101 "), "{head}");
    let lower = head.to_ascii_lowercase();
    assert!(lower.contains("\r\nupgrade: websocket\r\n"), "{head}");
    assert!(lower.contains("\r\nconnection: upgrade\r\n"), "{head}");

    // The upstream upper-cases what it receives, so each answer proves a round trip.
    stream.write_all(b"hello tunnel").await.unwrap();
    assert_eq!(read_exactly(&mut stream, 12).await, "HELLO TUNNEL");
    stream.write_all(b"second frame").await.unwrap();
    assert_eq!(read_exactly(&mut stream, 12).await, "SECOND FRAME");

    // Closing our side ends the upstream's loop, and the tunnel closes back to us.
    stream.shutdown().await.unwrap();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await;
    assert!(read.is_ok(), "the tunnel stayed open after both sides finished");
    assert!(rest.is_empty(), "{rest:?}");
    assert_eq!(upstream.requests(), 1);
}

/// Shutting down closes the kept-alive connections that carry no request at once, over
/// HTTP/1.1 and HTTP/2, however long they could otherwise stay idle.
#[tokio::test]
async fn shutdown_closes_idle_kept_alive_connections_at_once() {
    let upstream = Upstream::start().await;
    let mut gw = TestGateway::proxy_to(&upstream, "header_timeout = \"60s\"", "").await;
    let request = || Request::get(gw.url("/x")).body(Full::new(Bytes::new())).unwrap();

    let stream = TcpStream::connect(gw.addr).await.unwrap();
    let (mut http1, connection) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    let http1_open = tokio::spawn(connection);
    let response = http1.send_request(request()).await.unwrap();
    assert_eq!(read_response(response).await.0, StatusCode::OK);

    let (mut http2, http2_open) = http2_connection(gw.addr).await;
    let response = http2.send_request(request()).await.unwrap();
    assert_eq!(read_response(response).await.0, StatusCode::OK);

    let started = std::time::Instant::now();
    let shutdown = gw.shutdown();
    for (protocol, open) in [("HTTP/1.1", http1_open), ("HTTP/2", http2_open)] {
        let closed = tokio::time::timeout(Duration::from_secs(5), open).await;
        assert!(closed.is_ok(), "{protocol}: still open 5 s after shutdown began");
    }
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(2),
        "closed {waited:?} after shutdown began"
    );
    tokio::time::timeout(Duration::from_secs(5), shutdown)
        .await
        .expect("the gateway shut down")
        .unwrap();
}

/// An HTTP/2 connection to `addr`, and the task that drives it (it ends when the
/// connection closes).
async fn http2_connection(
    addr: std::net::SocketAddr,
) -> (
    hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    tokio::task::JoinHandle<hyper::Result<()>>,
) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    (sender, tokio::spawn(connection))
}

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An empty SETTINGS frame.
const H2_SETTINGS: &[u8] = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00";
/// HEADERS on stream 1 (GET http /) with END_STREAM but not END_HEADERS: the server
/// waits for a CONTINUATION that never comes.
const H2_UNFINISHED_HEADERS: &[u8] = b"\x00\x00\x03\x01\x01\x00\x00\x00\x01\x82\x86\x84";

/// How long until the gateway closes a connection on which `sent` was written.
async fn closed_after(addr: std::net::SocketAddr, sent: &[u8]) -> Duration {
    let started = std::time::Instant::now();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(sent).await.unwrap();
    let mut received = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut received)).await;
    assert!(read.is_ok(), "{sent:?}: still open after 5 s");
    started.elapsed()
}

#[tokio::test]
async fn http2_connections_without_an_open_stream_are_closed_after_header_timeout() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "header_timeout = \"300ms\"", "").await;

    let preface = [H2_PREFACE, H2_SETTINGS].concat();
    let unfinished = [H2_PREFACE, H2_SETTINGS, H2_UNFINISHED_HEADERS].concat();
    for sent in [&preface[..], &unfinished[..]] {
        let elapsed = closed_after(gw.addr, sent).await;
        assert!(
            elapsed >= Duration::from_millis(250) && elapsed < Duration::from_secs(3),
            "closed after {elapsed:?}"
        );
    }

    // A stream open longer than the limit keeps its connection; once it is done, the idle
    // connection goes too.
    let (mut sender, driver) = http2_connection(gw.addr).await;
    let request = Request::get(gw.url("/slow?ms=800"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = sender
        .send_request(request)
        .await
        .expect("a slow stream is served");
    assert_eq!(response.status(), StatusCode::OK);
    let ended = std::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(3), driver)
        .await
        .expect("the idle connection is closed")
        .unwrap()
        .ok();
    let idle = ended.elapsed();
    assert!(idle >= Duration::from_millis(200), "closed after {idle:?} idle");
}
