//! Every answer floodgate makes itself goes through one renderer: each status it can
//! produce gets its `[server.errors]` page (a limit's refusal its own message) and the
//! server's response header rules (docs/configuration.md#servererrors).

use std::time::Duration;

use crate::common::config::{GatewayToml, write_config};
use crate::common::tls::TestCa;
use crate::common::{TestGateway, Upstream, closed_port, get, raw_request, until};
use floodgate::Config;
use http::StatusCode;

/// Every status `[server.errors]` takes, each with a page naming it.
const PAGES: [u16; 10] = [400, 403, 404, 408, 413, 431, 501, 502, 503, 504];

/// A configuration whose `[server]` has `server_keys`, the response rule every answer
/// must carry, and `[server.errors]`.
fn config(server_keys: &str) -> GatewayToml {
    let pages: String = PAGES
        .iter()
        .map(|status| format!("{status} = {{ body = \"page {status}\\n\", content_type = \"text/html\" }}\n"))
        .collect();
    GatewayToml::new()
        .server(server_keys)
        .server(r#"response_headers = { set = { "X-Frame-Options" = "DENY" } }"#)
        .table("server.errors", &pages)
}

/// The status line and head of a raw HTTP/1.1 answer, and its body.
fn split(answer: &str) -> (u16, String, String) {
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((answer, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {answer:?}"));
    (status, head.to_ascii_lowercase(), body.to_owned())
}

/// Asserts that a raw answer has `status`, the server's rule and `body`.
fn assert_answer(answer: &str, status: u16, body: &str) {
    let (got, head, got_body) = split(answer);
    assert_eq!(got, status, "{answer}");
    assert!(head.contains("\r\nx-frame-options: deny"), "{status}: {answer}");
    assert_eq!(got_body, body, "{status}: {answer}");
}

async fn get_answer(gw: &TestGateway, path: &str) -> String {
    let request = format!("GET {path} HTTP/1.1\r\nHost: app\r\nConnection: close\r\n\r\n");
    raw_request(gw.addr, request.as_bytes()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_status_floodgate_answers_itself_has_its_page_and_the_servers_rules() {
    let upstream = Upstream::start().await;
    let app = upstream.url();
    let config = config("max_body = \"10B\"\nbody_timeout = \"100ms\"")
        .upstream("app", &app, r#"timeout = "300ms""#)
        .upstream(
            "capped",
            &app,
            r#"max_requests = 1
            queue = 0"#,
        )
        .upstream("gone", &format!("http://127.0.0.1:{}", closed_port()), "")
        .limit(
            "one",
            r#"algorithm = "fixed_window"
            limit = 1
            window = "1m"
            message = "slow down""#,
        )
        .limit(
            "closed",
            r#"algorithm = "fixed_window"
            limit = 1
            window = "1m"
            status = 503
            message = "closed""#,
        )
        .route(
            "limited",
            r#"path = "/limited"
            upstream = "app"
            limits = ["one"]"#,
        )
        .route(
            "closed",
            r#"path = "/closed"
            upstream = "app"
            limits = ["closed"]"#,
        )
        .route(
            "private",
            r#"path = "/private"
            upstream = "app"
            deny = ["127.0.0.1"]"#,
        )
        .route(
            "gone",
            r#"path = "/gone"
            upstream = "gone""#,
        )
        .route(
            "capped",
            r#"path_prefix = "/capped/"
            upstream = "capped""#,
        )
        .route(
            "app",
            r#"path_prefix = "/app/"
            upstream = "app""#,
        );
    let gw = TestGateway::start(config).await;

    assert_answer(&get_answer(&gw, "/nowhere").await, 404, "page 404\n");
    assert_answer(&get_answer(&gw, "/../etc/passwd").await, 400, "page 400\n");
    assert_answer(&get_answer(&gw, "/private").await, 403, "page 403\n");
    assert_answer(&get_answer(&gw, "/gone").await, 502, "page 502\n");
    assert_answer(&get_answer(&gw, "/app/slow?ms=2000").await, 504, "page 504\n");
    let too_big = "POST /app/x HTTP/1.1\r\nHost: app\r\nContent-Length: 100\r\nConnection: close\r\n\r\n";
    assert_answer(&raw_request(gw.addr, too_big.as_bytes()).await, 413, "page 413\n");
    let paused = "POST /app/echo HTTP/1.1\r\nHost: app\r\nContent-Length: 5\r\n\r\nab";
    assert_answer(&raw_request(gw.addr, paused.as_bytes()).await, 408, "page 408\n");
    let gzip = "POST /app/x HTTP/1.1\r\nHost: app\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n";
    assert_answer(&raw_request(gw.addr, gzip.as_bytes()).await, 501, "page 501\n");
    let huge = format!(
        "GET /app/x HTTP/1.1\r\nHost: app\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
        "a".repeat(40_000)
    );
    assert_answer(&raw_request(gw.addr, huge.as_bytes()).await, 431, "page 431\n");
    // So do heads floodgate refuses before they are parsed: a request line hyper cannot
    // read, ambiguous framing, a head that goes on past hyper's buffer. Each closes the
    // connection and carries a request ID, as every answer does.
    for (raw, status) in [
        ("GET /app/a b HTTP/1.1\r\nHost: app\r\n\r\n".to_owned(), 400),
        (
            "POST /app/x HTTP/1.1\r\nHost: app\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                .to_owned(),
            400,
        ),
        (
            format!("GET /app/x HTTP/1.1\r\nHost: app\r\nX-Big: {}", "a".repeat(70_000)),
            431,
        ),
    ] {
        let answer = raw_request(gw.addr, raw.as_bytes()).await;
        assert_answer(&answer, status, &format!("page {status}\n"));
        let (_, head, _) = split(&answer);
        for expected in ["\r\nconnection: close\r\n", "\r\nx-request-id: ", "\r\ncontent-type: text/html\r\n", "\r\ndate: "] {
            assert!(head.contains(expected), "{expected:?}: {answer}");
        }
    }

    // A limit's refusal keeps the limit's message, whatever its status.
    assert_eq!(get(&gw.url("/limited")).await.0, StatusCode::OK);
    assert_answer(&get_answer(&gw, "/limited").await, 429, "slow down");
    assert_eq!(get(&gw.url("/closed")).await.0, StatusCode::OK);
    assert_answer(&get_answer(&gw, "/closed").await, 503, "closed");

    // The cap's queue is full while one request works.
    let forwarded = upstream.requests();
    let busy = tokio::spawn(get(gw.url("/capped/slow?ms=1000").leak()));
    until("the slow request holds the cap", Duration::from_secs(5), || {
        upstream.requests() == forwarded + 1
    })
    .await;
    let answer = get_answer(&gw, "/capped/x").await;
    assert_answer(&answer, 503, "page 503\n");
    assert!(split(&answer).1.contains("\r\nretry-after: 1"), "{answer}");
    assert_eq!(busy.await.unwrap().0, StatusCode::OK);
}

#[tokio::test]
async fn a_store_that_fails_under_deny_answers_the_503_page() {
    let upstream = Upstream::start().await;
    let config = config("")
        .redis(
            &format!("redis://127.0.0.1:{}", closed_port()),
            r#"on_error = "deny"
            timeout = "100ms""#,
        )
        .upstream("app", &upstream.url(), "")
        .limit(
            "one",
            r#"algorithm = "fixed_window"
            limit = 10
            window = "1m""#,
        )
        .route(
            "app",
            r#"path_prefix = "/"
            upstream = "app"
            limits = ["one"]"#,
        );
    let gw = TestGateway::start(config).await;
    let answer = get_answer(&gw, "/x").await;
    assert_answer(&answer, 503, "page 503\n");
    assert!(split(&answer).1.contains("\r\nretry-after: 1"), "{answer}");
    assert_eq!(upstream.requests(), 0);
}

#[tokio::test]
async fn the_redirect_to_https_carries_the_servers_rules() {
    let ca = TestCa::new("test ca");
    let dir = tempfile::tempdir().unwrap();
    ca.issue(&["a.test"]).write(dir.path(), "a");
    let upstream = Upstream::start().await;
    let text = config("")
        .table(
            "server.tls",
            r#"listen = "127.0.0.1:0"
            certificates = [{ cert = "a.crt", key = "a.key" }]
            redirect_http = true"#,
        )
        .proxy_to(&upstream.url(), "");
    let path = write_config(dir.path(), text);
    let gw = TestGateway::start_config(Config::load(&path).unwrap()).await;
    let answer = get_answer(&gw, "/x?y=1").await;
    assert_answer(&answer, 308, "");
    let port = gw.tls.unwrap().port();
    assert!(
        split(&answer)
            .1
            .contains(&format!("\r\nlocation: https://app:{port}/x?y=1")),
        "{answer}"
    );
    assert_eq!(upstream.requests(), 0);
}
