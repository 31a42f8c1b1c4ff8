//! A route's site files without PHP (docs/configuration.md#routesroot): a route with
//! `root` alone serves them; beside an HTTP upstream, a file that exists is served and
//! anything else is proxied. Hidden paths and paths outside the root are `404` either way,
//! a script is never sent as its source, and the route's limits apply to files too.

use crate::common::config::GatewayToml;
use crate::common::{TestGateway, Upstream, get, send};
use bytes::Bytes;
use floodgate::Config;
use http::{Request, StatusCode};
use http_body_util::Full;

/// A site with an index, a stylesheet in a directory, a dotfile, a PHP script and a
/// symlink out of the root.
fn site() -> (tempfile::TempDir, tempfile::TempDir) {
    let site = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let write = |path: &str, content: &str| {
        let full = site.path().join(path);
        std::fs::create_dir_all(full.parent().unwrap()).unwrap();
        std::fs::write(full, content).unwrap();
    };
    write("index.html", "<h1>home</h1>");
    write("docs/index.html", "<h1>docs</h1>");
    write("assets/style.css", "body { color: red }");
    write(".env", "SECRET=1");
    write("config.php", "<?php $password = 'secret';");
    std::fs::write(outside.path().join("passwd"), "root:x:0:0").unwrap();
    std::os::unix::fs::symlink(outside.path(), site.path().join("escape")).unwrap();
    (site, outside)
}

#[tokio::test]
async fn a_route_with_root_alone_serves_its_files_and_nothing_else() {
    let (site, _outside) = site();
    let gw = TestGateway::start(
        GatewayToml::new()
            .limit("two", "algorithm = \"fixed_window\"\nlimit = 2\nwindow = \"1m\"")
            .route("limited", "path_prefix = \"/limited/\"\nstrip_prefix = \"/limited\"\nlimits = [\"two\"]\nroot = \"ROOT\"".replace("ROOT", &site.path().display().to_string()).as_str())
            .route("site", &format!("root = \"{}\"", site.path().display())),
    )
    .await;
    let (status, headers, body) = get(&gw.url("/")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "<h1>home</h1>"));
    assert_eq!(headers["content-type"], "text/html; charset=utf-8");
    let (status, headers, _) = get(&gw.url("/docs?x=1")).await;
    assert_eq!(status, StatusCode::PERMANENT_REDIRECT);
    assert_eq!(headers["location"], "/docs/?x=1");
    assert_eq!(get(&gw.url("/docs/")).await.2, "<h1>docs</h1>");
    let (status, headers, body) = get(&gw.url("/assets/style.css")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "body { color: red }"));
    let request = Request::get(gw.url("/assets/style.css"))
        .header("if-none-match", headers["etag"].clone())
        .body(Full::<Bytes>::default())
        .unwrap();
    assert_eq!(send(request).await.0, StatusCode::NOT_MODIFIED);
    for path in [
        "/.env",
        "/escape/passwd",
        "/config.php",
        "/CONFIG.PHP",
        "/missing",
        "/assets/",
    ] {
        let (status, _, body) = get(&gw.url(path)).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}: {body}");
        assert!(
            !body.contains("SECRET") && !body.contains("root:x") && !body.contains("password"),
            "{path}"
        );
    }
    // A directory's redirect names the path the client asked for, its stripped prefix
    // included (it counts against the route's limits too).
    let (status, headers, _) = get(&gw.url("/limited/docs")).await;
    assert_eq!(status, StatusCode::PERMANENT_REDIRECT);
    assert_eq!(headers["location"], "/limited/docs/");
    // The route's limits apply to files as to anything else.
    assert_eq!(get(&gw.url("/limited/assets/style.css")).await.0, StatusCode::OK);
    assert_eq!(
        get(&gw.url("/limited/assets/style.css")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn beside_an_http_upstream_a_file_is_served_and_the_rest_proxied() {
    let (site, _outside) = site();
    let app = Upstream::start().await;
    let gw = TestGateway::start(GatewayToml::new().upstream("app", &app.url(), "").route(
        "site",
        &format!("upstream = \"app\"\nroot = \"{}\"", site.path().display()),
    ))
    .await;
    let (status, _, body) = get(&gw.url("/assets/style.css")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "body { color: red }"));
    assert_eq!(app.requests(), 0, "a file went to the app");
    let (status, _, body) = get(&gw.url("/api/users")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.starts_with("GET /api/users"), "{body}");
    // A script is the app's to run, not a file to send.
    let (_, _, body) = get(&gw.url("/config.php")).await;
    assert!(body.starts_with("GET /config.php"), "{body}");
    // Hidden and outside: 404, never proxied.
    let before = app.requests();
    for path in ["/.env", "/escape/passwd"] {
        assert_eq!(get(&gw.url(path)).await.0, StatusCode::NOT_FOUND, "{path}");
    }
    assert_eq!(app.requests(), before);
}

#[test]
fn the_keys_of_a_site_go_where_they_apply() {
    let errors = |route: &str| {
        let text =
            format!("[upstreams.app]\nurl = \"http://127.0.0.1:9\"\n\n[[routes]]\nname = \"r\"\n{route}\n");
        Config::parse(std::path::Path::new("gw.toml"), &text)
            .unwrap_err()
            .errors
            .into_iter()
            .map(|e| e.key)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        errors("root = \"/tmp\"\nphp_root = \"/app\""),
        ["routes[0].php_root"]
    );
    assert_eq!(
        errors("upstream = \"app\"\nroot = \"/tmp\"\nsplit_path = \".php\""),
        ["routes[0].split_path"]
    );
    assert_eq!(
        errors("respond = { status = 204 }\nroot = \"/tmp\""),
        ["routes[0].root"]
    );
    assert_eq!(errors("root = \"/no/such/directory\""), ["routes[0].root"]);
    assert_eq!(
        errors("upstream = \"app\"\nindex = \"index.html\""),
        ["routes[0].index"]
    );
}

/// A file too large to be read at once is held open while it streams, in one of the
/// places an eighth of `server.max_connections` gives files being served: a client that
/// never reads holds its place, not the process's descriptors, and a file that finds no
/// place is a 503 with `Retry-After: 1`; small files, read when opened, need none; the
/// place comes back when the client goes.
#[tokio::test]
async fn files_that_stream_take_a_place_and_give_it_back() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let site = tempfile::tempdir().unwrap();
    std::fs::write(site.path().join("big.bin"), vec![b'b'; 4 << 20]).unwrap();
    std::fs::write(site.path().join("small.txt"), "small").unwrap();
    let gw = TestGateway::start(
        GatewayToml::new()
            .server("max_connections = 4")
            .route("site", &format!("root = \"{}\"", site.path().display())),
    )
    .await;
    // The room's one place, held by a download nobody reads.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket.connect(gw.addr).await.unwrap();
    stalled
        .write_all(b"GET /big.bin HTTP/1.1\r\nHost: h\r\n\r\n")
        .await
        .unwrap();
    // Its head come: the file is open, its place taken.
    let mut head = [0u8; 12];
    stalled.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");

    let (status, headers, body) = get(&gw.url("/big.bin")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{} bytes", body.len());
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(get(&gw.url("/small.txt")).await.2, "small");

    drop(stalled);
    let started = std::time::Instant::now();
    loop {
        let (status, _, body) = get(&gw.url("/big.bin")).await;
        if status == StatusCode::OK {
            assert_eq!(body.len(), 4 << 20);
            break;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(3),
            "the place did not come back: {status}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
