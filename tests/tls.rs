//! TLS both ways (docs/configuration.md#servertls): the HTTPS listener (certificates by
//! SNI, ALPN h2 and http/1.1, reload of certificate files in place, redirect, HSTS,
//! X-Forwarded-Proto, handshakes that fail or never finish) and https upstreams checked
//! against their CA. Certificates come from a CA made in each test.

use crate::common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::common::config::{GatewayToml, write_config};
use crate::common::stub::{ListeningStub, StubUpstream};
use crate::common::tls::{NOT_AFTER, TestCa, connect, presented, unverified_client};
use crate::common::{TestGateway, Upstream, get, header_lines, until};
use bytes::Bytes;
use floodgate::Config;
use floodgate::reload::{Reloader, watch_file};
use http::{Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A gateway with `[server.tls]` (`tls_keys` added to it) in front of `upstream`, its
/// configuration in `dir/gateway.toml` with the certificate files named relative to it.
async fn gateway(dir: &Path, upstream: &Upstream, certificates: &[&str], tls_keys: &str) -> TestGateway {
    let path = write_config(dir, tls_config(upstream, certificates, tls_keys));
    TestGateway::start_config(Config::load(&path).unwrap()).await
}

/// The configuration [`gateway`] runs: `NAME.crt` and `NAME.key` for each of `certificates`.
fn tls_config(upstream: &Upstream, certificates: &[&str], tls_keys: &str) -> GatewayToml {
    let pairs: Vec<String> = certificates
        .iter()
        .map(|name| format!("{{ cert = \"{name}.crt\", key = \"{name}.key\" }}"))
        .collect();
    GatewayToml::new()
        .server("header_timeout = \"500ms\"")
        .table(
            "server.tls",
            &format!(
                "listen = \"127.0.0.1:0\"\ncertificates = [{}]\n{tls_keys}",
                pairs.join(", ")
            ),
        )
        .proxy_to(&upstream.url(), "")
}

const RELOADED: &str = r#"floodgate_config_reloads_total{result="ok"}"#;

/// A gateway serving `a.test` from `dir`, its configuration reloaded by a watcher (held by
/// the returned handle) and by the returned reloader, as SIGHUP does.
async fn watched_gateway(
    dir: &Path,
    ca: &TestCa,
    upstream: &Upstream,
) -> (TestGateway, Arc<Reloader>, floodgate::reload::WatchHandle) {
    ca.issue(&["a.test"]).write(dir, "a");
    let gw = gateway(dir, upstream, &["a"], "").await;
    let path = dir.join("gateway.toml");
    let load_path = path.clone();
    let reloader = Arc::new(Reloader::new(
        gw.shared.clone(),
        Box::new(move || Config::load(&load_path)),
    ));
    let watcher = watch_file(reloader.clone(), &path);
    (gw, reloader, watcher)
}

/// A certificate named before its files exist: the reload is refused; once they are
/// there, saving the configuration again (unchanged) loads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_named_before_its_files_exist_loads_when_the_configuration_is_saved_again() {
    const REFUSED: &str = r#"floodgate_config_reloads_total{result="error"}"#;
    let (ca, dir, upstream) = (
        TestCa::new("test ca"),
        tempfile::tempdir().unwrap(),
        Upstream::start().await,
    );
    let (gw, _reloader, _watcher) = watched_gateway(dir.path(), &ca, &upstream).await;
    write_config(dir.path(), tls_config(&upstream, &["a", "b"], ""));
    gw.metric_becomes(REFUSED, 1.0, Duration::from_secs(3)).await;
    let b = ca.issue(&["b.test"]);
    b.write(dir.path(), "b");
    write_config(dir.path(), tls_config(&upstream, &["a", "b"], ""));
    gw.metric_becomes(RELOADED, 1.0, Duration::from_secs(3)).await;
    let seen = presented(&connect(&ca.client(&[b"http/1.1"]), gw.tls.unwrap(), "b.test").await);
    assert_eq!(seen, b.der);
}

/// A reload (SIGHUP) that names new certificate files is not followed by a second one
/// when the watcher starts watching them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_naming_new_certificate_files_is_not_repeated_by_the_watcher() {
    let (ca, dir, upstream) = (
        TestCa::new("test ca"),
        tempfile::tempdir().unwrap(),
        Upstream::start().await,
    );
    let (gw, reloader, _watcher) = watched_gateway(dir.path(), &ca, &upstream).await;
    ca.issue(&["b.test"]).write(dir.path(), "b");
    write_config(dir.path(), tls_config(&upstream, &["a", "b"], ""));
    assert!(
        tokio::task::spawn_blocking(move || reloader.reload("SIGHUP"))
            .await
            .unwrap()
    );
    // The watcher polls every 500 ms and waits 200 ms for writes to settle.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(gw.metric(RELOADED).await, 1.0, "reloaded twice");
}

/// One HTTP request over a TLS connection offering `alpn`: the version used, the status
/// and the body.
async fn request_over_tls(
    ca: &TestCa,
    gw: &TestGateway,
    alpn: &[&[u8]],
    path: &str,
) -> (Version, StatusCode, http::HeaderMap, String) {
    let stream = connect(&ca.client(alpn), gw.tls.unwrap(), "a.test").await;
    let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
    let request = Request::get(path)
        .header("host", "a.test")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let response = if h2 {
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(connection);
        let mut request = request;
        *request.uri_mut() = format!("https://a.test{path}").parse().unwrap();
        sender.send_request(request).await.unwrap()
    } else {
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(connection);
        sender.send_request(request).await.unwrap()
    };
    let version = response.version();
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (
        version,
        status,
        headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

#[tokio::test]
async fn the_certificate_is_chosen_by_sni_and_the_first_is_the_default() {
    let ca = TestCa::new("test ca");
    let dir = tempfile::tempdir().unwrap();
    let first = ca.issue(&["a.test"]);
    let second = ca.issue(&["*.b.test"]);
    first.write(dir.path(), "first");
    second.write(dir.path(), "second");
    let upstream = Upstream::start().await;
    let gw = gateway(dir.path(), &upstream, &["first", "second"], "").await;
    let client = ca.client(&[b"http/1.1"]);
    let addr = gw.tls.unwrap();
    assert_eq!(presented(&connect(&client, addr, "a.test").await), first.der);
    assert_eq!(
        presented(&connect(&client, addr, "shop.b.test").await),
        second.der
    );
    // No match, and no SNI at all (an IP address): the first certificate. The client
    // would refuse it for these names, so look at what was presented without checking.
    for name in ["other.test", "127.0.0.1"] {
        let seen = presented_unchecked(addr, name).await;
        assert_eq!(seen, first.der, "{name}");
    }
}

/// A client may send its SNI name with a trailing dot (RFC 6066 says not to; openssl
/// sends what it is given, where rustls strips it): the certificate is chosen for the
/// name routing sees, lowercase and without the dot.
#[tokio::test]
async fn a_trailing_dot_or_capitals_in_the_sni_name_choose_the_same_certificate() {
    let ca = TestCa::new("test ca");
    let dir = tempfile::tempdir().unwrap();
    ca.issue(&["a.test"]).write(dir.path(), "first");
    let shop = ca.issue(&["shop.example.net"]);
    shop.write(dir.path(), "shop");
    let upstream = Upstream::start().await;
    let gw = gateway(dir.path(), &upstream, &["first", "shop"], "").await;
    let addr = gw.tls.unwrap().to_string();
    for name in ["shop.example.net", "shop.example.net.", "Shop.Example.NET."] {
        let run = tokio::process::Command::new("openssl")
            .args(["s_client", "-connect", &addr, "-servername", name])
            .stdin(std::process::Stdio::null())
            .output();
        let output = tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("openssl s_client finishes")
            .expect("openssl runs");
        let seen = rustls::pki_types::CertificateDer::from_pem_slice(&output.stdout).unwrap_or_else(|e| {
            panic!(
                "{name}: no certificate printed ({e:?}): {}",
                String::from_utf8_lossy(&output.stderr)
            )
        });
        assert!(seen == shop.der, "{name}: the default certificate was presented");
    }
}

/// The certificate presented to a client asking for `name`, without verifying it.
async fn presented_unchecked(
    addr: std::net::SocketAddr,
    name: &str,
) -> rustls::pki_types::CertificateDer<'static> {
    presented(&connect(&unverified_client(&[]), addr, name).await)
}

#[tokio::test]
async fn alpn_serves_http2_and_http1_and_requests_are_forwarded_as_https() {
    let ca = TestCa::new("test ca");
    let dir = tempfile::tempdir().unwrap();
    ca.issue(&["a.test"]).write(dir.path(), "a");
    let upstream = Upstream::start().await;
    let gw = gateway(dir.path(), &upstream, &["a"], "").await;
    for (alpn, version) in [
        (&b"h2"[..], Version::HTTP_2),
        (&b"http/1.1"[..], Version::HTTP_11),
    ] {
        let (seen, status, _, body) = request_over_tls(&ca, &gw, &[alpn], "/hello").await;
        assert_eq!((seen, status), (version, StatusCode::OK), "{body}");
        assert_eq!(header_lines(&body, "x-forwarded-proto"), ["https"], "{body}");
    }
    // Over the plain listener, still http.
    let (_, _, body) = get(&gw.url("/plain")).await;
    assert_eq!(header_lines(&body, "x-forwarded-proto"), ["http"]);
}

#[tokio::test]
async fn curl_speaks_http2_over_tls() {
    let ca = TestCa::new("test ca");
    let dir = tempfile::tempdir().unwrap();
    ca.issue(&["a.test"]).write(dir.path(), "a");
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
    let upstream = Upstream::start().await;
    let gw = gateway(dir.path(), &upstream, &["a"], "").await;
    let port = gw.tls.unwrap().port();
    let output = tokio::process::Command::new("curl")
        .args([
            "-sS",
            "--http2",
            "-o",
            "/dev/null",
            "-w",
            "%{http_version} %{http_code}",
        ])
        .arg("--cacert")
        .arg(dir.path().join("ca.pem"))
        .args(["--resolve", &format!("a.test:{port}:127.0.0.1")])
        .arg(format!("https://a.test:{port}/curl"))
        .output()
        .await
        .expect("curl runs");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "2 200",
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test]
async fn hsts_and_the_redirect_to_https() {
    let ca = TestCa::new("test ca");
    let dir = tempfile::tempdir().unwrap();
    ca.issue(&["a.test"]).write(dir.path(), "a");
    let upstream = Upstream::start().await;
    let gw = gateway(
        dir.path(),
        &upstream,
        &["a"],
        "redirect_http = true\nhsts = \"1d\"",
    )
    .await;
    let (_, status, headers, _) = request_over_tls(&ca, &gw, &[b"http/1.1"], "/x").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["strict-transport-security"], "max-age=86400");
    let port = gw.tls.unwrap().port();
    // The host as routing sees it: no port, lowercase, no trailing dot, brackets kept.
    for (host, name) in [
        ("a.test:8080", "a.test"),
        ("A.Test.", "a.test"),
        ("[::1]:8080", "[::1]"),
    ] {
        let response = common::send(
            Request::get(gw.url("/some/path?q=1"))
                .header("host", host)
                .body(http_body_util::Full::default())
                .unwrap(),
        )
        .await;
        assert_eq!(response.0, StatusCode::PERMANENT_REDIRECT, "{host}");
        assert_eq!(
            response.1["location"],
            format!("https://{name}:{port}/some/path?q=1").as_str()
        );
        assert!(!response.1.contains_key("strict-transport-security"));
    }
    assert_eq!(upstream.requests(), 1, "the redirected request was forwarded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_files_replaced_in_place_serve_new_handshakes_and_a_broken_one_keeps_the_old() {
    let ca = TestCa::new("test ca");
    let dir = tempfile::tempdir().unwrap();
    let old = ca.issue(&["a.test"]);
    old.write(dir.path(), "a");
    let upstream = Upstream::start().await;
    let gw = gateway(dir.path(), &upstream, &["a"], "").await;
    let path = dir.path().join("gateway.toml");
    let reloader = Arc::new(Reloader::new(
        gw.shared.clone(),
        Box::new(move || Config::load(&path)),
    ));
    let _watcher = watch_file(reloader, &dir.path().join("gateway.toml"));

    // A keep-alive connection made with the old certificate.
    let stream = connect(&ca.client(&[b"http/1.1"]), gw.tls.unwrap(), "a.test").await;
    assert_eq!(presented(&stream), old.der);
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    let ask = |path: &str| {
        Request::get(path)
            .header("host", "a.test")
            .body(Empty::<Bytes>::new())
            .unwrap()
    };
    assert_eq!(
        sender.send_request(ask("/before")).await.unwrap().status(),
        StatusCode::OK
    );

    let new = ca.issue(&["a.test"]);
    new.write(dir.path(), "a");
    let started = Instant::now();
    loop {
        let seen = presented(&connect(&ca.client(&[b"http/1.1"]), gw.tls.unwrap(), "a.test").await);
        if seen == new.der {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the new certificate was not picked up"
        );
        // The established connection keeps working throughout (and, busy, is not idle).
        sender.ready().await.unwrap();
        assert_eq!(
            sender.send_request(ask("/during")).await.unwrap().status(),
            StatusCode::OK
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sender.ready().await.unwrap();
    assert_eq!(
        sender.send_request(ask("/after")).await.unwrap().status(),
        StatusCode::OK,
        "the established connection was cut"
    );

    // A key that does not load: the reload fails, the certificate in use stays.
    std::fs::write(dir.path().join("a.key"), "not a key").unwrap();
    let started = Instant::now();
    while gw
        .metric("floodgate_config_reloads_total{result=\"error\"}")
        .await
        < 1.0
    {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the broken key was not noticed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seen = presented(&connect(&ca.client(&[b"http/1.1"]), gw.tls.unwrap(), "a.test").await);
    assert_eq!(seen, new.der);
}

#[tokio::test]
async fn a_failed_or_unfinished_handshake_closes_that_connection_only_and_is_counted() {
    let ca = TestCa::new("test ca");
    let dir = tempfile::tempdir().unwrap();
    let issued = ca.issue(&["a.test"]);
    issued.write(dir.path(), "a");
    let upstream = Upstream::start().await;
    let gw = gateway(dir.path(), &upstream, &["a"], "").await;
    let expiry = "floodgate_tls_certificate_expiry_timestamp_seconds{certificate=\"a.test\"}";
    assert_eq!(gw.metric(expiry).await, NOT_AFTER);

    // Plain HTTP to the TLS port.
    let mut plain = tokio::net::TcpStream::connect(gw.tls.unwrap()).await.unwrap();
    plain
        .write_all(b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n")
        .await
        .unwrap();
    let mut received = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(2), plain.read_to_end(&mut received)).await;
    assert!(closed.is_ok(), "plain HTTP on the TLS port left open");
    assert!(!String::from_utf8_lossy(&received).contains("200"));
    // A client that never starts its handshake is cut at header_timeout (500 ms).
    let mut silent = tokio::net::TcpStream::connect(gw.tls.unwrap()).await.unwrap();
    let started = Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(3), silent.read_to_end(&mut Vec::new())).await;
    assert!(closed.is_ok(), "still open after 3 s");
    assert!(started.elapsed() >= Duration::from_millis(400));
    gw.metric_becomes(
        "floodgate_tls_handshake_errors_total",
        2.0,
        Duration::from_secs(2),
    )
    .await;
    // Others are served meanwhile.
    let (_, status, _, _) = request_over_tls(&ca, &gw, &[b"http/1.1"], "/fine").await;
    assert_eq!(status, StatusCode::OK);
}

/// A reload that removes `[server.tls]` leaves the listener (a restart closes it) refusing
/// handshakes, and no certificate's expiry exported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_without_tls_exports_no_certificate_expiry() {
    let ca = TestCa::new("test ca");
    let dir = tempfile::tempdir().unwrap();
    ca.issue(&["a.test"]).write(dir.path(), "a");
    let upstream = Upstream::start().await;
    let gw = gateway(dir.path(), &upstream, &["a"], "").await;
    let expiry = "floodgate_tls_certificate_expiry_timestamp_seconds{certificate=\"a.test\"}";
    assert_eq!(gw.metric(expiry).await, NOT_AFTER);
    let path = write_config(dir.path(), GatewayToml::new().proxy_to(&upstream.url(), ""));
    let reloader = Reloader::new(gw.shared.clone(), Box::new(move || Config::load(&path)));
    assert!(
        tokio::task::spawn_blocking(move || reloader.reload("test"))
            .await
            .unwrap()
    );
    let metrics = get(&gw.admin_url("/metrics")).await.2;
    assert!(
        !metrics.contains("floodgate_tls_certificate_expiry_timestamp_seconds{"),
        "{metrics}"
    );
}

#[tokio::test]
async fn check_names_a_key_that_does_not_match_its_certificate() {
    let ca = TestCa::new("test ca");
    let dir = tempfile::tempdir().unwrap();
    let a = ca.issue(&["a.test"]);
    let b = ca.issue(&["b.test"]);
    a.write(dir.path(), "a");
    std::fs::write(dir.path().join("b.crt"), &b.cert).unwrap();
    std::fs::write(dir.path().join("b.key"), &a.key).unwrap();
    let path = write_config(
        dir.path(),
        "[server.tls]\nlisten = \"127.0.0.1:0\"\ncertificates = [\n  { cert = \"a.crt\", key = \"a.key\" },\n  { cert = \"b.crt\", key = \"b.key\" },\n]\n",
    );
    let output = std::process::Command::new(common::process::BIN)
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains(":5:27: server.tls.certificates[1].key: "),
        "{stderr}"
    );
    assert!(
        stderr.contains("b.key: the key does not match the certificate in"),
        "{stderr}"
    );
    // Fixed, the same file passes and summarizes the listener.
    std::fs::write(dir.path().join("b.key"), &b.key).unwrap();
    let output = std::process::Command::new(common::process::BIN)
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stdout).contains("2 certificate(s)"));
}

/// An HTTPS upstream for `localhost`, its certificate from `ca`, that answers every
/// request with 200 "secure"; returns it and the count of `/health` requests it answered.
async fn https_upstream(ca: &TestCa) -> (ListeningStub, Arc<AtomicUsize>) {
    let issued = ca.issue(&["localhost"]);
    let chain = vec![issued.der.clone()];
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(issued.key.as_bytes()).unwrap();
    let config =
        rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
    let checks = Arc::new(AtomicUsize::new(0));
    let counted = checks.clone();
    let upstream = StubUpstream::http1_tls(Arc::new(config))
        .route_fn("/health", move |_| {
            counted.fetch_add(1, Ordering::SeqCst);
            Response::new("secure")
        })
        .fallback_fn(|_| Response::new("secure"))
        .run()
        .await;
    (upstream, checks)
}

#[tokio::test]
async fn an_https_upstream_is_used_with_its_ca_and_refused_without() {
    let ca = TestCa::new("upstream ca");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
    let (upstream, _) = https_upstream(&ca).await;
    let config = |tls_ca: &str| {
        let url = format!("https://localhost:{}", upstream.addr.port());
        let path = write_config(dir.path(), GatewayToml::new().proxy_to(&url, tls_ca));
        Config::load(&path).unwrap()
    };
    let trusted = TestGateway::start_config(config("tls_ca = \"ca.pem\"")).await;
    for _ in 0..3 {
        let (status, _, body) = get(&trusted.url("/")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "secure"));
    }
    // The system's roots do not know this CA.
    let untrusted = TestGateway::start_config(config("")).await;
    assert_eq!(get(&untrusted.url("/")).await.0, StatusCode::BAD_GATEWAY);
    assert_eq!(
        untrusted
            .metric("floodgate_upstream_errors_total{upstream=\"app\",kind=\"tls\"}")
            .await,
        1.0
    );
    // The right CA but the wrong name.
    let wrong_name =
        TestGateway::start_config(config("tls_ca = \"ca.pem\"\ntls_server_name = \"other.test\"")).await;
    assert_eq!(get(&wrong_name.url("/")).await.0, StatusCode::BAD_GATEWAY);
}

#[tokio::test]
async fn active_checks_of_an_https_upstream_speak_tls() {
    let ca = TestCa::new("upstream ca");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
    let (upstream, checks) = https_upstream(&ca).await;
    let addr = upstream.addr;
    let path = write_config(
        dir.path(),
        GatewayToml::new().proxy_to(
            &format!("https://localhost:{}", addr.port()),
            r#"tls_ca = "ca.pem"
            health_check = { path = "/health", interval = "50ms", timeout = "500ms" }"#,
        ),
    );
    let gw = TestGateway::start_config(Config::load(&path).unwrap()).await;
    // Several check rounds, each over TLS (a check in the clear never gets a TLS server to
    // answer); two failures in a row would have taken the server out.
    until("four checks answered", Duration::from_secs(5), || {
        checks.load(Ordering::SeqCst) >= 4
    })
    .await;
    let up = format!(
        "floodgate_upstream_server_up{{upstream=\"app\",server=\"localhost:{}\"}}",
        addr.port()
    );
    assert_eq!(gw.metric(&up).await, 1.0);
    assert_eq!(get(&gw.url("/")).await.0, StatusCode::OK);
}

/// `min_version = "1.3"` refuses a client that offers TLS 1.2 only, which the default
/// (`"1.2"`) accepts.
#[tokio::test]
async fn min_version_refuses_older_clients() {
    let ca = TestCa::new("test ca");
    let dir = tempfile::tempdir().unwrap();
    ca.issue(&["a.test"]).write(dir.path(), "a");
    let upstream = Upstream::start().await;
    let tls12 = ca.client_of_versions(&[b"http/1.1"], &[&rustls::version::TLS12]);
    let name = rustls::pki_types::ServerName::try_from("a.test").unwrap();

    let default = gateway(dir.path(), &upstream, &["a"], "").await;
    let tcp = tokio::net::TcpStream::connect(default.tls.unwrap())
        .await
        .unwrap();
    let stream = tls12
        .connect(name.clone(), tcp)
        .await
        .expect("TLS 1.2 by default");
    assert_eq!(
        stream.get_ref().1.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_2)
    );

    let strict = gateway(dir.path(), &upstream, &["a"], "min_version = \"1.3\"").await;
    let tcp = tokio::net::TcpStream::connect(strict.tls.unwrap()).await.unwrap();
    assert!(tls12.connect(name, tcp).await.is_err(), "TLS 1.2 accepted");
    let stream = connect(&ca.client(&[b"http/1.1"]), strict.tls.unwrap(), "a.test").await;
    assert_eq!(
        stream.get_ref().1.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_3)
    );
}
