//! Rate limiting through HTTP with the Redis store, each test with its
//! own `redis-server`: exact counts and headers, a counter and a lock shared by two
//! gateways, a TTL on every key, and a failing store (`on_error` allow and deny) that
//! never holds a request up.

use std::time::{Duration, Instant};

use crate::common::config::GatewayToml;
use crate::common::redis_server::RedisServer;
use crate::common::{TestGateway, Upstream, closed_port, get};
use http::{HeaderMap, StatusCode};

async fn redis_server() -> RedisServer {
    tokio::task::spawn_blocking(RedisServer::start).await.unwrap()
}

/// A configuration on `redis_url` with `[redis]` extras, one upstream `app`, and a route
/// `/warmup` answered by the gateway itself, limited generously: until its responses carry
/// `RateLimit`, the gateway has not reached Redis yet. Each test adds its limits and routes.
/// Unless the extras set one, the store's timeout is 5 s: these tests count in Redis, and
/// a call over the default 50 ms on a starved machine would be decided by `on_error`
/// instead.
fn config(redis_url: &str, redis_extra: &str, upstream: &Upstream) -> GatewayToml {
    let timeout = if redis_extra.contains("timeout") {
        ""
    } else {
        "timeout = \"5s\""
    };
    GatewayToml::new()
        .redis(redis_url, &format!("{timeout}\n{redis_extra}"))
        .upstream("app", &upstream.url(), "")
        .limit(
            "warmup",
            r#"algorithm = "fixed_window"
            limit = 1000000
            window = "1m""#,
        )
        .route(
            "warmup",
            r#"path = "/warmup"
            respond = { status = 200, body = "ok\n" }
            limits = ["warmup"]"#,
        )
}

/// Waits until `gw` decides with Redis (it connects in the background).
async fn until_connected(gw: &TestGateway) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (status, headers, _) = get(&gw.url("/warmup")).await;
        assert_eq!(status, StatusCode::OK);
        if headers.contains_key("ratelimit") {
            return;
        }
        assert!(Instant::now() < deadline, "the gateway never reached redis");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn one<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    let values: Vec<_> = headers.get_all(name).iter().collect();
    assert_eq!(values.len(), 1, "{name}: {values:?} in {headers:?}");
    values[0].to_str().unwrap()
}

/// `config` with the limit `name`, `limit` a minute, on a route for everything.
fn limited(config: GatewayToml, name: &str, limit: u64) -> GatewayToml {
    config
        .limit(
            name,
            &format!(
                r#"algorithm = "fixed_window"
                limit = {limit}
                window = "1m""#
            ),
        )
        .route(
            "api",
            &format!(
                r#"path_prefix = "/"
                upstream = "app"
                limits = ["{name}"]"#
            ),
        )
}

#[tokio::test]
async fn redis_admits_exactly_the_limit_and_rejects_before_the_upstream() {
    let redis = redis_server().await;
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(limited(config(&redis.url(), "", &upstream), "per_ip", 3)).await;
    until_connected(&gw).await;

    for remaining in [2, 1, 0] {
        let (status, headers, body) = get(&gw.url("/x")).await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.starts_with("GET /x\n"), "{body}");
        assert_eq!(one(&headers, "ratelimit-policy"), "\"per_ip\";q=3;w=60");
        let value = one(&headers, "ratelimit");
        assert!(
            [60, 59]
                .map(|t| format!("\"per_ip\";r={remaining};t={t}"))
                .contains(&value.to_owned()),
            "{value}"
        );
    }
    assert_eq!(upstream.requests(), 3);

    let (status, headers, body) = get(&gw.url("/x")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::TOO_MANY_REQUESTS, "Too Many Requests\n")
    );
    let retry: u64 = one(&headers, "retry-after").parse().unwrap();
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    assert!(one(&headers, "ratelimit").starts_with("\"per_ip\";r=0;t="));
    assert_eq!(upstream.requests(), 3);

    let decisions = |outcome: &str| {
        format!("floodgate_ratelimit_decisions_total{{limit=\"per_ip\",outcome=\"{outcome}\"}}")
    };
    assert_eq!(gw.metric(&decisions("allowed")).await, 3.0);
    assert_eq!(gw.metric(&decisions("rejected")).await, 1.0);
    assert_eq!(gw.metric(&decisions("store_error")).await, 0.0);

    // Every key floodgate wrote expires.
    let keys = redis.cli(&["--scan", "--pattern", "floodgate:*"]);
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    assert!(keys.iter().any(|k| k.ends_with(":per_ip:fw")), "{keys:?}");
    for key in keys {
        let ttl: i64 = redis.cli(&["PTTL", key]).trim().parse().unwrap();
        assert!(ttl > 0 && ttl <= 60_000, "{key}: PTTL {ttl}");
    }
}

#[tokio::test]
async fn a_refusal_is_remembered_and_answered_without_redis() {
    let redis = redis_server().await;
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(limited(config(&redis.url(), "", &upstream), "per_ip", 2)).await;
    until_connected(&gw).await;
    let script_calls = || redis.command_calls("evalsha");
    let before = script_calls();

    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(get(&gw.url("/x")).await.0.as_u16());
    }
    assert_eq!(statuses, [200, 200, 429, 429, 429]);
    // Two admissions and the first refusal reach Redis; that refusal holds until the
    // window ends, so the next two are answered from memory.
    assert_eq!(script_calls() - before, 3);
    assert_eq!(
        gw.metric(r#"floodgate_ratelimit_decisions_total{limit="per_ip",outcome="rejected"}"#)
            .await,
        3.0
    );
    assert_eq!(upstream.requests(), 2);
}

/// A remembered refusal tells the time still left: its `Retry-After` and `RateLimit`
/// reset count down from the refusal Redis gave, and do not repeat it.
#[tokio::test]
async fn a_remembered_refusal_tells_the_time_left_not_the_time_it_was_given() {
    let redis = redis_server().await;
    let upstream = Upstream::start().await;
    let config = config(&redis.url(), "", &upstream)
        .limit(
            "slow",
            r#"algorithm = "token_bucket"
            rate = 1
            per = "10s"
            burst = 1"#,
        )
        .route(
            "api",
            r#"upstream = "app"
            limits = ["slow"]"#,
        );
    let gw = TestGateway::start(&config).await;
    until_connected(&gw).await;
    // Decisions asked of Redis, as the gateway counts them: Redis's own count of script
    // calls takes in the gateway's heartbeat too.
    let decisions = || gw.metric(r#"floodgate_store_duration_seconds_count{store="redis"}"#);

    // The bucket's next token comes 10 s after the first request. Refused 0.5 s later,
    // the wait is 9.5 s ("10"); remembered (for at most 1 s) and asked again 0.5 s after
    // that, 9 s ("9"). Each figure holds while the requests take under half a second.
    assert_eq!(get(&gw.url("/")).await.0, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, given, _) = get(&gw.url("/")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let asked = decisions().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, remembered, _) = get(&gw.url("/")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(decisions().await, asked, "answered from memory");

    let retry = |headers: &HeaderMap| one(headers, "retry-after").parse::<u64>().unwrap();
    let reset = |headers: &HeaderMap| {
        let value = one(headers, "ratelimit");
        value.rsplit_once(";t=").unwrap().1.parse::<u64>().unwrap()
    };
    assert_eq!((retry(&given), retry(&remembered)), (10, 9));
    // With a burst of 1, the bucket is full again when the next token comes.
    assert_eq!((reset(&given), reset(&remembered)), (10, 9));
    assert_eq!(upstream.requests(), 1);
}

#[tokio::test]
async fn two_gateways_on_one_redis_share_the_counter() {
    let redis = redis_server().await;
    let upstream = Upstream::start().await;
    let config = limited(config(&redis.url(), "", &upstream), "shared", 4);
    let a = TestGateway::start(&config).await;
    let b = TestGateway::start(&config).await;
    until_connected(&a).await;
    until_connected(&b).await;

    assert_eq!(get(&a.url("/")).await.0, StatusCode::OK);
    assert_eq!(get(&a.url("/")).await.0, StatusCode::OK);
    assert_eq!(get(&b.url("/")).await.0, StatusCode::OK);
    let (status, headers, _) = get(&b.url("/")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(one(&headers, "ratelimit").starts_with("\"shared\";r=0;t="));

    assert_eq!(get(&a.url("/")).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(get(&b.url("/")).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(upstream.requests(), 4);
}

#[tokio::test]
async fn a_lock_out_in_redis_binds_every_gateway() {
    let redis = redis_server().await;
    let upstream = Upstream::start().await;
    let config = config(&redis.url(), "", &upstream)
        .limit(
            "login",
            r#"algorithm = "fixed_window"
            limit = 1
            window = "300ms"
            lockout = "2s""#,
        )
        .route(
            "api",
            r#"upstream = "app"
            limits = ["login"]"#,
        );
    let a = TestGateway::start(&config).await;
    let b = TestGateway::start(&config).await;
    until_connected(&a).await;
    until_connected(&b).await;

    assert_eq!(get(&a.url("/")).await.0, StatusCode::OK);
    let (status, headers, _) = get(&a.url("/")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(one(&headers, "retry-after"), "2");

    // The window is over, but the lock set through gateway A holds on B.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (status, headers, _) = get(&b.url("/")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(one(&headers, "retry-after"), "2");
    assert_eq!(
        b.metric("floodgate_ratelimit_decisions_total{limit=\"login\",outcome=\"locked\"}")
            .await,
        1.0
    );
    assert_eq!(upstream.requests(), 1);
}

/// `GET path` that must finish quickly although the store fails (well before the 1.5 s
/// that a paused Redis would hold it).
async fn timed_get(gw: &TestGateway, path: &str) -> (StatusCode, HeaderMap, String) {
    let started = Instant::now();
    let response = get(&gw.url(path)).await;
    let took = started.elapsed();
    assert!(took < Duration::from_millis(1000), "{path} took {took:?}");
    response
}

#[tokio::test]
async fn unreachable_redis_with_on_error_allow_forwards_and_counts_store_errors() {
    let upstream = Upstream::start().await;
    let url = format!("redis://127.0.0.1:{}/0", closed_port());
    let redis_extra = "timeout = \"50ms\"\non_error = \"allow\"";
    let gw = TestGateway::start(limited(config(&url, redis_extra, &upstream), "per_ip", 1)).await;

    for i in 0..3 {
        let (status, headers, body) = timed_get(&gw, "/x").await;
        assert_eq!(status, StatusCode::OK, "request {i}");
        assert!(body.starts_with("GET /x\n"), "{body}");
        assert!(!headers.contains_key("ratelimit"), "{headers:?}");
        assert!(!headers.contains_key("ratelimit-policy"), "{headers:?}");
    }
    assert_eq!(upstream.requests(), 3);
    assert_eq!(
        gw.metric("floodgate_ratelimit_decisions_total{limit=\"per_ip\",outcome=\"store_error\"}")
            .await,
        3.0
    );
    assert_eq!(
        gw.metric("floodgate_ratelimit_decisions_total{limit=\"per_ip\",outcome=\"allowed\"}")
            .await,
        0.0
    );
    assert_eq!(
        gw.metric("floodgate_store_errors_total{store=\"redis\"}").await,
        3.0
    );
}

#[tokio::test]
async fn unreachable_redis_with_on_error_deny_answers_503_with_retry_after_1() {
    let upstream = Upstream::start().await;
    let url = format!("redis://127.0.0.1:{}/0", closed_port());
    let redis_extra = "timeout = \"50ms\"\non_error = \"deny\"";
    let gw = TestGateway::start(limited(config(&url, redis_extra, &upstream), "per_ip", 100)).await;

    for i in 0..3 {
        let (status, headers, body) = timed_get(&gw, "/x").await;
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, "Service Unavailable\n"),
            "request {i}"
        );
        assert_eq!(one(&headers, "retry-after"), "1");
        assert_eq!(one(&headers, "content-type"), "text/plain; charset=utf-8");
    }
    assert_eq!(upstream.requests(), 0);
    assert_eq!(
        gw.metric("floodgate_ratelimit_decisions_total{limit=\"per_ip\",outcome=\"store_error\"}")
            .await,
        3.0
    );
    assert_eq!(
        gw.metric("floodgate_store_errors_total{store=\"redis\"}").await,
        3.0
    );
    assert_eq!(
        gw.metric("floodgate_requests_total{route=\"api\",status=\"503\"}")
            .await,
        3.0
    );
}

#[tokio::test]
async fn a_redis_that_misses_the_timeout_fails_the_decision_not_the_request() {
    let redis = redis_server().await;
    let upstream = Upstream::start().await;
    let redis_extra = "timeout = \"50ms\"\non_error = \"allow\"";
    let gw = TestGateway::start(limited(
        config(&redis.url(), redis_extra, &upstream),
        "per_ip",
        100,
    ))
    .await;
    until_connected(&gw).await;

    // Redis accepts the commands but runs none of them for 1.5 s.
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "1500", "ALL"]).trim(), "OK");
    let paused = Instant::now();
    for i in 0..3 {
        let (status, headers, _) = timed_get(&gw, "/x").await;
        assert_eq!(status, StatusCode::OK, "request {i}");
        assert!(
            !headers.contains_key("ratelimit"),
            "decided during the pause: {headers:?}"
        );
    }
    assert!(paused.elapsed() < Duration::from_millis(1500));
    assert!(gw.metric("floodgate_store_errors_total{store=\"redis\"}").await >= 3.0);

    // Redis answers again: decisions come from it within 2 s of the pause's end.
    tokio::time::sleep_until((paused + Duration::from_millis(1500)).into()).await;
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let (status, headers, _) = get(&gw.url("/x")).await;
        assert_eq!(status, StatusCode::OK);
        if headers.contains_key("ratelimit") {
            break;
        }
        assert!(Instant::now() < deadline, "never returned to redis");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
