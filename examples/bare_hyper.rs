//! The floor under floodgate's rejecting path: hyper alone, on one current-thread runtime,
//! answering every request with a fixed 429 from memory (no routing, no limits, no
//! framing guard, no logging). What this costs per request on a machine bounds what any
//! hyper-based gateway can reach there; docs/performance.md compares it with nginx's
//! `limit_req` rejection in the same run.
//!
//! ```sh
//! cargo run --release --example bare_hyper -- 127.0.0.1:18099
//! ```

use std::convert::Infallible;

use bytes::Bytes;
use http::{Response, StatusCode, header};
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
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let listener = TcpListener::bind(&address).await?;
        loop {
            let (stream, _) = listener.accept().await?;
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = service_fn(|_request| async {
                    let mut response = Response::new(Full::new(Bytes::from_static(b"Too Many Requests\n")));
                    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                    response
                        .headers_mut()
                        .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
                    Ok::<_, Infallible>(response)
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    })
}
