//! Following a request (SPEC 17): request IDs (unique, sent upstream and back, a client's
//! replaced unless a trusted proxy sent it), W3C trace context (continued when valid,
//! replaced when not, one `traceparent` per upstream try), spans exported over OTLP/HTTP
//! to a receiver in the test, and a collector that fails never slowing a request.

use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::config::GatewayToml;
use crate::common::php_fpm::PhpFpm;
use crate::common::process::FloodgateProcess;
use crate::common::{TestGateway, Upstream, closed_port, get, h2c_client, header_lines, read_response, send};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use tokio::net::TcpListener;

const PARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

fn is_hex_id(text: &str) -> bool {
    text.len() == 32
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

async fn get_with(url: &str, headers: &[(&str, &str)]) -> (StatusCode, http::HeaderMap, String) {
    let mut request = Request::get(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    send(request.body(Full::new(Bytes::new())).unwrap()).await
}

#[tokio::test]
async fn every_request_gets_a_unique_id_that_the_upstream_and_the_client_both_see() {
    let upstream = Upstream::start().await;
    let gateway = TestGateway::proxy_to(&upstream, "", "").await;
    let mut ids = HashSet::new();
    for _ in 0..50 {
        let (status, headers, body) = get(&gateway.url("/x")).await;
        assert_eq!(status, 200);
        let id = headers["x-request-id"].to_str().unwrap().to_owned();
        assert!(is_hex_id(&id), "{id}");
        assert_eq!(header_lines(&body, "x-request-id"), [id.as_str()], "{body}");
        assert!(ids.insert(id), "unique");
    }
    // Over HTTP/2 alike.
    let response = h2c_client()
        .request(
            Request::get(gateway.url("/h2"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.version(), http::Version::HTTP_2);
    let (status, headers, body) = read_response(response).await;
    assert_eq!(status, 200);
    let id = headers["x-request-id"].to_str().unwrap();
    assert_eq!(header_lines(&body, "x-request-id"), [id], "{body}");
    assert!(!ids.contains(id));
}

#[tokio::test]
async fn a_clients_id_is_replaced_unless_a_trusted_proxy_sent_it() {
    let upstream = Upstream::start().await;
    // Names with `_` kept (`drop_invalid_headers = false`): the request ID's spelling is
    // dropped all the same.
    let untrusted = TestGateway::proxy_to(&upstream, "drop_invalid_headers = false", "").await;
    let sent = [("x-request-id", "chosen-by-client"), ("x-request_id", "planted")];
    let (_, headers, body) = get_with(&untrusted.url("/"), &sent).await;
    let id = headers["x-request-id"].to_str().unwrap();
    assert_ne!(id, "chosen-by-client");
    assert_eq!(
        header_lines(&body, "x-request-id"),
        [id],
        "exactly one, floodgate's: {body}"
    );
    assert!(
        header_lines(&body, "x-request_id").is_empty(),
        "the underscore spelling is dropped: {body}"
    );
    let (_, _, kept) = get_with(&untrusted.url("/"), &[("x_other", "kept")]).await;
    assert_eq!(
        header_lines(&kept, "x_other"),
        ["kept"],
        "other underscore names are kept: {kept}"
    );

    let trusted = TestGateway::proxy_to(&upstream, "trusted_proxies = [\"127.0.0.1/32\"]", "").await;
    let (_, headers, body) = get_with(&trusted.url("/"), &sent[..1]).await;
    assert_eq!(headers["x-request-id"], "chosen-by-client");
    assert_eq!(header_lines(&body, "x-request-id"), ["chosen-by-client"]);
    // Even from a trusted proxy, a value that is not one short visible token is replaced.
    for bad in ["has space", &"a".repeat(201)] {
        let (_, headers, _) = get_with(&trusted.url("/"), &[("x-request-id", bad)]).await;
        assert!(is_hex_id(headers["x-request-id"].to_str().unwrap()), "{bad}");
    }
}

#[tokio::test]
async fn floodgates_own_answers_carry_the_id_too() {
    let upstream = Upstream::start().await;
    let toml = GatewayToml::new()
        .upstream("app", &upstream.url(), "")
        .upstream("gone", &format!("http://127.0.0.1:{}", closed_port()), "")
        .limit(
            "one",
            "algorithm = \"fixed_window\"\nlimit = 1\nwindow = \"1m\"\nkey = [\"client_ip\"]",
        )
        .route(
            "limited",
            "path_prefix = \"/limited\"\nupstream = \"app\"\nlimits = [\"one\"]",
        )
        .route("dead", "path_prefix = \"/dead\"\nupstream = \"gone\"");
    let gateway = TestGateway::start(toml).await;
    let _ = get(&gateway.url("/limited")).await;
    for (path, status) in [("/nowhere", 404), ("/limited", 429), ("/dead", 502)] {
        let (got, headers, _) = get(&gateway.url(path)).await;
        assert_eq!(got, status, "{path}");
        assert!(
            is_hex_id(headers["x-request-id"].to_str().unwrap()),
            "{path}: {headers:?}"
        );
    }
}

#[tokio::test]
async fn request_id_off_leaves_the_header_alone() {
    let upstream = Upstream::start().await;
    let gateway = TestGateway::proxy_to(&upstream, "request_id = \"\"", "").await;
    let (_, headers, body) = get_with(&gateway.url("/"), &[("x-request-id", "mine")]).await;
    assert!(headers.get("x-request-id").is_none(), "{headers:?}");
    assert_eq!(header_lines(&body, "x-request-id"), ["mine"]);
    // Another header name carries them when configured.
    let gateway = TestGateway::proxy_to(&upstream, "request_id = \"X-Correlation-Id\"", "").await;
    let (_, headers, body) = get(&gateway.url("/")).await;
    let id = headers["x-correlation-id"].to_str().unwrap();
    assert_eq!(header_lines(&body, "x-correlation-id"), [id]);
}

#[tokio::test]
async fn a_valid_traceparent_is_continued_an_invalid_one_replaced() {
    let upstream = Upstream::start().await;
    let gateway = TestGateway::proxy_to(&upstream, "", "").await;
    // Without `[tracing]` a new trace goes on as sampled (`sample` defaults to 1.0), so an
    // app that samples by its parent records it.
    let (_, _, body) = get(&gateway.url("/")).await;
    assert!(header_lines(&body, "traceparent")[0].ends_with("-01"), "{body}");
    let sent = [("traceparent", PARENT), ("tracestate", "rojo=00f067aa0ba902b7")];
    let (_, headers, body) = get_with(&gateway.url("/"), &sent).await;
    let passed = header_lines(&body, "traceparent");
    assert_eq!(passed.len(), 1, "{body}");
    let fields: Vec<&str> = passed[0].split('-').collect();
    assert_eq!(fields[0], "00");
    assert_eq!(
        fields[1], "0af7651916cd43dd8448eb211c80319c",
        "the client's trace"
    );
    assert_ne!(
        fields[2], "b7ad6b7169203331",
        "floodgate's span is the parent now"
    );
    assert_eq!(fields[3], "01", "the client's sampling decision goes on");
    assert_eq!(header_lines(&body, "tracestate"), ["rojo=00f067aa0ba902b7"]);
    // The request ID is new: the trace is the client's, not the request.
    assert_ne!(headers["x-request-id"], "0af7651916cd43dd8448eb211c80319c");

    for invalid in [
        "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "garbage",
    ] {
        let sent = [("traceparent", invalid), ("tracestate", "rojo=1")];
        let (_, headers, body) = get_with(&gateway.url("/"), &sent).await;
        let passed = header_lines(&body, "traceparent");
        assert_eq!(passed.len(), 1, "{invalid}: {body}");
        let trace = passed[0].split('-').nth(1).unwrap();
        assert!(
            is_hex_id(trace) && trace != "0af7651916cd43dd8448eb211c80319c",
            "{invalid}: {trace}"
        );
        assert_eq!(
            headers["x-request-id"], trace,
            "a new trace's ID is the request's"
        );
        assert!(
            header_lines(&body, "tracestate").is_empty(),
            "{invalid}: tracestate dropped"
        );
    }
    // Two traceparent headers: neither is believed.
    let (_, _, body) = get_with(
        &gateway.url("/"),
        &[("traceparent", PARENT), ("traceparent", PARENT)],
    )
    .await;
    let passed = header_lines(&body, "traceparent");
    assert_eq!(passed.len(), 1, "{body}");
    assert!(!passed[0].contains("0af7651916cd43dd8448eb211c80319c"));
}

/// An OTLP/HTTP receiver: what was posted to `/v1/traces`, decoded.
struct Receiver {
    url: String,
    spans: Arc<Mutex<Vec<Span>>>,
}

impl Receiver {
    async fn start() -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
        let received = spans.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let received = received.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request: Request<Incoming>| {
                        let received = received.clone();
                        async move {
                            assert_eq!(request.uri().path(), "/v1/traces");
                            assert_eq!(request.headers()["content-type"], "application/x-protobuf");
                            let body = request.into_body().collect().await.unwrap().to_bytes();
                            let export = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                            for resource in export.resource_spans {
                                let service = resource.resource.unwrap().attributes;
                                assert!(service.iter().any(|kv| kv.key == "service.name"));
                                for scope in resource.scope_spans {
                                    received.lock().unwrap().extend(scope.spans);
                                }
                            }
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        Receiver { url, spans }
    }

    /// The spans received once there are `n`, within 10 s.
    async fn wait_for(&self, n: usize) -> Vec<Span> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let spans = self.spans.lock().unwrap().clone();
            if spans.len() >= n || Instant::now() > deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn attribute(span: &Span, key: &str) -> Option<any_value::Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.clone()?.value)
}

fn text(value: Option<any_value::Value>) -> String {
    match value {
        Some(any_value::Value::StringValue(text)) => text,
        other => panic!("not a string: {other:?}"),
    }
}

fn int(value: Option<any_value::Value>) -> i64 {
    match value {
        Some(any_value::Value::IntValue(n)) => n,
        other => panic!("not an int: {other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn a_server_span_and_a_client_span_per_try_reach_the_collector() {
    let receiver = Receiver::start().await;
    let upstream = Upstream::start().await;
    let dead = format!("127.0.0.1:{}", closed_port());
    let toml = GatewayToml::new()
        .table(
            "upstreams.app",
            &format!(
                "servers = [\"http://{dead}\", \"{}\"]\nretries = 1\nbalance = \"round_robin\"",
                upstream.url()
            ),
        )
        .route("site", "path_prefix = \"/\"\nupstream = \"app\"")
        .table(
            "tracing",
            &format!("endpoint = \"{}\"\nsample = 1.0", receiver.url),
        );
    let gateway = TestGateway::start(toml).await;
    // Round robin: the first request goes to the dead server first, then to the live one.
    let (status, _, body) = get_with(&gateway.url("/page"), &[("traceparent", PARENT)]).await;
    assert_eq!(status, 200, "{body}");
    let passed = header_lines(&body, "traceparent")[0].to_owned();

    let spans = receiver.wait_for(3).await;
    assert_eq!(spans.len(), 3, "{spans:#?}");
    let server = spans.iter().find(|span| span.kind == 2).expect("a server span");
    let mut clients: Vec<&Span> = spans.iter().filter(|span| span.kind == 3).collect();
    clients.sort_by_key(|span| span.start_time_unix_nano);
    assert_eq!(clients.len(), 2, "one client span per try");
    for span in &spans {
        assert_eq!(
            hex(&span.trace_id),
            "0af7651916cd43dd8448eb211c80319c",
            "the client's trace"
        );
        assert!(span.end_time_unix_nano >= span.start_time_unix_nano);
    }
    assert_eq!(
        hex(&server.parent_span_id),
        "b7ad6b7169203331",
        "the client's span is the parent"
    );
    assert_eq!(server.name, "GET site");
    assert_eq!(text(attribute(server, "http.request.method")), "GET");
    assert_eq!(text(attribute(server, "http.route")), "site");
    assert_eq!(int(attribute(server, "http.response.status_code")), 200);
    assert_eq!(text(attribute(server, "client.address")), "127.0.0.1");
    assert_eq!(text(attribute(server, "floodgate.limit.outcome")), "none");
    assert_eq!(text(attribute(server, "url.scheme")), "http");
    assert_eq!(text(attribute(server, "url.path")), "/page");
    for client in &clients {
        assert_eq!(
            client.parent_span_id, server.span_id,
            "tries are children of the request"
        );
    }
    let (failed, served) = (clients[0], clients[1]);
    assert_eq!(text(attribute(failed, "server.address")), "127.0.0.1");
    assert_eq!(
        int(attribute(failed, "server.port")),
        i64::from(dead.rsplit(':').next().unwrap().parse::<u16>().unwrap())
    );
    assert_eq!(text(attribute(failed, "error.type")), "connect");
    assert_eq!(failed.status.as_ref().map(|status| status.code), Some(2));
    assert_eq!(int(attribute(served, "http.response.status_code")), 200);
    assert_eq!(int(attribute(served, "http.request.resend_count")), 1);
    assert_eq!(
        int(attribute(served, "server.port")),
        i64::from(upstream.addr.port())
    );
    // The upstream saw the served try's span as its parent.
    assert_eq!(
        passed,
        format!("00-0af7651916cd43dd8448eb211c80319c-{}-01", hex(&served.span_id))
    );
    assert_ne!(failed.span_id, served.span_id, "each try a span of its own");
}

/// A request that one try serves: the upstream is told that try's span, a child of the
/// request's, as its parent.
#[tokio::test]
async fn a_single_try_names_its_own_span_to_the_upstream() {
    let receiver = Receiver::start().await;
    let upstream = Upstream::start().await;
    let toml = GatewayToml::new()
        .upstream("app", &upstream.url(), "")
        .route("site", "path_prefix = \"/\"\nupstream = \"app\"")
        .table(
            "tracing",
            &format!("endpoint = \"{}\"\nsample = 1.0", receiver.url),
        );
    let gateway = TestGateway::start(toml).await;
    let (status, _, body) = get_with(&gateway.url("/"), &[("traceparent", PARENT)]).await;
    assert_eq!(status, 200, "{body}");
    let passed = header_lines(&body, "traceparent")[0].to_owned();

    let spans = receiver.wait_for(2).await;
    let client = spans.iter().find(|span| span.kind == 3).expect("a client span");
    let server = spans.iter().find(|span| span.kind == 2).expect("a server span");
    assert_eq!(client.parent_span_id, server.span_id);
    assert_ne!(client.span_id, server.span_id);
    assert_eq!(
        passed,
        format!("00-0af7651916cd43dd8448eb211c80319c-{}-01", hex(&client.span_id))
    );
}

/// Ratio sampling compares a trace ID's low bits with the ratio; a client that floodgate
/// does not trust chooses the ID of the trace it continues, so its request is decided by
/// a draw of floodgate's own: an ID just above zero would be below every ratio.
#[tokio::test]
async fn a_client_cannot_choose_an_id_that_the_ratio_always_records() {
    let receiver = Receiver::start().await;
    let upstream = Upstream::start().await;
    let gateway = TestGateway::start(GatewayToml::new().proxy_to(&upstream.url(), "").table(
        "tracing",
        &format!("endpoint = \"{}\"\nsample = 0.000000001", receiver.url),
    ))
    .await;
    let chosen = "00-0af7651916cd43dd0000000000000001-b7ad6b7169203331-00";
    for _ in 0..10 {
        let (_, _, body) = get_with(&gateway.url("/"), &[("traceparent", chosen)]).await;
        let sent = &header_lines(&body, "traceparent")[0];
        assert!(
            sent.starts_with("00-0af7651916cd43dd0000000000000001-"),
            "continued: {body}"
        );
        assert!(sent.ends_with("-00"), "not recorded: {body}");
    }
}

/// A trace continued from a trusted proxy is recorded as its `sampled` flag says; one a
/// client floodgate does not trust sent, by the ratio, as a new one (its flag alone would
/// have every request of its recorded).
#[tokio::test]
async fn sampling_follows_a_trusted_parent_or_the_ratio() {
    let receiver = Receiver::start().await;
    let upstream = Upstream::start().await;
    let tracing = format!("endpoint = \"{}\"\nsample = 0.0", receiver.url);
    let untrusting = TestGateway::start(
        GatewayToml::new()
            .proxy_to(&upstream.url(), "")
            .table("tracing", &tracing),
    )
    .await;
    // A new trace at ratio 0: not recorded, and the upstream is told so.
    let (_, _, body) = get(&untrusting.url("/")).await;
    assert!(header_lines(&body, "traceparent")[0].ends_with("-00"), "{body}");
    // A client's parent that sampled: the ratio decides, and the upstream is told.
    let (_, _, body) = get_with(&untrusting.url("/"), &[("traceparent", PARENT)]).await;
    let sent = &header_lines(&body, "traceparent")[0];
    assert!(
        sent.starts_with("00-0af7651916cd43dd8448eb211c80319c-"),
        "continued: {body}"
    );
    assert!(sent.ends_with("-00"), "{body}");
    let trusting = TestGateway::start(
        GatewayToml::new()
            .server("trusted_proxies = [\"127.0.0.1/32\"]")
            .proxy_to(&upstream.url(), "")
            .table("tracing", &tracing),
    )
    .await;
    // A trusted parent that did not sample: not recorded either.
    let unsampled = PARENT.replace("-01", "-00");
    let (_, _, body) = get_with(&trusting.url("/"), &[("traceparent", &unsampled)]).await;
    assert!(header_lines(&body, "traceparent")[0].ends_with("-00"), "{body}");
    // A trusted parent that sampled: recorded whatever the ratio.
    let (_, _, body) = get_with(&trusting.url("/"), &[("traceparent", PARENT)]).await;
    assert!(header_lines(&body, "traceparent")[0].ends_with("-01"), "{body}");
    let spans = receiver.wait_for(2).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let spans_later = receiver.spans.lock().unwrap().len();
    assert_eq!(
        spans.len(),
        2,
        "the trusted sampled request's server and client span only"
    );
    assert_eq!(spans_later, 2);
    assert!(
        spans
            .iter()
            .all(|span| hex(&span.trace_id) == "0af7651916cd43dd8448eb211c80319c")
    );
}

/// The slowest of `n` requests, one after the other.
async fn slowest_of(gateway: &TestGateway, n: usize) -> Duration {
    let mut slowest = Duration::ZERO;
    for _ in 0..n {
        let started = Instant::now();
        let (status, _, _) = get(&gateway.url("/")).await;
        assert_eq!(status, 200);
        slowest = slowest.max(started.elapsed());
    }
    slowest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_or_silent_collector_never_delays_a_request_and_drops_are_counted() {
    let upstream = Upstream::start().await;
    let untraced = TestGateway::proxy_to(&upstream, "", "").await;
    let baseline = slowest_of(&untraced, 200).await;

    let dead = format!("http://127.0.0.1:{}", closed_port());
    let toml = GatewayToml::new()
        .proxy_to(&upstream.url(), "")
        .table("tracing", &format!("endpoint = \"{dead}\""));
    let traced = TestGateway::start(toml).await;
    let slowest = slowest_of(&traced, 200).await;
    // A request that waited for an export would wait for a connection or its timeout;
    // noise on a busy machine stays far below that.
    assert!(
        slowest < baseline + Duration::from_secs(1),
        "slowest traced request {slowest:?}, untraced {baseline:?}"
    );
    // The failed exports' spans are counted, within a batch's delay.
    let deadline = Instant::now() + Duration::from_secs(10);
    while traced.metric("floodgate_trace_spans_dropped_total").await < 400.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(traced.metric("floodgate_trace_spans_dropped_total").await, 400.0);

    // A collector that accepts and never answers: the export waits, the queue fills,
    // requests go on as fast, and what does not fit is dropped at once.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("http://{}", silent.local_addr().unwrap());
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((tcp, _)) = silent.accept().await {
            open.push(tcp);
        }
    });
    let toml = GatewayToml::new()
        .proxy_to(&upstream.url(), "")
        .table("tracing", &format!("endpoint = \"{silent_url}\""));
    let traced = TestGateway::start(toml).await;
    let slowest = slowest_of(&traced, 1500).await;
    assert!(
        slowest < baseline + Duration::from_secs(1),
        "slowest request with a silent collector {slowest:?}, untraced {baseline:?}"
    );
    // 3000 spans (the last request's server span perhaps still on its way): one batch of
    // at most 512 is out, 2048 wait, the rest were dropped.
    let dropped = traced.metric("floodgate_trace_spans_dropped_total").await;
    assert!(dropped >= 3000.0 - 512.0 - 2048.0 - 1.0, "{dropped}");
    held.abort();
}

#[tokio::test]
async fn upstream_latency_requests_in_flight_and_build_info_are_exported() {
    let upstream = Upstream::start().await;
    let gateway = TestGateway::proxy_to(&upstream, "", "").await;
    let series = format!(
        "floodgate_upstream_duration_seconds_count{{upstream=\"app\",server=\"{}\"}}",
        upstream.addr
    );
    assert_eq!(gateway.metric(&series).await, 0.0);
    let slow = tokio::spawn({
        let url = gateway.url("/slow?ms=1500");
        async move { get(&url).await }
    });
    assert!(
        eventually(|| async { gateway.metric("floodgate_requests_in_flight").await == 1.0 }).await,
        "the slow request is in flight"
    );
    assert_eq!(slow.await.unwrap().0, 200);
    let _ = get(&gateway.url("/")).await;
    assert_eq!(gateway.metric(&series).await, 2.0);
    let sum = format!(
        "floodgate_upstream_duration_seconds_sum{{upstream=\"app\",server=\"{}\"}}",
        upstream.addr
    );
    assert!(gateway.metric(&sum).await >= 1.5);
    assert!(
        eventually(|| async { gateway.metric("floodgate_requests_in_flight").await == 0.0 }).await,
        "none in flight once answered"
    );
    let version = format!(
        "floodgate_build_info{{version=\"{}\"}}",
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(gateway.metric(&version).await, 1.0);
}

/// Whether `check` comes true within 5 s.
async fn eventually<F: std::future::Future<Output = bool>>(check: impl Fn() -> F) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test]
async fn php_sees_its_try_as_the_parent_span() {
    let receiver = Receiver::start().await;
    let fpm = PhpFpm::start(2);
    fpm.file(
        "/index.php",
        "<?php echo $_SERVER['HTTP_TRACEPARENT'], \"\\n\", $_SERVER['HTTP_X_REQUEST_ID'];",
    );
    let toml = GatewayToml::new()
        .upstream("php", &fpm.url(), "")
        .route(
            "site",
            &format!(
                "path_prefix = \"/\"\nupstream = \"php\"\nroot = \"{}\"",
                fpm.site().display()
            ),
        )
        .table("tracing", &format!("endpoint = \"{}\"", receiver.url));
    let gateway = TestGateway::start(toml).await;
    let (status, headers, body) = get_with(&gateway.url("/"), &[("traceparent", PARENT)]).await;
    assert_eq!(status, 200, "{body}");
    let (traceparent, id) = body.split_once('\n').unwrap();
    assert_eq!(id, headers["x-request-id"]);
    let spans = receiver.wait_for(2).await;
    let client = spans.iter().find(|span| span.kind == 3).expect("a client span");
    let server = spans.iter().find(|span| span.kind == 2).expect("a server span");
    assert_eq!(client.parent_span_id, server.span_id);
    // What PHP-FPM got names the try's span, written over the records for that try.
    assert_eq!(
        traceparent,
        format!("00-0af7651916cd43dd8448eb211c80319c-{}-01", hex(&client.span_id))
    );
    assert_eq!(text(attribute(client, "server.address")), "127.0.0.1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_still_queued_at_shutdown_are_sent() {
    let receiver = Receiver::start().await;
    let upstream = Upstream::start().await;
    let toml = GatewayToml::new()
        .proxy_to(&upstream.url(), "")
        .table("tracing", &format!("endpoint = \"{}\"", receiver.url));
    let mut gateway = FloodgateProcess::start(toml, &[]);
    let (status, _, _) = get(&gateway.url("/")).await;
    assert_eq!(status, 200);
    // At once, well within the batch's delay of a second.
    gateway.signal(libc::SIGTERM);
    let exited = tokio::task::block_in_place(|| gateway.wait_exit(Duration::from_secs(10)));
    assert!(exited.is_some_and(|status| status.success()), "{exited:?}");
    let spans = receiver.spans.lock().unwrap().clone();
    assert_eq!(spans.len(), 2, "the server and the client span: {spans:#?}");
}

#[tokio::test]
async fn the_server_span_says_what_the_limits_made_of_the_request() {
    let receiver = Receiver::start().await;
    let upstream = Upstream::start().await;
    let toml = GatewayToml::new()
        .upstream("app", &upstream.url(), "")
        .limit(
            "one",
            "algorithm = \"fixed_window\"\nlimit = 1\nwindow = \"1m\"\nkey = [\"client_ip\"]",
        )
        .route(
            "limited",
            "path_prefix = \"/\"\nupstream = \"app\"\nlimits = [\"one\"]",
        )
        .table("tracing", &format!("endpoint = \"{}\"", receiver.url));
    let gateway = TestGateway::start(toml).await;
    assert_eq!(get(&gateway.url("/")).await.0, 200);
    assert_eq!(get(&gateway.url("/")).await.0, 429);
    let spans = receiver.wait_for(3).await;
    let mut outcomes: Vec<(i64, String)> = spans
        .iter()
        .filter(|span| span.kind == 2)
        .map(|span| {
            (
                int(attribute(span, "http.response.status_code")),
                text(attribute(span, "floodgate.limit.outcome")),
            )
        })
        .collect();
    outcomes.sort();
    assert_eq!(
        outcomes,
        [(200, "allowed".to_owned()), (429, "rejected".to_owned())]
    );
}

/// The sizes of the header blocks of five responses on one HTTP/2 connection to a gateway
/// with `server` in its `[server]` table (`nghttp`, from nghttp2-client).
fn http2_header_blocks(server: &str) -> Vec<usize> {
    let gateway = FloodgateProcess::start(
        GatewayToml::new()
            .server(server)
            .route("hello", r#"respond = { body = "hi" }"#),
        &[],
    );
    let output = std::process::Command::new("nghttp")
        .args(["-nv", "-m", "5", &gateway.url("/")])
        .output()
        .expect("nghttp (nghttp2-client) runs");
    let output = String::from_utf8_lossy(&output.stdout);
    let sizes: Vec<usize> = output
        .lines()
        .filter(|line| line.contains("recv HEADERS frame"))
        .filter_map(|line| line.split("length=").nth(1)?.split(',').next()?.parse().ok())
        .collect();
    assert_eq!(sizes.len(), 5, "{output}");
    sizes
}

/// Over HTTP/2 an ID's value is never indexed (each is new), and after a connection's
/// first response its name is sent as an index into the connection's table: the ID then
/// adds its value's bytes alone (32 hex digits Huffman-coded take about 21, with a length
/// byte and two for the name's index), where spelling the name out would add 9 more.
#[test]
fn over_http2_an_ids_name_is_sent_once_a_connection() {
    let with_ids = http2_header_blocks("");
    let without_ids = http2_header_blocks(r#"request_id = """#);
    for (with_id, without) in with_ids.iter().zip(&without_ids).skip(1) {
        assert!(with_id - without <= 27, "{with_ids:?} against {without_ids:?}");
    }
}
