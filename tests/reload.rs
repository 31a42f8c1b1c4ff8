//! Hot reload: a valid file is swapped in atomically, requests in flight finish
//! under the configuration they started with, an invalid file changes nothing live and is
//! counted, counters of unchanged limits survive, and the file is watched (including
//! editors that write a new file and rename it over the old one).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::config::{GatewayToml, config_file};
use crate::common::{TestGateway, Upstream, get, spawn_get, until};
use floodgate::Config;
use floodgate::reload::{Reloader, watch_file};
use http::StatusCode;

fn config_text(upstream: &Upstream, greeting: &str, limit: u64) -> GatewayToml {
    GatewayToml::new()
        .upstream("app", &upstream.url(), "")
        .limit(
            "quota",
            &format!(
                r#"algorithm = "fixed_window"
                limit = {limit}
                window = "1m""#
            ),
        )
        .route(
            "hello",
            &format!(
                r#"path = "/hello"
                respond = {{ body = "{greeting}\n" }}"#
            ),
        )
        .route(
            "app",
            r#"path_prefix = "/app/"
            upstream = "app"
            limits = ["quota"]"#,
        )
}

/// Writes `text` to `path` the way many editors do: a new file renamed over the old one.
fn replace_file(path: &Path, text: GatewayToml) {
    let temporary = path.with_extension("swp");
    std::fs::write(&temporary, text.to_string()).unwrap();
    std::fs::rename(&temporary, path).unwrap();
}

struct Setup {
    _dir: tempfile::TempDir,
    path: PathBuf,
    upstream: Upstream,
    gateway: TestGateway,
    reloader: Arc<Reloader>,
}

async fn setup(limit: u64) -> Setup {
    let upstream = Upstream::start().await;
    let (dir, path, gateway, reloader) = reloadable(config_text(&upstream, "hello", limit)).await;
    Setup {
        _dir: dir,
        path,
        upstream,
        gateway,
        reloader,
    }
}

async fn body(gateway: &TestGateway, path: &str) -> String {
    get(&gateway.url(path)).await.2
}

async fn reload(reloader: &Arc<Reloader>) -> bool {
    let reloader = reloader.clone();
    tokio::task::spawn_blocking(move || reloader.reload("test"))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_file_is_swapped_in_and_an_invalid_one_changes_nothing() {
    let s = setup(100).await;
    assert_eq!(body(&s.gateway, "/hello").await, "hello\n");

    std::fs::write(&s.path, config_text(&s.upstream, "bonjour", 100).to_string()).unwrap();
    assert!(reload(&s.reloader).await);
    assert_eq!(body(&s.gateway, "/hello").await, "bonjour\n");

    std::fs::write(
        &s.path,
        config_text(&s.upstream, "hola", 100)
            .to_string()
            .replace("[[routes]]", "[[route]]"),
    )
    .unwrap();
    assert!(!reload(&s.reloader).await);
    assert_eq!(
        body(&s.gateway, "/hello").await,
        "bonjour\n",
        "the old configuration still serves"
    );
    assert_eq!(
        s.gateway
            .metric(r#"floodgate_config_reloads_total{result="ok"}"#)
            .await,
        1.0
    );
    assert_eq!(
        s.gateway
            .metric(r#"floodgate_config_reloads_total{result="error"}"#)
            .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_of_limits_survive_a_reload() {
    let s = setup(3).await;
    assert_eq!(get(&s.gateway.url("/app/1")).await.0, StatusCode::OK);
    assert_eq!(get(&s.gateway.url("/app/2")).await.0, StatusCode::OK);
    std::fs::write(&s.path, config_text(&s.upstream, "changed", 3).to_string()).unwrap();
    assert!(reload(&s.reloader).await);
    assert_eq!(get(&s.gateway.url("/app/3")).await.0, StatusCode::OK);
    assert_eq!(
        get(&s.gateway.url("/app/4")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // An edited limit applies at once, on the same counter.
    std::fs::write(&s.path, config_text(&s.upstream, "changed", 5).to_string()).unwrap();
    assert!(reload(&s.reloader).await);
    assert_eq!(get(&s.gateway.url("/app/5")).await.0, StatusCode::OK);
    assert_eq!(get(&s.gateway.url("/app/6")).await.0, StatusCode::OK);
    assert_eq!(
        get(&s.gateway.url("/app/7")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_flight_finish_under_the_configuration_they_started_with() {
    let s = setup(100).await;
    let slow = tokio::spawn({
        let url = s.gateway.url("/app/slow?ms=600");
        async move { get(&url).await }
    });
    let started = Instant::now();
    while s.upstream.requests() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the slow request never arrived"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The new configuration has no /app/ route at all.
    let without_app = config_text(&s.upstream, "hello", 100)
        .to_string()
        .replace("path_prefix = \"/app/\"", "path = \"/gone\"");
    std::fs::write(&s.path, without_app).unwrap();
    assert!(reload(&s.reloader).await);
    assert_eq!(get(&s.gateway.url("/app/new")).await.0, StatusCode::NOT_FOUND);
    let (status, _, body) = slow.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert!(body.starts_with("GET /app/slow?ms=600"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_is_watched_through_rename_over_edits() {
    let s = setup(100).await;
    let _watcher = watch_file(s.reloader.clone(), &s.path);
    replace_file(&s.path, config_text(&s.upstream, "renamed", 100));
    let started = Instant::now();
    while body(&s.gateway, "/hello").await != "renamed\n" {
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the change was not picked up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A second edit of the same kind is seen too (the watch survives the rename).
    replace_file(&s.path, config_text(&s.upstream, "again", 100));
    let started = Instant::now();
    while body(&s.gateway, "/hello").await != "again\n" {
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the second change was not picked up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Several writes in a burst make one reload.
    let before = s
        .gateway
        .metric(r#"floodgate_config_reloads_total{result="ok"}"#)
        .await;
    for greeting in ["a", "b", "c"] {
        std::fs::write(&s.path, config_text(&s.upstream, greeting, 100).to_string()).unwrap();
    }
    let started = Instant::now();
    while body(&s.gateway, "/hello").await != "c\n" {
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the burst was not picked up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Counted a moment after the new configuration is in service, and only once.
    let reloads = r#"floodgate_config_reloads_total{result="ok"}"#;
    s.gateway
        .metric_becomes(reloads, before + 1.0, Duration::from_secs(3))
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(s.gateway.metric(reloads).await, before + 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_applies_header_timeout_to_new_connections_and_shutdown_grace_to_the_next_shutdown() {
    use tokio::io::AsyncReadExt;

    let mut s = setup(100).await;
    std::fs::write(
        &s.path,
        config_text(&s.upstream, "hello", 100)
            .server("header_timeout = \"300ms\"\nshutdown_grace = \"200ms\"")
            .to_string(),
    )
    .unwrap();
    assert!(reload(&s.reloader).await);

    // A connection that never sends a head is closed after the new header_timeout (the
    // default, 10 s, would outlast the 5 s bound).
    let mut idle = tokio::net::TcpStream::connect(s.gateway.addr).await.unwrap();
    let started = Instant::now();
    let mut received = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), idle.read_to_end(&mut received))
        .await
        .expect("the idle connection outlived the reloaded header_timeout")
        .unwrap();
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(250), "closed after {elapsed:?}");
    assert!(received.is_empty());

    // A request still in flight at shutdown is cut off after the new grace (the default,
    // 10 s, would outlast the 5 s bound).
    let slow_url = s.gateway.url("/app/slow?ms=8000");
    let slow = tokio::spawn(async move { get(&slow_url).await });
    while s.upstream.requests() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), s.gateway.shutdown())
        .await
        .expect("shutdown outlived the reloaded shutdown_grace")
        .unwrap();
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(150),
        "shut down after {elapsed:?}"
    );
    slow.abort();
}

/// One upstream `app` with `keys`, behind `/app/`.
fn capped_app(upstream: &Upstream, keys: &str) -> GatewayToml {
    GatewayToml::new().upstream("app", &upstream.url(), keys).route(
        "app",
        r#"path_prefix = "/app/"
        upstream = "app""#,
    )
}

/// A gateway on `config`, written to a file, and its reloader.
async fn reloadable(config: GatewayToml) -> (tempfile::TempDir, PathBuf, TestGateway, Arc<Reloader>) {
    let (dir, path) = config_file(config);
    let gateway = TestGateway::start_config(Config::load(&path).unwrap()).await;
    let load_path = path.clone();
    let reloader = Arc::new(Reloader::new(
        gateway.shared.clone(),
        Box::new(move || Config::load(&load_path)),
    ));
    (dir, path, gateway, reloader)
}

const QUEUE_DEPTH: &str = r#"floodgate_upstream_queue_depth{upstream="app"}"#;

/// A reload that changes a capped upstream keeps one count of each server's requests
/// across both generations: a request queued under the new one gets the slot a request
/// from before the reload frees, whether or not the old one had a cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_after_a_reload_gets_the_slot_one_from_before_frees() {
    for before in ["max_requests = 1\nqueue_timeout = \"4s\"", ""] {
        let upstream = Upstream::start().await;
        let (_dir, path, gateway, reloader) = reloadable(capped_app(&upstream, before)).await;
        let old = spawn_get(gateway.url("/app/old/slow?ms=500"));
        until("the app has the requests", Duration::from_secs(2), || {
            upstream.requests() >= 1
        })
        .await;
        replace_file(
            &path,
            capped_app(&upstream, "max_requests = 1\nqueue_timeout = \"3s\""),
        );
        assert!(reload(&reloader).await);
        let new = spawn_get(gateway.url("/app/new"));
        gateway
            .metric_becomes(QUEUE_DEPTH, 1.0, Duration::from_secs(2))
            .await;
        assert_eq!(old.await.unwrap().0, StatusCode::OK, "before: {before:?}");
        let (status, _, body) = new.await.unwrap();
        assert_eq!(status, StatusCode::OK, "before: {before:?}: {body}");
        assert_eq!(upstream.requests(), 2);
    }
}

/// The other way round: a request queued before a reload that raised the cap gets a slot
/// when a request of the new generation frees one, though the old generation's own
/// request ended while the server was full under its old cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_before_a_reload_gets_the_slot_one_from_after_frees() {
    let upstream = Upstream::start().await;
    let (_dir, path, gateway, reloader) =
        reloadable(capped_app(&upstream, "max_requests = 1\nqueue_timeout = \"4s\"")).await;
    let first = spawn_get(gateway.url("/app/first/slow?ms=300"));
    until("the app has the requests", Duration::from_secs(2), || {
        upstream.requests() >= 1
    })
    .await;
    let waiting = spawn_get(gateway.url("/app/waiting"));
    gateway
        .metric_becomes(QUEUE_DEPTH, 1.0, Duration::from_secs(2))
        .await;
    replace_file(
        &path,
        capped_app(&upstream, "max_requests = 2\nqueue_timeout = \"4s\""),
    );
    assert!(reload(&reloader).await);
    // Takes the new generation's second slot: the server is full under the old cap of 1
    // when the first request ends.
    let after = spawn_get(gateway.url("/app/after/slow?ms=600"));
    until("the app has the requests", Duration::from_secs(2), || {
        upstream.requests() >= 2
    })
    .await;
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
    assert_eq!(after.await.unwrap().0, StatusCode::OK);
    let (status, _, body) = waiting.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(upstream.requests(), 3);
}

/// A file reloaded by SIGHUP is not reloaded again when the watcher sees that it changed:
/// the watcher compares with what the last reload read, whoever triggered it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_reloaded_by_sighup_is_not_reloaded_again_by_the_watcher() {
    const RELOADED: &str = r#"floodgate_config_reloads_total{result="ok"}"#;
    let s = setup(100).await;
    let _watcher = watch_file(s.reloader.clone(), &s.path);
    replace_file(&s.path, config_text(&s.upstream, "edited", 100));
    assert!(reload(&s.reloader).await);
    assert_eq!(body(&s.gateway, "/hello").await, "edited\n");
    // The watcher polls every 500 ms and waits 200 ms for writes to settle.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(s.gateway.metric(RELOADED).await, 1.0, "reloaded twice");
    // It still reloads an edit of its own.
    replace_file(&s.path, config_text(&s.upstream, "again", 100));
    s.gateway
        .metric_becomes(RELOADED, 2.0, Duration::from_secs(3))
        .await;
    assert_eq!(body(&s.gateway, "/hello").await, "again\n");
}
