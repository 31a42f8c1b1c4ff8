//! Limits that count failures (docs/configuration.md#limitsnamecount): an attempt takes
//! its unit before it is forwarded and keeps it only when the answer is a failure (so
//! parallel guesses get no more than the limit through); the failure that takes the last
//! of the room starts the lock-out, and from then on the key is refused before anything
//! is forwarded. Both stores.

use crate::common::config::GatewayToml;
use crate::common::redis_server::RedisServer;
use crate::common::{TestGateway, Upstream, get};
use http::StatusCode;

fn config(upstream: &Upstream, redis: Option<&RedisServer>) -> GatewayToml {
    login_config(&upstream.url(), 3, redis)
}

/// One route to the app at `url`, its failures limited to `limit` in 15 minutes per
/// client address, then an hour's lock-out; in Redis when given.
fn login_config(url: &str, limit: u64, redis: Option<&RedisServer>) -> GatewayToml {
    let mut config = GatewayToml::new();
    if let Some(redis) = redis {
        // Exactness is what these tests check, not outages: a loaded test machine must
        // not turn a slow answer into the `on_error` policy.
        config = config.redis(&redis.url(), "timeout = \"2s\"");
    }
    config
        .upstream("app", url, "")
        .limit(
            "login_failures",
            &format!(
                r#"algorithm = "fixed_window"
                limit = {limit}
                window = "15m"
                key = ["client_ip"]
                count = "failures"
                lockout = "1h""#
            ),
        )
        .route(
            "login",
            r#"path_prefix = "/"
            upstream = "app"
            limits = ["login_failures"]"#,
        )
}

/// A PHP-style login: `/status?code=200` succeeds, `/status?code=401` fails.
async fn scenario(gw: &TestGateway, upstream: &Upstream) {
    for _ in 0..5 {
        let (status, headers, _) = get(&gw.url("/status?code=200")).await;
        assert_eq!(status, StatusCode::OK);
        assert!(
            headers["ratelimit"]
                .to_str()
                .unwrap()
                .starts_with("\"login_failures\";r=3;")
        );
    }
    for left in [2, 1, 0] {
        let (status, _, _) = get(&gw.url("/status?code=401")).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "the failure itself is answered");
        let (status, headers, _) = get(&gw.url("/status?code=200")).await;
        if left > 0 {
            assert_eq!(status, StatusCode::OK);
            let ratelimit = headers["ratelimit"].to_str().unwrap();
            assert!(
                ratelimit.starts_with(&format!("\"login_failures\";r={left};")),
                "{ratelimit}"
            );
        } else {
            // The third failure started the lock-out: refused, not forwarded.
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
            let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
            assert!((3590..=3600).contains(&retry), "{retry}");
        }
    }
    let before = upstream.requests();
    assert_eq!(
        get(&gw.url("/status?code=401")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(upstream.requests(), before, "a locked-out request was forwarded");
}

#[tokio::test]
async fn failures_are_counted_and_lock_out_in_process() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(config(&upstream, None)).await;
    scenario(&gw, &upstream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_and_lock_out_in_redis() {
    let redis = tokio::task::spawn_blocking(RedisServer::start).await.unwrap();
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(config(&upstream, Some(&redis))).await;
    scenario(&gw, &upstream).await;
}

/// 50 guesses at once against a limit of 5 failures: each takes its unit before it is
/// forwarded, so exactly 5 reach the app, whatever the concurrency.
async fn parallel_guesses_get_exactly_the_limit_through(redis: Option<&RedisServer>) {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(login_config(&upstream.url(), 5, redis)).await;
    // Every guess fails, after 300 ms: all 50 are in flight at once.
    let url = gw.url("/status?code=401&ms=300");
    let guesses = (0..50).map(|_| {
        let url = url.clone();
        tokio::spawn(async move { get(&url).await.0 })
    });
    let statuses: Vec<StatusCode> = futures_util::future::join_all(guesses)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let failed = statuses
        .iter()
        .filter(|s| **s == StatusCode::UNAUTHORIZED)
        .count();
    let refused = statuses
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!((failed, refused), (5, 45), "{statuses:?}");
    assert_eq!(upstream.requests(), 5);
    // The fifth failure started the lock-out.
    let (status, headers, _) = get(&url).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((3590..=3600).contains(&retry), "{retry}");
    assert_eq!(upstream.requests(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_guesses_get_exactly_the_limit_through_in_process() {
    parallel_guesses_get_exactly_the_limit_through(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_guesses_get_exactly_the_limit_through_in_redis() {
    let redis = tokio::task::spawn_blocking(RedisServer::start).await.unwrap();
    parallel_guesses_get_exactly_the_limit_through(Some(&redis)).await;
}

/// A client that hangs up once its attempt has reached the app gets no attempt for free:
/// the app works on it whatever the client does, so its unit is kept as a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_whose_client_hangs_up_counts_as_a_failure() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(login_config(&upstream.url(), 2, None)).await;
    let url = gw.url("/status?code=401&ms=400");
    for _ in 0..2 {
        let abandoned = tokio::time::timeout(std::time::Duration::from_millis(150), get(&url)).await;
        assert!(abandoned.is_err(), "answered before the client hung up");
    }
    // Both reached the app; the second took the last of the room and started the lock-out
    // when its 401 came, about 250 ms from now (1.5 s leaves a loaded machine room).
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert_eq!(upstream.requests(), 2);
    assert_eq!(
        get(&gw.url("/status?code=200")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(upstream.requests(), 2);
}

/// A failure is kept by every limit that counts it even when the client hangs up while
/// floodgate is still starting the lock-outs: settling is not the client's to interrupt,
/// so a limit settled after the hang-up does not give its unit back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_up_while_lock_outs_start_gives_no_unit_back() {
    let redis = tokio::task::spawn_blocking(RedisServer::start).await.unwrap();
    let upstream = Upstream::start().await;
    let limit = |header: &str| {
        format!(
            r#"algorithm = "fixed_window"
            limit = 1
            window = "15m"
            key = ["header:{header}"]
            count = "failures"
            lockout = "1h""#
        )
    };
    let config = GatewayToml::new()
        .redis(&redis.url(), "timeout = \"5s\"")
        .upstream("app", &upstream.url(), "")
        .limit("per_user", &limit("x-user"))
        .limit("per_account", &limit("x-account"))
        .route(
            "login",
            r#"path_prefix = "/"
            upstream = "app"
            limits = ["per_user", "per_account"]"#,
        );
    let gw = TestGateway::start(config).await;
    let attempt = |user: &str, account: &str, query: &str| {
        http::Request::get(gw.url(&format!("/status?{query}")))
            .header("x-user", user)
            .header("x-account", account)
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap()
    };
    // The failure takes the last of both rooms; while the app works on it, Redis stops,
    // so starting the lock-outs waits, and the client hangs up meanwhile.
    let failing = tokio::spawn(crate::common::send(attempt("u", "a", "code=401&ms=400")));
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    redis.pause();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    failing.abort();
    let _ = failing.await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    redis.resume();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    // Each limit is locked out on its own key, whichever was settled first.
    for (user, account) in [("u", "fresh"), ("fresh", "a")] {
        let (status, headers, _) = crate::common::send(attempt(user, account, "code=200")).await;
        assert_eq!(
            status,
            StatusCode::TOO_MANY_REQUESTS,
            "user {user}, account {account}: {headers:?}"
        );
    }
    assert_eq!(upstream.requests(), 1);
}

/// A client that hangs up while floodgate is still connecting to the app sent the app
/// nothing: its unit goes back, and no lock-out starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_up_before_the_app_was_reached_gives_the_unit_back() {
    let (stuck, _listener, _queued) = crate::common::unaccepting_server().await;
    let app = Upstream::start().await;
    // The stuck route first: the login route takes every path.
    let config = GatewayToml::new()
        .upstream("stuck", &stuck, "timeout = \"5s\"\nconnect_timeout = \"5s\"")
        .route(
            "stuck",
            r#"path_prefix = "/stuck"
            upstream = "stuck"
            limits = ["login_failures"]"#,
        )
        .upstream("app", &app.url(), "")
        .limit(
            "login_failures",
            r#"algorithm = "fixed_window"
            limit = 1
            window = "15m"
            key = ["client_ip"]
            count = "failures"
            lockout = "1h""#,
        )
        .route(
            "login",
            r#"path_prefix = "/"
            upstream = "app"
            limits = ["login_failures"]"#,
        );
    let gw = TestGateway::start(config).await;
    let abandoned = tokio::time::timeout(
        std::time::Duration::from_millis(300),
        get(&gw.url("/stuck/login")),
    )
    .await;
    assert!(abandoned.is_err(), "answered before the client hung up");
    // The unit comes back once the gateway has seen the hang-up (at once, but on a loaded
    // machine a moment later).
    tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
    let (status, headers, _) = get(&gw.url("/status?code=200")).await;
    assert_eq!(status, StatusCode::OK, "{headers:?}");
    assert!(
        headers["ratelimit"]
            .to_str()
            .unwrap()
            .starts_with("\"login_failures\";r=1;"),
        "{headers:?}"
    );
}
