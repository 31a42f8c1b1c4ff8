//! Header rewriting between client and upstream (docs/configuration.md#forwarding): hop-by-hop headers removed
//! (RFC 9110 §7.6.1, including the names listed in `Connection`), forwarding headers set by
//! floodgate alone, and other spellings of them dropped where invalid names are kept (PHP
//! and CGI read `X_Real_IP` and `X.Real.IP` as `HTTP_X_REAL_IP`, so a client could
//! otherwise plant one).

use std::net::IpAddr;

use http::Version;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::client_ip::Peer;
use crate::config::HeaderRules;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static FORWARDED: HeaderName = HeaderName::from_static("forwarded");
static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Headers that describe one connection and never travel past it.
fn hop_by_hop() -> [&'static HeaderName; 7] {
    [
        &header::CONNECTION,
        &KEEP_ALIVE,
        &PROXY_CONNECTION,
        &header::TE,
        &header::TRAILER,
        &header::TRANSFER_ENCODING,
        &header::UPGRADE,
    ]
}

/// Whether `token` names a header of [`hop_by_hop`], in any case.
fn is_hop_by_hop(token: &[u8]) -> bool {
    hop_by_hop()
        .iter()
        .any(|hop| hop.as_str().len() == token.len() && hop.as_str().as_bytes().eq_ignore_ascii_case(token))
}

/// The headers floodgate owns on the way upstream, with `-` spelled `_`.
const UNDERSCORE_SPELLINGS: [&str; 4] = [
    "x_forwarded_for",
    "x_real_ip",
    "x_forwarded_proto",
    "x_forwarded_host",
];

/// Removes hop-by-hop headers and every header named in `Connection`. `Host` is never
/// removed, whatever `Connection` says.
pub(crate) fn remove_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names with cheap comparisons finds which of them are present: most
    // messages carry none, or only `Connection: keep-alive` (nearly every upstream
    // response), and then only those are hashed and removed.
    let mut present = hop_by_hop().map(|_| false);
    for name in headers.keys() {
        if let Some(i) = hop_by_hop().iter().position(|hop| *hop == name) {
            present[i] = true;
        }
    }
    if !present.contains(&true) {
        return;
    }
    // `Connection` comes first in hop_by_hop(). A token naming a hop-by-hop header (as
    // `keep-alive` and `close` do) needs no removal of its own: that header goes below if
    // present.
    let mut named = Vec::new();
    if present[0] {
        for value in headers.get_all(header::CONNECTION) {
            // What nearly every message says, checked whole first.
            let value = value.as_bytes();
            if value.eq_ignore_ascii_case(b"keep-alive") || value.eq_ignore_ascii_case(b"close") {
                continue;
            }
            for token in value.split(|&byte| byte == b',') {
                let token = token.trim_ascii();
                if token.is_empty() || token.eq_ignore_ascii_case(b"close") || is_hop_by_hop(token) {
                    continue;
                }
                if let Ok(name) = HeaderName::from_bytes(token)
                    && name != header::HOST
                {
                    named.push(name);
                }
            }
        }
    }
    for name in named {
        headers.remove(name);
    }
    for (name, present) in hop_by_hop().into_iter().zip(present) {
        if present {
            headers.remove(name);
        }
    }
}

/// Applies header rules, the server's or a route's (docs/configuration.md#header-rules):
/// each `set` header replaces every value of its name, then the `remove` ones go.
pub(crate) fn apply_rules(rules: &HeaderRules, headers: &mut HeaderMap) {
    for (name, value) in &rules.set {
        headers.insert(name.clone(), value.clone());
    }
    for name in &rules.remove {
        headers.remove(name);
    }
}

/// The `Upgrade` value of an HTTP/1.1 request that asks for a protocol switch the
/// upstream may accept (WebSocket and the like; `h2c` is ours to refuse, not to forward).
pub(crate) fn requested_upgrade(version: Version, headers: &HeaderMap) -> Option<HeaderValue> {
    if version != Version::HTTP_11 {
        return None;
    }
    let upgrade = headers.get(header::UPGRADE)?;
    let connection_says_upgrade = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("upgrade"));
    let is_h2c = upgrade
        .to_str()
        .is_ok_and(|v| v.trim().eq_ignore_ascii_case("h2c"));
    (connection_says_upgrade && !is_h2c).then(|| upgrade.clone())
}

/// What floodgate knows about the client connection, for the forwarding headers.
pub(crate) struct ForwardingContext<'a> {
    /// The request ID's header and value, set on every request that goes upstream.
    pub request_id: Option<(&'a HeaderName, &'a HeaderValue)>,
    pub peer: &'a Peer,
    pub client_ip: IpAddr,
    /// The peer is inside `server.trusted_proxies`: its forwarding headers are believed.
    pub peer_trusted: bool,
    pub version: Version,
    /// Underscore spellings (`x_api_key`) dropped too: of the headers rate limits key on,
    /// and of those request rules set or remove.
    pub guarded_spellings: &'a [String],
    /// Whether the request may hold header names PHP and CGI fold (kept by
    /// `server.drop_invalid_headers = false`): only then are the spellings looked for.
    pub folding_names: bool,
}

/// Sets `X-Forwarded-For`, `X-Real-IP`, `X-Forwarded-Proto`, `X-Forwarded-Host`, `Via`
/// and the request ID on a request going upstream. Call after [`remove_hop_by_hop`], with `Host` already the
/// host the client asked for (its `Host`, or the `:authority` of HTTP/2 and absolute-form
/// targets): `X-Forwarded-Host` repeats it.
pub(crate) fn set_forwarding_headers(headers: &mut HeaderMap, ctx: &ForwardingContext<'_>) {
    if ctx.folding_names {
        remove_underscore_spellings(headers, ctx.guarded_spellings);
    }

    let peer = ctx.peer.ip;
    let peer_value = ctx.peer.value.clone();
    if ctx.peer_trusted {
        let previous: Vec<&str> = headers
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .collect();
        if previous.is_empty() {
            headers.insert(X_FORWARDED_FOR.clone(), peer_value.clone());
        } else {
            insert(
                headers,
                &X_FORWARDED_FOR,
                &format!("{}, {}", previous.join(", "), ctx.peer.text),
            );
        }
    } else {
        headers.remove(&FORWARDED);
        headers.insert(X_FORWARDED_FOR.clone(), peer_value.clone());
    }
    // From an untrusted peer (the usual case) the client is the peer: one value for both.
    let client_value = if ctx.client_ip == peer {
        peer_value
    } else {
        ip_value(ctx.client_ip)
    };
    headers.insert(X_REAL_IP.clone(), client_value);

    if !(ctx.peer_trusted && headers.contains_key(&X_FORWARDED_PROTO)) {
        let proto = if ctx.peer.tls { "https" } else { "http" };
        headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static(proto));
    }
    if !(ctx.peer_trusted && headers.contains_key(&X_FORWARDED_HOST)) {
        // The same bytes, shared (a host that is not visible ASCII is not repeated).
        match headers
            .get(header::HOST)
            .filter(|host| host.to_str().is_ok())
            .cloned()
        {
            Some(host) => {
                headers.insert(X_FORWARDED_HOST.clone(), host);
            }
            None => {
                headers.remove(&X_FORWARDED_HOST);
            }
        }
    }
    headers.append(header::VIA, via_value(ctx.version));
    if let Some((name, id)) = ctx.request_id {
        headers.insert(name.clone(), id.clone());
    }
}

/// An address as a header value (always valid: digits, dots, colons and hex).
fn ip_value(ip: IpAddr) -> HeaderValue {
    HeaderValue::try_from(crate::client_ip::ip_text(ip)).expect("an IP address is a valid header value")
}

fn via_value(version: Version) -> HeaderValue {
    HeaderValue::from_static(match version {
        Version::HTTP_09 => "0.9 floodgate",
        Version::HTTP_10 => "1.0 floodgate",
        Version::HTTP_2 => "2.0 floodgate",
        Version::HTTP_3 => "3.0 floodgate",
        _ => "1.1 floodgate",
    })
}

fn insert(headers: &mut HeaderMap, name: &HeaderName, value: &str) {
    match HeaderValue::from_str(value) {
        Ok(value) => {
            headers.insert(name.clone(), value);
        }
        Err(_) => {
            headers.remove(name);
        }
    }
}

/// Drops the spellings of protected names that PHP and CGI fold into them: with
/// `server.drop_invalid_headers` (the default) none are left to find.
fn remove_underscore_spellings(headers: &mut HeaderMap, guarded: &[String]) {
    let folds = |b: u8| !(b.is_ascii_alphanumeric() || b == b'-');
    let planted: Vec<HeaderName> = headers
        .keys()
        .filter(|name| name.as_str().bytes().any(folds))
        .filter(|name| {
            let normalized: String = name
                .as_str()
                .bytes()
                .map(|b| if b.is_ascii_alphanumeric() { b as char } else { '_' })
                .collect();
            UNDERSCORE_SPELLINGS.contains(&normalized.as_str()) || guarded.contains(&normalized)
        })
        .cloned()
        .collect();
    for name in planted {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        headers
    }

    fn name(text: &str) -> HeaderName {
        HeaderName::from_bytes(text.as_bytes()).unwrap()
    }

    #[test]
    fn rules_replace_every_value_then_remove_what_is_present() {
        let mut headers = map(&[
            ("x-env", "a"),
            ("x-env", "b"),
            ("server", "nginx"),
            ("x-powered-by", "PHP/5.6"),
            ("x-powered-by", "again"),
            ("content-type", "text/html"),
        ]);
        let rules = HeaderRules {
            set: vec![(name("x-env"), HeaderValue::from_static("prod"))],
            remove: vec![name("x-powered-by"), name("x-absent"), name("server")],
        };
        apply_rules(&rules, &mut headers);
        assert_eq!(all(&headers, "x-env"), ["prod"]);
        assert!(!headers.contains_key("x-powered-by"));
        assert!(!headers.contains_key("server"));
        assert_eq!(all(&headers, "content-type"), ["text/html"]);
        assert_eq!(headers.len(), 2);
    }

    fn ctx(peer: &Peer, trusted: bool) -> ForwardingContext<'_> {
        ForwardingContext {
            request_id: None,
            peer,
            client_ip: "198.51.100.7".parse().unwrap(),
            peer_trusted: trusted,
            version: Version::HTTP_11,
            guarded_spellings: &[],
            folding_names: true,
        }
    }

    fn peer() -> Peer {
        Peer::new("10.0.0.1:40000".parse().unwrap(), 8080, false)
    }

    fn all(headers: &HeaderMap, name: &str) -> Vec<String> {
        headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_are_removed() {
        let mut h = map(&[
            ("connection", "keep-alive, X-Secret, host"),
            ("keep-alive", "timeout=5"),
            ("x-secret", "1"),
            ("proxy-connection", "keep-alive"),
            ("te", "trailers"),
            ("trailer", "x-checksum"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("host", "app"),
            ("x-kept", "yes"),
        ]);
        remove_hop_by_hop(&mut h);
        let names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["host", "x-kept"]);
    }

    #[test]
    fn a_connection_naming_only_hop_by_hop_headers_removes_exactly_those_present() {
        let mut typical = map(&[("connection", "keep-alive"), ("content-length", "2")]);
        remove_hop_by_hop(&mut typical);
        assert_eq!(all(&typical, "content-length"), ["2"]);
        assert_eq!(typical.len(), 1);

        let mut mixed = map(&[
            ("connection", "Keep-Alive, UPGRADE, x-other"),
            ("upgrade", "websocket"),
            ("x-other", "1"),
            ("x-kept", "yes"),
        ]);
        remove_hop_by_hop(&mut mixed);
        let names: Vec<&str> = mixed.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["x-kept"]);
    }

    #[test]
    fn upgrade_is_detected_only_with_connection_upgrade_on_http11() {
        let ws = map(&[("connection", "keep-alive, Upgrade"), ("upgrade", "websocket")]);
        assert_eq!(requested_upgrade(Version::HTTP_11, &ws).unwrap(), "websocket");
        assert!(requested_upgrade(Version::HTTP_10, &ws).is_none());
        assert!(requested_upgrade(Version::HTTP_11, &map(&[("upgrade", "websocket")])).is_none());
        let h2c = map(&[("connection", "upgrade"), ("upgrade", "h2c")]);
        assert!(requested_upgrade(Version::HTTP_11, &h2c).is_none());
    }

    #[test]
    fn untrusted_peer_forwarding_headers_are_replaced() {
        let mut h = map(&[
            ("x-forwarded-for", "1.2.3.4"),
            ("x-real-ip", "1.2.3.4"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "evil.example"),
            ("host", "app.example.com"),
            ("forwarded", "for=1.2.3.4"),
            ("x_forwarded_for", "1.2.3.4"),
            ("x_real_ip", "1.2.3.4"),
            ("x-real_ip", "1.2.3.4"),
            ("x.real.ip", "1.2.3.4"),
            ("x_custom", "kept"),
        ]);
        set_forwarding_headers(&mut h, &ctx(&peer(), false));
        assert_eq!(all(&h, "x-forwarded-for"), ["10.0.0.1"]);
        assert_eq!(all(&h, "x-real-ip"), ["198.51.100.7"]);
        assert_eq!(all(&h, "x-forwarded-proto"), ["http"]);
        assert_eq!(all(&h, "x-forwarded-host"), ["app.example.com"]);
        assert_eq!(all(&h, "via"), ["1.1 floodgate"]);
        assert!(h.get("forwarded").is_none());
        assert!(h.get("x_forwarded_for").is_none());
        assert!(h.get("x_real_ip").is_none());
        assert!(h.get("x-real_ip").is_none());
        assert!(h.get("x.real.ip").is_none());
        assert_eq!(all(&h, "x_custom"), ["kept"]);
    }

    #[test]
    fn trusted_peer_forwarding_headers_are_appended_or_kept() {
        let mut h = map(&[
            ("x-forwarded-for", "198.51.100.7"),
            ("x-forwarded-for", "10.0.0.9"),
            ("x-forwarded-proto", "https"),
            ("via", "1.1 lb"),
            ("host", "app.example.com"),
        ]);
        set_forwarding_headers(&mut h, &ctx(&peer(), true));
        assert_eq!(all(&h, "x-forwarded-for"), ["198.51.100.7, 10.0.0.9, 10.0.0.1"]);
        assert_eq!(all(&h, "x-forwarded-proto"), ["https"]);
        assert_eq!(all(&h, "x-forwarded-host"), ["app.example.com"]);
        assert_eq!(all(&h, "via"), ["1.1 lb", "1.1 floodgate"]);
    }
}
