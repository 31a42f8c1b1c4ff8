//! Compression on a route with `compress = true` (docs/configuration.md#routescompress):
//! what an app's responses and a site's files look like to a client that accepts
//! zstd, br or gzip, what is never compressed, and precompressed siblings of files.

use crate::common;

use crate::common::config::GatewayToml;
use crate::common::stub::StubUpstream;
use crate::common::{TestGateway, h2c_client, http1_client};
use async_compression::tokio::bufread::{BrotliDecoder, GzipDecoder, ZstdDecoder};
use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::io::AsyncReadExt;

/// A page that compresses well, larger than any single read.
fn page() -> String {
    (0..4000)
        .map(|i| format!("<p>paragraph {i} of the page</p>\n"))
        .collect()
}

async fn fetch(method: Method, url: &str, headers: &[(&str, &str)]) -> (StatusCode, HeaderMap, Bytes) {
    let mut request = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = http1_client()
        .request(request.body(Full::default()).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

/// A revalidation of `url` with `etag` by a client that takes gzip.
async fn revalidate(url: &str, etag: &str) -> (StatusCode, HeaderMap) {
    let (status, headers, _) = fetch(
        Method::GET,
        url,
        &[("accept-encoding", "gzip"), ("if-none-match", etag)],
    )
    .await;
    (status, headers)
}

async fn decode(coding: &str, encoded: &[u8]) -> String {
    let mut decoded = String::new();
    match coding {
        "zstd" => ZstdDecoder::new(encoded).read_to_string(&mut decoded).await,
        "br" => BrotliDecoder::new(encoded).read_to_string(&mut decoded).await,
        "gzip" => GzipDecoder::new(encoded).read_to_string(&mut decoded).await,
        other => panic!("unexpected coding {other}"),
    }
    .unwrap();
    decoded
}

fn typed(content_type: &'static str, body: impl Into<Bytes>) -> Response<Bytes> {
    Response::builder()
        .header("content-type", content_type)
        .body(body.into())
        .unwrap()
}

async fn app() -> common::stub::ListeningStub {
    StubUpstream::http1()
        .route_fn("/page", |_| typed("text/html; charset=utf-8", page()))
        .route_fn("/data", |_| typed("application/problem+json", page()))
        .route_fn("/image", |_| typed("image/png", page()))
        .route_fn("/events", |_| typed("text/event-stream", page()))
        .route_fn("/short", |_| typed("text/html", "<p>short</p>"))
        .route_fn("/no-transform", |_| {
            let mut response = typed("text/html", page());
            response
                .headers_mut()
                .insert("cache-control", "public, no-transform".parse().unwrap());
            response
        })
        .route_fn("/encoded", |_| {
            let mut response = typed("text/html", page());
            response
                .headers_mut()
                .insert("content-encoding", "gzip".parse().unwrap());
            response
        })
        .route_fn("/tagged", |_| {
            let mut response = typed("text/css", page());
            response.headers_mut().insert("etag", "\"v1\"".parse().unwrap());
            response.headers_mut().insert("vary", "Origin".parse().unwrap());
            response
        })
        .run()
        .await
}

#[tokio::test]
async fn an_apps_text_is_compressed_in_the_coding_the_client_prefers() {
    let app = app().await;
    let gw = TestGateway::start(
        GatewayToml::new()
            .upstream("app", &app.url(), "")
            .route(
                "plain",
                "path_prefix = \"/plain/\"\nstrip_prefix = \"/plain\"\nupstream = \"app\"",
            )
            .route("app", "upstream = \"app\"\ncompress = true"),
    )
    .await;
    for (accept, coding) in [
        ("gzip, deflate, br, zstd", "zstd"),
        ("gzip, br", "br"),
        ("gzip", "gzip"),
        ("br;q=0.5, gzip", "gzip"),
        ("*", "zstd"),
    ] {
        for path in ["/page", "/data"] {
            let (status, headers, body) =
                fetch(Method::GET, &gw.url(path), &[("accept-encoding", accept)]).await;
            assert_eq!(status, StatusCode::OK);
            assert_eq!(headers["content-encoding"], coding, "{accept} {path}");
            assert_eq!(headers["vary"], "Accept-Encoding");
            assert!(!headers.contains_key("content-length"));
            assert!(
                body.len() < page().len() / 4,
                "{accept} {path}: {} bytes",
                body.len()
            );
            assert_eq!(decode(coding, &body).await, page(), "{accept} {path}");
        }
    }
    // A client that accepts no coding gets the original, and a cache learns it varies.
    let (_, headers, body) = fetch(Method::GET, &gw.url("/page"), &[]).await;
    assert!(!headers.contains_key("content-encoding"));
    assert_eq!(headers["vary"], "Accept-Encoding");
    assert_eq!(body, page());
    // A route without `compress` sends what the app sent.
    let (_, headers, body) = fetch(
        Method::GET,
        &gw.url("/plain/page"),
        &[("accept-encoding", "gzip")],
    )
    .await;
    assert!(!headers.contains_key("content-encoding") && !headers.contains_key("vary"));
    assert_eq!(body, page());
    // The app's validator is kept, weakened; its Vary gains Accept-Encoding.
    let (_, headers, body) = fetch(Method::GET, &gw.url("/tagged"), &[("accept-encoding", "br")]).await;
    assert_eq!(headers["etag"], "W/\"v1\"");
    assert_eq!(
        headers.get_all("vary").iter().collect::<Vec<_>>(),
        ["Origin", "Accept-Encoding"]
    );
    assert_eq!(decode("br", &body).await, page());
}

#[tokio::test]
async fn what_is_never_compressed() {
    let app = app().await;
    let gw = TestGateway::start(
        GatewayToml::new()
            .upstream("app", &app.url(), "")
            .route("app", "upstream = \"app\"\ncompress = true"),
    )
    .await;
    for path in ["/image", "/events", "/short", "/no-transform"] {
        let (_, headers, body) = fetch(
            Method::GET,
            &gw.url(path),
            &[("accept-encoding", "zstd, br, gzip")],
        )
        .await;
        assert!(!headers.contains_key("content-encoding"), "{path}");
        assert!(!headers.contains_key("vary"), "{path}");
        assert!(body == page() || body == "<p>short</p>", "{path}");
    }
    // Already encoded by the app: passed as it is, never twice.
    let (_, headers, body) = fetch(Method::GET, &gw.url("/encoded"), &[("accept-encoding", "br")]).await;
    assert_eq!(headers["content-encoding"], "gzip");
    assert_eq!(body, page());
}

/// A site whose page is large enough to compress, with a precompressed script beside it.
fn site() -> tempfile::TempDir {
    let site = tempfile::tempdir().unwrap();
    std::fs::write(site.path().join("index.html"), page()).unwrap();
    std::fs::write(site.path().join("app.js"), "console.log('plain')").unwrap();
    std::fs::write(site.path().join("app.js.br"), "PRECOMPRESSED-BR").unwrap();
    site
}

#[tokio::test]
async fn files_are_compressed_but_never_a_part_and_a_head_gets_the_gets_headers() {
    let site = site();
    let gw = TestGateway::start(GatewayToml::new().route(
        "site",
        &format!("root = \"{}\"\ncompress = true", site.path().display()),
    ))
    .await;
    let accept = [("accept-encoding", "gzip")];
    let (_, get_headers, body) = fetch(Method::GET, &gw.url("/index.html"), &accept).await;
    assert_eq!(get_headers["content-encoding"], "gzip");
    assert!(get_headers["etag"].to_str().unwrap().starts_with("W/\""));
    assert_eq!(decode("gzip", &body).await, page());
    let (status, head_headers, body) = fetch(Method::HEAD, &gw.url("/index.html"), &accept).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.is_empty());
    for name in [
        "content-encoding",
        "vary",
        "etag",
        "content-type",
        "last-modified",
    ] {
        assert_eq!(head_headers.get(name), get_headers.get(name), "{name}");
    }
    assert!(!head_headers.contains_key("content-length"));
    // The weak tag the client got revalidates it.
    let etag = get_headers["etag"].to_str().unwrap();
    let (status, headers) = revalidate(&gw.url("/index.html"), etag).await;
    assert_eq!(status, StatusCode::NOT_MODIFIED);
    assert_eq!(headers["vary"], "Accept-Encoding");
    assert_eq!(headers["etag"], etag);
    // No coding in a 304 (RFC 9110 §15.4.5): the copy it revalidates may be one sent as
    // it is while every encoder was busy, which a cache must not relabel.
    assert!(!headers.contains_key("content-encoding"), "{headers:?}");
    // A range is of the file as it is on disk, never compressed.
    let (status, headers, body) = fetch(
        Method::GET,
        &gw.url("/index.html"),
        &[("accept-encoding", "gzip"), ("range", "bytes=3-10")],
    )
    .await;
    assert_eq!(status, StatusCode::PARTIAL_CONTENT);
    assert!(!headers.contains_key("content-encoding"));
    assert_eq!(body, page()[3..=10]);
    // A precompressed sibling is sent as it is, not compressed again.
    let (_, headers, body) = fetch(
        Method::GET,
        &gw.url("/app.js"),
        &[("accept-encoding", "br, gzip")],
    )
    .await;
    assert_eq!(headers["content-encoding"], "br");
    assert_eq!(body, "PRECOMPRESSED-BR");
}

#[tokio::test]
async fn a_sites_ranges_and_siblings_on_a_route_without_compress() {
    let site = site();
    let gw = TestGateway::start(
        GatewayToml::new().route("site", &format!("root = \"{}\"", site.path().display())),
    )
    .await;
    let (status, headers, body) = fetch(Method::GET, &gw.url("/app.js"), &[("range", "bytes=-7")]).await;
    assert_eq!(status, StatusCode::PARTIAL_CONTENT);
    assert_eq!(headers["content-range"], "bytes 13-19/20");
    assert_eq!(body, "plain')");
    let (status, headers, body) = fetch(Method::GET, &gw.url("/app.js"), &[("range", "bytes=20-")]).await;
    assert_eq!(status, StatusCode::RANGE_NOT_SATISFIABLE);
    assert_eq!(headers["content-range"], "bytes */20");
    assert!(body.is_empty());
    let (_, headers, body) = fetch(Method::GET, &gw.url("/app.js"), &[("accept-encoding", "br")]).await;
    assert_eq!(
        (
            headers["content-encoding"].to_str().unwrap(),
            headers["vary"].to_str().unwrap()
        ),
        ("br", "Accept-Encoding")
    );
    assert_eq!(body, "PRECOMPRESSED-BR");
    // A client that accepts no coding with a sibling gets the file itself.
    let (_, headers, body) = fetch(Method::GET, &gw.url("/app.js"), &[("accept-encoding", "gzip")]).await;
    assert!(!headers.contains_key("content-encoding"));
    assert_eq!(body, "console.log('plain')");
}

/// A file's length comes on the wire from its body (HTTP/1.1 and HTTP/2 alike), and
/// decides, as a `Content-Length` would, that a file under 1 KB goes as it is.
#[tokio::test]
async fn a_files_length_is_sent_and_a_short_file_is_not_compressed() {
    let site = site();
    std::fs::write(site.path().join("short.html"), "<p>short</p>").unwrap();
    let gw = TestGateway::start(GatewayToml::new().route(
        "site",
        &format!("root = \"{}\"\ncompress = true", site.path().display()),
    ))
    .await;
    let accept = [("accept-encoding", "gzip")];
    let (status, headers, body) = fetch(Method::GET, &gw.url("/short.html"), &accept).await;
    assert_eq!(status, StatusCode::OK);
    assert!(!headers.contains_key("content-encoding"), "{headers:?}");
    assert_eq!(headers["content-length"], "12");
    assert_eq!(body, "<p>short</p>");
    // Its revalidation and its HEAD say what its GET said: not encoded.
    let etag = headers["etag"].to_str().unwrap();
    let (status, revalidated) = revalidate(&gw.url("/short.html"), etag).await;
    assert_eq!(status, StatusCode::NOT_MODIFIED);
    assert!(!revalidated.contains_key("content-encoding"), "{revalidated:?}");
    assert_eq!(revalidated["etag"], headers["etag"]);
    let (_, head, _) = fetch(Method::HEAD, &gw.url("/short.html"), &accept).await;
    assert!(!head.contains_key("content-encoding"), "{head:?}");
    // floodgate's own answers are decided by their headers, GET and HEAD alike.
    let (status, get_404, _) = fetch(Method::GET, &gw.url("/missing.html"), &accept).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (_, head_404, _) = fetch(Method::HEAD, &gw.url("/missing.html"), &accept).await;
    for name in ["content-encoding", "vary", "content-length"] {
        assert_eq!(get_404.get(name), head_404.get(name), "{name}");
    }
    let (_, headers, _) = fetch(Method::GET, &gw.url("/index.html"), &[]).await;
    assert_eq!(headers["content-length"], page().len().to_string().as_str());
    let response = h2c_client()
        .request(Request::get(gw.url("/index.html")).body(Full::default()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.version(), http::Version::HTTP_2);
    assert_eq!(
        response.headers()["content-length"],
        page().len().to_string().as_str()
    );
    // An empty file states its length too (hyper's HTTP/2 would not, for a body at its end).
    std::fs::write(site.path().join("empty.txt"), "").unwrap();
    let response = h2c_client()
        .request(Request::get(gw.url("/empty.txt")).body(Full::default()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.headers()["content-length"], "0");
}
