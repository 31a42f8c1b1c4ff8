//! PHP-FPM behind floodgate with nothing between them (docs/php-fpm.md): the file choice
//! and its parameters, the security rules each with an attack, CGI responses, request
//! bodies, the cap in front of a small pool, pooled connections across a PHP-FPM restart,
//! unix sockets and active checks, a page flushed in parts through compression. Real
//! `php-fpm8.2` throughout.

use crate::common;

use std::time::Duration;

use crate::common::config::GatewayToml;
use crate::common::php_fpm::PhpFpm;
use crate::common::{TestGateway, get, raw_request, send};
use bytes::Bytes;
use floodgate::Config;
use http::{Request, StatusCode};
use http_body_util::Full;

/// The parameters a script reports, one `NAME=value` line each (`-` when unset).
const DUMP: &str = r#"<?php
foreach (['SCRIPT_NAME', 'SCRIPT_FILENAME', 'PATH_INFO', 'REQUEST_URI', 'QUERY_STRING',
          'DOCUMENT_ROOT', 'REMOTE_ADDR', 'SERVER_NAME', 'SERVER_PORT', 'HTTPS', 'REQUEST_METHOD',
          'CONTENT_LENGTH', 'HTTP_PROXY', 'HTTP_X_REAL_IP', 'HTTP_X_FORWARDED_FOR', 'APP_ENV',
          'PATH_TRANSLATED', 'DOCUMENT_URI', 'REQUEST_SCHEME', 'SERVER_PROTOCOL',
          'GATEWAY_INTERFACE', 'SERVER_SOFTWARE', 'REMOTE_PORT', 'HTTP_X_REQUEST_ID',
          'HTTP_TRACEPARENT', 'HTTP_TRACESTATE'] as $k) {
    echo $k, '=', $_SERVER[$k] ?? '-', "\n";
}
"#;

/// A site with a front controller, a login script, a blog with its index, a stylesheet,
/// an upload holding PHP code, a dotfile, and scripts for CGI answers and bodies.
fn site(fpm: &PhpFpm) {
    fpm.file("/dump.php", DUMP);
    fpm.file("/index.php", "<?php echo \"front\\n\"; include 'dump.php';");
    fpm.file("/login.php", "<?php echo \"login\\n\"; include 'dump.php';");
    fpm.file(
        "/blog/index.php",
        "<?php echo \"blog\\n\"; include __DIR__ . '/../dump.php';",
    );
    fpm.file("/style.css", "body { color: red }");
    fpm.file("/uploads/evil.jpg", "<?php echo 'EXECUTED';");
    fpm.file("/.env", "SECRET=1");
    fpm.file(
        "/cgi.php",
        r#"<?php
switch ($_GET['do'] ?? '') {
    case 'location': header('Location: /elsewhere'); break;
    case 'teapot': http_response_code(418); break;
    case 'cookies': setcookie('a', '1'); setcookie('b', '2'); break;
    case 'stderr': error_log('secret-from-stderr'); break;
}
echo "done\n";
"#,
    );
    fpm.file(
        "/upload.php",
        "<?php $b = file_get_contents('php://input'); echo strlen($b), ' ', md5($b);",
    );
    fpm.file("/slow.php", "<?php usleep(300000); echo 'slow';");
}

/// A gateway with one route to `fpm`'s site; `upstream_keys` go in `[upstreams.php]`.
async fn gateway(fpm: &PhpFpm, upstream_keys: &str) -> TestGateway {
    site_gateway(fpm.site(), &format!("url = \"{}\"\n{upstream_keys}", fpm.url())).await
}

/// [`gateway`] with `server_keys` in `[server]`.
async fn gateway_with(fpm: &PhpFpm, server_keys: &str, upstream_keys: &str) -> TestGateway {
    let route = format!("upstream = \"php\"\nroot = \"{}\"", fpm.site().display());
    TestGateway::start(
        GatewayToml::new()
            .server(server_keys)
            .table(
                "upstreams.php",
                &format!("url = \"{}\"\n{upstream_keys}", fpm.url()),
            )
            .route("site", &route),
    )
    .await
}

/// A gateway with one route to the site in `root`, run by `[upstreams.php]` with `upstream`
/// (its servers and keys).
async fn site_gateway(root: &std::path::Path, upstream: &str) -> TestGateway {
    let route = format!("upstream = \"php\"\nroot = \"{}\"", root.display());
    TestGateway::start(
        GatewayToml::new()
            .table("upstreams.php", upstream)
            .route("site", &route),
    )
    .await
}

/// The value of `NAME=` in a dump.
fn param<'a>(body: &'a str, name: &str) -> &'a str {
    body.lines()
        .find_map(|line| line.strip_prefix(name).and_then(|rest| rest.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {name} in {body}"))
}

#[tokio::test]
async fn the_front_controller_runs_what_no_file_answers_with_the_parameters_nginx_sends() {
    let fpm = PhpFpm::start(2);
    site(&fpm);
    let gw = gateway(&fpm, "env = { APP_ENV = \"test\" }").await;
    let root = fpm.site().canonicalize().unwrap().display().to_string();
    let request = Request::get(gw.url("/articles/42?x=1&y=%20"))
        .header("proxy", "http://evil.example:8080")
        .header("x-real-ip", "6.6.6.6")
        .body(Full::<Bytes>::default())
        .unwrap();
    let (status, _, body) = send(request).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.starts_with("front\n"), "{body}");
    assert_eq!(param(&body, "SCRIPT_NAME"), "/index.php");
    assert_eq!(param(&body, "SCRIPT_FILENAME"), format!("{root}/index.php"));
    assert_eq!(param(&body, "DOCUMENT_ROOT"), root);
    assert_eq!(param(&body, "REQUEST_URI"), "/articles/42?x=1&y=%20");
    assert_eq!(param(&body, "QUERY_STRING"), "x=1&y=%20");
    assert_eq!(param(&body, "REMOTE_ADDR"), "127.0.0.1");
    assert_eq!(param(&body, "SERVER_PORT"), gw.addr.port().to_string());
    assert_eq!(param(&body, "REQUEST_METHOD"), "GET");
    assert_eq!(param(&body, "HTTPS"), "-");
    assert_eq!(param(&body, "REQUEST_SCHEME"), "http");
    assert_eq!(param(&body, "SERVER_PROTOCOL"), "HTTP/1.1");
    assert_eq!(param(&body, "GATEWAY_INTERFACE"), "CGI/1.1");
    assert!(
        param(&body, "SERVER_SOFTWARE").starts_with("floodgate/"),
        "{body}"
    );
    assert!(
        param(&body, "REMOTE_PORT")
            .parse::<u16>()
            .is_ok_and(|port| port > 0),
        "{body}"
    );
    // The front controller ran: nginx's $document_uri after try_files, no PATH_INFO.
    assert_eq!(param(&body, "DOCUMENT_URI"), "/index.php");
    assert_eq!(param(&body, "PATH_INFO"), "");
    assert_eq!(param(&body, "PATH_TRANSLATED"), "-");
    assert_eq!(param(&body, "APP_ENV"), "test");
    // httpoxy: no Proxy header reaches PHP; the client's X-Real-IP is floodgate's.
    assert_eq!(param(&body, "HTTP_PROXY"), "-");
    assert_eq!(param(&body, "HTTP_X_REAL_IP"), "127.0.0.1");

    let (_, _, body) = get(&gw.url("/login.php/x/y")).await;
    assert!(body.starts_with("login\n"), "{body}");
    assert_eq!(param(&body, "SCRIPT_NAME"), "/login.php");
    assert_eq!(param(&body, "PATH_INFO"), "/x/y");
    assert_eq!(param(&body, "PATH_TRANSLATED"), format!("{root}/x/y"));
    assert_eq!(param(&body, "DOCUMENT_URI"), "/login.php/x/y");

    // A HEAD runs the script and gets its head, no body.
    let head = Request::head(gw.url("/login.php"))
        .body(Full::<Bytes>::default())
        .unwrap();
    let (status, headers, body) = send(head).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers["content-type"].to_str().unwrap().starts_with("text/html"));
    assert_eq!(body, "");

    let (_, _, body) = get(&gw.url("/")).await;
    assert!(body.starts_with("front\n"), "{body}");
}

#[tokio::test]
async fn php_sees_the_request_id_and_floodgates_span_as_parent() {
    let fpm = PhpFpm::start(2);
    site(&fpm);
    let gw = gateway(&fpm, "").await;
    let request = Request::get(gw.url("/login.php"))
        .header("x-request-id", "from-client")
        .header(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )
        .header("tracestate", "rojo=1")
        .body(Full::<Bytes>::default())
        .unwrap();
    let (status, headers, body) = send(request).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // The client is not a trusted proxy: floodgate's ID, which PHP and the client share.
    let id = headers["x-request-id"].to_str().unwrap();
    assert_ne!(id, "from-client");
    assert_eq!(param(&body, "HTTP_X_REQUEST_ID"), id);
    let traceparent = param(&body, "HTTP_TRACEPARENT");
    let fields: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(fields.len(), 4, "{traceparent}");
    assert_eq!(fields[1], "0af7651916cd43dd8448eb211c80319c");
    assert_ne!(fields[2], "b7ad6b7169203331");
    assert_eq!(param(&body, "HTTP_TRACESTATE"), "rojo=1");
    // Each request's try is a span of its own.
    let (_, _, again) = get(&gw.url("/login.php")).await;
    let other = param(&again, "HTTP_TRACEPARENT");
    assert_ne!(other.split('-').nth(2), Some(fields[2]), "{other}");
}

#[tokio::test]
async fn a_directory_gets_its_slash_then_its_index_and_a_file_is_served_with_validators() {
    let fpm = PhpFpm::start(2);
    site(&fpm);
    let gw = gateway(&fpm, "").await;
    let (status, headers, _) = get(&gw.url("/blog?page=2")).await;
    assert_eq!(status, StatusCode::PERMANENT_REDIRECT);
    assert_eq!(headers["location"], "/blog/?page=2");
    let (status, _, body) = get(&gw.url("/blog/")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.starts_with("blog\n"), "{body}");
    assert_eq!(param(&body, "SCRIPT_NAME"), "/blog/index.php");

    let (status, headers, body) = get(&gw.url("/style.css")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "body { color: red }");
    assert_eq!(headers["content-type"], "text/css; charset=utf-8");
    let request = Request::get(gw.url("/style.css"))
        .header("if-none-match", headers["etag"].clone())
        .body(Full::<Bytes>::default())
        .unwrap();
    assert_eq!(send(request).await.0, StatusCode::NOT_MODIFIED);
    let request = Request::post(gw.url("/style.css"))
        .body(Full::<Bytes>::default())
        .unwrap();
    let (status, headers, _) = send(request).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(headers["allow"], "GET, HEAD");
}

/// PHP-FPM reads each parameter record's pairs on their own and refuses a record longer
/// than 65,535 bytes with its padding: parameters past that go in records of whole pairs,
/// and a pair that no record holds is a 414 before PHP-FPM is contacted.
#[tokio::test]
async fn parameters_past_a_record_reach_php_and_one_too_long_is_a_414() {
    let fpm = PhpFpm::start(1);
    site(&fpm);
    let gw = gateway(&fpm, "").await;
    // REQUEST_URI and QUERY_STRING: 80 KB of parameters.
    let query = format!("q={}", "a".repeat(40_000));
    let (status, _, body) = get(&gw.url(&format!("/dump.php?{query}"))).await;
    assert_eq!(status, StatusCode::OK, "{}", &body[..body.len().min(300)]);
    assert_eq!(param(&body, "QUERY_STRING"), query);
    // Over HTTP/2 a target may be longer than a record holds with its name and lengths
    // (65,528 bytes): the client's URI, at most 65,534 bytes, spells the address short.
    let long = format!("http://127.1:{}/{}", gw.addr.port(), "b".repeat(65_515));
    let response = common::h2c_client()
        .request(Request::get(&long).body(Full::<Bytes>::default()).unwrap())
        .await
        .expect("h2 request");
    assert_eq!(response.status(), StatusCode::URI_TOO_LONG);
    let (status, _, body) = get(&gw.url("/login.php")).await;
    assert_eq!((status, body.lines().next()), (StatusCode::OK, Some("login")));
    assert_eq!(
        gw.metric("floodgate_upstream_errors_total{upstream=\"php\",kind=\"reset\"}")
            .await,
        0.0
    );
}

/// The setup docs/php-fpm.md gives for uploads: a route before the site's that only serves
/// their files. An encoded slash does not walk around it to have PHP run an upload.
#[tokio::test]
async fn an_encoded_slash_does_not_walk_around_an_uploads_route() {
    let fpm = PhpFpm::start(2);
    site(&fpm);
    fpm.file("/uploads/planted.php", "<?php echo 'EXECUTED';");
    let root = fpm.site().display().to_string();
    let gw = TestGateway::start(
        GatewayToml::new()
            .table("upstreams.php", &format!("url = \"{}\"", fpm.url()))
            .route(
                "uploads",
                &format!("path_prefix = \"/uploads/\"\nroot = \"{root}\""),
            )
            .route("site", &format!("upstream = \"php\"\nroot = \"{root}\"")),
    )
    .await;
    let (status, _, body) = get(&gw.url("/uploads/planted.php")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    for path in [
        "/uploads%2Fplanted.php",
        "/%2Fuploads/planted.php",
        "/uploads%2F%2Fplanted.php",
    ] {
        let (status, _, body) = get(&gw.url(path)).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}: {body}");
        assert!(!body.contains("EXECUTED"), "{path}: {body}");
    }
    assert_eq!(
        gw.metric("floodgate_requests_total{route=\"uploads\",status=\"404\"}")
            .await,
        4.0
    );
}

#[tokio::test]
async fn no_path_trick_runs_an_upload_or_reaches_a_hidden_file() {
    let fpm = PhpFpm::start(2);
    site(&fpm);
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret.txt"), "outside").unwrap();
    std::os::unix::fs::symlink(outside.path(), fpm.site().join("escape")).unwrap();
    // Scripts named by symlinks directly in the root: one to a script outside, one to a
    // script inside.
    std::fs::write(outside.path().join("evil.php"), "<?php echo 'EXECUTED';").unwrap();
    std::os::unix::fs::symlink(outside.path().join("evil.php"), fpm.site().join("out.php")).unwrap();
    std::os::unix::fs::symlink("login.php", fpm.site().join("alias.php")).unwrap();
    let gw = gateway(&fpm, "").await;
    // The upload is a file: served as it is, never run.
    let (status, _, body) = get(&gw.url("/uploads/evil.jpg")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "<?php echo 'EXECUTED';")
    );
    // A script name after it does not exist: the front controller runs, not the upload.
    for path in [
        "/uploads/evil.jpg/x.php",
        "/uploads/evil.jpg.php",
        "/uploads/evil.jpg/x.PHP",
    ] {
        let (status, _, body) = get(&gw.url(path)).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert!(
            !body.contains("EXECUTED") && body.starts_with("front\n"),
            "{path}: {body}"
        );
    }
    // A NUL or a backslash names no file.
    for path in ["/uploads/evil.jpg%00.php", "/uploads%5Cevil.jpg", "/index.php%00"] {
        let answer = raw_request(
            gw.addr,
            format!("GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{path}: {answer}");
        assert!(!answer.contains("EXECUTED"), "{path}");
    }
    // Hidden and outside the root: 404, without the front controller.
    for path in [
        "/.env",
        "/uploads/.env",
        "/uploads/evil.jpg/.php",
        "/escape/secret.txt",
        "/escape/none",
        "/out.php",
        "/out.php/x",
    ] {
        let (status, _, body) = get(&gw.url(path)).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}: {body}");
        assert!(
            !body.contains("SECRET") && !body.contains("outside") && !body.contains("front"),
            "{path}"
        );
    }
    // A script is run, never sent as its source; through a symlink that stays inside too.
    for path in ["/login.php", "/alias.php"] {
        let (_, _, body) = get(&gw.url(path)).await;
        assert!(
            body.starts_with("login\n") && !body.contains("<?php"),
            "{path}: {body}"
        );
    }
}

#[tokio::test]
async fn cgi_status_location_and_cookies_become_the_response_and_stderr_stays_out() {
    let fpm = PhpFpm::start(2);
    site(&fpm);
    let gw = gateway(&fpm, "").await;
    let (status, headers, _) = get(&gw.url("/cgi.php?do=location")).await;
    assert_eq!(status, StatusCode::FOUND);
    assert_eq!(headers["location"], "/elsewhere");
    assert_eq!(get(&gw.url("/cgi.php?do=teapot")).await.0.as_u16(), 418);
    let (_, headers, _) = get(&gw.url("/cgi.php?do=cookies")).await;
    let cookies: Vec<_> = headers.get_all("set-cookie").iter().collect();
    assert_eq!(cookies, ["a=1", "b=2"]);
    let (status, _, body) = get(&gw.url("/cgi.php?do=stderr")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "done\n"));
}

#[tokio::test]
async fn a_body_of_either_framing_reaches_php_whole() {
    let fpm = PhpFpm::start(2);
    site(&fpm);
    let gw = gateway(&fpm, "").await;
    let upload: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    let digest = format!("{:x}", md5_of(&upload));
    let request = Request::post(gw.url("/upload.php"))
        .header("content-type", "application/octet-stream")
        .body(Full::new(Bytes::from(upload.clone())))
        .unwrap();
    let (status, _, body) = send(request).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, format!("1000000 {digest}"));
    // Chunked: PHP-FPM needs CONTENT_LENGTH, so the body is read whole first, in memory
    // when small, in a temporary file when not.
    for size in [3usize, 300_000] {
        let part = &upload[..size];
        let mut raw = b"POST /upload.php HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_vec();
        for chunk in part.chunks(10_000) {
            raw.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
            raw.extend_from_slice(chunk);
            raw.extend_from_slice(b"\r\n");
        }
        raw.extend_from_slice(b"0\r\n\r\n");
        let answer = raw_request(gw.addr, &raw).await;
        let digest = format!("{:x}", md5_of(part));
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(
            answer.contains(&format!("\r\n{size} {digest}\r\n")),
            "{size}: {answer}"
        );
    }
}

/// MD5, for comparing with PHP's `md5()` (RFC 1321).
fn md5_of(data: &[u8]) -> u128 {
    let output = std::process::Command::new("md5sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(data)?;
            child.wait_with_output()
        })
        .unwrap();
    let hex = String::from_utf8(output.stdout).unwrap();
    u128::from_str_radix(hex.split_whitespace().next().unwrap(), 16).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cap_queues_what_a_small_pool_cannot_take_so_that_nothing_fails() {
    let fpm = PhpFpm::start(2);
    site(&fpm);
    let gw = gateway(&fpm, "max_requests = 2\nqueue = 16\nqueue_timeout = \"10s\"").await;
    let url = gw.url("/slow.php");
    let answers = futures_util::future::join_all((0..8).map(|_| get(&url))).await;
    for (status, _, body) in answers {
        assert_eq!((status, body.as_str()), (StatusCode::OK, "slow"));
    }
}

#[tokio::test]
async fn pooled_connections_survive_a_php_fpm_restart_and_unix_sockets_work() {
    let mut fpm = PhpFpm::start(2);
    site(&fpm);
    let gw = gateway(&fpm, "").await;
    for _ in 0..3 {
        assert_eq!(get(&gw.url("/login.php")).await.0, StatusCode::OK);
    }
    fpm.restart();
    for _ in 0..3 {
        let (status, _, body) = get(&gw.url("/login.php")).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }

    let unix = PhpFpm::start_unix(1);
    site(&unix);
    let gw = gateway(&unix, "").await;
    let (status, _, body) = get(&gw.url("/login.php")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.starts_with("login\n"));
}

#[tokio::test]
async fn an_active_check_asks_php_fpm_for_its_ping() {
    let fpm = PhpFpm::start(1);
    site(&fpm);
    let dead = common::closed_port();
    let servers = format!(
        "servers = [\"{}\", \"fastcgi://127.0.0.1:{dead}\"]\n\
         health_check = {{ path = \"/ping\", interval = \"100ms\", timeout = \"1s\" }}",
        fpm.url()
    );
    let gw = site_gateway(fpm.site(), &servers).await;
    let live = fpm.url().trim_start_matches("fastcgi://").to_owned();
    let up = |server: String| format!("floodgate_upstream_server_up{{upstream=\"php\",server=\"{server}\"}}");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let live_up = gw.metric(&up(live.clone())).await;
        let dead_up = gw.metric(&up(format!("127.0.0.1:{dead}"))).await;
        if live_up == 1.0 && dead_up == 0.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "live {live_up}, dead {dead_up}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn a_fastcgi_upstream_needs_a_root_that_exists_and_a_cap_is_advised() {
    let check = |route_keys: &str| {
        let text = format!(
            "[upstreams.php]\nurl = \"fastcgi://127.0.0.1:9000\"\n\n\
             [[routes]]\nname = \"site\"\nupstream = \"php\"\n{route_keys}\n"
        );
        Config::parse(std::path::Path::new("gw.toml"), &text)
            .unwrap_err()
            .errors
    };
    let errors = check("");
    assert_eq!(errors[0].key, "routes[0].root", "{errors:?}");
    let errors = check("root = \"/no/such/directory\"");
    assert_eq!(errors[0].key, "routes[0].root", "{errors:?}");
    assert!(errors[0].message.contains("/no/such/directory"), "{errors:?}");
    let site = tempfile::tempdir().unwrap();
    let uncapped = format!(
        "[upstreams.php]\nurl = \"fastcgi://127.0.0.1:9000\"\n\n\
         [[routes]]\nname = \"site\"\nupstream = \"php\"\nroot = \"{}\"\n",
        site.path().display()
    );
    let config = Config::parse(std::path::Path::new("gw.toml"), &uncapped).unwrap();
    let warnings = config.warnings();
    assert!(
        warnings
            .iter()
            .any(|w| w.starts_with("upstreams.php: a fastcgi:// upstream without max_requests")),
        "{warnings:?}"
    );
    assert!(
        warnings
            .iter()
            .any(|w| w.starts_with("server.max_body: unlimited")),
        "{warnings:?}"
    );
    let capped = format!(
        "[server]\nmax_body = \"8MB\"\n\n{}",
        uncapped.replace("9000\"\n", "9000\"\nmax_requests = 4\n")
    );
    let config = Config::parse(std::path::Path::new("gw.toml"), &capped).unwrap();
    assert!(config.warnings().is_empty(), "{:?}", config.warnings());
    // A check's path is the script's file as PHP-FPM sees it: a URL path is a 404 there.
    let checked = |path: &str| {
        let text = capped.replace(
            "max_requests = 4\n",
            &format!("max_requests = 4\nhealth_check = {{ path = \"{path}\" }}\n"),
        );
        let text = text.replace("root = ", "php_root = \"/var/www/html\"\nroot = ");
        Config::parse(std::path::Path::new("gw.toml"), &text)
            .unwrap()
            .warnings()
    };
    let warnings = checked("/health.php");
    assert!(
        warnings.len() == 1
            && warnings[0].starts_with("upstreams.php.health_check.path: \"/health.php\" is sent")
            && warnings[0].ends_with("did you mean \"/var/www/html/health.php\"?"),
        "{warnings:?}"
    );
    assert!(checked("/var/www/html/health.php").is_empty());
    assert!(checked("/ping").is_empty(), "PHP-FPM's ping.path is no script");
    let text = "[upstreams.php]\nurl = \"fastcgi://127.0.0.1:9000/app\"\n\n[[routes]]\nname = \"x\"\nupstream = \"php\"\nroot = \"/tmp\"\n";
    let errors = Config::parse(std::path::Path::new("gw.toml"), text)
        .unwrap_err()
        .errors;
    assert_eq!(errors[0].key, "upstreams.php.url", "{errors:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_of_a_page_that_fits_the_buffer_does_not_hold_php() {
    let (status, waited) = after_a_slow_reader("64MB").await;
    // PHP's one worker and the one slot are free again: the next request goes through.
    assert_eq!(status, StatusCode::OK);
    assert!(waited < Duration::from_secs(2), "{waited:?}");
}

#[tokio::test]
async fn without_read_ahead_a_slow_reader_holds_the_slot() {
    let (status, waited) = after_a_slow_reader("0").await;
    // `response_buffer = "0"`: the page streams at the reader's pace, holding the one
    // slot; the next request waits its queue_timeout and is shed.
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(waited >= Duration::from_millis(900), "{waited:?}");
}

/// A one-worker pool behind `max_requests = 1` with `response_buffer`: a client asks for
/// a 40 MB page and reads none of it; the status of another client's request a second
/// later, and how long it waited.
async fn after_a_slow_reader(response_buffer: &str) -> (StatusCode, Duration) {
    use tokio::io::AsyncWriteExt;
    let fpm = PhpFpm::start(1);
    site(&fpm);
    // Larger than what the sockets hold on the way (a few MB on loopback).
    fpm.file("/big.php", "<?php echo str_repeat('x', 40000000);");
    let gw = gateway(
        &fpm,
        &format!(
            "max_requests = 1\nqueue = 4\nqueue_timeout = \"1s\"\nresponse_buffer = \"{response_buffer}\""
        ),
    )
    .await;
    // A client that asks for the page and reads none of it, through a small window.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut slow = socket.connect(gw.addr).await.unwrap();
    slow.write_all(b"GET /big.php HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let started = std::time::Instant::now();
    let (status, _, _) = get(&gw.url("/login.php")).await;
    let waited = started.elapsed();
    drop(slow);
    (status, waited)
}

/// The upstream's `timeout` bounds each request's wait for PHP's head on a pooled
/// connection too: a connection whose last request's deadline passed while it was idle
/// serves the next request in full, a script slower than the timeout is a 504, and the
/// request after it is served.
#[tokio::test]
async fn the_timeout_holds_for_each_request_on_a_pooled_connection() {
    let fpm = PhpFpm::start(2);
    site(&fpm);
    fpm.file("/slower.php", "<?php usleep(2000000); echo 'slower';");
    let gw = gateway(&fpm, "timeout = \"1s\"").await;
    let (status, _, body) = get(&gw.url("/login.php")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // The first request's deadline passes while its connection waits in the pool.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let (status, _, body) = get(&gw.url("/login.php")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let started = std::time::Instant::now();
    let (status, _, _) = get(&gw.url("/slower.php")).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_millis(1900),
        "{waited:?}"
    );
    let (status, _, body) = get(&gw.url("/login.php")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

#[tokio::test]
async fn a_request_a_server_never_answered_goes_to_the_next_with_its_parameters() {
    let fpm = PhpFpm::start(2);
    site(&fpm);
    // A server that takes the connection and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!("fastcgi://{}", silent.local_addr().unwrap());
    let servers = format!(
        "servers = [\"{silent_url}\", \"{}\"]\nbalance = \"round_robin\"\nretries = 1\ntimeout = \"300ms\"",
        fpm.url()
    );
    let gw = site_gateway(fpm.site(), &servers).await;
    for _ in 0..2 {
        let (status, _, body) = get(&gw.url("/login.php/x")).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(param(&body, "PATH_INFO"), "/x");
    }
    drop(silent);
}

/// Over TLS, PHP is told so (`HTTPS=on`, the scheme), and the protocol the client spoke.
#[tokio::test]
async fn over_tls_php_is_told_https_the_scheme_and_the_protocol() {
    use common::tls::{TestCa, connect};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let fpm = PhpFpm::start(2);
    site(&fpm);
    let ca = TestCa::new("php ca");
    let dir = tempfile::tempdir().unwrap();
    ca.issue(&["a.test"]).write(dir.path(), "site");
    let text = GatewayToml::new()
        .table(
            "server.tls",
            "listen = \"127.0.0.1:0\"\ncertificates = [{ cert = \"site.crt\", key = \"site.key\" }]",
        )
        .upstream("php", &fpm.url(), "")
        .route(
            "site",
            &format!("upstream = \"php\"\nroot = \"{}\"", fpm.site().display()),
        );
    let path = common::config::write_config(dir.path(), text);
    let gw = TestGateway::start_config(Config::load(&path).unwrap()).await;
    let stream = connect(&ca.client(&[b"h2"]), gw.tls.unwrap(), "a.test").await;
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(connection);
    let response = sender
        .send_request(
            Request::get("https://a.test/dump.php")
                .body(http_body_util::Empty::<Bytes>::new())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    use http_body_util::BodyExt as _;
    let body = String::from_utf8(response.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    assert_eq!(param(&body, "HTTPS"), "on");
    assert_eq!(param(&body, "REQUEST_SCHEME"), "https");
    assert_eq!(param(&body, "SERVER_PROTOCOL"), "HTTP/2.0");
    assert_eq!(param(&body, "SERVER_NAME"), "a.test");
    assert_eq!(param(&body, "SERVER_PORT"), gw.tls.unwrap().port().to_string());
}

/// A server that answers anything but FastCGI is a `502`, as a broken HTTP upstream is.
/// A script whose head cannot be relayed (a header value PHP's `header()` lets through but
/// HTTP does not, a `Status` of `1xx`) is a 502; PHP-FPM answered, so the server is not
/// failed for it, nor is the script run again on another.
#[tokio::test]
async fn a_script_answer_that_cannot_be_relayed_is_a_502_not_a_server_failure() {
    let first = PhpFpm::start(1);
    site(&first);
    let second = PhpFpm::start(1);
    let runs = first.site().join("runs");
    first.file(
        "/bad.php",
        r#"<?php file_put_contents(__DIR__ . '/runs', 'x', FILE_APPEND);
if (($_GET['do'] ?? '') === 'interim') { header('Status: 103'); } else { header("X-Bad: a\x01b"); }
echo 'body';"#,
    );
    let servers = format!(
        "servers = [\"{}\", \"{}\"]\nbalance = \"round_robin\"\nretries = 1",
        first.url(),
        second.url()
    );
    let gw = site_gateway(first.site(), &servers).await;
    for (n, path) in ["/bad.php", "/bad.php?do=interim"].into_iter().enumerate() {
        let (status, _, body) = get(&gw.url(path)).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{path}: {body}");
        assert_eq!(
            std::fs::read_to_string(&runs).unwrap().len(),
            n + 1,
            "{path} ran once"
        );
    }
    for server in [&first, &second] {
        let label = server.url().trim_start_matches("fastcgi://").to_owned();
        assert_eq!(
            gw.metric(&format!(
                "floodgate_upstream_server_up{{upstream=\"php\",server=\"{label}\"}}"
            ))
            .await,
            1.0,
            "{label}"
        );
    }
    assert_eq!(
        gw.metric("floodgate_upstream_errors_total{upstream=\"php\",kind=\"reset\"}")
            .await,
        2.0
    );
    assert_eq!(
        gw.metric("floodgate_upstream_retries_total{upstream=\"php\"}")
            .await,
        0.0
    );
}

#[tokio::test]
async fn a_response_that_is_not_fastcgi_is_a_502() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buffer = [0; 4096];
                let _ = stream.read(&mut buffer).await;
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
            });
        }
    });
    let site = tempfile::tempdir().unwrap();
    std::fs::write(site.path().join("index.php"), "<?php echo 1;").unwrap();
    let upstream = format!("url = \"fastcgi://{addr}\"\nmax_requests = 1\nretries = 0");
    let gw = site_gateway(site.path(), &upstream).await;
    let (status, _, body) = get(&gw.url("/")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert!(!body.contains("HTTP/1.1"), "{body}");
}

/// `CONTENT_LENGTH` goes with every request that has body framing, `0` for an empty body,
/// the spooled length for a chunked one, and not at all without framing.
#[tokio::test]
async fn content_length_is_sent_whenever_the_request_has_body_framing() {
    let fpm = PhpFpm::start(2);
    site(&fpm);
    let gw = gateway(&fpm, "").await;
    let (_, _, body) = get(&gw.url("/dump.php")).await;
    assert_eq!(param(&body, "CONTENT_LENGTH"), "-");
    let empty = Request::post(gw.url("/dump.php"))
        .header("content-length", "0")
        .body(Full::<Bytes>::default())
        .unwrap();
    let (_, _, body) = send(empty).await;
    assert_eq!(param(&body, "CONTENT_LENGTH"), "0");
    let chunked = b"POST /dump.php HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n3\r\n!!!\r\n0\r\n\r\n";
    let answer = raw_request(gw.addr, chunked).await;
    assert!(answer.contains("\nCONTENT_LENGTH=8\n"), "{answer}");
}

/// A unix-socket server is labelled by its socket path in the metrics.
#[tokio::test]
async fn a_unix_socket_server_is_labelled_by_its_path() {
    let fpm = PhpFpm::start_unix(1);
    site(&fpm);
    let gw = gateway(&fpm, "").await;
    assert_eq!(get(&gw.url("/login.php")).await.0, StatusCode::OK);
    let (_, _, metrics) = get(&gw.admin_url("/metrics")).await;
    let socket = fpm.url().trim_start_matches("fastcgi://").to_owned();
    let series = format!("floodgate_upstream_server_up{{upstream=\"php\",server=\"{socket}\"}} 1");
    assert!(metrics.lines().any(|line| line == series), "{series}\n{metrics}");
}

/// What PHP writes to stderr is logged at `warn`, target `fastcgi`, at most one line a
/// second per server, and never reaches the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stderr_is_logged_once_a_second_at_most() {
    let fpm = PhpFpm::start(2);
    site(&fpm);
    let config = GatewayToml::new()
        .upstream("php", &fpm.url(), "max_requests = 2")
        .route(
            "site",
            &format!("upstream = \"php\"\nroot = \"{}\"", fpm.site().display()),
        );
    let gateway = common::process::FloodgateProcess::start(config, &[]);
    let started = std::time::Instant::now();
    for _ in 0..3 {
        let (status, _, body) = get(&gateway.url("/cgi.php?do=stderr")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "done\n"));
    }
    let line = gateway
        .wait_for_line(Duration::from_secs(5), |line| {
            line.contains("PHP wrote to stderr")
        })
        .expect("a stderr line in the log");
    assert!(line.contains("WARN") && line.contains("fastcgi"), "{line}");
    assert!(line.contains("secret-from-stderr"), "{line}");
    // One line a second at most: the three requests took well under a second unless the
    // machine was loaded.
    let seconds = started.elapsed().as_secs() as usize;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let logged = gateway
        .stdout_lines()
        .into_iter()
        .filter(|line| line.contains("PHP wrote to stderr"))
        .count();
    assert!(
        (1..=1 + seconds).contains(&logged),
        "{logged} lines in {seconds} s: {:?}",
        gateway.stdout_lines()
    );
}

/// Every `HTTP_*` parameter PHP got, sorted, one `NAME=value` line each.
const HTTP_DUMP: &str = r#"<?php
$names = array_filter(array_keys($_SERVER), fn ($k) => str_starts_with($k, 'HTTP_'));
sort($names);
foreach ($names as $k) { echo $k, '=', $_SERVER[$k], "\n"; }
"#;

/// PHP is told the request's headers as they go upstream: the client's forwarding
/// headers replaced, its `Via` followed by floodgate's, hop-by-hop headers and those
/// `Connection` names left out; and a route's request rules apply (a route with rules
/// rewrites the headers where one without reads them as they go: both must tell PHP the
/// same).
#[tokio::test]
async fn php_is_told_the_headers_as_they_go_with_or_without_rules() {
    let fpm = PhpFpm::start(2);
    fpm.file("/headers.php", HTTP_DUMP);
    let root = fpm.site().display().to_string();
    let gw = TestGateway::start(
        GatewayToml::new()
            .table("upstreams.php", &format!("url = \"{}\"", fpm.url()))
            .route(
                "ruled",
                &format!(
                    "path_prefix = \"/ruled/\"\nstrip_prefix = \"/ruled\"\nupstream = \"php\"\nroot = \"{root}\"\n\
                     request_headers = {{ set = {{ \"X-Env\" = \"prod\" }}, remove = [\"Cookie\"] }}"
                ),
            )
            .route("plain", &format!("upstream = \"php\"\nroot = \"{root}\"")),
    )
    .await;
    let port = gw.addr.port();
    let ask = |path: &str, extra: &str| {
        format!(
            "GET {path} HTTP/1.1\r\nHost: shop.example:{port}\r\nX-Forwarded-For: 6.6.6.6\r\n\
             X-Forwarded-Proto: https\r\nX-Forwarded-Host: evil.example\r\nX-Real-IP: 6.6.6.6\r\n\
             Forwarded: for=6.6.6.6\r\nVia: 1.0 corp\r\nCookie: a=1\r\nKeep-Alive: timeout=5\r\n\
             TE: trailers\r\n{extra}Connection: close\r\n\r\n"
        )
    };
    let dump = |raw: String| -> Vec<String> {
        let body = raw.split_once("\r\n\r\n").map_or("", |(_, body)| body);
        assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
        // The body comes chunked: its lines of parameters, between chunk sizes.
        body.lines()
            .filter(|line| line.starts_with("HTTP_"))
            .map(str::to_owned)
            .collect()
    };
    let tail = |lines: &[&str]| lines.iter().map(|line| line.to_string()).collect::<Vec<_>>();
    // The lines of what floodgate made up for the request: its ID and `traceparent`.
    let made_up = |lines: &[String]| -> [String; 2] {
        ["HTTP_X_REQUEST_ID=", "HTTP_TRACEPARENT="].map(|name| {
            lines
                .iter()
                .find(|line| line.starts_with(name))
                .unwrap_or_else(|| panic!("no {name} in {lines:?}"))
                .clone()
        })
    };

    let plain = dump(raw_request(gw.addr, ask("/headers.php", "").as_bytes()).await);
    let [request_id, traceparent] = made_up(&plain);
    let host = format!("HTTP_HOST=shop.example:{port}");
    let forwarded_host = format!("HTTP_X_FORWARDED_HOST=shop.example:{port}");
    assert_eq!(
        plain,
        tail(&[
            "HTTP_COOKIE=a=1",
            &host,
            &traceparent,
            "HTTP_VIA=1.0 corp, 1.1 floodgate",
            "HTTP_X_FORWARDED_FOR=127.0.0.1",
            &forwarded_host,
            "HTTP_X_FORWARDED_PROTO=http",
            "HTTP_X_REAL_IP=127.0.0.1",
            &request_id,
        ])
    );

    // What `Connection` names goes too (the map is rewritten then), `Host` never.
    let named = dump(
        raw_request(
            gw.addr,
            ask("/headers.php", "X-Secret: 1\r\nConnection: X-Secret, Host\r\n").as_bytes(),
        )
        .await,
    );
    assert!(
        !named.iter().any(|line| line.starts_with("HTTP_X_SECRET")),
        "{named:?}"
    );
    assert!(named.contains(&host), "{named:?}");
    assert!(
        named.contains(&"HTTP_X_REAL_IP=127.0.0.1".to_owned()),
        "{named:?}"
    );

    let ruled = dump(raw_request(gw.addr, ask("/ruled/headers.php", "").as_bytes()).await);
    let [request_id, traceparent] = made_up(&ruled);
    assert_eq!(
        ruled,
        tail(&[
            &host,
            &traceparent,
            "HTTP_VIA=1.0 corp, 1.1 floodgate",
            "HTTP_X_ENV=prod",
            "HTTP_X_FORWARDED_FOR=127.0.0.1",
            &forwarded_host,
            "HTTP_X_FORWARDED_PROTO=http",
            "HTTP_X_REAL_IP=127.0.0.1",
            &request_id,
        ])
    );
}

/// A client that declares a Content-Length and then sends its body a byte at a time,
/// each pause under `server.body_timeout`, holds no PHP worker (nor the server's
/// `max_requests` slot): the body is read whole before PHP-FPM is contacted, as a
/// chunked one is. It used to stream to PHP, and every other request was shed with 503.
#[tokio::test]
async fn a_body_sent_slowly_holds_no_php_worker() {
    use tokio::io::AsyncWriteExt;
    let fpm = PhpFpm::start(1);
    site(&fpm);
    let gw = gateway_with(
        &fpm,
        "body_timeout = \"1s\"",
        "max_requests = 1\nqueue = 4\nqueue_timeout = \"1s\"",
    )
    .await;
    let mut slow = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    slow.write_all(b"POST /upload.php HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\n\r\n")
        .await
        .unwrap();
    let trickle = tokio::spawn(async move {
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            if slow.write_all(b"x").await.is_err() {
                break;
            }
        }
        slow
    });
    // Past body_timeout, which a body that keeps coming never reaches.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (status, _, body) = get(&gw.url("/login.php")).await;
    trickle.abort();
    assert_eq!(status, StatusCode::OK, "another client's request: {body}");
}

/// A page PHP flushes in parts, compressed on the way out: each part reaches the client
/// while PHP is still working on the next, not when the encoder's block fills.
#[tokio::test]
async fn a_compressed_page_php_flushes_reaches_the_client_part_by_part() {
    use futures_util::TryStreamExt as _;
    use http_body_util::BodyStream;
    use tokio::io::AsyncReadExt as _;

    let fpm = PhpFpm::start(2);
    fpm.file(
        "/progress.php",
        "<?php while (ob_get_level()) { ob_end_flush(); }
echo str_repeat('first part ', 20); flush(); sleep(2); echo 'second part';",
    );
    let route = format!(
        "upstream = \"php\"\nroot = \"{}\"\ncompress = true",
        fpm.site().display()
    );
    let gateway = TestGateway::start(
        GatewayToml::new()
            .table("upstreams.php", &format!("url = \"{}\"", fpm.url()))
            .route("site", &route),
    )
    .await;
    let started = std::time::Instant::now();
    let response = common::http1_client()
        .request(
            Request::get(gateway.url("/progress.php"))
                .header("accept-encoding", "gzip")
                .body(Full::<Bytes>::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.headers()["content-encoding"], "gzip");
    let data = BodyStream::new(response.into_body())
        .try_filter_map(|frame| std::future::ready(Ok(frame.into_data().ok())))
        .map_err(std::io::Error::other);
    let mut page =
        async_compression::tokio::bufread::GzipDecoder::new(tokio_util::io::StreamReader::new(data));
    let mut first = vec![0u8; 220];
    page.read_exact(&mut first).await.unwrap();
    assert_eq!(first, "first part ".repeat(20).as_bytes());
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "the first part came after {:?}, with the second",
        started.elapsed()
    );
    let mut rest = String::new();
    page.read_to_string(&mut rest).await.unwrap();
    assert_eq!(rest, "second part");
}

/// A script's `Content-Length` is relayed as the one number it is (`3, 3` as `3`); one
/// that is no number, or lines that disagree, are a 502 rather than a connection the
/// client sees cut without an answer.
#[tokio::test]
async fn a_scripts_content_length_is_one_number_or_a_502() {
    let fpm = PhpFpm::start(2);
    fpm.file(
        "/length.php",
        r#"<?php
switch ($_GET['as']) {
    case 'list': header('Content-Length: 3, 3'); break;
    case 'two': header('Content-Length: 3'); header('Content-Length: 50', false); break;
    case 'word': header('Content-Length: abc'); break;
}
echo 'abc';
"#,
    );
    let gw = gateway(&fpm, "").await;
    let (status, headers, body) = get(&gw.url("/length.php?as=list")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "abc"));
    assert_eq!(headers["content-length"], "3");
    for broken in ["two", "word"] {
        let (status, _, _) = get(&gw.url(&format!("/length.php?as={broken}"))).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{broken}");
    }
}

/// A FastCGI record of `kind` for request 1.
fn fastcgi_record(kind: u8, content: &[u8]) -> Vec<u8> {
    let length = u16::try_from(content.len()).unwrap().to_be_bytes();
    let mut record = vec![1, kind, 0, 1, length[0], length[1], 0, 0];
    record.extend_from_slice(content);
    record
}

/// Bytes a FastCGI server sends past its answer's end are no next request's answer: the
/// connection they came on is not used again.
#[tokio::test]
async fn bytes_past_a_fastcgi_answer_answer_no_other_request() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    const STDOUT: u8 = 6;
    const END_REQUEST: u8 = 3;
    const STDIN: u8 = 5;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut read = Vec::new();
                let mut buffer = [0u8; 4096];
                loop {
                    // A request ends with its empty STDIN record.
                    let mut at = 0;
                    let mut ended = None;
                    while read.len() >= at + 8 {
                        let length = usize::from(u16::from_be_bytes([read[at + 4], read[at + 5]]));
                        let next = at + 8 + length + usize::from(read[at + 6]);
                        if read.len() < next {
                            break;
                        }
                        if read[at + 1] == STDIN && length == 0 {
                            ended = Some(next);
                            break;
                        }
                        at = next;
                    }
                    if let Some(end) = ended {
                        read.drain(..end);
                        let mut answer = fastcgi_record(STDOUT, b"Status: 200\r\n\r\nright");
                        answer.extend(fastcgi_record(END_REQUEST, &[0; 8]));
                        answer.extend(fastcgi_record(STDOUT, b"Status: 200\r\n\r\nPLANTED"));
                        answer.extend(fastcgi_record(END_REQUEST, &[0; 8]));
                        if stream.write_all(&answer).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => read.extend_from_slice(&buffer[..n]),
                    }
                }
            });
        }
    });
    let site = tempfile::tempdir().unwrap();
    std::fs::write(site.path().join("index.php"), "<?php echo 1;").unwrap();
    let gw = site_gateway(site.path(), &format!("url = \"fastcgi://{addr}\"")).await;
    for n in 0..3 {
        let (status, _, body) = get(&gw.url("/")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "right"), "request {n}");
    }
}

/// Bodies read whole take their temporary files from places, an eighth of
/// `server.max_connections` (the open-files limit's share of clients), so that uploads,
/// many to a connection over HTTP/2, cannot take every descriptor: a body that finds the
/// room full waits for a place within `server.body_timeout` and is then a 503, nothing
/// sent to PHP; a body that fits in memory needs no place; a place a client leaves is
/// taken by the next body.
#[tokio::test]
async fn bodies_read_whole_share_a_bounded_room_of_temporary_files() {
    use tokio::io::AsyncWriteExt;
    let fpm = PhpFpm::start(2);
    site(&fpm);
    let gw = gateway_with(
        &fpm,
        "body_timeout = \"1s\"\nmax_connections = 16",
        "max_requests = 2",
    )
    .await;
    // Two uploads past what memory keeps, going on a byte at a time: the room's two places.
    let held = |addr| {
        tokio::spawn(async move {
            let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            stream
                .write_all(b"POST /upload.php HTTP/1.1\r\nHost: a\r\nContent-Length: 10000000\r\n\r\n")
                .await
                .unwrap();
            stream.write_all(&[b'h'; 100_000]).await.unwrap();
            while stream.write_all(b"h").await.is_ok() {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
    };
    let holders = [held(gw.addr), held(gw.addr)];
    tokio::time::sleep(Duration::from_millis(500)).await;
    let upload = |size: usize| {
        Request::post(gw.url("/upload.php"))
            .body(Full::new(Bytes::from(vec![b'u'; size])))
            .unwrap()
    };
    let asked = std::time::Instant::now();
    let (status, _, body) = send(upload(200_000)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(
        asked.elapsed() >= Duration::from_millis(900),
        "{:?}",
        asked.elapsed()
    );
    let (status, _, body) = send(upload(10_000)).await;
    let small = format!("10000 {:x}", md5_of(&[b'u'; 10_000]));
    assert_eq!((status, body), (StatusCode::OK, small));
    holders[0].abort();
    let (status, _, body) = send(upload(200_000)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.starts_with("200000 "), "{body}");
    holders[1].abort();
}

/// Over HTTP/2 a body that finds no place is answered 503 at once, not kept waiting: a
/// stream that is not read keeps what it was sent counted against the connection's
/// window, and the connection's other uploads, the one holding the place among them,
/// would stall until the waiting streams' `body_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http2_a_body_with_no_place_is_refused_at_once_not_left_to_stall_the_connection() {
    use http_body_util::StreamBody;
    use hyper::body::Frame;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let fpm = PhpFpm::start(2);
    site(&fpm);
    let gw = gateway_with(
        &fpm,
        "body_timeout = \"3s\"\nmax_connections = 4",
        "max_requests = 2",
    )
    .await;
    type UploadParts = std::pin::Pin<
        Box<dyn futures_util::Stream<Item = Result<Frame<Bytes>, std::convert::Infallible>> + Send>,
    >;
    type Upload = StreamBody<UploadParts>;
    let stream = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (sender, connection) =
        hyper::client::conn::http2::handshake::<_, _, Upload>(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(connection);
    // An upload of `count` 100 KB parts, 50 ms apart.
    let upload = |mut sender: hyper::client::conn::http2::SendRequest<Upload>, count: usize| {
        let parts = futures_util::stream::unfold(0, move |sent| async move {
            if sent == count {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            Some((
                Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(vec![b'p'; 100_000]))),
                sent + 1,
            ))
        });
        let request = Request::post(format!("http://{}/upload.php", gw.addr))
            .body(StreamBody::new(Box::pin(parts) as UploadParts))
            .unwrap();
        tokio::spawn(async move {
            let response = sender.send_request(request).await.unwrap();
            let status = response.status();
            let body = http_body_util::BodyExt::collect(response.into_body())
                .await
                .unwrap()
                .to_bytes();
            (status, String::from_utf8_lossy(&body).into_owned())
        })
    };
    let started = std::time::Instant::now();
    let holder = upload(sender.clone(), 30);
    // Past 64 KB: the holder has the room's one place.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let others = [upload(sender.clone(), 10), upload(sender.clone(), 10)];
    for other in others {
        let (status, body) = other.await.unwrap();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    }
    let (status, body) = holder.await.unwrap();
    assert_eq!(
        (status, body.split(' ').next()),
        (StatusCode::OK, Some("3000000")),
        "{body}"
    );
    // About 1.5 s to send; stalled, it would end past the others' 3 s.
    assert!(
        started.elapsed() < Duration::from_millis(2700),
        "the holder stalled until the others' body_timeout: {:?}",
        started.elapsed()
    );
}
