//! Answering a request with a file: `GET` and `HEAD`, the type by extension, validators
//! (`Last-Modified`, a strong `ETag` of modification time and size) and the `304` they
//! allow, a single byte range (`206`, `416`), a precompressed sibling (`app.js.br`) for a
//! client that accepts its coding, and the body streamed from disk so that memory does not
//! grow with the file.
//!
//! The file is opened and measured in place, as the file choice looked it up, and a small
//! one is read at once: from the page cache this costs less than a hop to the blocking
//! pool (docs/performance.md#files).

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::Stream;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncReadExt, Take};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::io::ReaderStream;

use super::{Found, Opened, Root};
use crate::civil_time::{CivilTime, two_digits};
use crate::compression::{Accepted, Coding, vary_on_encoding};
use crate::room::Room;

/// Files up to this size are read whole when opened; larger ones stream.
const READ_AT_ONCE: u64 = 64 * 1024;

/// The size of a streamed file's reads.
const STREAM_CHUNK: usize = 256 * 1024;

/// A file's content on its way to the client; empty for a `HEAD`, a `304` or a `416`.
pub(crate) struct FileBody {
    content: Content,
    remaining: u64,
    /// The length of the content the response stands for: a whole file's, also for its
    /// `HEAD` and its `304`, whose bodies are empty (a part is never compressed). It
    /// decides, as a `Content-Length` would, whether a route compresses the response.
    file_length: u64,
    /// The file's place in the process's [`Room`](crate::room::Room), or its bytes'
    /// memory there, given back when the body ends.
    place: Option<OwnedSemaphorePermit>,
}

enum Content {
    /// Read already, or nothing to send.
    Read(Option<Bytes>),
    /// Read as the client takes it.
    Streamed(ReaderStream<Take<tokio::fs::File>>),
}

impl FileBody {
    /// The `length` bytes of `file`, from where it stands, streamed.
    pub(crate) fn new(file: tokio::fs::File, length: u64) -> Self {
        FileBody {
            content: Content::Streamed(ReaderStream::with_capacity(file.take(length), STREAM_CHUNK)),
            remaining: length,
            file_length: length,
            place: None,
        }
    }

    /// This body, holding what it keeps until it ends in `room`: its file's place while
    /// it streams from the file held open, the memory of its bytes when the file was read
    /// at once (and closed); `None` when the room has not that to give.
    pub(crate) fn held_in(mut self, room: &Room) -> Option<Self> {
        self.place = match &self.content {
            Content::Streamed(_) => Some(room.file_place()?),
            Content::Read(Some(bytes)) if !bytes.is_empty() => Some(room.file_memory(bytes.len())?),
            Content::Read(_) => None,
        };
        Some(self)
    }

    /// This body, holding `place` (its file's) until it ends.
    pub(crate) fn holding(mut self, place: OwnedSemaphorePermit) -> Self {
        self.place = Some(place);
        self
    }

    fn empty() -> Self {
        FileBody {
            content: Content::Read(None),
            remaining: 0,
            file_length: 0,
            place: None,
        }
    }

    /// The length of the content the response stands for ([`FileBody::file_length`]).
    pub(crate) fn file_length(&self) -> u64 {
        self.file_length
    }

    /// `length` bytes of `file` from `start`: read now when they are few, else streamed.
    fn part(mut file: File, start: u64, length: u64) -> io::Result<Self> {
        if start > 0 {
            file.seek(SeekFrom::Start(start))?;
        }
        if length > READ_AT_ONCE {
            return Ok(FileBody::new(tokio::fs::File::from_std(file), length));
        }
        // Read into spare capacity: no pass zeroing a buffer the read overwrites anyway.
        let mut bytes = Vec::with_capacity(length as usize);
        file.take(length).read_to_end(&mut bytes)?;
        if bytes.len() as u64 != length {
            // The file shrank since it was measured.
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        Ok(FileBody {
            content: Content::Read(Some(Bytes::from(bytes))),
            remaining: length,
            file_length: length,
            place: None,
        })
    }
}

impl Body for FileBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let polled = match &mut self.content {
            Content::Read(bytes) => Poll::Ready(bytes.take().map(Ok)),
            Content::Streamed(stream) => Pin::new(stream).poll_next(cx),
        };
        match polled {
            Poll::Ready(Some(Ok(data))) => {
                self.remaining = self.remaining.saturating_sub(data.len() as u64);
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            Poll::Ready(Some(Err(error))) => Poll::Ready(Some(Err(error))),
            Poll::Ready(None) => {
                self.content = Content::Read(None);
                self.place = None;
                if self.remaining > 0 {
                    // The file shrank under us: the length sent can no longer be kept.
                    return Poll::Ready(Some(Err(io::Error::from(io::ErrorKind::UnexpectedEof))));
                }
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

/// The answer to `method` for `file`, found at `path` under `root`, given the request's
/// `headers`: `Err` with the status for a method other than `GET` and `HEAD` (`405`) or a
/// file that cannot be read.
pub(crate) fn serve(
    root: &Root,
    path: &str,
    file: Opened,
    method: &Method,
    headers: &HeaderMap,
) -> Result<Response<FileBody>, StatusCode> {
    if method != Method::GET && method != Method::HEAD {
        return Err(StatusCode::METHOD_NOT_ALLOWED);
    }
    // The sibling of the coding the client prefers, of those it accepts, that exists; its
    // name built in one buffer.
    let mut name = String::new();
    let sibling = Accepted::from_headers(headers).ranked().find_map(|coding| {
        name.clear();
        name.extend([path, ".", coding.extension()]);
        match root.find(&name) {
            Found::File(opened) => Some((coding, opened)),
            _ => None,
        }
    });
    let (
        coding,
        Opened {
            file: opened,
            metadata,
        },
    ) = match sibling {
        Some((coding, sibling)) => (Some(coding), sibling),
        None => (None, file),
    };
    let length = metadata.len();
    // A file dated before 1970 counts as of 1970, after 9999 (which HTTP dates cannot
    // write) as of the end of 9999.
    let modified = metadata.modified().unwrap_or(UNIX_EPOCH);
    let modified_secs = modified
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
        .min(LAST_HTTP_DATE);
    let etag = etag(modified_secs, length, coding.map(Coding::extension));
    let last_modified = http_date(modified_secs);
    let last_modified = std::str::from_utf8(&last_modified).expect("ASCII");
    let mut response = Response::new(FileBody {
        file_length: length,
        ..FileBody::empty()
    });
    let out = response.headers_mut();
    out.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(content_type(Path::new(path))),
    );
    if let Ok(etag) = HeaderValue::try_from(etag.as_str()) {
        out.insert(header::ETAG, etag);
    }
    if let Ok(date) = HeaderValue::try_from(last_modified) {
        out.insert(header::LAST_MODIFIED, date);
    }
    if let Some(coding) = coding {
        vary_on_encoding(out);
        out.insert(header::CONTENT_ENCODING, HeaderValue::from_static(coding.token()));
    }
    if not_modified(headers, &etag, modified) {
        *response.status_mut() = StatusCode::NOT_MODIFIED;
        return Ok(response);
    }
    out.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    let range = headers
        .get(header::RANGE)
        .filter(|_| if_range_holds(headers, &etag, last_modified))
        .and_then(|range| range.to_str().ok())
        .and_then(|range| Range::parse(range, length));
    let (start, count) = match range {
        None => (0, length),
        Some(Range::Unsatisfiable) => {
            *response.status_mut() = StatusCode::RANGE_NOT_SATISFIABLE;
            let all = format!("bytes */{length}");
            response.headers_mut().insert(
                header::CONTENT_RANGE,
                HeaderValue::try_from(all).expect("digits are a header value"),
            );
            return Ok(response);
        }
        Some(Range::Bytes { first, last }) => {
            *response.status_mut() = StatusCode::PARTIAL_CONTENT;
            let part = format!("bytes {first}-{last}/{length}");
            response.headers_mut().insert(
                header::CONTENT_RANGE,
                HeaderValue::try_from(part).expect("digits are a header value"),
            );
            (first, last - first + 1)
        }
    };
    if method == Method::GET && count > 0 {
        // Its exact length is the body's: hyper writes `Content-Length` from it (over
        // HTTP/2 only for a body not already at its end, hence the header for none).
        *response.body_mut() = FileBody::part(opened, start, count).map_err(|_| StatusCode::NOT_FOUND)?;
    } else {
        response
            .headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(count));
    }
    Ok(response)
}

/// A request's `Range`, as far as a file server honours it.
#[derive(Debug, PartialEq, Eq)]
enum Range {
    /// Bytes `first` to `last`, both included, within the file.
    Bytes { first: u64, last: u64 },
    /// A range that starts beyond the end: `416`.
    Unsatisfiable,
}

impl Range {
    /// A single `bytes` range of a file of `length` bytes (RFC 9110 §14.1.2); `None` for
    /// anything else (several ranges, another unit, a malformed one), which is answered
    /// with the whole file, as the RFC allows.
    fn parse(value: &str, length: u64) -> Option<Range> {
        let spec = value.trim().strip_prefix("bytes=")?.trim();
        if spec.contains(',') {
            return None;
        }
        let (first, last) = spec.split_once('-')?;
        let number = |text: &str| -> Option<u64> {
            if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            // Too many digits to be a position in any file: beyond its end.
            Some(text.parse().unwrap_or(u64::MAX))
        };
        let (first, last) = match (first.trim(), last.trim()) {
            ("", suffix) => {
                let suffix = number(suffix)?;
                if suffix == 0 || length == 0 {
                    return Some(Range::Unsatisfiable);
                }
                (length.saturating_sub(suffix), length - 1)
            }
            (first, "") => (number(first)?, u64::MAX),
            (first, last) => {
                let (first, last) = (number(first)?, number(last)?);
                if last < first {
                    return None;
                }
                (first, last)
            }
        };
        if first >= length {
            return Some(Range::Unsatisfiable);
        }
        Some(Range::Bytes {
            first,
            last: last.min(length - 1),
        })
    }
}

/// Whether a `Range` applies: no `If-Range`, or one that names the current
/// representation by its strong `ETag` or its exact `Last-Modified`.
/// A file version's ETag, as nginx writes it: its modification time and length in hex,
/// and the coding of a precompressed sibling.
fn etag(modified_secs: u64, length: u64, coding: Option<&str>) -> String {
    let mut etag = String::with_capacity(48);
    etag.push('"');
    push_hex(&mut etag, modified_secs);
    etag.push('-');
    push_hex(&mut etag, length);
    if let Some(coding) = coding {
        etag.push('-');
        etag.push_str(coding);
    }
    etag.push('"');
    etag
}

fn push_hex(out: &mut String, value: u64) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let digits = (u64::BITS - value.leading_zeros()).div_ceil(4).max(1);
    for digit in (0..digits).rev() {
        out.push(char::from(DIGITS[(value >> (digit * 4)) as usize & 0x0f]));
    }
}

/// The last second an HTTP date can name: 9999-12-31 23:59:59.
const LAST_HTTP_DATE: u64 = 253_402_300_799;

/// `secs` since 1970 (at most [`LAST_HTTP_DATE`]) as an HTTP date (RFC 9110 section
/// 5.6.7, `Sun, 06 Nov 1994 08:49:37 GMT`). Written here rather than through `httpdate`'s
/// `Display`: the formatting machinery cost a file's response about 1,000 instructions,
/// and `httpdate` panics on times before 1970.
pub(crate) fn http_date(secs: u64) -> [u8; 29] {
    const DAYS: [&[u8; 3]; 7] = [b"Sun", b"Mon", b"Tue", b"Wed", b"Thu", b"Fri", b"Sat"];
    const MONTHS: [&[u8; 3]; 12] = [
        b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov", b"Dec",
    ];
    let time = CivilTime::of(secs.min(LAST_HTTP_DATE));
    let mut out = *b"Thu, 01 Jan 1970 00:00:00 GMT";
    out[0..3].copy_from_slice(DAYS[time.weekday as usize]);
    out[5..7].copy_from_slice(&two_digits(time.day));
    out[8..11].copy_from_slice(MONTHS[(time.month - 1) as usize]);
    out[12..14].copy_from_slice(&two_digits(time.year / 100));
    out[14..16].copy_from_slice(&two_digits(time.year));
    out[17..19].copy_from_slice(&two_digits(time.hour));
    out[20..22].copy_from_slice(&two_digits(time.minute));
    out[23..25].copy_from_slice(&two_digits(time.second));
    out
}

fn if_range_holds(headers: &HeaderMap, etag: &str, last_modified: &str) -> bool {
    match headers.get(header::IF_RANGE).map(HeaderValue::to_str) {
        None => true,
        Some(Ok(value)) => value.trim() == etag || value.trim() == last_modified,
        Some(Err(_)) => false,
    }
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
    const UNKNOWN: &str = "application/octet-stream";
    let Some(extension) = file.extension().and_then(|e| e.to_str()) else {
        return UNKNOWN;
    };
    // Lower-cased on the stack: the longest extension below (`woff2`) fits.
    let mut lower = [0u8; 5];
    let Some(lower) = lower.get_mut(..extension.len()) else {
        return UNKNOWN;
    };
    lower.copy_from_slice(extension.as_bytes());
    lower.make_ascii_lowercase();
    match &*lower {
        b"html" | b"htm" => "text/html; charset=utf-8",
        b"css" => "text/css; charset=utf-8",
        b"js" | b"mjs" => "text/javascript; charset=utf-8",
        b"json" | b"map" => "application/json",
        b"txt" => "text/plain; charset=utf-8",
        b"xml" => "application/xml",
        b"csv" => "text/csv; charset=utf-8",
        b"md" => "text/markdown; charset=utf-8",
        b"svg" => "image/svg+xml",
        b"png" => "image/png",
        b"jpg" | b"jpeg" => "image/jpeg",
        b"gif" => "image/gif",
        b"webp" => "image/webp",
        b"avif" => "image/avif",
        b"ico" => "image/x-icon",
        b"woff" => "font/woff",
        b"woff2" => "font/woff2",
        b"ttf" => "font/ttf",
        b"otf" => "font/otf",
        b"pdf" => "application/pdf",
        b"wasm" => "application/wasm",
        b"zip" => "application/zip",
        b"gz" => "application/gzip",
        b"mp4" => "video/mp4",
        b"webm" => "video/webm",
        b"mp3" => "audio/mpeg",
        b"ogg" => "audio/ogg",
        b"wav" => "audio/wav",
        _ => UNKNOWN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `serve` for `file`, with its directory as the root.
    fn serve_at(file: &Path, method: &Method, headers: &HeaderMap) -> Result<Response<FileBody>, StatusCode> {
        let root = Root::new(file.parent().unwrap()).unwrap();
        let path = format!("/{}", file.file_name().unwrap().to_str().unwrap());
        let Found::File(opened) = root.find(&path) else {
            panic!("{path}: no file");
        };
        serve(&root, &path, opened, method, headers)
    }

    /// The HTTP dates written here are `httpdate`'s, every third day from 1970 to 9999 at a
    /// varying time of day, and the last second.
    #[test]
    fn http_dates_are_httpdates() {
        let mut secs = 0;
        while secs <= LAST_HTTP_DATE {
            let expected = httpdate::fmt_http_date(UNIX_EPOCH + std::time::Duration::from_secs(secs));
            assert_eq!(std::str::from_utf8(&http_date(secs)).unwrap(), expected);
            secs += 3 * 86_400 + 3_607;
        }
        assert_eq!(&http_date(LAST_HTTP_DATE), b"Fri, 31 Dec 9999 23:59:59 GMT");
        assert_eq!(&http_date(u64::MAX), b"Fri, 31 Dec 9999 23:59:59 GMT");
    }

    #[test]
    fn etags_are_hex_time_length_and_coding() {
        assert_eq!(etag(0, 0, None), "\"0-0\"");
        assert_eq!(etag(0x65a1_b2c3, 4096, Some("br")), "\"65a1b2c3-1000-br\"");
        assert_eq!(etag(u64::MAX, 15, None), "\"ffffffffffffffff-f\"");
    }

    /// A file dated before 1970 (which `touch -d` can make) is served, its dates clamped
    /// to the epoch.
    #[test]
    fn a_file_from_before_the_epoch_is_served() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("old.txt");
        std::fs::write(&file, "old").unwrap();
        let before = UNIX_EPOCH - std::time::Duration::from_secs(10 * 365 * 86_400);
        std::fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(before)
            .unwrap();
        let response = serve_at(&file, &Method::GET, &HeaderMap::new()).unwrap();
        assert_eq!(
            response.headers()["last-modified"],
            "Thu, 01 Jan 1970 00:00:00 GMT"
        );
        assert_eq!(response.headers()["etag"], "\"0-3\"");
    }

    #[test]
    fn the_type_comes_from_the_extension_in_any_case() {
        assert_eq!(content_type(Path::new("fonts/A.WOFF2")), "font/woff2");
        assert_eq!(content_type(Path::new("site.Css")), "text/css; charset=utf-8");
        assert_eq!(
            content_type(Path::new("x.longextension")),
            "application/octet-stream"
        );
        assert_eq!(content_type(Path::new("Makefile")), "application/octet-stream");
    }

    async fn body(response: Response<FileBody>) -> Vec<u8> {
        use http_body_util::BodyExt;
        response.into_body().collect().await.unwrap().to_bytes().to_vec()
    }

    #[tokio::test]
    async fn a_file_its_validators_and_the_304_they_allow() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("style.css");
        std::fs::write(&file, "body{}").unwrap();
        let response = serve_at(&file, &Method::GET, &HeaderMap::new()).unwrap();
        assert_eq!(response.headers()["content-type"], "text/css; charset=utf-8");
        assert_eq!(response.body().size_hint().exact(), Some(6));
        let etag = response.headers()["etag"].clone();
        let modified = response.headers()["last-modified"].clone();
        assert_eq!(body(response).await, b"body{}");

        let mut conditional = HeaderMap::new();
        conditional.insert(header::IF_NONE_MATCH, etag.clone());
        let response = serve_at(&file, &Method::GET, &conditional).unwrap();
        assert_eq!(response.status(), StatusCode::NOT_MODIFIED);
        assert!(body(response).await.is_empty());

        let mut by_date = HeaderMap::new();
        by_date.insert(header::IF_MODIFIED_SINCE, modified);
        assert_eq!(
            serve_at(&file, &Method::GET, &by_date).unwrap().status(),
            StatusCode::NOT_MODIFIED
        );
        let mut other = HeaderMap::new();
        other.insert(header::IF_NONE_MATCH, HeaderValue::from_static("\"other\""));
        assert_eq!(
            serve_at(&file, &Method::GET, &other).unwrap().status(),
            StatusCode::OK
        );

        let head = serve_at(&file, &Method::HEAD, &HeaderMap::new()).unwrap();
        assert_eq!(head.headers()["content-length"], "6");
        assert!(body(head).await.is_empty());
        assert_eq!(
            serve_at(&file, &Method::POST, &HeaderMap::new()).err(),
            Some(StatusCode::METHOD_NOT_ALLOWED)
        );
    }

    /// A small part is read at once: exactly its bytes from its start, and an error when
    /// the file holds fewer than were measured (it shrank).
    #[tokio::test]
    async fn a_small_part_is_read_whole_and_a_shrunk_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("part.txt");
        std::fs::write(&path, "0123456789").unwrap();
        let part = FileBody::part(File::open(&path).unwrap(), 3, 5).unwrap();
        assert!(matches!(&part.content, Content::Read(Some(bytes)) if bytes == "34567"));
        let all = FileBody::part(File::open(&path).unwrap(), 0, 10).unwrap();
        assert!(matches!(&all.content, Content::Read(Some(bytes)) if bytes == "0123456789"));
        let shrunk = FileBody::part(File::open(&path).unwrap(), 4, 7);
        assert_eq!(
            shrunk.err().map(|error| error.kind()),
            Some(io::ErrorKind::UnexpectedEof)
        );
    }

    /// What a body holds in the room (its file's place, or its bytes' memory) is given
    /// back when it ends, not before: a client that never reads keeps it.
    #[tokio::test]
    async fn what_a_body_holds_goes_back_when_it_ends() {
        use http_body_util::BodyExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![b'f'; 200_000]).unwrap();
        let room = Room::new(1, 1, 300_000);
        let small = FileBody::part(File::open(&path).unwrap(), 0, 10).unwrap();
        let large = FileBody::part(File::open(&path).unwrap(), 0, 200_000).unwrap();
        let mut small = small.held_in(&room).unwrap();
        assert_eq!(
            room.free(),
            (1, 1, 300_000 - 10),
            "a file read at once holds its bytes"
        );
        let large = large.held_in(&room).unwrap();
        assert_eq!(
            room.free(),
            (1, 0, 300_000 - 10),
            "a file that streams holds a place"
        );
        let empty = FileBody::empty().held_in(&room).unwrap();
        assert_eq!(room.free(), (1, 0, 300_000 - 10), "an empty body holds nothing");
        drop(empty);
        let first = small.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap().len(), 10);
        assert_eq!(room.free(), (1, 0, 300_000 - 10), "held until the body ends");
        assert!(small.frame().await.is_none());
        assert_eq!(room.free(), (1, 0, 300_000));
        assert_eq!(large.collect().await.unwrap().to_bytes().len(), 200_000);
        assert_eq!(room.free(), (1, 1, 300_000));
    }

    fn with(pairs: &[(header::HeaderName, &'static str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(name, HeaderValue::from_static(value));
        }
        headers
    }

    #[tokio::test]
    async fn a_single_range_is_a_part_and_one_beyond_the_end_a_416() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("data.bin");
        std::fs::write(&file, b"0123456789").unwrap();
        let part =
            |range: &'static str| serve_at(&file, &Method::GET, &with(&[(header::RANGE, range)])).unwrap();
        let response = part("bytes=2-4");
        assert_eq!(response.status(), StatusCode::PARTIAL_CONTENT);
        assert_eq!(response.headers()["content-range"], "bytes 2-4/10");
        assert_eq!(response.body().size_hint().exact(), Some(3));
        assert_eq!(body(response).await, b"234");
        assert_eq!(body(part("bytes=7-")).await, b"789");
        assert_eq!(body(part("bytes=-3")).await, b"789");
        assert_eq!(body(part("bytes=-30")).await, b"0123456789");
        assert_eq!(part("bytes=8-1000").headers()["content-range"], "bytes 8-9/10");
        for unsatisfiable in ["bytes=10-", "bytes=99999999999999999999999-", "bytes=-0"] {
            let response = part(unsatisfiable);
            assert_eq!(
                response.status(),
                StatusCode::RANGE_NOT_SATISFIABLE,
                "{unsatisfiable}"
            );
            assert_eq!(response.headers()["content-range"], "bytes */10");
            assert!(body(response).await.is_empty());
        }
        // Several ranges, another unit, nonsense: the whole file.
        for ignored in ["bytes=0-1,3-4", "items=0-1", "bytes=4-2", "bytes=a-b", "bytes=-"] {
            let response = part(ignored);
            assert_eq!(response.status(), StatusCode::OK, "{ignored}");
            assert_eq!(response.headers()["accept-ranges"], "bytes");
            assert_eq!(body(response).await, b"0123456789");
        }
    }

    #[tokio::test]
    async fn if_range_keeps_a_part_only_of_the_same_representation() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("data.bin");
        std::fs::write(&file, b"0123456789").unwrap();
        let whole = serve_at(&file, &Method::GET, &HeaderMap::new()).unwrap();
        let mut headers = with(&[(header::RANGE, "bytes=0-0")]);
        headers.insert(header::IF_RANGE, whole.headers()["etag"].clone());
        assert_eq!(
            serve_at(&file, &Method::GET, &headers).unwrap().status(),
            StatusCode::PARTIAL_CONTENT
        );
        headers.insert(header::IF_RANGE, whole.headers()["last-modified"].clone());
        assert_eq!(
            serve_at(&file, &Method::GET, &headers).unwrap().status(),
            StatusCode::PARTIAL_CONTENT
        );
        headers.insert(header::IF_RANGE, HeaderValue::from_static("\"stale\""));
        assert_eq!(
            serve_at(&file, &Method::GET, &headers).unwrap().status(),
            StatusCode::OK
        );
        // A weak tag never matches for a range.
        let weak = format!("W/{}", whole.headers()["etag"].to_str().unwrap());
        headers.insert(header::IF_RANGE, HeaderValue::try_from(weak).unwrap());
        assert_eq!(
            serve_at(&file, &Method::GET, &headers).unwrap().status(),
            StatusCode::OK
        );
    }

    #[tokio::test]
    async fn a_precompressed_sibling_goes_to_a_client_that_accepts_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("app.js");
        std::fs::write(&file, "plain").unwrap();
        std::fs::write(dir.path().join("app.js.br"), "BROTLI").unwrap();
        std::fs::write(dir.path().join("app.js.gz"), "GZIP!!!").unwrap();
        let get = |accept: &'static str| {
            serve_at(&file, &Method::GET, &with(&[(header::ACCEPT_ENCODING, accept)])).unwrap()
        };

        let brotli = get("gzip, deflate, br, zstd");
        assert_eq!(brotli.headers()["content-encoding"], "br");
        assert_eq!(brotli.headers()["content-type"], "text/javascript; charset=utf-8");
        assert_eq!(brotli.headers()["vary"], "Accept-Encoding");
        let brotli_tag = brotli.headers()["etag"].clone();
        assert_eq!(body(brotli).await, b"BROTLI");

        let gzip = get("gzip");
        assert_eq!(gzip.headers()["content-encoding"], "gzip");
        assert_ne!(gzip.headers()["etag"], brotli_tag);
        assert_eq!(body(gzip).await, b"GZIP!!!");

        // Siblings are looked for only in the codings the client accepts (as nginx's
        // gzip_static does): a client that accepts none gets the file, varying on nothing.
        let plain = get("identity");
        assert!(!plain.headers().contains_key(header::CONTENT_ENCODING));
        assert!(!plain.headers().contains_key(header::VARY));
        assert_ne!(plain.headers()["etag"], brotli_tag);
        assert_eq!(body(plain).await, b"plain");

        // A range applies to the representation chosen; its tag revalidates it alone.
        let mut headers = with(&[(header::ACCEPT_ENCODING, "br"), (header::RANGE, "bytes=0-1")]);
        assert_eq!(
            body(serve_at(&file, &Method::GET, &headers).unwrap()).await,
            b"BR"
        );
        headers.insert(header::IF_NONE_MATCH, brotli_tag);
        assert_eq!(
            serve_at(&file, &Method::GET, &headers).unwrap().status(),
            StatusCode::NOT_MODIFIED
        );
        headers.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("gzip"));
        assert_eq!(
            serve_at(&file, &Method::GET, &headers).unwrap().status(),
            StatusCode::PARTIAL_CONTENT
        );

        // A file without siblings varies on nothing.
        std::fs::write(dir.path().join("logo.svg"), "<svg/>").unwrap();
        let alone = serve_at(
            &dir.path().join("logo.svg"),
            &Method::GET,
            &with(&[(header::ACCEPT_ENCODING, "br")]),
        )
        .unwrap();
        assert!(!alone.headers().contains_key(header::VARY));
    }

    #[tokio::test]
    async fn a_sibling_that_leads_outside_the_root_is_not_used() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "SECRET").unwrap();
        let file = dir.path().join("app.js");
        std::fs::write(&file, "plain").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), dir.path().join("app.js.gz")).unwrap();
        let response = serve_at(&file, &Method::GET, &with(&[(header::ACCEPT_ENCODING, "gzip")])).unwrap();
        assert!(!response.headers().contains_key(header::CONTENT_ENCODING));
        assert_eq!(body(response).await, b"plain");
    }

    #[tokio::test]
    async fn a_large_file_streams_in_parts_and_a_range_of_it_stops_at_its_end() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("big.bin");
        let content: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&file, &content).unwrap();
        assert_eq!(
            body(serve_at(&file, &Method::GET, &HeaderMap::new()).unwrap()).await,
            content
        );
        let response = serve_at(
            &file,
            &Method::GET,
            &with(&[(header::RANGE, "bytes=1000-200999")]),
        )
        .unwrap();
        assert_eq!(body(response).await, &content[1000..201_000]);
    }
}
