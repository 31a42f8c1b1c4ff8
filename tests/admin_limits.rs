//! The limit-state API on the admin listener (docs/operations.md#limit-state-api): list
//! the limits, read one key's state without consuming, reset it and lift its lock-out,
//! with both stores (in Redis for every instance at once); the bearer token guards it.

use crate::common::config::GatewayToml;
use crate::common::redis_server::RedisServer;
use crate::common::{TestGateway, Upstream, get, send};
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use serde_json::Value;

const TOKEN: &str = "an-admin-token-0123456789";

fn config(upstream: &Upstream, redis: Option<&RedisServer>, token: bool) -> GatewayToml {
    let mut config = GatewayToml::new();
    if token {
        config = config.server(&format!("admin_token = \"{TOKEN}\""));
    }
    if let Some(redis) = redis {
        config = config.redis(&redis.url(), "");
    }
    config
        .upstream("app", &upstream.url(), "")
        .limit(
            "login",
            r#"algorithm = "fixed_window"
            limit = 2
            window = "1m"
            key = ["client_ip", "header:x-user"]
            lockout = "1h""#,
        )
        .route(
            "login",
            r#"path_prefix = "/"
            upstream = "app"
            limits = ["login"]"#,
        )
}

async fn admin(gw: &TestGateway, method: Method, path: &str, token: Option<&str>) -> (StatusCode, Value) {
    let mut request = Request::builder().method(method).uri(gw.admin_url(path));
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let (status, _, body) = send(request.body(Full::<Bytes>::default()).unwrap()).await;
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

async fn login(gw: &TestGateway, user: &str) -> StatusCode {
    let request = Request::get(gw.url("/login"))
        .header("x-user", user)
        .body(Full::<Bytes>::default())
        .unwrap();
    send(request).await.0
}

const ALICE: &str = "/limits/login/state?client_ip=127.0.0.1&header:x-user=alice";

#[tokio::test]
async fn without_a_token_the_api_does_not_exist_and_with_one_it_must_be_sent() {
    let upstream = Upstream::start().await;
    let closed = TestGateway::start(config(&upstream, None, false)).await;
    assert_eq!(get(&closed.admin_url("/limits")).await.0, StatusCode::NOT_FOUND);
    let open = TestGateway::start(config(&upstream, None, true)).await;
    assert_eq!(
        admin(&open, Method::GET, "/limits", None).await.0,
        StatusCode::UNAUTHORIZED
    );
    let wrong = format!("{TOKEN}x");
    assert_eq!(
        admin(&open, Method::GET, "/limits", Some(&wrong)).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        admin(&open, Method::DELETE, ALICE, Some("short")).await.0,
        StatusCode::UNAUTHORIZED
    );
    let (status, body) = admin(&open, Method::GET, "/limits", Some(TOKEN)).await;
    assert_eq!(status, StatusCode::OK);
    let limit = &body["limits"][0];
    assert_eq!(limit["name"], "login");
    assert_eq!(limit["algorithm"], "fixed_window");
    assert_eq!(limit["parameters"]["limit"], 2);
    assert_eq!(limit["key"], serde_json::json!(["client_ip", "header:x-user"]));
    assert_eq!(limit["lockout_seconds"], 3600.0);
}

#[tokio::test]
async fn bad_requests_name_the_part() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(config(&upstream, None, true)).await;
    let (status, body) = admin(
        &gw,
        Method::GET,
        "/limits/login/state?client_ip=127.0.0.1",
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body["error"].as_str().unwrap().contains("header:x-user"),
        "{body}"
    );
    let (status, body) = admin(&gw, Method::GET, &format!("{ALICE}&cookie:sid=1"), Some(TOKEN)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body["error"].as_str().unwrap().contains("cookie:sid"), "{body}");
    // A part named twice (spelled alike once decoded) names no one key: a reset must not
    // pick one of the two.
    for twice in ["header:x-user=bob", "header%3Ax-user=bob", "client_ip=127.0.0.2"] {
        for method in [Method::GET, Method::DELETE] {
            let (status, body) = admin(&gw, method.clone(), &format!("{ALICE}&{twice}"), Some(TOKEN)).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{method} {twice}: {body}");
            assert!(body["error"].as_str().unwrap().contains("twice"), "{body}");
        }
    }
    // An address that is none names no key the gateway could have made.
    for address in ["203.0.113.7:80", "nobody", ""] {
        let (status, body) = admin(
            &gw,
            Method::GET,
            &format!("/limits/login/state?client_ip={address}&header:x-user=alice"),
            Some(TOKEN),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{address:?}: {body}");
        assert!(body["error"].as_str().unwrap().contains("client_ip"), "{body}");
    }
    let (status, _) = admin(
        &gw,
        Method::GET,
        "/limits/nope/state?client_ip=1.2.3.4",
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

/// Reading consumes nothing; a lock-out shows, and DELETE lifts it (`gateways[0]` is asked,
/// every one of them sees it).
async fn read_and_lift(gateways: &[&TestGateway]) {
    let gw = gateways[0];
    let (status, state) = admin(gw, Method::GET, ALICE, Some(TOKEN)).await;
    assert_eq!(status, StatusCode::OK, "{state}");
    assert_eq!(state["remaining"], 2);
    assert_eq!(state["locked_seconds"], 0);
    assert_eq!(state["key"]["header:x-user"], "alice");
    assert_eq!(
        admin(gw, Method::GET, ALICE, Some(TOKEN)).await.1["remaining"],
        2,
        "a read consumed"
    );
    assert_eq!(login(gw, "alice").await, StatusCode::OK);
    assert_eq!(admin(gw, Method::GET, ALICE, Some(TOKEN)).await.1["remaining"], 1);
    assert_eq!(login(gw, "alice").await, StatusCode::OK);
    assert_eq!(login(gw, "alice").await, StatusCode::TOO_MANY_REQUESTS);
    let (_, state) = admin(gw, Method::GET, ALICE, Some(TOKEN)).await;
    assert_eq!(state["remaining"], 0);
    let locked = state["locked_seconds"].as_u64().unwrap();
    assert!((3590..=3600).contains(&locked), "{state}");
    // Every instance refuses her (and may remember that).
    for gw in gateways {
        assert_eq!(login(gw, "alice").await, StatusCode::TOO_MANY_REQUESTS);
    }
    // Bob, another key, is not affected.
    assert_eq!(login(gw, "bob").await, StatusCode::OK);

    let (status, _) = admin(gw, Method::DELETE, ALICE, Some(TOKEN)).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert_eq!(
        login(gw, "alice").await,
        StatusCode::OK,
        "the lock-out was not lifted"
    );
    // The other instances may have remembered the refusal: for a second at most.
    for other in &gateways[1..] {
        let started = std::time::Instant::now();
        while login(other, "alice").await != StatusCode::OK {
            assert!(
                started.elapsed() < std::time::Duration::from_millis(1500),
                "another instance still refuses"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    let (_, state) = admin(gw, Method::GET, ALICE, Some(TOKEN)).await;
    assert_eq!(state["locked_seconds"], 0);
}

#[tokio::test]
async fn the_in_process_store_reads_and_lifts_a_lock_out() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(config(&upstream, None, true)).await;
    read_and_lift(&[&gw]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lifts_a_lock_out_for_every_instance() {
    let redis = tokio::task::spawn_blocking(RedisServer::start).await.unwrap();
    let upstream = Upstream::start().await;
    let first = TestGateway::start(config(&upstream, Some(&redis), true)).await;
    let second = TestGateway::start(config(&upstream, Some(&redis), true)).await;
    read_and_lift(&[&first, &second]).await;
}

#[tokio::test]
async fn a_key_with_an_override_reads_with_its_parameters_and_the_scheme_is_case_insensitive() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        GatewayToml::new()
            .server(&format!("admin_token = \"{TOKEN}\""))
            .upstream("app", &upstream.url(), "")
            .limit(
                "api",
                r#"algorithm = "token_bucket"
                rate = 1
                per = "1h"
                burst = 2
                key = ["header:x-key"]
                overrides = [{ key = ["gold"], burst = 5 }, { key = ["free"], exempt = true }]"#,
            )
            .route(
                "api",
                r#"path_prefix = "/"
                upstream = "app"
                limits = ["api"]"#,
            ),
    )
    .await;
    let read = |key: &str| format!("/limits/api/state?header:x-key={key}");
    assert_eq!(
        admin(&gw, Method::GET, &read("plain"), Some(TOKEN)).await.1["remaining"],
        2
    );
    assert_eq!(
        admin(&gw, Method::GET, &read("gold"), Some(TOKEN)).await.1["remaining"],
        5
    );
    assert_eq!(
        admin(&gw, Method::GET, &read("free"), Some(TOKEN)).await.1["exempt"],
        true
    );
    // Reset, an exempt key is cleared of what it held under the limit's own parameters.
    assert_eq!(
        admin(&gw, Method::DELETE, &read("free"), Some(TOKEN)).await.0,
        StatusCode::NO_CONTENT
    );
    let request = Request::get(gw.admin_url("/limits"))
        .header("authorization", format!("bearer {TOKEN}"))
        .body(Full::<Bytes>::default())
        .unwrap();
    assert_eq!(send(request).await.0, StatusCode::OK);
}

/// With two `Authorization` headers it is unknown which one a proxy in front checked or
/// logged: neither is trusted.
#[tokio::test]
async fn two_authorization_headers_are_refused() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(config(&upstream, None, true)).await;
    let good = format!("Bearer {TOKEN}");
    for (first, second) in [
        (good.as_str(), "Bearer wrong"),
        ("Bearer wrong", good.as_str()),
        (good.as_str(), good.as_str()),
    ] {
        let request = Request::get(gw.admin_url("/limits"))
            .header("authorization", first)
            .header("authorization", second)
            .body(Full::<Bytes>::default())
            .unwrap();
        let (status, _, body) = send(request).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{first} then {second}: {body}");
        assert!(body.contains("Authorization"), "{body}");
    }
}

/// HEAD is answered wherever GET is, with GET's status and headers and no body.
#[tokio::test]
async fn head_answers_as_get_without_a_body() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(config(&upstream, None, true)).await;
    for (path, token) in [
        ("/limits", Some(TOKEN)),
        ("/limits", None),
        (ALICE, Some(TOKEN)),
        ("/limits/login/state?client_ip=127.0.0.1", Some(TOKEN)),
        ("/limits/nope/state?client_ip=127.0.0.1", Some(TOKEN)),
        ("/healthz", None),
        ("/readyz", None),
        ("/metrics", None),
        ("/nothing-here", None),
    ] {
        let answer = |method: Method| {
            let mut request = Request::builder().method(method).uri(gw.admin_url(path));
            if let Some(token) = token {
                request = request.header("authorization", format!("Bearer {token}"));
            }
            send(request.body(Full::<Bytes>::default()).unwrap())
        };
        let (get_status, mut get_headers, get_body) = answer(Method::GET).await;
        let (head_status, mut head_headers, head_body) = answer(Method::HEAD).await;
        assert_eq!(head_status, get_status, "{path}: {get_body}");
        assert!(!get_body.is_empty(), "{path}");
        assert_eq!(head_body, "", "{path}");
        for headers in [&mut get_headers, &mut head_headers] {
            headers.remove("date");
            if path == "/metrics" {
                // The scrape itself changes the numbers, and so their length.
                headers.remove("content-length");
            }
        }
        assert_eq!(head_headers, get_headers, "{path}");
    }
}

/// A `path` or `host` is read as a request's would be (the path normalized, an encoded
/// slash a slash; the host in lower case without port), so that the state asked for is
/// the one those requests made; one no request can have is a 400.
#[tokio::test]
async fn a_path_and_host_are_read_as_a_requests_are() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        GatewayToml::new()
            .server(&format!("admin_token = \"{TOKEN}\""))
            .upstream("app", &upstream.url(), "")
            .limit(
                "pages",
                r#"algorithm = "fixed_window"
                limit = 5
                window = "1m"
                key = ["path", "host"]"#,
            )
            .route(
                "pages",
                r#"path_prefix = "/"
                upstream = "app"
                limits = ["pages"]"#,
            ),
    )
    .await;
    let request = Request::get(gw.url("/docs%2Fa"))
        .header("host", "shop.test")
        .body(Full::<Bytes>::default())
        .unwrap();
    assert_eq!(send(request).await.0, StatusCode::OK);
    for asked in [
        "/limits/pages/state?path=/docs/a&host=shop.test",
        "/limits/pages/state?path=/docs%252Fa&host=Shop.Test:8080",
        "/limits/pages/state?path=/docs//x/../a&host=shop.test.",
    ] {
        let (status, body) = admin(&gw, Method::GET, asked, Some(TOKEN)).await;
        assert_eq!(status, StatusCode::OK, "{asked}: {body}");
        assert_eq!(body["remaining"], 4, "{asked}: {body}");
        assert_eq!(body["key"]["path"], "/docs/a", "{asked}: {body}");
        assert_eq!(body["key"]["host"], "shop.test", "{asked}: {body}");
    }
    for bad in [
        "/limits/pages/state?path=docs&host=shop.test",
        "/limits/pages/state?path=/..&host=shop.test",
        "/limits/pages/state?path=/a&host=",
    ] {
        let (status, body) = admin(&gw, Method::GET, bad, Some(TOKEN)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
    }
}
