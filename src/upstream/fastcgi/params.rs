//! What a request tells PHP: the CGI/1.1 variables (RFC 3875) as nginx's `fastcgi_params`
//! sets them, and every request header as `HTTP_*` (docs/php-fpm.md#parameters).

use bytes::BytesMut;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Version};

use super::FastCgiHead;
use super::record::{self, PairTooLong, Params};
use crate::files::choice::Script;
use crate::proxy::headers::AsForwarded;
use crate::trace::TRACEPARENT;

/// Where a request came from and arrived.
pub(crate) struct Caller<'a> {
    /// The client's address, as floodgate decided it (trusted proxies applied), as text.
    pub(crate) address: &'a str,
    pub(crate) port: u16,
    /// The `Host` name without its port.
    pub(crate) server_name: &'a str,
    /// The port of the listener that took the connection.
    pub(crate) server_port: u16,
    pub(crate) https: bool,
}

/// A request's headers as they go upstream.
#[derive(Clone, Copy)]
pub(crate) enum Headers<'a> {
    /// Rewritten in the request's map (after header rules).
    Rewritten(&'a HeaderMap),
    /// Read beside the client's as they would go.
    AsForwarded(&'a AsForwarded<'a>),
}

/// The request as it goes to PHP.
pub(crate) struct Call<'a> {
    pub(crate) method: &'a Method,
    pub(crate) version: Version,
    /// The target exactly as the client sent it (`REQUEST_URI`).
    pub(crate) target: &'a str,
    pub(crate) query: &'a str,
    pub(crate) headers: Headers<'a>,
    /// The body's length, when the request has body framing (`Some(0)` for an empty one).
    pub(crate) content_length: Option<u64>,
    /// The `traceparent` PHP gets (`HTTP_TRACEPARENT`) in place of any the client sent;
    /// each try writes its own span ID over its parent ID.
    pub(crate) traceparent: &'a [u8],
}

/// The begin and parameter records of `call` to `script`, for a site whose root PHP-FPM
/// sees as `php_root`, with the upstream's extra `env`.
pub(crate) fn request_head(
    call: &Call<'_>,
    script: &Script,
    caller: &Caller<'_>,
    php_root: &str,
    env: &[(String, String)],
) -> Result<FastCgiHead, PairTooLong> {
    let mut out = BytesMut::with_capacity(1024);
    record::begin_request(&mut out);
    let mut params = Params::new(&mut out);
    // First, so that it stays where it was written in the first record even when the
    // parameters take several (past 64 KB).
    let mut traceparent = 0;
    params.pair_with(b"HTTP_TRACEPARENT".len(), call.traceparent.len(), |out| {
        out.extend_from_slice(b"HTTP_TRACEPARENT");
        traceparent = out.len();
        out.extend_from_slice(call.traceparent);
    });
    let protocol = match call.version {
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_2 => "HTTP/2.0",
        Version::HTTP_3 => "HTTP/3.0",
        _ => "HTTP/1.1",
    };
    let scheme = if caller.https { "https" } else { "http" };
    let mut number = itoa::Buffer::new();
    let php_root = php_root.as_bytes();
    let (name, path_info) = (script.name.as_bytes(), script.path_info.as_bytes());
    params.pair(b"GATEWAY_INTERFACE", b"CGI/1.1");
    params.pair(
        b"SERVER_SOFTWARE",
        concat!("floodgate/", env!("CARGO_PKG_VERSION")).as_bytes(),
    );
    params.pair(b"SERVER_PROTOCOL", protocol.as_bytes());
    params.pair(b"REQUEST_SCHEME", scheme.as_bytes());
    params.pair(b"SERVER_NAME", caller.server_name.as_bytes());
    params.pair(b"SERVER_PORT", number.format(caller.server_port).as_bytes());
    params.pair(b"REMOTE_ADDR", caller.address.as_bytes());
    params.pair(b"REMOTE_PORT", number.format(caller.port).as_bytes());
    params.pair(b"REQUEST_METHOD", call.method.as_str().as_bytes());
    params.pair(b"REQUEST_URI", call.target.as_bytes());
    params.pair(b"QUERY_STRING", call.query.as_bytes());
    params.pair(b"DOCUMENT_ROOT", php_root);
    params.pair_parts(b"DOCUMENT_URI", &[name, path_info]);
    params.pair(b"SCRIPT_NAME", name);
    params.pair_parts(b"SCRIPT_FILENAME", &[php_root, name]);
    params.pair(b"PATH_INFO", path_info);
    if !path_info.is_empty() {
        params.pair_parts(b"PATH_TRANSLATED", &[php_root, path_info]);
    }
    if caller.https {
        params.pair(b"HTTPS", b"on");
    }
    if let Some(length) = call.content_length {
        params.pair(b"CONTENT_LENGTH", number.format(length).as_bytes());
    }
    let content_type = match call.headers {
        Headers::Rewritten(map) => map.get(http::header::CONTENT_TYPE),
        // Sent as the client sent it.
        Headers::AsForwarded(headers) => headers.first(&http::header::CONTENT_TYPE),
    };
    if let Some(content_type) = content_type {
        params.pair(b"CONTENT_TYPE", content_type.as_bytes());
    }
    for (name, value) in env {
        params.pair(name.as_bytes(), value.as_bytes());
    }
    match call.headers {
        Headers::AsForwarded(headers) => {
            // Four runs that share no name.
            http_variables(&mut params, headers.sent());
            http_variables(&mut params, headers.added());
            http_variables(&mut params, headers.via());
            http_variables(&mut params, headers.set());
        }
        Headers::Rewritten(map) => http_variables(&mut params, map.iter()),
    }
    params.finish()?;
    Ok(FastCgiHead {
        records: out.freeze(),
        traceparent,
        span: None,
    })
}

/// The begin and parameter records of an active check: `GET` of the script `path`.
pub(crate) fn check_head(path: &str) -> BytesMut {
    let mut out = BytesMut::with_capacity(256);
    record::begin_request(&mut out);
    let mut params = Params::new(&mut out);
    params.pair(b"GATEWAY_INTERFACE", b"CGI/1.1");
    params.pair(b"REQUEST_METHOD", b"GET");
    params.pair(b"SCRIPT_NAME", path.as_bytes());
    params.pair(b"SCRIPT_FILENAME", path.as_bytes());
    params.pair(b"REQUEST_URI", path.as_bytes());
    params.pair(b"QUERY_STRING", b"");
    params.pair(b"HTTP_USER_AGENT", b"floodgate-health-check");
    params
        .finish()
        .expect("a check's path is at most 8 KB (config::upstreams), its three pairs fit a record");
    out
}

/// Each request header as `HTTP_NAME` (upper case, `-` as `_`), repeated ones joined
/// with `, `; `Proxy` never (httpoxy), nor a name holding `_`, which would pass for the
/// `-` spelling of another; `traceparent` is floodgate's, written apart.
fn http_variables<'h>(
    params: &mut Params<'_>,
    headers: impl Iterator<Item = (&'h HeaderName, &'h HeaderValue)>,
) {
    const PREFIX: &[u8] = b"HTTP_";
    // A name's values come one after the other.
    let mut values = headers.peekable();
    let mut repeated: Vec<&HeaderValue> = Vec::new();
    while let Some((name, first)) = values.next() {
        repeated.clear();
        while let Some((_, value)) = values.next_if(|(next, _)| *next == name) {
            repeated.push(value);
        }
        let text = name.as_str();
        if text == "proxy" || *name == TRACEPARENT || text.contains('_') {
            continue;
        }
        let value_len = first.len() + repeated.iter().map(|value| 2 + value.len()).sum::<usize>();
        params.pair_with(PREFIX.len() + text.len(), value_len, |out| {
            out.extend_from_slice(PREFIX);
            let start = out.len();
            out.extend_from_slice(text.as_bytes());
            // Header names are lower case already.
            for byte in &mut out[start..] {
                *byte = if *byte == b'-' {
                    b'_'
                } else {
                    byte.to_ascii_uppercase()
                };
            }
            out.extend_from_slice(first.as_bytes());
            for value in &repeated {
                out.extend_from_slice(b", ");
                out.extend_from_slice(value.as_bytes());
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_become_http_variables_except_proxy_and_underscored_names() {
        let mut headers = HeaderMap::new();
        headers.insert("x-real-ip", "1.2.3.4".parse().unwrap());
        headers.insert("proxy", "http://evil:8080".parse().unwrap());
        headers.insert("x_real_ip", "6.6.6.6".parse().unwrap());
        headers.append("accept", "a".parse().unwrap());
        headers.append("accept", "b".parse().unwrap());
        headers.append("accept", "c".parse().unwrap());
        headers.insert("x-last", "z".parse().unwrap());
        let mut out = BytesMut::new();
        let mut params = Params::new(&mut out);
        http_variables(&mut params, headers.iter());
        params.finish().unwrap();
        assert_eq!(
            decoded(&out),
            [
                (&b"HTTP_X_REAL_IP"[..], &b"1.2.3.4"[..]),
                (b"HTTP_ACCEPT", b"a, b, c"),
                (b"HTTP_X_LAST", b"z"),
            ]
            .map(|(name, value)| (name.to_vec(), value.to_vec()))
        );
    }

    #[test]
    fn the_cgi_variables_of_a_script_with_path_info() {
        let mut headers = HeaderMap::new();
        headers.insert("host", "shop.example:8080".parse().unwrap());
        headers.insert("content-type", "text/plain".parse().unwrap());
        let call = Call {
            method: &Method::POST,
            version: Version::HTTP_11,
            target: "/index.php/cart?id=7",
            query: "id=7",
            headers: Headers::Rewritten(&headers),
            content_length: Some(12),
            traceparent: b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        };
        let script = Script {
            name: "/index.php".into(),
            path_info: "/cart".into(),
        };
        let caller = Caller {
            address: "203.0.113.9",
            port: 50123,
            server_name: "shop.example",
            server_port: 8443,
            https: true,
        };
        let env = [("APP_ENV".to_owned(), "prod".to_owned())];
        let head = request_head(&call, &script, &caller, "/var/www", &env)
            .unwrap()
            .records;
        let variables = decoded(&head);
        let get = |name: &str| {
            let found: Vec<&[u8]> = variables
                .iter()
                .filter(|(n, _)| n == name.as_bytes())
                .map(|(_, v)| v.as_slice())
                .collect();
            assert_eq!(found.len(), 1, "{name} once");
            String::from_utf8(found[0].to_vec()).unwrap()
        };
        for (name, value) in [
            ("GATEWAY_INTERFACE", "CGI/1.1"),
            ("SERVER_PROTOCOL", "HTTP/1.1"),
            ("REQUEST_SCHEME", "https"),
            ("SERVER_NAME", "shop.example"),
            ("SERVER_PORT", "8443"),
            ("REMOTE_ADDR", "203.0.113.9"),
            ("REMOTE_PORT", "50123"),
            ("REQUEST_METHOD", "POST"),
            ("REQUEST_URI", "/index.php/cart?id=7"),
            ("QUERY_STRING", "id=7"),
            ("DOCUMENT_ROOT", "/var/www"),
            ("DOCUMENT_URI", "/index.php/cart"),
            ("SCRIPT_NAME", "/index.php"),
            ("SCRIPT_FILENAME", "/var/www/index.php"),
            ("PATH_INFO", "/cart"),
            ("PATH_TRANSLATED", "/var/www/cart"),
            ("HTTPS", "on"),
            ("CONTENT_LENGTH", "12"),
            ("CONTENT_TYPE", "text/plain"),
            ("APP_ENV", "prod"),
            ("HTTP_HOST", "shop.example:8080"),
            ("HTTP_CONTENT_TYPE", "text/plain"),
            (
                "HTTP_TRACEPARENT",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
        ] {
            assert_eq!(get(name), value, "{name}");
        }
        assert!(get("SERVER_SOFTWARE").starts_with("floodgate/"));
        assert_eq!(variables.len(), 24);
    }

    #[test]
    fn where_the_traceparent_value_starts() {
        const PARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let mut headers = HeaderMap::new();
        headers.insert("host", "a".parse().unwrap());
        // The client's is not passed on: floodgate's is.
        headers.insert(
            "traceparent",
            "00-11111111111111111111111111111111-2222222222222222-01"
                .parse()
                .unwrap(),
        );
        headers.insert("x-after", "b".parse().unwrap());
        let call = Call {
            method: &Method::GET,
            version: Version::HTTP_11,
            target: "/",
            query: "",
            headers: Headers::Rewritten(&headers),
            content_length: None,
            traceparent: PARENT.as_bytes(),
        };
        let script = Script {
            name: "/index.php".into(),
            path_info: String::new(),
        };
        let caller = Caller {
            address: "127.0.0.1",
            port: 1,
            server_name: "a",
            server_port: 80,
            https: false,
        };
        let FastCgiHead {
            records: head,
            traceparent: at,
            ..
        } = request_head(&call, &script, &caller, "/srv", &[]).unwrap();
        assert_eq!(&head[at..at + PARENT.len()], PARENT.as_bytes());
        let traceparents: Vec<Vec<u8>> = decoded(&head)
            .into_iter()
            .filter(|(name, _)| name == b"HTTP_TRACEPARENT")
            .map(|(_, value)| value)
            .collect();
        assert_eq!(traceparents, [PARENT.as_bytes()]);
        // Past 64 KB of parameters the records are split; the traceparent, first, stays put.
        let mut big = headers.clone();
        for name in ["x-big1", "x-big2", "x-big3"] {
            big.insert(name, "v".repeat(30_000).parse().unwrap());
        }
        let call = Call {
            headers: Headers::Rewritten(&big),
            ..call
        };
        let FastCgiHead {
            records: head,
            traceparent: at,
            ..
        } = request_head(&call, &script, &caller, "/srv", &[]).unwrap();
        assert_eq!(&head[at..at + PARENT.len()], PARENT.as_bytes());
        assert!(
            decoded(&head)
                .iter()
                .filter(|(name, value)| name.starts_with(b"HTTP_X_BIG") && value.len() == 30_000)
                .count()
                == 3
        );
    }

    /// The name-value pairs of the PARAMS records in `wire` (after its begin record).
    fn decoded(wire: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut stream = Vec::new();
        let mut rest = wire;
        while !rest.is_empty() {
            let len = usize::from(u16::from_be_bytes([rest[4], rest[5]]));
            let padding = usize::from(rest[6]);
            if rest[1] == 4 {
                stream.extend_from_slice(&rest[8..8 + len]);
            }
            rest = &rest[8 + len + padding..];
        }
        let mut stream = &stream[..];
        let mut pairs = Vec::new();
        while !stream.is_empty() {
            let name_len = length(&mut stream);
            let value_len = length(&mut stream);
            pairs.push((
                stream[..name_len].to_vec(),
                stream[name_len..name_len + value_len].to_vec(),
            ));
            stream = &stream[name_len + value_len..];
        }
        pairs
    }

    /// A pair's length from the front of `stream`: one byte, or four with the high bit set.
    fn length(stream: &mut &[u8]) -> usize {
        if stream[0] < 0x80 {
            let len = usize::from(stream[0]);
            *stream = &stream[1..];
            len
        } else {
            let len = u32::from_be_bytes([stream[0] & 0x7f, stream[1], stream[2], stream[3]]);
            *stream = &stream[4..];
            len as usize
        }
    }
}
