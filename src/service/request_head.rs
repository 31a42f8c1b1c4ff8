//! What hyper accepts in a request head but a gateway must refuse before anything is
//! forwarded: transfer codings other than `chunked`, a repeated `Content-Length` (HTTP/2;
//! hyper merges equal ones in HTTP/1.1), a missing, repeated or malformed `Host`, values
//! with whitespace around them (HTTP/2, whose values the parser does not trim), and
//! header sections over 32 KB. (A `Content-Length` beside `Transfer-Encoding` is gone from
//! the parsed request: `connection::framing` finds it on the wire.)
//!
//! The checks read the request hyper parsed, not the bytes on the socket, so they hold
//! for every request of a connection whatever came before it (an `Upgrade` the upstream
//! declined, a refused `CONNECT`), and for HTTP/1.1 and HTTP/2 alike.

use http::header::{self, HeaderName, HeaderValue};
use http::request::Parts;
use http::{HeaderMap, Uri};

use crate::error::GatewayError;

/// The most header bytes a request may carry, counted as HTTP/1.1 writes each field
/// (`name: value` and its line end), whatever the protocol: beyond it, 431.
pub(crate) const MAX_HEADER_BYTES: usize = 32 * 1024;

/// What [`check`] does with the header names PHP and CGI would fold into others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InvalidNames {
    /// Dropped: names with characters other than letters, digits and `-`.
    Drop,
    /// Kept (`server.drop_invalid_headers = false`).
    Keep,
}

/// Checks `request`'s head; returns the authority the client asked for (the request
/// target's, or else the `Host` header's), and what [`tidy`] has to do.
pub(crate) fn check(request: &Parts) -> Result<Checked<'_>, GatewayError> {
    let fields = Fields::of(&request.headers)?;
    // HTTP/1.1's parser has trimmed every value already.
    if request.version == http::Version::HTTP_2
        && request.headers.values().any(|value| padded(value.as_bytes()))
    {
        return Err(GatewayError::MalformedRequest(
            "a header value that starts or ends with whitespace",
        ));
    }
    // HTTP/1.1's parser takes only a target that starts with `/` (or `*`, or absolute);
    // HTTP/2's `:path` must too (RFC 9113 §8.3.1), where a bare query (`?a`) passed.
    if request.version == http::Version::HTTP_2
        && request
            .uri
            .path_and_query()
            .is_some_and(|target| !matches!(target.as_str().as_bytes().first(), Some(b'/' | b'*')))
    {
        return Err(GatewayError::MalformedRequest(
            "a :path that does not start with /",
        ));
    }
    // HTTP/2 carries the authority outside the fields: counted as the `Host` it stands for.
    let authority_field = match (fields.host, request.uri.authority()) {
        (None, Some(authority)) => "host".len() + authority.as_str().len() + 4,
        _ => 0,
    };
    if fields.bytes + authority_field > MAX_HEADER_BYTES {
        return Err(GatewayError::HeadersTooLarge);
    }
    if fields.content_length > 1 {
        return Err(GatewayError::AmbiguousFraming("repeated Content-Length"));
    }
    let declared = fields
        .length
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse().ok());
    Ok(Checked {
        authority: host(&request.uri, fields.host)?,
        untidy: Untidy {
            invalid_names: fields.invalid_names > 0,
            cookie_crumbs: fields.cookies > 1,
        },
        seen: Seen {
            declared,
            ..fields.seen
        },
    })
}

/// A request head that passed [`check`].
pub(crate) struct Checked<'a> {
    pub authority: &'a str,
    pub untidy: Untidy,
    pub seen: Seen,
}

/// What forwarding needs from the header fields, found by [`check`]'s pass over them:
/// the body's declared length, and which of the headers forwarding reads the request
/// has at all (most have none of them), so that it looks up only those.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Seen {
    /// The `Content-Length`, if there is one and it is a number.
    pub declared: Option<u64>,
    pub connection: bool,
    pub upgrade: bool,
    pub via: bool,
}

/// What [`tidy`] finds to do in a checked head.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Untidy {
    invalid_names: bool,
    cookie_crumbs: bool,
}

impl Untidy {
    /// Whether names PHP and CGI would fold remain after [`tidy`], under `names`.
    pub(crate) fn leaves_folding_names(self, names: InvalidNames) -> bool {
        self.invalid_names && names == InvalidNames::Keep
    }

    /// Whether [`tidy`] changes anything, under `names`.
    pub(crate) fn any(self, names: InvalidNames) -> bool {
        (self.invalid_names && names == InvalidNames::Drop) || self.cookie_crumbs
    }
}

/// Tidies a checked head for everything that reads it after: header names with
/// characters other than letters, digits and `-` dropped (unless `names` keeps them;
/// `dropped` counts them), and several `Cookie` fields (HTTP/2 sends one per cookie, RFC
/// 9113 §8.2.3) joined into one.
pub(crate) fn tidy(
    headers: &mut HeaderMap,
    untidy: Untidy,
    names: InvalidNames,
    dropped: impl FnOnce(usize),
) {
    if untidy.invalid_names && names == InvalidNames::Drop {
        dropped(drop_invalid_names(headers));
    }
    if untidy.cookie_crumbs {
        join_cookies(headers);
    }
}

/// What [`check`] needs from the header fields, in one pass over them.
struct Fields<'a> {
    host: Option<&'a HeaderValue>,
    content_length: usize,
    /// The first `Content-Length`.
    length: Option<&'a HeaderValue>,
    seen: Seen,
    /// Names with characters other than letters, digits and `-`.
    invalid_names: usize,
    cookies: usize,
    /// The fields' size as HTTP/1.1 writes them.
    bytes: usize,
}

impl<'a> Fields<'a> {
    fn of(headers: &'a HeaderMap) -> Result<Self, GatewayError> {
        let mut fields = Fields {
            host: None,
            content_length: 0,
            length: None,
            seen: Seen::default(),
            invalid_names: 0,
            cookies: 0,
            bytes: 0,
        };
        let mut transfer_encoding = false;
        for (name, value) in headers {
            fields.bytes += name.as_str().len() + value.len() + 4;
            if name == header::HOST {
                if fields.host.is_some() {
                    return Err(GatewayError::BadHost("repeated Host"));
                }
                fields.host = Some(value);
            } else if name == header::TRANSFER_ENCODING {
                if transfer_encoding {
                    return Err(GatewayError::AmbiguousFraming("repeated Transfer-Encoding"));
                }
                transfer_encoding = true;
                transfer_coding(value)?;
            } else if name == header::CONTENT_LENGTH {
                fields.content_length += 1;
                fields.length = fields.length.or(Some(value));
            } else if name == header::COOKIE {
                fields.cookies += 1;
            } else if name == header::CONNECTION {
                fields.seen.connection = true;
            } else if name == header::UPGRADE {
                fields.seen.upgrade = true;
            } else if name == header::VIA {
                fields.seen.via = true;
            } else if !valid_name(name.as_str()) {
                fields.invalid_names += 1;
            }
        }
        Ok(fields)
    }
}

/// Whether a value starts or ends with a space or tab. HTTP/1.1's parser trims them
/// (RFC 9112 §5.1); HTTP/2 carries them, and RFC 9113 §8.2.1 makes such a field
/// malformed: kept, a padded value would count as a key of its own while the upstream,
/// trimming it again, read the same value as unpadded.
fn padded(value: &[u8]) -> bool {
    matches!(value, [b' ' | b'\t', ..] | [.., b' ' | b'\t'])
}

/// Letters (header names are lower-case here), digits and `-`: what nginx calls a valid
/// name. PHP and CGI turn every other character into `_`, so `X.Real.IP` and `X_Real_IP`
/// would reach an app as its `X-Real-IP`.
fn valid_name(name: &str) -> bool {
    name.bytes().all(|b| VALID_NAME_BYTE[usize::from(b)])
}

/// The bytes of a valid name.
const VALID_NAME_BYTE: [bool; 256] = byte_set!(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');

/// Removes the fields with invalid names; returns how many went.
fn drop_invalid_names(headers: &mut HeaderMap) -> usize {
    let invalid: Vec<HeaderName> = headers
        .keys()
        .filter(|name| !valid_name(name.as_str()))
        .cloned()
        .collect();
    let mut count = 0;
    for name in invalid {
        count += headers.get_all(&name).iter().count();
        tracing::debug!(header = %name, "dropped a request header with an invalid name");
        headers.remove(name);
    }
    count
}

/// Joins every `Cookie` field into one, `; ` between them (RFC 9113 §8.2.3), as an
/// HTTP/1.1 app expects: Apache and `php -S` would join separate lines with `, `, and
/// PHP would then read the cookies after the first as part of its value.
fn join_cookies(headers: &mut HeaderMap) {
    let mut joined = Vec::new();
    for crumb in headers.get_all(header::COOKIE) {
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(crumb.as_bytes());
    }
    // Valid header values joined by `; ` are a valid header value.
    if let Ok(value) = HeaderValue::from_bytes(&joined) {
        headers.insert(header::COOKIE, value);
    }
}

/// hyper has already refused a `Transfer-Encoding` that does not end in `chunked` (400,
/// RFC 9112 §6.3); what it lets through with other codings before `chunked` would reach
/// the upstream as plain chunked, the codings dropped: 501 (RFC 9112 §6.1).
fn transfer_coding(value: &HeaderValue) -> Result<(), GatewayError> {
    let codings = value
        .to_str()
        .map_err(|_| GatewayError::UnsupportedTransferCoding)?;
    let mut codings = codings.split(',').map(str::trim).filter(|c| !c.is_empty());
    match (codings.next(), codings.next()) {
        (Some(only), None) if only.eq_ignore_ascii_case("chunked") => Ok(()),
        _ => Err(GatewayError::UnsupportedTransferCoding),
    }
}

/// RFC 9112 §3.2: exactly one valid `Host`; an absolute-form target's authority must agree
/// with it. HTTP/2 carries the authority in the target and may omit `Host`.
fn host<'a>(target: &'a Uri, header: Option<&'a HeaderValue>) -> Result<&'a str, GatewayError> {
    let Some(authority) = target.authority() else {
        // Not `ok_or`: an error made on every request is dropped by a call.
        let Some(host) = header else {
            return Err(GatewayError::BadHost("no Host"));
        };
        // A value that parses is ASCII: `to_str` (cheaper than `str::from_utf8` on a few
        // bytes) then never fails.
        return match HostPort::parse(host.as_bytes()).map(|_| host.to_str()) {
            Some(Ok(host)) => Ok(host),
            _ => Err(GatewayError::BadHost("malformed Host")),
        };
    };
    let asked = HostPort::parse(authority.as_str().as_bytes())
        .ok_or(GatewayError::BadHost("malformed authority in the request target"))?;
    if let Some(header) = header {
        let host = HostPort::parse(header.as_bytes()).ok_or(GatewayError::BadHost("malformed Host"))?;
        let default_port = if target.scheme() == Some(&http::uri::Scheme::HTTPS) {
            443
        } else {
            80
        };
        if !(host.name.eq_ignore_ascii_case(asked.name)
            && host.port.unwrap_or(default_port) == asked.port.unwrap_or(default_port))
        {
            return Err(GatewayError::BadHost("Host disagrees with the request target"));
        }
    }
    Ok(authority.as_str())
}

/// A `Host` value: a host name or IP literal, optionally `:port` (RFC 9110 §7.2), without
/// userinfo, lists or anything else a legacy application could misread.
#[derive(Debug, PartialEq, Eq)]
struct HostPort<'a> {
    /// ASCII: letters, digits, `-`, `.` and `_`, or an IPv6 literal in brackets.
    name: &'a [u8],
    port: Option<u16>,
}

/// The bytes a host name may hold: letters, digits, `-`, `.` and `_`. A table, where the
/// same test as a chain of comparisons cost about 20 instructions a byte.
const NAME_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut byte = 0;
    while byte < 256 {
        let b = byte as u8;
        table[byte] = b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_');
        byte += 1;
    }
    table
};

impl<'a> HostPort<'a> {
    fn parse(text: &'a [u8]) -> Option<Self> {
        let (name, port) = if let Some(rest) = text.strip_prefix(b"[") {
            let end = rest.iter().position(|&b| b == b']')?;
            std::str::from_utf8(&rest[..end])
                .ok()?
                .parse::<std::net::Ipv6Addr>()
                .ok()?;
            (&text[..end + 2], &rest[end + 1..])
        } else {
            let end = text
                .iter()
                .position(|&b| !NAME_BYTES[usize::from(b)])
                .unwrap_or(text.len());
            if end == 0 {
                return None;
            }
            (&text[..end], &text[end..])
        };
        let port = match port {
            [] | [b':'] => None,
            [b':', digits @ ..] => Some(digits.iter().try_fold(0u16, |port, &digit| {
                digit
                    .is_ascii_digit()
                    .then(|| port.checked_mul(10)?.checked_add(u16::from(digit - b'0')))?
            })?),
            _ => return None,
        };
        Some(HostPort { name, port })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn request(target: &str, headers: &[(&str, &str)]) -> Parts {
        let mut builder = Request::get(target);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(()).unwrap().into_parts().0
    }

    #[test]
    fn the_headers_forwarding_reads_are_seen_in_the_same_pass() {
        let plain = check(&request("/", &[("host", "a.example")])).unwrap().seen;
        assert_eq!(
            (plain.declared, plain.connection, plain.upgrade, plain.via),
            (None, false, false, false)
        );
        let head = request(
            "/",
            &[
                ("host", "a.example"),
                ("content-length", "42"),
                ("connection", "upgrade"),
                ("upgrade", "websocket"),
                ("via", "1.1 edge"),
            ],
        );
        let seen = check(&head).unwrap().seen;
        assert_eq!(
            (seen.declared, seen.connection, seen.upgrade, seen.via),
            (Some(42), true, true, true)
        );
    }

    /// The authority a request asks for, once checked.
    fn checked(target: &str, headers: &[(&str, &str)]) -> Result<String, GatewayError> {
        check(&request(target, headers)).map(|head| head.authority.to_owned())
    }

    /// `request` checked and tidied.
    fn tidied(mut request: Parts, names: InvalidNames, dropped: impl FnOnce(usize)) -> Parts {
        let untidy = check(&request).unwrap().untidy;
        tidy(&mut request.headers, untidy, names, dropped);
        request
    }

    fn status(target: &str, headers: &[(&str, &str)]) -> u16 {
        match checked(target, headers) {
            Ok(_) => 200,
            Err(error) => error.status().as_u16(),
        }
    }

    #[test]
    fn good_hosts_are_accepted() {
        for host in [
            "example.com",
            "Example.COM:8080",
            "127.0.0.1",
            "10.0.0.1:80",
            "[::1]",
            "[2001:db8::1]:443",
            "under_score.internal",
            "php:9000",
            "example.com:",
            "[::1]:",
        ] {
            assert_eq!(status("/", &[("host", host)]), 200, "{host}");
        }
        assert_eq!(checked("/", &[("host", "a.b:1")]).unwrap(), "a.b:1");
    }

    #[test]
    fn bad_hosts_are_400() {
        for host in [
            "",
            "user@admin.example.com",
            "admin.example.com,other",
            "a b",
            "a:b:c",
            "example.com:99999",
            "example.com:8o",
            "[::1",
            "[nonsense]",
            "[::1]x",
            "exa/mple",
            ":80",
            "\u{e9}.example",
            "a.example\t",
            "[::1]:x",
        ] {
            assert_eq!(status("/", &[("host", host)]), 400, "{host:?}");
        }
        assert_eq!(status("/", &[]), 400, "no Host");
        assert_eq!(status("/", &[("host", "a"), ("host", "a")]), 400, "repeated");
    }

    #[test]
    fn an_absolute_target_must_agree_with_host() {
        assert_eq!(status("http://a.example/x", &[("host", "a.example")]), 200);
        assert_eq!(status("http://a.example/x", &[("host", "A.example:80")]), 200);
        assert_eq!(status("https://a.example/x", &[("host", "a.example:443")]), 200);
        assert_eq!(status("http://a.example/x", &[]), 200, "HTTP/2: no Host needed");
        assert_eq!(status("http://a.example/x", &[("host", "b.example")]), 400);
        assert_eq!(status("http://a.example/x", &[("host", "a.example:81")]), 400);
        assert_eq!(status("http://user@a.example/x", &[("host", "a.example")]), 400);
        assert_eq!(checked("http://a.example:81/x", &[]).unwrap(), "a.example:81");
    }

    #[test]
    fn an_http2_value_with_whitespace_around_it_is_malformed() {
        let http2 = |value: &str| {
            let mut request = request("/", &[("host", "h"), ("x-key", value)]);
            request.version = http::Version::HTTP_2;
            check(&request)
                .map(|_| ())
                .map_err(|error| error.status().as_u16())
        };
        for padded in [" a", "a ", "\ta", "a\t", " "] {
            assert_eq!(http2(padded), Err(400), "{padded:?}");
        }
        for kept in ["a b", "a\tb", ""] {
            assert_eq!(http2(kept), Ok(()), "{kept:?}");
        }
    }

    #[test]
    fn an_http2_path_must_start_with_a_slash() {
        let http2 = |path: &str| {
            let uri = Uri::builder()
                .scheme("https")
                .authority("h")
                .path_and_query(path)
                .build()
                .unwrap();
            let mut request = request("/", &[]);
            request.uri = uri;
            request.version = http::Version::HTTP_2;
            check(&request)
                .map(|_| ())
                .map_err(|error| error.status().as_u16())
        };
        assert_eq!(http2("?a"), Err(400));
        assert_eq!(http2("/?a"), Ok(()));
        assert_eq!(http2("/"), Ok(()));
        assert_eq!(http2("*"), Ok(()), "OPTIONS *");
    }

    #[test]
    fn framing_is_checked() {
        let host = ("host", "h");
        assert_eq!(status("/", &[host, ("transfer-encoding", "chunked")]), 200);
        assert_eq!(status("/", &[host, ("transfer-encoding", "Chunked")]), 200);
        assert_eq!(status("/", &[host, ("content-length", "4")]), 200);
        for headers in [
            [("content-length", "4"), ("content-length", "4")],
            [("transfer-encoding", "chunked"), ("transfer-encoding", "chunked")],
        ] {
            let mut all = vec![host];
            all.extend(headers);
            assert_eq!(status("/", &all), 400, "{headers:?}");
        }
        for coding in ["gzip, chunked", "chunked, chunked", "x-custom,chunked"] {
            assert_eq!(
                status("/", &[host, ("transfer-encoding", coding)]),
                501,
                "{coding}"
            );
        }
    }

    #[test]
    fn header_bytes_are_counted_as_http1_writes_them() {
        // "host: h\r\n" is 9 bytes; each "x-NNNNN: v\r\n" field is 12.
        let fields = (MAX_HEADER_BYTES - 9) / 12;
        let names: Vec<String> = (0..=fields).map(|i| format!("x-{i:05}")).collect();
        let mut headers = vec![("host", "h")];
        headers.extend(names[..fields].iter().map(|n| (n.as_str(), "v")));
        assert_eq!(status("/", &headers), 200, "{fields} fields fit");
        headers.push((names[fields].as_str(), "v"));
        assert_eq!(status("/", &headers), 431, "one more does not");
        // Without Host (HTTP/2), the target's authority counts as one.
        headers.remove(0);
        assert_eq!(status("http://h/", &headers), 431);
        headers.pop();
        assert_eq!(status("http://h/", &headers), 200);
    }

    #[test]
    fn names_php_would_fold_are_dropped_unless_kept() {
        let fields = [
            ("host", "h"),
            ("x.real.ip", "6.6.6.6"),
            ("x_forwarded_for", "6.6.6.6"),
            ("x-api-key", "decoy"),
            ("x.api.key", "real"),
            ("x-kept-2", "yes"),
        ];
        let mut dropped = 0;
        let req = tidied(request("/", &fields), InvalidNames::Drop, |n| dropped = n);
        let mut names: Vec<&str> = req.headers.keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["host", "x-api-key", "x-kept-2"]);
        assert_eq!(dropped, 3);

        let kept = tidied(request("/", &fields), InvalidNames::Keep, |_| {
            panic!("nothing dropped")
        });
        assert_eq!(kept.headers.len(), fields.len());
    }

    #[test]
    fn cookie_crumbs_are_joined_into_one_field() {
        let req = tidied(
            request(
                "http://h/",
                &[
                    ("cookie", "a=1"),
                    ("x", "y"),
                    ("cookie", "PHPSESSID=abc"),
                    ("cookie", "theme=dark"),
                ],
            ),
            InvalidNames::Drop,
            |_| {},
        );
        let cookies: Vec<&[u8]> = req
            .headers
            .get_all("cookie")
            .iter()
            .map(|v| v.as_bytes())
            .collect();
        assert_eq!(cookies, [&b"a=1; PHPSESSID=abc; theme=dark"[..]]);
        let one = tidied(
            request("http://h/", &[("cookie", "a=1, b")]),
            InvalidNames::Drop,
            |_| {},
        );
        assert_eq!(one.headers["cookie"], "a=1, b", "a single field is left alone");
    }
}
