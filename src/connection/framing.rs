//! A guard between the socket and hyper's HTTP/1 parser for the one thing hyper lets
//! through that a gateway must refuse and that the request hyper hands over no longer
//! shows: a request carrying both `Content-Length` and `Transfer-Encoding`. hyper drops
//! the `Content-Length` (RFC 9112 §6.3 lets an intermediary forward such a request as
//! chunked) and keeps the connection open; floodgate answers 400, nothing forwarded and the
//! connection closed. The guard holds each request head until it is complete, and when
//! it sees both headers it breaks the request line, so hyper answers 400 and closes the
//! connection without ever calling the service. Everything else about a head is checked
//! on the parsed request (`service::request_head`).
//!
//! To find every request head on a keep-alive connection the guard follows the framing of
//! each request body (`Content-Length` or chunked), with the same limits as hyper and a
//! reading of each head that agrees with hyper's parser (plain `name: value` lines are read
//! line by line; anything else goes through httparse, as in hyper), and of chunked bodies
//! that agrees with hyper's decoder, so the two never disagree about where a head starts:
//! where the guard cannot follow a body as hyper would (a line hyper refuses, or one too
//! long to hold), it makes hyper fail there rather than let it read on. Request bodies pass
//! through without a copy where possible. It inspects every head of an HTTP/1 connection,
//! those after an `Upgrade` or `CONNECT` included, until a tunnel actually starts
//! ([`ConnectionState::tunnel_started`]); it turns transparent only for that, for an
//! HTTP/2 connection, and for bytes hyper refuses by itself (and then closes). Before
//! hyper is given the connection, the guard tells from its first bytes whether it speaks
//! HTTP/2 ([`FramingGuard::protocol`]), keeping them for hyper.
//!
//! A head with more fields than hyper is given room for reaches it folded ([`fold`]).

use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker, ready};

use bytes::{Buf, Bytes, BytesMut};
use memchr::memchr;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::ConnectionState;
use super::fold::{self, HYPER_FIELDS};

/// The HTTP/2 connection preface (prior-knowledge h2c).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Longest chunk-size or trailer line the guard follows; a longer one is refused (hyper
/// would take up to 16 KB of chunk extensions).
const MAX_LINE: usize = 8 * 1024;
const READ_CHUNK: usize = 8 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Waiting for a complete request head.
    Head,
    /// Inside a `Content-Length` body with this many bytes left.
    Body(u64),
    /// Before a chunk-size line.
    ChunkSize,
    /// Inside a chunk with this many bytes left.
    ChunkData(u64),
    /// The CRLF that ends a chunk's data.
    ChunkEnd,
    /// Trailer lines after the last chunk, up to an empty line.
    Trailers,
    /// Not inspecting any more.
    Transparent,
    /// A head was refused: hyper gets nothing more.
    Refused,
}

/// What the guard found in a complete request head.
#[derive(Debug, PartialEq, Eq)]
enum HeadVerdict {
    /// A head floodgate refuses; hyper never sees it.
    Refuse(HeadRefusal),
    /// Follow this framing for the body.
    Framing(State),
    /// Something hyper will refuse by itself, and then close the connection.
    StopInspecting,
}

/// Why the guard refused a request head: floodgate answers it itself
/// ([`AnswerRefusal`]) and closes the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeadRefusal {
    /// Both `Content-Length` and `Transfer-Encoding` (400).
    Ambiguous,
    /// A head hyper's parser refuses, or whose framing it does (400).
    Malformed,
    /// More than the head limits allow (431).
    TooLarge,
}

/// Makes floodgate's answer to a head the guard refused: the bytes of a whole HTTP/1.1
/// response, written once every earlier response has gone out.
pub(crate) trait AnswerRefusal: Unpin {
    fn answer(&self, refusal: HeadRefusal) -> Bytes;
}

/// A refused head's answer, as it is written.
struct Refused {
    refusal: HeadRefusal,
    /// Made when it is first written.
    message: Option<Bytes>,
    written: usize,
    /// hyper's read, waiting for the responses before the answer to go out.
    reader: Option<Waker>,
}

/// The connection stream with request framing checked. See the module docs.
pub(crate) struct FramingGuard<S, A> {
    inner: S,
    /// Bytes read from the socket that hyper has not yet been given.
    buf: BytesMut,
    /// How many bytes at the front of `buf` have been inspected and may be handed out.
    cleared: usize,
    /// How many bytes past `cleared` have been found to hold no whole head (0: none yet):
    /// a head sent a byte at a time is searched once, not again at each byte.
    searched: usize,
    state: State,
    /// The largest head, and the most fields in it, that floodgate accepts.
    limits: HeadLimits,
    connection: Arc<ConnectionState>,
    answer: A,
    refused: Option<Box<Refused>>,
    /// Whether hyper has written since it last flushed.
    unflushed: bool,
}

/// The head limits hyper is configured with; the guard follows heads up to them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeadLimits {
    pub bytes: usize,
    pub fields: usize,
}

impl<S, A> FramingGuard<S, A> {
    pub(crate) fn new(inner: S, limits: HeadLimits, connection: Arc<ConnectionState>, answer: A) -> Self {
        FramingGuard {
            inner,
            buf: BytesMut::new(),
            cleared: 0,
            searched: 0,
            state: State::Head,
            limits,
            connection,
            answer,
            refused: None,
            unflushed: false,
        }
    }

    /// Inspects what `buf` holds beyond `cleared`; returns whether anything changed.
    fn advance(&mut self) -> bool {
        let pending = &self.buf[self.cleared..];
        if pending.is_empty() && self.state != State::Head {
            return false;
        }
        match self.state {
            State::Transparent => {
                self.cleared = self.buf.len();
                true
            }
            State::Body(left) | State::ChunkData(left) => {
                let take = left.min(pending.len() as u64);
                self.cleared += take as usize;
                let left = left - take;
                self.state = match (self.state, left) {
                    (State::Body(_), 0) => State::Head,
                    (State::Body(_), _) => State::Body(left),
                    (_, 0) => State::ChunkEnd,
                    _ => State::ChunkData(left),
                };
                take > 0
            }
            // Where the guard cannot follow a chunked body as hyper reads it (a line hyper
            // refuses, or one too long for the guard), hyper is made to fail there: were
            // the guard to stop inspecting, hyper could read on, and the heads after would
            // pass unchecked.
            State::ChunkSize => match chunk_size_line(pending) {
                ChunkLine::Complete { len, size } if len <= MAX_LINE => {
                    self.cleared += len;
                    self.state = if size == 0 {
                        State::Trailers
                    } else {
                        State::ChunkData(size)
                    };
                    true
                }
                ChunkLine::Partial if pending.len() <= MAX_LINE => false,
                // hyper expects a hex digit.
                _ => self.break_stream(b"@"),
            },
            State::ChunkEnd => match pending {
                [b'\r', b'\n', ..] => self.clear_line(2, State::ChunkSize),
                [b'\r'] => false,
                // hyper expects CR.
                _ => self.break_stream(b"@"),
            },
            // As hyper reads trailers: a line ends at its first CR, which must be followed
            // by LF, and the section at a line that is empty.
            State::Trailers => match pending {
                [b'\r', b'\n', ..] => self.clear_line(2, State::Head),
                [b'\r'] => false,
                [b'\r', ..] => self.break_stream(b"\r@"),
                _ => match memchr(b'\r', pending) {
                    Some(cr) if cr > MAX_LINE => self.break_stream(b"\r@"),
                    Some(cr) => match pending.get(cr + 1) {
                        Some(b'\n') => self.clear_line(cr + 2, State::Trailers),
                        Some(_) => self.break_stream(b"\r@"),
                        None => false,
                    },
                    None if pending.len() <= MAX_LINE => false,
                    // At a line's start hyper takes CR then anything but LF as an error.
                    None => self.break_stream(b"\r@"),
                },
            },
            State::Head => self.advance_head(),
            State::Refused => false,
        }
    }

    fn clear_line(&mut self, len: usize, next: State) -> bool {
        self.cleared += len;
        self.state = next;
        true
    }

    /// Writes `poison` over the first bytes not yet handed to hyper, bytes hyper fails
    /// on where it is, and stops inspecting: hyper answers 400 (or ends the body it was
    /// reading with an error) and closes the connection.
    fn break_stream(&mut self, poison: &[u8]) -> bool {
        tracing::warn!("refused a request body the framing guard cannot follow as hyper would");
        let at = self.cleared;
        self.buf[at..at + poison.len()].copy_from_slice(poison);
        self.stop_inspecting()
    }

    fn stop_inspecting(&mut self) -> bool {
        self.state = State::Transparent;
        self.cleared = self.buf.len();
        self.refused = None;
        true
    }

    /// Refuses the head at `cleared`: hyper gets what comes before it and then the end of
    /// the stream, never the head, and floodgate answers it once the responses before it
    /// have gone out ([`poll_refusal`](Self::poll_refusal)). The client may still be
    /// sending: the connection lingers as it closes. What the guard holds is kept for a
    /// tunnel that an earlier request may yet start (its bytes are no head).
    fn refuse(&mut self, refusal: HeadRefusal) -> bool {
        tracing::debug!(?refusal, "refused a request head");
        self.state = State::Refused;
        self.refused = Some(Box::new(Refused {
            refusal,
            message: None,
            written: 0,
            reader: None,
        }));
        self.connection.closed_before_the_body_ended();
        true
    }

    fn advance_head(&mut self) -> bool {
        let pending = &self.buf[self.cleared..];
        // Empty lines before a request line are allowed (RFC 9112 §2.2).
        let blank = pending.iter().take_while(|&&b| b == b'\r' || b == b'\n').count();
        if blank > 0 {
            self.cleared += blank;
            self.searched = 0;
            return true;
        }
        if pending.is_empty() {
            return false;
        }
        match protocol_of(pending) {
            Some(Protocol::Http2) => return self.stop_inspecting(),
            None => return false,
            Some(Protocol::Http1) => {}
        }
        // A byte that cannot start a method is refused at once, as hyper's parser refuses
        // it there whatever follows: a TLS handshake sent to the plain port, say, which
        // has no line end to wait for.
        if !is_token(pending[0]) {
            return self.refuse(HeadRefusal::Malformed);
        }
        // A head found incomplete is read again only once it may be whole: once the new
        // bytes, with the two before them (an empty line's CR LF may complete the LF
        // before them), end a line with an empty one. A head that came whole costs no
        // search.
        if self.searched > 0 {
            let from = self.searched.saturating_sub(2);
            if head_end(&pending[from..]).is_none() {
                self.searched = pending.len();
                return pending.len() > self.limits.bytes && self.refuse(HeadRefusal::TooLarge);
            }
            self.searched = 0;
        }
        // Heads with more fields than hyper takes are read by the parser, and folded.
        let (head_len, verdict, fields) = match scan_head(pending, HYPER_FIELDS) {
            Scanned::Complete(head_len, verdict) => (head_len, verdict, 0),
            Scanned::Unusual if let Some(head_len) = head_end(pending) => {
                let (verdict, fields) = parse_framing(&pending[..head_len], self.limits.fields);
                (head_len, verdict, fields)
            }
            Scanned::Incomplete | Scanned::Unusual if pending.len() > self.limits.bytes => {
                return self.refuse(HeadRefusal::TooLarge);
            }
            // An unusual head is parsed as far as it came: one the parser refuses already
            // is refused now, not when (if ever) it ends.
            Scanned::Unusual
                if let (HeadVerdict::Refuse(refusal), _) = parse_framing(pending, self.limits.fields) =>
            {
                return self.refuse(refusal);
            }
            Scanned::Incomplete | Scanned::Unusual => {
                self.searched = pending.len();
                return false;
            }
        };
        // Come whole in one read, yet past the limit (hyper would answer an overlong
        // target itself).
        if head_len > self.limits.bytes {
            return self.refuse(HeadRefusal::TooLarge);
        }
        match verdict {
            HeadVerdict::Framing(next) if fields > HYPER_FIELDS => self.fold_head(head_len, fields, next),
            HeadVerdict::Framing(next) => {
                self.cleared += head_len;
                self.state = next;
                true
            }
            HeadVerdict::StopInspecting => self.stop_inspecting(),
            HeadVerdict::Refuse(refusal) => self.refuse(refusal),
        }
    }

    /// Gives hyper the head of `head_len` bytes and `fields` fields at `cleared` with its
    /// fields past the 99th folded into one ([`fold`]), then follows its body's framing,
    /// `next`.
    #[cold]
    fn fold_head(&mut self, head_len: usize, fields: usize, next: State) -> bool {
        let head = &self.buf[self.cleared..self.cleared + head_len];
        let folded = match fold::fold(head, fields) {
            Ok(folded) if folded.len() <= self.limits.bytes => folded,
            Ok(_) => return self.refuse(HeadRefusal::TooLarge),
            Err(refusal) => return self.refuse(refusal),
        };
        let mut buf = BytesMut::with_capacity(self.buf.len() - head_len + folded.len());
        buf.extend_from_slice(&self.buf[..self.cleared]);
        buf.extend_from_slice(&folded);
        buf.extend_from_slice(&self.buf[self.cleared + head_len..]);
        self.buf = buf;
        self.cleared += folded.len();
        self.state = next;
        true
    }
}

/// What the start of a chunked body's size line holds.
#[derive(Debug, PartialEq, Eq)]
enum ChunkLine {
    /// A line of `len` bytes announcing a chunk of `size`.
    Complete { len: usize, size: u64 },
    /// The start of a line hyper would read on.
    Partial,
    /// A line hyper refuses.
    Refused,
}

/// The chunk-size line at the start of `bytes` as hyper's decoder reads it: hex digits,
/// then spaces or tabs, then `;` and an extension holding neither CR nor LF, then CR LF.
fn chunk_size_line(bytes: &[u8]) -> ChunkLine {
    let digits = bytes.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    let Some(size) = bytes[..digits].iter().try_fold(0u64, |size, &digit| {
        let value = (digit as char).to_digit(16).expect("a hex digit");
        size.checked_mul(16)?.checked_add(u64::from(value))
    }) else {
        return ChunkLine::Refused;
    };
    if digits == 0 {
        return if bytes.is_empty() {
            ChunkLine::Partial
        } else {
            ChunkLine::Refused
        };
    }
    let mut at = digits
        + bytes[digits..]
            .iter()
            .take_while(|&&b| b == b' ' || b == b'\t')
            .count();
    if bytes.get(at) == Some(&b';') {
        match bytes[at..].iter().position(|&b| b == b'\r' || b == b'\n') {
            Some(end) if bytes[at + end] == b'\r' => at += end,
            Some(_) => return ChunkLine::Refused,
            None => return ChunkLine::Partial,
        }
    }
    match (bytes.get(at), bytes.get(at + 1)) {
        (Some(b'\r'), Some(b'\n')) => ChunkLine::Complete { len: at + 2, size },
        (None, _) | (Some(b'\r'), None) => ChunkLine::Partial,
        _ => ChunkLine::Refused,
    }
}

/// The length of the head at the start of `bytes` (through the empty line), if complete.
fn head_end(bytes: &[u8]) -> Option<usize> {
    let mut from = 0;
    while let Some(nl) = memchr(b'\n', &bytes[from..]) {
        let at = from + nl;
        match bytes.get(at + 1..) {
            Some([b'\n', ..]) => return Some(at + 2),
            Some([b'\r', b'\n', ..]) => return Some(at + 3),
            _ => from = at + 1,
        }
    }
    None
}

/// What reading a head line by line found.
#[derive(Debug, PartialEq, Eq)]
enum Scanned {
    /// The head is the first `usize` bytes, with this framing.
    Complete(usize, HeadVerdict),
    /// The head has not all arrived.
    Incomplete,
    /// A field line that is not a token name, a colon and a value, or too many of them:
    /// the parser decides, once the head is complete.
    Unusual,
}

/// The length and framing of the head at the start of `bytes`, read line by line in one
/// pass (what nearly every client sends): for every head hyper accepts, the verdict
/// [`parse_framing`] gives, at a fraction of its cost.
fn scan_head(bytes: &[u8], max_fields: usize) -> Scanned {
    let mut framing = FramingHeaders::default();
    let mut fields = 0;
    // After the request line, each field line up to the empty one that ends the head.
    let Some(request_line) = memchr(b'\n', bytes) else {
        return Scanned::Incomplete;
    };
    if !plain_request_line(&bytes[..request_line]) {
        return Scanned::Unusual;
    }
    let mut start = request_line + 1;
    loop {
        let rest = &bytes[start..];
        match rest {
            [b'\n', ..] => return Scanned::Complete(start + 1, framing.verdict()),
            [b'\r', b'\n', ..] => return Scanned::Complete(start + 2, framing.verdict()),
            [] | [b'\r'] => return Scanned::Incomplete,
            _ => {}
        }
        fields += 1;
        if fields > max_fields {
            return Scanned::Unusual;
        }
        let name_len = rest.iter().take_while(|&&byte| is_token(byte)).count();
        match rest.get(name_len) {
            None => return Scanned::Incomplete,
            Some(b':') if name_len > 0 => {}
            Some(_) => return Scanned::Unusual,
        }
        let value_start = name_len + 1;
        let Some(value_len) = memchr(b'\n', &rest[value_start..]) else {
            return Scanned::Incomplete;
        };
        let value = &rest[value_start..value_start + value_len];
        framing.see(&rest[..name_len], value.strip_suffix(b"\r").unwrap_or(value));
        start += value_start + value_len + 1;
    }
}

/// Whether `line` (without its LF) is `method SP target SP HTTP/1.1` (or `1.0`), the
/// method a token and the target a path (and query) of bytes every URI rule of hyper's
/// takes, as nearly every client sends it; any other goes through httparse and hyper's
/// URI rules ([`parse_framing`]), so that a line hyper would refuse (a space or a `<` in
/// the target, say) is refused by floodgate.
fn plain_request_line(line: &[u8]) -> bool {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let Some(rest) = line
        .strip_suffix(b" HTTP/1.1")
        .or_else(|| line.strip_suffix(b" HTTP/1.0"))
    else {
        return false;
    };
    let method_len = rest.iter().take_while(|&&byte| is_token(byte)).count();
    let (method, target) = rest.split_at(method_len);
    let Some(target) = target.strip_prefix(b" ") else {
        return false;
    };
    // Looked at whole, in a loop the compiler vectorizes, not byte by byte to the first odd
    // one: a target nearly always has none.
    let odd = target
        .iter()
        .fold(false, |odd, &byte| odd | !plain_target_byte(byte));
    !method.is_empty() && target.first() == Some(&b'/') && !odd
}

/// Whether a target may hold `byte` wherever it stands, in its path or its query, by the
/// URI rules hyper applies (the `http` crate's, after httparse's): visible ASCII but `"`,
/// `#`, `<`, `>` and `` ` `` (some of which a path or a query may hold, left to the
/// parser). Written as arithmetic on the byte, not a table or a set, so that a loop over a
/// line vectorizes.
#[inline(always)]
fn plain_target_byte(byte: u8) -> bool {
    let visible = byte.wrapping_sub(0x21) < 0x5e;
    let quote_or_hash = byte.wrapping_sub(b'"') < 2;
    let angle = byte | 2 == b'>';
    let backtick = byte == b'`';
    visible & !(quote_or_hash | angle | backtick)
}

/// Whether `byte` may be part of a field name (RFC 9110 §5.6.2).
fn is_token(byte: u8) -> bool {
    TOKEN[usize::from(byte)]
}

/// The bytes of field names: RFC 9110's `tchar`.
const TOKEN: [bool; 256] = byte_set!(|b| {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'!' | b'#'
                | b'$'
                | b'%'
                | b'&'
                | b'\''
                | b'*'
                | b'+'
                | b'-'
                | b'.'
                | b'^'
                | b'_'
                | b'`'
                | b'|'
                | b'~'
        )
});

/// Fields looked for on the stack; a head with more is parsed again with room for all.
const USUAL_FIELDS: usize = 64;

/// The framing of `head` as httparse, hyper's parser, reads it, and how many fields it
/// found.
fn parse_framing(head: &[u8], max_fields: usize) -> (HeadVerdict, usize) {
    let mut usual = [httparse::EMPTY_HEADER; USUAL_FIELDS];
    let mut request = httparse::Request::new(&mut usual);
    match request.parse(head) {
        Err(httparse::Error::TooManyHeaders) if max_fields > USUAL_FIELDS => {}
        parsed => return (verdict_of(parsed, &request), request.headers.len()),
    }
    let mut all = vec![httparse::EMPTY_HEADER; max_fields];
    let mut request = httparse::Request::new(&mut all);
    let parsed = request.parse(head);
    (verdict_of(parsed, &request), request.headers.len())
}

/// The verdict on a head httparse `parsed` into `request`: what hyper refuses the guard
/// refuses too, with hyper's status (`TooManyHeaders` is its 431).
fn verdict_of(parsed: httparse::Result<usize>, request: &httparse::Request<'_, '_>) -> HeadVerdict {
    match parsed {
        Ok(httparse::Status::Complete(_)) if !request_line_taken(request) => {
            HeadVerdict::Refuse(HeadRefusal::Malformed)
        }
        Ok(httparse::Status::Complete(_)) => FramingHeaders::of(request).verdict(),
        Ok(httparse::Status::Partial) => HeadVerdict::StopInspecting,
        Err(httparse::Error::TooManyHeaders) => HeadVerdict::Refuse(HeadRefusal::TooLarge),
        Err(_) => HeadVerdict::Refuse(HeadRefusal::Malformed),
    }
}

/// Whether hyper takes the method and target httparse read: as a `Method` and a `Uri`,
/// by the `http` crate's rules, which refuse some of what httparse lets through (a `<` or
/// a `"` in a target, bytes that are not UTF-8).
fn request_line_taken(request: &httparse::Request<'_, '_>) -> bool {
    let (Some(method), Some(target)) = (request.method, request.path) else {
        return false;
    };
    http::Method::from_bytes(method.as_bytes()).is_ok() && target.parse::<http::Uri>().is_ok()
}

/// What a head says about its body's framing.
#[derive(Default)]
struct FramingHeaders<'a> {
    transfer_encoding: Option<&'a [u8]>,
    /// The `Content-Length`, if every one the head has is the same number (`None` in it
    /// when they differ or one is not a number).
    content_length: Option<Option<u64>>,
    /// Whether the head has more than one `Content-Length` field.
    lengths_repeated: bool,
}

impl<'a> FramingHeaders<'a> {
    fn of(request: &httparse::Request<'_, 'a>) -> Self {
        let mut framing = FramingHeaders::default();
        for header in request.headers.iter() {
            framing.see(header.name.as_bytes(), header.value);
        }
        framing
    }

    /// Takes note of one field.
    fn see(&mut self, name: &[u8], value: &'a [u8]) {
        if name.eq_ignore_ascii_case(b"transfer-encoding") {
            self.transfer_encoding = Some(value.trim_ascii());
        } else if name.eq_ignore_ascii_case(b"content-length") {
            let length = decimal(value.trim_ascii());
            self.lengths_repeated |= self.content_length.is_some();
            self.content_length = Some(match self.content_length {
                Some(previous) if previous != length => None,
                _ => length,
            });
        }
    }

    /// hyper refuses a request whose last transfer coding is not `chunked`, and one whose
    /// `Content-Length` values differ or are not a number; floodgate also one with its
    /// length given twice, alike or not (hyper takes equal ones as one), as nginx does.
    fn verdict(&self) -> HeadVerdict {
        match (self.transfer_encoding, self.content_length) {
            (Some(_), Some(_)) => HeadVerdict::Refuse(HeadRefusal::Ambiguous),
            _ if self.lengths_repeated => HeadVerdict::Refuse(HeadRefusal::Ambiguous),
            (Some(coding), None) if ends_with_chunked(coding) => HeadVerdict::Framing(State::ChunkSize),
            (None, Some(Some(0))) => HeadVerdict::Framing(State::Head),
            (None, Some(Some(length))) => HeadVerdict::Framing(State::Body(length)),
            (None, None) => HeadVerdict::Framing(State::Head),
            (Some(_), None) | (None, Some(None)) => HeadVerdict::Refuse(HeadRefusal::Malformed),
        }
    }
}

/// A `Content-Length` value as hyper reads it: decimal digits only.
fn decimal(value: &[u8]) -> Option<u64> {
    if value.is_empty() {
        return None;
    }
    value.iter().try_fold(0u64, |number, &digit| {
        digit
            .is_ascii_digit()
            .then(|| number.checked_mul(10)?.checked_add(u64::from(digit - b'0')))?
    })
}

fn ends_with_chunked(coding: &[u8]) -> bool {
    std::str::from_utf8(coding)
        .ok()
        .and_then(|c| c.rsplit(',').next())
        .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"))
}

impl<S: AsyncRead + AsyncWrite + Unpin, A: AnswerRefusal> AsyncRead for FramingGuard<S, A> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.state != State::Transparent && this.connection.tunnel_started() {
            this.stop_inspecting();
        }
        loop {
            if this.cleared > 0 {
                let n = this.cleared.min(out.remaining());
                out.put_slice(&this.buf[..n]);
                this.buf.advance(n);
                this.cleared -= n;
                return Poll::Ready(Ok(()));
            }
            if this.state == State::Refused {
                return this.poll_refusal(cx);
            }
            if this.buf.is_empty() {
                match this.state {
                    // Nothing held back: read straight into hyper's buffer.
                    State::Transparent => return Pin::new(&mut this.inner).poll_read(cx, out),
                    State::Body(left) => return this.read_body_directly(cx, out, left),
                    _ => {}
                }
            }
            if this.advance() {
                continue;
            }
            let n = ready!(this.poll_fill(cx))?;
            if n == 0 {
                // End of stream: hand over whatever is held so hyper sees it all.
                this.stop_inspecting();
                if this.cleared == 0 {
                    return Poll::Ready(Ok(()));
                }
            }
        }
    }
}

/// What a connection speaks, as its first bytes tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    Http1,
    /// It opens with the HTTP/2 preface (prior-knowledge h2c, or h2 after TLS).
    Http2,
}

/// What `bytes`, the first a connection sent, tell of its protocol: `None` while they are
/// the start of HTTP/2's preface and no more.
fn protocol_of(bytes: &[u8]) -> Option<Protocol> {
    let seen = bytes.len().min(H2_PREFACE.len());
    if bytes[..seen] != H2_PREFACE[..seen] {
        Some(Protocol::Http1)
    } else if seen == H2_PREFACE.len() {
        Some(Protocol::Http2)
    } else {
        None
    }
}

impl<S: AsyncWrite + Unpin, A: AnswerRefusal> FramingGuard<S, A> {
    /// Writes the answer to the refused head once the responses before it have gone out
    /// (no request in flight, and hyper's writes flushed; until then hyper's read waits,
    /// and is woken by the flush that ends them), then ends the stream for hyper, which
    /// closes the connection.
    #[cold]
    fn poll_refusal(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let refused = self.refused.as_mut().expect("a refused head has its answer");
        if self.unflushed || self.connection.carries_requests() {
            refused.reader = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let message = refused
            .message
            .get_or_insert_with(|| self.answer.answer(refused.refusal));
        while refused.written < message.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &message[refused.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            refused.written += n;
        }
        ready!(Pin::new(&mut self.inner).poll_flush(cx))?;
        Poll::Ready(Ok(()))
    }

    /// hyper's writes have gone out: a refused head's answer may follow.
    fn flushed(&mut self) {
        self.unflushed = false;
        if let Some(reader) = self.refused.as_mut().and_then(|refused| refused.reader.take()) {
            reader.wake();
        }
    }
}

impl<S: AsyncRead + Unpin, A> FramingGuard<S, A> {
    /// Which protocol the connection speaks: reads only as much as it takes to tell, and
    /// keeps what it read for hyper (whose first read then gets the whole head that
    /// arrived, where a sniffer of its own would hand over its 24 bytes first and make
    /// hyper double its read buffer). The end of the stream counts as HTTP/1.
    pub(crate) async fn protocol(&mut self) -> io::Result<Protocol> {
        std::future::poll_fn(|cx| {
            loop {
                if let Some(protocol) = protocol_of(&self.buf) {
                    return Poll::Ready(Ok(protocol));
                }
                if ready!(self.poll_fill(cx))? == 0 {
                    return Poll::Ready(Ok(Protocol::Http1));
                }
            }
        })
        .await
    }

    /// Reads from the socket into `buf`; the bytes read, `0` at the end of the stream.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.state == State::Head && self.buf.is_empty() {
            // Waiting for a head with nothing held, as a keep-alive connection does
            // between requests, often for long: read on the stack and keep only what
            // arrives, so that an idle connection holds no more of the guard's buffer
            // than its last head took (8 KB reserved for each read, before).
            let mut chunk = [MaybeUninit::<u8>::uninit(); READ_CHUNK];
            let mut read_buf = ReadBuf::uninit(&mut chunk);
            ready!(Pin::new(&mut self.inner).poll_read(cx, &mut read_buf))?;
            self.buf.extend_from_slice(read_buf.filled());
            Poll::Ready(Ok(read_buf.filled().len()))
        } else {
            self.buf.reserve(READ_CHUNK);
            let mut read_buf = ReadBuf::uninit(self.buf.spare_capacity_mut());
            ready!(Pin::new(&mut self.inner).poll_read(cx, &mut read_buf))?;
            let n = read_buf.filled().len();
            // SAFETY: `poll_read` initialized the first `n` bytes of the spare capacity.
            unsafe { self.buf.set_len(self.buf.len() + n) };
            Poll::Ready(Ok(n))
        }
    }

    /// Reads at most `left` body bytes from the socket straight into `out`.
    fn read_body_directly(
        &mut self,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
        left: u64,
    ) -> Poll<io::Result<()>> {
        let limit = usize::try_from(left).unwrap_or(usize::MAX).min(out.remaining());
        let mut limited = out.take(limit);
        let polled = Pin::new(&mut self.inner).poll_read(cx, &mut limited);
        let n = limited.filled().len();
        if let Poll::Ready(Ok(())) = polled {
            // SAFETY: `take` lends the unfilled part of `out`, whose first `n` bytes the
            // inner reader has just initialized.
            unsafe { out.assume_init(n) };
            out.advance(n);
            let left = left - n as u64;
            self.state = if left == 0 { State::Head } else { State::Body(left) };
        }
        polled
    }
}

impl<S, A> Drop for FramingGuard<S, A> {
    fn drop(&mut self) {
        // Closed in the middle of a request body: the client may still be sending it.
        if matches!(
            self.state,
            State::Body(1..) | State::ChunkSize | State::ChunkData(_) | State::ChunkEnd | State::Trailers
        ) {
            self.connection.closed_before_the_body_ended();
        }
    }
}

impl<S: AsyncWrite + Unpin, A: AnswerRefusal> AsyncWrite for FramingGuard<S, A> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.unflushed = true;
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.unflushed = true;
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(Pin::new(&mut self.inner).poll_flush(cx))?;
        self.flushed();
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Feeds `input` through a guard in pieces of `piece` bytes and returns what hyper
    /// would read, and what the guard answered the client itself.
    async fn through_guard_answering(input: &[u8], piece: usize) -> (Vec<u8>, Vec<u8>) {
        let (client, server) = tokio::io::duplex(1 << 20);
        let (mut answers, mut client) = tokio::io::split(client);
        let input = input.to_vec();
        let writer = tokio::spawn(async move {
            for chunk in input.chunks(piece) {
                client.write_all(chunk).await.unwrap();
                tokio::task::yield_now().await;
            }
            client.shutdown().await.unwrap();
        });
        let mut guard = FramingGuard::new(server, LIMITS, ConnectionState::new(), Fixed);
        let mut seen = Vec::new();
        guard.read_to_end(&mut seen).await.unwrap();
        writer.await.unwrap();
        drop(guard);
        let mut answered = Vec::new();
        answers.read_to_end(&mut answered).await.unwrap();
        (seen, answered)
    }

    async fn through_guard(input: &[u8], piece: usize) -> Vec<u8> {
        through_guard_answering(input, piece).await.0
    }

    /// Asserts that the guard hands hyper `input` up to `at`, then refuses the head there:
    /// hyper reads no more, and the client gets floodgate's answer.
    async fn refused_at(input: &[u8], piece: usize, at: usize, refusal: HeadRefusal) {
        let (seen, answered) = through_guard_answering(input, piece).await;
        let context = format!("{:?} in pieces of {piece}", String::from_utf8_lossy(input));
        assert_eq!(seen, input[..at], "{context}");
        assert_eq!(answered, format!("{refusal:?}").as_bytes(), "{context}");
    }

    #[test]
    fn a_head_may_end_only_at_an_empty_line() {
        for ended in [
            &b"GET / HTTP/1.1\r\n\r\n"[..],
            b"a: b\n\n",
            b"a: b\r\n\n",
            b"\n\r\n",
        ] {
            assert!(head_end(ended).is_some(), "{ended:?}");
        }
        for open in [
            &b"GET / HTTP/1.1\r\nHost: x\r\n"[..],
            b"a: b\r\n\r",
            b"\r\n",
            b"a\rb\r\n",
        ] {
            assert!(head_end(open).is_none(), "{open:?}");
        }
    }

    /// Each byte of a head sent a byte at a time is searched for its end about once: what
    /// reaches hyper is the same, its framing checked, whatever the pieces.
    #[tokio::test]
    async fn heads_sent_a_byte_at_a_time_are_followed() {
        let mut long = b"GET / HTTP/1.1\r\nHost: x\r\n".to_vec();
        for _ in 0..2_000 {
            long.extend_from_slice(b"a:b\r\n");
        }
        long.extend_from_slice(b"Content-Length: 2\r\n\r\n");
        let folded = fold::fold(&long, LIMITS.fields).unwrap();
        let rest = [&b"hi"[..], PIPELINE].concat();
        long.extend_from_slice(&rest);
        for piece in [1, 2, 3, 7] {
            let seen = through_guard(&long, piece).await;
            assert!(seen == [&folded[..], &rest].concat(), "pieces of {piece}");
        }
        let ambiguous = b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n";
        for piece in [1, 2, 3] {
            refused_at(ambiguous, piece, 0, HeadRefusal::Ambiguous).await;
        }
    }

    /// Answers a refused head with the refusal's name, for a test to read back.
    struct Fixed;

    impl AnswerRefusal for Fixed {
        fn answer(&self, refusal: HeadRefusal) -> Bytes {
            Bytes::from(format!("{refusal:?}"))
        }
    }

    const LIMITS: HeadLimits = HeadLimits {
        bytes: 64 * 1024,
        fields: 8192,
    };

    const PIPELINE: &[u8] = b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello\
POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n0\r\nX-T: 1\r\n\r\n\
GET /c HTTP/1.1\r\nHost: x\r\n\r\n";

    /// The protocol is told by the first bytes, read only as far as needed (one byte for
    /// HTTP/1, the whole preface for HTTP/2, in any pieces) and kept for hyper.
    #[tokio::test]
    async fn the_first_bytes_tell_the_protocol_and_stay_for_hyper() {
        let mut h2 = H2_PREFACE.to_vec();
        h2.extend_from_slice(b"\0\0\0\x04\0\0\0\0\0");
        let cases: [(&[u8], Protocol); 4] = [
            (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", Protocol::Http1),
            (b"PRI / HTTP/1.1\r\nHost: x\r\n\r\n", Protocol::Http1),
            (&h2, Protocol::Http2),
            (b"", Protocol::Http1),
        ];
        for (input, expected) in cases {
            for piece in [1, 5, 64] {
                let (mut client, server) = tokio::io::duplex(1 << 16);
                let sent = input.to_vec();
                let writer = tokio::spawn(async move {
                    for chunk in sent.chunks(piece) {
                        client.write_all(chunk).await.unwrap();
                        tokio::task::yield_now().await;
                    }
                    client.shutdown().await.unwrap();
                });
                let mut guard = FramingGuard::new(server, LIMITS, ConnectionState::new(), Fixed);
                assert_eq!(
                    guard.protocol().await.unwrap(),
                    expected,
                    "{input:?} in pieces of {piece}"
                );
                let mut seen = Vec::new();
                guard.read_to_end(&mut seen).await.unwrap();
                writer.await.unwrap();
                assert_eq!(seen, input, "in pieces of {piece}");
            }
        }
    }

    /// Between requests, waiting for the next, the guard holds no room beyond what the
    /// last head took (it used to reserve 8 KB for every read); part of a head is held.
    #[tokio::test]
    async fn an_idle_guard_holds_no_spare_room() {
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let mut guard = FramingGuard::new(server, LIMITS, ConnectionState::new(), Fixed);
        let request = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n";
        client.write_all(request).await.unwrap();
        let mut seen = vec![0; request.len()];
        guard.read_exact(&mut seen).await.unwrap();
        assert_eq!(seen, request);
        let mut more = [0; 64];
        let waiting = futures_util::poll!(std::pin::pin!(guard.read(&mut more)));
        assert!(waiting.is_pending());
        assert!(guard.buf.is_empty());
        assert!(
            guard.buf.capacity() < request.len(),
            "{} bytes of room held",
            guard.buf.capacity()
        );

        client.write_all(b"GET /b HTTP/1.1\r\n").await.unwrap();
        let waiting = futures_util::poll!(std::pin::pin!(guard.read(&mut more)));
        assert!(waiting.is_pending(), "half a head is held back");
        assert_eq!(&guard.buf[..], b"GET /b HTTP/1.1\r\n");
    }

    #[tokio::test]
    async fn well_framed_requests_pass_unchanged_in_any_pieces() {
        for piece in [1, 3, 7, 64, 4096] {
            assert_eq!(
                through_guard(PIPELINE, piece).await,
                PIPELINE,
                "piece size {piece}"
            );
        }
    }

    #[tokio::test]
    async fn content_length_with_transfer_encoding_is_broken_in_either_order() {
        for head in [
            &b"POST / HTTP/1.1\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"[..],
            &b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n"[..],
        ] {
            refused_at(head, 5, 0, HeadRefusal::Ambiguous).await;
        }
    }

    /// Heads hyper's parser refuses, or whose framing it does, are refused by the guard,
    /// which answers them; the plain request line is read without the parser.
    #[tokio::test]
    async fn heads_hyper_refuses_are_answered_by_the_guard() {
        let clean = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n";
        for (bad, refusal) in [
            (
                &b"GET /a b HTTP/1.1\r\nHost: x\r\n\r\n"[..],
                HeadRefusal::Malformed,
            ),
            (b"GET  /a HTTP/1.1\r\nHost: x\r\n\r\n", HeadRefusal::Malformed),
            (b"GET /a HTTP/1.1 \r\nHost: x\r\n\r\n", HeadRefusal::Malformed),
            (b"GET /a HTTP/2.1\r\nHost: x\r\n\r\n", HeadRefusal::Malformed),
            (
                b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
                HeadRefusal::Malformed,
            ),
            (b"GET /a HTTP/1.1\r\nBad Name: x\r\n\r\n", HeadRefusal::Malformed),
            (
                b"POST /a HTTP/1.1\r\nContent-Length: 1x\r\n\r\n",
                HeadRefusal::Malformed,
            ),
            (
                b"POST /a HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                HeadRefusal::Ambiguous,
            ),
            (
                b"POST /a HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
                HeadRefusal::Malformed,
            ),
        ] {
            let mut input = clean.to_vec();
            input.extend_from_slice(bad);
            for piece in [1, 4096] {
                refused_at(&input, piece, clean.len(), refusal).await;
            }
        }
        for plain in [
            &b"GET /a?b=c%20d HTTP/1.0\r\n\r\n"[..],
            b"get /a HTTP/1.1\r\n\r\n",
            b"OPTIONS * HTTP/1.1\n\n",
            b"GET http://x/a HTTP/1.1\r\nHost: x\r\n\r\n",
        ] {
            assert_eq!(through_guard(plain, 3).await, plain, "{plain:?}");
        }
    }

    /// A head the parser refuses before it ends is refused at once, not once it ends or the
    /// client gives up: a TLS handshake sent to the plain port, a broken request line.
    #[tokio::test]
    async fn heads_refused_before_they_end_are_answered_at_once() {
        for start in [
            &b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"[..],
            b"GET /a b HTTP/1.1\r\nHost: x\r\n",
        ] {
            let (client, server) = tokio::io::duplex(1 << 16);
            let (mut answers, mut client) = tokio::io::split(client);
            let mut guard = FramingGuard::new(server, LIMITS, ConnectionState::new(), Fixed);
            client.write_all(start).await.unwrap();
            let mut buf = [0; 64];
            let read = tokio::time::timeout(std::time::Duration::from_secs(5), guard.read(&mut buf)).await;
            assert_eq!(read.expect("answered at once").unwrap(), 0, "{start:?}");
            drop(guard);
            let mut answered = Vec::new();
            answers.read_to_end(&mut answered).await.unwrap();
            assert_eq!(answered, b"Malformed", "{start:?}");
        }
    }

    /// A head longer than hyper's buffer, or with more fields than it takes, is refused
    /// as too large (431).
    #[tokio::test]
    async fn heads_over_the_limits_are_refused_as_too_large() {
        let mut endless = b"GET / HTTP/1.1\r\nX-Big: ".to_vec();
        endless.resize(LIMITS.bytes + 10, b'a');
        refused_at(&endless, 4096, 0, HeadRefusal::TooLarge).await;
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for _ in 0..=LIMITS.fields {
            many.extend_from_slice(b"a:\r\n");
        }
        many.extend_from_slice(b"\r\n");
        refused_at(&many, 4096, 0, HeadRefusal::TooLarge).await;
        // Within the limit as sent, past it folded (each length written takes a byte more
        // than `: ` and CR).
        let mut folds_large = b"GET / HTTP/1.1\n".to_vec();
        while folds_large.len() < LIMITS.bytes - 200 {
            folds_large.extend_from_slice(b"a:");
            folds_large.extend_from_slice(&[b'v'; 100]);
            folds_large.push(b'\n');
        }
        folds_large.push(b'\n');
        assert!(folds_large.len() <= LIMITS.bytes);
        refused_at(&folds_large, 4096, 0, HeadRefusal::TooLarge).await;
        // Fields that hyper acts on stay in view beside the folded one: at most 99.
        let mut connections = b"GET / HTTP/1.1\r\n".to_vec();
        for _ in 0..=HYPER_FIELDS {
            connections.extend_from_slice(b"Connection: x\r\n");
        }
        connections.extend_from_slice(b"\r\n");
        refused_at(&connections, 4096, 0, HeadRefusal::TooLarge).await;
    }

    /// A refused head is answered only once the responses before it have gone out: while
    /// a request is in flight, or hyper's writes are not flushed, hyper's read waits, and
    /// the flush after the last response wakes it to the answer and the end of the stream.
    #[tokio::test]
    async fn a_refusal_waits_for_the_responses_before_it() {
        let (client, server) = tokio::io::duplex(1 << 16);
        let (mut answers, mut client) = tokio::io::split(client);
        let connection = ConnectionState::new();
        let mut guard = FramingGuard::new(server, LIMITS, connection.clone(), Fixed);
        let clean = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n";
        client.write_all(clean).await.unwrap();
        client.write_all(b"GET /a b HTTP/1.1\r\n\r\n").await.unwrap();
        let mut head = vec![0; clean.len()];
        guard.read_exact(&mut head).await.unwrap();
        let in_flight = connection.begin();
        let mut more = [0; 64];
        assert!(futures_util::poll!(std::pin::pin!(guard.read(&mut more))).is_pending());
        guard.write_all(b"response").await.unwrap();
        drop(in_flight);
        struct Flag(std::sync::atomic::AtomicBool);
        impl std::task::Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let woken = Arc::new(Flag(false.into()));
        let waker = Waker::from(woken.clone());
        let mut buf = [0; 64];
        let read =
            Pin::new(&mut guard).poll_read(&mut Context::from_waker(&waker), &mut ReadBuf::new(&mut buf));
        assert!(read.is_pending(), "written, not flushed");
        guard.flush().await.unwrap();
        assert!(
            woken.0.load(std::sync::atomic::Ordering::SeqCst),
            "the flush wakes the read"
        );
        assert_eq!(guard.read(&mut more).await.unwrap(), 0);
        drop(guard);
        let mut answered = Vec::new();
        answers.read_to_end(&mut answered).await.unwrap();
        assert_eq!(answered, b"responseMalformed");
    }

    #[tokio::test]
    async fn smuggled_request_after_a_clean_one_is_found() {
        let mut input = b"POST /a HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc".to_vec();
        let second = b"POST /b HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n";
        input.extend_from_slice(second);
        refused_at(&input, 11, input.len() - second.len(), HeadRefusal::Ambiguous).await;
    }

    /// hyper ends a trailer line only at CR LF, and the trailers at an empty one: a bare LF
    /// at the start of the trailers is a trailer's first byte, not their end, and the
    /// lines after it are trailers, not a head whose body would hide the next one.
    #[tokio::test]
    async fn trailers_end_where_hyper_ends_them() {
        let mut input = b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\
            \nGET /pad HTTP/1.1\r\nContent-Length: 64\r\n\r\n"
            .to_vec();
        let at = input.len();
        input.extend_from_slice(SMUGGLED);
        for piece in [1, 7, 4096] {
            refused_at(&input, piece, at, HeadRefusal::Ambiguous).await;
        }
    }

    /// A chunk-size line longer than the guard follows is refused (hyper is made to fail
    /// on it) rather than let through uninspected with what follows on the connection.
    #[tokio::test]
    async fn a_chunk_line_too_long_to_follow_breaks_the_stream() {
        let head = b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
        let mut input = head.to_vec();
        input.extend_from_slice(format!("3;x={}\r\nabc\r\n0\r\n\r\n", "a".repeat(MAX_LINE)).as_bytes());
        input.extend_from_slice(SMUGGLED);
        let seen = through_guard(&input, 4096).await;
        assert_eq!(seen[head.len()], b'@');
        assert_eq!(seen[head.len() + 1..], input[head.len() + 1..]);
    }

    /// What hyper refuses in a chunked body, the guard breaks too: it never goes on past
    /// bytes hyper would read otherwise than it does.
    #[tokio::test]
    async fn chunk_lines_hyper_refuses_are_broken() {
        let head = b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
        for (body, at) in [
            (&b"3\nabc\r\n0\r\n\r\n"[..], 0),
            (b"3 4\r\nabc\r\n0\r\n\r\n", 0),
            (b"3;a\nb\r\nabc\r\n0\r\n\r\n", 0),
            (b"3\r\nabc\n0\r\n\r\n", 6),
            (b"3\r\nabc\r\n0\r\nX-T: 1\rX\r\n\r\n", 12),
        ] {
            let mut input = head.to_vec();
            input.extend_from_slice(body);
            input.extend_from_slice(SMUGGLED);
            let seen = through_guard(&input, 4096).await;
            assert_eq!(seen[head.len() + at], b'@', "{}", String::from_utf8_lossy(body));
        }
    }

    /// A length given twice is refused, even when hyper reads both as one number (`03`
    /// and `3`, `3` and `3`), which it would take as one length.
    #[tokio::test]
    async fn lengths_given_twice_are_refused_even_alike() {
        for twice in [
            &b"POST /a HTTP/1.1\r\nContent-Length: 03\r\nContent-Length: 3\r\n\r\nabc"[..],
            b"POST /a HTTP/1.1\r\nContent-Length: 3\r\ncontent-length: 3\r\n\r\nabc",
        ] {
            let mut input = b"GET / HTTP/1.1\r\n\r\n".to_vec();
            let at = input.len();
            input.extend_from_slice(twice);
            refused_at(&input, 4096, at, HeadRefusal::Ambiguous).await;
        }
    }

    #[tokio::test]
    async fn body_bytes_that_look_like_heads_are_left_alone() {
        let body = b"GET / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
        let mut input = format!("POST / HTTP/1.1\r\nContent-Length: {}\r\n\r\n", body.len()).into_bytes();
        input.extend_from_slice(body);
        assert_eq!(through_guard(&input, 9).await, input);
    }

    const SMUGGLED: &[u8] = b"POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n";

    #[tokio::test]
    async fn heads_after_a_declined_upgrade_or_connect_are_still_inspected() {
        for first in [
            &b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nUpgrade: h2c\r\nConnection: upgrade, http2-settings\r\n\r\n",
            b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
        ] {
            let mut input = first.to_vec();
            input.extend_from_slice(SMUGGLED);
            refused_at(&input, 13, first.len(), HeadRefusal::Ambiguous).await;
        }
    }

    /// A head of `fields` fields, `Transfer-Encoding: chunked` the one at `chunked_at`.
    fn many_fields(fields: usize, chunked_at: Option<usize>) -> Vec<u8> {
        let mut head = b"POST /many HTTP/1.1\r\n".to_vec();
        for i in 0..fields {
            match chunked_at == Some(i) {
                true => head.extend_from_slice(b"Transfer-Encoding: chunked\r\n"),
                false => head.extend_from_slice(format!("x-{i}: v\r\n").as_bytes()),
            }
        }
        head.extend_from_slice(b"\r\n");
        head
    }

    #[tokio::test]
    async fn many_fields_are_folded_and_do_not_turn_it_transparent() {
        let first = many_fields(1000, None);
        let folded = fold::fold(&first, LIMITS.fields).unwrap();
        let input = [&first[..], SMUGGLED].concat();
        let (seen, answered) = through_guard_answering(&input, 4096).await;
        assert_eq!(seen, folded);
        assert_eq!(answered, b"Ambiguous");
    }

    /// A folded head's body is followed by its framing, wherever the field that gives it
    /// stood, and the heads after it are read where they start.
    #[tokio::test]
    async fn a_folded_heads_body_and_the_heads_after_it_are_followed() {
        let first = many_fields(150, Some(140));
        let folded = fold::fold(&first, LIMITS.fields).unwrap();
        let body = b"5\r\nhello\r\n0\r\n\r\n";
        let input = [&first[..], body, PIPELINE].concat();
        for piece in [1, 7, 4096] {
            let seen = through_guard(&input, piece).await;
            assert_eq!(seen, [&folded[..], body, PIPELINE].concat(), "pieces of {piece}");
        }
        // Nor are the bytes of a body that look like a head of many fields one; the head
        // after the body is folded too.
        let second = many_fields(120, None);
        let body = [
            format!("{:x}\r\n", second.len()).as_bytes(),
            &second,
            b"\r\n0\r\n\r\n",
        ]
        .concat();
        let input = [&first[..], &body, &second].concat();
        let seen = through_guard(&input, 4096).await;
        let second_folded = fold::fold(&second, LIMITS.fields).unwrap();
        assert_eq!(seen, [&folded[..], &body, &second_folded].concat());
    }

    #[tokio::test]
    async fn a_started_tunnel_and_h2_turn_it_transparent() {
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let connection = ConnectionState::new();
        let mut guard = FramingGuard::new(server, LIMITS, connection.clone(), Fixed);
        let upgrade = b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n";
        client.write_all(upgrade).await.unwrap();
        let mut head = vec![0; upgrade.len()];
        guard.read_exact(&mut head).await.unwrap();
        let upgrading = connection.begin();
        // Tunnel bytes (a WebSocket frame), which cannot start a head, held while the
        // upgrade is in flight, until the tunnel is known to have started.
        let frame = b"\x82\x03abc";
        client.write_all(frame).await.unwrap();
        let mut buf = [0u8; 64];
        let held = tokio::time::timeout(std::time::Duration::from_millis(50), guard.read(&mut buf)).await;
        assert!(held.is_err(), "a head is inspected before it passes");
        upgrading.start_tunnel(Box::pin(async {}));
        client.shutdown().await.unwrap();
        let mut tunnelled = Vec::new();
        guard.read_to_end(&mut tunnelled).await.unwrap();
        assert_eq!(tunnelled, frame, "passed untouched");

        let mut h2 = H2_PREFACE.to_vec();
        h2.extend_from_slice(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00");
        assert_eq!(through_guard(&h2, 5).await, h2);
    }

    /// One of `choices`, or a few random bytes.
    fn one_of(choices: &[&'static [u8]]) -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        prop_oneof![
            proptest::sample::select(choices.to_vec()).prop_map(<[u8]>::to_vec),
            proptest::collection::vec(any::<u8>(), 0..6),
        ]
    }

    /// Field lines as clients write them, and as attackers bend them: names in any case,
    /// spacing around values, repeated and conflicting framing fields, odd bytes.
    fn field_line() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let name = one_of(&[
            b"Content-Length",
            b"content-LENGTH",
            b"Transfer-Encoding",
            b"transfer-encoding",
            b"Host",
            b"Content-Length ",
            b" Transfer-Encoding",
            b"X-A_b.c",
        ]);
        let value = one_of(&[
            b"5",
            b" 5 ",
            b"\t05",
            b"+5",
            b"chunked",
            b"gzip, chunked ",
            b"chunked, gzip",
        ]);
        let end = prop_oneof![Just(b"\r\n".to_vec()), Just(b"\n".to_vec())];
        (
            name,
            prop_oneof![Just(b": ".to_vec()), Just(b":".to_vec())],
            value,
            end,
        )
            .prop_map(|(name, colon, value, end)| [name, colon, value, end].concat())
    }

    proptest::proptest! {
        /// Wherever httparse (hyper's parser) accepts a head, reading it line by line finds
        /// the same framing, or leaves the head to the parser.
        #[test]
        fn the_line_scan_agrees_with_the_parser(
            lines in proptest::collection::vec(field_line(), 0..6),
            end in proptest::prop_oneof![proptest::strategy::Just(&b"\r\n"[..]), proptest::strategy::Just(&b"\n"[..])],
        ) {
            let head = [&b"POST / HTTP/1.1\r\n"[..], &lines.concat(), end].concat();
            let mut fields = [httparse::EMPTY_HEADER; 16];
            let accepted = matches!(
                httparse::Request::new(&mut fields).parse(&head),
                Ok(httparse::Status::Complete(_))
            );
            if accepted && let Scanned::Complete(len, verdict) = scan_head(&head, 100) {
                proptest::prop_assert_eq!(Some(len), head_end(&head));
                proptest::prop_assert_eq!(verdict, parse_framing(&head, 100).0);
            }
        }
    }

    /// Whether hyper's server takes `head` (what its `Server::parse` does before the
    /// framing headers): httparse, then the method and the target as `http` types.
    fn hyper_takes(head: &[u8]) -> Option<bool> {
        let mut fields = [httparse::EMPTY_HEADER; 16];
        let mut request = httparse::Request::new(&mut fields);
        match request.parse(head) {
            Ok(httparse::Status::Complete(_)) => {}
            Ok(httparse::Status::Partial) | Err(httparse::Error::TooManyHeaders) => return None,
            Err(_) => return Some(false),
        }
        let method = http::Method::from_bytes(request.method?.as_bytes());
        let target = http::Uri::from_maybe_shared(bytes::Bytes::copy_from_slice(request.path?.as_bytes()));
        Some(method.is_ok() && target.is_ok())
    }

    proptest::proptest! {
        /// The guard refuses exactly the complete heads hyper would refuse for their
        /// request line: read without the parser where plain, by it where not. (A control
        /// byte inside a field value is left to hyper: looking for one would cost every
        /// request a pass over its fields.)
        #[test]
        fn the_guard_refuses_what_hyper_refuses(
            method in one_of(&[b"GET", b"POST", b"G(T", b"", b"M\x7fX"]),
            target in one_of(&[
                b"/", b"/a?b=c", b"/<x>", b"/q?\"x\"", b"/{\"a\"}|b", b"/a`b", b"/a#f",
                b"/caf\xc3\xa9", b"/\xff", b"http://h/x", b"*", b"/a\\b^c",
            ]),
            value in proptest::sample::select(vec![&b"x"[..], b"a\tb", b"a b", b"\xc3\xa9"]),
            crlf in proptest::bool::ANY,
        ) {
            let end: &[u8] = if crlf { b"\r\n" } else { b"\n" };
            let head = [
                &method[..], b" ", &target, b" HTTP/1.1", end, b"Host: h", end, b"X-A: ", value, end, end,
            ]
            .concat();
            let Some(takes) = hyper_takes(&head) else {
                return Ok(());
            };
            let verdict = match scan_head(&head, 100) {
                Scanned::Complete(len, verdict) => {
                    proptest::prop_assert_eq!(Some(len), head_end(&head));
                    verdict
                }
                Scanned::Unusual => parse_framing(&head, 100).0,
                Scanned::Incomplete => return Ok(()),
            };
            proptest::prop_assert_eq!(
                verdict == HeadVerdict::Refuse(HeadRefusal::Malformed),
                !takes,
                "{:?}",
                String::from_utf8_lossy(&head)
            );
        }
    }

    #[test]
    fn plain_heads_are_read_line_by_line() {
        let head = b"POST / HTTP/1.1\r\nHost: x\r\ncontent-length:  12 \r\n\r\nbody";
        assert_eq!(
            scan_head(head, 100),
            Scanned::Complete(head.len() - 4, HeadVerdict::Framing(State::Body(12)))
        );
        let both = b"POST / HTTP/1.1\nTransfer-Encoding: chunked\nContent-Length: 3\n\n";
        assert_eq!(
            scan_head(both, 100),
            Scanned::Complete(both.len(), HeadVerdict::Refuse(HeadRefusal::Ambiguous))
        );
        let folded = b"POST / HTTP/1.1\r\nX: a\r\n b\r\n\r\n";
        assert_eq!(scan_head(folded, 100), Scanned::Unusual, "left to the parser");
        let many = b"GET / HTTP/1.1\r\na: 1\r\nb: 2\r\n\r\n";
        assert_eq!(scan_head(many, 1), Scanned::Unusual, "left to the parser");
        for partial in [
            &b"GET / HTTP/1.1"[..],
            b"GET / HTTP/1.1\r\n",
            b"GET / HTTP/1.1\r\nHo",
            b"GET / HTTP/1.1\r\nHost: x",
            b"GET / HTTP/1.1\r\nHost: x\r\n\r",
        ] {
            assert_eq!(
                scan_head(partial, 100),
                Scanned::Incomplete,
                "{:?}",
                String::from_utf8_lossy(partial)
            );
        }
        for odd in [
            &b"GET / HTTP/1.1\r\n: x\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
            b"GET / HTTP/1.1\r\nno colon\r\n",
        ] {
            assert_eq!(
                scan_head(odd, 100),
                Scanned::Unusual,
                "{:?}",
                String::from_utf8_lossy(odd)
            );
        }
    }
}
