//! The upstream connection pool: connections are reused once their response is read to
//! the end (whatever its framing), never while or after a response was abandoned (unless
//! a cap counts the request: then its rest is read and discarded first), and a
//! request that meets a connection the upstream has just closed is sent again on a new
//! one instead of failing.

use std::time::Duration;

use crate::common::config::GatewayToml;
use crate::common::{TestGateway, Upstream, get, http1_client};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

async fn gateway(upstream: &Upstream) -> TestGateway {
    TestGateway::proxy_to(upstream, "", "").await
}

#[tokio::test]
async fn sequential_requests_share_one_connection_whatever_the_body_framing() {
    let upstream = Upstream::start().await;
    let gateway = gateway(&upstream).await;
    // Content-Length bodies, a streamed body, an empty 204, and a HEAD.
    for path in ["/", "/big?bytes=100000", "/status?code=204", "/", "/big?bytes=10"] {
        let (status, _, _) = get(&gateway.url(path)).await;
        assert!(status.is_success(), "{path}: {status}");
    }
    let head = Request::builder()
        .method(Method::HEAD)
        .uri(gateway.url("/"))
        .body(Full::default())
        .unwrap();
    let response = http1_client().request(head).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let (status, _, _) = get(&gateway.url("/")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(upstream.connections(), 1);
    assert_eq!(upstream.requests(), 7);
}

#[tokio::test]
async fn concurrent_requests_open_only_the_connections_they_need() {
    let upstream = Upstream::start().await;
    let gateway = gateway(&upstream).await;
    let client = http1_client();
    for _ in 0..20 {
        let round: Vec<_> = (0..8)
            .map(|_| {
                let (client, url) = (client.clone(), gateway.url("/"));
                tokio::spawn(async move {
                    let response = client.get(url.parse().unwrap()).await.unwrap();
                    let status = response.status();
                    response.into_body().collect().await.unwrap();
                    status
                })
            })
            .collect();
        for request in round {
            assert_eq!(request.await.unwrap(), StatusCode::OK);
        }
    }
    assert_eq!(upstream.requests(), 160);
    assert!(
        upstream.connections() <= 16,
        "{} connections",
        upstream.connections()
    );
}

#[tokio::test]
async fn a_response_the_client_abandons_takes_its_connection_with_it() {
    let upstream = Upstream::start().await;
    let gateway = gateway(&upstream).await;
    // Read the head and a little of a 50 MB body, then hang up.
    let mut stream = tokio::net::TcpStream::connect(gateway.addr).await.unwrap();
    stream
        .write_all(b"GET /big?bytes=52428800 HTTP/1.1\r\nHost: app\r\n\r\n")
        .await
        .unwrap();
    let mut start = [0u8; 4096];
    let read = stream.read(&mut start).await.unwrap();
    assert!(start[..read].starts_with(b"HTTP/1.1 200"));
    drop(stream);
    tokio::time::sleep(Duration::from_millis(100)).await;

    for _ in 0..5 {
        let (status, _, body) = get(&gateway.url("/after")).await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("GET /after"), "{body}");
    }
    // The abandoned response's connection was not reused: one more served the rest.
    assert_eq!(upstream.connections(), 2);
}

/// Under a cap (here `max_requests`), a response whose client hangs up half-way is read
/// to its end and discarded, since the app is still sending it, and only then does its
/// connection serve again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_cap_a_response_the_client_abandons_is_read_to_its_end_and_its_connection_kept() {
    let upstream = Upstream::start().await;
    let gateway = TestGateway::proxy_to(&upstream, "", "max_requests = 10").await;
    // Read the head of a response whose body ends after 500 ms, then hang up.
    let mut stream = tokio::net::TcpStream::connect(gateway.addr).await.unwrap();
    stream
        .write_all(b"GET /abandoned/busy?ms=500&stream=1 HTTP/1.1\r\nHost: app\r\n\r\n")
        .await
        .unwrap();
    let mut start = [0u8; 4096];
    let read = stream.read(&mut start).await.unwrap();
    assert!(start[..read].starts_with(b"HTTP/1.1 200"));
    drop(stream);

    // Its connection is still busy with the rest: another one serves meanwhile.
    let (status, _, body) = get(&gateway.url("/during")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("GET /during"), "{body}");
    assert_eq!(upstream.connections(), 2);

    // The rest read, both connections are back in the pool: two requests at once need
    // no third.
    let in_flight = format!(
        "floodgate_upstream_in_flight{{upstream=\"app\",server=\"{}\"}}",
        upstream.addr
    );
    let started = std::time::Instant::now();
    while gateway.metric(&in_flight).await != 0.0 {
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the rest was never read"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let both: Vec<_> = ["/after1/slow?ms=200", "/after2/slow?ms=200"]
        .into_iter()
        .map(|path| {
            let url = gateway.url(path);
            tokio::spawn(async move { get(&url).await.0 })
        })
        .collect();
    for request in both {
        assert_eq!(request.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(upstream.connections(), 2);
}

/// An upstream that answers one request per connection and closes it without saying so
/// (no `Connection: close`), the way an app server with a short keep-alive timeout does.
async fn one_request_per_connection_upstream() -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .await;
            });
        }
    });
    (addr, task)
}

#[tokio::test]
async fn a_connection_the_upstream_closed_costs_no_request() {
    let (addr, upstream) = one_request_per_connection_upstream().await;
    let gateway = TestGateway::start(GatewayToml::new().proxy_to(&format!("http://{addr}"), "")).await;
    for i in 0..50 {
        let (status, _, body) = get(&gateway.url("/")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"), "request {i}");
    }
    upstream.abort();
}

/// An upstream that answers `401` as soon as it has a request head, then reads the request
/// body (`Content-Length`) to its end before the next request on the connection, as an
/// app that refuses an upload before reading it does.
async fn answers_before_the_body_upstream() -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let mut stream = tokio::io::BufReader::new(stream);
                loop {
                    let mut length = 0usize;
                    loop {
                        let mut line = String::new();
                        if tokio::io::AsyncBufReadExt::read_line(&mut stream, &mut line)
                            .await
                            .unwrap_or(0)
                            == 0
                        {
                            return;
                        }
                        if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            length = value.trim().parse().unwrap();
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let reply = b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n";
                    if stream.get_mut().write_all(reply).await.is_err() {
                        return;
                    }
                    let mut body = vec![0u8; length];
                    if stream.read_exact(&mut body).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, task)
}

#[tokio::test]
async fn a_request_does_not_wait_behind_an_upload_the_upstream_answered_early() {
    let (addr, upstream) = answers_before_the_body_upstream().await;
    let gateway = TestGateway::start(GatewayToml::new().proxy_to(&format!("http://{addr}"), "")).await;
    // An upload of 10 bytes, of which the client sends 5 now and 5 after 1.5 s.
    let mut upload = tokio::net::TcpStream::connect(gateway.addr).await.unwrap();
    upload
        .write_all(b"POST /upload HTTP/1.1\r\nHost: app\r\nContent-Length: 10\r\n\r\n12345")
        .await
        .unwrap();
    let mut answer = [0u8; 64];
    let read = upload.read(&mut answer).await.unwrap();
    assert!(
        answer[..read].starts_with(b"HTTP/1.1 401"),
        "{:?}",
        String::from_utf8_lossy(&answer[..read])
    );

    let started = std::time::Instant::now();
    let (status, _, _) = get(&gateway.url("/next")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(
        started.elapsed() < Duration::from_millis(1_000),
        "waited {:?} behind the upload",
        started.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    upload.write_all(b"67890").await.unwrap();
    upstream.abort();
}

/// `count` requests for `path` at once on one HTTP/2 connection: their statuses and
/// `Retry-After` values, and how long the last took.
async fn at_once_over_http2(
    gateway: &TestGateway,
    path: &str,
    count: usize,
) -> (Vec<(u16, String)>, Duration) {
    let client = crate::common::h2c_client();
    let started = std::time::Instant::now();
    let requests = (0..count).map(|_| {
        let sent = client.request(Request::get(gateway.url(path)).body(Full::default()).unwrap());
        async move {
            let response = sent.await.expect("h2c request");
            let retry = response
                .headers()
                .get("retry-after")
                .map_or(String::new(), |value| value.to_str().unwrap().to_owned());
            let status = response.status().as_u16();
            response.into_body().collect().await.unwrap();
            (status, retry)
        }
    });
    let answers = futures_util::future::join_all(requests).await;
    (answers, started.elapsed())
}

/// One HTTP/2 connection carries many requests at once, each wanting an upstream
/// connection of its own: together the requests of every client hold at most
/// `server.max_connections` of them, so that a few clients cannot take every descriptor.
/// The others wait for a place, or for a connection to their server that another request
/// is done with; past the upstream's `connect_timeout` they are a `503` with
/// `Retry-After: 1`, nothing sent upstream.
#[tokio::test]
async fn streams_at_once_hold_at_most_max_connections_upstream_connections() {
    let upstream = Upstream::start().await;
    let gateway = TestGateway::proxy_to(&upstream, "max_connections = 4", "connect_timeout = \"5s\"").await;
    // Twelve of 300 ms each: four at a time, each waiting for a place when it has none.
    let (answers, took) = at_once_over_http2(&gateway, "/busy?ms=300", 12).await;
    assert!(answers.iter().all(|(status, _)| *status == 200), "{answers:?}");
    assert_eq!(upstream.most_in_flight(), 4);
    assert!(took >= Duration::from_millis(900), "{took:?}");
    // A connection done with its request goes to one waiting for the same server, not
    // closed for a new one to open in its place.
    assert_eq!(upstream.connections(), 4);

    // Past the connect timeout, a request still without a place is refused.
    let gateway =
        TestGateway::proxy_to(&upstream, "max_connections = 4", "connect_timeout = \"300ms\"").await;
    let requests = upstream.requests();
    let (answers, _) = at_once_over_http2(&gateway, "/busy?ms=1500", 8).await;
    let refused: Vec<_> = answers.iter().filter(|(status, _)| *status == 503).collect();
    assert_eq!(refused.len(), 4, "{answers:?}");
    assert!(refused.iter().all(|(_, retry)| retry == "1"), "{answers:?}");
    assert_eq!(upstream.requests() - requests, 4);
    // Counted by upstream, as the requests a full queue sheds are.
    let no_place = "floodgate_upstream_errors_total{upstream=\"app\",kind=\"no_place\"}";
    assert_eq!(gateway.metric(no_place).await, 4.0);
}

/// A gateway with `max_connections = 2` and two upstreams, each `(name, server, its
/// options)` and routed under `/name`.
async fn two_servers_in_two_places(
    (first, first_server, first_options): (&str, &Upstream, &str),
    (second, second_server, second_options): (&str, &Upstream, &str),
) -> TestGateway {
    let route = |name: &str| format!("path_prefix = \"/{name}\"\nupstream = \"{name}\"");
    TestGateway::start(
        GatewayToml::new()
            .server("max_connections = 2")
            .upstream(first, &first_server.url(), first_options)
            .upstream(second, &second_server.url(), second_options)
            .route(first, &route(first))
            .route(second, &route(second)),
    )
    .await
}

/// Connections idle to one server give their places up to a connection another server
/// needs: the places are not held hostage by what the last burst left open.
#[tokio::test]
async fn a_connection_idle_to_one_server_gives_its_place_to_another_server() {
    let (first, second) = (Upstream::start().await, Upstream::start().await);
    let gateway = two_servers_in_two_places(
        ("first", &first, "connect_timeout = \"3s\""),
        ("second", &second, "connect_timeout = \"3s\""),
    )
    .await;
    // Both places taken by connections to the first, idle once answered.
    let (answers, _) = at_once_over_http2(&gateway, "/first/busy?ms=200", 2).await;
    assert_eq!(answers, [(200, String::new()), (200, String::new())]);
    assert_eq!(first.connections(), 2);

    let started = std::time::Instant::now();
    let (status, _, _) = get(&gateway.url("/second/")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    // The first still has a connection to reuse.
    let (status, _, _) = get(&gateway.url("/first/")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(first.connections(), 2);
}

/// The wait for a place is not the server's slowness: an upstream whose `timeout` is
/// shorter than the wait is still asked once a place frees, its `timeout` counted from
/// then, and no server is counted as failing.
#[tokio::test]
async fn waiting_for_a_place_does_not_count_against_the_servers_timeout() {
    let (first, second) = (Upstream::start().await, Upstream::start().await);
    let gateway = two_servers_in_two_places(
        ("first", &first, ""),
        ("second", &second, "timeout = \"300ms\"\nconnect_timeout = \"3s\""),
    )
    .await;
    // Both places held for a second by the first's requests.
    let holding = tokio::spawn({
        let url = gateway.url("/first/busy?ms=1000");
        async move {
            let client = crate::common::h2c_client();
            let sent = (0..2).map(|_| client.request(Request::get(&url).body(Full::default()).unwrap()));
            futures_util::future::join_all(sent).await
        }
    });
    crate::common::until("both places taken", Duration::from_secs(2), || {
        first.connections() == 2
    })
    .await;
    let started = std::time::Instant::now();
    let (status, _, seen) = get(&gateway.url("/second/")).await;
    assert_eq!(status, StatusCode::OK, "{seen}");
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        gateway
            .metric("floodgate_upstream_errors_total{upstream=\"second\",kind=\"timeout\"}")
            .await,
        0.0
    );
    for answer in holding.await.unwrap() {
        assert_eq!(answer.unwrap().status(), StatusCode::OK);
    }
}

/// A steady flood to one server does not shut requests for another out of the places: a
/// connection done with its request goes to a request for its own server only while no
/// request for another server waits; otherwise it closes, and its place goes to the first
/// request in line, whatever its server.
#[tokio::test]
async fn a_steady_flood_to_one_server_leaves_another_its_turn() {
    let (flooded, other) = (Upstream::start().await, Upstream::start().await);
    let gateway = two_servers_in_two_places(
        ("flooded", &flooded, "connect_timeout = \"10s\""),
        ("other", &other, "connect_timeout = \"2s\""),
    )
    .await;
    let client = crate::common::h2c_client();
    // Six streams to the flooded server at all times for 4 s, 200 ms each: four wait for
    // a place at any moment.
    let flood_until = std::time::Instant::now() + Duration::from_secs(4);
    let flood: Vec<_> = (0..6)
        .map(|_| {
            let (client, url) = (client.clone(), gateway.url("/flooded/busy?ms=200"));
            tokio::spawn(async move {
                while std::time::Instant::now() < flood_until {
                    let request = Request::get(&url).body(Full::default()).unwrap();
                    let response = client.request(request).await.expect("h2c request");
                    assert_eq!(response.status(), StatusCode::OK);
                    response.into_body().collect().await.unwrap();
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = std::time::Instant::now();
    let request = Request::get(gateway.url("/other/"))
        .body(Full::default())
        .unwrap();
    let response = client.request(request).await.expect("h2c request");
    assert_eq!(
        response.status(),
        StatusCode::OK,
        "the other server's request after {:?}",
        started.elapsed()
    );
    for flooding in flood {
        flooding.await.unwrap();
    }
}
