//! Upgrade tunnels: once an upstream has accepted a protocol switch (`101`), the client's
//! and the upstream's connections are joined and bytes copied both ways until either side
//! closes. A tunnel is a request in flight: it holds what its request held (its server
//! slot and its concurrency-limit slots) until it closes, and it is closed after
//! `server.tunnel_idle_timeout` without a byte either way.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Response, StatusCode};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use super::UpstreamBody;

/// When the upstream accepted a protocol switch, the tunnel: joins `client`'s upgraded
/// connection to the upstream's and copies bytes both ways, holding what the request
/// held, for the client connection's task to run once hyper has handed it over.
pub(crate) fn tunnel(
    client: OnUpgrade,
    response: &mut Response<UpstreamBody>,
    upstream: Arc<str>,
    idle_timeout: Duration,
) -> Option<impl Future<Output = ()> + Send + 'static> {
    if response.status() != StatusCode::SWITCHING_PROTOCOLS {
        return None;
    }
    let body = response.body_mut();
    let held = body.held.take();
    let upstream_side = body.take_switched()?;
    Some(async move {
        match client.await {
            Ok(client) => {
                if let Err(e) = relay(TokioIo::new(client), upstream_side, idle_timeout).await {
                    tracing::debug!(%upstream, error = %e, "upgraded connection ended with an error");
                }
            }
            Err(e) => tracing::warn!(%upstream, error = %e, "protocol upgrade failed"),
        }
        drop(held);
    })
}

/// Copies bytes both ways until either side closes, or until neither has sent a byte for
/// `idle_timeout`; then both connections are closed.
async fn relay(
    client: impl AsyncRead + AsyncWrite + Unpin,
    upstream: impl AsyncRead + AsyncWrite + Unpin,
    idle_timeout: Duration,
) -> io::Result<()> {
    let opened = Instant::now();
    let last_read = AtomicU64::new(0);
    let mut client = Side {
        io: client,
        opened,
        last_read: &last_read,
    };
    let mut upstream = Side {
        io: upstream,
        opened,
        last_read: &last_read,
    };
    let copy = tokio::io::copy_bidirectional(&mut client, &mut upstream);
    tokio::pin!(copy);
    let mut idle_at = opened + idle_timeout;
    loop {
        tokio::select! {
            copied = &mut copy => return copied.map(drop),
            () = tokio::time::sleep_until(idle_at) => {
                idle_at = opened + Duration::from_micros(last_read.load(Ordering::Relaxed)) + idle_timeout;
                if idle_at <= Instant::now() {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no byte either way for server.tunnel_idle_timeout",
                    ));
                }
            }
        }
    }
}

/// One side of a tunnel, noting when it last delivered bytes (in microseconds since the
/// tunnel opened).
struct Side<'a, T> {
    io: T,
    opened: Instant,
    last_read: &'a AtomicU64,
}

impl<T: AsyncRead + Unpin> AsyncRead for Side<'_, T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            let now = u64::try_from(self.opened.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.last_read.store(now, Ordering::Relaxed);
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Side<'_, T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
