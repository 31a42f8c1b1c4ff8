//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>): the `traceparent` a client
//! sends, parsed strictly, and the one each upstream try receives; `tracestate` passed on
//! only with a valid `traceparent` and only when it is well formed itself.

use std::fmt;

use http::HeaderValue;
use smallvec::SmallVec;

/// A trace's ID: 16 bytes, never all zero.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct TraceId(pub(crate) [u8; 16]);

/// A span's ID: 8 bytes, never all zero.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct SpanId(pub(crate) [u8; 8]);

/// The `sampled` bit of `trace-flags`: the caller may have recorded its span.
pub(crate) const SAMPLED: u8 = 0x01;

/// The length of a version-00 `traceparent`.
const LEN: usize = 55;

impl TraceId {
    /// A new random ID.
    pub(crate) fn random() -> TraceId {
        loop {
            let id = fastrand::u128(..).to_be_bytes();
            if id != [0; 16] {
                return TraceId(id);
            }
        }
    }

    /// The ID as 32 lower-case hex digits.
    pub(crate) fn hex(&self) -> [u8; 32] {
        let mut out = [0; 32];
        hex_into(&self.0, &mut out);
        out
    }

    /// The low 8 bytes as a number, which ratio sampling compares (as OpenTelemetry's
    /// `TraceIdRatioBased` does, so that every hop of a trace decides alike).
    pub(crate) fn low(&self) -> u64 {
        u64::from_be_bytes(self.0[8..].try_into().expect("8 bytes"))
    }
}

impl SpanId {
    pub(crate) fn random() -> SpanId {
        loop {
            let id = fastrand::u64(..).to_be_bytes();
            if id != [0; 8] {
                return SpanId(id);
            }
        }
    }
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(std::str::from_utf8(&self.hex()).expect("hex digits"))
    }
}

/// What a valid `traceparent` says.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct TraceParent {
    pub(crate) trace_id: TraceId,
    pub(crate) parent_id: SpanId,
    pub(crate) flags: u8,
}

impl TraceParent {
    /// `value` as a `traceparent`, or `None` when it breaks a rule: `version-traceid-
    /// parentid-flags` in lower-case hex; version `ff` is invalid; version `00` is exactly
    /// 55 characters, a later version at least that and continues with `-` if longer;
    /// an all-zero trace or parent ID is invalid.
    pub(crate) fn parse(value: &[u8]) -> Option<TraceParent> {
        if value.len() < LEN {
            return None;
        }
        let version = hex_byte(&value[0..2])?;
        match version {
            0xff => return None,
            0x00 if value.len() != LEN => return None,
            _ if value.len() > LEN && value[LEN] != b'-' => return None,
            _ => {}
        }
        if value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
            return None;
        }
        let mut trace_id = [0; 16];
        let mut parent_id = [0; 8];
        for (byte, pair) in trace_id.iter_mut().zip(value[3..35].chunks(2)) {
            *byte = hex_byte(pair)?;
        }
        for (byte, pair) in parent_id.iter_mut().zip(value[36..52].chunks(2)) {
            *byte = hex_byte(pair)?;
        }
        let flags = hex_byte(&value[53..55])?;
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return None;
        }
        Some(TraceParent {
            trace_id: TraceId(trace_id),
            parent_id: SpanId(parent_id),
            flags,
        })
    }
}

/// The `traceparent` (version 00) naming `span` of `trace` as the parent, with `flags`.
pub(crate) fn traceparent(trace: &TraceId, span: &SpanId, flags: u8) -> [u8; LEN] {
    let mut out = [b'-'; LEN];
    out[0..2].copy_from_slice(b"00");
    hex_into(&trace.0, &mut out[3..35]);
    hex_into(&span.0, &mut out[36..52]);
    hex_into(&[flags], &mut out[53..55]);
    out
}

/// Writes `span` as 16 hex digits over `out`: the parent ID of a `traceparent` already
/// written.
pub(crate) fn write_span_id(span: &SpanId, out: &mut [u8]) {
    hex_into(&span.0, out);
}

/// Where the parent ID sits in a `traceparent`.
pub(crate) const PARENT_ID: std::ops::Range<usize> = 36..52;

/// The longest `tracestate` passed on, its lines together (the specification asks that at
/// least 512 characters be passed on; a longer one is dropped whole).
const MAX_TRACESTATE: usize = 512;

/// Whether the `tracestate` made of `values` (its header lines, joined by commas) is well
/// formed and passed on: at most 512 bytes and 1 to 32 list members, each `key=value` with
/// the key and value grammar of the specification and no key twice; empty members are
/// allowed.
pub(crate) fn valid_tracestate<'a>(values: impl Iterator<Item = &'a HeaderValue>) -> bool {
    let mut keys: SmallVec<[&[u8]; 8]> = SmallVec::new();
    let mut length = 0;
    for value in values {
        length += value.len() + 1;
        if length > MAX_TRACESTATE + 1 {
            return false;
        }
        for member in value.as_bytes().split(|&b| b == b',') {
            let member = trim_ows(member);
            if member.is_empty() {
                continue;
            }
            let Some(key) = valid_member(member) else {
                return false;
            };
            if keys.len() == 32 || keys.contains(&key) {
                return false;
            }
            keys.push(key);
        }
    }
    !keys.is_empty()
}

/// The key of a well-formed `key=value` member.
fn valid_member(member: &[u8]) -> Option<&[u8]> {
    let equals = member.iter().position(|&b| b == b'=')?;
    let (key, value) = (&member[..equals], &member[equals + 1..]);
    (valid_key(key) && valid_value(value)).then_some(key)
}

/// `key = simple-key / multi-tenant-key`: lower-case letters, digits, `_-*/`, starting
/// with a letter (a tenant may start with a digit), at most 256 characters; a
/// multi-tenant key is `tenant@system` (241 and 14 characters at most).
fn valid_key(key: &[u8]) -> bool {
    let part = |text: &[u8], max: usize, digit_first: bool| {
        !text.is_empty()
            && text.len() <= max
            && (text[0].is_ascii_lowercase() || (digit_first && text[0].is_ascii_digit()))
            && text.iter().all(|&b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-' | b'*' | b'/')
            })
    };
    match key.iter().position(|&b| b == b'@') {
        None => part(key, 256, false),
        Some(at) => part(&key[..at], 241, true) && part(&key[at + 1..], 14, false),
    }
}

/// `value`: 1 to 256 printable ASCII characters other than `,` and `=`, not ending in a
/// space.
fn valid_value(value: &[u8]) -> bool {
    !value.is_empty()
        && value.len() <= 256
        && value.last() != Some(&b' ')
        && value
            .iter()
            .all(|&b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=')
}

fn trim_ows(mut bytes: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = bytes {
        bytes = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = bytes {
        bytes = rest;
    }
    bytes
}

/// One byte from two lower-case hex digits.
fn hex_byte(pair: &[u8]) -> Option<u8> {
    let digit = |b: u8| match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    };
    Some(digit(pair[0])? << 4 | digit(pair[1])?)
}

/// `bytes` as lower-case hex digits over the start of `out`, two a byte.
fn hex_into(bytes: &[u8], out: &mut [u8]) {
    for (byte, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
        pair.copy_from_slice(&HEX_PAIRS[usize::from(*byte)]);
    }
}

/// Each byte's two hex digits: one load and one store a byte, where splitting it into
/// digits costs a dozen instructions (IDs and `traceparent` values are made per request).
const HEX_PAIRS: [[u8; 2]; 256] = {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut pairs = [[0; 2]; 256];
    let mut byte = 0;
    while byte < 256 {
        pairs[byte] = [DIGITS[byte >> 4], DIGITS[byte & 0x0f]];
        byte += 1;
    }
    pairs
};

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn a_valid_traceparent_and_its_fields() {
        let parent = TraceParent::parse(VALID.as_bytes()).unwrap();
        assert_eq!(parent.trace_id.to_string(), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(
            parent.parent_id.0,
            [0xb7, 0xad, 0x6b, 0x71, 0x69, 0x20, 0x33, 0x31]
        );
        assert_eq!(parent.flags, SAMPLED);
        // Written back, it is the same text.
        let written = traceparent(&parent.trace_id, &parent.parent_id, parent.flags);
        assert_eq!(&written[..], VALID.as_bytes());
    }

    /// The rules of the specification's section 3.2 (traceparent), one case each, and the
    /// invalid inputs of its test suite (w3c/trace-context, test/test_traceparent.py).
    #[test]
    fn what_the_specification_refuses() {
        let invalid = [
            "",
            "00",
            // Version ff is forbidden; versions must be hex, lower case.
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "0g-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "0A-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            // Version 00 is exactly 55 characters.
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-what-the-future-will-be-like",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0",
            // Upper-case hex, other characters, wrong separators.
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-B7AD6B7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0X",
            "00-0af7651916cd43dd8448eb211c80319z-b7ad6b7169203331-01",
            "00_0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c_b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331_01",
            // Field lengths.
            "00-0af7651916cd43dd8448eb211c8031-b7ad6b7169203331-0100",
            "00-0af7651916cd43dd8448eb211c80319c00-b7ad6b71692033-01",
            " 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            // All-zero IDs.
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            // A later version that continues without a dash.
            "cc-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01x",
        ];
        for value in invalid {
            assert_eq!(TraceParent::parse(value.as_bytes()), None, "{value:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_as_far_as_version_00_goes() {
        for value in [
            "cc-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "cc-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-what-the-future-will-be-like",
        ] {
            let parent = TraceParent::parse(value.as_bytes()).unwrap();
            assert_eq!(parent.trace_id.to_string(), "0af7651916cd43dd8448eb211c80319c");
            assert_eq!(parent.flags, SAMPLED);
        }
        // Unknown flags are read; only `sampled` means anything here.
        let parent = TraceParent::parse(b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-09").unwrap();
        assert_eq!(parent.flags, 0x09);
    }

    #[test]
    fn tracestate_members_follow_the_grammar() {
        let valid = |text: &str| valid_tracestate([HeaderValue::from_str(text).unwrap()].iter());
        assert!(valid("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"));
        assert!(valid("tenant1@vendor=x, a-b_c*d/e=1"));
        assert!(valid("foo=bar,,  ,baz=qux"));
        // A key twice, or no member at all, is not passed on.
        assert!(!valid("k=1,k=2"));
        assert!(!valid("k=1, j=2 ,k=1"));
        assert!(!valid(""));
        assert!(!valid(" , ,"));
        assert!(!valid("Upper=1"));
        assert!(!valid("1abc=1"));
        assert!(!valid("key"));
        assert!(!valid("key="));
        assert!(!valid("key=a=b"));
        // A value may hold spaces, not end in one (around a member, spaces are not its).
        assert!(valid("key=a b "));
        assert!(!valid_value(b"ends in space "));
        assert!(!valid(&format!("{}=1", "a".repeat(257))));
        assert!(!valid("t@verylongsystemname=1"));
        let many: Vec<String> = (0..33).map(|i| format!("k{i}=v")).collect();
        assert!(!valid(&many.join(",")));
        assert!(valid(&many[..32].join(",")));
        // Past 512 bytes, padding included, it is not passed on.
        assert!(valid(&format!("a=b{}", ",".repeat(509))));
        assert!(!valid(&format!("a=b{}", ",".repeat(510))));
        // Members are counted over every header line.
        let lines: Vec<HeaderValue> = (0..2)
            .map(|_| HeaderValue::from_str(&many[..20].join(",")).unwrap())
            .collect();
        assert!(!valid_tracestate(lines.iter()));
    }

    #[test]
    fn new_ids_are_never_zero_and_differ() {
        let a = TraceId::random();
        let b = TraceId::random();
        assert_ne!(a, b);
        assert_ne!(a.0, [0; 16]);
        assert_ne!(SpanId::random().0, [0; 8]);
    }
}
