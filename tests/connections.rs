//! `server.max_connections`: past it the listeners accept no more, and a new connection
//! waits in the kernel's queue until one closes; the admin listener is not counted.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::config::GatewayToml;
use crate::common::{TestGateway, Upstream, get};

/// Sends a request on `stream` and reads its answer's status line, within `within`.
async fn status_line(stream: &mut TcpStream, within: Duration) -> Option<String> {
    stream
        .write_all(b"GET /ok HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .ok()?;
    let mut answer = vec![0u8; 1024];
    let read = tokio::time::timeout(within, stream.read(&mut answer))
        .await
        .ok()?
        .ok()?;
    let answer = String::from_utf8_lossy(&answer[..read]).into_owned();
    answer.lines().next().map(str::to_owned)
}

/// A gateway proxying to `upstream` with `server.max_connections = 2`.
async fn capped_at_two(upstream: &Upstream) -> TestGateway {
    TestGateway::start(
        GatewayToml::new()
            .server("max_connections = 2")
            .proxy_to(&upstream.url(), ""),
    )
    .await
}

/// A request sent on a new connection to `gw`, its status line awaited in a task: the
/// connection is queued by the kernel while the gateway is at its cap.
async fn waiting_request(gw: &TestGateway) -> tokio::task::JoinHandle<(Option<String>, TcpStream)> {
    let mut stream = TcpStream::connect(gw.addr).await.unwrap();
    let waiting = tokio::spawn(async move {
        let line = status_line(&mut stream, Duration::from_secs(5)).await;
        (line, stream)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "served past max_connections");
    waiting
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_connections_a_connection_waits_until_one_closes() {
    let upstream = Upstream::start().await;
    let gw = capped_at_two(&upstream).await;
    let mut first = TcpStream::connect(gw.addr).await.unwrap();
    let mut second = TcpStream::connect(gw.addr).await.unwrap();
    for stream in [&mut first, &mut second] {
        let line = status_line(stream, Duration::from_secs(2)).await;
        assert_eq!(line.as_deref(), Some("HTTP/1.1 200 OK"));
    }
    assert_eq!(gw.metric("floodgate_client_connections").await, 2.0);
    // The third connects (the kernel queues it) but is not served while two are open.
    let waiting = waiting_request(&gw).await;
    // The admin listener is not counted.
    assert_eq!(get(&gw.admin_url("/healthz")).await.0, http::StatusCode::OK);
    drop(first);
    let (line, _third) = waiting.await.unwrap();
    assert_eq!(line.as_deref(), Some("HTTP/1.1 200 OK"));
    assert_eq!(gw.metric("floodgate_client_connections").await, 2.0);
    assert_eq!(upstream.requests(), 3);
}

/// A tunnel (a WebSocket) is a connection like any other: tunnels cannot take connections
/// past the cap once hyper has handed theirs over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnels_count_as_connections() {
    let upstream = Upstream::start().await;
    let gw = capped_at_two(&upstream).await;
    let (head, mut first) = crate::common::websocket_upgrade(gw.addr).await;
    assert!(head.starts_with("HTTP/1.1 101 "), "{head}");
    let (head, _second) = crate::common::websocket_upgrade(gw.addr).await;
    assert!(head.starts_with("HTTP/1.1 101 "), "{head}");
    assert_eq!(gw.metric("floodgate_client_connections").await, 2.0);
    let waiting = waiting_request(&gw).await;
    // Closing a tunnel frees its place.
    first.shutdown().await.unwrap();
    let (line, _third) = waiting.await.unwrap();
    assert_eq!(line.as_deref(), Some("HTTP/1.1 200 OK"));
}

/// A connection closed while its client was still sending lingers (reading what comes,
/// up to 5 s) and keeps its place meanwhile: clients that start uploads and never finish
/// them cannot hold sockets past the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lingering_connection_keeps_its_place() {
    let gw = TestGateway::start(GatewayToml::new().server("max_connections = 1").route(
        "early",
        "path_prefix = \"/\"\nrespond = { status = 200, body = \"early\" }",
    ))
    .await;
    let mut uploading = TcpStream::connect(gw.addr).await.unwrap();
    uploading
        .write_all(b"POST /up HTTP/1.1\r\nHost: a\r\nContent-Length: 1000000\r\n\r\nsome of it")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), uploading.read_to_end(&mut answer))
        .await
        .expect("answered, and floodgate's side ended")
        .unwrap();
    assert!(answer.starts_with(b"HTTP/1.1 200 OK\r\n"));
    // floodgate still reads what the uploading client sends: its place is still taken.
    let waiting = waiting_request(&gw).await;
    drop(uploading);
    let (line, _next) = waiting.await.unwrap();
    assert_eq!(line.as_deref(), Some("HTTP/1.1 200 OK"));
}
