//! A request's key tuple for one limit (SPEC §2 key parts).
//!
//! Values the client controls are taken exactly once: a key header, query parameter or
//! cookie that appears more than once is refused (an app might read another occurrence
//! than the gateway counted, and so escape the limit), and an absent or empty one falls
//! back to the client IP, tagged so that a client cannot send a value equal to someone
//! else's address and share (or exhaust) their counter.

use http::{HeaderMap, Method, header};

use super::key::encode_tuple;
use crate::config::KeyPart;

/// A key part occurred more than once in the request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the rate-limit key {0} occurs more than once")]
pub struct AmbiguousKey(pub String);

/// What key parts are read from.
pub struct KeySource<'a> {
    pub client_ip: &'a str,
    pub headers: &'a HeaderMap,
    pub query: Option<&'a str>,
    pub method: &'a Method,
    pub path: &'a str,
    pub host: Option<&'a str>,
    pub route: &'a str,
}

/// The encoded tuple of `parts` for this request.
pub fn key_tuple(parts: &[KeyPart], source: &KeySource<'_>) -> Result<String, AmbiguousKey> {
    let mut values: Vec<Vec<u8>> = Vec::with_capacity(parts.len());
    for part in parts {
        let value = match part {
            KeyPart::ClientIp => tagged(b'i', source.client_ip.as_bytes()),
            KeyPart::Method => tagged(b'v', source.method.as_str().as_bytes()),
            KeyPart::Path => tagged(b'v', source.path.as_bytes()),
            KeyPart::Host => tagged(b'v', source.host.unwrap_or("").as_bytes()),
            KeyPart::Route => tagged(b'v', source.route.as_bytes()),
            KeyPart::Header(name) => {
                let mut found = source.headers.get_all(name).iter();
                let value = found.next().map(|v| v.as_bytes().to_vec());
                if found.next().is_some() {
                    return Err(AmbiguousKey(format!("header {name}")));
                }
                client_value(value, source.client_ip)
            }
            KeyPart::Query(name) => client_value(
                single(query_values(source.query, name), || {
                    format!("query parameter {name}")
                })?,
                source.client_ip,
            ),
            KeyPart::Cookie(name) => client_value(
                single(cookie_values(source.headers, name), || format!("cookie {name}"))?,
                source.client_ip,
            ),
        };
        values.push(value);
    }
    Ok(encode_tuple(values.iter().map(Vec::as_slice)))
}

fn tagged(tag: u8, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(value.len() + 1);
    out.push(tag);
    out.extend_from_slice(value);
    out
}

/// A client-supplied value, or the client IP when it is absent or empty.
fn client_value(value: Option<Vec<u8>>, client_ip: &str) -> Vec<u8> {
    match value {
        Some(value) if !value.is_empty() => tagged(b'v', &value),
        _ => tagged(b'i', client_ip.as_bytes()),
    }
}

fn single(
    mut values: impl Iterator<Item = Vec<u8>>,
    what: impl FnOnce() -> String,
) -> Result<Option<Vec<u8>>, AmbiguousKey> {
    let first = values.next();
    if values.next().is_some() {
        return Err(AmbiguousKey(what()));
    }
    Ok(first)
}

/// Values of `name` in a query string, percent- and `+`-decoded (so that `%61` and `a`
/// are the same key, as they are to the app).
fn query_values<'a>(query: Option<&'a str>, name: &'a str) -> impl Iterator<Item = Vec<u8>> + 'a {
    query.unwrap_or("").split('&').filter_map(move |pair| {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        (form_decode(key) == name.as_bytes()).then(|| form_decode(value))
    })
}

fn cookie_values<'a>(headers: &'a HeaderMap, name: &'a str) -> impl Iterator<Item = Vec<u8>> + 'a {
    headers
        .get_all(header::COOKIE)
        .iter()
        .flat_map(|line| line.as_bytes().split(|&b| b == b';'))
        .filter_map(move |pair| {
            let pair = pair.trim_ascii();
            let at = pair.iter().position(|&b| b == b'=')?;
            (pair[..at].trim_ascii() == name.as_bytes()).then(|| pair[at + 1..].trim_ascii().to_vec())
        })
}

fn form_decode(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    out
}
