//! Rate limiting through HTTP with the in-process store: rejection with
//! `Retry-After` before the upstream is contacted, custom status and message, the
//! rate-limit headers in every `server.ratelimit_headers` mode, shadow and exempt limits,
//! limits shared by routes, `cost`, lock-out, and the decision and store metrics.

use std::ops::RangeInclusive;
use std::time::Duration;

use crate::common::config::GatewayToml;
use crate::common::{TestGateway, Upstream, get};
use http::{HeaderMap, StatusCode};

const RATELIMIT_HEADERS: [&str; 5] = [
    "ratelimit-policy",
    "ratelimit",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
];

/// A configuration with one upstream, `app`, at `upstream`, and `server` keys in
/// `[server]`; each test adds its limits and routes.
fn app(upstream: &Upstream, server: &str) -> GatewayToml {
    GatewayToml::new()
        .server(server)
        .upstream("app", &upstream.url(), "")
}

/// The only value of `name`; fails when it is absent or repeated.
fn one<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    let values: Vec<_> = headers.get_all(name).iter().collect();
    assert_eq!(values.len(), 1, "{name}: {values:?} in {headers:?}");
    values[0].to_str().unwrap()
}

fn retry_after(headers: &HeaderMap) -> u64 {
    one(headers, "retry-after").parse().unwrap()
}

/// Checks a `RateLimit` value item by item: name and exact `r`, and `t` within a range
/// (a window that started a moment ago has a little less than its length left).
fn assert_ratelimit(value: &str, expected: &[(&str, u64, RangeInclusive<u64>)]) {
    let items: Vec<&str> = value.split(", ").collect();
    assert_eq!(items.len(), expected.len(), "{value}");
    for (item, (name, remaining, reset)) in items.iter().zip(expected) {
        let prefix = format!("\"{name}\";r={remaining};t=");
        let t: u64 = item
            .strip_prefix(&prefix)
            .unwrap_or_else(|| panic!("{item:?} should start with {prefix:?} (in {value:?})"))
            .parse()
            .unwrap_or_else(|_| panic!("t of {item:?}"));
        assert!(reset.contains(&t), "t={t} not in {reset:?}: {value}");
    }
}

fn assert_no_ratelimit_headers(headers: &HeaderMap) {
    for name in RATELIMIT_HEADERS {
        assert!(!headers.contains_key(name), "{name} in {headers:?}");
    }
}

/// `per_ip`, 3 a minute, and the route `api` it limits.
fn per_ip_3(upstream: &Upstream) -> GatewayToml {
    app(upstream, "")
        .limit(
            "per_ip",
            r#"algorithm = "fixed_window"
            limit = 3
            window = "1m""#,
        )
        .route(
            "api",
            r#"upstream = "app"
            limits = ["per_ip"]"#,
        )
}

#[tokio::test]
async fn the_request_over_the_limit_gets_429_and_never_reaches_the_upstream() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(per_ip_3(&upstream)).await;

    for i in 0..3 {
        let (status, _, body) = get(&gw.url("/x")).await;
        assert_eq!(status, StatusCode::OK, "request {i}");
        assert!(body.starts_with("GET /x\n"), "{body}");
    }
    assert_eq!(upstream.requests(), 3);

    let (status, headers, body) = get(&gw.url("/x")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::TOO_MANY_REQUESTS, "Too Many Requests\n")
    );
    assert_eq!(one(&headers, "content-type"), "text/plain; charset=utf-8");
    let retry = retry_after(&headers);
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    assert_eq!(
        upstream.requests(),
        3,
        "a rejected request must not reach the upstream"
    );

    // Rejected requests consume nothing, but the window still has not ended.
    assert_eq!(get(&gw.url("/x")).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(upstream.requests(), 3);
}

#[tokio::test]
async fn custom_status_and_message_are_the_rejection() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        app(&upstream, "")
            .limit(
                "strict",
                r#"algorithm = "fixed_window"
                limit = 1
                window = "1m"
                status = 503
                message = "Slow down, please.\n""#,
            )
            .route(
                "api",
                r#"upstream = "app"
                limits = ["strict"]"#,
            ),
    )
    .await;

    assert_eq!(get(&gw.url("/")).await.0, StatusCode::OK);
    let (status, headers, body) = get(&gw.url("/")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "Slow down, please.\n")
    );
    assert_eq!(one(&headers, "content-type"), "text/plain; charset=utf-8");
    assert!((1..=60).contains(&retry_after(&headers)));
    assert_eq!(upstream.requests(), 1);
}

#[tokio::test]
async fn ietf_headers_name_each_limit_on_admitted_and_rejected_responses() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(per_ip_3(&upstream)).await;

    for remaining in [2, 1, 0] {
        let (status, headers, _) = get(&gw.url("/")).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(one(&headers, "ratelimit-policy"), "\"per_ip\";q=3;w=60");
        assert_ratelimit(one(&headers, "ratelimit"), &[("per_ip", remaining, 59..=60)]);
        for legacy in &RATELIMIT_HEADERS[2..] {
            assert!(!headers.contains_key(*legacy), "{legacy} with ietf");
        }
    }
    let (status, headers, _) = get(&gw.url("/")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(one(&headers, "ratelimit-policy"), "\"per_ip\";q=3;w=60");
    assert_ratelimit(one(&headers, "ratelimit"), &[("per_ip", 0, 59..=60)]);
    // The reset and Retry-After of a fixed window are the same instant.
    let t: u64 = one(&headers, "ratelimit")
        .rsplit("t=")
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(retry_after(&headers), t);
}

/// `per_minute` and `burst`, both limiting the route `api`; `server` keys in `[server]`.
fn two_limits(upstream: &Upstream, server: &str) -> GatewayToml {
    app(upstream, server)
        .limit(
            "per_minute",
            r#"algorithm = "fixed_window"
            limit = 3
            window = "1m""#,
        )
        .limit(
            "burst",
            r#"algorithm = "token_bucket"
            rate = 2
            per = "1s"
            burst = 5"#,
        )
        .route(
            "api",
            r#"upstream = "app"
            limits = ["per_minute", "burst"]"#,
        )
}

#[tokio::test]
async fn a_route_with_two_limits_gets_one_item_per_limit_in_route_order() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(two_limits(&upstream, "ratelimit_headers = \"ietf\"")).await;

    let (status, headers, _) = get(&gw.url("/")).await;
    assert_eq!(status, StatusCode::OK);
    // token_bucket: q = burst, w = ceil(burst * per / rate) = ceil(2.5 s).
    assert_eq!(
        one(&headers, "ratelimit-policy"),
        "\"per_minute\";q=3;w=60, \"burst\";q=5;w=3"
    );
    // One token spent of five: full again in 0.5 s, rounded up.
    assert_ratelimit(
        one(&headers, "ratelimit"),
        &[("per_minute", 2, 59..=60), ("burst", 4, 1..=1)],
    );
}

#[tokio::test]
async fn legacy_headers_describe_the_limit_with_least_remaining() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        app(&upstream, "ratelimit_headers = \"legacy\"")
            .limit(
                "per_minute",
                r#"algorithm = "fixed_window"
                limit = 3
                window = "1m""#,
            )
            .limit(
                "burst",
                r#"algorithm = "token_bucket"
                rate = 1
                per = "10s"
                burst = 2"#,
            )
            .route(
                "api",
                r#"upstream = "app"
                limits = ["per_minute", "burst"]"#,
            ),
    )
    .await;

    // per_minute has 2 left, burst 1: burst is the most restrictive.
    let (status, headers, _) = get(&gw.url("/")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(one(&headers, "x-ratelimit-limit"), "2");
    assert_eq!(one(&headers, "x-ratelimit-remaining"), "1");
    assert_eq!(one(&headers, "x-ratelimit-reset"), "10");
    assert!(!headers.contains_key("ratelimit"));
    assert!(!headers.contains_key("ratelimit-policy"));

    assert_eq!(get(&gw.url("/")).await.0, StatusCode::OK);
    let (status, headers, _) = get(&gw.url("/")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(one(&headers, "x-ratelimit-limit"), "2");
    assert_eq!(one(&headers, "x-ratelimit-remaining"), "0");
    let reset: u64 = one(&headers, "x-ratelimit-reset").parse().unwrap();
    assert!((19..=20).contains(&reset), "X-RateLimit-Reset {reset}");
    // One token comes back 10 s after the first request.
    let retry = retry_after(&headers);
    assert!((9..=10).contains(&retry), "Retry-After {retry}");
}

#[tokio::test]
async fn both_sends_ietf_and_legacy_headers() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(two_limits(&upstream, "ratelimit_headers = \"both\"")).await;

    let (_, headers, _) = get(&gw.url("/")).await;
    assert_eq!(
        one(&headers, "ratelimit-policy"),
        "\"per_minute\";q=3;w=60, \"burst\";q=5;w=3"
    );
    assert_ratelimit(
        one(&headers, "ratelimit"),
        &[("per_minute", 2, 59..=60), ("burst", 4, 1..=1)],
    );
    assert_eq!(one(&headers, "x-ratelimit-limit"), "3");
    assert_eq!(one(&headers, "x-ratelimit-remaining"), "2");
    let reset: u64 = one(&headers, "x-ratelimit-reset").parse().unwrap();
    assert!((59..=60).contains(&reset), "X-RateLimit-Reset {reset}");
}

#[tokio::test]
async fn none_sends_no_rate_limit_headers_but_still_retry_after() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        app(&upstream, "ratelimit_headers = \"none\"")
            .limit(
                "one",
                r#"algorithm = "fixed_window"
                limit = 1
                window = "1m""#,
            )
            .route(
                "api",
                r#"upstream = "app"
                limits = ["one"]"#,
            ),
    )
    .await;

    let (status, headers, _) = get(&gw.url("/")).await;
    assert_eq!(status, StatusCode::OK);
    assert_no_ratelimit_headers(&headers);
    let (status, headers, _) = get(&gw.url("/")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_no_ratelimit_headers(&headers);
    assert!((1..=60).contains(&retry_after(&headers)));
}

#[tokio::test]
async fn shadow_limits_never_reject_add_no_headers_and_count_what_they_would_have_done() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        app(&upstream, "")
            .limit(
                "x",
                r#"algorithm = "fixed_window"
                limit = 1
                window = "1m"
                mode = "shadow""#,
            )
            .limit(
                "y",
                r#"algorithm = "fixed_window"
                limit = 1
                window = "1m"
                mode = "shadow""#,
            )
            .limit(
                "enforced",
                r#"algorithm = "fixed_window"
                limit = 10
                window = "1m""#,
            )
            .route(
                "shadow-only",
                r#"path_prefix = "/only"
                upstream = "app"
                limits = ["x"]"#,
            )
            .route(
                "mixed",
                r#"path_prefix = "/mixed"
                upstream = "app"
                limits = ["y", "enforced"]"#,
            ),
    )
    .await;

    for i in 0..5 {
        let (status, headers, body) = get(&gw.url("/only")).await;
        assert_eq!(status, StatusCode::OK, "request {i}");
        assert!(body.starts_with("GET /only\n"), "{body}");
        assert_no_ratelimit_headers(&headers);
    }
    assert_eq!(upstream.requests(), 5);
    assert_eq!(
        gw.metric("floodgate_ratelimit_decisions_total{limit=\"x\",outcome=\"shadow_rejected\"}")
            .await,
        4.0
    );
    assert_eq!(
        gw.metric("floodgate_ratelimit_decisions_total{limit=\"x\",outcome=\"allowed\"}")
            .await,
        1.0
    );
    assert_eq!(
        gw.metric("floodgate_ratelimit_decisions_total{limit=\"x\",outcome=\"rejected\"}")
            .await,
        0.0
    );

    // Next to an enforced limit, a shadow limit is left out of the headers.
    for remaining in [9, 8] {
        let (status, headers, _) = get(&gw.url("/mixed")).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(one(&headers, "ratelimit-policy"), "\"enforced\";q=10;w=60");
        assert_ratelimit(one(&headers, "ratelimit"), &[("enforced", remaining, 59..=60)]);
    }
    assert_eq!(
        gw.metric("floodgate_ratelimit_decisions_total{limit=\"y\",outcome=\"shadow_rejected\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn exempt_client_ips_are_never_limited_and_get_no_headers_for_that_limit() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        app(&upstream, "")
            .limit(
                "local_exempt",
                r#"algorithm = "fixed_window"
                limit = 1
                window = "1m"
                exempt = ["127.0.0.0/8"]"#,
            )
            .limit(
                "other_exempt",
                r#"algorithm = "fixed_window"
                limit = 1
                window = "1m"
                exempt = ["10.0.0.0/8", "::1/128"]"#,
            )
            .limit(
                "everyone",
                r#"algorithm = "fixed_window"
                limit = 10
                window = "1m""#,
            )
            .route(
                "exempt",
                r#"path_prefix = "/exempt"
                upstream = "app"
                limits = ["local_exempt"]"#,
            )
            .route(
                "mixed",
                r#"path_prefix = "/mixed"
                upstream = "app"
                limits = ["local_exempt", "everyone"]"#,
            )
            .route(
                "not-exempt",
                r#"path_prefix = "/applies"
                upstream = "app"
                limits = ["other_exempt"]"#,
            ),
    )
    .await;

    for i in 0..3 {
        let (status, headers, _) = get(&gw.url("/exempt")).await;
        assert_eq!(status, StatusCode::OK, "request {i}");
        assert_no_ratelimit_headers(&headers);
    }

    for remaining in [9, 8] {
        let (status, headers, _) = get(&gw.url("/mixed")).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(one(&headers, "ratelimit-policy"), "\"everyone\";q=10;w=60");
        assert_ratelimit(one(&headers, "ratelimit"), &[("everyone", remaining, 59..=60)]);
    }

    // 127.0.0.1 is in neither of other_exempt's networks: it applies.
    assert_eq!(get(&gw.url("/applies")).await.0, StatusCode::OK);
    assert_eq!(get(&gw.url("/applies")).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(upstream.requests(), 6);
}

#[tokio::test]
async fn routes_that_name_the_same_limit_share_its_counter() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        app(&upstream, "")
            .limit(
                "shared",
                r#"algorithm = "fixed_window"
                limit = 3
                window = "1m""#,
            )
            .route(
                "a",
                r#"path_prefix = "/a"
                upstream = "app"
                limits = ["shared"]"#,
            )
            .route(
                "b",
                r#"path_prefix = "/b"
                upstream = "app"
                limits = ["shared"]"#,
            ),
    )
    .await;

    assert_eq!(get(&gw.url("/a")).await.0, StatusCode::OK);
    assert_eq!(get(&gw.url("/a")).await.0, StatusCode::OK);
    let (status, headers, _) = get(&gw.url("/b")).await;
    assert_eq!(status, StatusCode::OK);
    assert_ratelimit(one(&headers, "ratelimit"), &[("shared", 0, 59..=60)]);
    assert_eq!(get(&gw.url("/a")).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(get(&gw.url("/b")).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(upstream.requests(), 3);
}

#[tokio::test]
async fn cost_is_consumed_from_the_limit_per_request() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        app(&upstream, "")
            .limit(
                "ten",
                r#"algorithm = "fixed_window"
                limit = 10
                window = "1m""#,
            )
            .route(
                "expensive",
                r#"upstream = "app"
                limits = ["ten"]
                cost = 3"#,
            ),
    )
    .await;

    for remaining in [7, 4, 1] {
        let (status, headers, _) = get(&gw.url("/")).await;
        assert_eq!(status, StatusCode::OK);
        assert_ratelimit(one(&headers, "ratelimit"), &[("ten", remaining, 59..=60)]);
    }
    // 9 used: one unit is left, but a request costs 3.
    let (status, headers, _) = get(&gw.url("/")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_ratelimit(one(&headers, "ratelimit"), &[("ten", 1, 59..=60)]);
    assert_eq!(upstream.requests(), 3);
}

#[tokio::test]
async fn lockout_keeps_rejecting_after_the_window_until_the_penalty_ends() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        app(&upstream, "")
            .limit(
                "tight",
                r#"algorithm = "fixed_window"
                limit = 1
                window = "300ms"
                lockout = "1s""#,
            )
            .route(
                "login",
                r#"upstream = "app"
                limits = ["tight"]"#,
            ),
    )
    .await;

    assert_eq!(get(&gw.url("/")).await.0, StatusCode::OK);
    let (status, headers, _) = get(&gw.url("/")).await;
    let locked_at = tokio::time::Instant::now();
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry_after(&headers), 1, "the lock, not the 300 ms window");

    // The window has ended; the lock has not.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, headers, body) = get(&gw.url("/")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::TOO_MANY_REQUESTS, "Too Many Requests\n")
    );
    assert_eq!(retry_after(&headers), 1);
    assert_ratelimit(one(&headers, "ratelimit"), &[("tight", 0, 1..=1)]);
    let decisions = |outcome: &str| {
        format!("floodgate_ratelimit_decisions_total{{limit=\"tight\",outcome=\"{outcome}\"}}")
    };
    assert_eq!(gw.metric(&decisions("allowed")).await, 1.0);
    assert_eq!(gw.metric(&decisions("rejected")).await, 1.0);
    assert_eq!(gw.metric(&decisions("locked")).await, 1.0);

    tokio::time::sleep_until(locked_at + Duration::from_millis(1100)).await;
    assert_eq!(get(&gw.url("/")).await.0, StatusCode::OK);
    assert_eq!(gw.metric(&decisions("allowed")).await, 2.0);
    assert_eq!(upstream.requests(), 2);
}

#[tokio::test]
async fn decisions_and_store_calls_are_counted_exactly() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        app(&upstream, "")
            .limit(
                "two",
                r#"algorithm = "fixed_window"
                limit = 2
                window = "1m""#,
            )
            .route(
                "limited",
                r#"path_prefix = "/limited"
                upstream = "app"
                limits = ["two"]"#,
            )
            .route(
                "free",
                r#"path_prefix = "/free"
                upstream = "app""#,
            ),
    )
    .await;

    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(get(&gw.url("/limited")).await.0.as_u16());
    }
    assert_eq!(statuses, [200, 200, 429, 429, 429]);
    // Routes without limits never ask the store.
    assert_eq!(get(&gw.url("/free")).await.0, StatusCode::OK);
    assert_eq!(get(&gw.url("/free")).await.0, StatusCode::OK);

    assert_eq!(
        gw.metric("floodgate_ratelimit_decisions_total{limit=\"two\",outcome=\"allowed\"}")
            .await,
        2.0
    );
    assert_eq!(
        gw.metric("floodgate_ratelimit_decisions_total{limit=\"two\",outcome=\"rejected\"}")
            .await,
        3.0
    );
    // The in-process store decides every limited request (refusals are remembered only
    // in front of Redis: tests/ratelimit_redis.rs).
    assert_eq!(
        gw.metric("floodgate_store_duration_seconds_count{store=\"memory\"}")
            .await,
        5.0
    );
    assert_eq!(
        gw.metric("floodgate_store_errors_total{store=\"memory\"}").await,
        0.0
    );
    assert_eq!(
        gw.metric("floodgate_requests_total{route=\"limited\",status=\"429\"}")
            .await,
        3.0
    );
    assert_eq!(
        gw.metric("floodgate_requests_total{route=\"limited\",status=\"200\"}")
            .await,
        2.0
    );
}
