//! `algorithm = "concurrency"` (docs/configuration.md#limitsnamealgorithm): at most
//! `limit` requests of one key in flight; a request over it is refused at once (its
//! status, `Retry-After: 1`, no RateLimit items); slots come back when responses end or
//! fail. In Redis the limit is shared by every instance, and a killed instance's slots
//! come back after `lease`.

use std::time::{Duration, Instant};

use crate::common::config::GatewayToml;
use crate::common::process::FloodgateProcess;
use crate::common::redis_server::RedisServer;
use crate::common::{TestGateway, Upstream, closed_port, get, spawn_get, until};
use http::StatusCode;

fn config(upstream_url: &str, redis: Option<&str>, lease: &str) -> GatewayToml {
    let mut config = GatewayToml::new();
    if let Some(url) = redis {
        config = config.redis(url, "");
    }
    config
        .upstream("app", upstream_url, "")
        .limit(
            "inflight",
            &format!(
                r#"algorithm = "concurrency"
                limit = 2
                key = ["client_ip"]
                {lease}"#
            ),
        )
        .route(
            "app",
            r#"path_prefix = "/"
            upstream = "app"
            limits = ["inflight"]"#,
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_third_request_in_flight_is_refused_at_once_and_slots_come_back() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(config(&upstream.url(), None, "")).await;
    let holding: Vec<_> = (0..2)
        .map(|i| spawn_get(gw.url(&format!("/h{i}/slow?ms=600"))))
        .collect();
    until("two in flight", Duration::from_secs(2), || {
        upstream.requests() == 2
    })
    .await;
    let (status, headers, _) = get(&gw.url("/third")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        holding.iter().all(|request| !request.is_finished()),
        "refused only after waiting for a slot"
    );
    assert_eq!(headers["retry-after"], "1");
    assert!(!headers.contains_key("ratelimit") && !headers.contains_key("ratelimit-policy"));
    for request in holding {
        assert_eq!(request.await.unwrap().0, StatusCode::OK);
    }
    assert_eq!(get(&gw.url("/after")).await.0, StatusCode::OK);
    assert_eq!(upstream.most_in_flight(), 2);
    assert_eq!(upstream.requests(), 3);
}

#[tokio::test]
async fn a_failed_request_gives_its_slot_back() {
    let gw = TestGateway::start(config(&format!("http://127.0.0.1:{}", closed_port()), None, "")).await;
    for _ in 0..5 {
        assert_eq!(get(&gw.url("/")).await.0, StatusCode::BAD_GATEWAY);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_redis_share_the_slots() {
    let redis = tokio::task::spawn_blocking(RedisServer::start).await.unwrap();
    let upstream = Upstream::start().await;
    let a = TestGateway::start(config(&upstream.url(), Some(&redis.url()), "")).await;
    let b = TestGateway::start(config(&upstream.url(), Some(&redis.url()), "")).await;
    let first = spawn_get(a.url("/a1/slow?ms=800"));
    let second = spawn_get(b.url("/b1/slow?ms=800"));
    until("two in flight", Duration::from_secs(2), || {
        upstream.requests() == 2
    })
    .await;
    assert_eq!(get(&a.url("/a2")).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(get(&b.url("/b2")).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
    assert_eq!(second.await.unwrap().0, StatusCode::OK);
    // Given back (in the background): admitted again shortly.
    let started = Instant::now();
    while get(&b.url("/b3")).await.0 != StatusCode::OK {
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the slots never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(upstream.most_in_flight(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slots_of_a_killed_instance_come_back_after_the_lease() {
    let redis = tokio::task::spawn_blocking(RedisServer::start).await.unwrap();
    let upstream = Upstream::start().await;
    // `deny`: a store call that misses its deadline on a loaded machine must not pass for
    // a slot come back (`allow` would forward it).
    let text = config(&upstream.url(), Some(&redis.url()), "lease = \"3s\"")
        .to_string()
        .replace("[redis]\n", "[redis]\non_error = \"deny\"\n");
    assert!(text.contains("on_error"));
    let doomed = tokio::task::spawn_blocking({
        let text = text.clone();
        move || FloodgateProcess::start(&text, &[])
    })
    .await
    .unwrap();
    let survivor = TestGateway::start(&text).await;
    // The doomed instance holds both slots with requests that would run for a minute.
    let held: Vec<_> = (0..2)
        .map(|i| spawn_get(doomed.url(&format!("/held{i}/slow?ms=60000"))))
        .collect();
    until("two in flight", Duration::from_secs(3), || {
        upstream.requests() == 2
    })
    .await;
    assert_eq!(
        get(&survivor.url("/refused")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Renewed while it lives: still refused after more than a lease.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(
        get(&survivor.url("/still")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    let killed = Instant::now();
    doomed.signal(libc::SIGKILL);
    while get(&survivor.url("/back")).await.0 != StatusCode::OK {
        assert!(
            killed.elapsed() < Duration::from_secs(6),
            "the killed instance's slots never came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        killed.elapsed() >= Duration::from_secs(1),
        "the slots came back before the lease could end"
    );
    for request in held {
        request.abort();
    }
}
