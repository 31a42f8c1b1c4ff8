//! Response header names as servers spell them. Every response an upstream sends names its
//! headers again, nearly always the same few in the same spelling (nginx's `Server`,
//! `Date`, `Content-Type`, `Content-Length`, `Connection`; PHP's `Content-type`, ...).
//! `HeaderName::from_bytes` lowercases each name into a buffer before it looks it up; a name
//! spelled as the table below has it is recognised with a compare or two, with its role
//! (framing, hop-by-hop), and any other goes to `from_bytes` and is compared with those
//! names, so the result is always what `from_bytes` and the comparisons give.

use http::header::{self, HeaderName, InvalidHeaderName};

use crate::proxy::headers::{KEEP_ALIVE, is_hop_by_hop_name};

static X_POWERED_BY: HeaderName = HeaderName::from_static("x-powered-by");

/// What a response header is to the exchange that reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// `Connection`: whether the connection is kept, and what else is hop-by-hop.
    Connection,
    /// `Transfer-Encoding`, which frames the body (and is hop-by-hop).
    TransferEncoding,
    /// `Content-Length`, which frames the body.
    ContentLength,
    /// Any other hop-by-hop header.
    HopByHop,
    /// A header that goes on to the client.
    EndToEnd,
}

impl Role {
    pub(crate) fn hop_by_hop(self) -> bool {
        matches!(self, Role::Connection | Role::TransferEncoding | Role::HopByHop)
    }

    fn of(name: &HeaderName) -> Role {
        if name == header::CONNECTION {
            Role::Connection
        } else if name == header::TRANSFER_ENCODING {
            Role::TransferEncoding
        } else if name == header::CONTENT_LENGTH {
            Role::ContentLength
        } else if is_hop_by_hop_name(name) {
            Role::HopByHop
        } else {
            Role::EndToEnd
        }
    }
}

/// A name as servers spell it, the name it is, and its role.
type Spelling<const N: usize> = (&'static [u8; N], &'static HeaderName, Role);

/// The header name `raw`, as a response spells it, and its role.
pub(crate) fn response_header(raw: &[u8]) -> Result<(HeaderName, Role), InvalidHeaderName> {
    use Role::EndToEnd;
    let known = match raw.len() {
        4 => spelled(
            raw,
            &[
                (b"Date", &header::DATE, EndToEnd),
                (b"ETag", &header::ETAG, EndToEnd),
                (b"Vary", &header::VARY, EndToEnd),
                (b"Link", &header::LINK, EndToEnd),
            ],
        ),
        6 => spelled(
            raw,
            &[
                (b"Server", &header::SERVER, EndToEnd),
                (b"Pragma", &header::PRAGMA, EndToEnd),
            ],
        ),
        7 => spelled(raw, &[(b"Expires", &header::EXPIRES, EndToEnd)]),
        8 => spelled(raw, &[(b"Location", &header::LOCATION, EndToEnd)]),
        10 => spelled(
            raw,
            &[
                (b"Connection", &header::CONNECTION, Role::Connection),
                (b"Keep-Alive", &KEEP_ALIVE, Role::HopByHop),
                (b"Set-Cookie", &header::SET_COOKIE, EndToEnd),
            ],
        ),
        12 => spelled(
            raw,
            &[
                (b"Content-Type", &header::CONTENT_TYPE, EndToEnd),
                // PHP's own spelling.
                (b"Content-type", &header::CONTENT_TYPE, EndToEnd),
                (b"X-Powered-By", &X_POWERED_BY, EndToEnd),
            ],
        ),
        13 => spelled(
            raw,
            &[
                (b"Cache-Control", &header::CACHE_CONTROL, EndToEnd),
                (b"Last-Modified", &header::LAST_MODIFIED, EndToEnd),
                (b"Accept-Ranges", &header::ACCEPT_RANGES, EndToEnd),
            ],
        ),
        14 => spelled(
            raw,
            &[(b"Content-Length", &header::CONTENT_LENGTH, Role::ContentLength)],
        ),
        16 => spelled(raw, &[(b"Content-Encoding", &header::CONTENT_ENCODING, EndToEnd)]),
        17 => spelled(
            raw,
            &[(
                b"Transfer-Encoding",
                &header::TRANSFER_ENCODING,
                Role::TransferEncoding,
            )],
        ),
        _ => None,
    };
    match known {
        Some((name, role)) => Ok((name.clone(), role)),
        None => {
            let name = HeaderName::from_bytes(raw)?;
            let role = Role::of(&name);
            Ok((name, role))
        }
    }
}

/// The entry of `spellings` (of `N` bytes) that `raw` is. Compared as arrays: a few word
/// compares each, where matching a byte-string pattern compared byte by byte.
fn spelled<const N: usize>(raw: &[u8], spellings: &[Spelling<N>]) -> Option<(&'static HeaderName, Role)> {
    let raw: &[u8; N] = raw.try_into().ok()?;
    spellings
        .iter()
        .find(|(spelling, ..)| *spelling == raw)
        .map(|&(_, name, role)| (name, role))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_spelling_in_the_table_is_read_as_from_bytes_reads_it() {
        for raw in [
            "Date",
            "ETag",
            "Vary",
            "Link",
            "Server",
            "Pragma",
            "Expires",
            "Location",
            "Connection",
            "Keep-Alive",
            "Set-Cookie",
            "Content-Type",
            "Content-type",
            "X-Powered-By",
            "Cache-Control",
            "Last-Modified",
            "Accept-Ranges",
            "Content-Length",
            "Content-Encoding",
            "Transfer-Encoding",
        ] {
            let (from_table, role) = response_header(raw.as_bytes()).unwrap();
            let parsed = HeaderName::from_bytes(raw.as_bytes()).unwrap();
            assert_eq!(from_table, parsed, "{raw}");
            assert_eq!(from_table.as_str(), raw.to_ascii_lowercase());
            assert_eq!(role, Role::of(&parsed), "{raw}");
        }
    }

    #[test]
    fn other_spellings_and_invalid_names_go_to_from_bytes() {
        let read = |raw: &[u8]| response_header(raw).map(|(name, role)| (name.as_str().to_owned(), role));
        assert_eq!(
            read(b"content-type").unwrap(),
            ("content-type".into(), Role::EndToEnd)
        );
        assert_eq!(read(b"DATE").unwrap(), ("date".into(), Role::EndToEnd));
        assert_eq!(read(b"X-App").unwrap(), ("x-app".into(), Role::EndToEnd));
        assert!(read(b"Date ").is_err());
        assert!(read(b"").is_err());
        assert!(read(b"Content Type").is_err());
    }

    #[test]
    fn the_roles_are_those_of_framing_and_hop_by_hop_headers() {
        let role = |raw: &[u8]| response_header(raw).unwrap().1;
        assert_eq!(role(b"connection"), Role::Connection);
        assert_eq!(role(b"Connection"), Role::Connection);
        assert_eq!(role(b"TRANSFER-ENCODING"), Role::TransferEncoding);
        assert_eq!(role(b"Transfer-Encoding"), Role::TransferEncoding);
        assert_eq!(role(b"content-length"), Role::ContentLength);
        for hop in [
            "Keep-Alive",
            "keep-alive",
            "Proxy-Connection",
            "TE",
            "Trailer",
            "Upgrade",
        ] {
            assert_eq!(role(hop.as_bytes()), Role::HopByHop, "{hop}");
        }
        assert!(Role::Connection.hop_by_hop() && Role::TransferEncoding.hop_by_hop());
        assert!(!Role::ContentLength.hop_by_hop() && !Role::EndToEnd.hop_by_hop());
    }

    proptest! {
        #[test]
        fn any_name_is_read_as_from_bytes_reads_it(raw in proptest::collection::vec(any::<u8>(), 0..24)) {
            let expected = HeaderName::from_bytes(&raw).ok().map(|name| {
                let role = Role::of(&name);
                (name, role)
            });
            prop_assert_eq!(response_header(&raw).ok(), expected);
        }
    }
}
