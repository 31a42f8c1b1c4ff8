//! Noticing that a client has left while its request is held (leaky bucket), so
//! that its queue slot is given back and the request is never forwarded.
//!
//! hyper notices that an HTTP/1 client closed its connection only when it reads from it,
//! and it stops reading while a request body waits to be consumed: a held request's body
//! does until its turn. So a client that sends a body of more than one read and leaves
//! goes unnoticed; without this module its request keeps its place in the queue and
//! reaches the upstream, truncated, at its turn. [`ClientSocket::closed`] watches the
//! socket itself, through a duplicate of its descriptor with a readiness registration of
//! its own (so it consumes no byte and takes no wake-up from hyper's reads), and completes
//! on the peer's FIN or RST, as nginx's `ngx_http_test_reading` does during a `limit_req`
//! delay. A FIN that the client's kernel still queues behind body bytes the gateway has
//! not read cannot be seen before those bytes are read, by this or by anything else.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

/// A client connection's socket, as the requests it carries see it.
#[derive(Debug)]
pub(crate) struct ClientSocket {
    /// The socket's descriptor while the connection's stream ([`Watched`]) lives.
    fd: Mutex<Option<RawFd>>,
    /// Whether the connection closes while its client may still be sending.
    linger: AtomicBool,
    /// A duplicate of the socket, left when its stream was dropped with `linger` set,
    /// for [`ClientSocket::linger`].
    lingering: Mutex<Option<OwnedFd>>,
}

impl ClientSocket {
    /// Completes once the client has closed or reset the connection (or it is gone).
    /// Never completes if the socket cannot be watched: hyper's own detection remains.
    pub(crate) async fn closed(&self) {
        let watch = match self.duplicate() {
            Ok(Some(watch)) => watch,
            Ok(None) => return,
            Err(error) => {
                tracing::debug!(%error, "cannot watch a held client's connection");
                return std::future::pending().await;
            }
        };
        loop {
            match watch.ready(Interest::READABLE).await {
                Ok(ready) if ready.is_read_closed() => return,
                // Bytes that are hyper's to read: forget this edge and wait for the next.
                Ok(_) => {
                    let _ = watch.try_io(Interest::READABLE, || {
                        Err::<(), _>(io::ErrorKind::WouldBlock.into())
                    });
                }
                Err(_) => return std::future::pending().await,
            }
        }
    }

    /// The connection closes before a request body ended: its socket lingers
    /// ([`linger`](super::linger)) rather than close at once.
    pub(crate) fn linger_on_close(&self) {
        self.linger.store(true, Ordering::Relaxed);
    }

    /// Once the connection's stream is gone: lingers on the socket if the connection
    /// closed before a request body ended. Run by the connection's task, so that the
    /// socket keeps its connection's place meanwhile.
    pub(crate) async fn linger(&self) {
        if !self.linger.load(Ordering::Relaxed) {
            return;
        }
        let lingering = self
            .lingering
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(socket) = lingering {
            // Boxed: every connection's future would otherwise have room for its buffer.
            Box::pin(super::linger::drain(socket)).await;
        }
    }

    /// A registered duplicate of the socket; `None` once the connection's stream is gone.
    fn duplicate(&self) -> io::Result<Option<TcpStream>> {
        let fd = self.fd.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(fd) = *fd else {
            return Ok(None);
        };
        // SAFETY: `fd` is open: `Watched` clears it, under this lock, before the stream that
        // owns it is dropped, and the lock is held until the duplicate exists.
        let duplicate = unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned()?;
        TcpStream::from_std(std::net::TcpStream::from(duplicate)).map(Some)
    }
}

/// A connection's stream, shared with its [`ClientSocket`].
pub(crate) struct Watched {
    stream: TcpStream,
    socket: Arc<ClientSocket>,
}

impl Watched {
    pub(crate) fn new(stream: TcpStream) -> (Watched, Arc<ClientSocket>) {
        let socket = Arc::new(ClientSocket {
            fd: Mutex::new(Some(stream.as_raw_fd())),
            linger: AtomicBool::new(false),
            lingering: Mutex::new(None),
        });
        (
            Watched {
                stream,
                socket: socket.clone(),
            },
            socket,
        )
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        // Before `stream` closes the descriptor, whose number may then be reused.
        *self.socket.fd.lock().unwrap_or_else(PoisonError::into_inner) = None;
        if self.socket.linger.load(Ordering::Relaxed) {
            // A duplicate, so that dropping `stream` closes no socket.
            *self
                .socket
                .lingering
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = self.stream.as_fd().try_clone_to_owned().ok();
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Watched {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    async fn pair() -> (TcpStream, Watched, Arc<ClientSocket>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let (watched, socket) = Watched::new(server);
        (client, watched, socket)
    }

    #[tokio::test]
    async fn unread_bytes_are_not_a_close_and_stay_readable() {
        let (mut client, mut watched, socket) = pair().await;
        client.write_all(b"body bytes").await.unwrap();
        let watching = tokio::time::timeout(Duration::from_millis(100), socket.closed()).await;
        assert!(watching.is_err(), "the client is still there");
        let mut buf = [0u8; 10];
        watched.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"body bytes");
    }

    #[tokio::test]
    async fn a_close_behind_unread_bytes_is_seen() {
        let (mut client, _watched, socket) = pair().await;
        let watching = tokio::spawn(async move { socket.closed().await });
        client.write_all(&[b'x'; 100_000]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!watching.is_finished());
        drop(client);
        tokio::time::timeout(Duration::from_secs(5), watching)
            .await
            .expect("the close is seen")
            .unwrap();
    }

    #[tokio::test]
    async fn a_dropped_stream_counts_as_gone() {
        let (_client, watched, socket) = pair().await;
        drop(watched);
        tokio::time::timeout(Duration::from_secs(1), socket.closed())
            .await
            .expect("gone");
    }
}
