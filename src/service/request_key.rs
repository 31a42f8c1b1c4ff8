//! A request's key tuple for one limit (docs/configuration.md#key-parts).
//!
//! Values the client controls are taken exactly once: a key header, query parameter or
//! cookie that appears more than once is refused (an app might read another occurrence
//! than the gateway counted, and so escape the limit), and an absent or empty one falls
//! back to the client IP, tagged so that a client cannot send a value equal to someone
//! else's address and share (or exhaust) their counter.

use std::borrow::Cow;

use http::{HeaderMap, Method, header};

use crate::config::KeyPart;
use crate::error::GatewayError;
use crate::limit::key::{KeyedTuple, PartKind, TupleEncoder, key_suffix_len};

/// A key part occurred more than once in the request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the rate-limit key {0} occurs more than once")]
pub struct AmbiguousKey(pub String);

impl From<AmbiguousKey> for GatewayError {
    fn from(AmbiguousKey(part): AmbiguousKey) -> Self {
        GatewayError::AmbiguousKey(part)
    }
}

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
    Ok(encode_parts(parts, source, TupleEncoder::default())?.finish())
}

/// The encoded tuple of `parts` for this request, written where the store keys of limit
/// `limit` under `prefix` hold it.
pub fn keyed_tuple(
    parts: &[KeyPart],
    source: &KeySource<'_>,
    (prefix, limit): (&str, &str),
) -> Result<KeyedTuple, AmbiguousKey> {
    let encoder = TupleEncoder::in_key(prefix, key_suffix_len(limit));
    Ok(encode_parts(parts, source, encoder)?.finish_in_key())
}

fn encode_parts(
    parts: &[KeyPart],
    source: &KeySource<'_>,
    mut tuple: TupleEncoder,
) -> Result<TupleEncoder, AmbiguousKey> {
    for part in parts {
        let (tag, value) = match part {
            KeyPart::ClientIp => (PartKind::ClientIp, Cow::Borrowed(source.client_ip.as_bytes())),
            KeyPart::Method => (PartKind::Value, Cow::Borrowed(source.method.as_str().as_bytes())),
            KeyPart::Path => (PartKind::Value, Cow::Borrowed(source.path.as_bytes())),
            KeyPart::Host => (
                PartKind::Value,
                Cow::Borrowed(source.host.unwrap_or("").as_bytes()),
            ),
            KeyPart::Route => (PartKind::Value, Cow::Borrowed(source.route.as_bytes())),
            KeyPart::Header(name) => client_value(
                single(
                    source.headers.get_all(name).iter().map(|v| v.as_bytes().into()),
                    || format!("header {name}"),
                )?,
                source.client_ip,
            ),
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
        tuple.part(tag, &value);
    }
    Ok(tuple)
}

/// A key tuple built from named values (the admin API's).
pub(crate) struct NamedTuple {
    pub tuple: String,
    /// The values by part name, as given.
    pub named: Vec<(String, String)>,
    /// Each part encoded alone (for overrides with a network).
    pub parts: Vec<String>,
}

/// The tuple of `parts` for values named in `query` as the parts are named in `key`
/// (`client_ip=203.0.113.7&header:x-api-key=abc`): the key the request path builds for a
/// request carrying those values. Returns the values by part name, or the name of a part
/// that is missing, given twice, or that the limit does not have.
pub(crate) fn named_tuple(parts: &[KeyPart], query: &str) -> Result<NamedTuple, String> {
    let given: Vec<(String, Vec<u8>)> = query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            (
                String::from_utf8_lossy(&form_decode(name, true)).into_owned(),
                form_decode(value, true).into_owned(),
            )
        })
        .collect();
    let names: Vec<String> = parts.iter().map(KeyPart::name).collect();
    if let Some((unknown, _)) = given.iter().find(|(name, _)| !names.contains(name)) {
        return Err(format!(
            "the limit has no key part {unknown:?} (its key: {names:?})"
        ));
    }
    if let Some((twice, _)) = given
        .iter()
        .enumerate()
        .find_map(|(i, (name, _))| given[..i].iter().find(|(earlier, _)| earlier == name))
    {
        return Err(format!("key part {twice:?} is given twice"));
    }
    let mut tuple = TupleEncoder::default();
    let mut named = Vec::with_capacity(parts.len());
    let mut alone = Vec::with_capacity(parts.len());
    for (part, name) in parts.iter().zip(names) {
        let Some((_, value)) = given.iter().find(|(given, _)| *given == name) else {
            return Err(format!("missing key part {name:?}"));
        };
        // An address as the request path writes it (`::ffff:1.2.3.4` is 1.2.3.4, say), a
        // path and a host as a request's read; a value no request could have is an error.
        let canonical = match part {
            KeyPart::ClientIp => {
                let ip = std::str::from_utf8(value)
                    .ok()
                    .and_then(|text| text.parse::<std::net::IpAddr>().ok())
                    .ok_or_else(|| format!("{name:?} is not an IP address"))?;
                Some(crate::client_ip::ip_text(ip.to_canonical()).into_bytes())
            }
            // As a request's reads: `/a%2Fb` is counted as `/a/b`.
            KeyPart::Path | KeyPart::Host => {
                let text = std::str::from_utf8(value).map_err(|_| format!("{name:?} is not text"))?;
                Some(
                    part.as_requests_read(text)
                        .map_err(|why| format!("{name:?} names no request's: {why}"))?
                        .into_bytes(),
                )
            }
            _ => None,
        };
        let value = canonical.as_deref().unwrap_or(value);
        let kind = if *part == KeyPart::ClientIp {
            PartKind::ClientIp
        } else {
            PartKind::Value
        };
        tuple.part(kind, value);
        let mut one = TupleEncoder::default();
        one.part(kind, value);
        alone.push(one.finish());
        named.push((name, String::from_utf8_lossy(value).into_owned()));
    }
    Ok(NamedTuple {
        tuple: tuple.finish(),
        named,
        parts: alone,
    })
}

/// A client-supplied value, or the client IP when it is absent or empty, with its tag.
fn client_value<'a>(value: Option<Cow<'a, [u8]>>, client_ip: &'a str) -> (PartKind, Cow<'a, [u8]>) {
    match value {
        Some(value) if !value.is_empty() => (PartKind::Value, value),
        _ => (PartKind::ClientIp, Cow::Borrowed(client_ip.as_bytes())),
    }
}

fn single<'a>(
    mut values: impl Iterator<Item = Cow<'a, [u8]>>,
    what: impl FnOnce() -> String,
) -> Result<Option<Cow<'a, [u8]>>, AmbiguousKey> {
    let first = values.next();
    if values.next().is_some() {
        return Err(AmbiguousKey(what()));
    }
    Ok(first)
}

/// Values of `name` in a query string, percent- and `+`-decoded (so that `%61` and `a`
/// are the same key, as they are to the app), under every name PHP reads as `name`. A `;`
/// separates parameters as `&` does, as some apps read it (Rails, Go before 1.17,
/// Python's `parse_qs` before 3.10): `key=a;x=1` is `a` to them, and counted as `a`
/// rather than as a new value of the client's choosing; `key=a;key=b` is given twice.
fn query_values<'a>(query: Option<&'a str>, name: &'a str) -> impl Iterator<Item = Cow<'a, [u8]>> + 'a {
    let wanted = php_name(name.as_bytes());
    query.unwrap_or("").split(['&', ';']).filter_map(move |pair| {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        (php_name(&form_decode(key, true)) == wanted).then(|| form_decode(value, true))
    })
}

/// Values of the cookie `name`, decoded as PHP decodes them (`%XX`; `+` in the name),
/// under every name PHP reads as `name`, from every `Cookie` field.
fn cookie_values<'a>(headers: &'a HeaderMap, name: &'a str) -> impl Iterator<Item = Cow<'a, [u8]>> + 'a {
    let wanted = php_name(name.as_bytes());
    headers
        .get_all(header::COOKIE)
        .iter()
        .flat_map(|line| line.as_bytes().split(|&b| b == b';'))
        .filter_map(move |pair| {
            let pair = pair.trim_ascii();
            let at = pair.iter().position(|&b| b == b'=')?;
            let key = form_decode_bytes(pair[..at].trim_ascii(), true);
            (php_name(&key) == wanted).then(|| form_decode_bytes(pair[at + 1..].trim_ascii(), false))
        })
}

/// A query or cookie name as PHP registers it (`php_register_variable_ex`): leading
/// spaces gone, cut at a NUL, ` ` and `.` turned into `_`; a `[` opens an array (`a[x]` is
/// `a`), or, with no `]` after it, is turned into `_` too. So `api.key`, `api key`,
/// `api[key` and `api_key` are one name. Later characters are folded as well: folding
/// more than PHP does makes names collide (a 400), never lets a name past.
fn php_name(raw: &[u8]) -> Cow<'_, [u8]> {
    let start = raw.iter().position(|&b| b != b' ').unwrap_or(raw.len());
    let raw = &raw[start..];
    let raw = &raw[..raw.iter().position(|&b| b == 0).unwrap_or(raw.len())];
    let array = raw
        .iter()
        .position(|&b| b == b'[')
        .filter(|&open| raw[open..].contains(&b']'));
    let raw = &raw[..array.unwrap_or(raw.len())];
    if !raw.iter().any(|b| matches!(b, b' ' | b'.' | b'[')) {
        return Cow::Borrowed(raw);
    }
    Cow::Owned(
        raw.iter()
            .map(|&b| if matches!(b, b' ' | b'.' | b'[') { b'_' } else { b })
            .collect(),
    )
}

fn form_decode(text: &str, plus_is_space: bool) -> Cow<'_, [u8]> {
    form_decode_bytes(text.as_bytes(), plus_is_space)
}

/// `%XX` decoded; `+` a space when `plus_is_space` (query strings and cookie names; PHP
/// decodes cookie values with `rawurldecode`).
fn form_decode_bytes(bytes: &[u8], plus_is_space: bool) -> Cow<'_, [u8]> {
    if !bytes.iter().any(|&b| b == b'%' || (plus_is_space && b == b'+')) {
        return Cow::Borrowed(bytes);
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match bytes[i] {
            b'+' if plus_is_space => out.push(b' '),
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
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn source<'a>(headers: &'a HeaderMap, query: Option<&'a str>) -> KeySource<'a> {
        KeySource {
            client_ip: "198.51.100.7",
            headers,
            query,
            method: &Method::GET,
            path: "/api/x",
            host: Some("api.example.com"),
            route: "api",
        }
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    fn tuple(parts: &[KeyPart], headers: &HeaderMap, query: Option<&str>) -> Result<String, AmbiguousKey> {
        key_tuple(parts, &source(headers, query))
    }

    #[test]
    fn every_part_is_read() {
        let parts = [
            KeyPart::ClientIp,
            KeyPart::Method,
            KeyPart::Path,
            KeyPart::Host,
            KeyPart::Route,
        ];
        assert_eq!(
            tuple(&parts, &HeaderMap::new(), None).unwrap(),
            "i198.51.100.7:vGET:v%2Fapi%2Fx:vapi.example.com:vapi"
        );
    }

    #[test]
    fn an_absent_or_empty_value_falls_back_to_the_client_ip_tagged_apart() {
        let api_key = [KeyPart::Header(http::HeaderName::from_static("x-api-key"))];
        let fallback = tuple(&api_key, &HeaderMap::new(), None).unwrap();
        assert_eq!(
            fallback,
            tuple(&[KeyPart::ClientIp], &HeaderMap::new(), None).unwrap()
        );
        assert_eq!(
            tuple(&api_key, &headers(&[("x-api-key", "")]), None).unwrap(),
            fallback
        );
        // A client sending someone's address as its key does not share that counter.
        let forged = tuple(&api_key, &headers(&[("x-api-key", "198.51.100.7")]), None).unwrap();
        assert_ne!(forged, fallback);
    }

    #[test]
    fn a_key_given_twice_is_ambiguous() {
        let api_key = [KeyPart::Header(http::HeaderName::from_static("x-api-key"))];
        let twice = headers(&[("x-api-key", "a"), ("x-api-key", "b")]);
        assert!(tuple(&api_key, &twice, None).is_err());
        let query = [KeyPart::Query("k".into())];
        assert!(tuple(&query, &HeaderMap::new(), Some("k=a&x=1&k=b")).is_err());
        assert!(tuple(&query, &HeaderMap::new(), Some("k=a;k=b")).is_err());
        let cookie = [KeyPart::Cookie("s".into())];
        assert!(
            tuple(
                &cookie,
                &headers(&[("cookie", "s=1; t=2"), ("cookie", "s=3")]),
                None
            )
            .is_err()
        );
    }

    #[test]
    fn query_values_are_decoded_like_the_app_decodes_them() {
        let query = [KeyPart::Query("key".into())];
        let plain = tuple(&query, &HeaderMap::new(), Some("x=1&key=a%20b")).unwrap();
        assert_eq!(
            tuple(&query, &HeaderMap::new(), Some("%6Bey=a+b")).unwrap(),
            plain
        );
        assert_eq!(plain, "va%20b");
        let missing = tuple(&query, &HeaderMap::new(), Some("keys=1")).unwrap();
        assert_eq!(missing, "i198.51.100.7");
        // What follows a `;` is another parameter, not part of the value: a client cannot
        // make its key new at each request where the app reads it as the same.
        for query_string in ["key=a%20b;r=1", "r=2;key=a%20b", "key=a%20b;"] {
            assert_eq!(
                tuple(&query, &HeaderMap::new(), Some(query_string)).unwrap(),
                plain,
                "{query_string}"
            );
        }
    }

    #[test]
    fn cookies_are_found_among_others() {
        let cookie = [KeyPart::Cookie("session".into())];
        let h = headers(&[("cookie", "theme=dark; session=abc123 ; x=y")]);
        assert_eq!(tuple(&cookie, &h, None).unwrap(), "vabc123");
    }

    #[test]
    fn names_are_folded_as_php_registers_them() {
        for (raw, php) in [
            ("api_key", "api_key"),
            ("api.key", "api_key"),
            ("api key", "api_key"),
            ("  api key", "api_key"),
            ("api[key", "api_key"),
            ("api[k.e y", "api_k_e_y"),
            ("api[key]", "api"),
            ("api_key[]", "api_key"),
            ("api_key\0junk", "api_key"),
            ("Api_Key", "Api_Key"),
        ] {
            assert_eq!(php_name(raw.as_bytes()), php.as_bytes(), "{raw:?}");
        }
    }
}
