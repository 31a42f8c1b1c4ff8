//! `floodgate healthcheck` through the real binary: exit 0 with one line against a running
//! gateway (a wildcard `admin_listen` probed on loopback, the file from `--config` or
//! `FLOODGATE_CONFIG`), exit 1 with one line when nothing listens, when the listener is
//! silent past `--timeout`, when it answers something other than 200, and when the file
//! cannot be read. The container image's `HEALTHCHECK` relies on exactly this.

use std::io::{Read as _, Write as _};
use std::net::TcpListener;
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use crate::common::closed_port;
use crate::common::config::config_file;
use crate::common::process::{FloodgateProcess, run};

/// The probe's own default timeout is 2 s; the binary must be done well within this.
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);

fn healthcheck(dir: &Path, args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut all = vec!["healthcheck"];
    all.extend_from_slice(args);
    run(dir, &all, envs, EXIT_TIMEOUT)
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Asserts exit 1, nothing on stdout, and exactly one line on stderr; returns that line.
fn unhealthy_line(output: &Output) -> String {
    assert_eq!(
        output.status.code(),
        Some(1),
        "stdout:\n{}\nstderr:\n{}",
        stdout(output),
        stderr(output)
    );
    assert!(output.stdout.is_empty(), "{}", stdout(output));
    let err = stderr(output);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("unhealthy: "), "{err}");
    lines[0].to_owned()
}

/// A gateway whose admin listener binds every address on a port the test knows, as in the
/// container (`0.0.0.0:9901`); its own config file is what the health check reads.
fn gateway_on_wildcard_admin() -> (FloodgateProcess, u16) {
    let port = closed_port();
    let gateway = FloodgateProcess::start(
        format!("[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"0.0.0.0:{port}\"\n"),
        &[],
    );
    assert_eq!(gateway.admin.port(), port);
    (gateway, port)
}

#[test]
fn a_running_gateway_is_healthy_and_a_wildcard_admin_is_probed_on_loopback() {
    let (gateway, port) = gateway_on_wildcard_admin();
    let config = gateway.config.to_str().unwrap();
    let output = healthcheck(gateway.dir.path(), &["--config", config], &[]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(
        stdout(&output),
        format!("healthy: GET http://127.0.0.1:{port}/healthz answered 200\n")
    );
    assert!(output.stderr.is_empty(), "{}", stderr(&output));
}

#[test]
fn the_config_comes_from_floodgate_config_too() {
    let (gateway, _) = gateway_on_wildcard_admin();
    let config = gateway.config.to_str().unwrap();
    let output = healthcheck(gateway.dir.path(), &[], &[("FLOODGATE_CONFIG", config)]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
}

#[test]
fn a_config_edited_into_an_invalid_one_does_not_fail_a_running_gateway() {
    // The running gateway keeps serving its previous configuration after a failed reload,
    // so the health check reads only `admin_listen` and ignores the rest of the file.
    let (gateway, _) = gateway_on_wildcard_admin();
    let text = std::fs::read_to_string(&gateway.config).unwrap();
    let (dir, edited) = config_file(format!("{text}listen_addr = \"typo\"\n[[routes]]\nname = 1\n"));
    let check = run(
        dir.path(),
        &["check", "--config", edited.to_str().unwrap()],
        &[],
        EXIT_TIMEOUT,
    );
    assert_eq!(check.status.code(), Some(1), "the edited file must be invalid");
    let output = healthcheck(dir.path(), &["--config", edited.to_str().unwrap()], &[]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
}

#[test]
fn nothing_listening_is_unhealthy() {
    let port = closed_port();
    let (dir, path) = config_file(format!("[server]\nadmin_listen = \"127.0.0.1:{port}\"\n"));
    let output = healthcheck(dir.path(), &["--config", path.to_str().unwrap()], &[]);
    let line = unhealthy_line(&output);
    assert!(
        line.contains(&format!(
            "cannot connect to the admin listener at 127.0.0.1:{port}"
        )),
        "{line}"
    );
}

#[test]
fn a_silent_listener_is_unhealthy_after_the_timeout() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // Accepts and reads, never answers; the connection stays open until the test ends.
    let holder = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut buf = [0u8; 1024];
        while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
    });
    let (dir, path) = config_file(format!("[server]\nadmin_listen = \"127.0.0.1:{port}\"\n"));
    let started = Instant::now();
    let output = healthcheck(
        dir.path(),
        &["--config", path.to_str().unwrap(), "--timeout", "300ms"],
        &[],
    );
    let took = started.elapsed();
    let line = unhealthy_line(&output);
    assert!(
        line.contains(&format!(
            "no answer from the admin listener at 127.0.0.1:{port} within 300ms"
        )),
        "{line}"
    );
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    drop(holder);
}

#[test]
fn an_answer_other_than_200_is_unhealthy() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut request = Vec::new();
        let mut buf = [0u8; 1024];
        while !request.ends_with(b"\r\n\r\n") {
            let n = stream.read(&mut buf).unwrap();
            assert!(n > 0, "the probe closed before sending its request");
            request.extend_from_slice(&buf[..n]);
        }
        stream
            .write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 9\r\n\r\ndraining\n")
            .unwrap();
        String::from_utf8(request).unwrap()
    });
    let (dir, path) = config_file(format!("[server]\nadmin_listen = \"127.0.0.1:{port}\"\n"));
    let output = healthcheck(dir.path(), &["--config", path.to_str().unwrap()], &[]);
    let line = unhealthy_line(&output);
    assert!(
        line.contains(&format!("GET http://127.0.0.1:{port}/healthz answered 503")),
        "{line}"
    );
    let request = server.join().unwrap();
    assert!(request.starts_with("GET /healthz HTTP/1.1\r\n"), "{request}");
    assert!(
        request.contains(&format!("\r\nHost: 127.0.0.1:{port}\r\n")),
        "{request}"
    );
}

#[test]
fn an_unreadable_config_is_unhealthy() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.toml");
    let output = healthcheck(dir.path(), &["--config", missing.to_str().unwrap()], &[]);
    let line = unhealthy_line(&output);
    assert!(line.contains("missing.toml: cannot read the file"), "{line}");

    let (dir, path) = config_file("[server]\nadmin_listen = \"localhost\"\n");
    let output = healthcheck(dir.path(), &["--config", path.to_str().unwrap()], &[]);
    let line = unhealthy_line(&output);
    assert!(
        line.contains("server.admin_listen: expected an address"),
        "{line}"
    );
}
