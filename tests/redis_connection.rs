//! Connecting to Redis as production does (`redis.url` with TLS and AUTH): a
//! password and a database number, an ACL user, TLS with `rediss://`, and a wrong password
//! that is logged with the address but never the password. Runs the real binary against a
//! private redis-server.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::config::GatewayToml;
use crate::common::process::FloodgateProcess;
use crate::common::redis_server::RedisServer;

fn config(url: &str, on_error: &str) -> GatewayToml {
    GatewayToml::new()
        .redis(
            url,
            &format!(
                r#"timeout = "200ms"
                on_error = "{on_error}""#
            ),
        )
        .limit(
            "quota",
            r#"algorithm = "fixed_window"
            limit = 100
            window = "1m""#,
        )
        .route(
            "hello",
            r#"respond = { body = "hi\n" }
            limits = ["quota"]"#,
        )
}

/// Status and headers of `GET url`, with a plain blocking client.
fn get(url: &str) -> (u16, String) {
    let url = url.strip_prefix("http://").unwrap();
    let (address, path) = url.split_once('/').unwrap();
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    use std::io::{Read, Write};
    write!(
        stream,
        "GET /{path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    let status = response.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, response)
}

fn keys(redis_cli: &[&str]) -> Vec<String> {
    let output = Command::new("redis-cli")
        .args(redis_cli)
        .arg("--scan")
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn password_and_database_number() {
    let redis = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let gateway = FloodgateProcess::start(
        config(&format!("redis://:s3cret@127.0.0.1:{}/3", redis.port), "deny"),
        &[],
    );
    let (status, response) = get(&gateway.url("/"));
    assert_eq!(status, 200, "{response}");
    assert!(response.contains("ratelimit: \"quota\";r=99"), "{response}");
    let port = redis.port.to_string();
    let in_db3 = keys(&["-p", &port, "-a", "s3cret", "--no-auth-warning", "-n", "3"]);
    assert!(in_db3.iter().any(|k| k.starts_with("floodgate:")), "{in_db3:?}");
    let in_db0 = keys(&["-p", &port, "-a", "s3cret", "--no-auth-warning", "-n", "0"]);
    assert!(in_db0.is_empty(), "{in_db0:?}");
}

#[test]
fn acl_user_and_password() {
    let redis = RedisServer::start();
    assert_eq!(
        redis
            .cli(&["acl", "setuser", "gate", "on", ">gatepass", "~*", "+@all"])
            .trim(),
        "OK"
    );
    assert_eq!(redis.cli(&["acl", "setuser", "default", "off"]).trim(), "OK");
    let gateway = FloodgateProcess::start(
        config(
            &format!("redis://gate:gatepass@127.0.0.1:{}/0", redis.port),
            "deny",
        ),
        &[],
    );
    let (status, response) = get(&gateway.url("/"));
    assert_eq!(status, 200, "{response}");
    assert!(response.contains("ratelimit: \"quota\";r=99"), "{response}");
}

#[test]
fn a_wrong_password_is_logged_without_the_password() {
    let redis = RedisServer::start_with(&["--requirepass", "right"]);
    let gateway = FloodgateProcess::start(
        config(&format!("redis://:Wr0ngPa55@127.0.0.1:{}/0", redis.port), "deny"),
        &[],
    );
    let (status, response) = get(&gateway.url("/"));
    assert_eq!(status, 503, "{response}");
    let line = gateway
        .wait_for_line(Duration::from_secs(5), |line| {
            line.contains("cannot connect to redis")
        })
        .expect("the failure is logged");
    assert!(
        line.contains(&format!("redis://:***@127.0.0.1:{}/0", redis.port)),
        "{line}"
    );
    let everything = gateway.stdout_lines().join("\n") + &gateway.stderr_lines().join("\n");
    assert!(
        !everything.contains("Wr0ngPa55"),
        "the password leaked into the logs"
    );
}

/// A CA, and a certificate for 127.0.0.1 signed by it, in `dir`.
fn make_certificates(dir: &Path) {
    let run = |args: &[&str]| {
        let status = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl");
        assert!(
            status.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&status.stderr)
        );
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=floodgate test CA",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]);
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "ext.cnf",
    ]);
}

#[test]
fn tls_with_rediss() {
    let certificates = tempfile::tempdir().unwrap();
    make_certificates(certificates.path());
    let file = |name: &str| certificates.path().join(name).to_string_lossy().into_owned();
    let redis = RedisServer::start_with(&[
        "--tls-port",
        "PORT",
        "--tls-cert-file",
        &file("server.pem"),
        "--tls-key-file",
        &file("server.key"),
        "--tls-ca-cert-file",
        &file("ca.pem"),
        "--tls-auth-clients",
        "no",
    ]);
    let ca = file("ca.pem");
    let gateway = FloodgateProcess::start(
        config(&format!("rediss://127.0.0.1:{}/0", redis.port), "deny"),
        &[("SSL_CERT_FILE", &ca)],
    );
    let started = Instant::now();
    let (status, response) = loop {
        let (status, response) = get(&gateway.url("/"));
        if status == 200 || started.elapsed() > Duration::from_secs(3) {
            break (status, response);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(status, 200, "{response}\n{}", gateway.stdout_lines().join("\n"));
    let port = redis.port.to_string();
    let stored = keys(&["-p", &port, "--tls", "--cacert", &ca]);
    assert!(stored.iter().any(|k| k.starts_with("floodgate:")), "{stored:?}");
}
