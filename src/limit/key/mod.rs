//! Store keys: `PREFIX:{TUPLE}:LIMIT:ALGORITHM` and `PREFIX:{TUPLE}:LIMIT:lock`, where TUPLE is the limit's key parts,
//! encoded so that no two distinct tuples share a key and no key exceeds [`MAX_KEY_LEN`]
//! bytes, whatever a client sends.
//!
//! Each part is percent-escaped (everything but `A-Z a-z 0-9 . - _`), so the `:` between
//! parts, the braces of the hash tag and `#` never occur inside one. A tuple whose escaped
//! form would not fit is replaced by `#` and the hex SHA-256 of the escaped form (128 bits
//! kept): distinct tuples still map to distinct keys, and an escaped tuple never starts
//! with `#`. The braces make TUPLE the Redis Cluster hash tag, so limits of one request that
//! share a key tuple land in one slot and are decided in one atomic script call.

pub(crate) mod identity;

use sha2::{Digest, Sha256};

use super::Algorithm;

/// The longest key floodgate writes.
pub const MAX_KEY_LEN: usize = 200;
/// The longest prefix and limit name the configuration accepts; what remains of
/// [`MAX_KEY_LEN`] is the tuple's budget.
pub const MAX_PREFIX_LEN: usize = 32;
pub const MAX_LIMIT_NAME_LEN: usize = 48;
/// `:{` + `}:` + `:lock` (the longest suffix) around prefix, tuple and name.
const OVERHEAD: usize = 9;
const TUPLE_BUDGET: usize = MAX_KEY_LEN - MAX_PREFIX_LEN - MAX_LIMIT_NAME_LEN - OVERHEAD;
/// Hex digits of the digest kept for long tuples (128 bits).
const DIGEST_HEX: usize = 32;

/// The encoded key tuple of one request for one limit.
pub fn encode_tuple<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> String {
    let mut tuple = TupleEncoder::default();
    for part in parts {
        tuple.next_part();
        tuple.push(part);
    }
    tuple.finish()
}

/// What a key part's value is, written as its first byte: the client's address, or any
/// other value (a header's, say), so that no client can send a value that equals someone's
/// address and share that key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartKind {
    ClientIp,
    Value,
}

/// Builds a key tuple part by part, escaping as it goes (no copy of a part is made).
pub struct TupleEncoder {
    /// Before `start`, the beginning of the store key the tuple is written into (if any);
    /// from it on, the tuple: ASCII only, every byte outside `A-Z a-z 0-9 . - _` escaped.
    escaped: Vec<u8>,
    start: usize,
    parts: usize,
}

/// Room for a typical tuple (an IPv6 address, escaped, or an API key), so that building
/// one allocates once.
const TYPICAL_TUPLE: usize = 64;

impl Default for TupleEncoder {
    fn default() -> Self {
        TupleEncoder {
            escaped: Vec::with_capacity(TYPICAL_TUPLE),
            start: 0,
            parts: 0,
        }
    }
}

impl TupleEncoder {
    /// An encoder that writes the tuple where a store key under `prefix` holds it, with
    /// room after it for a suffix of `suffix` bytes: the tuple and the key are then one
    /// allocation ([`KeyedTuple::into_store_key`]).
    pub fn in_key(prefix: &str, suffix: usize) -> Self {
        let (escaped, start) = key_opening(prefix, TYPICAL_TUPLE + suffix);
        TupleEncoder {
            escaped,
            start,
            parts: 0,
        }
    }

    /// Starts the next part; [`Self::push`] then appends its bytes.
    pub fn next_part(&mut self) {
        if self.parts > 0 {
            self.escaped.push(b':');
        }
        self.parts += 1;
    }

    /// Appends a whole part: its kind, then `value`.
    pub fn part(&mut self, kind: PartKind, value: &[u8]) {
        self.next_part();
        // Plain bytes: nothing to escape.
        self.escaped.push(match kind {
            PartKind::ClientIp => b'i',
            PartKind::Value => b'v',
        });
        self.push(value);
    }

    /// Appends bytes to the current part, escaped.
    pub fn push(&mut self, mut bytes: &[u8]) {
        self.escaped.reserve(bytes.len());
        // Runs of plain bytes are copied whole: an address or an API key is one run.
        while let Some(at) = bytes.iter().position(|&byte| !is_plain(byte)) {
            let byte = bytes[at];
            self.escaped.extend_from_slice(&bytes[..at]);
            self.escaped.extend_from_slice(&[
                b'%',
                HEX[usize::from(byte >> 4)],
                HEX[usize::from(byte & 0xf)],
            ]);
            bytes = &bytes[at + 1..];
        }
        self.escaped.extend_from_slice(bytes);
    }

    /// The tuple: as escaped, or if that would not fit, `#` and the digest's hex.
    pub fn finish(self) -> String {
        self.finish_in_key().text
    }

    /// The tuple, in the store key it began ([`Self::in_key`]).
    pub fn finish_in_key(mut self) -> KeyedTuple {
        if self.escaped.len() - self.start > TUPLE_BUDGET {
            let digest = Sha256::digest(&self.escaped[self.start..]);
            self.escaped.truncate(self.start);
            self.escaped.push(b'#');
            for byte in &digest[..DIGEST_HEX / 2] {
                self.escaped
                    .extend_from_slice(&[HEX[usize::from(byte >> 4)], HEX[usize::from(byte & 0xf)]]);
            }
        }
        KeyedTuple {
            text: ascii_after_prefix(self.escaped),
            start: self.start,
        }
    }
}

/// `key` as text: what precedes the tuple is a `&str` prefix and `:{`, the tuple itself
/// ASCII (every other byte escaped, or `#` and hex digits).
#[allow(unsafe_code)] // checking the bytes again cost about 70 instructions a limited request
fn ascii_after_prefix(key: Vec<u8>) -> String {
    debug_assert!(std::str::from_utf8(&key).is_ok());
    // SAFETY: UTF-8 as said above: a `&str`, then ASCII bytes only.
    unsafe { String::from_utf8_unchecked(key) }
}

/// A key tuple written where a store key holds it: `PREFIX:{TUPLE`.
pub struct KeyedTuple {
    text: String,
    start: usize,
}

impl KeyedTuple {
    /// `tuple` (already encoded) where the store keys of `limit` under `prefix` hold it.
    pub fn of(prefix: &str, tuple: &str, limit: &str) -> Self {
        let (mut text, start) = key_opening(prefix, tuple.len() + key_suffix_len(limit));
        text.extend_from_slice(tuple.as_bytes());
        KeyedTuple {
            text: String::from_utf8(text).expect("a prefix and a tuple are UTF-8"),
            start,
        }
    }

    pub fn tuple(&self) -> &str {
        &self.text[self.start..]
    }

    /// The store key of `limit`'s counter for this tuple ([`store_key`]), in the tuple's
    /// own buffer.
    pub fn into_store_key(self, limit: &str, algorithm: &Algorithm) -> String {
        self.into_key(limit, algorithm_tag(algorithm))
    }

    /// The key `PREFIX:{TUPLE}:LIMIT:TAG`, in the tuple's own buffer.
    fn into_key(self, limit: &str, tag: &str) -> String {
        let mut key = self.text;
        for part in ["}:", limit, ":", tag] {
            key.push_str(part);
        }
        key
    }
}

/// A buffer holding `PREFIX:{`, the beginning of every store key, with room for `room`
/// bytes more; and where the tuple starts in it.
fn key_opening(prefix: &str, room: usize) -> (Vec<u8>, usize) {
    let start = prefix.len() + 2;
    let mut opening = Vec::with_capacity(start + room);
    opening.extend_from_slice(prefix.as_bytes());
    opening.extend_from_slice(b":{");
    (opening, start)
}

/// The store key of `limit`'s counter for `tuple`. It names the algorithm, so that a limit
/// edited to another algorithm starts afresh instead of meeting state of another shape.
pub fn store_key(prefix: &str, tuple: &str, limit: &str, algorithm: &Algorithm) -> String {
    joined_key(prefix, tuple, limit, algorithm_tag(algorithm))
}

/// The last part of a counter's key: its algorithm.
fn algorithm_tag(algorithm: &Algorithm) -> &'static str {
    match algorithm {
        Algorithm::FixedWindow { .. } => "fw",
        Algorithm::SlidingWindow { .. } => "sw",
        Algorithm::TokenBucket { .. } => "tb",
        Algorithm::LeakyBucket { .. } => "lb",
    }
}

/// The longest suffix a key tuple's store keys add after `limit`'s name: `}:NAME:lock`.
pub fn key_suffix_len(limit: &str) -> usize {
    limit.len() + ":lock".len() + 2
}

/// The store key of concurrency limit `limit`'s slots for `tuple`.
pub fn slots_key(prefix: &str, tuple: &str, limit: &str) -> String {
    joined_key(prefix, tuple, limit, "cc")
}

/// The store key of `limit`'s lock-out marker for `tuple`.
pub fn lock_key(prefix: &str, tuple: &str, limit: &str) -> String {
    joined_key(prefix, tuple, limit, "lock")
}

/// `prefix:{tuple}:limit:tag`.
fn joined_key(prefix: &str, tuple: &str, limit: &str, tag: &str) -> String {
    KeyedTuple::of(prefix, tuple, limit).into_key(limit, tag)
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

fn is_plain(byte: u8) -> bool {
    PLAIN[usize::from(byte)]
}

/// The bytes kept as they are in a tuple: `A-Z a-z 0-9 . - _`.
static PLAIN: [bool; 256] = byte_set!(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn tuple(parts: &[&str]) -> String {
        encode_tuple(parts.iter().map(|p| p.as_bytes()))
    }

    #[test]
    fn plain_parts_stay_readable() {
        assert_eq!(tuple(&["203.0.113.9"]), "203.0.113.9");
        assert_eq!(tuple(&["2001:db8::1", "GET"]), "2001%3Adb8%3A%3A1:GET");
        let fixed = Algorithm::FixedWindow { limit: 1, window: 1 };
        assert_eq!(
            store_key("fg", &tuple(&["k"]), "per_ip", &fixed),
            "fg:{k}:per_ip:fw"
        );
        assert_eq!(lock_key("fg", &tuple(&["k"]), "per_ip"), "fg:{k}:per_ip:lock");
    }

    #[test]
    fn separators_and_braces_cannot_be_forged() {
        assert_ne!(tuple(&["a:b"]), tuple(&["a", "b"]));
        assert_eq!(tuple(&["}{x"]), "%7D%7Bx");
        assert_eq!(tuple(&["a b%", "", "\u{e9}z"]), "a%20b%25::%C3%A9z");
        assert!(!tuple(&["#abc"]).starts_with('#'));
    }

    #[test]
    fn long_tuples_are_hashed_within_the_budget() {
        let long = "x".repeat(10_000);
        let hashed = tuple(&[&long]);
        assert!(hashed.starts_with('#'));
        assert_eq!(hashed.len(), 1 + DIGEST_HEX);
        assert_ne!(hashed, tuple(&[&format!("{long}y")]));
        let key = lock_key(
            &"p".repeat(MAX_PREFIX_LEN),
            &hashed,
            &"n".repeat(MAX_LIMIT_NAME_LEN),
        );
        assert!(key.len() <= MAX_KEY_LEN);
    }

    proptest! {
        #[test]
        fn distinct_tuples_give_distinct_bounded_keys(
            a in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..150), 1..4),
            b in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..150), 1..4),
        ) {
            let ka = encode_tuple(a.iter().map(Vec::as_slice));
            let kb = encode_tuple(b.iter().map(Vec::as_slice));
            prop_assert!(ka.len() <= TUPLE_BUDGET);
            if a != b {
                prop_assert_ne!(ka, kb);
            }
        }

        #[test]
        fn a_tuple_written_in_its_key_is_the_key_of_the_tuple(
            parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..150), 1..4),
            prefix in "[a-z]{0,32}",
            name in "[a-z_]{1,48}",
        ) {
            let tuple = encode_tuple(parts.iter().map(Vec::as_slice));
            let mut encoder = TupleEncoder::in_key(&prefix, key_suffix_len(&name));
            for part in &parts {
                encoder.next_part();
                encoder.push(part);
            }
            let keyed = encoder.finish_in_key();
            prop_assert_eq!(keyed.tuple(), tuple.as_str());
            let algorithm = Algorithm::TokenBucket { rate: 1.0, per: 1, burst: 1 };
            let key = store_key(&prefix, &tuple, &name, &algorithm);
            prop_assert_eq!(keyed.into_store_key(&name, &algorithm), key);
        }

        #[test]
        fn a_tuple_that_fits_decodes_to_its_parts(
            // At most 3 parts of 12 bytes: 110 bytes when every byte is escaped, within the budget.
            parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..13), 1..4),
        ) {
            let encoded = encode_tuple(parts.iter().map(Vec::as_slice));
            let decoded: Vec<Vec<u8>> = encoded.split(':').map(percent_decode).collect();
            prop_assert_eq!(decoded, parts);
        }
    }

    fn percent_decode(part: &str) -> Vec<u8> {
        let bytes = part.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'%' {
                out.push(u8::from_str_radix(&part[i + 1..i + 3], 16).unwrap());
                i += 3;
            } else {
                assert!(is_plain(bytes[i]), "{part}: unescaped {:?}", bytes[i] as char);
                out.push(bytes[i]);
                i += 1;
            }
        }
        out
    }
}
