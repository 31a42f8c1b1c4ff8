//! FastCGI 1.0 records (the FastCGI specification, section 3): what floodgate writes to
//! PHP-FPM and how what comes back is framed. One request per connection at a time, so
//! every record carries request ID 1.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// The protocol version.
const VERSION: u8 = 1;
/// The request ID of the one request a connection carries at a time.
const REQUEST_ID: u16 = 1;
/// The length of a record header.
pub(super) const HEADER_LEN: usize = 8;
/// The most content one record carries.
pub(super) const MAX_CONTENT: usize = 65_535;

/// The record types floodgate writes or reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    BeginRequest = 1,
    EndRequest = 3,
    Params = 4,
    Stdin = 5,
    Stdout = 6,
    Stderr = 7,
}

impl Kind {
    /// The kind of a record PHP-FPM may send on a request, `None` for any other.
    fn received(byte: u8) -> Option<Kind> {
        match byte {
            3 => Some(Kind::EndRequest),
            6 => Some(Kind::Stdout),
            7 => Some(Kind::Stderr),
            _ => None,
        }
    }
}

/// Appends a record header for `len` bytes of content of `kind`, padded to 8 bytes.
fn header(out: &mut BytesMut, kind: Kind, len: usize) -> usize {
    debug_assert!(len <= MAX_CONTENT);
    let padding = (8 - len % 8) % 8;
    out.put_u8(VERSION);
    out.put_u8(kind as u8);
    out.put_u16(REQUEST_ID);
    out.put_u16(len as u16);
    out.put_u8(padding as u8);
    out.put_u8(0);
    padding
}

/// Appends one record of `kind` holding `content` (at most [`MAX_CONTENT`] bytes).
fn record(out: &mut BytesMut, kind: Kind, content: &[u8]) {
    let padding = header(out, kind, content.len());
    out.extend_from_slice(content);
    out.put_bytes(0, padding);
}

/// `FCGI_BEGIN_REQUEST` for the responder role, keeping the connection open afterwards.
pub(super) fn begin_request(out: &mut BytesMut) {
    const RESPONDER: u16 = 1;
    const KEEP_CONN: u8 = 1;
    let mut body = [0u8; 8];
    body[..2].copy_from_slice(&RESPONDER.to_be_bytes());
    body[2] = KEEP_CONN;
    record(out, Kind::BeginRequest, &body);
}

/// The `FCGI_PARAMS` stream: `params` as name-value pairs, then its empty end record.
pub(super) fn params<'a>(out: &mut BytesMut, params: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) {
    let mut pairs = BytesMut::new();
    for (name, value) in params {
        length(&mut pairs, name.len());
        length(&mut pairs, value.len());
        pairs.extend_from_slice(name);
        pairs.extend_from_slice(value);
    }
    for chunk in pairs.chunks(MAX_CONTENT) {
        record(out, Kind::Params, chunk);
    }
    record(out, Kind::Params, &[]);
}

/// A name-value pair's length: one byte below 128, else four with the high bit set.
fn length(out: &mut BytesMut, len: usize) {
    match u8::try_from(len) {
        Ok(short) if short < 0x80 => out.put_u8(short),
        _ => out.put_u32(len as u32 | 0x8000_0000),
    }
}

/// `FCGI_STDIN` records for `data` (none for empty data: an empty record ends the stream).
pub(super) fn stdin(out: &mut BytesMut, data: &[u8]) {
    for chunk in data.chunks(MAX_CONTENT) {
        record(out, Kind::Stdin, chunk);
    }
}

/// The empty `FCGI_STDIN` record that ends the request body.
pub(super) fn end_of_stdin(out: &mut BytesMut) {
    record(out, Kind::Stdin, &[]);
}

/// What PHP-FPM sent that is not FastCGI as floodgate speaks it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ProtocolError {
    #[error("a record of version {0}")]
    Version(u8),
    #[error("a record of type {0} on a request")]
    Kind(u8),
    #[error("a record for request {0}")]
    RequestId(u16),
    #[error("FCGI_END_REQUEST of {0} bytes")]
    EndRequest(usize),
    #[error("the request was refused (protocol status {0})")]
    Refused(u8),
}

/// A record as read: its kind and content (padding dropped).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Received {
    Stdout(Bytes),
    Stderr(Bytes),
    /// The request is complete, with the app's exit status.
    End {
        app_status: u32,
    },
}

/// Reads records from the front of `buffer` as they arrive.
#[derive(Debug, Default)]
pub(super) struct Reader {
    /// The record being read: its kind, content and padding still to come.
    current: Option<(Kind, usize, usize)>,
}

impl Reader {
    /// The next piece of a record in `buffer`, consuming it: `Ok(None)` when more bytes
    /// are needed. Content is handed out as it arrives, in parts of a record if the record
    /// is larger than what was read; an end record only whole.
    pub(super) fn next(&mut self, buffer: &mut BytesMut) -> Result<Option<Received>, ProtocolError> {
        loop {
            let Some((kind, content, padding)) = self.current else {
                if buffer.len() < HEADER_LEN {
                    return Ok(None);
                }
                let head = buffer.split_to(HEADER_LEN);
                if head[0] != VERSION {
                    return Err(ProtocolError::Version(head[0]));
                }
                let kind = Kind::received(head[1]).ok_or(ProtocolError::Kind(head[1]))?;
                let request_id = u16::from_be_bytes([head[2], head[3]]);
                if request_id != REQUEST_ID {
                    return Err(ProtocolError::RequestId(request_id));
                }
                let content = usize::from(u16::from_be_bytes([head[4], head[5]]));
                if kind == Kind::EndRequest && content != 8 {
                    return Err(ProtocolError::EndRequest(content));
                }
                self.current = Some((kind, content, usize::from(head[6])));
                continue;
            };
            if content == 0 {
                let skipped = padding.min(buffer.len());
                buffer.advance(skipped);
                if skipped < padding {
                    self.current = Some((kind, 0, padding - skipped));
                    return Ok(None);
                }
                self.current = None;
                continue;
            }
            if kind == Kind::EndRequest {
                if buffer.len() < content {
                    return Ok(None);
                }
                let body = buffer.split_to(content);
                self.current = Some((kind, 0, padding));
                let protocol_status = body[4];
                // FCGI_REQUEST_COMPLETE; the others say the request was not run.
                if protocol_status != 0 {
                    return Err(ProtocolError::Refused(protocol_status));
                }
                let app_status = u32::from_be_bytes([body[0], body[1], body[2], body[3]]);
                // The padding of the last record is not waited for.
                let skipped = padding.min(buffer.len());
                buffer.advance(skipped);
                self.current = (skipped < padding).then_some((kind, 0, padding - skipped));
                return Ok(Some(Received::End { app_status }));
            }
            if buffer.is_empty() {
                return Ok(None);
            }
            let part = buffer.split_to(content.min(buffer.len())).freeze();
            self.current = Some((kind, content - part.len(), padding));
            return Ok(Some(match kind {
                Kind::Stdout => Received::Stdout(part),
                _ => Received::Stderr(part),
            }));
        }
    }

    /// Whether a record was cut off: bytes of it are still due.
    pub(super) fn mid_record(&self) -> bool {
        self.current.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(kind: Kind, content: &[u8]) -> BytesMut {
        let mut out = BytesMut::new();
        record(&mut out, kind, content);
        out
    }

    #[test]
    fn records_are_padded_to_eight_bytes() {
        let out = encoded(Kind::Stdin, b"hello");
        assert_eq!(&out[..8], &[1, 5, 0, 1, 0, 5, 3, 0]);
        assert_eq!(out.len(), 16);
        assert_eq!(encoded(Kind::Params, &[]).len(), 8);
    }

    #[test]
    fn long_names_and_values_take_four_byte_lengths() {
        let mut out = BytesMut::new();
        let long = [b'v'; 200];
        params(&mut out, [(&b"SHORT"[..], &b"x"[..]), (&b"LONG"[..], &long[..])]);
        let content = &out[8..];
        assert_eq!(&content[..2], &[5, 1]);
        assert_eq!(&content[2..8], b"SHORTx");
        assert_eq!(&content[8..13], &[4, 0x80, 0, 0, 200]);
        // The stream ends with an empty PARAMS record.
        assert_eq!(&out[out.len() - 8..], &[1, 4, 0, 1, 0, 0, 0, 0]);
    }

    #[test]
    fn params_larger_than_a_record_are_split() {
        let mut out = BytesMut::new();
        let value = vec![b'v'; 70_000];
        params(&mut out, [(&b"BIG"[..], &value[..])]);
        let first = usize::from(u16::from_be_bytes([out[4], out[5]]));
        assert_eq!(first, MAX_CONTENT);
    }

    #[test]
    fn content_comes_out_as_it_arrives_and_padding_is_skipped() {
        let mut wire = encoded(Kind::Stdout, b"Status: 200\r\n\r\nhi");
        wire.extend_from_slice(&encoded(Kind::Stderr, b"oops"));
        let mut end = BytesMut::new();
        header(&mut end, Kind::EndRequest, 8);
        end.extend_from_slice(&[0, 0, 0, 7, 0, 0, 0, 0]);
        wire.extend_from_slice(&end);
        let mut reader = Reader::default();
        let mut buffer = BytesMut::new();
        let mut got = Vec::new();
        // One byte at a time: every boundary is crossed.
        for byte in wire {
            buffer.put_u8(byte);
            while let Some(received) = reader.next(&mut buffer).unwrap() {
                got.push(received);
            }
        }
        let stdout: Vec<u8> = got
            .iter()
            .filter_map(|r| match r {
                Received::Stdout(b) => Some(b.to_vec()),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(stdout, b"Status: 200\r\n\r\nhi");
        assert_eq!(got.last(), Some(&Received::End { app_status: 7 }));
        assert!(!reader.mid_record());
    }

    #[test]
    fn what_is_not_fastcgi_is_an_error() {
        let mut reader = Reader::default();
        let mut http = BytesMut::from(&b"HTTP/1.1 200 OK\r\n"[..]);
        assert_eq!(reader.next(&mut http), Err(ProtocolError::Version(b'H')));
        let mut reader = Reader::default();
        let mut other = BytesMut::from(&[1u8, 6, 0, 2, 0, 0, 0, 0][..]);
        assert_eq!(reader.next(&mut other), Err(ProtocolError::RequestId(2)));
        let mut reader = Reader::default();
        let mut params = encoded(Kind::Params, b"x");
        assert_eq!(reader.next(&mut params), Err(ProtocolError::Kind(4)));
    }
}
