//! Forwarding headers and hop-by-hop headers (docs/configuration.md#forwarding): what the upstream sees of the
//! client's headers, and what the client sees of the upstream's.

use crate::common::{TestGateway, Upstream, header_lines, raw_request, send};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;

/// A gateway in front of `upstream` with `server_keys` in `[server]`.
async fn gateway(upstream: &Upstream, server_keys: &str) -> TestGateway {
    TestGateway::proxy_to(upstream, server_keys, "").await
}

async fn untrusted_gateway(upstream: &Upstream) -> TestGateway {
    gateway(upstream, "").await
}

async fn trusted_gateway(upstream: &Upstream) -> TestGateway {
    gateway(upstream, r#"trusted_proxies = ["127.0.0.0/8"]"#).await
}

/// A raw HTTP/1.1 exchange answered with a `Content-Length` body: (head, body).
fn split_response(raw: &str) -> (&str, &str) {
    raw.split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no complete response: {raw:?}"))
}

/// Sends `headers` (already `\r\n`-terminated lines) on `GET /seen` and returns the
/// upstream's description of what it received.
async fn upstream_saw(gw: &TestGateway, headers: &str) -> String {
    let raw = raw_request(
        gw.addr,
        format!("GET /seen HTTP/1.1\r\n{headers}Connection: close\r\n\r\n").as_bytes(),
    )
    .await;
    let (head, body) = split_response(&raw);
    assert!(head.starts_with("HTTP/1.1 200 "), "{raw}");
    assert!(body.starts_with("GET /seen\n"), "{raw}");
    body.to_owned()
}

#[tokio::test]
async fn untrusted_client_forwarding_headers_are_replaced() {
    let upstream = Upstream::start().await;
    let gw = untrusted_gateway(&upstream).await;

    let request = Request::get(gw.url("/seen"))
        .header("host", "app.example.com:8443")
        .header("x-forwarded-for", "6.6.6.6")
        .header("x-real-ip", "6.6.6.6")
        .header("x-forwarded-proto", "https")
        .header("x-forwarded-host", "evil.example")
        .header("via", "1.0 corp-proxy")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (status, _, seen) = send(request).await;
    assert_eq!(status, StatusCode::OK, "{seen}");

    assert_eq!(header_lines(&seen, "x-forwarded-for"), ["127.0.0.1"], "{seen}");
    assert_eq!(header_lines(&seen, "x-real-ip"), ["127.0.0.1"], "{seen}");
    assert_eq!(header_lines(&seen, "x-forwarded-proto"), ["http"], "{seen}");
    assert_eq!(
        header_lines(&seen, "x-forwarded-host"),
        ["app.example.com:8443"],
        "{seen}"
    );
    assert_eq!(header_lines(&seen, "host"), ["app.example.com:8443"], "{seen}");
    assert_eq!(
        header_lines(&seen, "via"),
        ["1.0 corp-proxy", "1.1 floodgate"],
        "{seen}"
    );
}

#[tokio::test]
async fn forwarding_headers_are_set_when_the_client_sends_none() {
    let upstream = Upstream::start().await;
    let gw = untrusted_gateway(&upstream).await;

    let seen = upstream_saw(&gw, "Host: legacy.internal\r\n").await;
    assert_eq!(header_lines(&seen, "x-forwarded-for"), ["127.0.0.1"], "{seen}");
    assert_eq!(header_lines(&seen, "x-real-ip"), ["127.0.0.1"], "{seen}");
    assert_eq!(header_lines(&seen, "x-forwarded-proto"), ["http"], "{seen}");
    assert_eq!(
        header_lines(&seen, "x-forwarded-host"),
        ["legacy.internal"],
        "{seen}"
    );
    assert_eq!(header_lines(&seen, "host"), ["legacy.internal"], "{seen}");
    assert_eq!(header_lines(&seen, "via"), ["1.1 floodgate"], "{seen}");
}

/// Names PHP and CGI fold into floodgate's forwarding headers (and into any other name):
/// `_`, `.` and the rest of what is neither a letter, a digit nor `-`.
const PLANTED: &str = "Host: h\r\n\
     X_Forwarded_For: 6.6.6.6\r\n\
     X_Real_IP: 6.6.6.6\r\n\
     X.Real.IP: 6.6.6.6\r\n\
     X.Forwarded.For: 6.6.6.6\r\n\
     X.Forwarded.Proto: https\r\n\
     X_Forwarded_Proto: https\r\n\
     X_Forwarded_Host: evil.example\r\n\
     x-real_ip: 6.6.6.6\r\n\
     X_FORWARDED-FOR: 6.6.6.6\r\n\
     X.Debug: 1\r\n\
     X_Custom: app\r\n";

/// What of [`PLANTED`] the upstream saw: no planted value, and floodgate's own.
fn assert_nothing_planted(seen: &str) {
    assert!(!seen.contains("6.6.6.6"), "{seen}");
    assert!(!seen.contains("evil.example"), "{seen}");
    assert_eq!(header_lines(seen, "x-real-ip"), ["127.0.0.1"], "{seen}");
    assert_eq!(header_lines(seen, "x-forwarded-for"), ["127.0.0.1"], "{seen}");
    assert_eq!(header_lines(seen, "x-forwarded-proto"), ["http"], "{seen}");
}

#[tokio::test]
async fn names_php_would_fold_never_reach_the_upstream() {
    let upstream = Upstream::start().await;
    for gw in [
        untrusted_gateway(&upstream).await,
        trusted_gateway(&upstream).await,
    ] {
        let seen = upstream_saw(&gw, PLANTED).await;
        assert_nothing_planted(&seen);
        let invalid: Vec<&str> = seen
            .lines()
            .filter(|line| {
                line.split(':')
                    .next()
                    .is_some_and(|name| name.contains(['_', '.']))
            })
            .collect();
        assert!(invalid.is_empty(), "invalid names reached the upstream: {seen}");
        assert_eq!(gw.metric("floodgate_request_headers_dropped_total").await, 11.0);
    }
}

#[tokio::test]
async fn kept_invalid_names_still_never_spell_a_protected_one() {
    let upstream = Upstream::start().await;
    let gw = gateway(
        &upstream,
        r#"drop_invalid_headers = false
        request_headers = { remove = ["X-Debug"] }"#,
    )
    .await;
    let seen = upstream_saw(&gw, PLANTED).await;
    assert_nothing_planted(&seen);
    assert!(
        !seen.contains("x.debug"),
        "a removed header's spelling got through: {seen}"
    );
    // The app asked for names it needs: those that spell nothing floodgate guards pass.
    assert_eq!(header_lines(&seen, "x_custom"), ["app"], "{seen}");
    assert_eq!(gw.metric("floodgate_request_headers_dropped_total").await, 0.0);
}

#[tokio::test]
async fn hop_by_hop_request_headers_are_not_forwarded() {
    let upstream = Upstream::start().await;
    let gw = untrusted_gateway(&upstream).await;

    let seen = upstream_saw(
        &gw,
        "Host: h\r\n\
         Connection: X-Secret, x-other\r\n\
         X-Secret: 1\r\n\
         X-Other: 2\r\n\
         Keep-Alive: timeout=5\r\n\
         TE: trailers\r\n\
         Trailer: x-checksum\r\n\
         Upgrade: websocket\r\n\
         Proxy-Connection: keep-alive\r\n\
         X-Kept: yes\r\n",
    )
    .await;
    for name in [
        "connection",
        "x-secret",
        "x-other",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
    ] {
        assert_eq!(
            header_lines(&seen, name),
            Vec::<&str>::new(),
            "{name} forwarded: {seen}"
        );
    }
    assert_eq!(header_lines(&seen, "x-kept"), ["yes"], "{seen}");
    assert_eq!(header_lines(&seen, "host"), ["h"], "{seen}");
}

#[tokio::test]
async fn host_named_in_connection_is_still_forwarded() {
    let upstream = Upstream::start().await;
    let gw = untrusted_gateway(&upstream).await;

    let seen = upstream_saw(&gw, "Host: app.example.com\r\nConnection: host\r\n").await;
    assert_eq!(header_lines(&seen, "host"), ["app.example.com"], "{seen}");
    assert_eq!(
        header_lines(&seen, "x-forwarded-host"),
        ["app.example.com"],
        "{seen}"
    );
}

#[tokio::test]
async fn hop_by_hop_response_headers_are_not_returned() {
    let upstream = Upstream::start().await;
    let gw = untrusted_gateway(&upstream).await;

    // The upstream answers with `connection: x-hop`, `x-hop` and `keep-alive`.
    let (status, headers, body) = send(
        Request::get(gw.url("/seen"))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(headers["x-upstream"], "yes");
    assert!(headers.get("x-hop").is_none(), "{headers:?}");
    assert!(headers.get("keep-alive").is_none(), "{headers:?}");
    assert!(headers.get("connection").is_none(), "{headers:?}");

    // The same on the wire, where no client library can hide anything.
    let raw = raw_request(
        gw.addr,
        b"GET /seen HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
    )
    .await;
    let (head, _) = split_response(&raw);
    let head = head.to_ascii_lowercase();
    assert!(head.contains("\r\nx-upstream: yes"), "{raw}");
    assert!(!head.contains("x-hop"), "{raw}");
    assert!(!head.contains("keep-alive"), "{raw}");
}

#[tokio::test]
async fn trusted_proxy_forwarded_for_is_appended_to() {
    let upstream = Upstream::start().await;
    let gw = trusted_gateway(&upstream).await;

    let seen = upstream_saw(&gw, "Host: h\r\nX-Forwarded-For: 198.51.100.7\r\n").await;
    assert_eq!(
        header_lines(&seen, "x-forwarded-for"),
        ["198.51.100.7, 127.0.0.1"],
        "{seen}"
    );
    assert_eq!(header_lines(&seen, "x-real-ip"), ["198.51.100.7"], "{seen}");

    // X-Real-IP is the rightmost address of the chain that is not a trusted proxy.
    let seen = upstream_saw(
        &gw,
        "Host: h\r\nX-Forwarded-For: 203.0.113.9, 198.51.100.7\r\nX-Forwarded-For: 127.0.0.5\r\n",
    )
    .await;
    assert_eq!(
        header_lines(&seen, "x-forwarded-for"),
        ["203.0.113.9, 198.51.100.7, 127.0.0.5, 127.0.0.1"],
        "{seen}"
    );
    assert_eq!(header_lines(&seen, "x-real-ip"), ["198.51.100.7"], "{seen}");

    // Without X-Forwarded-For the trusted peer is the client.
    let seen = upstream_saw(&gw, "Host: h\r\n").await;
    assert_eq!(header_lines(&seen, "x-forwarded-for"), ["127.0.0.1"], "{seen}");
    assert_eq!(header_lines(&seen, "x-real-ip"), ["127.0.0.1"], "{seen}");
    assert_eq!(header_lines(&seen, "via"), ["1.1 floodgate"], "{seen}");
}
