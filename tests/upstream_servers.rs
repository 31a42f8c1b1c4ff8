//! Several servers per upstream (docs/configuration.md#upstreamsname): weighted round
//! robin, sticky hashing, passive and active health, retries, and the concurrency cap
//! with its queue, against real upstream servers.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::common::config::{GatewayToml, config_file};
use crate::common::{TestGateway, Upstream, closed_port, get, send, spawn_get, until};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A gateway whose one route sends everything to `[upstreams.app]`, defined by `keys`.
async fn gateway(keys: &str) -> TestGateway {
    TestGateway::start(GatewayToml::new().table("upstreams.app", keys).route(
        "app",
        r#"path_prefix = "/"
        upstream = "app""#,
    ))
    .await
}

fn servers(urls: &[String]) -> String {
    let quoted: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    format!("servers = [{}]", quoted.join(", "))
}

fn with_cookie(gw: &TestGateway, path: &str, cookie: &str) -> Request<Full<Bytes>> {
    Request::get(gw.url(path))
        .header("cookie", cookie)
        .body(Full::default())
        .unwrap()
}

/// Which of `upstreams` served the next request (by their request counts).
async fn served_by(upstreams: &[&Upstream], request: Request<Full<Bytes>>) -> usize {
    let before: Vec<usize> = upstreams.iter().map(|u| u.requests()).collect();
    let (status, _, body) = send(request).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let changed: Vec<usize> = (0..upstreams.len())
        .filter(|&i| upstreams[i].requests() != before[i])
        .collect();
    assert_eq!(changed.len(), 1, "served by {changed:?}");
    changed[0]
}

#[tokio::test]
async fn round_robin_spreads_requests_in_proportion_to_weight() {
    let (a, b, c) = (
        Upstream::start().await,
        Upstream::start().await,
        Upstream::start().await,
    );
    let gw = gateway(&format!(
        "servers = [\"{}\", \"{}\", {{ url = \"{}\", weight = 2 }}]",
        a.url(),
        b.url(),
        c.url()
    ))
    .await;
    for i in 0..40 {
        assert_eq!(get(&gw.url(&format!("/r{i}"))).await.0, StatusCode::OK);
    }
    assert_eq!((a.requests(), b.requests(), c.requests()), (10, 10, 20));
}

#[tokio::test]
async fn least_requests_sends_to_the_idle_server() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let gw = gateway(&format!(
        "{}\nbalance = \"least_requests\"",
        servers(&[a.url(), b.url()])
    ))
    .await;
    // One slow request holds a server; everything sent meanwhile goes to the other.
    let slow = spawn_get(gw.url("/slow?ms=1500"));
    while a.requests() + b.requests() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let busy = if a.requests() == 1 { &a } else { &b };
    for _ in 0..10 {
        assert_eq!(get(&gw.url("/quick")).await.0, StatusCode::OK);
    }
    assert_eq!(busy.requests(), 1, "a request went to the busy server");
    assert_eq!(slow.await.unwrap().0, StatusCode::OK);
}

#[tokio::test]
async fn hash_keeps_each_session_on_one_server_and_moves_only_those_of_a_server_that_leaves() {
    let mut upstreams = vec![
        Upstream::start().await,
        Upstream::start().await,
        Upstream::start().await,
    ];
    let urls: Vec<String> = upstreams.iter().map(Upstream::url).collect();
    let gw = gateway(&format!(
        "{}\nbalance = \"hash\"\nhash_key = [\"cookie:sid\"]",
        servers(&urls)
    ))
    .await;
    let sessions: Vec<String> = (0..30).map(|i| format!("sid=session-{i}")).collect();
    let mut home = Vec::new();
    {
        let all: Vec<&Upstream> = upstreams.iter().collect();
        for sid in &sessions {
            let first = served_by(&all, with_cookie(&gw, "/", sid)).await;
            for _ in 0..3 {
                assert_eq!(served_by(&all, with_cookie(&gw, "/", sid)).await, first, "{sid}");
            }
            home.push(first);
        }
    }
    for server in 0..3 {
        assert!(home.contains(&server), "server {server} got no session: {home:?}");
    }

    // Server 1 leaves: its sessions move, every other session stays where it was.
    let gone = upstreams.remove(1);
    drop(gone);
    let left: Vec<&Upstream> = upstreams.iter().collect();
    for (sid, &was) in sessions.iter().zip(&home) {
        let now = served_by(&left, with_cookie(&gw, "/", sid)).await;
        let now_index = if now == 0 { 0 } else { 2 };
        if was != 1 {
            assert_eq!(now_index, was, "{sid} moved although its server stayed");
        }
        // Wherever it went, it stays there.
        assert_eq!(served_by(&left, with_cookie(&gw, "/", sid)).await, now, "{sid}");
    }
}

#[tokio::test]
async fn a_dead_server_is_retried_elsewhere_and_taken_out_of_rotation() {
    let live = Upstream::start().await;
    let dead = format!("http://127.0.0.1:{}", closed_port());
    let gw = gateway(&format!(
        "{}\nmax_fails = 1\nfail_timeout = \"30s\"",
        servers(&[dead.clone(), live.url()])
    ))
    .await;
    // Nothing reached the dead server, so any method may be tried again: a GET and a POST
    // with a body both arrive, once.
    assert_eq!(get(&gw.url("/first")).await.0, StatusCode::OK);
    let post = Request::post(gw.url("/echo"))
        .body(Full::new(Bytes::from("payload")))
        .unwrap();
    let (status, _, body) = send(post).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "payload"));
    for i in 0..6 {
        assert_eq!(get(&gw.url(&format!("/more{i}"))).await.0, StatusCode::OK);
    }
    assert_eq!(live.requests(), 8);
    let dead_label = dead.trim_start_matches("http://");
    assert_eq!(
        gw.metric(&format!(
            "floodgate_upstream_server_up{{upstream=\"app\",server=\"{dead_label}\"}}"
        ))
        .await,
        0.0
    );
    // One failure took it out: exactly one retry, then it was never tried again.
    assert_eq!(
        gw.metric("floodgate_upstream_retries_total{upstream=\"app\"}")
            .await,
        1.0
    );
    assert_eq!(
        gw.metric("floodgate_upstream_errors_total{upstream=\"app\",kind=\"connect\"}")
            .await,
        1.0
    );
}

/// A try whose `timeout` passes while it is still connecting sent nothing: the request,
/// a POST with its body, goes on to another server.
#[tokio::test]
async fn a_request_timed_out_while_connecting_goes_on_with_its_body() {
    let (stuck, _listener, _queued) = common::unaccepting_server().await;
    let live = Upstream::start().await;
    let gw = gateway(&format!(
        "{}
timeout = \"300ms\"\nconnect_timeout = \"5s\"",
        servers(&[stuck, live.url()])
    ))
    .await;
    let post = Request::post(gw.url("/echo"))
        .body(Full::new(Bytes::from("payload")))
        .unwrap();
    let (status, _, body) = send(post).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "payload"));
    assert_eq!(
        gw.metric("floodgate_upstream_errors_total{upstream=\"app\",kind=\"timeout\"}")
            .await,
        1.0
    );
}

/// A server that accepts connections and never answers: each active check gives up at
/// its `timeout` and closes its connection, so checks leave nothing open behind them.
#[tokio::test]
async fn checks_of_a_server_that_never_answers_leave_no_connection_open() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent = format!("http://{}", listener.local_addr().unwrap());
    let (accepted, open) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (accepted_here, open_here) = (accepted.clone(), open.clone());
    let _server = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            accepted_here.fetch_add(1, Ordering::SeqCst);
            open_here.fetch_add(1, Ordering::SeqCst);
            let open = open_here.clone();
            tokio::spawn(async move {
                // Reads the request and says nothing, until the gateway closes.
                let mut buf = [0u8; 1024];
                while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
                open.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    let live = Upstream::start().await;
    let _gw = gateway(&format!(
        "{}\nhealth_check = {{ path = \"/health\", interval = \"50ms\", timeout = \"100ms\" }}",
        servers(&[silent, live.url()])
    ))
    .await;
    until("ten checks", Duration::from_secs(5), || {
        accepted.load(Ordering::SeqCst) >= 10
    })
    .await;
    // At most the check in progress, and one whose close is on its way.
    let still_open = open.load(Ordering::SeqCst);
    assert!(
        still_open <= 2,
        "{still_open} of {} connections open",
        accepted.load(Ordering::SeqCst)
    );
}

/// `retries` bounds the other servers a request tries: with three dead servers and the
/// default of 1, a request makes two tries; with 0, one.
#[tokio::test]
async fn retries_bounds_the_servers_a_request_tries() {
    let dead: Vec<String> = (0..3)
        .map(|_| format!("http://127.0.0.1:{}", closed_port()))
        .collect();
    let errors = "floodgate_upstream_errors_total{upstream=\"app\",kind=\"connect\"}";
    let retries = "floodgate_upstream_retries_total{upstream=\"app\"}";
    let gw = gateway(&format!("{}\nmax_fails = 0", servers(&dead))).await;
    assert_eq!(get(&gw.url("/")).await.0, StatusCode::BAD_GATEWAY);
    assert_eq!((gw.metric(errors).await, gw.metric(retries).await), (2.0, 1.0));

    let live = Upstream::start().await;
    let gw = gateway(&format!(
        "{}\nretries = 0\nmax_fails = 0",
        servers(&[dead[0].clone(), live.url()])
    ))
    .await;
    // Round robin: the first request meets the dead server and is not tried again.
    assert_eq!(get(&gw.url("/first")).await.0, StatusCode::BAD_GATEWAY);
    assert_eq!(get(&gw.url("/second")).await.0, StatusCode::OK);
    assert_eq!((gw.metric(errors).await, gw.metric(retries).await), (1.0, 0.0));
    assert_eq!(live.targets(), ["/second"]);
}

/// An answer is not a failure, whatever its status: a server answering 500 is neither
/// taken out of rotation nor retried.
#[tokio::test]
async fn a_server_answering_500_stays_in_rotation_and_its_answer_is_the_clients() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let gw = gateway(&format!("{}\nmax_fails = 1", servers(&[a.url(), b.url()]))).await;
    for _ in 0..4 {
        assert_eq!(
            get(&gw.url("/status?code=500")).await.0,
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }
    assert_eq!((a.requests(), b.requests()), (2, 2));
    for server in [&a, &b] {
        let up = format!(
            "floodgate_upstream_server_up{{upstream=\"app\",server=\"{}\"}}",
            server.addr
        );
        assert_eq!(gw.metric(&up).await, 1.0);
    }
    assert_eq!(
        gw.metric("floodgate_upstream_retries_total{upstream=\"app\"}")
            .await,
        0.0
    );
}

/// A server that reads a request head and closes the connection without answering.
async fn hanging_up_server() -> (String, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = stream.shutdown().await;
            });
        }
    });
    (url, task)
}

#[tokio::test]
async fn after_a_request_was_sent_only_idempotent_requests_without_a_body_are_tried_again() {
    let live = Upstream::start().await;
    let (hangs_up, _task) = hanging_up_server().await;
    // Passive health off, so that every request may meet the failing server.
    let gw = gateway(&format!("{}\nmax_fails = 0", servers(&[hangs_up, live.url()]))).await;
    // Round robin alternates: every other request meets the failing server first, and
    // the second server gets the same head (the retried request is rebuilt from a copy).
    for i in 0..8 {
        let request = Request::get(gw.url(&format!("/get{i}?q={i}")))
            .header("x-client", i.to_string())
            .header("x-tag", "one")
            .header("x-tag", "two")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let (status, _, echoed) = send(request).await;
        assert_eq!(status, StatusCode::OK, "GET {i}");
        assert!(echoed.starts_with(&format!("GET /get{i}?q={i}\n")), "{echoed}");
        assert!(echoed.contains(&format!("\nx-client: {i}\n")), "{echoed}");
        assert!(echoed.contains("\nx-tag: one\nx-tag: two\n"), "{echoed}");
        assert!(echoed.contains("\nx-forwarded-for: 127.0.0.1\n"), "{echoed}");
    }
    assert_eq!(
        gw.metric("floodgate_upstream_retries_total{upstream=\"app\"}")
            .await,
        4.0
    );
    let mut posts_refused = 0;
    for _ in 0..8 {
        let post = Request::post(gw.url("/echo"))
            .body(Full::new(Bytes::from("once")))
            .unwrap();
        match send(post).await.0 {
            StatusCode::OK => {}
            StatusCode::BAD_GATEWAY => posts_refused += 1,
            other => panic!("POST answered {other}"),
        }
    }
    // GETs were tried again; POSTs, whose body may have reached the server, were not.
    assert_eq!(posts_refused, 4);
    assert_eq!(
        gw.metric("floodgate_upstream_retries_total{upstream=\"app\"}")
            .await,
        4.0
    );
    assert_eq!(live.targets().iter().filter(|t| t.starts_with("/get")).count(), 8);
    assert_eq!(live.targets().iter().filter(|t| *t == "/echo").count(), 4);
}

/// A POST without a body that reached a server is not sent again either: the server may
/// have acted on its head alone.
#[tokio::test]
async fn a_post_without_a_body_that_reached_a_server_is_not_sent_again() {
    let live = Upstream::start().await;
    let (hangs_up, _task) = hanging_up_server().await;
    let gw = gateway(&format!("{}\nmax_fails = 0", servers(&[hangs_up, live.url()]))).await;
    let mut refused = 0;
    for _ in 0..8 {
        let post = Request::post(gw.url("/orders"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        match send(post).await.0 {
            StatusCode::OK => {}
            StatusCode::BAD_GATEWAY => refused += 1,
            other => panic!("POST answered {other}"),
        }
    }
    assert_eq!(refused, 4);
    assert_eq!(live.targets().iter().filter(|t| *t == "/orders").count(), 4);
}

#[tokio::test]
async fn active_checks_take_a_server_out_and_bring_it_back() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let gw = gateway(&format!(
        "{}\nhealth_check = {{ path = \"/health\", interval = \"100ms\", timeout = \"500ms\" }}",
        servers(&[a.url(), b.url()])
    ))
    .await;
    let up = format!(
        "floodgate_upstream_server_up{{upstream=\"app\",server=\"{}\"}}",
        a.addr
    );
    gw.metric_becomes(&up, 1.0, Duration::from_secs(2)).await;
    a.set_health(503);
    // Two failed checks in a row: about 200 ms.
    gw.metric_becomes(&up, 0.0, Duration::from_secs(2)).await;
    let before = a.requests();
    for i in 0..6 {
        assert_eq!(get(&gw.url(&format!("/while-down{i}"))).await.0, StatusCode::OK);
    }
    assert_eq!(a.requests(), before, "a server out of rotation got requests");
    a.set_health(200);
    gw.metric_becomes(&up, 1.0, Duration::from_secs(2)).await;
    for i in 0..6 {
        assert_eq!(get(&gw.url(&format!("/back{i}"))).await.0, StatusCode::OK);
    }
    assert!(
        a.targets().iter().filter(|t| t.starts_with("/back")).count() >= 2,
        "the server did not come back: {:?}",
        a.targets()
    );
    drop(b);
}

const QUEUE_DEPTH: &str = "floodgate_upstream_queue_depth{upstream=\"app\"}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cap_is_never_exceeded() {
    let app = Upstream::start().await;
    let gw = gateway(&format!("url = \"{}\"\nmax_requests = 2\nqueue = 100", app.url())).await;
    let requests: Vec<_> = (0..30)
        .map(|i| spawn_get(gw.url(&format!("/burst{i}/slow?ms=20"))))
        .collect();
    for request in requests {
        assert_eq!(request.await.unwrap().0, StatusCode::OK);
    }
    assert_eq!(app.requests(), 30);
    assert_eq!(app.most_in_flight(), 2, "the cap was exceeded or never reached");
    assert_eq!(gw.metric(QUEUE_DEPTH).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_is_served_in_arrival_order() {
    let app = Upstream::start().await;
    let gw = gateway(&format!("url = \"{}\"\nmax_requests = 1\nqueue = 10", app.url())).await;
    let mut requests = vec![spawn_get(gw.url("/holding/slow?ms=300"))];
    until("the slot is taken", Duration::from_secs(5), || {
        app.requests() == 1
    })
    .await;
    for i in 0..6 {
        requests.push(spawn_get(gw.url(&format!("/queued{i}/slow?ms=20"))));
        gw.metric_becomes(QUEUE_DEPTH, f64::from(i + 1), Duration::from_secs(2))
            .await;
    }
    for request in requests {
        assert_eq!(request.await.unwrap().0, StatusCode::OK);
    }
    let expected: Vec<String> = std::iter::once("/holding/slow?ms=300".to_owned())
        .chain((0..6).map(|i| format!("/queued{i}/slow?ms=20")))
        .collect();
    assert_eq!(app.targets(), expected, "not served in arrival order");
    assert_eq!(app.most_in_flight(), 1);
    assert_eq!(gw.metric(QUEUE_DEPTH).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_or_a_long_wait_is_503_with_retry_after_and_nothing_is_sent() {
    let app = Upstream::start().await;
    let gw = gateway(&format!(
        "url = \"{}\"\nmax_requests = 1\nqueue = 1\nqueue_timeout = \"300ms\"",
        app.url()
    ))
    .await;
    let holding = spawn_get(gw.url("/holding/slow?ms=1500"));
    until("the slot is taken", Duration::from_secs(5), || {
        app.requests() == 1
    })
    .await;
    let queued = spawn_get(gw.url("/queued"));
    gw.metric_becomes(QUEUE_DEPTH, 1.0, Duration::from_secs(1)).await;
    // The queue is full: shed at once.
    let (status, headers, _) = get(&gw.url("/shed")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "1");
    // The queued request waited its queue_timeout, then was shed too.
    let started = Instant::now();
    let (status, headers, _) = queued.await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "1");
    assert!(started.elapsed() < Duration::from_millis(400));
    assert_eq!(holding.await.unwrap().0, StatusCode::OK);
    assert_eq!(app.targets(), ["/holding/slow?ms=1500"]);
    assert_eq!(
        gw.metric("floodgate_upstream_errors_total{upstream=\"app\",kind=\"queue_full\"}")
            .await,
        1.0
    );
    assert_eq!(
        gw.metric("floodgate_upstream_errors_total{upstream=\"app\",kind=\"queue_timeout\"}")
            .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_the_queue_is_never_forwarded() {
    let app = Upstream::start().await;
    let gw = gateway(&format!("url = \"{}\"\nmax_requests = 1\nqueue = 5", app.url())).await;
    let holding = spawn_get(gw.url("/holding/slow?ms=2000"));
    until("the slot is taken", Duration::from_secs(5), || {
        app.requests() == 1
    })
    .await;
    let mut leaving = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    leaving
        .write_all(b"GET /left HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    gw.metric_becomes(QUEUE_DEPTH, 1.0, Duration::from_secs(1)).await;
    drop(leaving);
    // It leaves the queue when it leaves, not when a slot frees.
    gw.metric_becomes(QUEUE_DEPTH, 0.0, Duration::from_millis(500))
        .await;
    assert_eq!(holding.await.unwrap().0, StatusCode::OK);
    // The slot it would have had serves the next request at once.
    let started = Instant::now();
    assert_eq!(get(&gw.url("/next")).await.0, StatusCode::OK);
    assert!(started.elapsed() < Duration::from_millis(500));
    assert_eq!(app.targets(), ["/holding/slow?ms=2000", "/next"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_health_of_an_unchanged_upstream() {
    use floodgate::Config;
    use floodgate::reload::Reloader;

    let live = Upstream::start().await;
    let dead = format!("http://127.0.0.1:{}", closed_port());
    let text = |greeting: &str| {
        GatewayToml::new()
            .table(
                "upstreams.app",
                &format!("{}\nfail_timeout = \"30s\"", servers(&[dead.clone(), live.url()])),
            )
            .route(
                "hello",
                &format!(
                    r#"path = "/hello"
                    respond = {{ body = "{greeting}" }}"#
                ),
            )
            .route(
                "app",
                r#"path_prefix = "/"
                upstream = "app""#,
            )
            .to_string()
    };
    let (_dir, path) = config_file(text("hello"));
    let gw = TestGateway::start_config(Config::load(&path).unwrap()).await;
    assert_eq!(get(&gw.url("/a")).await.0, StatusCode::OK);
    assert_eq!(get(&gw.url("/b")).await.0, StatusCode::OK);
    let retries = "floodgate_upstream_retries_total{upstream=\"app\"}";
    assert_eq!(gw.metric(retries).await, 1.0, "the dead server was tried once");

    std::fs::write(&path, text("bonjour")).unwrap();
    let reloader = Arc::new(Reloader::new(
        gw.shared.clone(),
        Box::new(move || Config::load(&path)),
    ));
    assert!(
        tokio::task::spawn_blocking(move || reloader.reload("test"))
            .await
            .unwrap()
    );
    assert_eq!(get(&gw.url("/hello")).await.2, "bonjour");
    for i in 0..4 {
        assert_eq!(get(&gw.url(&format!("/after{i}"))).await.0, StatusCode::OK);
    }
    assert_eq!(
        gw.metric(retries).await,
        1.0,
        "the reload forgot the dead server was out"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_the_cap_is_shared_by_the_live_instances() {
    let redis = tokio::task::spawn_blocking(common::redis_server::RedisServer::start)
        .await
        .unwrap();
    let app = Upstream::start().await;
    let config = GatewayToml::new()
        .redis(&redis.url(), "")
        .proxy_to(&app.url(), "max_requests = 2\nqueue = 10");
    let first = TestGateway::start(&config).await;
    let second = TestGateway::start(&config).await;
    // Both heartbeats are seen, by both, within a few seconds.
    let started = Instant::now();
    while [&first, &second]
        .iter()
        .any(|gateway| gateway.shared.instances() != 2)
    {
        assert!(started.elapsed() < Duration::from_secs(5), "not two instances");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // max_requests = 2 over two instances: one request at a time through each.
    let requests: Vec<_> = (0..3)
        .map(|i| spawn_get(first.url(&format!("/r{i}/slow?ms=200"))))
        .collect();
    for request in requests {
        assert_eq!(request.await.unwrap().0, StatusCode::OK);
    }
    assert_eq!(app.most_in_flight(), 1);
}

#[tokio::test]
async fn with_every_server_out_of_rotation_requests_are_502_without_a_try() {
    let dead: Vec<String> = (0..2)
        .map(|_| format!("http://127.0.0.1:{}", closed_port()))
        .collect();
    let gw = gateway(&format!("{}\nfail_timeout = \"30s\"", servers(&dead))).await;
    // The first request tries both (one retry) and takes both out.
    assert_eq!(get(&gw.url("/first")).await.0, StatusCode::BAD_GATEWAY);
    let errors = |kind: &str| format!("floodgate_upstream_errors_total{{upstream=\"app\",kind=\"{kind}\"}}");
    assert_eq!(gw.metric(&errors("connect")).await, 2.0);
    assert_eq!(get(&gw.url("/second")).await.0, StatusCode::BAD_GATEWAY);
    assert_eq!(
        gw.metric(&errors("connect")).await,
        2.0,
        "a server out of rotation was tried"
    );
    assert_eq!(gw.metric(&errors("no_server")).await, 1.0);
}

#[tokio::test]
async fn a_single_server_is_never_taken_out() {
    let port = closed_port();
    let gw = gateway(&format!("url = \"http://127.0.0.1:{port}\"\nmax_fails = 1")).await;
    for _ in 0..3 {
        assert_eq!(get(&gw.url("/")).await.0, StatusCode::BAD_GATEWAY);
    }
    assert_eq!(
        gw.metric("floodgate_upstream_errors_total{upstream=\"app\",kind=\"connect\"}")
            .await,
        3.0
    );
    // It comes back the moment it listens again.
    let listener = TcpListener::bind(("127.0.0.1", port)).await.unwrap();
    let _app = Upstream::start_on(listener);
    assert_eq!(get(&gw.url("/")).await.0, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hashed_request_waits_for_its_own_server_at_the_cap() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let gw = gateway(&format!(
        "{}\nbalance = \"hash\"\nhash_key = [\"cookie:sid\"]\nmax_requests = 2\nqueue = 10",
        servers(&[a.url(), b.url()])
    ))
    .await;
    let requests: Vec<_> = (0..6)
        .map(|i| {
            let request = with_cookie(&gw, &format!("/same{i}/slow?ms=100"), "sid=busy");
            tokio::spawn(send(request))
        })
        .collect();
    for request in requests {
        assert_eq!(request.await.unwrap().0, StatusCode::OK);
    }
    // All six on one server, two at a time: none spilled over to the other.
    let counts = (a.requests(), b.requests());
    assert!(counts == (6, 0) || counts == (0, 6), "{counts:?}");
    assert_eq!(a.most_in_flight().max(b.most_in_flight()), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_removed_by_a_reload_leaves_no_series_behind() {
    use floodgate::Config;
    use floodgate::reload::Reloader;

    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let text = |urls: &[String]| {
        GatewayToml::new()
            .table("upstreams.app", &servers(urls))
            .route(
                "app",
                r#"path_prefix = "/"
                upstream = "app""#,
            )
            .to_string()
    };
    let (_dir, path) = config_file(text(&[a.url(), b.url()]));
    let gw = TestGateway::start_config(Config::load(&path).unwrap()).await;
    let up = |u: &Upstream| {
        format!(
            "floodgate_upstream_server_up{{upstream=\"app\",server=\"{}\"}}",
            u.addr
        )
    };
    let series = |body: &str, u: &Upstream| body.lines().any(|line| line.starts_with(&up(u)));
    let metrics = get(&gw.admin_url("/metrics")).await.2;
    assert!(series(&metrics, &a) && series(&metrics, &b));
    std::fs::write(&path, text(&[a.url()])).unwrap();
    let reloader = Arc::new(Reloader::new(
        gw.shared.clone(),
        Box::new(move || Config::load(&path)),
    ));
    assert!(
        tokio::task::spawn_blocking(move || reloader.reload("test"))
            .await
            .unwrap()
    );
    let metrics = get(&gw.admin_url("/metrics")).await.2;
    assert!(series(&metrics, &a), "the kept server's series went");
    assert!(!series(&metrics, &b), "the removed server's series stayed");
}

/// A `path` key part of `hash` reads the client's path, not the one `strip_prefix` left:
/// `/a/x` and `/b/x` (both forwarded as `/x`) are different keys.
#[tokio::test]
async fn a_hash_on_the_path_reads_the_clients_path_not_the_stripped_one() {
    let upstreams = [Upstream::start().await, Upstream::start().await];
    let urls: Vec<String> = upstreams.iter().map(Upstream::url).collect();
    let upstream = format!("{}\nbalance = \"hash\"\nhash_key = [\"path\"]", servers(&urls));
    let gw = TestGateway::start(
        GatewayToml::new()
            .table("upstreams.app", &upstream)
            .route(
                "a",
                "path_prefix = \"/a/\"\nstrip_prefix = \"/a\"\nupstream = \"app\"",
            )
            .route(
                "b",
                "path_prefix = \"/b/\"\nstrip_prefix = \"/b\"\nupstream = \"app\"",
            ),
    )
    .await;
    let all: Vec<&Upstream> = upstreams.iter().collect();
    let get = |path: String| Request::get(gw.url(&path)).body(Full::default()).unwrap();
    let mut apart = 0;
    for i in 0..20 {
        let a = served_by(&all, get(format!("/a/x{i}"))).await;
        let b = served_by(&all, get(format!("/b/x{i}"))).await;
        apart += usize::from(a != b);
    }
    // With the stripped path as the key, every pair would go to one server.
    assert!(apart > 0, "every /a/xN and /b/xN went to the same server");
}
