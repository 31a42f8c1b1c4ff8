//! A request body read whole before it goes upstream, for an upstream that must be told
//! its length first and whose workers a slow client must not hold (PHP-FPM): kept in
//! memory up to 64 KB, in an anonymous temporary file beyond, so that memory does not
//! grow with it. It is read before the upstream is contacted, so a slow client holds no
//! PHP worker meanwhile. What the bodies being read whole hold at once, process-wide, is
//! bounded by a [`SpoolRoom`]: clients uploading many bodies at once (HTTP/2 streams)
//! take neither every descriptor nor unbounded memory.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::io::{AsyncSeekExt, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::request_body::RequestBodyError;
use crate::files::serve::FileBody;

/// The most a body is kept in memory.
const IN_MEMORY: usize = 64 * 1024;

/// The most memory all bodies being read whole keep at once (a thousand full ones); past
/// it, bodies go to temporary files from their first byte.
const ALL_IN_MEMORY: usize = 1024 * IN_MEMORY;

/// What the bodies read whole may hold at once: their temporary files and their memory.
pub(crate) struct SpoolRoom {
    files: Arc<Semaphore>,
    memory: Arc<Semaphore>,
}

impl SpoolRoom {
    /// Room for a temporary file per four client connections of `connections` (each file
    /// is a descriptor, as each connection is), and [`ALL_IN_MEMORY`] bytes.
    pub(crate) fn for_connections(connections: usize) -> SpoolRoom {
        SpoolRoom::new((connections / 4).max(1), ALL_IN_MEMORY)
    }

    fn new(files: usize, memory: usize) -> SpoolRoom {
        SpoolRoom {
            files: Arc::new(Semaphore::new(files.min(Semaphore::MAX_PERMITS))),
            memory: Arc::new(Semaphore::new(memory)),
        }
    }

    /// `bytes` more of memory, if the room has them.
    fn memory(&self, bytes: usize) -> Option<OwnedSemaphorePermit> {
        let bytes = u32::try_from(bytes).ok()?;
        self.memory.clone().try_acquire_many_owned(bytes).ok()
    }

    /// A temporary file's place, waited for up to `wait`.
    async fn file(&self, wait: Duration) -> Result<OwnedSemaphorePermit, RequestBodyError> {
        let place = tokio::time::timeout(wait, self.files.clone().acquire_owned());
        match place.await {
            Ok(place) => Ok(place.expect("the room is never closed")),
            Err(_) => Err(RequestBodyError::NoRoom),
        }
    }
}

/// A body read whole, and its length.
pub(crate) struct Spooled {
    length: u64,
    content: Content,
}

enum Content {
    /// `None` once sent; the memory's place in the room goes with it.
    Memory(Option<(Bytes, Option<OwnedSemaphorePermit>)>),
    /// The file's place in the room goes when the body is dropped (the file closes).
    File {
        body: FileBody,
        _place: OwnedSemaphorePermit,
    },
}

impl Spooled {
    pub(crate) fn len(&self) -> u64 {
        self.length
    }
}

/// Reads `body` to its end (its `server.max_body` and `server.body_timeout` apply) in the
/// room `room` has, waiting up to `wait` for a temporary file's place.
pub(crate) async fn spool<B>(
    mut body: B,
    room: &SpoolRoom,
    wait: Duration,
) -> Result<Spooled, RequestBodyError>
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
                let place = room.file(wait).await?;
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
            Content::File {
                body: FileBody::new(file, length),
                _place: place,
            }
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
            Content::File { body, .. } => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.content {
            Content::Memory(bytes) => bytes.as_ref().is_none_or(|(bytes, _)| bytes.is_empty()),
            Content::File { body, .. } => body.is_end_stream(),
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

    #[tokio::test]
    async fn a_small_body_stays_in_memory_and_gives_its_room_back_once_sent() {
        let room = SpoolRoom::new(1, 100);
        let spooled = spool(body(&[b"hello", b" world"]), &room, WAIT).await.unwrap();
        assert_eq!(spooled.len(), 11);
        assert!(matches!(spooled.content, Content::Memory(_)));
        assert_eq!(
            (room.memory.available_permits(), room.files.available_permits()),
            (89, 1)
        );
        assert_eq!(read(spooled).await, b"hello world");
        assert_eq!(room.memory.available_permits(), 100);
    }

    #[tokio::test]
    async fn a_large_body_goes_to_a_file_whose_place_is_held_until_it_is_dropped() {
        let room = SpoolRoom::new(1, ALL_IN_MEMORY);
        let part = vec![7u8; IN_MEMORY / 2 + 1];
        let spooled = spool(body(&[&part, &part, b"end"]), &room, WAIT).await.unwrap();
        assert!(matches!(spooled.content, Content::File { .. }));
        assert_eq!(room.files.available_permits(), 0);
        assert_eq!(
            room.memory.available_permits(),
            ALL_IN_MEMORY,
            "the memory went to the file"
        );
        let expected = [part.as_slice(), &part, b"end"].concat();
        assert_eq!(read(spooled).await, expected);
        assert_eq!(room.files.available_permits(), 1);
    }

    #[tokio::test]
    async fn a_body_memory_has_no_room_for_goes_to_a_file() {
        let room = SpoolRoom::new(1, 10);
        let taken = room.memory(8).unwrap();
        let spooled = spool(body(&[b"abc", b"def"]), &room, WAIT).await.unwrap();
        assert!(matches!(spooled.content, Content::File { .. }));
        assert_eq!(read(spooled).await, b"abcdef");
        drop(taken);
        assert_eq!(room.memory.available_permits(), 10);
    }

    #[tokio::test]
    async fn with_no_file_place_free_a_large_body_waits_then_finds_no_room() {
        let room = SpoolRoom::new(1, ALL_IN_MEMORY);
        let held = room.file(WAIT).await.unwrap();
        let started = tokio::time::Instant::now();
        let large = vec![1u8; IN_MEMORY + 1];
        let refused = spool(body(&[&large]), &room, WAIT).await;
        assert!(matches!(refused, Err(RequestBodyError::NoRoom)));
        assert!(started.elapsed() >= WAIT);
        assert_eq!(room.memory.available_permits(), ALL_IN_MEMORY);
        drop(held);
        assert!(spool(body(&[&large]), &room, WAIT).await.is_ok());
    }

    #[test]
    fn a_file_place_for_every_four_connections() {
        assert_eq!(SpoolRoom::for_connections(8).files.available_permits(), 2);
        assert_eq!(SpoolRoom::for_connections(1).files.available_permits(), 1);
        assert_eq!(
            SpoolRoom::for_connections(Semaphore::MAX_PERMITS)
                .files
                .available_permits(),
            Semaphore::MAX_PERMITS / 4
        );
    }
}
