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
/// The most content one record carries: a multiple of 8, so that it needs no padding.
/// PHP-FPM refuses a record whose content and padding together exceed 65,535 bytes.
pub(super) const MAX_CONTENT: usize = 65_528;

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

/// The header of a record of `kind` with `len` bytes of content, and the padding that
/// follows the content to a multiple of 8 bytes.
const fn header(kind: Kind, len: usize) -> ([u8; HEADER_LEN], usize) {
    debug_assert!(len <= MAX_CONTENT);
    let padding = (8 - len % 8) % 8;
    let [len_high, len_low] = (len as u16).to_be_bytes();
    let [id_high, id_low] = REQUEST_ID.to_be_bytes();
    (
        [
            VERSION,
            kind as u8,
            id_high,
            id_low,
            len_high,
            len_low,
            padding as u8,
            0,
        ],
        padding,
    )
}

/// Appends one record of `kind` holding `content` (at most [`MAX_CONTENT`] bytes).
fn record(out: &mut BytesMut, kind: Kind, content: &[u8]) {
    let (header, padding) = header(kind, content.len());
    out.extend_from_slice(&header);
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

/// The `FCGI_PARAMS` stream, written as its name-value pairs come: straight into the
/// output after room for a record header, framed when [`Params::finish`] knows the length.
pub(super) struct Params<'a> {
    out: &'a mut BytesMut,
    /// Where the pairs start in `out`, after the first record's header.
    start: usize,
}

impl<'a> Params<'a> {
    pub(super) fn new(out: &'a mut BytesMut) -> Params<'a> {
        out.put_bytes(0, HEADER_LEN);
        let start = out.len();
        Params { out, start }
    }

    /// Appends the pair `name` = `value`.
    ///
    /// Inlined, so that a constant name is copied as the few bytes it is rather than by a
    /// call; a name and a value both shorter than 128 bytes (nearly every pair) have
    /// one-byte lengths.
    #[inline(always)]
    pub(super) fn pair(&mut self, name: &[u8], value: &[u8]) {
        match (u8::try_from(name.len()), u8::try_from(value.len())) {
            (Ok(name_len @ ..0x80), Ok(value_len @ ..0x80)) => {
                self.out.reserve(2 + name.len() + value.len());
                self.out.put_u8(name_len);
                self.out.put_u8(value_len);
                self.out.extend_from_slice(name);
                self.out.extend_from_slice(value);
            }
            _ => self.pair_with(name.len(), value.len(), |out| {
                out.extend_from_slice(name);
                out.extend_from_slice(value);
            }),
        }
    }

    /// Appends the pair `name` = the `parts` one after the other.
    pub(super) fn pair_parts(&mut self, name: &[u8], parts: &[&[u8]]) {
        let value_len = parts.iter().map(|part| part.len()).sum();
        self.pair_with(name.len(), value_len, |out| {
            out.extend_from_slice(name);
            for part in parts {
                out.extend_from_slice(part);
            }
        });
    }

    /// Appends a pair whose name is `name_len` bytes and whose value is `value_len`:
    /// `write` appends the name and then the value, exactly that many bytes.
    pub(super) fn pair_with(&mut self, name_len: usize, value_len: usize, write: impl FnOnce(&mut BytesMut)) {
        let mut lengths = [0u8; 8];
        let used = length(&mut lengths, name_len);
        let used = used + length(&mut lengths[used..], value_len);
        self.out.reserve(used + name_len + value_len);
        self.out.extend_from_slice(&lengths[..used]);
        let before = self.out.len();
        write(self.out);
        debug_assert_eq!(self.out.len() - before, name_len + value_len);
    }

    /// Frames the pairs in records of at most [`MAX_CONTENT`] bytes, each holding whole
    /// pairs (PHP-FPM reads each record's pairs on their own), and ends the stream. The
    /// first record's content stays where it was written.
    pub(super) fn finish(self) -> Result<(), PairTooLong> {
        let content = self.out.len() - self.start;
        if content <= MAX_CONTENT {
            let (header, padding) = header(Kind::Params, content);
            self.out[self.start - HEADER_LEN..self.start].copy_from_slice(&header);
            self.out.put_bytes(0, padding);
        } else {
            let pairs = self.out.split_off(self.start);
            self.out.truncate(self.start - HEADER_LEN);
            let mut rest = &pairs[..];
            while !rest.is_empty() {
                let mut taken = 0;
                while taken < rest.len() {
                    let next = pair_len(&rest[taken..]);
                    if taken + next > MAX_CONTENT {
                        break;
                    }
                    taken += next;
                }
                if taken == 0 {
                    return Err(PairTooLong);
                }
                record(self.out, Kind::Params, &rest[..taken]);
                rest = &rest[taken..];
            }
        }
        record(self.out, Kind::Params, &[]);
        Ok(())
    }
}

/// A name-value pair longer than one record holds ([`MAX_CONTENT`] bytes with its
/// lengths): PHP-FPM would drop the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PairTooLong;

/// The length of the pair at the start of `pairs` (as [`Params`] wrote it), lengths included.
fn pair_len(pairs: &[u8]) -> usize {
    let mut at = 0;
    let mut length = || {
        if pairs[at] < 0x80 {
            at += 1;
            usize::from(pairs[at - 1])
        } else {
            at += 4;
            (u32::from_be_bytes([pairs[at - 4], pairs[at - 3], pairs[at - 2], pairs[at - 1]]) & 0x7fff_ffff)
                as usize
        }
    };
    let (name, value) = (length(), length());
    at + name + value
}

/// A name-value pair's length at the start of `out`: one byte below 128, else four with
/// the high bit set; how many bytes it took.
fn length(out: &mut [u8], len: usize) -> usize {
    match u8::try_from(len) {
        Ok(short) if short < 0x80 => {
            out[0] = short;
            1
        }
        _ => {
            out[..4].copy_from_slice(&(len as u32 | 0x8000_0000).to_be_bytes());
            4
        }
    }
}

/// `FCGI_STDIN` records for `data` (none for empty data: an empty record ends the stream).
pub(super) fn stdin(out: &mut BytesMut, data: &[u8]) {
    for chunk in data.chunks(MAX_CONTENT) {
        record(out, Kind::Stdin, chunk);
    }
}

/// The empty `FCGI_STDIN` record that ends the request body.
pub(super) const END_OF_STDIN: [u8; HEADER_LEN] = header(Kind::Stdin, 0).0;

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
                // Copied out and advanced past: a split would share the buffer's storage.
                let head: [u8; HEADER_LEN] = buffer[..HEADER_LEN].try_into().expect("a whole header");
                buffer.advance(HEADER_LEN);
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
                let body: [u8; 8] = buffer[..content]
                    .try_into()
                    .expect("8 bytes, checked with the header");
                buffer.advance(content);
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

    fn params<'a>(out: &mut BytesMut, pairs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) {
        let mut params = Params::new(out);
        for (name, value) in pairs {
            params.pair(name, value);
        }
        params.finish().unwrap();
    }

    /// The kinds and contents of the records in `wire`, padding checked and dropped.
    fn records(mut wire: &[u8]) -> Vec<(u8, Vec<u8>)> {
        let mut records = Vec::new();
        while !wire.is_empty() {
            let len = usize::from(u16::from_be_bytes([wire[4], wire[5]]));
            let padding = usize::from(wire[6]);
            assert_eq!((len + padding) % 8, 0);
            assert!(len + padding <= 65_535, "PHP-FPM reads no larger record");
            records.push((wire[1], wire[HEADER_LEN..HEADER_LEN + len].to_vec()));
            wire = &wire[HEADER_LEN + len + padding..];
        }
        records
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
    fn params_larger_than_a_record_are_split_between_pairs() {
        let mut out = BytesMut::new();
        let value = vec![b'v'; 30_000];
        let pairs = [
            (&b"A"[..], &b"b"[..]),
            (&b"BIG1"[..], &value[..]),
            (&b"BIG2"[..], &value[..]),
            (&b"BIG3"[..], &value[..]),
        ];
        params(&mut out, pairs);
        let records = records(&out);
        let lengths: Vec<usize> = records.iter().map(|(_, content)| content.len()).collect();
        // 1+1+1+1 bytes, then 1+4+4+30 000 for each big pair: two fit in a record, not three.
        assert_eq!(lengths, [4 + 2 * 30_009, 30_009, 0]);
        assert!(records.iter().all(|(kind, _)| *kind == Kind::Params as u8));
        // Each record holds whole pairs, which read back as written.
        let mut read = Vec::new();
        for (_, content) in &records {
            let mut rest = &content[..];
            while !rest.is_empty() {
                let len = pair_len(rest);
                read.push(rest[..len].to_vec());
                rest = &rest[len..];
            }
        }
        assert_eq!(read.len(), 4);
        assert_eq!(read[0], b"\x01\x01Ab");
        assert_eq!(&read[3][..9], &[4, 0x80, 0, 0x75, 0x30, b'B', b'I', b'G', b'3']);
    }

    #[test]
    fn a_pair_longer_than_a_record_is_refused() {
        let mut out = BytesMut::new();
        let mut params = Params::new(&mut out);
        params.pair(b"A", b"b");
        params.pair(b"REQUEST_URI", &vec![b'x'; MAX_CONTENT]);
        assert_eq!(params.finish(), Err(PairTooLong));
        // The longest that fits: its lengths (1 + 4) and name (1) with it.
        let mut out = BytesMut::new();
        let mut params = Params::new(&mut out);
        params.pair(b"A", b"b");
        params.pair(b"U", &vec![b'x'; MAX_CONTENT - 6]);
        assert_eq!(params.finish(), Ok(()));
        assert_eq!(records(&out).len(), 3);
    }

    #[test]
    fn a_short_params_stream_is_one_padded_record_and_its_end() {
        let mut out = BytesMut::new();
        begin_request(&mut out);
        params(&mut out, [(&b"AB"[..], &b"cde"[..])]);
        let records = records(&out);
        assert_eq!(records.len(), 3);
        assert_eq!(records[1], (Kind::Params as u8, b"\x02\x03ABcde".to_vec()));
        assert_eq!(records[2], (Kind::Params as u8, vec![]));
    }

    #[test]
    fn content_comes_out_as_it_arrives_and_padding_is_skipped() {
        let mut wire = encoded(Kind::Stdout, b"Status: 200\r\n\r\nhi");
        wire.extend_from_slice(&encoded(Kind::Stderr, b"oops"));
        wire.extend_from_slice(&encoded(Kind::EndRequest, &[0, 0, 0, 7, 0, 0, 0, 0]));
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
