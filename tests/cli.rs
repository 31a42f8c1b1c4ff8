//! The command line, through the real binary: `check` prints a summary or every
//! problem as `file:line:column: key: expected ...` and exits 1; `FLOODGATE_CONFIG`;
//! `--version`/`--help`; an invalid config or log format stops the gateway before it binds.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use crate::common::closed_port;
use crate::common::config::{GatewayToml, config_file};
use crate::common::process::run;

/// Commands that should exit at once get this long before the test calls them hung.
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);

const VALID: &str = r#"
[server]
listen = "127.0.0.1:18080"
admin_listen = "127.0.0.1:19901"

[upstreams.app]
url = "http://127.0.0.1:9000"

[upstreams.other]
url = "http://127.0.0.1:9001/base"

[[routes]]
name = "api"
path_prefix = "/api/"
upstream = "app"

[[routes]]
name = "ping"
path = "/ping"
respond = { status = 200, body = "pong\n" }

[[routes]]
name = "rest"
upstream = "other"
"#;

fn floodgate(dir: &Path, args: &[&str], envs: &[(&str, &str)]) -> Output {
    run(dir, args, envs, EXIT_TIMEOUT)
}

/// `floodgate check --config FILE` on `text`: the output and the file's path as printed.
fn check(text: &str) -> (Output, String) {
    let (dir, path) = config_file(text);
    let path = path.to_str().unwrap().to_owned();
    let output = floodgate(dir.path(), &["check", "--config", &path], &[]);
    (output, path)
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Asserts exit 1 and returns the non-empty stderr lines.
fn failure_lines(output: &Output) -> Vec<String> {
    assert_eq!(
        output.status.code(),
        Some(1),
        "stdout:\n{}\nstderr:\n{}",
        stdout(output),
        stderr(output)
    );
    stderr(output)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect()
}

/// The one error line of an invalid config, checked to start with `FILE:LINE:COLUMN: KEY: `.
fn single_error(text: &str, line: usize, column: usize, key: &str) -> String {
    let (output, path) = check(text);
    let lines = failure_lines(&output);
    assert_eq!(lines.len(), 1, "{lines:#?}");
    let prefix = format!("{path}:{line}:{column}: {key}: ");
    assert!(
        lines[0].starts_with(&prefix),
        "expected {prefix:?}…, got {:?}",
        lines[0]
    );
    assert!(output.stdout.is_empty(), "{}", stdout(&output));
    lines[0][prefix.len()..].to_owned()
}

#[test]
fn check_accepts_a_valid_file_with_a_summary() {
    let (output, path) = check(VALID);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let out = stdout(&output);
    assert!(out.contains(&path), "{out}");
    assert!(out.contains("ok"), "{out}");
    assert!(out.contains("3 route(s)"), "{out}");
    assert!(out.contains("2 upstream(s)"), "{out}");
    assert!(out.contains("127.0.0.1:18080"), "{out}");
    assert!(out.contains("127.0.0.1:19901"), "{out}");
    assert!(output.stderr.is_empty(), "{}", stderr(&output));
}

#[test]
fn check_rejects_an_unknown_key_with_its_position() {
    let message = single_error(
        "[server]\nlisten_addr = \"0.0.0.0:8080\"\n",
        2,
        1,
        "server.listen_addr",
    );
    assert!(message.contains("unknown field"), "{message}");
    // What would have been accepted, so that the typo is easy to fix.
    assert!(message.contains("expected"), "{message}");
    assert!(message.contains("`listen`"), "{message}");
}

#[test]
fn check_rejects_a_wrong_type() {
    let message = single_error(
        "[upstreams.app]\nurl = \"http://127.0.0.1:9000\"\ntimeout = 5\n",
        3,
        11,
        "upstreams.app.timeout",
    );
    assert!(message.contains("expected a string"), "{message}");

    // A number where a string is expected, and the other way round: the key path names the
    // setting, never serde's internal wrapper fields.
    let message = single_error("[server]\nworkers = \"two\"\n", 2, 11, "server.workers");
    assert!(message.contains("expected"), "{message}");
    assert!(!message.contains("$__"), "{message}");
}

#[test]
fn check_rejects_a_bad_duration() {
    let message = single_error(
        "[server]\nshutdown_grace = \"10 parsecs\"\n",
        2,
        18,
        "server.shutdown_grace",
    );
    assert!(message.contains("expected a duration"), "{message}");
    assert!(message.contains("\"10 parsecs\""), "{message}");
}

#[test]
fn check_rejects_an_unknown_upstream_reference() {
    let message = single_error(
        "[upstreams.app]\nurl = \"http://127.0.0.1:9000\"\n\n[[routes]]\nname = \"r\"\nupstream = \"ap\"\n",
        6,
        12,
        "routes[0].upstream",
    );
    assert!(message.contains("unknown upstream \"ap\""), "{message}");
    assert!(message.contains("\"app\""), "{message}");
}

#[test]
fn check_reports_every_problem_not_just_the_first() {
    let (output, path) =
        check("[server]\nshutdown_grace = \"soon\"\n\n[[routes]]\nname = \"r\"\nupstream = \"missing\"\n");
    let mut lines = failure_lines(&output);
    lines.sort();
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert!(
        lines[0].starts_with(&format!(
            "{path}:2:18: server.shutdown_grace: expected a duration"
        )),
        "{lines:#?}"
    );
    assert!(
        lines[1].starts_with(&format!(
            "{path}:6:12: routes[0].upstream: unknown upstream \"missing\""
        )),
        "{lines:#?}"
    );
}

#[test]
fn check_rejects_a_toml_syntax_error_with_its_position() {
    let (output, path) = check("[server]\nlisten = \"127.0.0.1:8080\n");
    let lines = failure_lines(&output);
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(lines[0].starts_with(&format!("{path}:2:")), "{lines:#?}");
    assert!(lines[0].contains("invalid TOML"), "{lines:#?}");

    let (output, path) = check("[server\nlisten = \"127.0.0.1:8080\"\n");
    let lines = failure_lines(&output);
    assert!(lines[0].starts_with(&format!("{path}:1:8: ")), "{lines:#?}");
    assert!(lines[0].contains("expected `]`"), "{lines:#?}");
}

#[test]
fn check_reports_a_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let output = floodgate(dir.path(), &["check", "--config", "nowhere.toml"], &[]);
    let lines = failure_lines(&output);
    assert!(
        lines[0].starts_with("nowhere.toml: cannot read the file"),
        "{lines:#?}"
    );
}

#[test]
fn config_path_comes_from_floodgate_config_then_the_default() {
    let (dir, path) = config_file(VALID);
    let output = floodgate(
        Path::new("/"),
        &["check"],
        &[("FLOODGATE_CONFIG", path.to_str().unwrap())],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(stdout(&output).contains("3 route(s)"), "{}", stdout(&output));

    // FLOODGATE_CONFIG names the file that is checked: an invalid one fails.
    let (_bad_dir, bad) = config_file("[server]\nlisten = \"nope\"\n");
    let output = floodgate(
        Path::new("/"),
        &["check"],
        &[("FLOODGATE_CONFIG", bad.to_str().unwrap())],
    );
    let lines = failure_lines(&output);
    assert!(lines[0].contains("server.listen"), "{lines:#?}");

    // --config wins over the environment.
    let output = floodgate(
        Path::new("/"),
        &["check", "--config", path.to_str().unwrap()],
        &[("FLOODGATE_CONFIG", bad.to_str().unwrap())],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));

    // Neither: ./gateway.toml.
    let output = floodgate(dir.path(), &["check"], &[]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(
        stdout(&output).starts_with("gateway.toml: ok"),
        "{}",
        stdout(&output)
    );
}

#[test]
fn version_and_help() {
    let dir = tempfile::tempdir().unwrap();
    let output = floodgate(dir.path(), &["--version"], &[]);
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(
        stdout(&output).trim(),
        format!("floodgate {}", env!("CARGO_PKG_VERSION"))
    );

    let output = floodgate(dir.path(), &["--help"], &[]);
    assert_eq!(output.status.code(), Some(0));
    let help = stdout(&output);
    assert!(help.contains("check"), "{help}");
    assert!(help.contains("--config"), "{help}");
    assert!(help.contains("FLOODGATE_CONFIG"), "{help}");
}

fn assert_port_free(port: u16) {
    std::net::TcpListener::bind(("127.0.0.1", port))
        .unwrap_or_else(|e| panic!("port {port} is taken after floodgate exited: {e}"));
}

#[test]
fn an_invalid_config_exits_1_before_binding() {
    let (listen, admin) = (closed_port(), closed_port());
    let (dir, path) = config_file(format!(
        "[server]\nlisten = \"127.0.0.1:{listen}\"\nadmin_listen = \"127.0.0.1:{admin}\"\n\
         shutdown_grace = \"forever\"\n"
    ));
    let path = path.to_str().unwrap();
    let output = floodgate(dir.path(), &["--config", path], &[]);
    let lines = failure_lines(&output);
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(
        lines[0].starts_with(&format!("{path}:4:18: server.shutdown_grace: ")),
        "{lines:#?}"
    );
    // No log line claims to listen, and neither port was ever taken.
    assert!(!stdout(&output).contains("listening"), "{}", stdout(&output));
    assert_port_free(listen);
    assert_port_free(admin);
}

#[test]
fn an_unknown_log_format_exits_1_with_a_message() {
    let (listen, admin) = (closed_port(), closed_port());
    let (dir, path) = config_file(format!(
        "[server]\nlisten = \"127.0.0.1:{listen}\"\nadmin_listen = \"127.0.0.1:{admin}\"\n"
    ));
    let output = floodgate(
        dir.path(),
        &["--config", path.to_str().unwrap()],
        &[("FLOODGATE_LOG_FORMAT", "yaml")],
    );
    let lines = failure_lines(&output);
    assert!(
        lines.iter().any(|l| l.contains("FLOODGATE_LOG_FORMAT")),
        "{lines:#?}"
    );
    assert!(lines.iter().any(|l| l.contains("\"yaml\"")), "{lines:#?}");
    assert!(lines.iter().any(|l| l.contains("json")), "{lines:#?}");
    assert_port_free(listen);
    assert_port_free(admin);
}

#[test]
fn an_invalid_log_filter_exits_1_with_a_message() {
    let (dir, path) = config_file(GatewayToml::new());
    let output = floodgate(
        dir.path(),
        &["--config", path.to_str().unwrap()],
        &[("FLOODGATE_LOG", "foo=loud")],
    );
    let lines = failure_lines(&output);
    assert!(lines.iter().any(|l| l.contains("FLOODGATE_LOG=")), "{lines:#?}");
}

/// Login protection PHP can reach around: a limit for POST only while the script reads
/// the query string too, and an exact path a front controller answers under other
/// spellings. The shipped examples draw none of these warnings.
#[test]
fn check_warns_about_login_protection_php_can_reach_around() {
    let login = |route: &str| {
        format!(
            "[upstreams.php]\nurl = \"http://127.0.0.1:9000\"\n\n\
             [limits.login_failures]\nalgorithm = \"fixed_window\"\nlimit = 5\nwindow = \"15m\"\n\
             count = \"failures\"\n\n\
             [[routes]]\nname = \"login\"\n{route}\nupstream = \"php\"\nlimits = [\"login_failures\"]\n\n\
             [[routes]]\nname = \"site\"\npath_prefix = \"/\"\nupstream = \"php\"\n"
        )
    };
    let warnings = |text: &str| -> Vec<String> {
        let (output, path) = check(text);
        assert!(output.status.success(), "{}", stderr(&output));
        stdout(&output)
            .lines()
            .filter_map(|line| line.strip_prefix(&format!("{path}: warning: ")))
            .map(str::to_owned)
            .collect()
    };

    let post_only = warnings(&login("path = \"/login.php\"\nmethods = [\"POST\"]"));
    assert_eq!(post_only.len(), 1, "{post_only:?}");
    assert!(
        post_only[0].starts_with("routes[0] (login).methods: the login's limits apply to POST only"),
        "{post_only:?}"
    );
    assert!(post_only[0].contains("through routes[1] (site)"), "{post_only:?}");

    let exact = warnings(&login("path = \"/account/login\""));
    assert_eq!(exact.len(), 1, "{exact:?}");
    assert!(
        exact[0].starts_with("routes[0] (login).path: an exact path does not match `/account/login/` or `/index.php/account/login`"),
        "{exact:?}"
    );

    // A script path also matches its PATH_INFO, and a prefix every spelling: no warning.
    assert_eq!(warnings(&login("path = \"/login.php\"")), Vec::<String>::new());
    assert_eq!(
        warnings(&login("path_prefix = \"/account/login\"")),
        Vec::<String>::new()
    );
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    for example in [
        "gateway.toml",
        "examples/compose/gateway.toml",
        "examples/compose/gateway.tls.toml",
        "examples/compose/gateway.acme.toml",
    ] {
        let output = floodgate(repo, &["check", "--config", example], &[]);
        assert!(output.status.success(), "{example}: {}", stderr(&output));
        assert!(
            !stdout(&output).contains("warning"),
            "{example}: {}",
            stdout(&output)
        );
    }
}
