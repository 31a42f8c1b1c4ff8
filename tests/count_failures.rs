//! Limits that count failures (docs/configuration.md#limitsnamecount): a request passes
//! without consuming while its key has room; a response with a failure status consumes;
//! the failure that takes the last of the room starts the lock-out, and from then on the
//! key is refused before anything is forwarded. Both stores.

mod common;

use common::redis_server::RedisServer;
use common::{TestGateway, Upstream, get};
use http::StatusCode;

fn config(upstream: &Upstream, redis: Option<&RedisServer>) -> String {
    format!(
        r#"[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
{redis}
[upstreams.app]
url = "{}"

[limits.login_failures]
algorithm = "fixed_window"
limit = 3
window = "15m"
key = ["client_ip"]
count = "failures"
lockout = "1h"

[[routes]]
name = "login"
path_prefix = "/"
upstream = "app"
limits = ["login_failures"]
"#,
        upstream.url(),
        redis = redis.map_or(String::new(), |r| format!("[redis]\nurl = \"{}\"\n", r.url())),
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
    let gw = TestGateway::start(&config(&upstream, None)).await;
    scenario(&gw, &upstream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_and_lock_out_in_redis() {
    let redis = tokio::task::spawn_blocking(RedisServer::start).await.unwrap();
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, Some(&redis))).await;
    scenario(&gw, &upstream).await;
}
