//! The floor under floodgate's proxy path: hyper alone, on one current-thread runtime,
//! relaying every request to one upstream over a connection of its own per client
//! connection (no pool, no routing, no header rewriting, no limits, no logging). What this
//! costs per request on a machine bounds what any hyper-based gateway can reach there;
//! docs/performance.md compares it with nginx's keep-alive reverse proxy in the same run.
//!
//! ```sh
//! cargo run --release --example bare_proxy -- 127.0.0.1:18098 127.0.0.1:8080
//! ```

use std::future::poll_fn;
use std::sync::{Arc, Mutex};

use hyper::body::Incoming;
use hyper::client::conn::http1::{SendRequest, handshake};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

/// The allocator floodgate itself uses.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: bare_proxy LISTEN_ADDRESS UPSTREAM_ADDRESS");
        std::process::exit(2);
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let listener = TcpListener::bind(&listen).await?;
        loop {
            let (client, _) = listener.accept().await?;
            let upstream = upstream.clone();
            tokio::spawn(async move {
                if let Err(error) = relay(client, &upstream).await {
                    eprintln!("bare_proxy: {error}");
                }
            });
        }
    })
}

/// Serves one client connection, sending its requests one by one over one upstream
/// connection (HTTP/1: the next request is read only after this one's response is sent).
async fn relay(client: TcpStream, upstream: &str) -> Result<(), Box<dyn std::error::Error>> {
    client.set_nodelay(true)?;
    let upstream = TcpStream::connect(upstream).await?;
    upstream.set_nodelay(true)?;
    let (sender, connection) = handshake::<_, Incoming>(TokioIo::new(upstream)).await?;
    tokio::spawn(connection);
    let sender: Arc<Mutex<SendRequest<Incoming>>> = Arc::new(Mutex::new(sender));
    let service = service_fn(move |request| {
        let sender = sender.clone();
        async move {
            poll_fn(|cx| sender.lock().expect("not poisoned").poll_ready(cx)).await?;
            // The lock is released before the response is awaited.
            let response = sender.lock().expect("not poisoned").send_request(request);
            response.await
        }
    });
    http1::Builder::new()
        .serve_connection(TokioIo::new(client), service)
        .await?;
    Ok(())
}
