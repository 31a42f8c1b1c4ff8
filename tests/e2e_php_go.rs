//! The compose example's topology without Docker: the real `floodgate` binary running
//! `examples/compose/gateway.toml` (service names replaced by local addresses, the PHP
//! upstream's `timeout` 1 s, Redis's 5 s, the site's directory the example's `php/`), a
//! private `redis-server`, the example PHP app under PHP-FPM (Debian `php8.2-fpm`, with the
//! example's pool, spoken to in FastCGI as in the containers) and the example Go app (`go
//! build`, Debian `golang-go`). Clients connect from distinct loopback addresses (127.0.0.2, ...), so
//! per-IP limits and the addresses the apps see are those of different clients.
//!
//! What it pins:
//! - each route's limits and rate-limit headers, exact, with the counters in Redis;
//! - PHP and Go see the client in X-Real-IP and X-Forwarded-For (PHP also in REMOTE_ADDR),
//!   never a planted value, and `X_Forwarded_For` (PHP's `HTTP_X_FORWARDED_FOR`) never
//!   reaches PHP;
//! - PHP's X-Powered-By never reaches the client; the site's static file is served by
//!   floodgate, compressed, and a script's source never;
//! - a POST form and a multipart upload reach PHP intact; a slow page is a 504;
//! - failed logins (`count = "failures"`) lock a client out after the fifth, its next
//!   attempts never reaching PHP, and the limit-state API shows and lifts the lock;
//! - with the example's two PHP servers (`php-a`, `php-b`), a PHP session (PHPSESSID)
//!   stays on one server, sessions spread over both, and killing a server loses no
//!   request.
//!
//! `php-fpm8.2`, `go` and `redis-server` are required: without them these tests fail, they do not
//! skip (`.ci/run` installs them).

use crate::common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt as _;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt as _;

use crate::common::process::FloodgateProcess;
use crate::common::redis_server::RedisServer;
use crate::common::{closed_port, raw_request};

const EXAMPLE: &str = "examples/compose";
/// The PHP upstream's `timeout` in the test (the example's is 30 s).
const PHP_TIMEOUT: &str = "1s";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Panics, loudly, when `program` cannot run: these tests must not pass by skipping.
fn require(program: &str, args: &[&str], package: &str) {
    let outcome = Command::new(program).args(args).output();
    match outcome {
        Ok(output) if output.status.success() => {}
        Ok(output) => panic!(
            "`{program} {}` failed ({}): {}\ntests/e2e_php_go.rs needs {program} from the Debian \
             package {package} (bash .ci/run installs it)",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ),
        Err(e) => panic!(
            "cannot run `{program}`: {e}\ntests/e2e_php_go.rs needs {program} from the Debian package \
             {package}: apt-get install -y {package} (bash .ci/run installs it when missing)"
        ),
    }
}

/// The example Go app, built once per test run (the Go build cache lives under the target
/// directory, so a build after the first takes a moment).
fn go_app_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        require("go", &["version"], "golang-go");
        let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("e2e-go");
        std::fs::create_dir_all(&work).unwrap();
        // Built under a private name and renamed, so concurrent test runs never see half a file.
        let partial = work.join(format!("goapp.{}", std::process::id()));
        let binary = work.join("goapp");
        let output = Command::new("go")
            .args(["build", "-o"])
            .arg(&partial)
            .arg(".")
            .current_dir(repo().join(EXAMPLE).join("go"))
            .env("GOCACHE", work.join("cache"))
            .env("GOPATH", work.join("gopath"))
            .env("GOFLAGS", "-mod=mod")
            .env("GOPROXY", "off")
            .env("GOTOOLCHAIN", "local")
            .env("GOTELEMETRY", "off")
            .env("CGO_ENABLED", "0")
            .output()
            .expect("run go build");
        assert!(
            output.status.success(),
            "go build of {EXAMPLE}/go failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        std::fs::rename(&partial, &binary).unwrap();
        binary
    })
}

/// A child process killed with its whole process group on drop (PHP-FPM forks its workers;
/// killing only the master would leave them running).
struct Group {
    child: Child,
}

impl Group {
    fn spawn(command: &mut Command) -> Group {
        let program = command.get_program().to_string_lossy().into_owned();
        let child = command
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
        Group { child }
    }
}

impl Drop for Group {
    #[allow(unsafe_code)] // kill(2)
    fn drop(&mut self) {
        let pgid = libc::pid_t::try_from(self.child.id()).expect("pid fits pid_t");
        // SAFETY: kill(2) with plain integers; the group is our own child's, not yet reaped.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// PHP-FPM (Debian's `php-fpm8.2`) running the example PHP app with the example's own pool
/// (`php-fpm/pool.conf`: the containers' 10 static workers), listening on a free port
/// instead of the containers' 9000, with an access log.
struct Php {
    addr: SocketAddr,
    /// Its access log: a line `ADDRESS [STATUS]: METHOD REQUEST_URI` per request answered.
    log: PathBuf,
    _process: Group,
    _dir: tempfile::TempDir,
}

impl Php {
    fn start() -> Php {
        Php::start_with(&[], &[])
    }

    /// With `-d` settings `ini` (`name=value`) and extra environment variables `envs`.
    fn start_with(ini: &[String], envs: &[(&str, &str)]) -> Php {
        require("php-fpm8.2", &["--version"], "php8.2-fpm");
        let dir = tempfile::tempdir().unwrap();
        let pool = repo().join(EXAMPLE).join("php-fpm/pool.conf");
        // A free port now may be taken before PHP-FPM binds it: then another.
        for _ in 0..5 {
            let addr = SocketAddr::from(([127, 0, 0, 1], closed_port()));
            let port = addr.port();
            let log = dir.path().join(format!("access-{port}.log"));
            let errors = dir.path().join(format!("error-{port}.log"));
            let config = dir.path().join(format!("fpm-{port}.conf"));
            std::fs::write(
                &config,
                format!(
                    "[global]\npid = {dir}/fpm-{port}.pid\nerror_log = {errors}\ndaemonize = no\n\n\
                     include = {pool}\n\n[www]\nlisten = {addr}\naccess.log = {log}\n\
                     access.format = \"%{{REMOTE_ADDR}}e [%s]: %m %{{REQUEST_URI}}e\"\n",
                    dir = dir.path().display(),
                    errors = errors.display(),
                    pool = pool.display(),
                    log = log.display(),
                ),
            )
            .unwrap();
            let mut process = Group::spawn(
                Command::new("php-fpm8.2")
                    .args(["-F", "-R", "-y"])
                    .arg(&config)
                    .args(ini.iter().flat_map(|setting| ["-d", setting]))
                    .envs(envs.iter().copied())
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null()),
            );
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if TcpStream::connect(addr).is_ok() {
                    return Php {
                        addr,
                        log,
                        _process: process,
                        _dir: dir,
                    };
                }
                if process.child.try_wait().unwrap().is_some() || Instant::now() > deadline {
                    eprintln!(
                        "php-fpm on {addr} did not start:\n{}",
                        std::fs::read_to_string(&errors).unwrap_or_default()
                    );
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!("php-fpm did not start (see the logs above)");
    }

    fn url(&self) -> String {
        format!("fastcgi://{}", self.addr)
    }

    /// How many requests the server logged as `request` (`POST /login.php`) answered with
    /// `status`: its log has a line `127.0.0.9 [401]: POST /login.php` for each.
    fn logged(&self, status: u16, request: &str) -> usize {
        let line_end = format!("[{status}]: {request}");
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|line| line.ends_with(&line_end))
            .count()
    }

    /// Waits until the server has logged `expected` requests `request` answered with
    /// `status` (it logs a request once it has answered it, so a moment after the client
    /// has the response), and checks that it has not logged more.
    async fn wait_for_logged(&self, status: u16, request: &str, expected: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let logged = self.logged(status, request);
            if logged >= expected {
                assert_eq!(
                    logged,
                    expected,
                    "`{request}` answered {status}:\n{}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "PHP logged {logged} of {expected} `{request}` answered {status}:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The example Go app on a port it picked, read from its "go-app listening on" line.
struct GoApp {
    addr: SocketAddr,
    _process: Group,
}

impl GoApp {
    fn start() -> GoApp {
        let mut process = Group::spawn(
            Command::new(go_app_binary())
                .env("LISTEN_ADDR", "127.0.0.1:0")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit()),
        );
        let stdout = process.child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the Go app did not print its address within 10 s");
        let addr = line
            .strip_prefix("go-app listening on ")
            .unwrap_or_else(|| panic!("unexpected first line from the Go app: {line:?}"))
            .parse()
            .expect("the Go app's address");
        GoApp {
            addr,
            _process: process,
        }
    }
}

/// The whole topology, private to one test.
struct Topology {
    gateway: FloodgateProcess,
    php: Php,
    _go: GoApp,
    redis: RedisServer,
}

/// `text` with `from` replaced by `to`, which must occur exactly once.
fn replace_once(text: &str, from: &str, to: &str) -> String {
    assert_eq!(
        text.matches(from).count(),
        1,
        "{EXAMPLE}/gateway.toml should contain {from:?} exactly once"
    );
    text.replacen(from, to, 1)
}

/// The example's PHP servers line (two containers, `php-a` and `php-b`).
const EXAMPLE_PHP_SERVERS: &str = "servers = [\"fastcgi://php-a:9000\", \"fastcgi://php-b:9000\"]";

/// The example's `gateway.toml` with local listeners, Redis at `redis_url`, and `rewrites`.
fn example_config(redis_url: &str, rewrites: Vec<(&str, String)>) -> String {
    let example = std::fs::read_to_string(repo().join(EXAMPLE).join("gateway.toml")).unwrap();
    let mut config = example;
    let local = [
        ("listen = \"0.0.0.0:8080\"", "listen = \"127.0.0.1:0\"".to_owned()),
        (
            "admin_listen = \"0.0.0.0:9901\"",
            "admin_listen = \"127.0.0.1:0\"".to_owned(),
        ),
        ("url = \"redis://redis:6379/0\"", format!("url = \"{redis_url}\"")),
    ];
    // The config is written to a temporary directory: its error pages are read from the
    // example's.
    let pages = ["errors/502.html", "errors/503.html"]
        .map(|page| (page, repo().join(EXAMPLE).join(page).display().to_string()));
    for (from, to) in local.into_iter().chain(pages).chain(rewrites) {
        config = replace_once(&config, from, &to);
    }
    // The site's directory, which floodgate and PHP-FPM both see where it is here (two
    // routes have it).
    let site = repo().join(EXAMPLE).join("php").display().to_string();
    for (from, to) in [("root = \"php\"", &site), ("php_root = \"/var/www/html\"", &site)] {
        assert_eq!(config.matches(from).count(), 2, "{EXAMPLE}/gateway.toml: {from}");
        config = config.replace(from, &from.replace(from.split('"').nth(1).unwrap(), to));
    }
    // The check asks PHP-FPM for the script by its file, under php_root.
    config = replace_once(
        &config,
        "path = \"/var/www/html/health.php\"",
        &format!("path = \"{site}/health.php\""),
    );
    let parsed = floodgate::Config::parse(Path::new("gateway.toml"), &config).unwrap();
    assert!(parsed.warnings().is_empty(), "{:?}", parsed.warnings());
    config
}

impl Topology {
    fn start() -> Topology {
        let redis = RedisServer::start();
        let php = Php::start();
        let go = GoApp::start();
        let config = example_config(
            &redis.url(),
            vec![
                // One PHP server: these tests pin what one app server does (a slow page's
                // 504 would be tried again on the other server, and the pages would be
                // spread over two logs). The sessions tests run both.
                (EXAMPLE_PHP_SERVERS, format!("servers = [\"{}\"]", php.url())),
                (
                    "url = \"http://go:8080\"",
                    format!("url = \"http://{}\"", go.addr),
                ),
                ("timeout = \"30s\"", format!("timeout = \"{PHP_TIMEOUT}\"")),
                // These tests pin exact counts in Redis: a script call that took over the
                // example's 50 ms on a starved machine would be decided locally instead
                // (`on_error = "local"`, as it should) and be missing from Redis's count.
                // tests/redis_failure.rs pins what a slow Redis does.
                ("timeout = \"50ms\"", "timeout = \"5s\"".to_owned()),
            ],
        );
        // The example's own admin_token, whatever the shell running the tests has (an empty
        // FLOODGATE_ADMIN_TOKEN is ignored).
        let gateway = FloodgateProcess::start(&config, &[("FLOODGATE_ADMIN_TOKEN", "")]);
        let topology = Topology {
            gateway,
            php,
            _go: go,
            redis,
        };
        topology.wait_for_redis();
        topology
    }

    /// Until the gateway's store answers from Redis (`/readyz` is 200 under `local` anyway).
    fn wait_for_redis(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.redis.cli(&["CLIENT", "LIST"]).lines().count() < 2 {
            assert!(Instant::now() < deadline, "floodgate did not connect to Redis");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn url(&self, path: &str) -> String {
        self.gateway.url(path)
    }
}

/// An HTTP/1.1 client whose connections come from `source` (a loopback address).
fn client_from(source: &str) -> Client<HttpConnector, Full<Bytes>> {
    let mut connector = HttpConnector::new();
    connector.set_local_address(Some(source.parse::<IpAddr>().unwrap()));
    Client::builder(TokioExecutor::new()).build(connector)
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> &str {
        let values: Vec<_> = self.headers.get_all(name).iter().collect();
        assert_eq!(values.len(), 1, "{name}: {values:?}");
        values[0].to_str().unwrap()
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

async fn send(client: &Client<HttpConnector, Full<Bytes>>, request: Request<Full<Bytes>>) -> Answer {
    let response = client.request(request).await.expect("request");
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.expect("body").to_bytes();
    Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

fn get(url: &str) -> http::request::Builder {
    Request::get(url)
}

fn empty() -> Full<Bytes> {
    Full::new(Bytes::new())
}

/// `t` of a fresh window or lock: 60, or 59 when a second boundary passed meanwhile.
fn minute_item(name: &str, remaining: u64, value_part: &str) -> bool {
    [60, 59]
        .iter()
        .any(|t| value_part == format!("\"{name}\";r={remaining};t={t}"))
}

/// The body of a raw HTTP/1.1 response, chunked or not.
fn raw_body(response: &str) -> String {
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no head: {response:?}"));
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return body.to_owned();
    }
    let mut out = String::new();
    let mut rest = body;
    loop {
        let (size, after) = rest.split_once("\r\n").expect("chunk size line");
        let size = usize::from_str_radix(size.split(';').next().unwrap().trim(), 16).expect("chunk size");
        if size == 0 {
            return out;
        }
        out.push_str(&after[..size]);
        rest = &after[size + 2..];
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn php_sees_the_real_client_and_the_php_route_has_its_quota_headers() {
    let topology = Topology::start();
    let client = client_from("127.0.0.2");

    let planted = get(&topology.url("/"))
        .header("x-forwarded-for", "6.6.6.6")
        .header("x-real-ip", "6.6.6.6")
        .header("forwarded", "for=6.6.6.6")
        .body(empty())
        .unwrap();
    let first = send(&client, planted).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    assert_eq!(first.header("ratelimit-policy"), "\"per_ip_minute\";q=300;w=60");
    assert_eq!(first.header("ratelimit"), "\"per_ip_minute\";r=299;t=60");
    // `[server] response_headers` hide PHP's X-Powered-By; the route sets X-Frame-Options.
    assert!(first.headers.get("x-powered-by").is_none(), "{:?}", first.headers);
    assert_eq!(first.header("x-frame-options"), "SAMEORIGIN");
    assert!(
        !first.body.contains("6.6.6.6"),
        "a planted address reached PHP: {}",
        first.body
    );

    let php = first.json();
    assert_eq!(php["app"], "php");
    assert_eq!(
        php["REMOTE_ADDR"], "127.0.0.2",
        "floodgate gives PHP the client's address"
    );
    assert_eq!(php["HTTP_X_REAL_IP"], "127.0.0.2");
    assert_eq!(php["HTTP_X_FORWARDED_FOR"], "127.0.0.2");
    assert_eq!(php["headers"]["HTTP_VIA"], "1.1 floodgate");
    assert_eq!(php["headers"]["HTTP_X_FORWARDED_PROTO"], "http");
    assert!(php["headers"].get("HTTP_FORWARDED").is_none(), "{php}");

    // Another client has its own quota and its own address.
    let other = send(
        &client_from("127.0.0.3"),
        get(&topology.url("/")).body(empty()).unwrap(),
    )
    .await;
    assert_eq!(other.header("ratelimit"), "\"per_ip_minute\";r=299;t=60");
    assert_eq!(other.json()["HTTP_X_REAL_IP"], "127.0.0.3");

    let second = send(&client, get(&topology.url("/")).body(empty()).unwrap()).await;
    assert!(
        minute_item("per_ip_minute", 298, second.header("ratelimit")),
        "{}",
        second.header("ratelimit")
    );

    // The counters live in Redis, under the example's prefix.
    let keys = topology
        .redis
        .cli(&["--scan", "--pattern", "floodgate:*per_ip_minute*"]);
    assert_eq!(keys.lines().count(), 2, "one counter per client IP: {keys}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_route_has_a_token_bucket_per_key_with_a_lockout_and_go_sees_the_client() {
    let topology = Topology::start();
    let client = client_from("127.0.0.4");
    let api = |key: &str| {
        get(&topology.url("/api/hello?x=1"))
            .header("x-api-key", key)
            .header("x-forwarded-for", "6.6.6.6")
            .body(empty())
            .unwrap()
    };
    let policy = "\"per_ip_minute\";q=300;w=60, \"api_key\";q=10;w=2";

    // The bucket refills 1 token per 200 ms; ten quick requests see it drain one by one,
    // t being the time to refill it whole (1 s for up to 5 missing tokens, then 2 s), and
    // the 11th is refused and locks the key out for a minute. Those figures are exact
    // only while no token has come back, so a run that takes 200 ms or more (a loaded
    // machine) starts again with a fresh key; the per-IP minute goes on counting.
    let mut passed_per_ip = 0u64;
    let mut locked_key = None;
    let mut locks = 0u64;
    for attempt in 1..=5 {
        let key = format!("key-1-{attempt}");
        let started = Instant::now();
        let mut answers = Vec::new();
        for _ in 0..11 {
            answers.push(send(&client, api(&key)).await);
        }
        if started.elapsed() >= Duration::from_millis(200) {
            passed_per_ip += answers.iter().filter(|a| a.status == StatusCode::OK).count() as u64;
            locks += u64::from(answers.iter().any(|a| a.status == StatusCode::TOO_MANY_REQUESTS));
            continue;
        }
        let refused = answers.pop().unwrap();
        for (i, answer) in (0u64..).zip(&answers) {
            assert_eq!(answer.status, StatusCode::OK, "request {i}: {}", answer.body);
            assert_eq!(answer.header("ratelimit-policy"), policy);
            let ratelimit = answer.header("ratelimit");
            let (minute, bucket) = ratelimit.split_once(", ").unwrap();
            assert!(
                minute_item("per_ip_minute", 299 - passed_per_ip - i, minute),
                "{ratelimit}"
            );
            let t = if i < 5 { 1 } else { 2 };
            assert_eq!(bucket, format!("\"api_key\";r={};t={t}", 9 - i), "{ratelimit}");
            let go = answer.json();
            assert_eq!(go["app"], "go");
            assert_eq!(go["path"], "/api/hello");
            assert_eq!(go["query"], "x=1");
            assert_eq!(go["x_real_ip"], "127.0.0.4");
            assert_eq!(go["x_forwarded_for"], "127.0.0.4", "never the planted 6.6.6.6");
            assert_eq!(go["via"], "1.1 floodgate");
            assert!(
                go["remote_addr"].as_str().unwrap().starts_with("127.0.0.1:"),
                "{go}"
            );
        }
        passed_per_ip += 10;

        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.body, "Too Many Requests\n");
        assert_eq!(refused.header("retry-after"), "60");
        assert_eq!(refused.header("ratelimit-policy"), policy);
        let ratelimit = refused.header("ratelimit");
        let (minute, bucket) = ratelimit.split_once(", ").unwrap();
        assert!(
            minute_item("per_ip_minute", 300 - passed_per_ip, minute),
            "refusals consume nothing: {ratelimit}"
        );
        // (`t` of the locking refusal is the bucket's own refill time; Retry-After is the lock.)
        assert!(bucket.starts_with("\"api_key\";r=0;t="), "{ratelimit}");
        locks += 1;
        locked_key = Some(key);
        break;
    }
    let locked_key = locked_key.expect("eleven requests in under 200 ms in one of five runs");

    // Another key from the same client has its own bucket.
    let other_key = send(&client, api("key-2")).await;
    assert_eq!(other_key.status, StatusCode::OK);
    assert!(other_key.header("ratelimit").ends_with("\"api_key\";r=9;t=1"));

    // The bucket refills in 2 s; the lock-out holds anyway.
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let still = send(&client, api(&locked_key)).await;
    assert_eq!(still.status, StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = still.header("retry-after").parse().unwrap();
    assert!((56..=58).contains(&retry), "Retry-After {retry}");
    assert!(
        still
            .header("ratelimit")
            .ends_with(&format!("\"api_key\";r=0;t={retry}")),
        "a locked key's reset is the end of the lock: {}",
        still.header("ratelimit")
    );

    let lock = topology
        .redis
        .cli(&["--scan", "--pattern", "floodgate:*api_key:lock"]);
    assert_eq!(
        lock.lines().count() as u64,
        locks,
        "the lock lives in Redis, one per locked key: {lock}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_ip_quota_is_shared_by_both_routes_and_refuses_the_301st() {
    let topology = Topology::start();
    let client = client_from("127.0.0.5");
    for i in 0..10 {
        let key = format!("key-{i}");
        let request = get(&topology.url("/api/x"))
            .header("x-api-key", key)
            .body(empty())
            .unwrap();
        assert_eq!(send(&client, request).await.status, StatusCode::OK);
    }
    // Four at a time, as many as PHP has workers.
    let pages = (0..290).map(|_| {
        let client = client.clone();
        let url = topology.url("/");
        async move { send(&client, get(&url).body(empty()).unwrap()).await.status }
    });
    let statuses: Vec<StatusCode> = futures_util::stream::iter(pages)
        .buffer_unordered(4)
        .collect()
        .await;
    assert!(statuses.iter().all(|s| *s == StatusCode::OK), "{statuses:?}");
    // Every decision was Redis's: none fell back to the local store.
    let metrics = admin_metrics(&topology).await;
    assert_eq!(
        metric(&metrics, "floodgate_store_errors_total{store=\"redis\"}"),
        0.0,
        "{metrics}"
    );

    for path in ["/", "/api/x"] {
        let refused = send(&client, get(&topology.url(path)).body(empty()).unwrap()).await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{path}");
        assert!(
            refused
                .header("ratelimit")
                .starts_with("\"per_ip_minute\";r=0;t="),
            "{path}: {}",
            refused.header("ratelimit")
        );
        let retry: u64 = refused.header("retry-after").parse().unwrap();
        assert!((1..=60).contains(&retry), "Retry-After {retry}");
    }
    // Another client is not affected.
    let other = send(
        &client_from("127.0.0.6"),
        get(&topology.url("/")).body(empty()).unwrap(),
    )
    .await;
    assert_eq!(other.status, StatusCode::OK);
}

/// Browsers over HTTP/2 send each cookie in a `cookie` field of its own; PHP behind
/// floodgate must still find its session among them (before floodgate joined them, PHP
/// read `a=1, PHPSESSID=..., theme=dark` as the one cookie `a`, and started a new session
/// on every request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn php_finds_its_session_among_http2_cookie_crumbs() {
    let topology = Topology::start();
    let client = common::h2c_client();
    // New to every run: PHP keeps its session files in the system's temporary directory.
    let session = format!(
        "crumbs{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let mut counts = Vec::new();
    for _ in 0..3 {
        let request = get(&topology.url("/session.php"))
            .header("cookie", "a=1")
            .header("cookie", format!("PHPSESSID={session}"))
            .header("cookie", "theme=dark")
            .body(empty())
            .unwrap();
        let answer = send(&client, request).await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
        let php = answer.json();
        assert_eq!(php["session"], session, "PHP did not see its cookie: {php}");
        counts.push(php["n"].as_u64().unwrap());
    }
    // One session on one server (the cookie picks it): counted up request by request.
    assert_eq!(counts, [1, 2, 3]);
}

/// The route's `root` is the example's `php/`: floodgate serves its static file itself and
/// runs scripts on PHP-FPM, a path that names none on the front controller (index.php);
/// with the route's `compress`, a page PHP sends goes out compressed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floodgate_serves_the_sites_files_and_php_runs_its_scripts() {
    let topology = Topology::start();
    let client = client_from("127.0.0.11");
    let on_disk = std::fs::read_to_string(repo().join(EXAMPLE).join("php/style.css")).unwrap();
    let css = send(&client, get(&topology.url("/style.css")).body(empty()).unwrap()).await;
    assert_eq!(css.status, StatusCode::OK);
    assert_eq!(css.header("content-type"), "text/css; charset=utf-8");
    assert!(css.headers.contains_key("etag") && css.headers.contains_key("last-modified"));
    assert_eq!(css.body, on_disk);
    // The route's limit counts files too.
    assert_eq!(css.header("ratelimit"), "\"per_ip_minute\";r=299;t=60");

    // No file: the front controller runs, with the path the client asked for.
    let page = send(
        &client,
        get(&topology.url("/no/such/page?x=1")).body(empty()).unwrap(),
    )
    .await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert_eq!(page.json()["uri"], "/no/such/page?x=1");

    // A page of a few KB, for a client that accepts gzip: compressed, and whole.
    let padding = "p".repeat(3000);
    let compressed = client
        .request(
            get(&topology.url("/"))
                .header("accept-encoding", "gzip")
                .header("x-padding", &padding)
                .body(empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(compressed.headers()["content-encoding"], "gzip");
    assert_eq!(compressed.headers()["vary"], "Accept-Encoding");
    let encoded = compressed.into_body().collect().await.unwrap().to_bytes();
    let mut decoded = String::new();
    async_compression::tokio::bufread::GzipDecoder::new(&encoded[..])
        .read_to_string(&mut decoded)
        .await
        .unwrap();
    let php: Value = serde_json::from_str(&decoded).unwrap();
    assert_eq!(php["headers"]["HTTP_X_PADDING"], padding.as_str());

    // PHP-FPM saw the scripts, never the file.
    let deadline = Instant::now() + Duration::from_secs(10);
    while topology.php.logged(200, "GET /no/such/page?x=1") == 0 {
        assert!(Instant::now() < deadline, "PHP-FPM did not log the page");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let log = std::fs::read_to_string(&topology.php.log).unwrap();
    assert!(!log.contains("style.css"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folded_forwarding_header_never_reaches_php() {
    let topology = Topology::start();
    let raw = "GET / HTTP/1.1\r\nHost: example.test\r\nX_Forwarded_For: 1.2.3.4\r\n\
               X_Real_IP: 1.2.3.4\r\nX.Forwarded.Proto: gopher\r\nX.Debug: 1\r\n\
               Connection: close\r\n\r\n";

    // Passed on as HTTP_* parameters, the underscore spelling would become
    // HTTP_X_FORWARDED_FOR: the attack. Through floodgate, PHP sees only floodgate's values.
    let response = raw_request(topology.gateway.listen, raw.as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 200 "), "{response}");
    let body = raw_body(&response);
    assert!(
        !body.contains("1.2.3.4"),
        "an underscore header reached PHP: {body}"
    );
    let php: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(php["HTTP_X_FORWARDED_FOR"], "127.0.0.1");
    assert_eq!(php["HTTP_X_REAL_IP"], "127.0.0.1");
    assert_eq!(php["headers"]["HTTP_X_FORWARDED_PROTO"], "http", "{php}");
    assert_eq!(php["headers"].get("HTTP_X_DEBUG"), None, "{php}");
}

/// Deterministic bytes of every value, with CRLFs and a boundary look-alike inside.
fn upload_bytes(len: usize) -> Vec<u8> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut bytes: Vec<u8> = (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect();
    bytes[1000..1030].copy_from_slice(b"\r\n--floodgate-boundary-ish\r\n\r\n");
    bytes
}

fn md5sum(bytes: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("upload.bin");
    std::fs::write(&path, bytes).unwrap();
    let output = Command::new("md5sum")
        .arg(&path)
        .output()
        .expect("md5sum (coreutils)");
    String::from_utf8(output.stdout).unwrap()[..32].to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_form_and_a_file_upload_reach_php_intact() {
    let topology = Topology::start();
    let client = client_from("127.0.0.7");

    let form = send(
        &client,
        Request::post(topology.url("/form.php"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(Full::new(Bytes::from_static(
                b"name=Ada+Lovelace&comment=a%26b%3Dc+%C3%A9&empty=",
            )))
            .unwrap(),
    )
    .await;
    assert_eq!(form.status, StatusCode::OK, "{}", form.body);
    let php = form.json();
    let fields: HashMap<String, String> = serde_json::from_value(php["fields"].clone()).unwrap();
    let expected: HashMap<String, String> = [("name", "Ada Lovelace"), ("comment", "a&b=c é"), ("empty", "")]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .into();
    assert_eq!(fields, expected);
    assert_eq!(php["HTTP_X_REAL_IP"], "127.0.0.7");

    let file = upload_bytes(1_500_000);
    let boundary = "----floodgate-e2e-7d1f";
    let mut body = Vec::new();
    body.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"title\"\r\n\r\nquarterly report\r\n\
             --{boundary}\r\nContent-Disposition: form-data; name=\"upload\"; filename=\"report.bin\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(&file);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let upload = send(
        &client,
        Request::post(topology.url("/form.php"))
            .header(
                "content-type",
                format!("multipart/form-data; boundary={boundary}"),
            )
            .body(Full::new(Bytes::from(body)))
            .unwrap(),
    )
    .await;
    assert_eq!(upload.status, StatusCode::OK, "{}", upload.body);
    let php = upload.json();
    assert_eq!(php["fields"]["title"], "quarterly report");
    let uploaded = &php["files"]["upload"];
    assert_eq!(uploaded["error"], 0, "{php}");
    assert_eq!(uploaded["name"], "report.bin");
    assert_eq!(uploaded["size"], file.len());
    assert_eq!(uploaded["md5"], md5sum(&file).as_str());
    let sha256: String = Sha256::digest(&file).iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(uploaded["sha256"], sha256.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_php_page_hits_the_route_timeout_with_504() {
    let topology = Topology::start();
    let client = client_from("127.0.0.8");

    let started = Instant::now();
    let slow = send(&client, get(&topology.url("/?sleep=3")).body(empty()).unwrap()).await;
    let took = started.elapsed();
    assert_eq!(slow.status, StatusCode::GATEWAY_TIMEOUT, "{}", slow.body);
    assert_eq!(slow.body.lines().count(), 1, "{}", slow.body);
    assert!(
        took >= Duration::from_millis(950) && took < Duration::from_millis(2_500),
        "the 1 s timeout took {took:?}"
    );
    // A limited route's answers carry the limit's headers, errors included.
    assert!(minute_item("per_ip_minute", 299, slow.header("ratelimit")));

    // PHP still serves the next page while the slow one sleeps.
    let next = send(&client, get(&topology.url("/")).body(empty()).unwrap()).await;
    assert_eq!(next.status, StatusCode::OK);

    let metrics = admin_metrics(&topology).await;
    assert!(
        metrics
            .lines()
            .any(|l| l == "floodgate_upstream_errors_total{upstream=\"php\",kind=\"timeout\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l == "floodgate_requests_total{route=\"php\",status=\"504\"} 1"),
        "{metrics}"
    );
}

async fn admin_metrics(topology: &Topology) -> String {
    let (_, _, body) = common::get(&topology.gateway.admin_url("/metrics")).await;
    body
}

// Login protection: examples/compose/php/login.php (401 for a wrong password, 200 for the
// demo credentials) on the example's `login` route, whose `login_failures` limit counts
// failures only (5 in 15 minutes per client address, then locked out for an hour), and the
// limit-state API on the admin listener with the example's `admin_token`.

/// The demo credentials in login.php.
const LOGIN_USER: &str = "demo";
const LOGIN_PASSWORD: &str = "floodgate-demo";
/// What PHP-FPM logs for a login attempt.
const LOGIN: &str = "POST /login.php";

/// `server.admin_token` of the example's gateway.toml.
fn example_admin_token() -> String {
    let example = std::fs::read_to_string(repo().join(EXAMPLE).join("gateway.toml")).unwrap();
    let example: toml::Table = example.parse().expect("the example's TOML");
    example["server"]["admin_token"]
        .as_str()
        .expect("the example sets server.admin_token")
        .to_owned()
}

/// A login form posted to the gateway.
fn login(topology: &Topology, password: &str) -> Request<Full<Bytes>> {
    login_at(topology, "/login.php", password)
}

/// A login form posted to `path` on the gateway.
fn login_at(topology: &Topology, path: &str, password: &str) -> Request<Full<Bytes>> {
    Request::post(topology.url(path))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Full::new(Bytes::from(format!(
            "user={LOGIN_USER}&password={password}"
        ))))
        .unwrap()
}

/// A call of the limit-state API, with `Authorization: Bearer TOKEN` when `token` is given.
fn admin_call(topology: &Topology, method: Method, path: &str, token: Option<&str>) -> Request<Full<Bytes>> {
    let mut request = Request::builder()
        .method(method)
        .uri(topology.gateway.admin_url(path));
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    request.body(empty()).unwrap()
}

/// One item of a `RateLimit` header, `"NAME";r=R;t=T`, as (name, r, t).
fn ratelimit_item(item: &str) -> (String, u64, u64) {
    let mut fields = item.split(';');
    let name = fields.next().unwrap().trim_matches('"').to_owned();
    let mut value = |prefix: &str| -> u64 {
        fields
            .next()
            .and_then(|field| field.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in {item:?}"))
            .parse()
            .unwrap()
    };
    let r = value("r=");
    let t = value("t=");
    (name, r, t)
}

/// The `RateLimit` header of a login answer admitted by both limits: the per-IP minute,
/// `minute_left` remaining, and the room left for failures, `failures_left`. `t` of a
/// window counts down from its length (60 s, 900 s) as the test runs.
fn assert_login_items(answer: &Answer, minute_left: u64, failures_left: u64) {
    assert_eq!(
        answer.header("ratelimit-policy"),
        "\"per_ip_minute\";q=300;w=60, \"login_failures\";q=5;w=900"
    );
    let ratelimit = answer.header("ratelimit");
    let (minute, failures) = ratelimit.split_once(", ").expect("two items");
    let (name, r, t) = ratelimit_item(minute);
    assert_eq!((name.as_str(), r), ("per_ip_minute", minute_left), "{ratelimit}");
    assert!((45..=60).contains(&t), "{ratelimit}");
    let (name, r, t) = ratelimit_item(failures);
    assert_eq!(
        (name.as_str(), r),
        ("login_failures", failures_left),
        "{ratelimit}"
    );
    assert!((885..=900).contains(&t), "{ratelimit}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_logins_lock_a_client_out_before_php_and_the_admin_api_lifts_the_lock() {
    let topology = Topology::start();
    let token = example_admin_token();
    let attacker = client_from("127.0.0.9");
    let user = client_from("127.0.0.10");
    let admin = client_from("127.0.0.1");

    // Five wrong passwords: each reaches PHP, which answers 401; the login_failures item
    // shows the room left for failures before each one.
    for i in 0..5u64 {
        let failed = send(&attacker, login(&topology, "guess")).await;
        assert_eq!(failed.status, StatusCode::UNAUTHORIZED, "{}", failed.body);
        let php = failed.json();
        assert_eq!(php["login"], "failed");
        assert_eq!(php["HTTP_X_REAL_IP"], "127.0.0.9");
        assert_login_items(&failed, 299 - i, 5 - i);
    }
    topology.php.wait_for_logged(401, LOGIN, 5).await;

    // The fifth failure locked the address out for an hour: every attempt is now refused
    // by floodgate, the right password included, and consumes nothing.
    for password in ["guess", LOGIN_PASSWORD] {
        let refused = send(&attacker, login(&topology, password)).await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{}", refused.body);
        assert_eq!(refused.body, "Too Many Requests\n");
        let retry: u64 = refused.header("retry-after").parse().unwrap();
        assert!((3590..=3600).contains(&retry), "Retry-After {retry}");
        // Both limits were decided together (the minute's five requests, none refused,
        // are in its item); the locked one refused.
        assert_eq!(
            refused.header("ratelimit-policy"),
            "\"per_ip_minute\";q=300;w=60, \"login_failures\";q=5;w=900"
        );
        let ratelimit = refused.header("ratelimit");
        assert!(ratelimit.starts_with("\"per_ip_minute\";r=295;t="), "{ratelimit}");
        assert!(
            ratelimit.ends_with(&format!(", \"login_failures\";r=0;t={retry}")),
            "{ratelimit}"
        );
    }

    // PHP runs /login.php/anything as login.php, and login.php reads the query string too:
    // neither way reaches PHP past the lock.
    let around = [
        login_at(&topology, "/login.php/x", LOGIN_PASSWORD),
        login_at(&topology, "/login.php%2Fx", LOGIN_PASSWORD),
        get(&topology.url(&format!("/login.php?user={LOGIN_USER}&password={LOGIN_PASSWORD}")))
            .body(empty())
            .unwrap(),
    ];
    for request in around {
        let target = request.uri().to_string();
        let refused = send(&attacker, request).await;
        assert_eq!(
            refused.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{target}: {}",
            refused.body
        );
    }

    // Another client logs in meanwhile.
    let welcome = send(&user, login(&topology, LOGIN_PASSWORD)).await;
    assert_eq!(welcome.status, StatusCode::OK, "{}", welcome.body);
    let php = welcome.json();
    assert_eq!(php["login"], "ok");
    assert_eq!(php["user"], LOGIN_USER);
    assert_eq!(php["HTTP_X_REAL_IP"], "127.0.0.10");
    assert_login_items(&welcome, 299, 5);
    // PHP answered the five failures and that login, and never saw the refused attempts
    // (the second of which had the right password: PHP would have logged a 200).
    topology.php.wait_for_logged(200, LOGIN, 1).await;
    assert_eq!(topology.php.logged(401, LOGIN), 5);
    let php_log = std::fs::read_to_string(&topology.php.log).unwrap();
    assert!(!php_log.contains("/login.php/"), "{php_log}");
    assert!(!php_log.contains("/login.php?"), "{php_log}");

    // The lock and the failures' counter live in Redis. The other client's login took
    // its unit before PHP answered and gave it back: its counter holds no failure.
    let keys = topology
        .redis
        .cli(&["--scan", "--pattern", "floodgate:{i127.0.0.9}:login_failures:*"]);
    let mut kinds: Vec<&str> = keys.lines().map(|key| key.rsplit(':').next().unwrap()).collect();
    kinds.sort_unstable();
    assert_eq!(kinds, ["fw", "lock"], "the attacker's counter and lock: {keys}");
    let user_failures = topology
        .redis
        .cli(&["get", "floodgate:{i127.0.0.10}:login_failures:fw"]);
    assert_eq!(user_failures.trim(), "0");

    // The limit-state API: without the token, or with another one, 401.
    let state_path = "/limits/login_failures/state?client_ip=127.0.0.9";
    for wrong in [None, Some("not-the-example-admin-token")] {
        let refused = send(&admin, admin_call(&topology, Method::GET, state_path, wrong)).await;
        assert_eq!(
            refused.status,
            StatusCode::UNAUTHORIZED,
            "{wrong:?}: {}",
            refused.body
        );
        assert_eq!(refused.header("www-authenticate"), "Bearer");
        let refused = send(&admin, admin_call(&topology, Method::DELETE, state_path, wrong)).await;
        assert_eq!(
            refused.status,
            StatusCode::UNAUTHORIZED,
            "{wrong:?}: {}",
            refused.body
        );
    }
    let state = |client: &'static str| {
        let request = admin_call(
            &topology,
            Method::GET,
            &format!("/limits/login_failures/state?client_ip={client}"),
            Some(&token),
        );
        let admin = admin.clone();
        async move {
            let answer = send(&admin, request).await;
            assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
            assert_eq!(answer.header("content-type"), "application/json");
            let state = answer.json();
            assert_eq!(state["limit"], "login_failures", "{state}");
            assert_eq!(
                state["key"],
                serde_json::json!({ "client_ip": client }),
                "{state}"
            );
            state
        }
    };

    // The attacker: no room, locked out for the hour; reading consumed nothing.
    let locked = state("127.0.0.9").await;
    assert_eq!(locked["remaining"], 0, "{locked}");
    let locked_seconds = locked["locked_seconds"].as_u64().unwrap();
    assert!((3590..=3600).contains(&locked_seconds), "{locked}");
    assert_eq!(locked["reset_seconds"], locked_seconds, "{locked}");
    // The user never failed: a fresh key.
    let fresh = state("127.0.0.10").await;
    assert_eq!(
        (
            &fresh["remaining"],
            &fresh["reset_seconds"],
            &fresh["locked_seconds"]
        ),
        (&Value::from(5), &Value::from(900), &Value::from(0)),
        "{fresh}"
    );
    let refused = send(&attacker, login(&topology, LOGIN_PASSWORD)).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "still locked");

    // DELETE lifts the lock and resets the counter, in Redis.
    let lifted = send(
        &admin,
        admin_call(&topology, Method::DELETE, state_path, Some(&token)),
    )
    .await;
    assert_eq!(lifted.status, StatusCode::NO_CONTENT, "{}", lifted.body);
    assert_eq!(lifted.body, "");
    let reset = state("127.0.0.9").await;
    assert_eq!(
        (
            &reset["remaining"],
            &reset["reset_seconds"],
            &reset["locked_seconds"]
        ),
        (&Value::from(5), &Value::from(900), &Value::from(0)),
        "{reset}"
    );
    let keys = topology
        .redis
        .cli(&["--scan", "--pattern", "floodgate:{i127.0.0.9}:login_failures:*"]);
    assert_eq!(keys.lines().count(), 0, "{keys}");

    // The attacker's next login reaches PHP and succeeds. Its refused attempts consumed
    // nothing from the per-IP minute either: 5 of 300 used before this one.
    let back = send(&attacker, login(&topology, LOGIN_PASSWORD)).await;
    assert_eq!(back.status, StatusCode::OK, "{}", back.body);
    assert_eq!(back.json()["login"], "ok");
    assert_eq!(back.json()["HTTP_X_REAL_IP"], "127.0.0.9");
    assert_login_items(&back, 294, 5);
    topology.php.wait_for_logged(200, LOGIN, 2).await;
    assert_eq!(topology.php.logged(401, LOGIN), 5);

    let metrics = admin_metrics(&topology).await;
    // The 429s: two attempts at /login.php, three around it, and one during the lock below.
    for (status, count) in [(200, 2.0), (401, 5.0), (429, 6.0)] {
        assert_eq!(
            metric(
                &metrics,
                &format!("floodgate_requests_total{{route=\"login\",status=\"{status}\"}}")
            ),
            count,
            "{status}: {metrics}"
        );
    }
    assert_eq!(
        metric(
            &metrics,
            "floodgate_ratelimit_decisions_total{limit=\"login_failures\",outcome=\"locked\"}"
        ),
        6.0,
        "{metrics}"
    );
    // Every read and count was Redis's.
    assert_eq!(
        metric(&metrics, "floodgate_store_errors_total{store=\"redis\"}"),
        0.0,
        "{metrics}"
    );
}

// Sticky sessions: the example's two PHP servers (`php-a`, `php-b`) under PHP-FPM, each
// told its name in APP_SERVER, behind the example's `[upstreams.php]` (`balance = "hash"`
// on the PHPSESSID cookie, its health check, `max_requests` and queue), with
// examples/compose/php/session.php counting each session's requests.

/// Where the PHP servers keep their session files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SessionStore {
    /// A directory of each server's own, as the compose example's containers have (PHP's
    /// default, files): a session's data lives on the server that wrote it, which is why
    /// the balancing must be sticky, and a session that moves to the other server starts
    /// afresh there.
    PerServer,
    /// One directory for both, standing for a shared session store (a common volume,
    /// Redis sessions): the stickiness is then a preference only, and a session that moves
    /// keeps its data.
    Shared,
}

/// Two PHP servers and the example's gateway in front of them.
struct Sessions {
    gateway: FloodgateProcess,
    /// Name (`php-a`, `php-b`) and server; a killed server is removed.
    php: Vec<(&'static str, Php)>,
    store: SessionStore,
    _redis: RedisServer,
    _session_dirs: tempfile::TempDir,
}

impl Sessions {
    async fn start(store: SessionStore) -> Sessions {
        let redis = RedisServer::start();
        let dirs = tempfile::tempdir().unwrap();
        let php: Vec<(&'static str, Php)> = ["php-a", "php-b"]
            .into_iter()
            .map(|name| {
                let dir = match store {
                    SessionStore::PerServer => dirs.path().join(name),
                    SessionStore::Shared => dirs.path().join("shared"),
                };
                std::fs::create_dir_all(&dir).unwrap();
                let ini = [
                    format!("session.save_path={}", dir.display()),
                    // PHP's default, explicit: a session id a server does not know is
                    // taken as it is (not replaced by a new one with a new cookie, which
                    // would move the session on the ring).
                    "session.use_strict_mode=0".to_owned(),
                ];
                (name, Php::start_with(&ini, &[("APP_SERVER", name)]))
            })
            .collect();
        let servers: Vec<String> = php.iter().map(|(_, p)| format!("\"{}\"", p.url())).collect();
        let config = example_config(
            &redis.url(),
            vec![
                (EXAMPLE_PHP_SERVERS, format!("servers = [{}]", servers.join(", "))),
                // Nothing listens there: these tests stay off /api/.
                (
                    "url = \"http://go:8080\"",
                    format!("url = \"http://127.0.0.1:{}\"", closed_port()),
                ),
            ],
        );
        let gateway = FloodgateProcess::start(&config, &[]);
        Sessions {
            gateway,
            php,
            store,
            _redis: redis,
            _session_dirs: dirs,
        }
    }

    /// The `server` label of the PHP server called `name` (its `host:port`).
    fn label(&self, name: &str) -> String {
        let (_, php) = self
            .php
            .iter()
            .find(|(n, _)| *n == name)
            .expect("a running server");
        php.addr.to_string()
    }

    /// Kills the PHP server called `name`, workers and all (SIGKILL to its process group):
    /// its port refuses connections from now on.
    fn kill(&mut self, name: &str) {
        let index = self
            .php
            .iter()
            .position(|(n, _)| *n == name)
            .expect("a running server");
        drop(self.php.remove(index));
    }

    async fn metrics(&self) -> String {
        common::get(&self.gateway.admin_url("/metrics")).await.2
    }
}

/// The value of the series `series` (`name{labels}`) in `metrics`; 0 when absent.
fn metric(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |value| value.trim().parse().unwrap())
}

/// A browser's session: its own client address and a cookie jar holding PHPSESSID.
struct Session {
    client: Client<HttpConnector, Full<Bytes>>,
    source: String,
    id: Option<String>,
    /// The server of each request so far.
    served: Vec<String>,
    /// PHP's count (`n`) of each request so far.
    counts: Vec<u64>,
}

impl Session {
    fn new(source: &str) -> Session {
        Session {
            client: client_from(source),
            source: source.to_owned(),
            id: None,
            served: Vec::new(),
            counts: Vec::new(),
        }
    }

    /// One request of the session to session.php, checked: a 200 from PHP, a cookie on the
    /// first response only and the same session from then on, and the count `n` the store
    /// implies: with a shared store every earlier request counts, with one per server
    /// only the earlier requests that server answered. Returns the server and `n`.
    async fn request(&mut self, topology: &Sessions) -> (String, u64) {
        let mut request = get(&topology.gateway.url("/session.php"));
        if let Some(id) = &self.id {
            request = request.header("cookie", format!("PHPSESSID={id}"));
        }
        let answer = send(&self.client, request.body(empty()).unwrap()).await;
        let context = format!("{} after {:?}: {}", self.source, self.served, answer.body);
        assert_eq!(answer.status, StatusCode::OK, "{context}");
        let cookies: Vec<String> = answer
            .headers
            .get_all("set-cookie")
            .iter()
            .filter_map(|value| value.to_str().ok()?.strip_prefix("PHPSESSID="))
            .map(|rest| rest.split(';').next().unwrap().to_owned())
            .collect();
        match &self.id {
            None => {
                assert_eq!(cookies.len(), 1, "a new session sets its cookie: {context}");
                self.id = Some(cookies[0].clone());
            }
            Some(_) => assert_eq!(cookies, Vec::<String>::new(), "{context}"),
        }
        let php = answer.json();
        assert_eq!(php["session"].as_str(), self.id.as_deref(), "{context}");
        assert_eq!(php["HTTP_X_REAL_IP"], self.source.as_str(), "{context}");
        let server = php["server"].as_str().expect("server").to_owned();
        let earlier = match topology.store {
            SessionStore::Shared => self.served.len(),
            SessionStore::PerServer => self.served.iter().filter(|s| **s == server).count(),
        };
        let n = php["n"].as_u64().expect("n");
        assert_eq!(n, earlier as u64 + 1, "{:?} store: {context}", topology.store);
        self.served.push(server.clone());
        self.counts.push(n);
        (server, n)
    }

    /// The server its cookie sent it to while both servers were up: that of its second
    /// request (the first had no cookie yet, and went by the client address).
    fn home(&self) -> &str {
        &self.served[1]
    }

    /// Makes `requests` more requests, then checks that every request of the session
    /// after its first went to one server.
    async fn requests(&mut self, topology: &Sessions, requests: usize) {
        for _ in 0..requests {
            self.request(topology).await;
        }
        let home = self.home();
        assert!(
            self.served[1..].iter().all(|s| s == home),
            "{} moved between servers: {:?}",
            self.source,
            self.served
        );
    }
}

/// The sessions of [`sticky_sessions_fail_over`], and which server it killed.
struct Failover {
    _topology: Sessions,
    /// 20 requests, then 3 after the kill.
    first: Session,
    /// 3 requests each, then 2 after the kill.
    others: Vec<Session>,
    /// Started after the kill: 3 requests.
    late: Session,
    victim: &'static str,
    survivor: &'static str,
}

/// What both stores share: a session sticks to its server for 20 requests, sessions spread
/// over both servers, and when one server is killed every request still succeeds, the
/// killed server's sessions are served by the other one and the other's stay where they
/// are. Every count is checked against the store in [`Session::request`].
async fn sticky_sessions_fail_over(store: SessionStore) -> Failover {
    let mut topology = Sessions::start(store).await;

    let mut first = Session::new("127.0.0.20");
    first.requests(&topology, 20).await;
    let (victim, survivor) = if first.home() == "php-a" {
        ("php-a", "php-b")
    } else {
        ("php-b", "php-a")
    };

    // Other sessions, each from a client of its own, until both servers have three: the
    // ring spreads them (the chance that 40 sessions all land on one server is 2^-39).
    let mut others: Vec<Session> = Vec::new();
    let homes = |others: &[Session], name: &str| others.iter().filter(|s| s.home() == name).count();
    while homes(&others, "php-a") < 3 || homes(&others, "php-b") < 3 {
        assert!(
            others.len() < 40,
            "40 sessions and not three on each server: {:?}",
            others.iter().map(Session::home).collect::<Vec<_>>()
        );
        let mut session = Session::new(&format!("127.0.1.{}", others.len() + 1));
        session.requests(&topology, 3).await;
        others.push(session);
    }

    let up = |metrics: &str, label: &str| {
        metric(
            metrics,
            &format!("floodgate_upstream_server_up{{upstream=\"php\",server=\"{label}\"}}"),
        )
    };
    let (victim_label, survivor_label) = (topology.label(victim), topology.label(survivor));
    let metrics = topology.metrics().await;
    assert_eq!(up(&metrics, &victim_label), 1.0, "{metrics}");
    assert_eq!(up(&metrics, &survivor_label), 1.0, "{metrics}");

    topology.kill(victim);

    // The first session's next request finds its server refusing and is tried on the
    // other one (nothing was sent, so any request may be); from then on its server is out
    // of rotation and its sessions go to the next server on the ring: the survivor.
    for _ in 0..3 {
        assert_eq!(first.request(&topology).await.0, survivor);
    }
    for session in &mut others {
        for _ in 0..2 {
            assert_eq!(session.request(&topology).await.0, survivor, "{}", session.source);
        }
    }
    let mut late = Session::new("127.0.2.1");
    for _ in 0..3 {
        assert_eq!(late.request(&topology).await.0, survivor);
    }

    // Every request was answered 200 by PHP: the killed server's refusals were retried.
    let requests: usize = std::iter::once(&first)
        .chain(&others)
        .chain([&late])
        .map(|s| s.served.len())
        .sum();
    let metrics = topology.metrics().await;
    assert_eq!(
        metric(&metrics, "floodgate_requests_total{route=\"php\",status=\"200\"}"),
        requests as f64,
        "{metrics}"
    );
    assert!(
        !metrics.contains("status=\"502\"") && !metrics.contains("status=\"503\""),
        "{metrics}"
    );
    assert_eq!(up(&metrics, &victim_label), 0.0, "{metrics}");
    assert_eq!(up(&metrics, &survivor_label), 1.0, "{metrics}");
    let failures: f64 = ["connect", "reset", "timeout"]
        .iter()
        .map(|kind| {
            metric(
                &metrics,
                &format!("floodgate_upstream_errors_total{{upstream=\"php\",kind=\"{kind}\"}}"),
            )
        })
        .sum();
    let retries = metric(&metrics, "floodgate_upstream_retries_total{upstream=\"php\"}");
    assert!(failures >= 1.0, "{metrics}");
    assert_eq!(retries, failures, "each failed try was tried again: {metrics}");

    // Every slot is free (a response's slot is released once its body is done).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let metrics = topology.metrics().await;
        let in_flight = |label: &str| {
            metric(
                &metrics,
                &format!("floodgate_upstream_in_flight{{upstream=\"php\",server=\"{label}\"}}"),
            )
        };
        if in_flight(&victim_label) == 0.0 && in_flight(&survivor_label) == 0.0 {
            break;
        }
        assert!(Instant::now() < deadline, "requests still in flight: {metrics}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    Failover {
        _topology: topology,
        first,
        others,
        late,
        victim,
        survivor,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_stick_to_their_server_and_start_afresh_on_the_other_when_it_dies() {
    let Failover {
        first,
        others,
        late,
        victim,
        survivor,
        ..
    } = sticky_sessions_fail_over(SessionStore::PerServer).await;
    let on = |session: &Session, server: &str, requests: std::ops::Range<usize>| {
        session.served[requests].iter().filter(|s| *s == server).count() as u64
    };

    // Requests 2 to 20 counted on from request 1 when the cookie-less first request went
    // to the session's server; when it went to the other one (by the client address),
    // what it stored stayed there and request 2 started afresh.
    let start = if first.served[0] == victim { 1 } else { 0 };
    assert_eq!(
        first.counts[1..20],
        (start + 1..start + 20).collect::<Vec<u64>>()[..]
    );
    // After the kill: the session's data stayed on the dead server; on the survivor it
    // counts afresh (from what its first request may have left there).
    let left = on(&first, survivor, 0..20);
    assert_eq!(first.counts[20..], [left + 1, left + 2, left + 3]);

    // The survivor's sessions kept their counts; the victim's started afresh.
    for session in &others {
        let counted = on(session, session.home(), 0..3);
        let expected = if session.home() == survivor {
            [counted + 1, counted + 2]
        } else {
            let left = on(session, survivor, 0..3);
            [left + 1, left + 2]
        };
        assert_eq!(
            session.counts[3..],
            expected,
            "{}: {:?}",
            session.source,
            session.served
        );
    }
    assert_eq!(late.counts, [1, 2, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_shared_session_store_a_session_keeps_its_count_when_its_server_dies() {
    let Failover {
        first,
        others,
        late,
        survivor,
        ..
    } = sticky_sessions_fail_over(SessionStore::Shared).await;
    // 1 to 20 on its server (the cookie-less first request possibly on the other; each
    // request's server was checked as it was made), then 21 to 23 on the survivor: the
    // data followed the session.
    assert_eq!(first.counts, (1..=23).collect::<Vec<u64>>());
    assert!(
        first.served[20..].iter().all(|s| s == survivor),
        "{:?}",
        first.served
    );
    for session in others.iter().chain([&late]) {
        let n = session.counts.len() as u64;
        assert_eq!(
            session.counts,
            (1..=n).collect::<Vec<u64>>(),
            "{}",
            session.source
        );
    }
}
