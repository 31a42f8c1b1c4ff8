//! The floor under floodgate's rejecting path: hyper alone, on one current-thread runtime,
//! answering every request with a fixed 429 from memory (no routing, no limits, no
//! framing guard, no logging). What this costs per request on a machine bounds what any
//! hyper-based gateway can reach there; docs/performance.md compares it with nginx's
//! `limit_req` rejection in the same run.
//!
//! ```sh
//! cargo run --release --example bare_hyper -- 127.0.0.1:18099
//! ```
//!
//! With `BARE_HYPER_HEADERS=refusal` the 429 carries the headers floodgate's refusal must
//! (SPEC section 5 and 17): `Content-Type`, `Retry-After`, `RateLimit-Policy`, a
//! `RateLimit` value made per response and a new 128-bit request ID: the floor under a
//! refusal that keeps the contract, before any routing or decision.

use std::convert::Infallible;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// The allocator floodgate itself uses.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::io::Result<()> {
    let address = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:18099".to_owned());
    let contract = std::env::var("BARE_HYPER_HEADERS").is_ok_and(|headers| headers == "refusal");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let listener = TcpListener::bind(&address).await?;
        loop {
            let (stream, _) = listener.accept().await?;
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = service_fn(move |_request| async move {
                    let mut response = Response::new(Full::new(Bytes::from_static(b"Too Many Requests\n")));
                    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                    let headers = response.headers_mut();
                    headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                    if contract {
                        add_refusal_headers(headers);
                    }
                    Ok::<_, Infallible>(response)
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    })
}

/// The headers floodgate's refusal carries besides `Retry-After`, values made as
/// floodgate makes them (the remaining room formatted, the ID random and shared).
fn add_refusal_headers(headers: &mut http::HeaderMap) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    headers.insert(
        HeaderName::from_static("ratelimit-policy"),
        HeaderValue::from_static("\"per_ip\";q=1;w=3600"),
    );
    let mut room = String::from("\"per_ip\";r=0;t=");
    room.push_str(itoa::Buffer::new().format(3600_u64));
    headers.insert(
        HeaderName::from_static("ratelimit"),
        HeaderValue::try_from(room).expect("visible ASCII"),
    );
    let mut id = [0; 32];
    for (pair, byte) in id.chunks_exact_mut(2).zip(fastrand::u128(..).to_be_bytes()) {
        pair.copy_from_slice(&[DIGITS[usize::from(byte >> 4)], DIGITS[usize::from(byte & 0x0f)]]);
    }
    headers.insert(
        HeaderName::from_static("x-request-id"),
        HeaderValue::from_maybe_shared(Bytes::from_owner(id)).expect("hex digits"),
    );
}
