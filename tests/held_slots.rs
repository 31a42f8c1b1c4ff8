//! How long a request holds its concurrency-limit slots (`algorithm = "concurrency"`) and
//! its server slot (`max_requests`): not while a client fails to read. A client that reads
//! nothing of its response is cut off after `server.send_timeout`.

mod common;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{TestGateway, Upstream, get};
use http::{Request, StatusCode};
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpSocket, TcpStream};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A gateway with `server` keys in `[server]`, `upstream` keys in `[upstreams.app]`, and
/// a concurrency limit of `limit` per client address when given.
async fn gateway(app: &Upstream, server: &str, upstream: &str, limit: Option<u32>) -> TestGateway {
    let limits = match limit {
        Some(limit) => format!(
            "[limits.inflight]\nalgorithm = \"concurrency\"\nlimit = {limit}\nkey = [\"client_ip\"]\n"
        ),
        None => String::new(),
    };
    TestGateway::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{server}\n\n\
         [upstreams.app]\nurl = \"{}\"\n{upstream}\n\n{limits}\n\
         [[routes]]\nname = \"app\"\npath_prefix = \"/\"\nupstream = \"app\"\n{}\n",
        app.url(),
        if limit.is_some() {
            "limits = [\"inflight\"]"
        } else {
            ""
        },
    ))
    .await
}

async fn until(what: &str, within: Duration, condition: impl Fn() -> bool) {
    let started = Instant::now();
    while !condition() {
        assert!(started.elapsed() < within, "never: {what}");
        tokio::time::sleep(ms(5)).await;
    }
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
async fn a_client_that_reads_nothing_frees_the_server_slot(http2: bool) {
    let app = Upstream::start().await;
    let gw = gateway(
        &app,
        "send_timeout = \"1s\"",
        "max_requests = 1\nqueue_timeout = \"5s\"\ntimeout = \"1s\"",
        None,
    )
    .await;
    let a = small_window_socket(gw.addr).await;
    let _a: Box<dyn Send> = if http2 {
        Box::new(unread_http2_response(a, &gw.url("/big?bytes=300000000")).await)
    } else {
        Box::new(unread_http1_response(a).await)
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

/// Sends `GET url` over HTTP/2 on `stream`, granting the gateway a window of 1 GB, and
/// stops reading the socket once the response head is in. Returns what keeps the
/// connection open.
async fn unread_http2_response(
    stream: TcpStream,
    url: &str,
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
        .initial_stream_window_size(1 << 30)
        .initial_connection_window_size(1 << 30)
        .handshake(TokioIo::new(io))
        .await
        .unwrap();
    tokio::spawn(connection);
    let request = Request::get(url).body(Full::new(Bytes::new())).unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    deaf.store(true, Ordering::SeqCst);
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
    a_client_that_reads_nothing_frees_the_server_slot(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_reads_nothing_is_cut_off_after_send_timeout() {
    a_client_that_reads_nothing_frees_the_server_slot(true).await;
}
