//! What a request tells PHP: the CGI/1.1 variables (RFC 3875) as nginx's `fastcgi_params`
//! sets them, and every request header as `HTTP_*` (docs/php-fpm.md#parameters).

use std::net::IpAddr;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Method, Version};

use super::record;
use crate::files::choice::Script;

/// Where a request came from and arrived.
pub(crate) struct Caller<'a> {
    /// The client's address, as floodgate decided it (trusted proxies applied).
    pub(crate) address: IpAddr,
    pub(crate) port: u16,
    /// The `Host` name without its port.
    pub(crate) server_name: &'a str,
    /// The port of the listener that took the connection.
    pub(crate) server_port: u16,
    pub(crate) https: bool,
}

/// The request as it goes to PHP.
pub(crate) struct Call<'a> {
    pub(crate) method: &'a Method,
    pub(crate) version: Version,
    /// The target exactly as the client sent it (`REQUEST_URI`).
    pub(crate) target: &'a str,
    pub(crate) query: &'a str,
    /// The request headers, after header rules.
    pub(crate) headers: &'a HeaderMap,
    /// The body's length, when the request has body framing (`Some(0)` for an empty one).
    pub(crate) content_length: Option<u64>,
}

/// The begin and parameter records of `call` to `script`, for a site whose root PHP-FPM
/// sees as `php_root`, with the upstream's extra `env`.
pub(crate) fn request_head(
    call: &Call<'_>,
    script: &Script,
    caller: &Caller<'_>,
    php_root: &str,
    env: &[(String, String)],
) -> Bytes {
    let mut out = BytesMut::with_capacity(1024);
    record::begin_request(&mut out);
    let script_filename = format!("{php_root}{}", script.name);
    let document_uri = format!("{}{}", script.name, script.path_info);
    let mut numbers = itoa::Buffer::new();
    let mut ports = itoa::Buffer::new();
    let remote_addr = crate::client_ip::ip_text(caller.address);
    let content_length = call.content_length.map(|length| length.to_string());
    let path_translated = (!script.path_info.is_empty()).then(|| format!("{php_root}{}", script.path_info));
    let protocol = match call.version {
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_2 => "HTTP/2.0",
        Version::HTTP_3 => "HTTP/3.0",
        _ => "HTTP/1.1",
    };
    let scheme = if caller.https { "https" } else { "http" };
    let mut params: Vec<(&[u8], &[u8])> = vec![
        (b"GATEWAY_INTERFACE", b"CGI/1.1"),
        (
            b"SERVER_SOFTWARE",
            concat!("floodgate/", env!("CARGO_PKG_VERSION")).as_bytes(),
        ),
        (b"SERVER_PROTOCOL", protocol.as_bytes()),
        (b"REQUEST_SCHEME", scheme.as_bytes()),
        (b"SERVER_NAME", caller.server_name.as_bytes()),
        (b"SERVER_PORT", numbers.format(caller.server_port).as_bytes()),
        (b"REMOTE_ADDR", remote_addr.as_bytes()),
        (b"REMOTE_PORT", ports.format(caller.port).as_bytes()),
        (b"REQUEST_METHOD", call.method.as_str().as_bytes()),
        (b"REQUEST_URI", call.target.as_bytes()),
        (b"QUERY_STRING", call.query.as_bytes()),
        (b"DOCUMENT_ROOT", php_root.as_bytes()),
        (b"DOCUMENT_URI", document_uri.as_bytes()),
        (b"SCRIPT_NAME", script.name.as_bytes()),
        (b"SCRIPT_FILENAME", script_filename.as_bytes()),
        (b"PATH_INFO", script.path_info.as_bytes()),
    ];
    if let Some(translated) = &path_translated {
        params.push((b"PATH_TRANSLATED", translated.as_bytes()));
    }
    if caller.https {
        params.push((b"HTTPS", b"on"));
    }
    if let Some(length) = &content_length {
        params.push((b"CONTENT_LENGTH", length.as_bytes()));
    }
    if let Some(content_type) = call.headers.get(http::header::CONTENT_TYPE) {
        params.push((b"CONTENT_TYPE", content_type.as_bytes()));
    }
    for (name, value) in env {
        params.push((name.as_bytes(), value.as_bytes()));
    }
    let headers = http_variables(call.headers);
    params.extend(
        headers
            .iter()
            .map(|(name, value)| (name.as_slice(), value.as_slice())),
    );
    record::params(&mut out, params);
    out.freeze()
}

/// The begin and parameter records of an active check: `GET` of the script `path`.
pub(crate) fn check_head(path: &str) -> BytesMut {
    let mut out = BytesMut::with_capacity(256);
    record::begin_request(&mut out);
    record::params(
        &mut out,
        [
            (&b"GATEWAY_INTERFACE"[..], &b"CGI/1.1"[..]),
            (b"REQUEST_METHOD", b"GET"),
            (b"SCRIPT_NAME", path.as_bytes()),
            (b"SCRIPT_FILENAME", path.as_bytes()),
            (b"REQUEST_URI", path.as_bytes()),
            (b"QUERY_STRING", b""),
            (b"HTTP_USER_AGENT", b"floodgate-health-check"),
        ],
    );
    out
}

/// Each request header as `HTTP_NAME` (upper case, `-` as `_`), repeated ones joined
/// with `, `; `Proxy` never (httpoxy), nor a name holding `_`, which would pass for the
/// `-` spelling of another.
fn http_variables(headers: &HeaderMap) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut variables: Vec<(Vec<u8>, Vec<u8>)> = Vec::with_capacity(headers.keys_len());
    for name in headers.keys() {
        let text = name.as_str();
        if text == "proxy" || text.contains('_') {
            continue;
        }
        let mut variable = Vec::with_capacity(5 + text.len());
        variable.extend_from_slice(b"HTTP_");
        variable.extend(
            text.bytes()
                .map(|b| if b == b'-' { b'_' } else { b.to_ascii_uppercase() }),
        );
        let mut value = Vec::new();
        for (i, part) in headers.get_all(name).iter().enumerate() {
            if i > 0 {
                value.extend_from_slice(b", ");
            }
            value.extend_from_slice(part.as_bytes());
        }
        variables.push((variable, value));
    }
    variables
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
        let variables = http_variables(&headers);
        let names: Vec<&[u8]> = variables.iter().map(|(n, _)| n.as_slice()).collect();
        assert_eq!(names, [&b"HTTP_X_REAL_IP"[..], b"HTTP_ACCEPT"]);
        assert_eq!(variables[1].1, b"a, b");
    }
}
