//! Routing through HTTP: first match in file order by host, path and method; `respond`
//! routes; 404; path normalization before matching, and the normalized path forwarded.

use crate::common::config::GatewayToml;
use crate::common::{TestGateway, Upstream, get, raw_request, send};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;

async fn gateway(upstream: &Upstream) -> TestGateway {
    TestGateway::start(
        GatewayToml::new()
            .upstream("app", &upstream.url(), "")
            .route(
                "admin-only-host",
                r#"host = "admin.example.com"
                path_prefix = "/"
                respond = { status = 403, body = "admin host\n" }"#,
            )
            .route(
                "wild",
                r#"host = "*.example.com"
                path_prefix = "/w/"
                upstream = "app""#,
            )
            .route(
                "health",
                r#"path = "/health"
                methods = ["GET"]
                respond = { status = 200, body = "healthy\n", content_type = "text/x-health" }"#,
            )
            .route(
                "public",
                r#"path_prefix = "/public/"
                methods = ["GET", "POST"]
                upstream = "app""#,
            ),
    )
    .await
}

fn request(url: &str, host: &str) -> Request<Full<Bytes>> {
    Request::get(url)
        .header("host", host)
        .body(Full::new(Bytes::new()))
        .unwrap()
}

#[tokio::test]
async fn routes_by_host_path_and_method_in_file_order() {
    let upstream = Upstream::start().await;
    let gw = gateway(&upstream).await;

    let (status, headers, body) = send(request(&gw.url("/public/x"), "Admin.Example.com:8080")).await;
    assert_eq!((status, body.as_str()), (StatusCode::FORBIDDEN, "admin host\n"));
    assert_eq!(headers["content-type"], "text/plain");

    let (status, _, body) = send(request(&gw.url("/w/page?q=1"), "shop.example.com")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.starts_with("GET /w/page?q=1\n"), "{body}");

    let (status, headers, body) = get(&gw.url("/health")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "healthy\n"));
    assert_eq!(headers["content-type"], "text/x-health");

    // Method not listed, path not matched, wildcard needs a subdomain: no route.
    let post = Request::post(gw.url("/health"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(send(post).await.0, StatusCode::NOT_FOUND);
    let (status, _, body) = get(&gw.url("/nowhere")).await;
    assert_eq!((status, body.as_str()), (StatusCode::NOT_FOUND, "Not Found\n"));
    assert_eq!(
        send(request(&gw.url("/w/page"), "example.com")).await.0,
        StatusCode::NOT_FOUND
    );

    assert_eq!(
        gw.metric("floodgate_requests_total{route=\"health\",status=\"200\"}")
            .await,
        1.0
    );
    assert_eq!(
        gw.metric("floodgate_requests_total{route=\"\",status=\"404\"}")
            .await,
        3.0
    );
}

#[tokio::test]
async fn paths_are_normalized_before_matching_and_forwarded_normalized() {
    let upstream = Upstream::start().await;
    let gw = gateway(&upstream).await;

    let raw = raw_request(
        gw.addr,
        b"GET /x/..//public/./%61b%2Fc?q=%2e HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    assert!(raw.contains("GET /public/ab%2Fc?q=%2e\n"), "{raw}");

    // Climbing above the root, or hiding it behind an encoded slash, is a 400 and never forwarded.
    for target in [
        "/public/../../etc/passwd",
        "/public/%2e%2e/%2e%2e/x",
        "/public/..%2f..%2fadmin",
        "/public/%zz",
    ] {
        let raw = raw_request(
            gw.addr,
            format!("GET {target} HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(raw.starts_with("HTTP/1.1 400"), "{target}: {raw}");
        assert!(raw.ends_with("Bad Request\n"), "{target}: {raw}");
        assert!(
            !raw.contains("body-bytes"),
            "{target} reached the upstream: {raw}"
        );
    }
}

/// An encoded slash is a slash to the route table, as to nginx, PHP and the frameworks
/// that decode the path before routing: `/admin%2Fx` is the `/admin/` route's, which an
/// app reading `/admin/x` would otherwise get without that route's rules. What is
/// forwarded keeps it encoded, but where a `strip_prefix` is found only by reading it as a
/// slash.
#[tokio::test]
async fn an_encoded_slash_is_a_slash_to_the_route_table() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        GatewayToml::new()
            .upstream("app", &upstream.url(), "")
            .route(
                "admin",
                r#"path_prefix = "/admin/"
                deny = ["127.0.0.0/8"]
                upstream = "app""#,
            )
            .route(
                "api",
                r#"path_prefix = "/api/"
                strip_prefix = "/api"
                upstream = "app""#,
            )
            .route("site", "path_prefix = \"/\"\nupstream = \"app\""),
    )
    .await;
    let answer = |target: &'static str| {
        let addr = gw.addr;
        async move {
            raw_request(
                addr,
                format!("GET {target} HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n").as_bytes(),
            )
            .await
        }
    };
    for walked_around in [
        "/admin%2Fx",
        "/admin%2fx",
        "/%2Fadmin/x",
        "/%2fadmin%2F%2Fx",
        "//admin%2F",
    ] {
        let raw = answer(walked_around).await;
        assert!(raw.starts_with("HTTP/1.1 403"), "{walked_around}: {raw}");
    }
    assert_eq!(upstream.requests(), 0);
    for (sent, forwarded) in [
        ("/files/a%2Fb", "/files/a%2Fb"),
        ("/api/a%2Fb", "/a%2Fb"),
        ("/api%2Fa%2Fb", "/a/b"),
        ("/adminx%2Fy", "/adminx%2Fy"),
    ] {
        let raw = answer(sent).await;
        assert!(raw.starts_with("HTTP/1.1 200"), "{sent}: {raw}");
        assert!(raw.contains(&format!("GET {forwarded}\n")), "{sent}: {raw}");
    }
}

/// The target an upstream gets: its URL's base path, the path without the route's
/// `strip_prefix`, and the query exactly as sent (an empty one included).
#[tokio::test]
async fn the_target_goes_under_the_base_path_with_the_query_as_sent() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        GatewayToml::new()
            .upstream("app", &format!("{}/base", upstream.url()), "")
            .route(
                "api",
                r#"path_prefix = "/api"
                strip_prefix = "/api"
                upstream = "app""#,
            ),
    )
    .await;
    for (sent, forwarded) in [
        ("/api/x?y=1&z=%20", "/base/x?y=1&z=%20"),
        ("/api?q", "/base/?q"),
        ("/api/x?", "/base/x?"),
        ("/api/a/./b/../%63", "/base/a/c"),
        ("/apix/y", "/base/apix/y"),
    ] {
        let raw = raw_request(
            gw.addr,
            format!("GET {sent} HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(raw.starts_with("HTTP/1.1 200"), "{sent}: {raw}");
        assert!(raw.contains(&format!("GET {forwarded}\n")), "{sent}: {raw}");
    }
}

/// PHP runs `/login.php/anything` as `login.php` (PATH_INFO): a route whose exact `path`
/// names a script takes those requests too, so its limits cannot be walked around.
#[tokio::test]
async fn an_exact_script_path_also_matches_its_path_info() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        GatewayToml::new()
            .upstream("app", &upstream.url(), "")
            .limit(
                "login",
                r#"algorithm = "fixed_window"
                limit = 1
                window = "1m""#,
            )
            .route(
                "login",
                r#"path = "/login.php"
                upstream = "app"
                limits = ["login"]"#,
            )
            .route(
                "site",
                r#"path_prefix = "/"
                upstream = "app""#,
            ),
    )
    .await;
    let status = |path: &'static str| {
        let url = gw.url(path);
        async move { get(&url).await.0 }
    };

    assert_eq!(status("/login.php").await, StatusCode::OK);
    for walked_around in [
        "/login.php/x",
        "/login.php/",
        "/login.php%2Fx",
        "/login.php%2fx",
        "//login.php/a/b",
    ] {
        assert_eq!(
            status(walked_around).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{walked_around}"
        );
    }
    // Other scripts and other files are other routes' business.
    for other in ["/login.phpx", "/login.php.bak", "/login.phps/x", "/x/login.php"] {
        assert_eq!(status(other).await, StatusCode::OK, "{other}");
    }
    assert_eq!(
        gw.metric("floodgate_requests_total{route=\"login\",status=\"429\"}")
            .await,
        5.0
    );
}
