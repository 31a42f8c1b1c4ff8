//! Limit overrides, tiers per key (docs/configuration.md#limitsnameoverrides): listed key
//! values get other parameters, or no limit; a CIDR matches client addresses; the first
//! entry that matches wins; the RateLimit headers report the override's quota.

use crate::common::config::GatewayToml;
use crate::common::{TestGateway, Upstream, send};
use bytes::Bytes;
use http::Request;
use http_body_util::Full;

async fn gateway(upstream: &Upstream) -> TestGateway {
    TestGateway::start(
        GatewayToml::new()
            .upstream("app", &upstream.url(), "")
            .limit(
                "api",
                r#"algorithm = "token_bucket"
                rate = 1
                per = "1h"
                burst = 2
                key = ["header:x-api-key"]
                overrides = [
                  { key = ["gold-7f3a"], burst = 5 },
                  { key = ["internal-batch"], exempt = true },
                  { key = ["gold-7f3a"], burst = 100 },
                ]"#,
            )
            .limit(
                "office",
                r#"algorithm = "fixed_window"
                limit = 1
                window = "1h"
                key = ["client_ip"]
                overrides = [{ key = ["127.0.0.0/8"], limit = 3 }]"#,
            )
            .route(
                "api",
                r#"path = "/api"
                upstream = "app"
                limits = ["api"]"#,
            )
            .route(
                "office",
                r#"path = "/office"
                upstream = "app"
                limits = ["office"]"#,
            ),
    )
    .await
}

/// The statuses of `n` requests to `path` with `X-Api-Key: key`, and the last
/// `RateLimit-Policy`.
async fn statuses(gw: &TestGateway, path: &str, key: &str, n: usize) -> (Vec<u16>, String) {
    let mut seen = Vec::new();
    let mut policy = String::new();
    for _ in 0..n {
        let request = Request::get(gw.url(path))
            .header("x-api-key", key)
            .body(Full::<Bytes>::default())
            .unwrap();
        let (status, headers, _) = send(request).await;
        seen.push(status.as_u16());
        policy = headers
            .get("ratelimit-policy")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
    }
    (seen, policy)
}

#[tokio::test]
async fn listed_keys_get_their_own_parameters_or_none() {
    let upstream = Upstream::start().await;
    let gw = gateway(&upstream).await;
    let (seen, policy) = statuses(&gw, "/api", "plain", 3).await;
    assert_eq!(seen, [200, 200, 429]);
    assert!(policy.starts_with("\"api\";q=2;"), "{policy}");
    // The first matching entry wins: 5, not 100.
    let (seen, policy) = statuses(&gw, "/api", "gold-7f3a", 6).await;
    assert_eq!(seen, [200, 200, 200, 200, 200, 429]);
    assert!(policy.starts_with("\"api\";q=5;"), "{policy}");
    let (seen, policy) = statuses(&gw, "/api", "internal-batch", 20).await;
    assert!(seen.iter().all(|&s| s == 200), "{seen:?}");
    assert_eq!(policy, "", "an exempt key gets no RateLimit items");
    // A value is matched exactly.
    let (seen, _) = statuses(&gw, "/api", "gold-7f3A", 3).await;
    assert_eq!(seen, [200, 200, 429]);
}

#[tokio::test]
async fn a_cidr_matches_client_addresses() {
    let upstream = Upstream::start().await;
    let gw = gateway(&upstream).await;
    let (seen, policy) = statuses(&gw, "/office", "", 4).await;
    assert_eq!(seen, [200, 200, 200, 429]);
    assert!(policy.starts_with("\"office\";q=3;"), "{policy}");
}
