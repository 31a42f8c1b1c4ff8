//! Gateway errors (SPEC §5, §8): upstream refused or broken (502) or slow (504) with their
//! metrics, `server.max_body` (413), ambiguous framing (400, never forwarded), oversized
//! heads (431), and clients that never finish a request head (`server.header_timeout`).

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{TestGateway, Upstream, closed_port, get, raw_request, send};
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn routes(upstream_url: &str, upstream_extra: &str) -> String {
    format!(
        r#"
[upstreams.app]
url = "{upstream_url}"
{upstream_extra}

[[routes]]
name = "app"
path_prefix = "/"
upstream = "app"
"#
    )
}

async fn gateway_with_server(upstream: &Upstream, server: &str) -> TestGateway {
    TestGateway::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{server}\n{}",
        routes(&upstream.url(), "")
    ))
    .await
}

/// Like `raw_request`, but a write the server cut short is not a failure: the server may
/// answer and close before reading everything (431, 413).
async fn exchange(addr: SocketAddr, raw: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let _ = stream.write_all(raw).await;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::sleep(Duration::from_secs(5));
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            read = stream.read(&mut buf) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            },
            () = &mut deadline => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn status_line(raw: &str) -> &str {
    raw.split("\r\n").next().unwrap_or("")
}

#[tokio::test]
async fn refused_upstream_is_a_502_counted_as_connect() {
    let url = format!("http://127.0.0.1:{}", closed_port());
    let gw = TestGateway::start(&routes(&url, "")).await;

    let (status, headers, body) = get(&gw.url("/anything")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::BAD_GATEWAY, "Bad Gateway\n")
    );
    assert_eq!(headers["content-type"], "text/plain; charset=utf-8");
    assert_eq!(
        gw.metric("floodgate_upstream_errors_total{upstream=\"app\",kind=\"connect\"}")
            .await,
        1.0
    );
    assert_eq!(
        gw.metric("floodgate_upstream_errors_total{upstream=\"app\",kind=\"timeout\"}")
            .await,
        0.0
    );
    assert_eq!(
        gw.metric("floodgate_requests_total{route=\"app\",status=\"502\"}")
            .await,
        1.0
    );
}

/// An upstream that reads a request, writes `reply` (nothing, or something that is not
/// HTTP) and closes the connection.
async fn broken_upstream(reply: &'static [u8]) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf).await;
            let _ = stream.write_all(reply).await;
        }
    });
    (url, task)
}

#[tokio::test]
async fn upstream_closing_or_answering_garbage_is_a_502_counted_as_reset() {
    for reply in [&b""[..], b"garbage\r\n\r\n"] {
        let (url, upstream) = broken_upstream(reply).await;
        let gw = TestGateway::start(&routes(&url, "")).await;

        let (status, _, body) = get(&gw.url("/anything")).await;
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::BAD_GATEWAY, "Bad Gateway\n"),
            "{reply:?}"
        );
        assert_eq!(
            gw.metric("floodgate_upstream_errors_total{upstream=\"app\",kind=\"reset\"}")
                .await,
            1.0,
            "{reply:?}"
        );
        assert_eq!(
            gw.metric("floodgate_upstream_errors_total{upstream=\"app\",kind=\"connect\"}")
                .await,
            0.0,
            "{reply:?}"
        );
        upstream.abort();
    }
}

#[tokio::test]
async fn upstream_slower_than_its_timeout_is_a_504_counted_as_timeout() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&routes(&upstream.url(), "timeout = \"200ms\"")).await;

    let started = Instant::now();
    let (status, _, body) = get(&gw.url("/slow?ms=2000")).await;
    let elapsed = started.elapsed();
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::GATEWAY_TIMEOUT, "Gateway Timeout\n")
    );
    assert!(
        elapsed >= Duration::from_millis(200) && elapsed < Duration::from_millis(1500),
        "answered after {elapsed:?}"
    );
    assert_eq!(
        gw.metric("floodgate_upstream_errors_total{upstream=\"app\",kind=\"timeout\"}")
            .await,
        1.0
    );
    assert_eq!(
        gw.metric("floodgate_upstream_errors_total{upstream=\"app\",kind=\"connect\"}")
            .await,
        0.0
    );

    // Within the timeout, the same upstream answers normally.
    let (status, _, body) = get(&gw.url("/slow?ms=10")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

fn post(url: &str, body: Vec<u8>) -> Request<Full<Bytes>> {
    Request::post(url).body(Full::new(Bytes::from(body))).unwrap()
}

#[tokio::test]
async fn declared_body_over_max_body_is_a_413_and_not_forwarded() {
    let upstream = Upstream::start().await;
    let gw = gateway_with_server(&upstream, "max_body = \"1KB\"").await;

    let (status, _, body) = send(post(&gw.url("/upload"), vec![b'x'; 2000])).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::PAYLOAD_TOO_LARGE, "Payload Too Large\n")
    );
    let (status, _, _) = send(post(&gw.url("/upload"), vec![b'x'; 1025])).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(upstream.connections(), 0);
    assert_eq!(upstream.requests(), 0);

    // At and under the limit the body passes whole.
    for size in [1000, 1024] {
        let (status, _, seen) = send(post(&gw.url("/upload"), vec![b'x'; size])).await;
        assert_eq!(status, StatusCode::OK, "{seen}");
        assert!(seen.ends_with(&format!("body-bytes: {size}\n")), "{seen}");
    }
    assert_eq!(
        gw.metric("floodgate_requests_total{route=\"app\",status=\"413\"}")
            .await,
        2.0
    );
}

fn chunked(path: &str, chunks: usize, chunk_size: usize) -> Vec<u8> {
    let mut raw =
        format!("POST {path} HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
            .into_bytes();
    for _ in 0..chunks {
        raw.extend_from_slice(format!("{chunk_size:x}\r\n").as_bytes());
        raw.extend(std::iter::repeat_n(b'y', chunk_size));
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    raw
}

#[tokio::test]
async fn chunked_body_over_max_body_is_a_413() {
    let upstream = Upstream::start().await;
    let gw = gateway_with_server(&upstream, "max_body = \"1KB\"").await;

    let raw = exchange(gw.addr, &chunked("/upload", 5, 500)).await;
    assert_eq!(status_line(&raw), "HTTP/1.1 413 Payload Too Large", "{raw}");
    assert!(raw.ends_with("\r\n\r\nPayload Too Large\n"), "{raw}");

    // Under the limit, a chunked body passes whole.
    let raw = raw_request(gw.addr, &chunked("/upload", 4, 256)).await;
    assert_eq!(status_line(&raw), "HTTP/1.1 200 OK", "{raw}");
    assert!(raw.ends_with("body-bytes: 1024\n"), "{raw}");
}

#[tokio::test]
async fn ambiguous_framing_is_a_400_and_never_forwarded() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&routes(&upstream.url(), "")).await;

    for raw in [
        "POST /smuggle HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "POST /smuggle HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
        "POST /smuggle HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
        "POST /smuggle HTTP/1.1\r\nHost: h\r\nContent-Length: 5, 6\r\n\r\nhello!",
    ] {
        let answer = exchange(gw.addr, raw.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 400 "), "{raw:?} -> {answer}");
    }
    assert_eq!(upstream.requests(), 0);

    // Hidden behind a clean request on the same connection, it is found all the same.
    let answer = exchange(
        gw.addr,
        b"POST /clean HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc\
          POST /smuggle HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n\
          0\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    assert!(answer.contains("POST /clean\n"), "{answer}");
    assert!(answer.contains("body-bytes: 3\nHTTP/1.1 400 "), "{answer}");
    assert!(!answer.contains("/smuggle"), "{answer}");
    assert_eq!(upstream.requests(), 1);
}

#[tokio::test]
async fn oversized_header_block_is_a_431() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&routes(&upstream.url(), "")).await;

    let big = "a".repeat(70 * 1024);
    let answer = exchange(
        gw.addr,
        format!("GET /big-head HTTP/1.1\r\nHost: h\r\nX-Big: {big}\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(
        status_line(&answer),
        "HTTP/1.1 431 Request Header Fields Too Large",
        "{answer}"
    );
    assert_eq!(upstream.requests(), 0);

    // A large head under the limit is forwarded.
    let big = "b".repeat(32 * 1024);
    let answer = raw_request(
        gw.addr,
        format!("GET /big-head HTTP/1.1\r\nHost: h\r\nX-Big: {big}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(status_line(&answer), "HTTP/1.1 200 OK");
    assert_eq!(upstream.requests(), 1);
}

/// How long until the gateway ends a connection on which `sent` was written.
async fn disconnected_after(addr: SocketAddr, sent: &[u8]) -> (Duration, Vec<u8>) {
    let started = Instant::now();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(sent).await.unwrap();
    let mut received = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut received)).await;
    assert!(read.is_ok(), "still connected after 5 s");
    (started.elapsed(), received)
}

#[tokio::test]
async fn clients_that_never_finish_a_head_are_disconnected() {
    let upstream = Upstream::start().await;
    let gw = gateway_with_server(&upstream, "header_timeout = \"300ms\"").await;

    for sent in [&b""[..], b"GET /sl"] {
        let (elapsed, received) = disconnected_after(gw.addr, sent).await;
        assert!(
            elapsed >= Duration::from_millis(250) && elapsed < Duration::from_secs(3),
            "{sent:?}: disconnected after {elapsed:?}"
        );
        assert_eq!(String::from_utf8_lossy(&received), "", "{sent:?}");
    }

    // A later head on a keep-alive connection is bounded too.
    let (elapsed, received) = disconnected_after(
        gw.addr,
        b"GET /first HTTP/1.1\r\nHost: h\r\n\r\nGET /second HTTP/1.1\r\nHo",
    )
    .await;
    assert!(
        elapsed >= Duration::from_millis(250) && elapsed < Duration::from_secs(3),
        "disconnected after {elapsed:?}"
    );
    let received = String::from_utf8_lossy(&received);
    assert!(received.starts_with("HTTP/1.1 200 "), "{received}");
    assert_eq!(upstream.requests(), 1);
}
