//! The request side of an exchange with a server, whatever the protocol: the bytes queued
//! for it (the head, then the body's as it comes, in the protocol's framing), the body
//! still to be read from the client, and whether any of it was read (a request whose body
//! was not touched can go out again on another connection).

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http_body::Body;
use tokio::io::AsyncWrite;

use crate::proxy::request_body::{RequestBody, RequestBodyError};

/// How a protocol puts a request body on the wire.
pub(super) trait BodyFraming {
    type Error: From<io::Error> + From<RequestBodyError>;

    /// Queues `data`, the next piece of the body, into `out`.
    fn data(&mut self, data: &[u8], out: &mut BytesMut) -> Result<(), Self::Error>;

    /// The bytes that end the body (none for a body framed by its length).
    fn end(&mut self) -> Result<&'static [u8], Self::Error>;
}

/// A request on its way to a server.
pub(super) struct Sending<F> {
    /// Bytes to write before `write`'s, each from where it is (a head shared by a
    /// request's tries, its end): written with them in one call, never copied.
    first: [Bytes; 2],
    /// Bytes to write.
    write: BytesMut,
    /// The request body still to be read; `None` once its end is queued.
    body: Option<RequestBody>,
    framing: F,
    /// Whether any of the request body was read.
    body_read: bool,
    /// Whether any byte went to the server: then it may have acted on the request.
    written: bool,
    /// Whether what was written may still sit in a TLS stream's buffer.
    unflushed: bool,
    /// Whether the last write stopped for the body's next frame: the client's to send.
    awaiting_body: bool,
    /// Whether bytes were written since [`Sending::take_progress`] last asked.
    progressed: bool,
}

impl<F: BodyFraming> Sending<F> {
    /// `first` to write, then `body` in `framing`.
    pub(super) fn new(first: [Bytes; 2], body: RequestBody, framing: F) -> Self {
        Sending {
            first,
            write: BytesMut::new(),
            body: Some(body),
            framing,
            body_read: false,
            written: false,
            unflushed: false,
            awaiting_body: false,
            progressed: false,
        }
    }

    /// Whether the whole request has been written.
    pub(super) fn is_done(&self) -> bool {
        self.queued() == 0 && self.body.is_none() && !self.unflushed
    }

    /// How many bytes wait to be written.
    fn queued(&self) -> usize {
        self.first[0].len() + self.first[1].len() + self.write.len()
    }

    /// Queues the body's end after what is queued: as a piece of its own when the last
    /// piece before `write` is free and `write` is empty (a request without a body: its
    /// end goes with its head, and nothing is copied or allocated), else into `write`.
    fn queue_end(&mut self) -> Result<(), F::Error> {
        let end = self.framing.end()?;
        if end.is_empty() {
            // A body framed by its length.
        } else if self.write.is_empty() && self.first[1].is_empty() {
            self.first[1] = Bytes::from_static(end);
        } else {
            self.write.extend_from_slice(end);
        }
        Ok(())
    }

    /// Drops the first `n` bytes of those queued: written.
    fn consume(&mut self, mut n: usize) {
        for first in &mut self.first {
            let taken = n.min(first.len());
            first.advance(taken);
            n -= taken;
        }
        // Advanced, not split off: splitting a buffer makes its storage shared, an
        // allocation for bytes that are then dropped.
        self.write.advance(n);
    }

    /// Whether the request waits for the client: everything so far written, the body's
    /// next frame not yet come.
    pub(super) fn awaits_client(&self) -> bool {
        self.awaiting_body
    }

    /// Whether bytes went to the server since the last time this was asked.
    pub(super) fn take_progress(&mut self) -> bool {
        std::mem::take(&mut self.progressed)
    }

    /// Whether the request has a body of which something was read.
    pub(super) fn had_body(&self) -> bool {
        self.body_read
    }

    /// Whether nothing of the request reached the server and none of its body was read:
    /// then it can go out again, whatever its method.
    pub(super) fn untouched(&self) -> bool {
        !self.written && !self.body_read
    }

    /// The request body (for another try), when the request is [`untouched`](Self::untouched).
    pub(super) fn into_body(self) -> Option<RequestBody> {
        if !self.untouched() {
            return None;
        }
        // A body that ended without data is as good as none.
        Some(self.body.unwrap_or_else(RequestBody::empty))
    }

    /// Writes what is queued to `stream`, and queues the body's frames as they come, until
    /// either would wait.
    pub(super) fn poll_write<S: AsyncWrite + Unpin>(
        &mut self,
        stream: &mut S,
        cx: &mut Context<'_>,
    ) -> Result<(), F::Error> {
        self.awaiting_body = false;
        loop {
            // A body already ended (a request without one) ends in the same write as the
            // head before it.
            if self.body.as_ref().is_some_and(|body| body.is_end_stream()) {
                self.body = None;
                self.queue_end()?;
            }
            if self.queued() > 0 {
                // Only the pieces that hold bytes: one goes as a plain write (a TLS stream
                // gathers several into a list it allocates).
                let mut queued = [IoSlice::new(&[]); 3];
                let mut pieces = 0;
                for piece in [&self.first[0][..], &self.first[1][..], &self.write[..]] {
                    if !piece.is_empty() {
                        queued[pieces] = IoSlice::new(piece);
                        pieces += 1;
                    }
                }
                let stream = Pin::new(&mut *stream);
                let polled = match pieces {
                    1 => stream.poll_write(cx, &queued[0]),
                    _ => stream.poll_write_vectored(cx, &queued[..pieces]),
                };
                match polled? {
                    Poll::Ready(0) => return Err(io::Error::from(io::ErrorKind::WriteZero).into()),
                    Poll::Ready(n) => {
                        self.consume(n);
                        self.written = true;
                        self.progressed = true;
                        self.unflushed = true;
                        continue;
                    }
                    Poll::Pending => return Ok(()),
                }
            }
            // A TLS stream may hold the last record back until flushed.
            if self.unflushed {
                match Pin::new(&mut *stream).poll_flush(cx)? {
                    Poll::Ready(()) => self.unflushed = false,
                    Poll::Pending => return Ok(()),
                }
            }
            let Some(body) = self.body.as_mut() else {
                return Ok(());
            };
            match Pin::new(body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data()
                        && !data.is_empty()
                    {
                        self.body_read = true;
                        self.framing.data(&data, &mut self.write)?;
                    }
                }
                Poll::Ready(None) => {
                    self.body = None;
                    self.queue_end()?;
                }
                Poll::Ready(Some(Err(error))) => return Err(error.into()),
                Poll::Pending => {
                    self.awaiting_body = true;
                    return Ok(());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::poll_fn;

    use super::*;

    /// A stream that takes at most `most` bytes a write, across the buffers it is given
    /// (and at most 1 KB in all).
    struct Trickle {
        out: Vec<u8>,
        most: usize,
    }

    impl AsyncWrite for Trickle {
        fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            self.poll_write_vectored(cx, &[IoSlice::new(buf)])
        }

        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            // A request written again and again fails here instead of looping.
            assert!(self.out.len() < 1024, "written past what was queued");
            let mut taken = 0;
            for buf in bufs {
                let take = buf.len().min(self.most - taken);
                self.out.extend_from_slice(&buf[..take]);
                taken += take;
            }
            Poll::Ready(Ok(taken))
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// Ends a body with its bytes.
    struct Marked(&'static [u8]);

    #[derive(Debug)]
    struct Failed;

    impl From<io::Error> for Failed {
        fn from(_: io::Error) -> Self {
            Failed
        }
    }

    impl From<RequestBodyError> for Failed {
        fn from(_: RequestBodyError) -> Self {
            Failed
        }
    }

    impl BodyFraming for Marked {
        type Error = Failed;

        fn data(&mut self, data: &[u8], out: &mut BytesMut) -> Result<(), Failed> {
            out.extend_from_slice(data);
            Ok(())
        }

        fn end(&mut self) -> Result<&'static [u8], Failed> {
            Ok(self.0)
        }
    }

    /// What goes out for `first` and a request without a body whose framing ends with
    /// `end`.
    async fn sent(first: [&'static [u8]; 2], end: &'static [u8], most: usize) -> Vec<u8> {
        let mut sending = Sending::new(first.map(Bytes::from_static), RequestBody::empty(), Marked(end));
        let mut stream = Trickle {
            out: Vec::new(),
            most,
        };
        poll_fn(|cx| Poll::Ready(sending.poll_write(&mut stream, cx)))
            .await
            .unwrap();
        assert!(sending.is_done());
        assert!(!sending.untouched());
        stream.out
    }

    #[tokio::test]
    async fn what_goes_first_and_the_bodys_end_are_written_in_order_whatever_each_write_takes() {
        for most in [1, 2, 3, 5, 64] {
            assert_eq!(
                sent([b"head\r\n", b"\r\n"], b"", most).await,
                b"head\r\n\r\n",
                "{most}"
            );
            assert_eq!(
                sent([b"records", b""], b"END", most).await,
                b"recordsEND",
                "{most}"
            );
            assert_eq!(
                sent([b"head\r\n", b"\r\n"], b"END", most).await,
                b"head\r\n\r\nEND",
                "{most}"
            );
        }
    }
}
