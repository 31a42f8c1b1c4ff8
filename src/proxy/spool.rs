//! A request body read whole before it goes upstream, for an upstream that must be told
//! its length first and whose workers a slow client must not hold (PHP-FPM): kept in
//! memory up to 64 KB, in an anonymous temporary file beyond, so that memory does not
//! grow with it. It is read before the upstream is contacted, so a slow client holds no
//! PHP worker meanwhile. The memory and the temporary file are taken from the process's
//! [`Room`].

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::io::{AsyncSeekExt, AsyncWriteExt};
use tokio::sync::OwnedSemaphorePermit;

use super::request_body::RequestBodyError;
use crate::files::serve::FileBody;
use crate::room::Room;

/// The most a body is kept in memory.
const IN_MEMORY: usize = 64 * 1024;

/// A body read whole, and its length.
pub(crate) struct Spooled {
    length: u64,
    content: Content,
}

enum Content {
    /// `None` once sent; the memory's place in the room goes with it.
    Memory(Option<(Bytes, Option<OwnedSemaphorePermit>)>),
    /// Holding the file's place in the room until it closes.
    File(FileBody),
}

impl Spooled {
    pub(crate) fn len(&self) -> u64 {
        self.length
    }
}

/// Reads `body` to its end (its `server.max_body` and `server.body_timeout` apply) in
/// `room`, waiting up to `wait` for a temporary file's place.
pub(crate) async fn spool<B>(mut body: B, room: &Room, wait: Duration) -> Result<Spooled, RequestBodyError>
where
    B: Body<Data = Bytes, Error = RequestBodyError> + Unpin,
{
    let mut memory = BytesMut::new();
    let mut held: Option<OwnedSemaphorePermit> = None;
    let mut file: Option<(tokio::fs::File, OwnedSemaphorePermit)> = None;
    let mut length = 0u64;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        length += data.len() as u64;
        if file.is_none()
            && memory.len() + data.len() <= IN_MEMORY
            && let Some(more) = room.memory(data.len())
        {
            match &mut held {
                Some(held) => held.merge(more),
                None => held = Some(more),
            }
            memory.extend_from_slice(&data);
            continue;
        }
        let (file, _) = match &mut file {
            Some(file) => file,
            None => {
                let place = room.body_place(wait).await.ok_or(RequestBodyError::NoRoom)?;
                let created = tokio::task::spawn_blocking(tempfile::tempfile)
                    .await
                    .map_err(io::Error::other)??;
                let mut created = tokio::fs::File::from_std(created);
                created.write_all(&memory).await?;
                memory = BytesMut::new();
                held = None;
                file.insert((created, place))
            }
        };
        file.write_all(&data).await?;
    }
    let content = match file {
        None => Content::Memory(Some((memory.freeze(), held))),
        Some((mut file, place)) => {
            file.flush().await?;
            file.rewind().await?;
            Content::File(FileBody::new(file, length).holding(place))
        }
    };
    Ok(Spooled { length, content })
}

impl Body for Spooled {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match &mut self.content {
            Content::Memory(bytes) => Poll::Ready(
                bytes
                    .take()
                    .map(|(bytes, _)| bytes)
                    .filter(|b| !b.is_empty())
                    .map(|b| Ok(Frame::data(b))),
            ),
            Content::File(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.content {
            Content::Memory(bytes) => bytes.as_ref().is_none_or(|(bytes, _)| bytes.is_empty()),
            Content::File(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.length)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::StreamBody;

    fn body(chunks: &[&[u8]]) -> impl Body<Data = Bytes, Error = RequestBodyError> + Unpin {
        let frames: Vec<Result<Frame<Bytes>, RequestBodyError>> = chunks
            .iter()
            .map(|chunk| Ok(Frame::data(Bytes::copy_from_slice(chunk))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames))
    }

    async fn read(spooled: Spooled) -> Vec<u8> {
        spooled.collect().await.unwrap().to_bytes().to_vec()
    }

    const WAIT: Duration = Duration::from_millis(20);
    /// More memory than the tests' bodies need.
    const ALL: usize = 1 << 20;

    #[tokio::test]
    async fn a_small_body_stays_in_memory_and_gives_its_room_back_once_sent() {
        let room = Room::new(1, 1, 100);
        let spooled = spool(body(&[b"hello", b" world"]), &room, WAIT).await.unwrap();
        assert_eq!(spooled.len(), 11);
        assert!(matches!(spooled.content, Content::Memory(_)));
        assert_eq!(room.free(), (1, 1, 89));
        assert_eq!(read(spooled).await, b"hello world");
        assert_eq!(room.free(), (1, 1, 100));
    }

    #[tokio::test]
    async fn a_large_body_goes_to_a_file_whose_place_is_held_until_it_is_dropped() {
        let room = Room::new(1, 1, ALL);
        let part = vec![7u8; IN_MEMORY / 2 + 1];
        let spooled = spool(body(&[&part, &part, b"end"]), &room, WAIT).await.unwrap();
        assert!(matches!(spooled.content, Content::File(_)));
        assert_eq!(room.free(), (0, 1, ALL), "the memory went to the file");
        let expected = [part.as_slice(), &part, b"end"].concat();
        assert_eq!(read(spooled).await, expected);
        assert_eq!(room.free(), (1, 1, ALL));
    }

    #[tokio::test]
    async fn a_body_memory_has_no_room_for_goes_to_a_file() {
        let room = Room::new(1, 1, 10);
        let taken = room.memory(8).unwrap();
        let spooled = spool(body(&[b"abc", b"def"]), &room, WAIT).await.unwrap();
        assert!(matches!(spooled.content, Content::File(_)));
        assert_eq!(read(spooled).await, b"abcdef");
        drop(taken);
        assert_eq!(room.free(), (1, 1, 10));
    }

    #[tokio::test]
    async fn with_no_file_place_free_a_large_body_waits_then_finds_no_room() {
        let room = Room::new(1, 1, ALL);
        let held = room.body_place(Duration::ZERO).await.unwrap();
        let started = tokio::time::Instant::now();
        let large = vec![1u8; IN_MEMORY + 1];
        let refused = spool(body(&[&large]), &room, WAIT).await;
        assert!(matches!(refused, Err(RequestBodyError::NoRoom)));
        assert!(started.elapsed() >= WAIT);
        assert_eq!(room.free(), (0, 1, ALL));
        drop(held);
        assert!(spool(body(&[&large]), &room, WAIT).await.is_ok());
    }
}
