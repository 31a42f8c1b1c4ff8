//! Answering a request with a file: `GET` and `HEAD`, the type by extension, validators
//! (`Last-Modified`, a strong `ETag` of modification time and size) and the `304` they
//! allow, the body streamed from disk so that memory does not grow with the file.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::Stream;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use tokio_util::io::ReaderStream;

/// A file's content on its way to the client; empty for a `HEAD` or a `304`.
pub(crate) struct FileBody {
    stream: Option<ReaderStream<tokio::fs::File>>,
    remaining: u64,
}

impl FileBody {
    /// The `length` bytes of `file`, from where it stands, streamed.
    pub(crate) fn new(file: tokio::fs::File, length: u64) -> Self {
        FileBody {
            stream: Some(ReaderStream::with_capacity(file, 64 * 1024)),
            remaining: length,
        }
    }
}

impl Body for FileBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let Some(stream) = self.stream.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(stream).poll_next(cx) {
            Poll::Ready(Some(Ok(data))) => {
                self.remaining = self.remaining.saturating_sub(data.len() as u64);
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            Poll::Ready(Some(Err(error))) => Poll::Ready(Some(Err(error))),
            Poll::Ready(None) => {
                self.stream = None;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.stream.is_none() || self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

/// The answer to `method` for `file`, given the request's `headers`: `Err` with the
/// status for a method other than `GET` and `HEAD` (`405`) or a file that cannot be read.
pub(crate) async fn serve(
    file: &Path,
    method: &Method,
    headers: &HeaderMap,
) -> Result<Response<FileBody>, StatusCode> {
    if method != Method::GET && method != Method::HEAD {
        return Err(StatusCode::METHOD_NOT_ALLOWED);
    }
    let opened = tokio::fs::File::open(file)
        .await
        .map_err(|_| StatusCode::NOT_FOUND)?;
    let metadata = opened.metadata().await.map_err(|_| StatusCode::NOT_FOUND)?;
    if !metadata.is_file() {
        return Err(StatusCode::NOT_FOUND);
    }
    let modified = metadata.modified().unwrap_or(UNIX_EPOCH);
    let since_epoch = modified.duration_since(UNIX_EPOCH).unwrap_or_default();
    let etag = format!("\"{:x}-{:x}\"", since_epoch.as_secs(), metadata.len());
    let mut response = Response::new(FileBody {
        stream: None,
        remaining: 0,
    });
    let out = response.headers_mut();
    out.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type(file)));
    if let Ok(etag) = HeaderValue::try_from(etag.as_str()) {
        out.insert(header::ETAG, etag);
    }
    if let Ok(date) = HeaderValue::try_from(httpdate::fmt_http_date(modified)) {
        out.insert(header::LAST_MODIFIED, date);
    }
    if not_modified(headers, &etag, modified) {
        *response.status_mut() = StatusCode::NOT_MODIFIED;
        return Ok(response);
    }
    response
        .headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(metadata.len()));
    if method == Method::GET {
        *response.body_mut() = FileBody::new(opened, metadata.len());
    }
    Ok(response)
}

/// Whether the client's copy is current: `If-None-Match` names the ETag (or `*`), or,
/// without it, `If-Modified-Since` is no earlier than the modification time.
fn not_modified(headers: &HeaderMap, etag: &str, modified: SystemTime) -> bool {
    if let Some(wanted) = headers.get(header::IF_NONE_MATCH) {
        let Ok(wanted) = wanted.to_str() else {
            return false;
        };
        return wanted.split(',').map(str::trim).any(|tag| {
            // The weak comparison RFC 9110 §13.1.2 asks for here.
            tag == "*" || tag.strip_prefix("W/").unwrap_or(tag) == etag
        });
    }
    let Some(since) = headers
        .get(header::IF_MODIFIED_SINCE)
        .and_then(|value| value.to_str().ok())
        .and_then(|text| httpdate::parse_http_date(text).ok())
    else {
        return false;
    };
    let whole_seconds = |time: SystemTime| time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    whole_seconds(modified) <= whole_seconds(since)
}

/// The `Content-Type` of a file, by its extension.
fn content_type(file: &Path) -> &'static str {
    let extension = file
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .unwrap_or_default();
    match extension.as_str() {
        "html" | "htm" => "text/html; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "json" | "map" => "application/json",
        "txt" => "text/plain; charset=utf-8",
        "xml" => "application/xml",
        "csv" => "text/csv; charset=utf-8",
        "md" => "text/markdown; charset=utf-8",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "webp" => "image/webp",
        "avif" => "image/avif",
        "ico" => "image/x-icon",
        "woff" => "font/woff",
        "woff2" => "font/woff2",
        "ttf" => "font/ttf",
        "otf" => "font/otf",
        "pdf" => "application/pdf",
        "wasm" => "application/wasm",
        "zip" => "application/zip",
        "gz" => "application/gzip",
        "mp4" => "video/mp4",
        "webm" => "video/webm",
        "mp3" => "audio/mpeg",
        "ogg" => "audio/ogg",
        "wav" => "audio/wav",
        _ => "application/octet-stream",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body(response: Response<FileBody>) -> Vec<u8> {
        use http_body_util::BodyExt;
        response.into_body().collect().await.unwrap().to_bytes().to_vec()
    }

    #[tokio::test]
    async fn a_file_its_validators_and_the_304_they_allow() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("style.css");
        std::fs::write(&file, "body{}").unwrap();
        let response = serve(&file, &Method::GET, &HeaderMap::new()).await.unwrap();
        assert_eq!(response.headers()["content-type"], "text/css; charset=utf-8");
        assert_eq!(response.headers()["content-length"], "6");
        let etag = response.headers()["etag"].clone();
        let modified = response.headers()["last-modified"].clone();
        assert_eq!(body(response).await, b"body{}");

        let mut conditional = HeaderMap::new();
        conditional.insert(header::IF_NONE_MATCH, etag.clone());
        let response = serve(&file, &Method::GET, &conditional).await.unwrap();
        assert_eq!(response.status(), StatusCode::NOT_MODIFIED);
        assert!(body(response).await.is_empty());

        let mut by_date = HeaderMap::new();
        by_date.insert(header::IF_MODIFIED_SINCE, modified);
        assert_eq!(
            serve(&file, &Method::GET, &by_date).await.unwrap().status(),
            StatusCode::NOT_MODIFIED
        );
        let mut other = HeaderMap::new();
        other.insert(header::IF_NONE_MATCH, HeaderValue::from_static("\"other\""));
        assert_eq!(
            serve(&file, &Method::GET, &other).await.unwrap().status(),
            StatusCode::OK
        );

        let head = serve(&file, &Method::HEAD, &HeaderMap::new()).await.unwrap();
        assert_eq!(head.headers()["content-length"], "6");
        assert!(body(head).await.is_empty());
        assert_eq!(
            serve(&file, &Method::POST, &HeaderMap::new()).await.err(),
            Some(StatusCode::METHOD_NOT_ALLOWED)
        );
    }
}
