//! Per-request pieces of the request path: route lookup, path normalization, key tuple
//! encoding and rate-limit header rendering.
//!
//! `cargo bench --bench request_path`

use std::path::Path;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use floodgate::Config;
use floodgate::config::RateLimitHeaders;
use floodgate::host::normalize_host;
use floodgate::limit::key::{encode_tuple, store_key};
use floodgate::limit::{LimitDecision, Outcome};
use floodgate::path::normalize_path;
use floodgate::router::Router;
use floodgate::service::limit_headers::{Described, LimitHeaders, policy_value, render};
use floodgate::service::request_key::{KeySource, key_tuple};
use http::{HeaderMap, HeaderValue, Method};

const CONFIG: &str = r#"
[upstreams.app]
url = "http://127.0.0.1:9000"

[limits.per_ip_minute]
algorithm = "fixed_window"
limit = 600
window = "1m"

[limits.search_burst]
algorithm = "token_bucket"
rate = 10
burst = 20
key = ["header:x-api-key", "method"]

[[routes]]
name = "admin"
host = "admin.example.com"
upstream = "app"

[[routes]]
name = "static"
path_prefix = "/static/"
methods = ["GET", "HEAD"]
upstream = "app"

[[routes]]
name = "search"
path_prefix = "/api/search"
upstream = "app"
limits = ["per_ip_minute", "search_burst"]

[[routes]]
name = "app"
upstream = "app"
limits = ["per_ip_minute"]
"#;

fn request_pieces(c: &mut Criterion) {
    let config = Config::parse(Path::new("bench.toml"), CONFIG).expect("valid");
    let router = Router::new(config.routes.clone());
    let mut group = c.benchmark_group("request_path");
    group.measurement_time(Duration::from_secs(3));

    group.bench_function("route_lookup", |b| {
        b.iter(|| {
            let host = normalize_host("api.example.com:8080");
            router.lookup(host.as_deref(), "/api/search/items", &Method::GET)
        })
    });
    group.bench_function("normalize_clean_path", |b| {
        b.iter(|| normalize_path("/api/search/items"))
    });
    group.bench_function("normalize_dirty_path", |b| {
        b.iter(|| normalize_path("/api//search/./x/../items%2Dall"))
    });

    let mut headers = HeaderMap::new();
    headers.insert("x-api-key", HeaderValue::from_static("k-1234567890"));
    let search = &config.limits["search_burst"];
    let search_algorithm = search.rate().expect("a rate limit").algorithm;
    group.bench_function("key_tuple_and_store_key", |b| {
        b.iter(|| {
            let source = KeySource {
                client_ip: "198.51.100.7",
                headers: &headers,
                query: None,
                method: &Method::GET,
                path: "/api/search/items",
                host: Some("api.example.com"),
                route: "search",
            };
            let tuple = key_tuple(&search.key, &source).expect("one key");
            store_key("floodgate", &tuple, &search.name, &search_algorithm)
        })
    });
    group.bench_function("encode_long_tuple", |b| {
        let long = "x".repeat(500);
        b.iter(|| encode_tuple([long.as_bytes()]))
    });

    let described = |name: &str| {
        let limit = &config.limits[name];
        Described {
            name: &limit.name,
            algorithm: &limit.rate().expect("a rate limit").algorithm,
        }
    };
    let limits = [described("per_ip_minute"), described("search_burst")];
    let policy = policy_value(limits);
    let decision = |remaining| LimitDecision {
        outcome: Outcome::Allowed,
        remaining,
        reset: Duration::from_millis(41_200),
        retry_after: Duration::ZERO,
    };
    let decided = [(limits[0], decision(599)), (limits[1], decision(19))];
    for (name, mode) in [
        ("render_ietf", RateLimitHeaders::Ietf),
        ("render_legacy", RateLimitHeaders::Legacy),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| {
                let mut out = LimitHeaders::new();
                render(mode, policy.as_ref(), &decided, true, &mut out);
                out
            })
        });
    }
    group.finish();
}

criterion_group!(benches, request_pieces);
criterion_main!(benches);
