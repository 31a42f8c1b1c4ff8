//! Shaping requests and responses (docs/configuration.md#header-rules): `strip_prefix`,
//! request and response header rules (on upstream responses and floodgate's own),
//! `respond` headers and redirects, `[server.errors]` bodies (inline and from a file,
//! re-read on reload), a limit's `content_type`, and the configurations refused at load.

use std::sync::Arc;

use crate::common::config::{GatewayToml, write_config};
use crate::common::{TestGateway, Upstream, closed_port, get, header_lines, raw_request, send};
use bytes::Bytes;
use floodgate::Config;
use floodgate::reload::Reloader;
use http::{Request, StatusCode};
use http_body_util::Full;

fn config(upstream: &Upstream, dead_port: u16) -> GatewayToml {
    GatewayToml::new()
        .table(
            "server.errors",
            r#"404 = { body = "<h1>Not found</h1>\n", content_type = "text/html" }
            502 = { body_file = "errors/502.html", content_type = "text/html; charset=utf-8" }"#,
        )
        .upstream("app", &upstream.url(), "")
        .upstream("gone", &format!("http://127.0.0.1:{dead_port}"), "")
        .limit(
            "two",
            r#"algorithm = "fixed_window"
            limit = 2
            window = "1m"
            message = "{\"error\": \"slow down\"}"
            content_type = "application/json""#,
        )
        .route(
            "api",
            r#"path_prefix = "/api/"
            strip_prefix = "/api"
            upstream = "app"
            limits = ["two"]
            request_headers = { set = { "X-Gateway" = "floodgate" }, remove = ["X-Debug"] }
            response_headers = { set = { "X-Frame-Options" = "DENY" }, remove = ["X-Powered-By", "Server"] }"#,
        )
        .route(
            "old_blog",
            r#"path_prefix = "/blog"
            respond = { status = 301, headers = { "Location" = "https://blog.example.com/" } }
            response_headers = { set = { "X-Frame-Options" = "DENY" } }"#,
        )
        .route(
            "moved",
            r#"path_prefix = "/moved/"
            respond = { status = 308, headers = { "Location" = "https://${host}/new$request_uri", "X-Price" = "$$5" } }"#,
        )
        .route(
            "same_host",
            r#"path_prefix = "/evil.example/"
            respond = { status = 301, headers = { "Location" = "https://$host$request_uri" } }"#,
        )
        .route(
            "gone",
            r#"path = "/gone"
            upstream = "gone"
            response_headers = { set = { "X-Frame-Options" = "DENY" } }"#,
        )
}

async fn gateway(dir: &std::path::Path, upstream: &Upstream) -> (TestGateway, Arc<Reloader>) {
    std::fs::create_dir_all(dir.join("errors")).unwrap();
    std::fs::write(dir.join("errors/502.html"), "<h1>Upstream down</h1>\n").unwrap();
    let path = write_config(dir, config(upstream, closed_port()));
    let gw = TestGateway::start_config(Config::load(&path).unwrap()).await;
    let reloader = Arc::new(Reloader::new(
        gw.shared.clone(),
        Box::new(move || Config::load(&path)),
    ));
    (gw, reloader)
}

#[tokio::test]
async fn the_prefix_is_stripped_and_request_and_response_rules_apply() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let (gw, _) = gateway(dir.path(), &upstream).await;
    let request = Request::get(gw.url("/api/users?page=2"))
        .header("x-debug", "1")
        .header("x-gateway", "spoofed")
        .body(Full::<Bytes>::default())
        .unwrap();
    let (status, headers, body) = send(request).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.starts_with("GET /users?page=2\n"), "{body}");
    assert_eq!(header_lines(&body, "x-gateway"), ["floodgate"]);
    assert!(header_lines(&body, "x-debug").is_empty(), "{body}");
    assert_eq!(headers["x-frame-options"], "DENY");
    // CGI and PHP read `X_Debug` as `X-Debug`: the underscore spellings of what the rules
    // set or remove do not pass either.
    let request = Request::get(gw.url("/api/users"))
        .header("x_debug", "1")
        .header("X_Gateway", "spoofed")
        .header("x_other", "kept")
        .body(Full::<Bytes>::default())
        .unwrap();
    let (_, _, body) = send(request).await;
    assert!(header_lines(&body, "x_debug").is_empty(), "{body}");
    assert!(header_lines(&body, "x_gateway").is_empty(), "{body}");
    assert_eq!(header_lines(&body, "x-gateway"), ["floodgate"]);
    // Nor does any other name PHP would fold (server.drop_invalid_headers).
    assert!(header_lines(&body, "x_other").is_empty(), "{body}");
    // The app's own headers are hidden.
    let (_, headers, _) = get(&gw.url("/api/powered")).await;
    assert!(
        !headers.contains_key("x-powered-by") && !headers.contains_key("server"),
        "{headers:?}"
    );
    assert_eq!(headers["x-frame-options"], "DENY");
}

#[tokio::test]
async fn rules_apply_to_floodgates_own_answers_which_keep_their_limit_headers() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let (gw, _) = gateway(dir.path(), &upstream).await;
    assert_eq!(get(&gw.url("/api/a")).await.0, StatusCode::OK);
    assert_eq!(get(&gw.url("/api/b")).await.0, StatusCode::OK);
    let (status, headers, body) = get(&gw.url("/api/c")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(body, "{\"error\": \"slow down\"}");
    assert_eq!(headers["x-frame-options"], "DENY");
    assert!(headers.contains_key("retry-after") && headers.contains_key("ratelimit"));
    // A redirect served by floodgate.
    let (status, headers, _) = get(&gw.url("/blog/2019/post")).await;
    assert_eq!(status, StatusCode::MOVED_PERMANENTLY);
    assert_eq!(headers["location"], "https://blog.example.com/");
    assert_eq!(headers["x-frame-options"], "DENY");
}

#[tokio::test]
async fn a_redirect_carries_the_requests_host_and_target_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let (gw, _) = gateway(dir.path(), &upstream).await;
    let request = Request::get(gw.url("/moved/a/b?page=2&q=x%20y"))
        .header("host", "Shop.Example.COM:8080")
        .body(Full::<Bytes>::default())
        .unwrap();
    let (status, headers, _) = send(request).await;
    assert_eq!(status, StatusCode::PERMANENT_REDIRECT);
    assert_eq!(
        headers["location"],
        "https://shop.example.com/new/moved/a/b?page=2&q=x%20y"
    );
    assert_eq!(headers["x-price"], "$5");
    // Encoded line breaks stay encoded: nothing the client sends becomes a header of its own.
    let answer = raw_request(
        gw.addr,
        b"GET /moved/x%0d%0aSet-Cookie:%20a=b HTTP/1.1\r\nHost: shop.example.com\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 308"), "{answer}");
    assert!(
        answer.contains("\r\nlocation: https://shop.example.com/new/moved/x%0d%0aSet-Cookie:%20a=b\r\n"),
        "{answer}"
    );
    assert!(
        !answer.to_ascii_lowercase().contains("\r\nset-cookie"),
        "{answer}"
    );
    // Without a Host there is no `$host` to answer with.
    let answer = raw_request(gw.addr, b"GET /moved/z HTTP/1.0\r\n\r\n").await;
    assert!(answer.contains(" 400 "), "{answer}");
    // An absolute-form target gives its path and query, not its scheme and authority.
    let answer = raw_request(
        gw.addr,
        b"GET http://shop.example.com/moved/y?z=1 HTTP/1.1\r\nHost: shop.example.com\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(
        answer.contains("\r\nlocation: https://shop.example.com/new/moved/y?z=1\r\n"),
        "{answer}"
    );
}

/// A target that starts with `//` reads as an authority after nothing or a bare scheme;
/// after `https://$host` it is a path on the request's own host.
#[tokio::test]
async fn a_target_like_an_authority_redirects_to_the_requests_own_host() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let (gw, _) = gateway(dir.path(), &upstream).await;
    let answer = raw_request(
        gw.addr,
        b"GET //evil.example/x HTTP/1.1\r\nHost: shop.example.com\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 301"), "{answer}");
    assert!(
        answer.contains("\r\nlocation: https://shop.example.com//evil.example/x\r\n"),
        "{answer}"
    );
}

/// A `respond` value in which `$request_uri` could be read as the authority of the
/// `Location`: a request for `//evil.example/x` would send the client there.
#[test]
fn a_respond_value_that_lets_the_target_choose_the_host_is_refused_at_load() {
    let respond = |location: &str| {
        format!(
            "[[routes]]\nname = \"r\"\npath = \"/\"\nrespond = {{ status = 301, headers = {{ \"Location\" = {location} }} }}\n"
        )
    };
    let refused = [
        r#""$request_uri""#,
        r#""${request_uri}""#,
        r#""/$request_uri""#,
        r#""//$request_uri""#,
        r#""/\\$request_uri""#,
        r#""\\$request_uri""#,
        r#""https:$request_uri""#,
        r#""https:/$request_uri""#,
        r#""https://$request_uri""#,
        r#""https:///$request_uri""#,
        r#"" $request_uri""#,
        r#""\t/x$request_uri""#,
        r#""https:// $host$request_uri""#,
        r#""x$request_uri""#,
        r#""$host$request_uri""#,
    ];
    let mut loaded_anyway = Vec::new();
    for location in refused {
        let Err(errors) = Config::parse(std::path::Path::new("gw.toml"), &respond(location)) else {
            loaded_anyway.push(location);
            continue;
        };
        let errors = errors.to_string();
        assert!(
            errors.starts_with("gw.toml:4:")
                && errors.contains(": routes[0].respond.headers.Location: ")
                && errors.contains("$request_uri"),
            "{location}: {errors}"
        );
    }
    assert!(loaded_anyway.is_empty(), "loaded: {loaded_anyway:?}");
    let loaded = [
        r#""https://$host$request_uri""#,
        r#""https://${host}/new$request_uri""#,
        r#""https://example.com:8443$request_uri""#,
        r#""https://login.example.com/?next=$request_uri""#,
        r#""/blog$request_uri""#,
        r#""/$host$request_uri""#,
        r#""https://$host""#,
    ];
    for location in loaded {
        let text = respond(location);
        if let Err(errors) = Config::parse(std::path::Path::new("gw.toml"), &text) {
            panic!("{location}: {errors}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_bodies_come_from_the_configuration_and_a_reload_rereads_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let (gw, reloader) = gateway(dir.path(), &upstream).await;
    let (status, headers, body) = get(&gw.url("/nowhere")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::NOT_FOUND, "<h1>Not found</h1>\n")
    );
    assert_eq!(headers["content-type"], "text/html");
    let (status, headers, body) = get(&gw.url("/gone")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::BAD_GATEWAY, "<h1>Upstream down</h1>\n")
    );
    assert_eq!(headers["content-type"], "text/html; charset=utf-8");
    assert_eq!(
        headers["x-frame-options"], "DENY",
        "an error keeps the route's rules"
    );
    // Statuses without a configured body keep the one-line text.
    let (status, _, body) = send(
        Request::get(gw.url("/api/x"))
            .header("host", "a")
            .header("host", "b")
            .body(Full::<Bytes>::default())
            .unwrap(),
    )
    .await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::BAD_REQUEST, "Bad Request\n")
    );

    std::fs::write(dir.path().join("errors/502.html"), "<h1>Back soon</h1>\n").unwrap();
    assert!(
        tokio::task::spawn_blocking(move || reloader.reload("test"))
            .await
            .unwrap()
    );
    assert_eq!(get(&gw.url("/gone")).await.2, "<h1>Back soon</h1>\n");
}

#[test]
fn configurations_that_would_break_a_message_are_refused_naming_the_header() {
    let route = |extra: &str| {
        format!(
            "[upstreams.app]\nurl = \"http://a:1\"\n\n[[routes]]\nname = \"r\"\npath_prefix = \"/api/\"\nupstream = \"app\"\n{extra}\n"
        )
    };
    let cases = [
        (
            route("request_headers = { set = { \"Host\" = \"x\" } }"),
            "routes[0].request_headers.set.Host",
            "host cannot be set",
        ),
        (
            route("request_headers = { remove = [\"X-Forwarded-For\"] }"),
            "routes[0].request_headers.remove[0]",
            "x-forwarded-for cannot be removed",
        ),
        (
            route("request_headers = { set = { \"Content-Length\" = \"1\" } }"),
            "routes[0].request_headers.set.Content-Length",
            "content-length",
        ),
        (
            route("response_headers = { remove = [\"Retry-After\"] }"),
            "routes[0].response_headers.remove[0]",
            "retry-after cannot be removed",
        ),
        (
            route("response_headers = { remove = [\"RateLimit\"] }"),
            "routes[0].response_headers.remove[0]",
            "ratelimit cannot be removed",
        ),
        (
            route("response_headers = { set = { \"Transfer-Encoding\" = \"chunked\" } }"),
            "routes[0].response_headers.set.Transfer-Encoding",
            "frames the message",
        ),
        (
            route("strip_prefix = \"/other\""),
            "routes[0].strip_prefix",
            "prefix of the route's path",
        ),
        (
            route("strip_prefix = \"/ap\""),
            "routes[0].strip_prefix",
            "whole segments",
        ),
        (
            "[[routes]]\nname = \"r\"\npath_prefix = \"/x/\"\nstrip_prefix = \"/x\"\nrespond = {}\n".to_owned(),
            "routes[0].strip_prefix",
            "only to a route with an upstream",
        ),
        (
            "[[routes]]\nname = \"r\"\npath = \"/\"\nrespond = { headers = { \"Content-Type\" = \"text/html\" } }\n"
                .to_owned(),
            "routes[0].respond.headers.Content-Type",
            "content_type",
        ),
        (
            "[[routes]]\nname = \"r\"\npath = \"/\"\nrespond = { status = 302 }\n".to_owned(),
            "routes[0].respond.headers",
            "Location",
        ),
        (
            "[[routes]]\nname = \"r\"\npath = \"/\"\nrespond = { status = 301, headers = { \"Location\" = \"https://$hots/\" } }\n".to_owned(),
            "routes[0].respond.headers.Location",
            "unknown variable $hots",
        ),
        (
            "[[routes]]\nname = \"r\"\npath = \"/\"\nrespond = { status = 301, headers = { \"Location\" = \"https://${host/\" } }\n".to_owned(),
            "routes[0].respond.headers.Location",
            "without its",
        ),
        (
            "[server]\nresponse_headers = { remove = [\"Retry-After\"] }\n".to_owned(),
            "server.response_headers.remove[0]",
            "retry-after cannot be removed",
        ),
        (
            "[server]\nrequest_headers = { set = { \"X-Real-IP\" = \"1.2.3.4\" } }\n".to_owned(),
            "server.request_headers.set.X-Real-IP",
            "x-real-ip cannot be set",
        ),
        (
            route("request_headers = { set = { \"X-Request-Id\" = \"forced\" } }"),
            "routes[0].request_headers.set.X-Request-Id",
            "x-request-id cannot be set: it carries the request ID",
        ),
        (
            route("response_headers = { remove = [\"x-request-id\"] }"),
            "routes[0].response_headers.remove[0]",
            "x-request-id cannot be removed: it carries the request ID",
        ),
        (
            "[server]\nrequest_id = \"Correlation-Id\"\nrequest_headers = { remove = [\"Correlation-Id\"] }\n"
                .to_owned(),
            "server.request_headers.remove[0]",
            "correlation-id cannot be removed: it carries the request ID",
        ),
        (
            "[[routes]]\nname = \"r\"\npath = \"/\"\nrespond = { headers = { \"X-Request-Id\" = \"x\" } }\n".to_owned(),
            "routes[0].respond.headers.X-Request-Id",
            "x-request-id cannot be set: it carries the request ID",
        ),
        (
            "[server.errors]\n418 = { body = \"teapot\" }\n".to_owned(),
            "server.errors.418",
            "expected one of",
        ),
        (
            "[server.errors]\n502 = { body_file = \"missing.html\" }\n".to_owned(),
            "server.errors.502.body_file",
            "missing.html",
        ),
    ];
    for (text, key, needle) in cases {
        let errors = Config::parse(std::path::Path::new("gw.toml"), &text)
            .unwrap_err()
            .errors;
        assert!(
            errors
                .iter()
                .any(|e| e.key == key && e.message.contains(needle) && e.position.is_some()),
            "{text}: {errors:?}"
        );
    }
    // Without request IDs the header is the app's to set.
    let without_ids = format!(
        "[server]\nrequest_id = \"\"\n\n{}",
        route("request_headers = { set = { \"X-Request-Id\" = \"static\" } }")
    );
    assert!(Config::parse(std::path::Path::new("gw.toml"), &without_ids).is_ok());
}

#[test]
fn an_error_page_larger_than_a_mebibyte_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("big.html"), vec![b'x'; 1024 * 1024 + 1]).unwrap();
    std::fs::write(dir.path().join("fits.html"), vec![b'x'; 1024 * 1024]).unwrap();
    let path = write_config(
        dir.path(),
        "[server.errors]\n502 = { body_file = \"big.html\" }\n503 = { body_file = \"fits.html\" }\n",
    );
    let errors = Config::load(&path).unwrap_err().errors;
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].key, "server.errors.502.body_file");
    assert!(errors[0].message.contains("larger than 1 MiB"), "{errors:?}");
}

#[tokio::test]
async fn server_rules_apply_to_every_answer_and_a_route_rule_comes_after_them() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        GatewayToml::new()
            .server(
                r#"request_headers = { set = { "X-Gateway" = "floodgate" }, remove = ["X-Debug"] }
                response_headers = { set = { "X-Frame-Options" = "DENY", "X-Content-Type-Options" = "nosniff" }, remove = ["X-Powered-By"] }"#,
            )
            .upstream("app", &upstream.url(), "")
            .route(
                "app",
                r#"path_prefix = "/app/"
                upstream = "app""#,
            )
            .route(
                "embeddable",
                r#"path_prefix = "/embed/"
                upstream = "app"
                request_headers = { set = { "X-Gateway" = "embed" } }
                response_headers = { set = { "X-Frame-Options" = "SAMEORIGIN" } }"#,
            ),
    )
    .await;
    let request = Request::get(gw.url("/app/x"))
        .header("x-debug", "1")
        .header("x_debug", "1")
        .body(Full::<Bytes>::default())
        .unwrap();
    let (status, headers, body) = send(request).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(header_lines(&body, "x-gateway"), ["floodgate"]);
    assert!(
        header_lines(&body, "x-debug").is_empty() && header_lines(&body, "x_debug").is_empty(),
        "{body}"
    );
    assert_eq!(headers["x-frame-options"], "DENY");
    let (_, headers, _) = get(&gw.url("/app/powered")).await;
    assert!(!headers.contains_key("x-powered-by"), "{headers:?}");
    // The route's rules run after the server's.
    let (_, headers, body) = get(&gw.url("/embed/x")).await;
    assert_eq!(header_lines(&body, "x-gateway"), ["embed"]);
    assert_eq!(headers["x-frame-options"], "SAMEORIGIN");
    assert_eq!(headers["x-content-type-options"], "nosniff");
    // Answers given before any route matched have them too.
    let (status, headers, _) = get(&gw.url("/nowhere")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(headers["x-frame-options"], "DENY");
    assert_eq!(headers["x-content-type-options"], "nosniff");
}

/// `strip_prefix` takes whole segments after routing, leaves `/` when nothing remains,
/// and puts the upstream's own path in front of what remains; the client's path is what
/// routing saw (docs/configuration.md#routesstrip_prefix).
#[tokio::test]
async fn strip_prefix_takes_whole_segments_and_keeps_the_upstreams_own_path() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        GatewayToml::new()
            .upstream("app", &format!("{}/v1", upstream.url()), "")
            .route(
                "api",
                r#"path_prefix = "/api"
                strip_prefix = "/api/"
                upstream = "app""#,
            ),
    )
    .await;
    for (sent, forwarded) in [
        ("/api/users?page=2", "GET /v1/users?page=2\n"),
        ("/api", "GET /v1/\n"),
        ("/api/", "GET /v1/\n"),
        // Matched by `path_prefix = "/api"`, but `/apix` is not the segment `/api`.
        ("/apix/users", "GET /v1/apix/users\n"),
        // Normalized before it is stripped: no way back above the prefix.
        ("/api/../api/a/./b", "GET /v1/a/b\n"),
    ] {
        let (status, _, body) = get(&gw.url(sent)).await;
        assert_eq!(status, StatusCode::OK, "{sent}");
        assert!(body.starts_with(forwarded), "{sent}: {body}");
    }
}

/// A name both set and removed by one route's rules is removed, whichever was sent
/// (docs/configuration.md#header-rules).
#[tokio::test]
async fn a_header_both_set_and_removed_is_removed() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        GatewayToml::new()
            .upstream("app", &upstream.url(), "")
            .route(
                "app",
                r#"path_prefix = "/"
                upstream = "app"
                request_headers = { set = { "X-Both" = "set", "X-Kept" = "set" }, remove = ["X-Both"] }
                response_headers = { set = { "X-Upstream" = "set", "X-Frame-Options" = "DENY" }, remove = ["x-upstream"] }"#,
            ),
    )
    .await;
    let request = Request::get(gw.url("/x"))
        .header("x-both", "client")
        .body(Full::<Bytes>::default())
        .unwrap();
    let (status, headers, body) = send(request).await;
    assert_eq!(status, StatusCode::OK);
    assert!(header_lines(&body, "x-both").is_empty(), "{body}");
    assert_eq!(header_lines(&body, "x-kept"), ["set"]);
    // The upstream sends `X-Upstream: yes`.
    assert!(!headers.contains_key("x-upstream"), "{headers:?}");
    assert_eq!(headers["x-frame-options"], "DENY");
}

/// A limit's rejection keeps its own `message` and `content_type` when `[server.errors]`
/// has a page for the same status; the page is for floodgate's own errors of that status.
#[tokio::test]
async fn a_limit_rejection_keeps_its_message_where_an_error_page_has_its_status() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        GatewayToml::new()
            .table(
                "server.errors",
                r#"503 = { body = "<h1>Busy</h1>\n", content_type = "text/html" }"#,
            )
            .upstream("app", &upstream.url(), "")
            .upstream(
                "capped",
                &upstream.url(),
                r#"max_requests = 1
                queue = 0"#,
            )
            .limit(
                "one",
                r#"algorithm = "fixed_window"
                limit = 1
                window = "1m"
                status = 503
                message = "limited\n""#,
            )
            .route(
                "limited",
                r#"path_prefix = "/limited"
                upstream = "app"
                limits = ["one"]"#,
            )
            .route(
                "capped",
                r#"path_prefix = "/capped"
                upstream = "capped""#,
            ),
    )
    .await;
    assert_eq!(get(&gw.url("/limited")).await.0, StatusCode::OK);
    let (status, headers, body) = get(&gw.url("/limited")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "limited\n")
    );
    assert_eq!(headers["content-type"], "text/plain; charset=utf-8");
    // floodgate's own 503: the capped upstream's one slot is held, and nothing may wait.
    let slow = gw.url("/capped/slow?ms=1000");
    let holding = tokio::spawn(async move { get(&slow).await });
    while upstream.requests() < 2 {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let (status, headers, body) = get(&gw.url("/capped/x")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "<h1>Busy</h1>\n")
    );
    assert_eq!(headers["content-type"], "text/html");
    assert_eq!(holding.await.unwrap().0, StatusCode::OK);
}
