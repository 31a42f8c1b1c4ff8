//! Request path normalization (docs/configuration.md#path-normalization), applied before routing and to what is forwarded.
//!
//! Percent-encoded unreserved characters are decoded (other escapes are kept, with upper-case
//! hex), `.` and `..` segments are removed and duplicate slashes merged. A path that would
//! climb above `/`, an invalid escape, and a `..` hidden behind an encoded slash
//! (`..%2F`), which a legacy app might decode after routing, are rejected: each could
//! otherwise reach a route the gateway never matched.

use std::borrow::Cow;

/// Why a request path cannot be normalized; every case is a 400 for the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("the path does not start with \"/\"")]
    NotAbsolute,
    #[error("the path climbs above \"/\"")]
    AboveRoot,
    #[error("the path has an invalid percent-encoding")]
    BadEscape,
    #[error("the path hides a dot segment behind an encoded slash")]
    EncodedTraversal,
    #[error("the path names no file: it holds a NUL byte, a backslash, or bytes that are not UTF-8")]
    NotAFileName,
}

/// Normalizes `path` (without its query string). Borrows when nothing changes.
///
/// ```
/// use floodgate::path::{PathError, normalize_path};
///
/// assert_eq!(normalize_path("/a//b/./c/../%64").unwrap(), "/a/b/d");
/// assert_eq!(normalize_path("/public/..%2Fadmin"), Err(PathError::EncodedTraversal));
/// assert_eq!(normalize_path("/.."), Err(PathError::AboveRoot));
/// ```
pub fn normalize_path(path: &str) -> Result<Cow<'_, str>, PathError> {
    if !path.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    if !needs_work(path) {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode_unreserved(path)?;
    let mut segments: Vec<&str> = Vec::new();
    let mut trailing_slash = false;
    for segment in decoded[1..].split('/') {
        trailing_slash = matches!(segment, "" | "." | "..");
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop().ok_or(PathError::AboveRoot)?;
            }
            _ if hides_dot_segment(segment) => return Err(PathError::EncodedTraversal),
            _ => segments.push(segment),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for segment in &segments {
        out.push('/');
        out.push_str(segment);
    }
    if trailing_slash || segments.is_empty() {
        out.push('/');
    }
    Ok(Cow::Owned(out))
}

/// The normalized `path` as the route table and the limits' keys read it: its encoded
/// slashes (`%2F`) taken for the slashes that nginx, PHP (for the file it runs) and most
/// frameworks take them for, and normalized again (doubled slashes merged). Read
/// literally, `/admin%2Fx` would miss a `/admin/` route that an app reading `/admin/x`
/// meant. Borrows when there is none.
///
/// ```
/// use floodgate::path::slashes_decoded;
///
/// assert_eq!(slashes_decoded("/%2Fadmin%2F%2Fx").unwrap(), "/admin/x");
/// assert_eq!(slashes_decoded("/a%252F").unwrap(), "/a%252F");
/// ```
pub fn slashes_decoded(path: &str) -> Result<Cow<'_, str>, PathError> {
    // A normalized path spells its escapes in upper case, each starting at its `%`; most
    // have none, which one `memchr` tells (a substring search costs more to set up).
    if memchr::memchr(b'%', path.as_bytes()).is_none() || !path.contains("%2F") {
        return Ok(Cow::Borrowed(path));
    }
    Ok(Cow::Owned(
        normalize_path(&path.replace("%2F", "/"))?.into_owned(),
    ))
}

/// True when `path` may contain an escape, a dot segment or a doubled slash.
fn needs_work(path: &str) -> bool {
    let bytes = path.as_bytes();
    bytes.iter().any(|&b| b == b'%' || b == b'\\') || bytes.windows(2).any(|w| w == b"//" || w == b"/.")
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Decodes `%XX` escapes of unreserved characters; keeps the others with upper-case hex.
/// A normalized `path` with every escape decoded, as a file name under a site's root
/// (`%20` a space, `%2F` a slash): `NotAFileName` when it holds a NUL byte or a backslash
/// or is not UTF-8, `EncodedTraversal` when a decoded slash makes a dot segment.
pub(crate) fn decode_file_path(path: &str) -> Result<String, PathError> {
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hi = bytes.get(i + 1).copied().and_then(hex_value);
            let lo = bytes.get(i + 2).copied().and_then(hex_value);
            let (Some(hi), Some(lo)) = (hi, lo) else {
                return Err(PathError::BadEscape);
            };
            out.push(hi << 4 | lo);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    let decoded = String::from_utf8(out).map_err(|_| PathError::NotAFileName)?;
    if decoded.contains(['\0', '\\']) {
        return Err(PathError::NotAFileName);
    }
    if decoded
        .split('/')
        .any(|segment| segment == "." || segment == "..")
    {
        return Err(PathError::EncodedTraversal);
    }
    Ok(decoded)
}

fn decode_unreserved(path: &str) -> Result<String, PathError> {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            let next = bytes[i..]
                .iter()
                .position(|&b| b == b'%')
                .map_or(bytes.len(), |p| i + p);
            out.push_str(&path[i..next]);
            i = next;
            continue;
        }
        let (hi, lo) = match (bytes.get(i + 1).copied(), bytes.get(i + 2).copied()) {
            (Some(h), Some(l)) => (hex_value(h), hex_value(l)),
            _ => (None, None),
        };
        let (Some(hi), Some(lo)) = (hi, lo) else {
            return Err(PathError::BadEscape);
        };
        let byte = hi << 4 | lo;
        if is_unreserved(byte) {
            out.push(byte as char);
        } else {
            out.push('%');
            out.push(
                char::from_digit(u32::from(hi), 16)
                    .expect("nibble")
                    .to_ascii_uppercase(),
            );
            out.push(
                char::from_digit(u32::from(lo), 16)
                    .expect("nibble")
                    .to_ascii_uppercase(),
            );
        }
        i += 3;
    }
    Ok(out)
}

/// True when splitting `segment` at encoded slashes or backslashes yields `.` or `..`.
fn hides_dot_segment(segment: &str) -> bool {
    segment
        .split(['\\'])
        .flat_map(|part| part.split("%2F"))
        .flat_map(|part| part.split("%5C"))
        .any(|part| part == "." || part == "..")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_path_is_decoded_whole_and_refuses_what_names_no_file() {
        assert_eq!(decode_file_path("/a%20b/c%2Fd.php").unwrap(), "/a b/c/d.php");
        assert_eq!(decode_file_path("/caf%C3%A9").unwrap(), "/café");
        assert_eq!(decode_file_path("/x.php%00.jpg"), Err(PathError::NotAFileName));
        assert_eq!(decode_file_path("/a%5C..%5Cb"), Err(PathError::NotAFileName));
        assert_eq!(decode_file_path("/%FF"), Err(PathError::NotAFileName));
        assert_eq!(decode_file_path("/a%2F..%2Fb"), Err(PathError::EncodedTraversal));
        assert_eq!(decode_file_path("/a%2"), Err(PathError::BadEscape));
    }

    fn norm(path: &str) -> Result<String, PathError> {
        normalize_path(path).map(Cow::into_owned)
    }

    #[test]
    fn clean_paths_are_borrowed_unchanged() {
        for path in ["/", "/a", "/a/b/", "/api/v1/users.json", "/a.b/c..d"] {
            assert!(
                matches!(normalize_path(path), Ok(Cow::Borrowed(p)) if p == path),
                "{path}"
            );
        }
        assert_eq!(norm("/a.b/c..d/.e/..f"), Ok("/a.b/c..d/.e/..f".into()));
    }

    #[test]
    fn dot_segments_and_duplicate_slashes() {
        assert_eq!(norm("//a///b"), Ok("/a/b".into()));
        assert_eq!(norm("/a/./b"), Ok("/a/b".into()));
        assert_eq!(norm("/a/b/../c"), Ok("/a/c".into()));
        assert_eq!(norm("/a/b/.."), Ok("/a/".into()));
        assert_eq!(norm("/a/."), Ok("/a/".into()));
        assert_eq!(norm("/a/b//"), Ok("/a/b/".into()));
        assert_eq!(norm("/a/.."), Ok("/".into()));
        assert_eq!(norm("/."), Ok("/".into()));
        assert_eq!(norm("/.hidden/x"), Ok("/.hidden/x".into()));
    }

    #[test]
    fn climbing_above_root_is_rejected() {
        assert_eq!(norm("/.."), Err(PathError::AboveRoot));
        assert_eq!(norm("/a/../../etc/passwd"), Err(PathError::AboveRoot));
        assert_eq!(norm("/%2e%2e/admin"), Err(PathError::AboveRoot));
        assert_eq!(norm("/a/%2E%2E/%2e%2e"), Err(PathError::AboveRoot));
    }

    #[test]
    fn unreserved_escapes_are_decoded_others_kept_upper_case() {
        assert_eq!(norm("/%61%62c"), Ok("/abc".into()));
        assert_eq!(norm("/a%7eb"), Ok("/a~b".into()));
        assert_eq!(norm("/a%20b%2fc"), Ok("/a%20b%2Fc".into()));
        assert_eq!(norm("/public/%2e%2e/admin"), Ok("/admin".into()));
    }

    #[test]
    fn encoded_slash_traversal_is_rejected() {
        assert_eq!(norm("/public/..%2Fadmin"), Err(PathError::EncodedTraversal));
        assert_eq!(norm("/public/..%2fadmin"), Err(PathError::EncodedTraversal));
        assert_eq!(norm("/public/%2e%2e%5cadmin"), Err(PathError::EncodedTraversal));
        assert_eq!(norm("/public/..\\admin"), Err(PathError::EncodedTraversal));
        assert_eq!(norm("/files/a%2Fb"), Ok("/files/a%2Fb".into()));
    }

    #[test]
    fn bad_escapes_and_relative_paths_are_rejected() {
        assert_eq!(norm("/a%zz"), Err(PathError::BadEscape));
        assert_eq!(norm("/a%4"), Err(PathError::BadEscape));
        assert_eq!(norm("/a%"), Err(PathError::BadEscape));
        assert_eq!(norm("a/b"), Err(PathError::NotAbsolute));
        assert_eq!(norm("*"), Err(PathError::NotAbsolute));
        assert_eq!(norm(""), Err(PathError::NotAbsolute));
    }
}
