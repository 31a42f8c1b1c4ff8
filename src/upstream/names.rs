//! Response header names as servers spell them. Every response an upstream sends names its
//! headers again, nearly always the same few in the same spelling (nginx's `Server`,
//! `Date`, `Content-Type`, `Content-Length`, `Connection`; PHP's `Content-type`, ...).
//! `HeaderName::from_bytes` lowercases each name into a buffer before it looks it up; a name
//! spelled as the table below has it is recognised with a compare or two, and any other
//! goes to `from_bytes`, so the result is always what `from_bytes` gives.

use http::header::{self, HeaderName, InvalidHeaderName};

static X_POWERED_BY: HeaderName = HeaderName::from_static("x-powered-by");
static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");

/// The header name `raw`, as a response spells it.
pub(crate) fn response_header_name(raw: &[u8]) -> Result<HeaderName, InvalidHeaderName> {
    let known = match raw {
        b"Date" => &header::DATE,
        b"ETag" => &header::ETAG,
        b"Vary" => &header::VARY,
        b"Link" => &header::LINK,
        b"Server" => &header::SERVER,
        b"Pragma" => &header::PRAGMA,
        b"Expires" => &header::EXPIRES,
        b"Location" => &header::LOCATION,
        b"Connection" => &header::CONNECTION,
        b"Keep-Alive" => &KEEP_ALIVE,
        b"Set-Cookie" => &header::SET_COOKIE,
        // PHP's own spelling.
        b"Content-Type" | b"Content-type" => &header::CONTENT_TYPE,
        b"X-Powered-By" => &X_POWERED_BY,
        b"Cache-Control" => &header::CACHE_CONTROL,
        b"Last-Modified" => &header::LAST_MODIFIED,
        b"Accept-Ranges" => &header::ACCEPT_RANGES,
        b"Content-Length" => &header::CONTENT_LENGTH,
        b"Content-Encoding" => &header::CONTENT_ENCODING,
        b"Transfer-Encoding" => &header::TRANSFER_ENCODING,
        _ => return HeaderName::from_bytes(raw),
    };
    Ok(known.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_spelling_in_the_table_is_the_name_from_bytes_makes() {
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
            let from_table = response_header_name(raw.as_bytes()).unwrap();
            assert_eq!(
                from_table,
                HeaderName::from_bytes(raw.as_bytes()).unwrap(),
                "{raw}"
            );
            assert_eq!(from_table.as_str(), raw.to_ascii_lowercase());
        }
    }

    #[test]
    fn other_spellings_and_invalid_names_go_to_from_bytes() {
        assert_eq!(
            response_header_name(b"content-type").unwrap(),
            header::CONTENT_TYPE
        );
        assert_eq!(response_header_name(b"DATE").unwrap(), header::DATE);
        assert_eq!(response_header_name(b"X-App").unwrap().as_str(), "x-app");
        assert!(response_header_name(b"Date ").is_err());
        assert!(response_header_name(b"").is_err());
        assert!(response_header_name(b"Content Type").is_err());
    }

    proptest! {
        #[test]
        fn any_name_is_read_as_from_bytes_reads_it(raw in proptest::collection::vec(any::<u8>(), 0..24)) {
            let expected = HeaderName::from_bytes(&raw).ok();
            prop_assert_eq!(response_header_name(&raw).ok(), expected);
        }
    }
}
