//! `server.send_timeout` (nginx's `send_timeout`): a write to the client that makes no
//! progress for that long fails with `TimedOut`, and hyper closes the connection, which
//! ends what its requests hold (their slots, their upstream responses). A client that
//! stops reading would otherwise keep them for as long as it likes.
//!
//! It bounds every write on a client connection: HTTP/1.1 responses, an HTTP/2
//! connection whose client stops reading the socket, and a tunnel's bytes towards the
//! client. An HTTP/2 stream that its client stalls through flow control alone (never
//! granting it window while still reading the socket) blocks no write: the connection's
//! stall check bounds it instead (`ResponseProgress`, in this module's parent).
//!
//! The deadline is armed when a write returns `Pending` with none armed, and disarmed by
//! the next write that completes: writes that never block cost a branch.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// A client stream whose writes fail after `limit` without progress.
pub(crate) struct SendTimeout<S> {
    inner: S,
    limit: Duration,
    /// Made the first time a write blocks, and reset for the next times.
    deadline: Option<Pin<Box<Sleep>>>,
    armed: bool,
}

impl<S> SendTimeout<S> {
    pub(crate) fn new(inner: S, limit: Duration) -> Self {
        SendTimeout {
            inner,
            limit,
            deadline: None,
            armed: false,
        }
    }

    /// Passes on what a write returned, keeping the deadline.
    fn bounded<T>(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.armed = false;
            return polled;
        }
        if !self.armed {
            self.armed = true;
            let at = Instant::now() + self.limit;
            match &mut self.deadline {
                Some(deadline) => deadline.as_mut().reset(at),
                None => self.deadline = Some(Box::pin(tokio::time::sleep_until(at))),
            }
        }
        let deadline = self.deadline.as_mut().expect("armed above");
        // Polled with the write's waker: the task wakes at the deadline to fail the write.
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client read nothing for server.send_timeout",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for SendTimeout<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for SendTimeout<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.bounded(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.bounded(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.bounded(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.bounded(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn a_write_without_progress_fails_after_the_limit_and_progress_resets_it() {
        let limit = Duration::from_millis(300);
        let (mut client, server) = tokio::io::duplex(8);
        let mut server = SendTimeout::new(server, limit);
        // The pipe holds 8 bytes: the write blocks until the client reads, within the limit.
        let reader = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let mut buf = [0u8; 16];
            let n = client.read(&mut buf).await.unwrap();
            (client, n)
        });
        server.write_all(&[0u8; 16]).await.unwrap();
        let (client, read) = reader.await.unwrap();
        assert!(read > 0);
        // The pipe is full again and the client reads no more: the next write fails once
        // the limit has passed since it blocked.
        let stalled = Instant::now();
        let error = server.write_all(&[0u8; 64]).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        let waited = stalled.elapsed();
        assert!(waited >= limit && waited < limit * 2, "{waited:?}");
        drop(client);
    }
}
