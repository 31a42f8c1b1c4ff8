//! Gateway errors (docs/configuration.md#status-codes): upstream refused or broken (502) or slow (504) with their
//! metrics, `server.max_body` (413), ambiguous framing (400, never forwarded), oversized
//! heads (431), and clients that never finish a request head (`server.header_timeout`).

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::common::config::GatewayToml;
use crate::common::{TestGateway, Upstream, closed_port, get, raw_request, send};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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
    let gw = TestGateway::start(GatewayToml::new().proxy_to(&url, "")).await;

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
        let gw = TestGateway::start(GatewayToml::new().proxy_to(&url, "")).await;

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
    let gw = TestGateway::proxy_to(&upstream, "", "timeout = \"200ms\"").await;

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

/// Each request on a kept-alive upstream connection has the whole timeout from its own
/// start, whether the connection's last request ended just now or longer ago than the
/// timeout.
#[tokio::test]
async fn each_request_on_a_pooled_connection_has_its_own_timeout() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "", "timeout = \"300ms\"").await;
    let timed = |path: &'static str| {
        let url = gw.url(path);
        async move {
            let started = Instant::now();
            let (status, _, _) = get(&url).await;
            (status, started.elapsed())
        }
    };

    // Right after a quick request, and long after one: answered when the upstream is in
    // time, a 504 no sooner than the timeout when it is not.
    for pause in [Duration::from_millis(200), Duration::from_millis(700)] {
        assert_eq!(timed("/slow?ms=10").await.0, StatusCode::OK);
        tokio::time::sleep(pause).await;
        let (status, elapsed) = timed("/slow?ms=150").await;
        assert_eq!(status, StatusCode::OK, "after {pause:?}");
        assert!(elapsed >= Duration::from_millis(150), "{elapsed:?}");
        tokio::time::sleep(pause).await;
        let (status, elapsed) = timed("/slow?ms=2000").await;
        assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "after {pause:?}");
        assert!(
            elapsed >= Duration::from_millis(300) && elapsed < Duration::from_millis(1500),
            "after {pause:?}: answered after {elapsed:?}"
        );
    }
    assert_eq!(
        gw.metric("floodgate_upstream_errors_total{upstream=\"app\",kind=\"timeout\"}")
            .await,
        2.0
    );
}

fn post(url: &str, body: Vec<u8>) -> Request<Full<Bytes>> {
    Request::post(url).body(Full::new(Bytes::from(body))).unwrap()
}

#[tokio::test]
async fn declared_body_over_max_body_is_a_413_and_not_forwarded() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "max_body = \"1KB\"", "").await;

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
    let gw = TestGateway::proxy_to(&upstream, "max_body = \"1KB\"", "").await;

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
    let gw = TestGateway::proxy_to(&upstream, "", "").await;

    for raw in [
        "POST /smuggle HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "POST /smuggle HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
        "POST /smuggle HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
        "POST /smuggle HTTP/1.1\r\nHost: h\r\nContent-Length: 5, 6\r\n\r\nhello!",
        // Given twice, even alike (hyper would take them as one).
        "POST /smuggle HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
    ] {
        let answer = exchange(gw.addr, raw.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 400 "), "{raw:?} -> {answer}");
        assert!(answer.ends_with("\r\n\r\nBad Request\n"), "{raw:?} -> {answer}");
    }
    assert_eq!(upstream.requests(), 0);
    // floodgate answers them before hyper reads them, and counts and logs them.
    const REFUSED: &str = r#"floodgate_requests_total{route="",status="400"}"#;
    gw.metric_becomes(REFUSED, 5.0, Duration::from_secs(2)).await;

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
    gw.metric_becomes(REFUSED, 6.0, Duration::from_secs(2)).await;
}

/// Request lines that look plain but that hyper's parser or its URI rules refuse (bytes
/// a target may not hold, a method that is not a token) get floodgate's own 400 like
/// every other refused head: its body and request ID, not hyper's bare answer. Nothing is
/// forwarded.
#[tokio::test]
async fn heads_hyper_would_refuse_get_floodgates_own_400() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "", "").await;
    for raw in [
        &b"GET /<script>alert(1)</script> HTTP/1.1\r\nHost: h\r\n\r\n"[..],
        b"GET /search?q=\"x\" HTTP/1.1\r\nHost: h\r\n\r\n",
        b"GET /a`b HTTP/1.1\r\nHost: h\r\n\r\n",
        b"GET /\xff\xfe HTTP/1.1\r\nHost: h\r\n\r\n",
        b"GET /\x7f HTTP/1.1\r\nHost: h\r\n\r\n",
        b"G(T / HTTP/1.1\r\nHost: h\r\n\r\n",
    ] {
        let answer = exchange(gw.addr, raw).await;
        let shown = String::from_utf8_lossy(raw);
        assert_eq!(
            status_line(&answer),
            "HTTP/1.1 400 Bad Request",
            "{shown:?} -> {answer}"
        );
        assert!(answer.ends_with("\r\n\r\nBad Request\n"), "{shown:?} -> {answer}");
        assert!(answer.contains("\r\nx-request-id: "), "{shown:?} -> {answer}");
    }
    assert_eq!(upstream.requests(), 0);
    // What hyper takes goes on as before: a fragment, braces and a quote in the path,
    // UTF-8, an absolute-form target, a tab in a value.
    for raw in [
        &b"GET /a#frag HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"[..],
        b"GET /{\"json\"}|x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        "GET /caf\u{e9} HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n".as_bytes(),
        b"GET http://h/abs HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: h\r\nX-A: a\tb\r\nConnection: close\r\n\r\n",
    ] {
        let answer = exchange(gw.addr, raw).await;
        assert_eq!(
            status_line(&answer),
            "HTTP/1.1 200 OK",
            "{:?} -> {answer}",
            String::from_utf8_lossy(raw)
        );
    }
    assert_eq!(upstream.requests(), 5);
}

/// Bytes the parser refuses before a head could end are answered at once: a TLS handshake
/// sent to the plain port (which never sends a line end), a broken request line.
#[tokio::test]
async fn a_head_refused_before_it_ends_is_answered_at_once() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "", "").await;
    for start in [
        &b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"[..],
        b"GET /a b HTTP/1.1\r\nHost: h\r\n",
    ] {
        let mut stream = TcpStream::connect(gw.addr).await.unwrap();
        stream.write_all(start).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(3), stream.read_to_end(&mut answer))
            .await
            .expect("answered and closed at once")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{answer}");
    }
    assert_eq!(upstream.requests(), 0);
}

#[tokio::test]
async fn oversized_header_block_is_a_431() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "", "").await;

    let big = "a".repeat(40 * 1024);
    let answer = exchange(
        gw.addr,
        format!("GET /big-head HTTP/1.1\r\nHost: h\r\nX-Big: {big}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(
        status_line(&answer),
        "HTTP/1.1 431 Request Header Fields Too Large",
        "{answer}"
    );
    assert_own_431(&answer);
    // A head that does not end within the 64 KB read for one is refused by the framing
    // guard, before hyper: the same answer, and the connection closed at once (the
    // exchange ends well before its 5 s). So is one that came whole but longer, a target
    // of 66,000 bytes say (hyper would have answered a bare 414).
    let long_target = format!("GET /{} HTTP/1.1\r\nHost: h\r\n\r\n", "t".repeat(66_000));
    let answer = exchange(gw.addr, long_target.as_bytes()).await;
    assert_own_431(&answer);
    assert!(
        answer.to_ascii_lowercase().contains("\r\nconnection: close\r\n"),
        "{answer}"
    );
    let mut endless = b"GET /endless HTTP/1.1\r\nHost: h\r\nX-Big: ".to_vec();
    endless.resize(70 * 1024, b'e');
    let asked = std::time::Instant::now();
    let answer = exchange(gw.addr, &endless).await;
    assert!(asked.elapsed() < Duration::from_secs(4), "{:?}", asked.elapsed());
    assert_own_431(&answer);
    assert!(
        answer.to_ascii_lowercase().contains("\r\nconnection: close\r\n"),
        "{answer}"
    );
    assert_eq!(upstream.requests(), 0);
    gw.metric_becomes(
        r#"floodgate_requests_total{route="",status="431"}"#,
        3.0,
        Duration::from_secs(2),
    )
    .await;

    // A large head under the limit is forwarded.
    let big = "b".repeat(30 * 1024);
    let answer = raw_request(
        gw.addr,
        format!("GET /big-head HTTP/1.1\r\nHost: h\r\nX-Big: {big}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(status_line(&answer), "HTTP/1.1 200 OK");
    assert_eq!(upstream.requests(), 1);
}

/// floodgate's own 431: its one-line body, as plain text, with the request ID every
/// answer carries.
fn assert_own_431(answer: &str) {
    assert_eq!(
        status_line(answer),
        "HTTP/1.1 431 Request Header Fields Too Large",
        "{answer}"
    );
    assert!(
        answer.ends_with("\r\n\r\nRequest Header Fields Too Large\n"),
        "{answer}"
    );
    let lower = answer.to_ascii_lowercase();
    for field in ["content-type: text/plain; charset=utf-8", "x-request-id: "] {
        assert!(lower.contains(&format!("\r\n{field}")), "{field}: {answer}");
    }
}

/// `count` fields of `size` bytes each as HTTP/1.1 writes them (`x-N: vvv` and CRLF).
fn small_fields(count: usize, size: usize) -> Vec<(String, String)> {
    (0..count)
        .map(|i| {
            let name = format!("x-{i:05}");
            let value = "v".repeat(size - name.len() - 4);
            (name, value)
        })
        .collect()
}

#[tokio::test]
async fn heads_are_limited_by_size_alike_over_http1_and_http2() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "", "").await;
    let h2 = common::h2c_client();
    // (fields, bytes each, expected): many small fields fit; 32 KB in all is the limit.
    // "host: 127.0.0.1:PORT" takes 25 or 26 bytes besides.
    for (count, size, expected) in [
        (150, 12, StatusCode::OK),
        (2000, 16, StatusCode::OK),
        (1000, 32, StatusCode::OK),
        (8, 4096, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE),
        (1100, 30, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE),
    ] {
        let fields = small_fields(count, size);
        let build = || {
            let mut request = Request::get(gw.url("/fields"));
            for (name, value) in &fields {
                request = request.header(name, value);
            }
            request.body(Full::new(Bytes::new())).unwrap()
        };
        let (status, _, body) = send(build()).await;
        assert_eq!(
            status, expected,
            "HTTP/1.1, {count} fields of {size} bytes: {body}"
        );
        let response = h2.request(build()).await.expect("h2 request");
        assert_eq!(
            response.status(),
            expected,
            "HTTP/2, {count} fields of {size} bytes"
        );
    }
    assert_eq!(upstream.requests(), 6, "only what fits is forwarded");
}

/// `count` fields named `f0`, `f1`... (an `x-rep` now and then, on both sides of the
/// 100th), each value with a space and a tab inside, and `extra` fields at given places.
fn numbered_fields(count: usize, extra: &[(usize, &str)]) -> Vec<String> {
    let mut fields: Vec<String> = (0..count)
        .map(|i| match i {
            10 | 98 | 99 | 100 | 140 => format!("X-Rep: r{i} \tx"),
            _ => format!("f{i}: {} \tv", i % 10),
        })
        .collect();
    for (at, field) in extra {
        fields.insert(*at, (*field).to_owned());
    }
    fields
}

/// What an upstream that lists the fields it got, grouped by name in the order of their
/// first appearance as a field map holds them, shows of `fields` (the numbered ones).
fn listed(fields: &[String]) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for field in fields {
        let name = field.split(':').next().unwrap().to_ascii_lowercase();
        if !names.contains(&name) {
            names.push(name);
        }
    }
    let numbered = |name: &str| name == "x-rep" || name.starts_with('f');
    let mut lines = Vec::new();
    for name in names.iter().filter(|name| numbered(name)) {
        for field in fields {
            let (field_name, value) = field.split_once(':').unwrap();
            if field_name.eq_ignore_ascii_case(name) {
                lines.push(format!("{name}: {}", value.trim()));
            }
        }
    }
    lines
}

/// The upstream's list of the numbered fields in `description`.
fn numbered_lines(description: &str) -> Vec<String> {
    description
        .lines()
        .filter(|line| line.starts_with("x-rep: ") || (line.starts_with('f') && line.contains(": ")))
        .map(str::to_owned)
        .collect()
}

/// hyper's parser is given room for 100 fields; the gateway takes any number within 32 KB
/// (the rest folded past hyper and unfolded before the request is read), and forwards them
/// all, each value as sent, with the fields that frame a body acted on wherever they stand.
#[tokio::test]
async fn a_head_of_many_fields_reaches_the_upstream_whole() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "", "").await;
    for count in [101, 150, 2000] {
        let fields = numbered_fields(count, &[(60, "Host: h"), (count, "Connection: close")]);
        let head = format!("GET /fields HTTP/1.1\r\n{}\r\n\r\n", fields.join("\r\n"));
        let answer = exchange(gw.addr, head.as_bytes()).await;
        assert_eq!(status_line(&answer), "HTTP/1.1 200 OK", "{count} fields");
        assert_eq!(numbered_lines(&answer), listed(&fields), "{count} fields");
    }
    // A body framed by a field past the 100th, then a request after it on the connection.
    for (framing, body) in [
        (
            "Transfer-Encoding: chunked",
            "5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        ),
        ("Content-Length: 11", "hello world"),
    ] {
        let fields = numbered_fields(150, &[(1, "Host: h"), (130, framing)]);
        let raw = format!(
            "POST /first HTTP/1.1\r\n{}\r\n\r\n{body}GET /second HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
            fields.join("\r\n")
        );
        let answer = exchange(gw.addr, raw.as_bytes()).await;
        let statuses: Vec<&str> = answer.lines().filter(|l| l.starts_with("HTTP/1.1 ")).collect();
        assert_eq!(statuses, ["HTTP/1.1 200 OK"; 2], "{framing}: {answer}");
        let second = answer.find("GET /second").expect("the second request forwarded");
        assert!(answer[..second].contains("POST /first"), "{answer}");
        assert!(
            answer[..second].contains("body-bytes: 11\n"),
            "{framing}: {answer}"
        );
        assert_eq!(numbered_lines(&answer[..second]), listed(&fields), "{framing}");
    }
    assert_eq!(upstream.requests(), 7);
}

#[tokio::test]
async fn framing_is_checked_on_every_request_after_a_declined_upgrade_or_connect() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "", "").await;
    let smuggle = "POST /smuggled HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
    for first in [
        // The upstream answers 200: it declines the switch.
        "GET /c HTTP/1.1\r\nHost: h\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
        "GET /c HTTP/1.1\r\nHost: h\r\nUpgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n",
        // Refused by the gateway itself (no path to route).
        "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
    ] {
        let before = upstream.requests();
        let answer = exchange(gw.addr, format!("{first}{smuggle}").as_bytes()).await;
        let statuses: Vec<&str> = answer.lines().filter(|l| l.starts_with("HTTP/1.1 ")).collect();
        assert_eq!(statuses.len(), 2, "{first:?} -> {answer}");
        assert!(statuses[0] != "HTTP/1.1 101 Switching Protocols", "{answer}");
        assert_eq!(statuses[1], "HTTP/1.1 400 Bad Request", "{first:?} -> {answer}");
        assert!(!answer.contains("/smuggled"), "{answer}");
        let forwarded = upstream.requests() - before;
        assert!(
            forwarded <= 1,
            "{first:?}: the smuggled request reached the upstream"
        );
    }
}

#[tokio::test]
async fn a_request_needs_exactly_one_valid_host() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "", "").await;
    for head in [
        "GET /h HTTP/1.1\r\nHost: app.example\r\nHost: admin.example\r\n",
        "GET /h HTTP/1.1\r\nHost: user@admin.example.com\r\n",
        "GET /h HTTP/1.1\r\nHost: admin.example.com,other\r\n",
        "GET /h HTTP/1.1\r\nHost: \r\n",
        "GET /h HTTP/1.1\r\n",
        "GET /h HTTP/1.1\r\nHost: a b\r\n",
        "GET http://admin.example/h HTTP/1.1\r\nHost: app.example\r\n",
        "GET http://user@app.example/h HTTP/1.1\r\nHost: app.example\r\n",
    ] {
        let answer = exchange(gw.addr, format!("{head}Connection: close\r\n\r\n").as_bytes()).await;
        assert_eq!(
            status_line(&answer),
            "HTTP/1.1 400 Bad Request",
            "{head:?} -> {answer}"
        );
    }
    assert_eq!(upstream.requests(), 0);

    // An absolute-form target that agrees with Host is forwarded, Host as it was sent.
    let answer = raw_request(
        gw.addr,
        b"GET http://App.Example:80/h HTTP/1.1\r\nHost: app.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_line(&answer), "HTTP/1.1 200 OK", "{answer}");
    assert_eq!(upstream.requests(), 1);
}

#[tokio::test]
async fn transfer_codings_other_than_chunked_are_501_and_not_forwarded() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "", "").await;
    let answer = exchange(
        gw.addr,
        b"POST /te HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(status_line(&answer), "HTTP/1.1 501 Not Implemented", "{answer}");
    assert!(answer.contains("connection: close"), "{answer}");
    // Without chunked last, the length is unknowable: 400 (RFC 9112 §6.3).
    let answer = exchange(
        gw.addr,
        b"POST /te HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\n\r\nabc",
    )
    .await;
    assert_eq!(status_line(&answer), "HTTP/1.1 400 Bad Request", "{answer}");
    assert_eq!(upstream.requests(), 0);
}

/// An upstream that reads request heads and bodies byte by byte and reports, per
/// connection, how many body bytes it saw before the connection ended.
async fn body_reading_upstream() -> (String, tokio::sync::mpsc::UnboundedReceiver<usize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (report, reports) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let report = report.clone();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = [0u8; 1024];
                while let Ok(n) = stream.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    seen.extend_from_slice(&buf[..n]);
                }
                let body = seen
                    .windows(4)
                    .position(|w| w == b"\r\n\r\n")
                    .map_or(0, |end| seen.len() - end - 4);
                let _ = report.send(body);
            });
        }
    });
    (url, reports)
}

#[tokio::test]
async fn a_body_paused_longer_than_body_timeout_is_a_408_and_aborted_upstream() {
    let (url, mut upstream_connections) = body_reading_upstream().await;
    let gw = TestGateway::start(
        GatewayToml::new()
            .server("body_timeout = \"400ms\"")
            .proxy_to(&url, ""),
    )
    .await;
    let mut client = TcpStream::connect(gw.addr).await.unwrap();
    client
        .write_all(b"POST /upload HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\nab")
        .await
        .unwrap();
    // Pauses shorter than the limit are fine...
    tokio::time::sleep(Duration::from_millis(200)).await;
    client.write_all(b"c").await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    client.write_all(b"d").await.unwrap();
    // ...a longer one is not.
    let started = Instant::now();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the connection is closed");
    let elapsed = started.elapsed();
    let answer = String::from_utf8_lossy(&answer);
    assert_eq!(status_line(&answer), "HTTP/1.1 408 Request Timeout", "{answer}");
    assert!(answer.contains("connection: close"), "{answer}");
    assert!(
        elapsed >= Duration::from_millis(350) && elapsed < Duration::from_secs(3),
        "answered after {elapsed:?}"
    );
    // The upstream saw the bytes sent so far, then its connection end: never the rest.
    let upstream_saw = tokio::time::timeout(Duration::from_secs(2), upstream_connections.recv())
        .await
        .expect("the upstream connection is closed")
        .unwrap();
    assert_eq!(upstream_saw, 4);
    assert_eq!(
        gw.metric("floodgate_requests_total{route=\"app\",status=\"408\"}")
            .await,
        1.0
    );
}

/// An upstream's `timeout` is the server's: waiting for a client's slow body is not
/// counted against it, nor the server failed for it; the server gets its `timeout` from
/// the body's end.
#[tokio::test]
async fn a_slow_upload_does_not_use_up_the_servers_timeout() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "", "timeout = \"300ms\"").await;
    let mut client = TcpStream::connect(gw.addr).await.unwrap();
    client
        .write_all(b"POST /upload HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nConnection: close\r\n\r\nab")
        .await
        .unwrap();
    // Each pause within body_timeout; together longer than the server's timeout.
    for byte in [b"c", b"d"] {
        tokio::time::sleep(Duration::from_millis(250)).await;
        client.write_all(byte).await.unwrap();
    }
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut answer))
        .await
        .expect("answered")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert_eq!(status_line(&answer), "HTTP/1.1 200 OK", "{answer}");
    assert!(answer.ends_with("body-bytes: 4\n"), "{answer}");
    assert_eq!(
        gw.metric("floodgate_upstream_errors_total{upstream=\"app\",kind=\"timeout\"}")
            .await,
        0.0
    );
    // A server that has the whole body and does not answer still runs out of it.
    let (url, _) = body_reading_upstream().await;
    let gw = TestGateway::start(GatewayToml::new().proxy_to(&url, "timeout = \"300ms\"")).await;
    let started = Instant::now();
    let answer = raw_request(
        gw.addr,
        b"POST /upload HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nConnection: close\r\n\r\nabcd",
    )
    .await;
    assert_eq!(status_line(&answer), "HTTP/1.1 504 Gateway Timeout", "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

/// While a body goes out, the server's `timeout` is time without progress: a server that
/// reads a large body slowly, but steadily, past its `timeout`, then answers, is not
/// timed out. (What the kernel's buffers hold once written is the server's to read: the
/// body is larger than they are, and its last half is read at once.)
#[tokio::test]
async fn a_server_reading_a_large_body_steadily_is_not_timed_out() {
    const BODY: usize = 16 << 20;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut seen = 0;
        let mut buf = vec![0u8; 512 * 1024];
        while seen < BODY {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => seen += n,
            }
            // The first half at about 2 MB a second: 4 s, past the 2 s timeout, with a
            // read every 250 ms (room for a loaded machine's pauses: a clean-clone CI run,
            // tests four at a time beside a release build's link, once saw the gateway
            // make no progress for over 850 ms against a 1 s timeout).
            if seen < BODY / 2 {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
        let _ = stream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\nconnection: close\r\n\r\nread")
            .await;
    });
    let gw = TestGateway::start(GatewayToml::new().proxy_to(&url, "timeout = \"2s\"")).await;
    let request = Request::post(gw.url("/upload"))
        .body(Full::new(Bytes::from(vec![b'x'; BODY])))
        .unwrap();
    let started = Instant::now();
    let (status, _, body) = send(request).await;
    let elapsed = started.elapsed();
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "read"),
        "after {elapsed:?}"
    );
    assert!(elapsed > Duration::from_millis(2500), "{elapsed:?}");
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

/// Connections to `addr` (with `header_timeout = "300ms"`) that send nothing, half a head
/// (`partial`), or a whole request and then half of another (`keep_alive`) are each closed
/// at the timeout; returns what the last one received.
async fn half_heads_are_cut_off(addr: std::net::SocketAddr, partial: &[u8], keep_alive: &[u8]) -> String {
    let mut last = String::new();
    for sent in [&b""[..], partial, keep_alive] {
        let (elapsed, received) = disconnected_after(addr, sent).await;
        assert!(
            elapsed >= Duration::from_millis(250) && elapsed < Duration::from_secs(3),
            "{sent:?}: disconnected after {elapsed:?}"
        );
        last = String::from_utf8_lossy(&received).into_owned();
        if sent != keep_alive {
            assert_eq!(last, "", "{sent:?}");
        }
    }
    last
}

#[tokio::test]
async fn clients_that_never_finish_a_head_are_disconnected() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "header_timeout = \"300ms\"", "").await;
    // A later head on a keep-alive connection is bounded too.
    let received = half_heads_are_cut_off(
        gw.addr,
        b"GET /sl",
        b"GET /first HTTP/1.1\r\nHost: h\r\n\r\nGET /second HTTP/1.1\r\nHo",
    )
    .await;
    assert!(received.starts_with("HTTP/1.1 200 "), "{received}");
    assert_eq!(upstream.requests(), 1);
}

/// The admin listener closes idle and half-sent connections as the proxy listener does.
#[tokio::test]
async fn admin_clients_that_never_finish_a_head_are_disconnected() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "header_timeout = \"300ms\"", "").await;
    let received = half_heads_are_cut_off(
        gw.admin,
        b"GET /heal",
        b"GET /healthz HTTP/1.1\r\nHost: h\r\n\r\nGET /metrics HTTP/1.1\r\nHo",
    )
    .await;
    assert!(received.starts_with("HTTP/1.1 200 "), "{received}");
    assert!(received.ends_with("ok\n"), "{received}");
}

/// A request body's trailer section holds at most 100 fields (hyper's limit): one with
/// more ends the request with an error, the body never complete upstream (which answers
/// only once it has the whole body), and the connection closes; the next request on it
/// is not read.
#[tokio::test]
async fn a_trailer_section_of_more_than_100_fields_ends_the_request() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "", "").await;
    for (count, expected) in [(100, "HTTP/1.1 200 OK"), (101, "HTTP/1.1 400 Bad Request")] {
        let trailers: String = (0..count).map(|i| format!("t{i}: v\r\n")).collect();
        let raw = format!(
            "POST /whole HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n{trailers}\r\n\
             GET /after HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
        );
        let answer = exchange(gw.addr, raw.as_bytes()).await;
        assert_eq!(status_line(&answer), expected, "{count} trailer fields: {answer}");
        assert_eq!(
            answer.contains("body-bytes: 5\n"),
            count == 100,
            "{count}: {answer}"
        );
        assert_eq!(answer.contains("GET /after"), count == 100, "{count}: {answer}");
    }
}

/// A trailer section that opens with a bare LF: hyper's chunked decoder ends a trailer
/// line only at CR LF, so what follows is trailers to it, and the framing guard reads
/// them as trailers too (it took the LF for their end, and the lines after for a head
/// whose Content-Length hid the next real head from it).
#[tokio::test]
async fn a_trailer_opening_with_a_bare_lf_does_not_hide_the_next_head() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "", "").await;
    let smuggle = "POST /smuggled HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n0\r\n\r\n";
    let raw = format!(
        "POST /clean HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\
         \nGET /pad HTTP/1.1\r\nContent-Length: {}\r\n\r\n{smuggle}",
        smuggle.len()
    );
    let answer = exchange(gw.addr, raw.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    assert!(answer.contains("POST /clean\n"), "{answer}");
    assert!(
        !answer.contains("/smuggled"),
        "the smuggled request was forwarded: {answer}"
    );
    assert_eq!(upstream.requests(), 1);
}

/// A chunk-size line longer than the guard follows (8 KB) but within hyper's 16 KB of
/// chunk extensions, sent in two writes so that the guard sees it incomplete past 8 KB:
/// the request is refused, where the guard used to stop inspecting the connection and
/// let the next request's Content-Length beside Transfer-Encoding through.
#[tokio::test]
async fn a_chunk_extension_too_long_to_follow_ends_the_connection() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::proxy_to(&upstream, "", "").await;
    let mut stream = TcpStream::connect(gw.addr).await.unwrap();
    let extension = "a".repeat(9 * 1024);
    stream
        .write_all(
            format!("POST /clean HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3;x={extension}")
                .as_bytes(),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stream
        .write_all(
            b"\r\nabc\r\n0\r\n\r\n\
              POST /smuggled HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n0\r\n\r\n",
        )
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        !answer.contains("/smuggled"),
        "the smuggled request was forwarded: {answer}"
    );
    assert!(upstream.requests() <= 1, "{answer}");
}

/// An answer given while the client is still sending its body (a route that never reads
/// it, a 413, a server's early answer) reaches the client whole: floodgate ends its side
/// of the connection and reads what the client still sends for a while, where closing at
/// once would have the kernel reset the connection and drop the answer's unsent tail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_to_an_upload_still_being_sent_arrives_whole() {
    const ANSWER: usize = 200_000;
    let gateway = TestGateway::start(GatewayToml::new().route(
        "early",
        &format!(
            "path_prefix = \"/\"\nrespond = {{ status = 200, body = \"{}\" }}",
            "a".repeat(ANSWER)
        ),
    ))
    .await;
    let mut reading = common::endless_upload(gateway.addr, Duration::from_millis(5)).await;
    // The client reads only once it has sent for a while, as one that sends first does.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut answer = Vec::new();
    let mut buffer = vec![0u8; 64 << 10];
    let outcome = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match reading.read(&mut buffer).await {
                Ok(0) => return Ok(()),
                Ok(n) => answer.extend_from_slice(&buffer[..n]),
                Err(error) => return Err(error),
            }
        }
    })
    .await
    .expect("the connection ends");
    let head_end = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head")
        + 4;
    assert!(answer.starts_with(b"HTTP/1.1 200 OK\r\n"));
    assert_eq!(answer.len() - head_end, ANSWER, "the body was cut ({outcome:?})");
    assert!(outcome.is_ok(), "{outcome:?}");
}
