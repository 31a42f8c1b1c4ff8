//! The leaky bucket in the request path: an early request is held until
//! its turn, evenly spaced, up to `burst` deep, and the excess is rejected at once; holding
//! takes no worker thread; a client that leaves while held gives its queue slot back and
//! its request never reaches the upstream; a held request carries the rate-limit headers.
//!
//! Timing assertions are one-sided where the algorithm makes them exact and generous on the
//! other side: a hold never ends before its turn (the store's clock and the test's are the
//! same monotonic clock, or Redis `TIME` on the same machine), so the lower bounds are tight
//! ([`EARLY`]); a busy machine can only make things late, so the upper bounds leave
//! [`LATE`] of slack, still well short of the next slot where that matters.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::config::GatewayToml;
use crate::common::process::FloodgateProcess;
use crate::common::redis_server::RedisServer;
use crate::common::stub::{ListeningStub, StubUpstream};
use crate::common::{TestGateway, Upstream, get, h2c_client, read_response};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How much earlier than its turn a request may be seen: clock rounding only.
const EARLY: Duration = Duration::from_millis(5);
/// How much later than its turn a request may be seen on a busy machine.
const LATE: Duration = Duration::from_millis(300);

/// An upstream that notes the path and arrival time of every request it receives.
struct Recorder {
    stub: ListeningStub,
    arrivals: Arc<Mutex<Vec<(String, Instant)>>>,
}

impl Recorder {
    async fn start() -> Recorder {
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let log = arrivals.clone();
        let stub = StubUpstream::http1()
            .fallback_fn(move |request| {
                log.lock()
                    .unwrap()
                    .push((request.uri().path().to_owned(), Instant::now()));
                Response::new("ok\n")
            })
            .run()
            .await;
        Recorder { stub, arrivals }
    }

    fn url(&self) -> String {
        self.stub.url()
    }

    /// The requests received so far, in arrival order.
    fn arrivals(&self) -> Vec<(String, Instant)> {
        let mut arrivals = self.arrivals.lock().unwrap().clone();
        arrivals.sort_by_key(|(_, at)| *at);
        arrivals
    }

    fn paths(&self) -> Vec<String> {
        self.arrivals().into_iter().map(|(path, _)| path).collect()
    }
}

/// A gateway config: route `held` (`/held...`) behind the leaky-bucket limit `queue` with
/// `bucket` parameters, route `free` (everything else) unlimited, both to `upstream`.
/// With `redis`, the store is that server, failing closed so that a Redis problem shows
/// up as a 503 instead of passing silently; `/probe` then tells when it is connected.
fn config(upstream: &str, bucket: &str, redis: Option<&str>, server: &str) -> GatewayToml {
    let mut config = GatewayToml::new()
        .server(server)
        .upstream("app", upstream, "")
        .limit("queue", &format!("algorithm = \"leaky_bucket\"\n{bucket}"));
    if let Some(url) = redis {
        config = config
            .redis(
                url,
                r#"timeout = "1s"
                on_error = "deny""#,
            )
            .limit(
                "probe",
                r#"algorithm = "fixed_window"
                limit = 1000000
                window = "1m""#,
            )
            .route(
                "probe",
                r#"path = "/probe"
                respond = { status = 200, body = "probe\n" }
                limits = ["probe"]"#,
            );
    }
    config
        .route(
            "held",
            r#"path_prefix = "/held"
            upstream = "app"
            limits = ["queue"]"#,
        )
        .route(
            "free",
            r#"path_prefix = "/"
            upstream = "app""#,
        )
}

/// Waits until the gateway decides with Redis (a `/probe` that is not 503).
async fn wait_for_redis(gateway: &TestGateway) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _, _) = get(&gateway.url("/probe")).await;
        if status == StatusCode::OK {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the gateway did not connect to redis: {status}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn decisions(outcome: &str) -> String {
    format!("floodgate_ratelimit_decisions_total{{limit=\"queue\",outcome=\"{outcome}\"}}")
}

/// Asserts that `at` is no earlier than `turn` (less clock rounding) and at most [`LATE`]
/// after it.
#[track_caller]
fn assert_at_turn(what: &str, at: Duration, turn: Duration) {
    assert!(
        at + EARLY >= turn && at <= turn + LATE,
        "{what}: at {at:?}, its turn is {turn:?} (allowed {:?} early, {LATE:?} late)",
        EARLY
    );
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The `r` (remaining) of the `queue` item of a `RateLimit` header.
fn remaining(headers: &http::HeaderMap) -> u64 {
    let value = headers["ratelimit"].to_str().unwrap();
    let item = value
        .strip_prefix("\"queue\";r=")
        .unwrap_or_else(|| panic!("RateLimit: {value}"));
    item.split(';').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn early_requests_are_held_evenly_spaced_and_the_excess_is_rejected_at_once() {
    let upstream = Recorder::start().await;
    // 100 ms apart, a queue of 3 behind the one that goes at once.
    let gateway = TestGateway::start(config(
        &upstream.url(),
        "rate = 10\nper = \"1s\"\nburst = 3",
        None,
        "",
    ))
    .await;

    let start = Instant::now();
    let requests: Vec<_> = (0..5)
        .map(|i| {
            let url = gateway.url(&format!("/held/{i}"));
            tokio::spawn(async move {
                let (status, headers, body) = get(&url).await;
                (i, status, headers, body, start.elapsed())
            })
        })
        .collect();
    let mut answers = Vec::new();
    for request in requests {
        answers.push(request.await.unwrap());
    }

    let (rejected, admitted): (Vec<_>, Vec<_>) = answers
        .into_iter()
        .partition(|(_, status, ..)| *status == StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(rejected.len(), 1, "one over the queue: {rejected:#?}");
    let (rejected_index, _, headers, body, at) = &rejected[0];
    // Held, it would be answered at 400 ms at the earliest.
    assert!(*at < ms(300), "the excess is rejected at once, not held: {at:?}");
    assert_eq!(body, "Too Many Requests\n");
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(headers["ratelimit"], "\"queue\";r=0;t=1");

    // The store tells each admitted request its place in the queue through `r`: the one
    // that goes at once has 3 places left behind it, the last one none.
    assert_eq!(admitted.len(), 4);
    let mut by_turn: Vec<Option<(u64, Duration)>> = vec![None; 4];
    for (i, status, headers, body, at) in &admitted {
        assert_eq!(*status, StatusCode::OK, "{i}: {body}");
        assert_eq!(body, "ok\n");
        assert_eq!(headers["ratelimit-policy"], "\"queue\";q=3;w=1");
        let turn = 3 - remaining(headers) as usize;
        assert!(by_turn[turn].is_none(), "two requests in turn {turn}");
        by_turn[turn] = Some((*i, *at));
    }
    for (turn, slot) in by_turn.iter().enumerate() {
        let (i, at) = slot.unwrap();
        assert_at_turn(&format!("request {i}, turn {turn}"), at, ms(100) * turn as u32);
    }

    // The upstream saw the four admitted ones, in their turns, 100 ms apart.
    let arrivals = upstream.arrivals();
    let paths: Vec<String> = by_turn
        .iter()
        .map(|slot| format!("/held/{}", slot.unwrap().0))
        .collect();
    assert_eq!(arrivals.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>(), paths);
    assert!(!paths.contains(&format!("/held/{rejected_index}")));
    let first = arrivals[0].1;
    for (turn, (path, at)) in arrivals.iter().enumerate().skip(1) {
        // The first forward's own latency (a new upstream connection, on a loaded machine
        // a slow one) may make the gaps look a little short.
        let after_first = at.duration_since(first) + ms(50);
        assert_at_turn(
            &format!("{path} at the upstream, after the first"),
            after_first,
            ms(100) * turn as u32,
        );
    }

    assert_eq!(gateway.metric(&decisions("allowed")).await, 1.0);
    assert_eq!(gateway.metric(&decisions("delayed")).await, 3.0);
    assert_eq!(gateway.metric(&decisions("rejected")).await, 1.0);
    assert_eq!(
        gateway
            .metric("floodgate_requests_total{route=\"held\",status=\"200\"}")
            .await,
        4.0
    );
}

/// The real binary on one worker thread: held requests wait on timers, so the worker keeps
/// serving; the access log names the held ones `delayed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn holding_requests_does_not_hold_the_only_worker_thread() {
    let upstream = Upstream::start().await;
    // 500 ms apart, queue of 3: held until ~500, ~1000 and ~1500 ms.
    let toml = config(
        &upstream.url(),
        "rate = 2\nper = \"1s\"\nburst = 3",
        None,
        "workers = 1",
    );
    let gateway = FloodgateProcess::start(toml, &[("FLOODGATE_LOG_FORMAT", "json")]);
    assert!(
        gateway.stdout_lines()[0].contains("\"workers\":1"),
        "{:?}",
        gateway.stdout_lines()
    );

    let start = Instant::now();
    let held: Vec<_> = (0..4)
        .map(|i| {
            let url = gateway.url(&format!("/held/{i}"));
            tokio::spawn(async move {
                let (status, headers, _) = get(&url).await;
                (status, remaining(&headers), start.elapsed())
            })
        })
        .collect();

    // While three are held (until 500 ms at the earliest), and again while one is still
    // held, the unlimited route answers at once.
    let mut probes = Vec::new();
    for probe_at in [ms(150), ms(350), ms(1150)] {
        tokio::time::sleep_until((start + probe_at).into()).await;
        let sent = Instant::now();
        let (status, _, body) = get(&gateway.url("/free/probe")).await;
        let took = sent.elapsed();
        assert_eq!(status, StatusCode::OK, "{body}");
        probes.push((probe_at, took));
    }
    let mut done = Vec::new();
    for request in held {
        done.push(request.await.unwrap());
    }
    for (probe_at, took) in &probes {
        assert!(
            // Behind a held request it would wait until 500 or 1500 ms: 350 ms at least.
            *took < ms(250),
            "an unlimited request at {probe_at:?} took {took:?}; held: {done:?}"
        );
    }
    for (status, remaining, at) in &done {
        assert_eq!(*status, StatusCode::OK);
        let turn = 3 - *remaining as u32;
        assert_at_turn(&format!("turn {turn}"), *at, ms(500) * turn);
    }
    // The probes really ran while requests were held.
    let last = done.iter().map(|(_, _, at)| *at).max().unwrap();
    assert!(last > ms(1150) + ms(100), "last held request at {last:?}");

    // One access-log line per request; the held ones say `delayed`.
    let deadline = Instant::now() + Duration::from_secs(5);
    let access = loop {
        let lines: Vec<Value> = gateway
            .stdout_lines()
            .iter()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .filter(|event| event["target"] == "access")
            .collect();
        if lines.len() >= 7 || Instant::now() > deadline {
            break lines;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let outcomes = |route: &str| {
        let mut outcomes: Vec<String> = access
            .iter()
            .filter(|event| event["route"] == route)
            .map(|event| event["limit"].as_str().unwrap().to_owned())
            .collect();
        outcomes.sort();
        outcomes
    };
    assert_eq!(
        outcomes("held"),
        ["allowed", "delayed", "delayed", "delayed"],
        "{access:#?}"
    );
    assert_eq!(outcomes("free"), ["none", "none", "none"], "{access:#?}");
    let (_, _, metrics) = get(&gateway.admin_url("/metrics")).await;
    assert!(
        metrics.contains(&format!("{} 3\n", decisions("delayed"))),
        "{metrics}"
    );
}

/// How the third client of [`a_client_that_leaves_while_held_gives_its_slot_back`] leaves.
#[derive(Debug, Clone, Copy)]
enum Leave {
    /// HTTP/1.1 on a raw socket, closed.
    CloseHttp1,
    /// HTTP/1.1 with a request body of this many bytes, all sent, then closed. Beyond one
    /// read, hyper stops reading until the body is consumed, so only the gateway's own
    /// watch of the socket can see the client leave.
    CloseHttp1WithBody(usize),
    /// HTTP/2: the request is cancelled (RST_STREAM), the connection stays.
    ResetHttp2Stream,
}

/// 500 ms apart, queue of 2. A goes at once, B is held until ~500 ms, C until ~1000 ms.
/// C leaves at ~150 ms; D, sent at ~200 ms, takes C's place and goes at ~1000 ms. Had C's
/// slot not been given back, D would be a 429 (its wait, ~1300 ms, exceeds the queue).
async fn a_client_that_leaves_while_held_gives_its_slot_back(redis: Option<&str>, leave: Leave) {
    let upstream = Recorder::start().await;
    let gateway = TestGateway::start(config(
        &upstream.url(),
        "rate = 2\nper = \"1s\"\nburst = 2",
        redis,
        "",
    ))
    .await;
    if redis.is_some() {
        wait_for_redis(&gateway).await;
    }

    let start = Instant::now();
    let (status, headers, _) = get(&gateway.url("/held/a")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(remaining(&headers), 2);
    assert!(
        start.elapsed() < ms(300),
        "A goes at once (B's turn is at 500 ms)"
    );

    let url = gateway.url("/held/b");
    let b = tokio::spawn(async move {
        let (status, headers, _) = get(&url).await;
        (status, remaining(&headers), start.elapsed())
    });
    // B is decided before C, so that C is the one queued last.
    tokio::time::sleep_until((start + ms(50)).into()).await;

    match leave {
        Leave::CloseHttp1 => {
            let mut c = TcpStream::connect(gateway.addr).await.unwrap();
            c.write_all(b"GET /held/c HTTP/1.1\r\nHost: gateway\r\n\r\n")
                .await
                .unwrap();
            tokio::time::sleep_until((start + ms(150)).into()).await;
            let mut buf = [0u8; 1024];
            let early = tokio::time::timeout(Duration::ZERO, c.read(&mut buf)).await;
            assert!(early.is_err(), "C is held, nothing answered yet: {early:?}");
            drop(c);
        }
        Leave::CloseHttp1WithBody(length) => {
            let mut c = TcpStream::connect(gateway.addr).await.unwrap();
            let head = format!("POST /held/c HTTP/1.1\r\nHost: gateway\r\nContent-Length: {length}\r\n\r\n");
            c.write_all(head.as_bytes()).await.unwrap();
            c.write_all(&vec![b'x'; length]).await.unwrap();
            tokio::time::sleep_until((start + ms(150)).into()).await;
            drop(c);
        }
        Leave::ResetHttp2Stream => {
            let client = h2c_client();
            let request = Request::get(gateway.url("/held/c"))
                .body(Full::new(Bytes::new()))
                .unwrap();
            let c = tokio::spawn(async move { client.request(request).await.map(|r| r.status()) });
            tokio::time::sleep_until((start + ms(150)).into()).await;
            assert!(!c.is_finished(), "C is held, nothing answered yet");
            c.abort();
        }
    }
    let left = start.elapsed();

    // Giving the slot back takes one store call after the gateway sees the client leave
    // (and counts it a 499); D is sent once that is done, well before C's turn.
    gateway
        .metric_becomes(
            "floodgate_requests_total{route=\"held\",status=\"499\"}",
            1.0,
            ms(500),
        )
        .await;
    let settled = Instant::now() + ms(50);
    tokio::time::sleep_until((start + ms(200)).max(settled).into()).await;
    let (status, headers, body) = get(&gateway.url("/held/d")).await;
    let d_done = start.elapsed();
    assert_eq!(status, StatusCode::OK, "D takes the slot C gave back ({body})");
    assert_eq!(remaining(&headers), 0, "D is last in the queue");
    assert_at_turn("D, in C's turn", d_done, ms(1000));

    let (status, b_remaining, b_done) = b.await.unwrap();
    assert_eq!((status, b_remaining), (StatusCode::OK, 1));
    assert_at_turn("B", b_done, ms(500));

    // Well past C's turn: C never reached the upstream.
    tokio::time::sleep_until((start + ms(1300)).into()).await;
    assert_eq!(
        upstream.paths(),
        ["/held/a", "/held/b", "/held/d"],
        "C left at {left:?}"
    );
    assert_eq!(gateway.metric(&decisions("allowed")).await, 1.0);
    assert_eq!(gateway.metric(&decisions("delayed")).await, 3.0);
    assert_eq!(gateway.metric(&decisions("rejected")).await, 0.0);
    // C is logged and counted with nginx's "client closed request".
    assert_eq!(
        gateway
            .metric("floodgate_requests_total{route=\"held\",status=\"499\"}")
            .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_leaves_while_held_gives_its_slot_back_in_process() {
    a_client_that_leaves_while_held_gives_its_slot_back(None, Leave::CloseHttp1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_leaves_while_held_gives_its_slot_back_in_redis() {
    let redis = RedisServer::start();
    a_client_that_leaves_while_held_gives_its_slot_back(Some(&redis.url()), Leave::CloseHttp1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_leaves_with_an_unread_body_while_held_gives_its_slot_back_in_process() {
    a_client_that_leaves_while_held_gives_its_slot_back(None, Leave::CloseHttp1WithBody(100_000)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_leaves_with_an_unread_body_while_held_gives_its_slot_back_in_redis() {
    let redis = RedisServer::start();
    a_client_that_leaves_while_held_gives_its_slot_back(
        Some(&redis.url()),
        Leave::CloseHttp1WithBody(100_000),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancelled_http2_request_while_held_gives_its_slot_back() {
    a_client_that_leaves_while_held_gives_its_slot_back(None, Leave::ResetHttp2Stream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_request_carries_the_rate_limit_headers_and_is_forwarded_once() {
    let upstream = Upstream::start().await;
    // 200 ms apart, queue of 2.
    let gateway = TestGateway::start(config(
        &upstream.url(),
        "rate = 5\nper = \"1s\"\nburst = 2",
        None,
        "ratelimit_headers = \"both\"",
    ))
    .await;

    let start = Instant::now();
    let (status, first, _) = get(&gateway.url("/held/first")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(first["ratelimit"], "\"queue\";r=2;t=1");

    let response = common::http1_client()
        .request(
            Request::get(gateway.url("/held/second?n=1"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    let (status, headers, body) = read_response(response).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_at_turn("the second request", start.elapsed(), ms(200));
    assert!(body.starts_with("GET /held/second?n=1\n"), "{body}");
    assert_eq!(headers["x-upstream"], "yes");
    assert_eq!(headers["ratelimit-policy"], "\"queue\";q=2;w=1");
    assert_eq!(headers["ratelimit"], "\"queue\";r=1;t=1");
    assert_eq!(headers["x-ratelimit-limit"], "2");
    assert_eq!(headers["x-ratelimit-remaining"], "1");
    assert_eq!(headers["x-ratelimit-reset"], "1");
    assert!(!headers.contains_key("retry-after"));

    // Forwarded exactly once, after the hold (and not again later).
    tokio::time::sleep(ms(300)).await;
    assert_eq!(upstream.requests(), 2);
    assert_eq!(gateway.metric(&decisions("allowed")).await, 1.0);
    assert_eq!(gateway.metric(&decisions("delayed")).await, 1.0);
}
