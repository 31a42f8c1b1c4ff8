//! What an upstream's response bytes can and cannot do to floodgate's HTTP/1.1 client: a
//! response is read by its framing and nothing past it answers another request; one with
//! two framings, cut short, with an endless head or bad chunks is never passed off as
//! whole; interim responses and chunk extensions and trailers are read past.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::common::config::GatewayToml;
use crate::common::{TestGateway, endless_upload, get, http1_client, raw_request};
use http::StatusCode;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// An upstream that answers each request head it reads with `reply`, and closes the
/// connection after it when `close`; it counts its connections.
async fn scripted_upstream(reply: &'static [u8], close: bool) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    let connections = Arc::new(AtomicUsize::new(0));
    let count = connections.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut read = Vec::new();
                let mut buffer = [0u8; 4096];
                loop {
                    while let Some(end) = read.windows(4).position(|w| w == b"\r\n\r\n") {
                        read.drain(..end + 4);
                        if stream.write_all(reply).await.is_err() || close {
                            return;
                        }
                    }
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => read.extend_from_slice(&buffer[..n]),
                    }
                }
            });
        }
    });
    (address, connections)
}

async fn gateway_to(upstream: &str) -> TestGateway {
    TestGateway::start(GatewayToml::new().proxy_to(upstream, "")).await
}

/// The status and body of `GET url`, or `None` when the response could not be read whole.
async fn try_get(url: &str) -> Option<(StatusCode, String)> {
    let response = http1_client().get(url.parse().unwrap()).await.ok()?;
    let status = response.status();
    let body = response.into_body().collect().await.ok()?.to_bytes();
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

#[tokio::test]
async fn bytes_past_a_responses_end_never_answer_another_request() {
    let reply =
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled";
    let (upstream, connections) = scripted_upstream(reply, false).await;
    let gateway = gateway_to(&upstream).await;
    for i in 0..3 {
        let (status, _, body) = get(&gateway.url("/")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"), "request {i}");
    }
    assert_eq!(
        connections.load(Ordering::SeqCst),
        3,
        "a connection with bytes past its response was used again"
    );
}

#[tokio::test]
async fn a_response_with_a_length_and_chunks_is_read_as_chunks_and_its_connection_closed() {
    let reply =
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n";
    let (upstream, connections) = scripted_upstream(reply, false).await;
    let gateway = gateway_to(&upstream).await;
    for _ in 0..2 {
        let (status, _, body) = get(&gateway.url("/")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
    }
    assert_eq!(connections.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn chunk_extensions_and_trailers_are_read_past_and_the_connection_kept() {
    let reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Checksum: 1\r\n\r\n";
    let (upstream, connections) = scripted_upstream(reply, false).await;
    let gateway = gateway_to(&upstream).await;
    for _ in 0..3 {
        let (status, _, body) = get(&gateway.url("/")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "abcde"));
    }
    assert_eq!(connections.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn interim_responses_are_read_past() {
    let reply = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
    let (upstream, _) = scripted_upstream(reply, false).await;
    let gateway = gateway_to(&upstream).await;
    let (status, _, body) = get(&gateway.url("/")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
}

#[tokio::test]
async fn a_response_until_close_arrives_whole_on_a_connection_of_its_own() {
    let (upstream, connections) = scripted_upstream(b"HTTP/1.0 200 OK\r\n\r\nuntil the close", true).await;
    let gateway = gateway_to(&upstream).await;
    for _ in 0..2 {
        let (status, _, body) = get(&gateway.url("/")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "until the close"));
    }
    assert_eq!(connections.load(Ordering::SeqCst), 2);
    // floodgate speaks its own version to the client (RFC 9110 §6.2), whose connection
    // the HTTP/1.0 server's does not end.
    let answer = raw_request(
        gateway.addr,
        b"GET / HTTP/1.1\r\nHost: h\r\n\r\nGET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(answer.matches("HTTP/1.1 200 OK\r\n").count(), 2, "{answer}");
    assert_eq!(answer.matches("until the close").count(), 2, "{answer}");
}

/// HTTP/2 has no protocol switch (RFC 9113 §8.6): a `101` a server sends to a request that
/// came over HTTP/2 cannot be passed on, and is a 502 counted as the upstream's error.
#[tokio::test]
async fn a_switch_the_server_makes_for_an_http2_client_is_a_502() {
    let (upstream, _) = scripted_upstream(
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: x\r\n\r\n",
        false,
    )
    .await;
    let gateway = gateway_to(&upstream).await;
    let request = http::Request::get(gateway.url("/"))
        .body(http_body_util::Full::<bytes::Bytes>::default())
        .unwrap();
    let response = crate::common::h2c_client()
        .request(request)
        .await
        .expect("h2 request");
    assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
    gateway
        .metric_becomes(
            "floodgate_upstream_errors_total{upstream=\"app\",kind=\"reset\"}",
            1.0,
            std::time::Duration::from_secs(2),
        )
        .await;
}

#[tokio::test]
async fn a_response_cut_short_or_with_bad_chunks_is_not_passed_off_as_whole() {
    for reply in [
        &b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"[..],
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n",
    ] {
        let (upstream, _) = scripted_upstream(reply, true).await;
        let gateway = gateway_to(&upstream).await;
        let answer = try_get(&gateway.url("/")).await;
        assert!(
            answer.is_none(),
            "{:?} was passed on as {answer:?}",
            String::from_utf8_lossy(reply)
        );
    }
}

#[tokio::test]
async fn heads_that_are_not_http_or_never_end_are_a_502() {
    let endless: &'static [u8] = Box::leak(
        std::iter::once(&b"HTTP/1.1 200 OK\r\n"[..])
            .chain(std::iter::repeat_n(
                &b"X-Filler: 0123456789abcdef0123456789abcdef\r\n"[..],
                4_000,
            ))
            .flatten()
            .copied()
            .collect::<Vec<u8>>()
            .into_boxed_slice(),
    );
    for reply in [
        endless,
        b"SSH-2.0-OpenSSH_9.2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    ] {
        let (upstream, _) = scripted_upstream(reply, false).await;
        let gateway = gateway_to(&upstream).await;
        let (status, _, _) = get(&gateway.url("/")).await;
        assert_eq!(
            status,
            StatusCode::BAD_GATEWAY,
            "{:?}",
            String::from_utf8_lossy(&reply[..40])
        );
    }
}

/// A server switches protocols only to one the request asked for (RFC 9110 §15.2.2): a
/// `101` to a request without `Upgrade`, or to another protocol than it asked for, is a
/// 502 counted as the server's error, and the client's connection goes on; no tunnel
/// starts.
#[tokio::test]
async fn a_switch_the_request_did_not_ask_for_is_a_502() {
    let (upstream, _) = scripted_upstream(
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\nPRI",
        true,
    )
    .await;
    let gateway = gateway_to(&upstream).await;
    for (n, asked) in ["", "Connection: upgrade\r\nUpgrade: websocket\r\n"]
        .into_iter()
        .enumerate()
    {
        let answer = raw_request(
            gateway.addr,
            format!(
                "GET /switch HTTP/1.1\r\nHost: h\r\n{asked}\r\nGET /next HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
        let statuses: Vec<&str> = answer.lines().filter(|l| l.starts_with("HTTP/1.1 ")).collect();
        assert_eq!(
            statuses.first(),
            Some(&"HTTP/1.1 502 Bad Gateway"),
            "{asked:?}: {answer}"
        );
        assert!(!answer.contains("PRI"), "{answer}");
        assert_eq!(statuses.len(), 2, "the next request goes unanswered: {answer}");
        gateway
            .metric_becomes(
                "floodgate_upstream_errors_total{upstream=\"app\",kind=\"reset\"}",
                // The upstream switches for `/next` too.
                (2 * (n + 1)) as f64,
                std::time::Duration::from_secs(2),
            )
            .await;
    }
}

/// How many bytes written to `stream` its peer has yet to acknowledge.
#[allow(unsafe_code)] // ioctl(2)
fn unsent(stream: &tokio::net::TcpStream) -> libc::c_int {
    let mut queued: libc::c_int = 0;
    // SAFETY: TIOCOUTQ writes one int through the pointer, to a valid one; the descriptor
    // is the open socket's, borrowed for the call.
    let done = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(stream),
            libc::TIOCOUTQ,
            &mut queued,
        )
    };
    assert_eq!(done, 0, "ioctl(TIOCOUTQ)");
    queued
}

/// A server that answers an upload early with a body framed by its close, then resets the
/// connection over the part of the upload it never read: every byte of its answer reached
/// floodgate before the reset, and the client, still sending, gets them all, the end
/// included (floodgate's connection to it lingers rather than reset in turn).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_framed_by_the_close_is_whole_after_the_upload_is_refused() {
    const ANSWER: usize = 1 << 20;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            stream.read_exact(&mut byte).await.unwrap();
            head.push(byte[0]);
        }
        stream.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        stream.write_all(&vec![b'a'; ANSWER]).await.unwrap();
        stream.shutdown().await.unwrap();
        // Every byte delivered, then closed with the upload unread: the kernel resets the
        // connection.
        let started = std::time::Instant::now();
        loop {
            let queued = unsent(&stream);
            if queued == 0 {
                break;
            }
            assert!(
                started.elapsed() < std::time::Duration::from_secs(2),
                "{queued} bytes never delivered"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    });
    let gateway = gateway_to(&upstream).await;
    let mut reading = endless_upload(gateway.addr, std::time::Duration::from_millis(10)).await;
    // Read nothing at first, so that floodgate still has the end to read when the reset comes.
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    let mut answer = Vec::new();
    let mut buffer = vec![0u8; 64 << 10];
    loop {
        match reading.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) => answer.extend_from_slice(&buffer[..n]),
        }
        if answer.ends_with(b"\r\n0\r\n\r\n") {
            break;
        }
    }
    let text = String::from_utf8_lossy(&answer[..answer.len().min(200)]).into_owned();
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(
        answer.ends_with(b"\r\n0\r\n\r\n"),
        "the answer was cut after {} bytes",
        answer.len()
    );
    let head_end = answer.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    assert_eq!(dechunked(&answer[head_end..]), vec![b'a'; ANSWER]);
}

/// The data of a chunked body, whose every chunk must be well formed.
fn dechunked(mut chunked: &[u8]) -> Vec<u8> {
    let mut data = Vec::new();
    loop {
        let line_end = chunked
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("a chunk-size line");
        let size = usize::from_str_radix(std::str::from_utf8(&chunked[..line_end]).unwrap(), 16).unwrap();
        chunked = &chunked[line_end + 2..];
        if size == 0 {
            assert_eq!(chunked, b"\r\n", "the end of the body");
            return data;
        }
        data.extend_from_slice(&chunked[..size]);
        assert_eq!(&chunked[size..size + 2], b"\r\n");
        chunked = &chunked[size + 2..];
    }
}
