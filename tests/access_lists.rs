//! Access lists (docs/configuration.md#serverdeny): `server.deny` refuses clients before
//! routing, a route's `allow` and `deny` before its limits; refused requests get 403,
//! reach no upstream and consume nothing. Clients connect from distinct loopback
//! addresses.

use std::net::SocketAddr;

use crate::common::config::GatewayToml;
use crate::common::{TestGateway, Upstream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;

/// The status code of `GET path` sent from `source` (a loopback address) to `addr`.
async fn status_from(source: &str, addr: SocketAddr, path: &str) -> u16 {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
    let mut stream = socket.connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response[9..12].parse().unwrap()
}

#[tokio::test]
async fn server_deny_and_route_allow_and_deny_refuse_with_403_before_limits() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        GatewayToml::new()
            .server(r#"deny = ["127.0.0.9"]"#)
            .upstream("app", &upstream.url(), "")
            .limit(
                "one",
                r#"algorithm = "fixed_window"
                limit = 1
                window = "1m""#,
            )
            .route(
                "office",
                r#"path = "/office"
                upstream = "app"
                allow = ["127.0.0.0/30"]
                deny = ["127.0.0.3"]
                limits = ["one"]"#,
            )
            .route(
                "public",
                r#"path_prefix = "/"
                upstream = "app""#,
            ),
    )
    .await;
    // Denied everywhere, before routing.
    assert_eq!(status_from("127.0.0.9", gw.addr, "/anything").await, 403);
    assert_eq!(status_from("127.0.0.9", gw.addr, "/office").await, 403);
    // Outside the route's allow list, and inside it but denied.
    assert_eq!(status_from("127.0.0.5", gw.addr, "/office").await, 403);
    assert_eq!(status_from("127.0.0.3", gw.addr, "/office").await, 403);
    // Refused requests consumed nothing: each allowed client still has its one request.
    assert_eq!(status_from("127.0.0.2", gw.addr, "/office").await, 200);
    assert_eq!(status_from("127.0.0.2", gw.addr, "/office").await, 429);
    assert_eq!(status_from("127.0.0.1", gw.addr, "/office").await, 200);
    // Other routes are open to the others.
    assert_eq!(status_from("127.0.0.5", gw.addr, "/public").await, 200);
    assert_eq!(upstream.requests(), 3);
    assert_eq!(
        gw.metric("floodgate_requests_total{route=\"office\",status=\"403\"}")
            .await,
        2.0
    );
}

/// Client addresses are compared as IPv4 when they are IPv4-mapped, so lists written with
/// the mapped spelling (`::ffff:127.0.0.1`, as some tools print an IPv4 peer) match them.
#[tokio::test]
async fn ipv4_mapped_entries_match_ipv4_clients() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        GatewayToml::new()
            .server(r#"deny = ["::ffff:127.0.0.1"]"#)
            .upstream("app", &upstream.url(), "")
            .route(
                "office",
                r#"path = "/office"
                upstream = "app"
                allow = ["::ffff:127.0.0.0/126"]"#,
            )
            .route(
                "public",
                r#"path_prefix = "/"
                upstream = "app""#,
            ),
    )
    .await;
    assert_eq!(status_from("127.0.0.1", gw.addr, "/public").await, 403);
    assert_eq!(status_from("127.0.0.2", gw.addr, "/public").await, 200);
    assert_eq!(status_from("127.0.0.2", gw.addr, "/office").await, 200);
    assert_eq!(status_from("127.0.0.5", gw.addr, "/office").await, 403);
    assert_eq!(upstream.requests(), 2);
}
