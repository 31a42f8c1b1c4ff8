//! Large bodies stream through both ways: a 200 MB upload echoed back and a
//! 200 MB download arrive whole and in order. (Memory staying flat is tested elsewhere.)

use std::convert::Infallible;

use crate::common::{TestGateway, Upstream, http1_client};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

const TOTAL: u64 = 200 * 1024 * 1024;
const CHUNK: usize = 64 * 1024;

async fn gateway(upstream: &Upstream) -> TestGateway {
    TestGateway::proxy_to(upstream, "", "timeout = \"10s\"").await
}

/// Bytes repeating with a fixed period, handed out as zero-copy slices.
#[derive(Clone)]
struct Pattern {
    period: u64,
    /// One chunk plus one period, so a chunk can start at any phase.
    bytes: Bytes,
}

impl Pattern {
    fn new(period: u8, byte_at: impl Fn(u8) -> u8) -> Pattern {
        let len = CHUNK + usize::from(period);
        let bytes = (0..len)
            .map(|i| byte_at((i % usize::from(period)) as u8))
            .collect::<Vec<u8>>();
        Pattern {
            period: u64::from(period),
            bytes: Bytes::from(bytes),
        }
    }

    /// The `len` (at most `CHUNK`) bytes starting at `offset` of the endless pattern.
    fn at(&self, offset: u64, len: usize) -> Bytes {
        let phase = (offset % self.period) as usize;
        self.bytes.slice(phase..phase + len)
    }
}

/// A prime period of distinct bytes: a dropped, repeated or reordered chunk shows.
fn counting() -> Pattern {
    Pattern::new(251, |i| i)
}

/// `TOTAL` bytes of `pattern`, produced chunk by chunk as the connection takes them.
fn body_of(pattern: Pattern) -> BoxBody<Bytes, Infallible> {
    let mut sent = 0u64;
    let stream = futures_util::stream::poll_fn(move |_| {
        if sent >= TOTAL {
            return std::task::Poll::Ready(None);
        }
        let len = (TOTAL - sent).min(CHUNK as u64) as usize;
        let chunk = pattern.at(sent, len);
        sent += len as u64;
        std::task::Poll::Ready(Some(Ok::<_, Infallible>(Frame::data(chunk))))
    });
    StreamBody::new(stream).boxed()
}

/// Reads `body` to the end; returns the byte count and the offset of the first byte that
/// differs from `expected`.
async fn drain(mut body: Incoming, expected: &Pattern) -> (u64, Option<u64>) {
    let mut received = 0u64;
    let mut first_mismatch = None;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.expect("body frame").into_data() else {
            continue;
        };
        for piece in data.chunks(CHUNK) {
            let wanted = expected.at(received, piece.len());
            if first_mismatch.is_none() && piece != wanted {
                let at = piece.iter().zip(wanted.iter()).position(|(a, b)| a != b);
                first_mismatch = Some(received + at.unwrap_or(0) as u64);
            }
            received += piece.len() as u64;
        }
    }
    (received, first_mismatch)
}

/// POSTs `TOTAL` patterned bytes to `/echo` and checks that all of them come back in order.
async fn echo_200_mb(declare_length: bool) {
    let upstream = Upstream::start().await;
    let gw = gateway(&upstream).await;
    let client: Client<_, BoxBody<Bytes, Infallible>> = Client::builder(TokioExecutor::new()).build_http();

    let mut request = Request::post(gw.url("/echo"));
    if declare_length {
        request = request.header("content-length", TOTAL.to_string());
    }
    let response = client
        .request(request.body(body_of(counting())).unwrap())
        .await
        .expect("response head");
    assert_eq!(response.status(), StatusCode::OK);
    let (received, mismatch) = drain(response.into_body(), &counting()).await;
    assert_eq!(received, TOTAL);
    assert_eq!(mismatch, None);
    assert_eq!(upstream.requests(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_200_mb_request_body_with_content_length_streams_upstream_and_back() {
    echo_200_mb(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_200_mb_chunked_request_body_streams_upstream_and_back() {
    echo_200_mb(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_200_mb_response_body_streams_to_the_client() {
    let upstream = Upstream::start().await;
    let gw = gateway(&upstream).await;

    let request = Request::get(gw.url(&format!("/big?bytes={TOTAL}")))
        .body(Full::<Bytes>::default())
        .unwrap();
    let response = http1_client().request(request).await.expect("response head");
    assert_eq!(response.status(), StatusCode::OK);
    let (received, mismatch) = drain(response.into_body(), &Pattern::new(1, |_| b'x')).await;
    assert_eq!(received, TOTAL);
    assert_eq!(mismatch, None);
}
