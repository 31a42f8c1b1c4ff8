//! What clients see when Redis fails (docs/operations.md#when-redis-fails): a hung or dead Redis costs at most
//! `redis.timeout` per request until the breaker opens, then next to nothing; decisions
//! return to Redis within 2 s of it answering again; `deny` answers 503 and turns /readyz
//! 503; `local` shares each limit out between the live instances; `SCRIPT FLUSH` and a
//! restart are survived. Every test runs its own redis-server.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::config::GatewayToml;
use crate::common::redis_server::RedisServer;
use crate::common::{TestGateway, Upstream, get};
use floodgate::limit::redis::RedisTarget;
use floodgate::limit::redis::{RedisStore, StoreError};
use floodgate::limit::{Algorithm, LimitCheck};
use http::StatusCode;

async fn start_redis() -> RedisServer {
    tokio::task::spawn_blocking(RedisServer::start).await.unwrap()
}

async fn gateway(redis_url: &str, upstream: &Upstream, on_error: &str, limit: u64) -> TestGateway {
    let limit = format!("algorithm = \"fixed_window\"\nlimit = {limit}\nwindow = \"1m\"");
    gateway_with(redis_url, upstream, on_error, &limit).await
}

/// A gateway on `redis_url` (300 ms deadline) whose one route has limit `l`, the table
/// body `limit`; its first request is decided by Redis.
async fn gateway_with(redis_url: &str, upstream: &Upstream, on_error: &str, limit: &str) -> TestGateway {
    let gateway = TestGateway::start(
        GatewayToml::new()
            .redis(
                redis_url,
                &format!(
                    r#"timeout = "300ms"
                    on_error = "{on_error}""#
                ),
            )
            .upstream("app", &upstream.url(), "")
            .limit("l", limit)
            .route(
                "r",
                r#"upstream = "app"
                limits = ["l"]"#,
            ),
    )
    .await;
    assert_eq!(
        status_of(&gateway).await,
        StatusCode::OK,
        "decided by redis from the start"
    );
    assert_eq!(
        gateway
            .metric(r#"floodgate_store_errors_total{store="redis"}"#)
            .await,
        0.0
    );
    gateway
}

async fn status_of(gateway: &TestGateway) -> StatusCode {
    get(&gateway.url("/x")).await.0
}

/// Polls `condition` every 50 ms until it holds; panics after `limit`. Returns the time taken.
async fn wait_until<F, Fut>(limit: Duration, mut condition: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if condition().await {
            return start.elapsed();
        }
        assert!(start.elapsed() < limit, "condition not met within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn allowed(gateway: &TestGateway) -> f64 {
    gateway
        .metric(r#"floodgate_ratelimit_decisions_total{limit="l",outcome="allowed"}"#)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_redis_costs_the_timeout_until_the_breaker_opens_then_nothing() {
    let redis = start_redis().await;
    let upstream = Upstream::start().await;
    let gw = gateway(&redis.url(), &upstream, "allow", 1_000_000).await;

    ten_requests_while_redis_hangs(&redis, &gw, "/x", StatusCode::OK).await;
    assert_eq!(
        gw.metric(r#"floodgate_store_errors_total{store="redis"}"#).await,
        10.0
    );
    assert_eq!(
        gw.metric(r#"floodgate_ratelimit_decisions_total{limit="l",outcome="store_error"}"#)
            .await,
        10.0
    );

    let before = allowed(&gw).await;
    redis.resume();
    let back_after = wait_until(Duration::from_secs(2), || async {
        status_of(&gw).await;
        allowed(&gw).await > before
    })
    .await;
    assert!(
        back_after < Duration::from_secs(2),
        "back on redis after {back_after:?}"
    );
}

/// Pauses Redis (SIGSTOP) and sends ten requests to `path`: each gets `status`
/// (`on_error = "allow"` forwards them). Until the breaker opens (3 failures, the
/// background probe's among them), a request waits at most the 300 ms deadline; after
/// that Redis is not asked at all: a few milliseconds of debug-build HTTP (the bounds leave
/// room for a loaded CI machine: under the deadline, or twice it for a request that waits
/// for it).
async fn ten_requests_while_redis_hangs(
    redis: &RedisServer,
    gw: &TestGateway,
    path: &str,
    status: StatusCode,
) {
    redis.pause();
    let mut latencies = Vec::new();
    for _ in 0..10 {
        let started = Instant::now();
        assert_eq!(
            get(&gw.url(path)).await.0,
            status,
            "allow forwards while redis hangs"
        );
        latencies.push(started.elapsed());
    }
    for latency in &latencies[..3] {
        assert!(*latency < Duration::from_millis(600), "{latencies:?}");
    }
    for latency in &latencies[3..] {
        assert!(*latency < Duration::from_millis(200), "{latencies:?}");
    }
}

/// A login limit: 3 failures in 15 minutes, then an hour's lock-out.
const LOGIN_FAILURES: &str = r#"algorithm = "fixed_window"
limit = 3
window = "15m"
key = ["client_ip"]
count = "failures"
lockout = "1h""#;

/// A limit that counts failures takes its unit in the decision, and gives it back or starts
/// its lock-out after the answer; a concurrency limit takes a lease. All of these go through
/// the breaker, and feed it, so a hung Redis costs such a route what it costs a rate limit,
/// and no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_redis_costs_a_failure_counting_route_nothing_once_the_breaker_is_open() {
    // Failures, which would be counted (and lock the key out) with Redis answering.
    latencies_with_redis_hung(LOGIN_FAILURES, "/status?code=401", StatusCode::UNAUTHORIZED).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_redis_costs_a_concurrency_limit_nothing_once_the_breaker_is_open() {
    let limit = r#"algorithm = "concurrency"
limit = 2
key = ["client_ip"]"#;
    latencies_with_redis_hung(limit, "/x", StatusCode::OK).await;
}

/// [`ten_requests_while_redis_hangs`] on a route with `limit` alone.
async fn latencies_with_redis_hung(limit: &str, path: &str, status: StatusCode) {
    let redis = start_redis().await;
    let upstream = Upstream::start().await;
    let gw = gateway_with(&redis.url(), &upstream, "allow", limit).await;
    ten_requests_while_redis_hangs(&redis, &gw, path, status).await;
    redis.resume();
}

/// Requests queued behind calls that a hung Redis never answers still fail by their own
/// deadline, not a call's deadline later: one request makes the first call, 40 more a
/// second, pipelined call, and the last 10 wait for a call to come back (two are in
/// flight). Those last would wait about 590 ms if a call's deadline counted from when it
/// was sent; each request's deadline is 300 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_behind_a_hung_redis_wait_no_longer_than_their_deadline() {
    let redis = start_redis().await;
    let deadline = Duration::from_millis(300);
    let store = RedisStore::connect(&RedisTarget::Url(redis.url()), deadline)
        .await
        .expect("connect");
    let store = Arc::new(store);
    let check = LimitCheck {
        key: "fg:{198.51.100.7}:l:tb".to_owned(),
        algorithm: Algorithm::TokenBucket {
            rate: 1000.0,
            per: 1_000_000,
            burst: 1000,
        },
        lockout: None,
        cost: 1,
        keep_below: 0,
        shadow: false,
    };
    redis.pause();
    let mut requests = Vec::new();
    for wave in [1, 40, 10] {
        for _ in 0..wave {
            let (store, check) = (store.clone(), check.clone());
            requests.push(tokio::spawn(async move {
                let started = Instant::now();
                let answer = store.decide(&[check]).await;
                (started.elapsed(), answer)
            }));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for request in requests {
        let (waited, answer) = request.await.unwrap();
        // Our deadline, or the connection's response timeout (the same 300 ms from when a
        // call is sent) when that comes first.
        let timed_out = match &answer {
            Err(StoreError::Timeout(_)) => true,
            Err(StoreError::Redis(error)) => error.is_timeout(),
            _ => false,
        };
        assert!(timed_out, "{answer:?}");
        // 100 ms for a loaded machine and a debug build.
        assert!(
            waited < deadline + Duration::from_millis(100),
            "waited {waited:?}"
        );
    }
    redis.resume();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_refuses_with_503_and_readyz_follows_redis() {
    let mut redis = start_redis().await;
    let upstream = Upstream::start().await;
    let gw = gateway(&redis.url(), &upstream, "deny", 1_000_000).await;
    assert_eq!(get(&gw.admin_url("/readyz")).await.0, StatusCode::OK);

    tokio::task::block_in_place(|| redis.kill());
    for _ in 0..4 {
        let (status, headers, body) = get(&gw.url("/x")).await;
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, "Service Unavailable\n")
        );
        assert_eq!(headers["retry-after"], "1");
    }
    assert_eq!(
        upstream.requests(),
        1,
        "only the warm-up request reached the upstream"
    );
    let (status, _, body) = get(&gw.admin_url("/readyz")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "redis unavailable\n")
    );

    tokio::task::block_in_place(|| redis.restart());
    wait_until(Duration::from_secs(2), || async {
        get(&gw.admin_url("/readyz")).await.0 == StatusCode::OK
    })
    .await;
    assert_eq!(status_of(&gw).await, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_redis_without_any_traffic() {
    let mut redis = start_redis().await;
    let upstream = Upstream::start().await;
    let gw = gateway(&redis.url(), &upstream, "deny", 1_000_000).await;
    let ready = || async { get(&gw.admin_url("/readyz")).await.0 == StatusCode::OK };
    // No request from here on: only the gateway's own probe can notice.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(ready().await);

    tokio::task::block_in_place(|| redis.kill());
    let unready_after = wait_until(Duration::from_secs(2), || async { !ready().await }).await;
    tokio::task::block_in_place(|| redis.restart());
    let ready_after = wait_until(Duration::from_secs(2), ready).await;
    assert_eq!(upstream.requests(), 1, "only the warm-up request");
    eprintln!("unready after {unready_after:?}, ready again after {ready_after:?}");

    // A Redis that hangs (SIGSTOP) instead of refusing is noticed the same way.
    redis.pause();
    let unready_after = wait_until(Duration::from_secs(2), || async { !ready().await }).await;
    redis.resume();
    let ready_after = wait_until(Duration::from_secs(2), ready).await;
    eprintln!("paused: unready after {unready_after:?}, ready again after {ready_after:?}");
}

/// A Redis that answers `PING` but refuses every write (a read-only replica here; a full
/// Redis under `noeviction` is the same) cannot decide: it is failing, with or without
/// traffic, until it takes writes again, and the breaker does not close and open again
/// at each probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_refuses_writes_is_failing_until_it_takes_them() {
    let redis = start_redis().await;
    let upstream = Upstream::start().await;
    let gw = gateway(&redis.url(), &upstream, "deny", 1_000_000).await;
    let ready = || async { get(&gw.admin_url("/readyz")).await.0 == StatusCode::OK };
    let master = crate::common::closed_port().to_string();
    redis.cli(&["replicaof", "127.0.0.1", &master]);
    wait_until(Duration::from_secs(2), || async { !ready().await }).await;
    for round in 0..20 {
        if round % 2 == 0 {
            assert_eq!(status_of(&gw).await, StatusCode::SERVICE_UNAVAILABLE);
        }
        assert!(!ready().await, "ready again at round {round}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    redis.cli(&["replicaof", "no", "one"]);
    wait_until(Duration::from_secs(2), ready).await;
    assert_eq!(status_of(&gw).await, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_shares_each_limit_between_the_live_instances() {
    let mut redis = start_redis().await;
    let upstream = Upstream::start().await;
    let a = gateway(&redis.url(), &upstream, "local", 4).await;
    let b = gateway(&redis.url(), &upstream, "local", 4).await;
    // Both instances announce themselves; then each needs one more heartbeat to see two.
    wait_until(Duration::from_secs(5), || async {
        [&a, &b].iter().all(|gateway| gateway.shared.instances() == 2)
    })
    .await;

    tokio::task::block_in_place(|| redis.kill());
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(status_of(&a).await);
    }
    // A limit of 4 shared by 2 instances: 2 each, decided locally (the warm-up request
    // counted in Redis, which is gone).
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_is_survived_with_exact_counts() {
    let redis = start_redis().await;
    let upstream = Upstream::start().await;
    let gw = gateway(&redis.url(), &upstream, "deny", 30).await;
    for _ in 0..9 {
        assert_eq!(status_of(&gw).await, StatusCode::OK);
    }
    assert_eq!(redis.cli(&["script", "flush"]).trim(), "OK");
    let mut statuses = Vec::new();
    for _ in 0..30 {
        statuses.push(status_of(&gw).await);
    }
    let admitted = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    assert_eq!(admitted, 20, "exact count across the flush: {statuses:?}");
    assert_eq!(
        gw.metric(r#"floodgate_store_errors_total{store="redis"}"#).await,
        0.0
    );
}

/// With a limit never reached: a restart loses Redis's counters, and a refused client
/// would stay refused (remembered) until its window ends, as its quota says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_is_survived() {
    let mut redis = start_redis().await;
    let upstream = Upstream::start().await;
    let gw = gateway(&redis.url(), &upstream, "deny", 1_000_000).await;
    tokio::task::block_in_place(|| redis.restart());
    let recovered = wait_until(Duration::from_secs(3), || async {
        status_of(&gw).await == StatusCode::OK
    })
    .await;
    let errors = gw.metric(r#"floodgate_store_errors_total{store="redis"}"#).await;
    assert!(
        errors <= 5.0,
        "{errors} store errors around a restart (recovered in {recovered:?})"
    );
}

/// Under `on_error = "local"`, a login limit keeps counting failures while Redis is down:
/// the in-process fallback takes each attempt's unit and starts the lock-out, so a brute
/// force during an outage is locked out as it would be with Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_counts_failures_and_locks_out_while_redis_is_down() {
    let mut redis = start_redis().await;
    let upstream = Upstream::start().await;
    let gateway = gateway_with(&redis.url(), &upstream, "local", LOGIN_FAILURES).await;
    tokio::task::block_in_place(|| redis.kill());
    let guess = || async { get(&gateway.url("/status?code=401")).await.0 };
    for _ in 0..3 {
        assert_eq!(guess().await, StatusCode::UNAUTHORIZED);
    }
    let before = upstream.requests();
    let (status, headers, _) = get(&gateway.url("/status?code=401")).await;
    assert_eq!(
        status,
        StatusCode::TOO_MANY_REQUESTS,
        "locked out in the fallback"
    );
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((3590..=3600).contains(&retry), "{retry}");
    assert_eq!(
        upstream.requests(),
        before,
        "the locked-out guess was not forwarded"
    );
    // Decided in the fallback: the outage was counted.
    assert!(
        gateway
            .metric(r#"floodgate_store_errors_total{store="redis"}"#)
            .await
            >= 1.0
    );
}
