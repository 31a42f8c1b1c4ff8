//! Listeners and connections: accepts clients (HTTP/1.1 and h2c on one port), applies
//! connection-level limits (header read timeout, header size), serves the admin listener,
//! and shuts down gracefully: stop accepting, let in-flight requests finish within
//! `server.shutdown_grace`, then return.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin;
use crate::client_ip::Peer;
use crate::config::Config;
use crate::disconnect::Watched;
use crate::framing::FramingGuard;
use crate::service::{Shared, handle};
use crate::state::GatewayState;

/// Largest request head (request line and headers) accepted; beyond it: 431.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// How long a starting gateway waits for Redis before serving under `on_error`.
const STORE_STARTUP_WAIT: Duration = Duration::from_secs(1);

/// A bound, not yet serving, gateway instance.
pub struct Gateway {
    shared: Arc<Shared>,
    listener: TcpListener,
    admin_listener: TcpListener,
}

impl Gateway {
    /// Binds the proxy and admin listeners of `config`.
    pub async fn bind(config: Config) -> io::Result<Gateway> {
        let listener = bind(config.server.listen, "server.listen").await?;
        let admin_listener = bind(config.server.admin_listen, "server.admin_listen").await?;
        let state = GatewayState::new(config)
            .map_err(|e| io::Error::other(format!("cannot set up the rate-limit store: {e}")))?;
        state.store.wait_ready(STORE_STARTUP_WAIT).await;
        Ok(Gateway {
            shared: Arc::new(Shared::new(state)),
            listener,
            admin_listener,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Serves until `shutdown` completes, then drains and returns.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        let Gateway {
            shared,
            listener,
            admin_listener,
        } = self;
        let config = shared.state.load().config.clone();
        let grace = config.server.shutdown_grace;
        let connections = TaskTracker::new();
        let closing = CancellationToken::new();
        let admin = tokio::spawn(admin::serve(admin_listener, shared.clone()));

        tokio::select! {
            () = shutdown => {}
            () = accept_loop(listener, shared.clone(), connections.clone(), closing.clone()) => {}
        }
        shared.draining.store(true, Ordering::SeqCst);
        tracing::info!(in_flight = connections.len(), grace = ?grace, "shutting down: no longer accepting, draining");
        closing.cancel();
        connections.close();
        if tokio::time::timeout(grace, connections.wait()).await.is_err() {
            tracing::warn!(
                open = connections.len(),
                "shutdown grace elapsed; closing the remaining connections"
            );
        }
        admin.abort();
        tracing::info!("shut down");
    }
}

async fn bind(addr: SocketAddr, key: &str) -> io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| io::Error::new(e.kind(), format!("cannot listen on {addr} ({key}): {e}")))
}

fn connection_builder(header_timeout: Duration) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .max_buf_size(MAX_HEAD_BYTES);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_HEAD_BYTES as u32);
    builder
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    connections: TaskTracker,
    closing: CancellationToken,
) {
    let header_timeout = shared.state.load().config.server.header_timeout;
    let builder = Arc::new(connection_builder(header_timeout));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        connections.spawn(serve_connection(
            stream,
            peer,
            shared.clone(),
            builder.clone(),
            closing.clone(),
            header_timeout,
        ));
    }
}

async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    builder: Arc<auto::Builder<TokioExecutor>>,
    closing: CancellationToken,
    header_timeout: Duration,
) {
    let _ = stream.set_nodelay(true);
    let (stream, socket) = Watched::new(stream);
    let io = TokioIo::new(FramingGuard::new(stream, header_timeout));
    let tcp_peer = Arc::new(Peer::new(peer));
    let service =
        service_fn(move |request| handle(shared.clone(), tcp_peer.clone(), socket.clone(), request));
    let connection = builder.serve_connection_with_upgrades(io, service);
    tokio::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        () = closing.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}
