//! A request body read whole before it goes upstream, for an upstream that must be told
//! its length first and whose workers a slow client must not hold (PHP-FPM): kept in
//! memory up to 64 KB, in an anonymous temporary file beyond, so that memory does not
//! grow with it. It is read before the upstream is contacted, so a slow client holds no
//! PHP worker meanwhile.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::io::{AsyncSeekExt, AsyncWriteExt};

use super::request_body::{RequestBody, RequestBodyError};
use crate::files::serve::FileBody;

/// The most a body is kept in memory.
const IN_MEMORY: usize = 64 * 1024;

/// A body read whole, and its length.
pub(crate) struct Spooled {
    length: u64,
    content: Content,
}

enum Content {
    /// `None` once sent.
    Memory(Option<Bytes>),
    File(FileBody),
}

impl Spooled {
    pub(crate) fn len(&self) -> u64 {
        self.length
    }
}

/// Reads `body` to its end (its `server.max_body` and `server.body_timeout` apply).
pub(crate) async fn spool(mut body: RequestBody) -> Result<Spooled, RequestBodyError> {
    let mut memory = BytesMut::new();
    let mut file: Option<tokio::fs::File> = None;
    let mut length = 0u64;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        length += data.len() as u64;
        if file.is_none() && memory.len() + data.len() <= IN_MEMORY {
            memory.extend_from_slice(&data);
            continue;
        }
        let file = match &mut file {
            Some(file) => file,
            None => {
                let created = tokio::task::spawn_blocking(tempfile::tempfile)
                    .await
                    .map_err(io::Error::other)??;
                let mut created = tokio::fs::File::from_std(created);
                created.write_all(&memory).await?;
                file.insert(created)
            }
        };
        file.write_all(&data).await?;
    }
    let content = match file {
        None => Content::Memory(Some(memory.freeze())),
        Some(mut file) => {
            file.flush().await?;
            file.rewind().await?;
            Content::File(FileBody::new(file, length))
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
            Content::Memory(bytes) => {
                Poll::Ready(bytes.take().filter(|b| !b.is_empty()).map(|b| Ok(Frame::data(b))))
            }
            Content::File(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.content {
            Content::Memory(bytes) => bytes.as_ref().is_none_or(Bytes::is_empty),
            Content::File(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.length)
    }
}
