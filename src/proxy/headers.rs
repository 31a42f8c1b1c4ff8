//! Header rewriting between client and upstream (docs/configuration.md#forwarding): hop-by-hop headers removed
//! (RFC 9110 §7.6.1, including the names listed in `Connection`), forwarding headers set by
//! floodgate alone, and other spellings of them dropped where invalid names are kept (PHP
//! and CGI read `X_Real_IP` and `X.Real.IP` as `HTTP_X_REAL_IP`, so a client could
//! otherwise plant one). What the forwarding headers become is decided once
//! ([`Forwarding`]) and then either written into the request's map or, for PHP-FPM, read
//! beside the client's headers as they would go ([`AsForwarded`]).

use std::net::IpAddr;

use http::Version;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use smallvec::SmallVec;

use crate::client_ip::Peer;
use crate::config::{CombinedRules, HeaderRules};
use crate::service::request_head::Seen;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static FORWARDED: HeaderName = HeaderName::from_static("forwarded");
pub(crate) static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
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
    // `Connection` comes first in hop_by_hop().
    if present[0] {
        for name in connection_named(headers) {
            headers.remove(name);
        }
    }
    for (name, present) in hop_by_hop().into_iter().zip(present) {
        if present {
            headers.remove(name);
        }
    }
}

/// The headers `Connection` names for removal besides the hop-by-hop ones, never `Host`.
/// A token naming a hop-by-hop header (as `keep-alive` and `close` do) is left out: that
/// header goes as hop-by-hop.
#[inline(always)]
pub(crate) fn connection_named(headers: &HeaderMap) -> Vec<HeaderName> {
    let mut named = Vec::new();
    for value in headers.get_all(header::CONNECTION) {
        named_by_connection(value, &mut named);
    }
    named
}

/// Adds to `named` the headers one `Connection` value names, as [`connection_named`].
#[inline(always)]
pub(crate) fn named_by_connection(value: &HeaderValue, named: &mut Vec<HeaderName>) {
    // What nearly every message says, checked whole first.
    let value = value.as_bytes();
    if value.eq_ignore_ascii_case(b"keep-alive") || value.eq_ignore_ascii_case(b"close") {
        return;
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

/// Whether `name` is a hop-by-hop header.
pub(crate) fn is_hop_by_hop_name(name: &HeaderName) -> bool {
    hop_by_hop().contains(&name)
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
    // HTTP/2 is the client's to speak to floodgate, not a tunnel past its routes and limits:
    // a list that offers h2c (in any version) asks for no switch.
    let offers_h2c = upgrade.to_str().map_or(true, |v| {
        v.split(',').any(|protocol| {
            let name = protocol.split('/').next().unwrap_or("");
            name.trim().eq_ignore_ascii_case("h2c")
        })
    });
    (connection_says_upgrade && !offers_h2c).then(|| upgrade.clone())
}

/// Whether a `101` with `answered` headers switches to the protocol the request, with
/// `asked` headers (as forwarded), named in its `Upgrade`.
pub(crate) fn switches_as_asked(asked: &HeaderMap, answered: &HeaderMap) -> bool {
    fn upgrade(headers: &HeaderMap) -> Option<&str> {
        headers.get(header::UPGRADE)?.to_str().ok()
    }
    let (Some(asked), Some(answered)) = (upgrade(asked), upgrade(answered)) else {
        return false;
    };
    let answered = answered.trim();
    asked
        .split(',')
        .any(|offered| offered.trim().eq_ignore_ascii_case(answered))
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
    /// Which of the headers read here the request has, from its head's checks.
    pub seen: Seen,
}

/// Sets `X-Forwarded-For`, `X-Real-IP`, `X-Forwarded-Proto`, `X-Forwarded-Host`, `Via`
/// and the request ID on a request going upstream. Call after [`remove_hop_by_hop`], with `Host` already the
/// host the client asked for (its `Host`, or the `:authority` of HTTP/2 and absolute-form
/// targets): `X-Forwarded-Host` repeats it.
pub(crate) fn set_forwarding_headers(headers: &mut HeaderMap, ctx: &ForwardingContext<'_>) {
    if ctx.folding_names {
        remove_underscore_spellings(headers, ctx.guarded_spellings);
    }
    let forwarding = Forwarding::decide(headers, headers.get(header::HOST), ctx);
    if forwarding.drops_forwarded {
        headers.remove(&FORWARDED);
    }
    match forwarding.forwarded_for {
        Some(chain) => headers.insert(X_FORWARDED_FOR.clone(), chain),
        None => headers.remove(&X_FORWARDED_FOR),
    };
    headers.insert(X_REAL_IP.clone(), forwarding.real_ip);
    if let Some(proto) = forwarding.proto {
        headers.insert(X_FORWARDED_PROTO.clone(), proto);
    }
    match forwarding.host {
        Owned::Keep => None,
        Owned::Set(host) => headers.insert(X_FORWARDED_HOST.clone(), host),
        Owned::Remove => headers.remove(&X_FORWARDED_HOST),
    };
    headers.append(header::VIA, forwarding.via);
    if let Some((name, id)) = forwarding.request_id {
        headers.insert(name.clone(), id.clone());
    }
}

/// What becomes of a forwarding header the client may have sent.
enum Owned {
    /// The client's values go on (a trusted proxy's).
    Keep,
    /// Replaced by this value.
    Set(HeaderValue),
    Remove,
}

/// The forwarding headers of a request going upstream, decided from its headers and
/// connection.
struct Forwarding<'a> {
    /// `X-Forwarded-For`; `None` when a trusted chain makes no valid value.
    forwarded_for: Option<HeaderValue>,
    /// Whether `Forwarded` goes (from an untrusted peer).
    drops_forwarded: bool,
    real_ip: HeaderValue,
    /// `X-Forwarded-Proto`; `None` keeps a trusted proxy's.
    proto: Option<HeaderValue>,
    /// `X-Forwarded-Host`.
    host: Owned,
    /// After the client's.
    via: HeaderValue,
    request_id: Option<(&'a HeaderName, &'a HeaderValue)>,
}

impl<'a> Forwarding<'a> {
    /// The forwarding headers for a request with `headers` (hop-by-hop ones gone) asking
    /// for `host`. Inlined: returned from a call, the decision costs about 150
    /// instructions more (callgrind), on every proxied request.
    #[inline(always)]
    fn decide(headers: &HeaderMap, host: Option<&HeaderValue>, ctx: &ForwardingContext<'a>) -> Self {
        let peer_value = ctx.peer.value.clone();
        let forwarded_for = if ctx.peer_trusted {
            let previous: Vec<&str> = headers
                .get_all(&X_FORWARDED_FOR)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .collect();
            if previous.is_empty() {
                Some(peer_value.clone())
            } else {
                HeaderValue::from_str(&format!("{}, {}", previous.join(", "), ctx.peer.text)).ok()
            }
        } else {
            Some(peer_value.clone())
        };
        // From an untrusted peer (the usual case) the client is the peer: one value for both.
        let real_ip = if ctx.client_ip == ctx.peer.ip {
            peer_value
        } else {
            ip_value(ctx.client_ip)
        };
        let proto = (!(ctx.peer_trusted && headers.contains_key(&X_FORWARDED_PROTO))).then(|| {
            const HTTPS: HeaderValue = HeaderValue::from_static("https");
            const HTTP: HeaderValue = HeaderValue::from_static("http");
            if ctx.peer.tls { HTTPS } else { HTTP }
        });
        let host = if ctx.peer_trusted && headers.contains_key(&X_FORWARDED_HOST) {
            Owned::Keep
        } else {
            // The same bytes, shared (a host that is not visible ASCII is not repeated).
            match host.filter(|host| host.to_str().is_ok()) {
                Some(host) => Owned::Set(host.clone()),
                None => Owned::Remove,
            }
        };
        Forwarding {
            forwarded_for,
            drops_forwarded: !ctx.peer_trusted,
            real_ip,
            proto,
            host,
            via: via_value(ctx.version),
            request_id: ctx.request_id,
        }
    }
}

/// The headers of a request as they go upstream, read without rewriting its map: the
/// client's, less the hop-by-hop ones and those floodgate replaces, then floodgate's (the
/// `Host` of the target, the forwarding headers, `Via` after the client's), then what the
/// header rules set. This is what the map would hold after [`remove_hop_by_hop`], the
/// target's `Host`, [`set_forwarding_headers`], a dropped `tracestate` and
/// [`apply_rules`] (the server's, then the route's), for a request whose `Connection`
/// names nothing else and with no folding names to look for: an upstream's request head
/// and PHP-FPM's parameters are written from it, and rewriting a map only to read it back
/// costs more than the request's own head.
pub(crate) struct AsForwarded<'a> {
    headers: &'a HeaderMap,
    /// `Host` as the target names it (HTTP/2, absolute-form), in place of the client's.
    host: Option<HeaderValue>,
    forwarding: Forwarding<'a>,
    /// `tracestate`, when the client's goes.
    dropped: Option<&'a HeaderName>,
    /// Whether the client sent `Via`.
    client_via: bool,
    /// The server's request rules and the route's, if either has any.
    rules: Option<&'a CombinedRules>,
}

impl<'a> AsForwarded<'a> {
    /// Whether the headers `headers` go upstream with can be read as they go: not when
    /// `Connection` names any besides the hop-by-hop ones, nor when the request may hold
    /// names that PHP folds (both need the map rewritten).
    pub(crate) fn readable(headers: &HeaderMap, ctx: &ForwardingContext<'_>) -> bool {
        !ctx.folding_names && (!ctx.seen.connection || connection_named(headers).is_empty())
    }

    /// The headers `headers` go upstream with, the target's `host` in place of the
    /// client's, without the `dropped` header, `rules` (the server's and the route's)
    /// applied; for headers that are [`readable`](Self::readable).
    pub(crate) fn new(
        headers: &'a HeaderMap,
        host: Option<HeaderValue>,
        dropped: Option<&'a HeaderName>,
        ctx: &ForwardingContext<'a>,
        rules: Option<&'a CombinedRules>,
    ) -> Self {
        let forwarding = Forwarding::decide(headers, host.as_ref().or(headers.get(header::HOST)), ctx);
        AsForwarded {
            headers,
            host,
            forwarding,
            dropped,
            client_via: ctx.seen.via,
            rules,
        }
    }

    /// The first value `name` goes with, of a header the client may send (floodgate's own
    /// are not looked at).
    pub(crate) fn first(&self, name: &HeaderName) -> Option<&HeaderValue> {
        if self.ruled(name) {
            self.set().find(|(set, _)| *set == name).map(|(_, value)| value)
        } else {
            self.headers.get(name).filter(|_| self.goes_as_sent(name))
        }
    }

    /// Whether a rule sets or removes `name`: then the rules alone say what it goes with.
    fn ruled(&self, name: &HeaderName) -> bool {
        self.rules.is_some_and(|rules| rules.names(name))
    }

    /// Whether the client's values of `name` go as they came: not hop-by-hop, nor
    /// replaced. One match on the name (by length, then bytes) where comparing names one
    /// by one cost more per header than the rewrite of the map it spares.
    fn goes_as_sent(&self, name: &HeaderName) -> bool {
        let forwarding = &self.forwarding;
        match name.as_str() {
            // hop_by_hop(), and `Via`, which comes with floodgate's.
            "connection" | "keep-alive" | "proxy-connection" | "te" | "trailer" | "transfer-encoding"
            | "upgrade" | "via" => false,
            "host" => self.host.is_none(),
            "x-forwarded-for" | "x-real-ip" => false,
            "forwarded" => !forwarding.drops_forwarded,
            "x-forwarded-proto" => forwarding.proto.is_none(),
            "x-forwarded-host" => matches!(forwarding.host, Owned::Keep),
            _ => {
                self.dropped.is_none_or(|dropped| dropped != name)
                    && forwarding.request_id.is_none_or(|(id, _)| id != name)
            }
        }
    }

    // The headers as they go come in three runs that share no name, each with a name's
    // values one after the other: [`sent`](Self::sent), [`added`](Self::added) and
    // [`via`](Self::via). Runs, not one chain of iterators: stepping through a chain of
    // five cost more than the rewrite it spares.

    /// The client's headers that go as sent.
    pub(crate) fn sent(&self) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
        self.headers
            .iter()
            .filter(|(name, _)| self.goes_as_sent(name) && !self.ruled(name))
    }

    /// floodgate's headers, `Via` apart.
    pub(crate) fn added<'s>(&'s self) -> impl Iterator<Item = (&'s HeaderName, &'s HeaderValue)> {
        let forwarding = &self.forwarding;
        let forwarded_host = match &forwarding.host {
            Owned::Set(host) => Some(host),
            Owned::Keep | Owned::Remove => None,
        };
        // Collected one by one: stepping through a chain of adapters over them cost about
        // 300 instructions.
        let mut added: SmallVec<[(&HeaderName, &HeaderValue); 6]> = SmallVec::new();
        let mut add = |name: &'s HeaderName, value: Option<&'s HeaderValue>| {
            if let Some(value) = value
                && !self.ruled(name)
            {
                added.push((name, value));
            }
        };
        add(&header::HOST, self.host.as_ref());
        add(&X_FORWARDED_FOR, forwarding.forwarded_for.as_ref());
        add(&X_REAL_IP, Some(&forwarding.real_ip));
        add(&X_FORWARDED_PROTO, forwarding.proto.as_ref());
        add(&X_FORWARDED_HOST, forwarded_host);
        if let Some((name, id)) = forwarding.request_id {
            add(name, Some(id));
        }
        added.into_iter()
    }

    /// `Via`: the client's values, then floodgate's.
    pub(crate) fn via(&self) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
        let mut values: SmallVec<[&HeaderValue; 2]> = SmallVec::new();
        if !self.ruled(&header::VIA) {
            if self.client_via {
                values.extend(self.headers.get_all(header::VIA));
            }
            values.push(&self.forwarding.via);
        }
        values.into_iter().map(|value| (&header::VIA, value))
    }

    /// What the rules set.
    pub(crate) fn set(&self) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
        self.rules
            .map_or(&[][..], CombinedRules::set)
            .iter()
            .map(|(name, value)| (name, value))
    }
}

/// An address as a header value (always valid: digits, dots, colons and hex).
fn ip_value(ip: IpAddr) -> HeaderValue {
    HeaderValue::try_from(crate::client_ip::ip_text(ip)).expect("an IP address is a valid header value")
}

fn via_value(version: Version) -> HeaderValue {
    // Constants: `from_static` called at run time checks each byte.
    const VIA_09: HeaderValue = HeaderValue::from_static("0.9 floodgate");
    const VIA_10: HeaderValue = HeaderValue::from_static("1.0 floodgate");
    const VIA_11: HeaderValue = HeaderValue::from_static("1.1 floodgate");
    const VIA_2: HeaderValue = HeaderValue::from_static("2.0 floodgate");
    const VIA_3: HeaderValue = HeaderValue::from_static("3.0 floodgate");
    match version {
        Version::HTTP_09 => VIA_09,
        Version::HTTP_10 => VIA_10,
        Version::HTTP_2 => VIA_2,
        Version::HTTP_3 => VIA_3,
        _ => VIA_11,
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
            seen: Seen {
                declared: None,
                connection: true,
                upgrade: true,
                via: true,
            },
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
        for offered in ["h2c", "websocket, h2c", "websocket,H2C/2"] {
            let h2c = map(&[("connection", "upgrade"), ("upgrade", offered)]);
            assert!(requested_upgrade(Version::HTTP_11, &h2c).is_none(), "{offered}");
        }
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

    /// What a map holds, name by name, each name's values in order.
    fn as_lists<'a>(
        pairs: impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)>,
    ) -> std::collections::BTreeMap<String, Vec<Vec<u8>>> {
        let mut lists = std::collections::BTreeMap::<String, Vec<Vec<u8>>>::new();
        for (name, value) in pairs {
            lists
                .entry(name.to_string())
                .or_default()
                .push(value.as_bytes().to_vec());
        }
        lists
    }

    proptest::proptest! {
        /// Reading the headers as they go gives what rewriting the map gives, for every
        /// request whose headers can be read so: the client's forwarding headers, hop-by-hop
        /// ones, `Via`, `Host`s, trusted or not, with a target host or not.
        #[test]
        fn headers_read_as_they_go_are_the_rewritten_maps(
            sent in proptest::collection::vec((0usize..19, 0usize..6), 0..12),
            trusted: bool,
            client_is_peer: bool,
            tls: bool,
            with_id: bool,
            target_host: bool,
            drops_tracestate: bool,
            rules in proptest::collection::vec((0usize..4, 0usize..20, 0usize..6), 0..6),
        ) {
            // Every hop-by-hop name among them: `goes_as_sent` spells the list out again.
            const NAMES: [&str; 20] = [
                "x-forwarded-for", "x-real-ip", "x-forwarded-proto", "x-forwarded-host",
                "forwarded", "via", "host", "connection", "keep-alive", "proxy-connection", "te",
                "trailer", "transfer-encoding", "upgrade", "tracestate", "x-request-id", "accept",
                "cookie", "x-forwarded-port", "content-type",
            ];
            for hop in hop_by_hop() {
                proptest::prop_assert!(NAMES.contains(&hop.as_str()), "{hop} not tried");
            }
            let values: [&[u8]; 6] = [
                b"keep-alive", b"1.2.3.4", b"", b"shop.example:8080", b"caf\xc3\xa9.example", b"upgrade",
            ];
            let mut headers = HeaderMap::new();
            for (name, value) in sent {
                headers.append(
                    HeaderName::from_static(NAMES[name]),
                    HeaderValue::from_bytes(values[value]).unwrap(),
                );
            }
            // Rules of the server (0: set, 1: remove) and the route (2, 3), as validation
            // allows them (no hop-by-hop names).
            let (mut server_rules, mut route_rules) = (HeaderRules::default(), HeaderRules::default());
            for (kind, name, value) in rules {
                let name = HeaderName::from_static(NAMES[name]);
                if hop_by_hop().contains(&&name) {
                    continue;
                }
                let value = HeaderValue::from_bytes(values[value]).unwrap();
                let target = if kind < 2 { &mut server_rules } else { &mut route_rules };
                // A name set twice in one table, as `X-A` and `x-a` can be.
                match kind % 2 {
                    0 => target.set.push((name, value)),
                    _ => target.remove.push(name),
                }
            }
            let peer = Peer::new("10.0.0.1:40000".parse().unwrap(), 8080, tls);
            let id = HeaderValue::from_static("0af7651916cd43dd8448eb211c80319c");
            let id_name = HeaderName::from_static("x-request-id");
            let ctx = ForwardingContext {
                request_id: with_id.then_some((&id_name, &id)),
                peer: &peer,
                client_ip: if client_is_peer { peer.ip } else { "198.51.100.7".parse().unwrap() },
                peer_trusted: trusted,
                version: Version::HTTP_11,
                guarded_spellings: &[],
                folding_names: false,
                seen: Seen {
                    declared: None,
                    connection: headers.contains_key(header::CONNECTION),
                    upgrade: headers.contains_key(header::UPGRADE),
                    via: headers.contains_key(header::VIA),
                },
            };
            proptest::prop_assume!(AsForwarded::readable(&headers, &ctx));
            let host = target_host.then(|| HeaderValue::from_static("target.example"));
            let dropped = drops_tracestate.then_some(&crate::trace::TRACESTATE);

            let mut rewritten = headers.clone();
            remove_hop_by_hop(&mut rewritten);
            if let Some(host) = host.clone() {
                rewritten.insert(header::HOST, host);
            }
            set_forwarding_headers(&mut rewritten, &ctx);
            if let Some(dropped) = dropped {
                rewritten.remove(dropped);
            }
            apply_rules(&server_rules, &mut rewritten);
            apply_rules(&route_rules, &mut rewritten);

            let combined = CombinedRules::of(&server_rules, &route_rules);
            let read = AsForwarded::new(&headers, host, dropped, &ctx, combined.as_ref());
            for name in ["accept", "cookie", "content-type", "tracestate"] {
                proptest::prop_assert_eq!(read.first(&HeaderName::from_static(name)), rewritten.get(name), "{}", name);
            }
            let mut runs = as_lists(read.sent());
            for run in [as_lists(read.added()), as_lists(read.via()), as_lists(read.set())] {
                for (name, values) in run {
                    proptest::prop_assert!(runs.insert(name.clone(), values).is_none(), "{name} in two runs");
                }
            }
            proptest::prop_assert_eq!(runs, as_lists(rewritten.iter()));
        }
    }
}
