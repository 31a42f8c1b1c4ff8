//! Response header names as servers spell them. Every response an upstream sends names its
//! headers again, nearly always the same few in the same spelling (nginx's `Server`,
//! `Date`, `Content-Type`, `Content-Length`, `Connection`; PHP's `Content-type`, ...).
//! `HeaderName::from_bytes` lowercases each name into a buffer before it looks it up; a name
//! spelled as the table below has it is recognised with a compare or two, with its role
//! (framing, hop-by-hop), and any other goes to `from_bytes` and is compared with those
//! names, so the result is always what `from_bytes` and the comparisons give.

use http::header::{self, HeaderName, InvalidHeaderName};

use crate::proxy::headers::is_hop_by_hop_name;

static X_POWERED_BY: HeaderName = HeaderName::from_static("x-powered-by");
static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");

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

/// The header name `raw`, as a response spells it, and its role.
pub(crate) fn response_header(raw: &[u8]) -> Result<(HeaderName, Role), InvalidHeaderName> {
    let (known, role) = match raw {
        b"Date" => (&header::DATE, Role::EndToEnd),
        b"ETag" => (&header::ETAG, Role::EndToEnd),
        b"Vary" => (&header::VARY, Role::EndToEnd),
        b"Link" => (&header::LINK, Role::EndToEnd),
        b"Server" => (&header::SERVER, Role::EndToEnd),
        b"Pragma" => (&header::PRAGMA, Role::EndToEnd),
        b"Expires" => (&header::EXPIRES, Role::EndToEnd),
        b"Location" => (&header::LOCATION, Role::EndToEnd),
        b"Connection" => (&header::CONNECTION, Role::Connection),
        b"Keep-Alive" => (&KEEP_ALIVE, Role::HopByHop),
        b"Set-Cookie" => (&header::SET_COOKIE, Role::EndToEnd),
        // PHP's own spelling.
        b"Content-Type" | b"Content-type" => (&header::CONTENT_TYPE, Role::EndToEnd),
        b"X-Powered-By" => (&X_POWERED_BY, Role::EndToEnd),
        b"Cache-Control" => (&header::CACHE_CONTROL, Role::EndToEnd),
        b"Last-Modified" => (&header::LAST_MODIFIED, Role::EndToEnd),
        b"Accept-Ranges" => (&header::ACCEPT_RANGES, Role::EndToEnd),
        b"Content-Length" => (&header::CONTENT_LENGTH, Role::ContentLength),
        b"Content-Encoding" => (&header::CONTENT_ENCODING, Role::EndToEnd),
        b"Transfer-Encoding" => (&header::TRANSFER_ENCODING, Role::TransferEncoding),
        _ => {
            let name = HeaderName::from_bytes(raw)?;
            let role = Role::of(&name);
            return Ok((name, role));
        }
    };
    Ok((known.clone(), role))
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
