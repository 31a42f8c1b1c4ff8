//! The CGI response head PHP writes at the start of its output (RFC 3875 section 6):
//! header lines, then an empty line. `Status:` gives the status; a `Location:` without one
//! is a `302`; every other line is a response header, repeated names kept (cookies), but
//! `Content-Length`, which hyper frames the response by: it must be one number.

use crate::upstream::h1::{Malformed, parse_length_list};
use crate::upstream::names::{Role, response_header};
use http::header::{CONTENT_LENGTH, HeaderValue, LOCATION};
use http::{HeaderMap, StatusCode};

/// The largest head read: beyond it the response is malformed (nginx's default buffer is
/// 4 KB; PHP apps that set many cookies need more).
pub(super) const MAX_HEAD: usize = 64 * 1024;

/// Room for the headers floodgate adds to a response after the head is read.
const ADDED_LATER: usize = 6;

/// Where the head ends in `output`: the length of the head with its empty line, if it has
/// arrived.
pub(super) fn end(output: &[u8]) -> Option<usize> {
    let mut line_start = 0;
    for i in memchr::memchr_iter(b'\n', output) {
        let line = &output[line_start..i];
        if line.is_empty() || line == b"\r" {
            return Some(i + 1);
        }
        line_start = i + 1;
    }
    None
}

/// The status and headers of a complete `head` (as [`end`] measured it).
pub(super) fn parse(head: &[u8]) -> Result<(StatusCode, HeaderMap), &'static str> {
    let mut status = None;
    let mut length = None;
    // Sized for the lines and the headers floodgate adds to a response (its request ID, a
    // limit's, the route's rules), so that the map is not grown and rehashed on the way.
    let lines = memchr::memchr_iter(b'\n', head).count();
    let mut headers = HeaderMap::with_capacity(lines + ADDED_LATER);
    let mut line_start = 0;
    for line_end in memchr::memchr_iter(b'\n', head) {
        let line = &head[line_start..line_end];
        line_start = line_end + 1;
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            break;
        }
        let colon = memchr::memchr(b':', line).ok_or("a header line without a colon")?;
        let name = &line[..colon];
        let value = line[colon + 1..].trim_ascii();
        if name.eq_ignore_ascii_case(b"status") {
            let code = value.get(..3).ok_or("a short Status")?;
            let code = StatusCode::from_bytes(code).map_err(|_| "a Status that is not a status code")?;
            if value.len() > 3 && value[3] != b' ' {
                return Err("a Status that is not a status code");
            }
            // An interim response has no place in a CGI answer, which is the final one.
            if code.is_informational() {
                return Err("an interim Status (1xx)");
            }
            status = Some(code);
            continue;
        }
        let (name, role) = response_header(name).map_err(|_| "an invalid header name")?;
        if role == Role::ContentLength {
            // Relayed as the one number it is: hyper frames the response by it.
            let this = parse_length_list(value).map_err(|Malformed(why)| why)?;
            if length.is_some_and(|length| Some(length) != this) {
                return Err("Content-Length values that differ");
            }
            length = this;
            continue;
        }
        let value = HeaderValue::from_bytes(value).map_err(|_| "an invalid header value")?;
        headers.append(name, value);
    }
    if let Some(length) = length {
        headers.insert(CONTENT_LENGTH, HeaderValue::from(length));
    }
    let status = match status {
        Some(status) => status,
        None if headers.contains_key(LOCATION) => StatusCode::FOUND,
        None => StatusCode::OK,
    };
    Ok((status, headers))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_ends_at_the_first_empty_line_with_or_without_carriage_returns() {
        assert_eq!(end(b"Status: 200\r\n\r\nbody"), Some(15));
        assert_eq!(end(b"X-A: 1\n\nbody"), Some(8));
        assert_eq!(end(b"X-A: 1\r\nX-B: 2\r\n"), None);
        assert_eq!(end(b"\r\nbody"), Some(2));
    }

    #[test]
    fn status_location_and_repeated_cookies() {
        let (status, headers) = parse(
            b"Status: 404 Not Found\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nContent-Type: text/html\r\n\r\n",
        )
        .unwrap();
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(headers.get_all("set-cookie").iter().count(), 2);
        assert_eq!(headers["content-type"], "text/html");
        let (status, headers) = parse(b"Location: /login\r\n\r\n").unwrap();
        assert_eq!(status, StatusCode::FOUND);
        assert_eq!(headers["location"], "/login");
        let (status, _) = parse(b"Location: /x\r\nStatus: 301\r\n\r\n").unwrap();
        assert_eq!(status, StatusCode::MOVED_PERMANENTLY);
        assert_eq!(parse(b"X-Powered-By: PHP\r\n\r\n").unwrap().0, StatusCode::OK);
    }

    #[test]
    fn a_malformed_head_is_refused() {
        for head in [
            &b"no colon here\r\n\r\n"[..],
            b"Status: abc\r\n\r\n",
            b"Status: 2000\r\n\r\n",
            b"Bad Name: x\r\n\r\n",
            b"X-A: a\x01b\r\n\r\n",
            b"Status: 100\r\n\r\n",
            b"Status: 101 Switching Protocols\r\n\r\n",
            b"Status: 103\r\n\r\n",
        ] {
            assert!(parse(head).is_err(), "{:?}", String::from_utf8_lossy(head));
        }
    }
}
