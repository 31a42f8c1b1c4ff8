//! The HTTP/1.1 messages an upstream exchange writes and reads: the request head with its
//! body's framing, the response head with its body's framing (RFC 9112 section 6.3), and
//! chunked bodies both ways.
//!
//! A response head is parsed by `httparse` where it was read, its header values shared with
//! that buffer; what the head says of the connection (kept alive or not) and of the body
//! (a length, chunks, until the close, none) is settled here once.

use std::mem::MaybeUninit;
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, HeaderName, HeaderValue, TRANSFER_ENCODING};
use http::{HeaderMap, Method, StatusCode, Version};
use smallvec::SmallVec;

use crate::config::CombinedRules;
use crate::proxy::headers::named_by_connection;
use crate::trace::TRACEPARENT;
use crate::trace::context::{self, SpanId, TraceId};
use crate::upstream::names::{Role, response_header};

/// The largest response head read: beyond it the response is malformed.
pub(super) const MAX_HEAD: usize = 64 * 1024;
/// The most header lines a response head may have.
const MAX_HEADERS: usize = 128;
/// Room for the headers floodgate adds to a response after its head is read (`Via`, the
/// request ID, a limit's), so that the map is not grown on the way.
const ADDED_LATER: usize = 6;
/// The longest chunk-size line (with its extensions) or trailer section read.
const MAX_CHUNK_LINE: usize = 4 * 1024;
const MAX_TRAILERS: usize = 16 * 1024;

/// Why a response could not be read as HTTP/1.1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the upstream's response is malformed: {0}")]
pub(crate) struct Malformed(pub(crate) &'static str);

/// How a request body goes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RequestFraming {
    /// As many bytes as the request's `Content-Length` (none: no body).
    Length(u64),
    Chunked,
}

/// A request head as each try sends it, written once by the request path: the request
/// line and the header lines, `traceparent` among them (naming the first try's span; a
/// later try's is written into a copy), less the framing header and the empty line,
/// which depend on the body and are always floodgate's (a client's `Content-Length` is
/// read, not copied).
#[derive(Debug)]
pub(crate) struct HttpHead {
    lines: Bytes,
    /// Where the `traceparent` value starts in `lines` and the span it names, if it has one.
    traceparent: Option<(usize, SpanId)>,
    /// The `Content-Length` among the headers, which frames the body.
    declared: Option<u64>,
    head_request: bool,
    /// Whether the head says `Connection: close`: its connection is not used again.
    closes: bool,
    /// The route's response rules with the server's, applied as the response head is read.
    response_rules: Option<Arc<CombinedRules>>,
}

/// Room for the longest end of a head: `content-length: ` and 20 digits, then the line
/// ends of the header and of the head.
const FRAMING_ROOM: usize = 40;

impl HttpHead {
    /// A head that starts `method target HTTP/1.1`, the target written from the pieces
    /// it is made of (each valid in a request target).
    pub(crate) fn writer(method: &Method, target: &[&str], header_count: usize) -> HeadWriter {
        let target_len: usize = target.iter().map(|piece| piece.len()).sum();
        let mut lines = BytesMut::with_capacity(64 + target_len + header_count * 48);
        lines.put_slice(method.as_str().as_bytes());
        lines.put_u8(b' ');
        for piece in target {
            lines.put_slice(piece.as_bytes());
        }
        lines.put_slice(b" HTTP/1.1\r\n");
        HeadWriter {
            lines,
            traceparent: None,
            declared: None,
            head_request: method == Method::HEAD,
            closes: false,
        }
    }

    pub(super) fn is_head_request(&self) -> bool {
        self.head_request
    }

    /// The rules its response is read through.
    pub(super) fn response_rules(&self) -> Option<&Arc<CombinedRules>> {
        self.response_rules.as_ref()
    }

    /// Whether the head asks the server to close the connection after its answer.
    pub(super) fn closes(&self) -> bool {
        self.closes
    }

    /// The span the head's `traceparent` names: the first try's, whose head then goes
    /// without a copy.
    pub(crate) fn span(&self) -> Option<SpanId> {
        self.traceparent.map(|(_, span)| span)
    }

    /// The head for a try whose span is `span`, as its lines and their end: the framing
    /// its body needs (the declared `Content-Length`, else the body's exact size,
    /// `Some(0)` meaning no body, else chunks) and the empty line. The lines are shared
    /// when they name `span` already, and copied to name it otherwise.
    pub(super) fn for_try(&self, span: &SpanId, body_length: Option<u64>) -> ([Bytes; 2], RequestFraming) {
        let lines = match self.traceparent {
            Some((at, named)) if named != *span => {
                let mut lines = BytesMut::from(&self.lines[..]);
                if let Some(parent) =
                    lines.get_mut(at + context::PARENT_ID.start..at + context::PARENT_ID.end)
                {
                    context::write_span_id(span, parent);
                }
                lines.freeze()
            }
            _ => self.lines.clone(),
        };
        let (end, framing) = match self.declared.or(body_length) {
            // A body the client framed with a length of 0 says so; none at all, nothing.
            Some(0) if self.declared.is_none() => (Bytes::from_static(b"\r\n"), RequestFraming::Length(0)),
            Some(0) => (
                Bytes::from_static(b"content-length: 0\r\n\r\n"),
                RequestFraming::Length(0),
            ),
            Some(length) => {
                let mut end = BytesMut::with_capacity(FRAMING_ROOM);
                end.put_slice(b"content-length: ");
                end.put_slice(itoa::Buffer::new().format(length).as_bytes());
                end.put_slice(b"\r\n\r\n");
                (end.freeze(), RequestFraming::Length(length))
            }
            None => (
                Bytes::from_static(b"transfer-encoding: chunked\r\n\r\n"),
                RequestFraming::Chunked,
            ),
        };
        ([lines, end], framing)
    }
}

/// An [`HttpHead`] being written, header by header.
pub(crate) struct HeadWriter {
    lines: BytesMut,
    traceparent: Option<(usize, SpanId)>,
    declared: Option<u64>,
    head_request: bool,
    closes: bool,
}

impl HeadWriter {
    /// Writes the header `name: value`; `Content-Length` and `Transfer-Encoding` are
    /// left to the framing, and a `traceparent` to [`traceparent`](Self::traceparent).
    #[inline]
    pub(crate) fn header(&mut self, name: &HeaderName, value: &HeaderValue) {
        if name == CONTENT_LENGTH {
            self.declared = parse_length_list(value.as_bytes()).ok().flatten();
            return;
        }
        if name == TRANSFER_ENCODING || name == TRACEPARENT {
            return;
        }
        if name == CONNECTION && has_token(value.as_bytes(), b"close") {
            self.closes = true;
        }
        self.line(name.as_str().as_bytes(), value.as_bytes());
    }

    /// Writes the `traceparent` header of `trace` with `flags`, naming `span` (the first
    /// try's) as the parent; a later try's copy names its own.
    pub(crate) fn traceparent(&mut self, trace: &TraceId, span: SpanId, flags: u8) {
        self.traceparent = Some((self.lines.len() + b"traceparent: ".len(), span));
        self.line(b"traceparent", &context::traceparent(trace, &span, flags));
    }

    fn line(&mut self, name: &[u8], value: &[u8]) {
        let lines = &mut self.lines;
        lines.reserve(name.len() + value.len() + 4);
        lines.put_slice(name);
        lines.put_slice(b": ");
        lines.put_slice(value);
        lines.put_slice(b"\r\n");
    }

    /// The head, its response to be read through `response_rules`.
    pub(crate) fn finish(self, response_rules: Option<Arc<CombinedRules>>) -> HttpHead {
        HttpHead {
            lines: self.lines.freeze(),
            traceparent: self.traceparent,
            declared: self.declared,
            head_request: self.head_request,
            closes: self.closes,
            response_rules,
        }
    }
}

/// Writes `data` as one chunk.
pub(super) fn write_chunk(data: &[u8], out: &mut BytesMut) {
    out.reserve(data.len() + 20);
    let mut digits = [0u8; 16];
    let mut at = digits.len();
    let mut size = data.len();
    loop {
        at -= 1;
        digits[at] = b"0123456789abcdef"[size & 15];
        size >>= 4;
        if size == 0 {
            break;
        }
    }
    out.put_slice(&digits[at..]);
    out.put_slice(b"\r\n");
    out.put_slice(data);
    out.put_slice(b"\r\n");
}

/// The end of a chunked body.
pub(super) const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// How a response body arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ResponseFraming {
    /// This many bytes (`0`: no body).
    Length(u64),
    Chunked,
    /// Everything until the upstream closes the connection.
    UntilClose,
    /// A protocol switch (`101`): what follows belongs to the tunnel.
    Switched,
}

/// A response head, read.
pub(super) struct ResponseHead {
    pub(super) status: StatusCode,
    pub(super) headers: HeaderMap,
    pub(super) framing: ResponseFraming,
    /// Whether the connection can carry another request once this response has been read.
    pub(super) keep_alive: bool,
}

/// Parses the response head at the start of `read` (to a `HEAD` request when `to_head`), taking it
/// out of the buffer: `None` while it is incomplete. Interim responses (`100 Continue`,
/// `103 Early Hints`) are skipped. `rules` are applied as the headers are read: a header
/// they name is left out, and what they set is added.
pub(super) fn read_response_head(
    read: &mut BytesMut,
    to_head: bool,
    rules: Option<&CombinedRules>,
) -> Result<Option<ResponseHead>, Malformed> {
    loop {
        let mut lines = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut []);
        let length = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut response,
            read,
            &mut lines,
        ) {
            Ok(httparse::Status::Complete(length)) => length,
            Ok(httparse::Status::Partial) if read.len() > MAX_HEAD => {
                return Err(Malformed("a head larger than 64 KB"));
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders) => return Err(Malformed("more than 128 header lines")),
            Err(_) => return Err(Malformed("not an HTTP/1.x response head")),
        };
        if length > MAX_HEAD {
            return Err(Malformed("a head larger than 64 KB"));
        }
        let code = response.code.unwrap_or_default();
        let status = StatusCode::from_u16(code).map_err(|_| Malformed("a status outside 100-999"))?;
        if status.is_informational() && code != 101 {
            read.advance(length);
            continue;
        }
        let version = match response.version {
            Some(0) => Version::HTTP_10,
            _ => Version::HTTP_11,
        };
        let count = response.headers.len();
        // The names and values' places, to take the values out of the buffer as shared
        // slices once the head is split off.
        let start = read.as_ptr() as usize;
        // On the stack for the usual head (a server sends a handful of headers).
        let places: SmallVec<[(u32, u32, u32, u32); 16]> = response
            .headers
            .iter()
            .map(|line| {
                // Within the head, at most 64 KB.
                let name_at = (line.name.as_ptr() as usize - start) as u32;
                let value_at = (line.value.as_ptr() as usize - start) as u32;
                (
                    name_at,
                    name_at + line.name.len() as u32,
                    value_at,
                    value_at + line.value.len() as u32,
                )
            })
            .collect();
        let head = read.split_to(length).freeze();
        let set = rules.map_or(&[][..], CombinedRules::set);
        let mut headers = HeaderMap::with_capacity(count + set.len() + ADDED_LATER);
        let mut keep_alive = version == Version::HTTP_11;
        let mut close = false;
        // The last `Transfer-Encoding` line, whose last coding frames the body, and the
        // length the `Content-Length` lines agree on.
        let mut codings = None;
        let mut length = Ok(None);
        // The `Content-Length` lines: how many, and the first as it was sent.
        let mut length_lines = 0;
        let mut sent_length = None;
        // What `Connection` names besides the hop-by-hop headers (rarely anything).
        let mut named = Vec::new();
        // Hop-by-hop headers go no further than this connection, but for a protocol
        // switch, whose `Upgrade` and `Connection` the client's tunnel needs.
        let switched = code == 101;
        for &(name_at, name_end, value_at, value_end) in &places {
            let (name, role) = response_header(&head[name_at as usize..name_end as usize])
                .map_err(|_| Malformed("a header name that is not a token"))?;
            let value = parsed_value(head.slice(value_at as usize..value_end as usize));
            match role {
                Role::Connection => {
                    if has_token(value.as_bytes(), b"close") {
                        close = true;
                    } else if has_token(value.as_bytes(), b"keep-alive") {
                        keep_alive = true;
                    }
                    named_by_connection(&value, &mut named);
                }
                Role::TransferEncoding => codings = Some(value.clone()),
                Role::ContentLength => {
                    // An error matters only where the length frames the body (not for `HEAD`).
                    length = match (length, parse_length_list(value.as_bytes())) {
                        (Ok(Some(before)), Ok(Some(this))) if before != this => {
                            Err(Malformed("Content-Length values that differ"))
                        }
                        (Ok(before), Ok(this)) => Ok(this.or(before)),
                        (Err(error), _) | (_, Err(error)) => Err(error),
                    };
                    length_lines += 1;
                    sent_length.get_or_insert(value);
                    // Forwarded below, as one number.
                    continue;
                }
                Role::HopByHop | Role::EndToEnd => {}
            }
            if !switched && role.hop_by_hop() || rules.is_some_and(|rules| rules.names(&name)) {
                continue;
            }
            headers.append(name, value);
        }
        if !switched {
            for name in named {
                headers.remove(name);
            }
        }
        for (name, value) in set {
            headers.append(name.clone(), value.clone());
        }
        // The length goes on as the one number it is (RFC 9110 §8.6): a list of equal
        // values or a repeated line as that number, an invalid one (which only a response
        // without a body gets past the framing with) not at all. A response with both a
        // length and a transfer coding is read by the coding, its length dropped (RFC 9112
        // §6.3), and its connection is never trusted with another request.
        let ambiguous = codings.is_some() && length_lines > 0;
        if let (Ok(Some(number)), Some(sent), false) = (&length, sent_length, ambiguous) {
            let plain = length_lines == 1 && sent.as_bytes().iter().all(u8::is_ascii_digit);
            headers.append(
                CONTENT_LENGTH,
                if plain { sent } else { HeaderValue::from(*number) },
            );
        }
        let framing = response_framing(status, version, (codings.as_ref(), length), to_head)?;
        let reusable = !matches!(framing, ResponseFraming::UntilClose | ResponseFraming::Switched);
        let keep_alive = keep_alive && !close && reusable && !ambiguous;
        return Ok(Some(ResponseHead {
            status,
            headers,
            framing,
            keep_alive,
        }));
    }
}

/// A header value httparse accepted, as the slice of the head it is.
#[allow(unsafe_code)] // checking the bytes a second time cost about 35 instructions a header
fn parsed_value(bytes: Bytes) -> HeaderValue {
    // SAFETY: httparse, as `read_response_head` configures it (the default: no obsolete
    // line folding, whose values would keep their CR LF), accepts in a header value only
    // HTAB, SP, visible ASCII and obs-text (0x80-0xFF), which are the bytes a
    // `HeaderValue` may hold (`tests::every_value_read_is_a_valid_header_value`); debug
    // builds check each value.
    unsafe { HeaderValue::from_maybe_shared_unchecked(bytes) }
}

/// How the body of a response with `status`, the last `Transfer-Encoding` line `codings`
/// and the `Content-Length` `length` to a request (a `HEAD` one when `to_head`) is framed (RFC 9112 section
/// 6.3).
fn response_framing(
    status: StatusCode,
    version: Version,
    (codings, length): (Option<&HeaderValue>, Result<Option<u64>, Malformed>),
    to_head: bool,
) -> Result<ResponseFraming, Malformed> {
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Ok(ResponseFraming::Switched);
    }
    if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED || to_head {
        return Ok(ResponseFraming::Length(0));
    }
    if let Some(codings) = codings {
        if version == Version::HTTP_10 {
            return Err(Malformed("Transfer-Encoding in an HTTP/1.0 response"));
        }
        let last = codings
            .as_bytes()
            .rsplit(|&byte| byte == b',')
            .next()
            .unwrap_or_default();
        return Ok(match last.trim_ascii().eq_ignore_ascii_case(b"chunked") {
            true => ResponseFraming::Chunked,
            false => ResponseFraming::UntilClose,
        });
    }
    Ok(length?.map_or(ResponseFraming::UntilClose, ResponseFraming::Length))
}

/// A `Content-Length` value, which may repeat one length in a list (`7, 7`).
pub(super) fn parse_length_list(value: &[u8]) -> Result<Option<u64>, Malformed> {
    let mut length = None;
    for item in value.split(|&byte| byte == b',') {
        let item = parse_length(item.trim_ascii()).ok_or(Malformed("an invalid Content-Length"))?;
        if length.is_some_and(|length| length != item) {
            return Err(Malformed("Content-Length values that differ"));
        }
        length = Some(item);
    }
    Ok(length)
}

/// A `Content-Length` value: decimal digits only (leading zeros allowed, as hyper reads
/// them), no more than a `u64` holds.
fn parse_length(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u64, |length, &digit| {
        if !digit.is_ascii_digit() {
            return None;
        }
        length.checked_mul(10)?.checked_add(u64::from(digit - b'0'))
    })
}

/// Whether the comma-separated list `value` holds `token`, in any case.
fn has_token(value: &[u8], token: &[u8]) -> bool {
    value
        .split(|&byte| byte == b',')
        .any(|item| item.trim_ascii().eq_ignore_ascii_case(token))
}

/// Where a chunked response body is between reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Chunks {
    /// Before a chunk-size line.
    Size,
    /// Inside a chunk's data, this many bytes to go.
    Data(u64),
    /// After a chunk's data, before its CRLF.
    DataEnd,
    /// After the last chunk, in the trailer section (dropped), this many bytes of it read.
    Trailers(usize),
    Done,
}

/// What the chunked decoder found in the buffer.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Decoded {
    Data(Bytes),
    /// More must be read.
    Short,
    End,
}

impl Chunks {
    /// Decodes what `read` holds from where the body is: the next piece of data, the end,
    /// or [`Decoded::Short`] when more must be read first.
    pub(super) fn decode(&mut self, read: &mut BytesMut) -> Result<Decoded, Malformed> {
        loop {
            match *self {
                Chunks::Size => {
                    let Some(end) = memchr::memchr(b'\n', read) else {
                        return match read.len() > MAX_CHUNK_LINE {
                            true => Err(Malformed("a chunk-size line longer than 4 KB")),
                            false => Ok(Decoded::Short),
                        };
                    };
                    let line = read[..end]
                        .strip_suffix(b"\r")
                        .ok_or(Malformed("a chunk-size line without CRLF"))?;
                    let digits = line.split(|&byte| byte == b';').next().unwrap_or_default();
                    let digits = digits.trim_ascii_end();
                    if digits.is_empty() || digits.len() > 15 {
                        return Err(Malformed("an invalid chunk size"));
                    }
                    let mut size = 0u64;
                    for &digit in digits {
                        let value = (digit as char)
                            .to_digit(16)
                            .ok_or(Malformed("an invalid chunk size"))?;
                        size = size << 4 | u64::from(value);
                    }
                    read.advance(end + 1);
                    *self = match size {
                        0 => Chunks::Trailers(0),
                        size => Chunks::Data(size),
                    };
                }
                Chunks::Data(left) => {
                    if read.is_empty() {
                        return Ok(Decoded::Short);
                    }
                    let take = left.min(read.len() as u64);
                    *self = match left - take {
                        0 => Chunks::DataEnd,
                        left => Chunks::Data(left),
                    };
                    return Ok(Decoded::Data(read.split_to(take as usize).freeze()));
                }
                Chunks::DataEnd => {
                    if read.len() < 2 {
                        return Ok(Decoded::Short);
                    }
                    if &read[..2] != b"\r\n" {
                        return Err(Malformed("chunk data longer than its size"));
                    }
                    read.advance(2);
                    *self = Chunks::Size;
                }
                Chunks::Trailers(seen) => {
                    let Some(end) = memchr::memchr(b'\n', read) else {
                        return match seen + read.len() > MAX_TRAILERS {
                            true => Err(Malformed("a trailer section longer than 16 KB")),
                            false => Ok(Decoded::Short),
                        };
                    };
                    if seen + end > MAX_TRAILERS {
                        return Err(Malformed("a trailer section longer than 16 KB"));
                    }
                    let line = read[..end]
                        .strip_suffix(b"\r")
                        .ok_or(Malformed("a trailer line without CRLF"))?;
                    let last = line.is_empty();
                    read.advance(end + 1);
                    if last {
                        *self = Chunks::Done;
                        return Ok(Decoded::End);
                    }
                    *self = Chunks::Trailers(seen + end + 1);
                }
                Chunks::Done => return Ok(Decoded::End),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str, method: Method) -> Result<Option<ResponseHead>, Malformed> {
        read_response_head(&mut BytesMut::from(text), method == Method::HEAD, None)
    }

    fn framing(text: &str) -> ResponseFraming {
        head(text, Method::GET).unwrap().unwrap().framing
    }

    proptest::proptest! {
        /// What `parsed_value` relies on: a response head is read only with values that
        /// are valid header values (debug builds, which run this, also check each one as
        /// it is taken). Values long enough for httparse's 32-byte vector steps.
        #[test]
        fn every_value_read_is_a_valid_header_value(
            // Mostly bytes a value may hold, so that most heads parse, and any byte besides.
            value in proptest::collection::vec(
                proptest::prop_oneof![8 => 0x20u8..=0xff, 1 => proptest::num::u8::ANY],
                0..80,
            ),
        ) {
            let mut text = b"HTTP/1.1 200 OK\r\nX-Value: ".to_vec();
            text.extend_from_slice(&value);
            text.extend_from_slice(b"\r\nContent-Length: 0\r\n\r\n");
            if let Ok(Some(head)) = read_response_head(&mut BytesMut::from(&text[..]), false, None) {
                for value in head.headers.get_all("x-value") {
                    proptest::prop_assert!(HeaderValue::from_bytes(value.as_bytes()).is_ok(), "{:?}", value);
                }
            }
        }

        /// Rules applied as the head is read leave what applying the server's and then
        /// the route's to the map read without them would.
        #[test]
        fn rules_applied_as_read_leave_what_rewriting_the_map_would(
            lines in proptest::collection::vec((0usize..6, 0usize..3), 0..10),
            rules in proptest::collection::vec((0usize..4, 0usize..5, 0usize..3), 0..6),
        ) {
            use crate::config::HeaderRules;
            use crate::proxy::headers::apply_rules;
            // `connection` (naming `x-c`) and names rules may take.
            const NAMES: [&str; 6] = ["x-a", "x-b", "server", "x-c", "connection", "x-powered-by"];
            const VALUES: [&str; 3] = ["1", "two", "x-c"];
            let mut text = String::from("HTTP/1.1 200 OK\r\n");
            for (name, value) in lines {
                text.push_str(&format!("{}: {}\r\n", NAMES[name], VALUES[value]));
            }
            text.push_str("\r\n");
            let (mut server, mut route) = (HeaderRules::default(), HeaderRules::default());
            for (kind, name, value) in rules {
                let name = HeaderName::from_static(NAMES[if name == 4 { 5 } else { name }]);
                let target = if kind < 2 { &mut server } else { &mut route };
                // A name set twice in one table, as `X-A` and `x-a` can be.
                match kind % 2 {
                    0 => target.set.push((name, HeaderValue::from_static(VALUES[value]))),
                    _ => target.remove.push(name),
                }
            }
            let combined = CombinedRules::of(&server, &route);
            let read = |rules| {
                read_response_head(&mut BytesMut::from(text.as_str()), false, rules)
                    .unwrap()
                    .unwrap()
                    .headers
            };
            let mut rewritten = read(None);
            apply_rules(&server, &mut rewritten);
            apply_rules(&route, &mut rewritten);
            proptest::prop_assert_eq!(read(combined.as_ref()), rewritten);
        }
    }

    #[test]
    fn values_are_taken_as_sent_and_control_bytes_refuse_the_head() {
        let mut read = BytesMut::from(&b"HTTP/1.1 200 OK\r\nX-Value: a\tb \xe9t\xc3\xa9\r\n\r\n"[..]);
        let head = read_response_head(&mut read, false, None).unwrap().unwrap();
        assert_eq!(head.headers["x-value"].as_bytes(), b"a\tb \xe9t\xc3\xa9");
        for control in [0x01u8, 0x7f, b'\r'] {
            let mut text = b"HTTP/1.1 200 OK\r\nX-Value: a".to_vec();
            text.extend_from_slice(&[control, b'b']);
            text.extend_from_slice(b"\r\n\r\n");
            assert!(
                read_response_head(&mut BytesMut::from(&text[..]), false, None).is_err(),
                "{control:#x}"
            );
        }
    }

    #[test]
    fn a_response_head_is_read_with_its_framing_and_the_rest_left() {
        let mut read =
            BytesMut::from("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: 1\r\nX-A: 2\r\n\r\nokHTTP");
        let head = read_response_head(&mut read, false, None).unwrap().unwrap();
        assert_eq!(head.status, StatusCode::OK);
        assert_eq!(head.framing, ResponseFraming::Length(2));
        assert!(head.keep_alive);
        assert_eq!(head.headers.get_all("x-a").iter().count(), 2);
        assert_eq!(&read[..], b"okHTTP");
    }

    #[test]
    fn an_incomplete_head_waits_and_interim_responses_are_skipped() {
        assert!(
            head("HTTP/1.1 200 OK\r\nContent-Le", Method::GET)
                .unwrap()
                .is_none()
        );
        let mut read =
            BytesMut::from("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n");
        let head = read_response_head(&mut read, false, None).unwrap().unwrap();
        assert_eq!(head.status, StatusCode::CREATED);
        assert!(read.is_empty());
    }

    #[test]
    fn the_framing_follows_rfc_9112() {
        assert_eq!(framing("HTTP/1.1 200 OK\r\n\r\n"), ResponseFraming::UntilClose);
        assert_eq!(
            framing("HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n"),
            ResponseFraming::Length(0)
        );
        assert_eq!(
            framing("HTTP/1.1 304 Not Modified\r\n\r\n"),
            ResponseFraming::Length(0)
        );
        assert_eq!(
            framing("HTTP/1.1 101 Switching Protocols\r\n\r\n"),
            ResponseFraming::Switched
        );
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"),
            ResponseFraming::Chunked
        );
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n"),
            ResponseFraming::UntilClose
        );
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\nContent-Length: 7, 7\r\n\r\n"),
            ResponseFraming::Length(7)
        );
        let to_head = head("HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n", Method::HEAD);
        assert_eq!(to_head.unwrap().unwrap().framing, ResponseFraming::Length(0));
    }

    #[test]
    fn a_length_goes_on_as_the_one_number_it_is() {
        let forwarded = |text: &str, method: Method| -> Vec<String> {
            let head = head(text, method).unwrap().unwrap();
            head.headers
                .get_all(CONTENT_LENGTH)
                .iter()
                .map(|value| value.to_str().unwrap().to_owned())
                .collect()
        };
        let get = |text: &str| forwarded(text, Method::GET);
        assert_eq!(get("HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n"), ["7"]);
        assert_eq!(get("HTTP/1.1 200 OK\r\nContent-Length: 7, 7\r\n\r\n"), ["7"]);
        assert_eq!(
            get("HTTP/1.1 200 OK\r\nContent-Length: 7\r\nX-A: b\r\nContent-Length: 7\r\n\r\n"),
            ["7"]
        );
        assert_eq!(get("HTTP/1.1 200 OK\r\nContent-Length: 007\r\n\r\n"), ["007"]);
        assert_eq!(
            get("HTTP/1.1 304 Not Modified\r\nContent-Length: 5, 5\r\n\r\n"),
            ["5"]
        );
        // Framing nothing, an invalid one is dropped rather than passed on.
        for invalid in ["abc", "5, 6", ""] {
            let text = format!("HTTP/1.1 200 OK\r\nContent-Length: {invalid}\r\n\r\n");
            assert!(forwarded(&text, Method::HEAD).is_empty(), "{invalid:?}");
        }
        let chunked = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert!(get(chunked).is_empty());
    }

    #[test]
    fn lengths_that_could_split_a_response_are_refused() {
        for text in [
            "HTTP/1.1 200 OK\r\nContent-Length: 7\r\nContent-Length: 8\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: +7\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 0x7\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n",
            "HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            "HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n",
            "HTTP/1.1 2000 OK\r\n\r\n",
        ] {
            assert!(head(text, Method::GET).is_err(), "{text:?}");
        }
        let both = head(
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            Method::GET,
        );
        let both = both.unwrap().unwrap();
        assert_eq!(both.framing, ResponseFraming::Chunked);
        assert!(
            !both.keep_alive,
            "a response with both framings is not trusted with another request"
        );
    }

    #[test]
    fn keep_alive_follows_the_version_and_connection() {
        let alive = |text: &str| head(text, Method::GET).unwrap().unwrap().keep_alive;
        assert!(alive("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"));
        assert!(!alive(
            "HTTP/1.1 200 OK\r\nConnection: Close\r\nContent-Length: 0\r\n\r\n"
        ));
        assert!(!alive("HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"));
        assert!(alive(
            "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n"
        ));
        assert!(!alive("HTTP/1.1 200 OK\r\n\r\n"));
    }

    #[test]
    fn hop_by_hop_headers_stay_with_the_connection_but_for_a_protocol_switch() {
        let text = "HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Hop\r\nKeep-Alive: timeout=5\r\nX-Hop: 1\r\nTransfer-Encoding: chunked\r\nX-App: 1\r\n\r\n";
        let read = head(text, Method::GET).unwrap().unwrap();
        assert_eq!(read.framing, ResponseFraming::Chunked);
        let names: Vec<&str> = read.headers.keys().map(|name| name.as_str()).collect();
        assert_eq!(names, ["x-app"]);
        let text = "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n";
        let switched = head(text, Method::GET).unwrap().unwrap();
        assert_eq!(switched.headers.len(), 2);
    }

    #[test]
    fn a_head_without_traceparent_goes_as_written_and_the_client_length_is_written_once() {
        let mut writer = HttpHead::writer(&Method::POST, &["/health"], 3);
        writer.header(&http::header::HOST, &HeaderValue::from_static("10.0.0.1:8080"));
        writer.header(&CONTENT_LENGTH, &HeaderValue::from_static("0005"));
        writer.header(&CONNECTION, &HeaderValue::from_static("close"));
        let head = writer.finish(None);
        assert!(head.closes());
        let ([lines, end], framing) = head.for_try(&SpanId([7; 8]), None);
        assert_eq!(
            &[lines, end].concat()[..],
            b"POST /health HTTP/1.1\r\nhost: 10.0.0.1:8080\r\nconnection: close\r\ncontent-length: 5\r\n\r\n"
        );
        assert_eq!(framing, RequestFraming::Length(5));
    }

    #[test]
    fn the_first_try_sends_the_head_as_written_a_later_one_a_copy_naming_its_own_span() {
        let first = SpanId([1; 8]);
        let mut writer = HttpHead::writer(&Method::GET, &["/"], 2);
        writer.header(&http::header::HOST, &HeaderValue::from_static("app"));
        writer.traceparent(&TraceId([0xab; 16]), first, 1);
        let head = writer.finish(None);
        assert_eq!(head.span(), Some(first));
        let ([lines, end], framing) = head.for_try(&first, Some(0));
        assert_eq!(lines.as_ptr(), head.lines.as_ptr());
        assert_eq!((&end[..], framing), (&b"\r\n"[..], RequestFraming::Length(0)));
        let ([lines, end], framing) = head.for_try(&SpanId([0x2c; 8]), None);
        let parent = format!("00-{}-2c2c2c2c2c2c2c2c-01", "ab".repeat(16));
        assert_eq!(
            [lines, end].concat(),
            format!(
                "GET / HTTP/1.1\r\nhost: app\r\ntraceparent: {parent}\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            .as_bytes()
        );
        assert_eq!(framing, RequestFraming::Chunked);
        // The head as written still names the first try's span.
        assert!(head.lines.ends_with(b"-0101010101010101-01\r\n"));
    }

    #[test]
    fn a_length_named_by_connection_still_makes_the_framing_ambiguous() {
        let text = "HTTP/1.1 200 OK\r\nConnection: content-length\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n";
        let read = head(text, Method::GET).unwrap().unwrap();
        assert_eq!(read.framing, ResponseFraming::Chunked);
        assert!(!read.keep_alive);
    }

    #[test]
    fn an_oversized_head_is_refused() {
        let mut text = String::from("HTTP/1.1 200 OK\r\n");
        while text.len() <= MAX_HEAD {
            text.push_str("X-Filler: 0123456789012345678901234567890123456789\r\n");
        }
        assert!(head(&text, Method::GET).is_err());
    }

    fn decode_all(mut input: BytesMut) -> Result<(Vec<u8>, bool), Malformed> {
        let mut chunks = Chunks::Size;
        let mut out = Vec::new();
        loop {
            match chunks.decode(&mut input)? {
                Decoded::Data(data) => out.extend_from_slice(&data),
                Decoded::Short => return Ok((out, false)),
                Decoded::End => return Ok((out, true)),
            }
        }
    }

    #[test]
    fn chunks_decode_with_extensions_and_trailers() {
        let body = BytesMut::from("5;name=value\r\nhello\r\n1\r\n \r\n0\r\nX-Trailer: 1\r\n\r\nnext");
        assert_eq!(decode_all(body).unwrap(), (b"hello ".to_vec(), true));
        let (data, ended) = decode_all(BytesMut::from("A\r\n01234")).unwrap();
        assert_eq!((data, ended), (b"01234".to_vec(), false));
    }

    #[test]
    fn bad_chunks_are_refused() {
        for text in [
            "zz\r\n",
            "5\r\nhelloXX",
            "10000000000000000\r\n",
            "5\nhello\r\n",
            ";x\r\n",
            "0\r\nX-Trailer: 1\n\r\n",
        ] {
            assert!(decode_all(BytesMut::from(text)).is_err(), "{text:?}");
        }
        // Short lines, each within any per-line bound, that never end the section.
        let mut endless = BytesMut::from("0\r\n");
        for _ in 0..2_000 {
            endless.extend_from_slice(b"X-Trailer: 0123456789\r\n");
        }
        assert!(decode_all(endless).is_err(), "a trailer section that never ends");
    }

    #[test]
    fn a_chunk_is_written_with_its_size_in_hex() {
        let mut out = BytesMut::new();
        write_chunk(&[b'x'; 26], &mut out);
        assert!(out.starts_with(b"1a\r\nxxxx"));
        assert!(out.ends_with(b"x\r\n"));
    }
}
