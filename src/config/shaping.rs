//! Validation of what shapes requests and responses (docs/configuration.md#header-rules):
//! a route's `request_headers` and `response_headers` rules, compiled here into header
//! names and values so that applying them parses nothing; `respond`'s `headers`; and
//! `[server.errors]`, the bodies of floodgate's own error responses, read at load.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::Path;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use toml::Spanned;

use super::error::ErrorSink;
use super::file::{ErrorPageFile, HeaderRulesFile};
use super::parse_spanned;

/// `set` and `remove` rules for one direction of one route.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderRules {
    pub set: Vec<(HeaderName, HeaderValue)>,
    pub remove: Vec<HeaderName>,
}

/// A route's rules of one direction and the server's as one (docs/configuration.md#header-rules):
/// the names either sets or removes, and the values that go in their place. A message's
/// headers are then read through them, each header once, instead of rewriting a map.
#[derive(Debug, PartialEq, Eq)]
pub struct CombinedRules {
    /// A bit for the length (modulo 64) of each name in `ruled`: most names are not
    /// ruled, and their length alone says so.
    lengths: u64,
    ruled: Vec<HeaderName>,
    set: Vec<(HeaderName, HeaderValue)>,
}

impl CombinedRules {
    /// The server's rules, then the route's (what applying one and then the other
    /// leaves); `None` when neither has any.
    pub fn of(server: &HeaderRules, route: &HeaderRules) -> Option<CombinedRules> {
        let ruled: Vec<HeaderName> = [server, route]
            .iter()
            .flat_map(|rules| rules.set.iter().map(|(name, _)| name).chain(&rules.remove))
            .cloned()
            .collect();
        if ruled.is_empty() {
            return None;
        }
        // A `set` of the server's goes unless the server removes that header too or the
        // route sets or removes it; a route's unless the route removes it. Of two sets of
        // one name in one table (`X-A` and `x-a` are two TOML keys), the later replaces
        // the earlier, as it does applied to a map.
        let set = last_of_each_name(&server.set)
            .filter(|(name, _)| {
                !server.remove.contains(name)
                    && !route.remove.contains(name)
                    && !route.set.iter().any(|(set, _)| set == name)
            })
            .chain(last_of_each_name(&route.set).filter(|(name, _)| !route.remove.contains(name)))
            .cloned()
            .collect();
        Some(CombinedRules {
            lengths: ruled.iter().fold(0, |lengths, name| lengths | length_bit(name)),
            ruled,
            set,
        })
    }

    /// Whether a rule sets or removes `name`: then the message's own values of it go no
    /// further, and [`Self::set`] says what does.
    pub fn names(&self, name: &HeaderName) -> bool {
        self.lengths & length_bit(name) != 0 && self.ruled.contains(name)
    }

    /// The headers the rules set, each name once.
    pub fn set(&self) -> &[(HeaderName, HeaderValue)] {
        &self.set
    }
}

/// The pairs of `set` no later pair of which has the same name.
fn last_of_each_name(set: &[(HeaderName, HeaderValue)]) -> impl Iterator<Item = &(HeaderName, HeaderValue)> {
    set.iter()
        .enumerate()
        .filter(|(i, (name, _))| !set[i + 1..].iter().any(|(later, _)| later == name))
        .map(|(_, pair)| pair)
}

/// `name`'s bit in [`CombinedRules::lengths`].
fn length_bit(name: &HeaderName) -> u64 {
    1 << (name.as_str().len() % 64)
}

/// A `respond` header's value (docs/configuration.md#routesrespond): fixed, or filled in
/// from the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueTemplate {
    Fixed(HeaderValue),
    Filled(Vec<TemplatePart>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplatePart {
    Text(String),
    /// The request's host, lowercase and without its port (nginx's `$host`).
    Host,
    /// The request's target as received, path and query (nginx's `$request_uri`).
    RequestUri,
}

/// A body for one of floodgate's own error statuses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorPage {
    pub body: Bytes,
    pub content_type: HeaderValue,
}

/// Which direction rules are for: what they may not touch differs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Direction {
    Request,
    Response,
}

/// Headers that describe the message itself: no rule may set or remove them.
const FRAMING: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "proxy-authenticate",
    "proxy-authorization",
];
/// What floodgate tells the upstream about the client: request rules may not change it.
const FORWARDING: [&str; 6] = [
    "x-forwarded-for",
    "x-real-ip",
    "x-forwarded-proto",
    "x-forwarded-host",
    "via",
    "host",
];
/// What floodgate tells the client about its limits: response rules may not change it.
const LIMITING: [&str; 6] = [
    "ratelimit",
    "ratelimit-policy",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "retry-after",
];

/// Whether `name` frames a request or is one floodgate sets for the upstream: no request
/// rule may touch it, and nothing else configured may take it over.
pub(super) fn reserved_on_requests(name: &HeaderName) -> bool {
    forbidden(name, Direction::Request).is_some()
}

/// Why a rule in `direction` may not set or remove `name`, where `request_id` is the
/// header of request IDs (floodgate's own, to the upstream and to the client alike).
fn refused(name: &HeaderName, (direction, request_id): Touching<'_>) -> Option<&'static str> {
    if request_id == Some(name) {
        return Some("it carries the request ID (server.request_id)");
    }
    forbidden(name, direction)
}

/// Which rules are read: their direction, and the header of request IDs if there is one.
pub(super) type Touching<'a> = (Direction, Option<&'a HeaderName>);

/// Why `name` may not be touched by a rule in `direction`, if it may not.
fn forbidden(name: &HeaderName, direction: Direction) -> Option<&'static str> {
    let name = name.as_str();
    if FRAMING.contains(&name) {
        return Some("it frames the message (hop-by-hop or Content-Length)");
    }
    match direction {
        Direction::Request if FORWARDING.contains(&name) => Some("floodgate sets it for the upstream"),
        Direction::Response if LIMITING.contains(&name) => Some("floodgate sets it with the rate limits"),
        _ => None,
    }
}

pub(super) fn header_rules(
    key: &str,
    raw: Option<&Spanned<HeaderRulesFile>>,
    touching: Touching<'_>,
    sink: &mut ErrorSink,
) -> Option<HeaderRules> {
    let Some(raw) = raw else {
        return Some(HeaderRules::default());
    };
    let raw = raw.get_ref();
    let mut valid = true;
    let mut rules = HeaderRules::default();
    for (name, value) in raw.set.as_ref().map(Spanned::get_ref).into_iter().flatten() {
        let at = format!("{key}.set.{name}");
        match header(name, value, &at, touching, sink, header_value) {
            Some(pair) => rules.set.push(pair),
            None => valid = false,
        }
    }
    for (i, name) in raw.remove.iter().flatten().enumerate() {
        let parsed = parse_spanned(name, format!("{key}.remove[{i}]"), sink, |text| {
            let name = HeaderName::from_bytes(text.as_bytes())
                .map_err(|_| format!("expected a header name, got {text:?}"))?;
            match refused(&name, touching) {
                Some(why) => Err(format!("{name} cannot be removed: {why}")),
                None => Ok(name),
            }
        });
        match parsed {
            Some(name) => rules.remove.push(name),
            None => valid = false,
        }
    }
    valid.then_some(rules)
}

/// One `"Name" = "value"` of a `set` or of `respond.headers`, the value read by
/// `parse_value`.
fn header<V>(
    name: &str,
    value: &Spanned<String>,
    at: &str,
    touching: Touching<'_>,
    sink: &mut ErrorSink,
    parse_value: impl FnOnce(&str) -> Result<V, String>,
) -> Option<(HeaderName, V)> {
    parse_spanned(value, at, sink, |text| {
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("expected a header name, got {name:?}"))?;
        if let Some(why) = refused(&name, touching) {
            return Err(format!("{name} cannot be set: {why}"));
        }
        Ok((name, parse_value(text)?))
    })
}

fn header_value(text: &str) -> Result<HeaderValue, String> {
    HeaderValue::from_str(text).map_err(|_| format!("expected a header value, got {text:?}"))
}

/// `respond.headers` of a response of `status`, which may not name `request_id`; a 3xx
/// status needs `Location`.
pub(super) fn respond_headers(
    key: &str,
    raw: Option<&Spanned<BTreeMap<String, Spanned<String>>>>,
    (status, request_id): (Option<StatusCode>, Option<&HeaderName>),
    span: std::ops::Range<usize>,
    sink: &mut ErrorSink,
) -> Option<Vec<(HeaderName, ValueTemplate)>> {
    let mut headers = Vec::new();
    let mut valid = true;
    for (name, value) in raw.map(Spanned::get_ref).into_iter().flatten() {
        if name.eq_ignore_ascii_case("content-type") {
            sink.push(
                Some(value.span()),
                format!("{key}.headers.{name}"),
                "set the type with content_type, not headers",
            );
            valid = false;
            continue;
        }
        let at = format!("{key}.headers.{name}");
        match header(
            name,
            value,
            &at,
            (Direction::Response, request_id),
            sink,
            value_template,
        ) {
            Some(pair) => headers.push(pair),
            None => valid = false,
        }
    }
    // A `Location` given but refused has its own error.
    if status.is_some_and(|s| s.is_redirection())
        && !raw
            .map(Spanned::get_ref)
            .into_iter()
            .flatten()
            .any(|(name, _)| name.eq_ignore_ascii_case("location"))
    {
        sink.push(
            Some(raw.map_or(span, Spanned::span)),
            format!("{key}.headers"),
            "a 3xx response needs headers = { \"Location\" = \"...\" }",
        );
        valid = false;
    }
    valid.then_some(headers)
}

/// A `respond` header value: `$host`, `$request_uri` (or `${host}`, `${request_uri}`) are
/// the request's, `$$` is a dollar sign.
fn value_template(text: &str) -> Result<ValueTemplate, String> {
    let mut parts = Vec::new();
    let mut literal = String::new();
    let mut rest = text;
    while let Some(dollar) = rest.find('$') {
        literal.push_str(&rest[..dollar]);
        let after = &rest[dollar + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            literal.push('$');
            rest = tail;
            continue;
        }
        let (name, tail) = match after.strip_prefix('{') {
            Some(braced) => braced
                .split_once('}')
                .ok_or_else(|| format!("a `${{` without its `}}` in {text:?}"))?,
            None => after.split_at(
                after
                    .bytes()
                    .take_while(|b| b.is_ascii_alphanumeric() || *b == b'_')
                    .count(),
            ),
        };
        let part = match name {
            "host" => TemplatePart::Host,
            "request_uri" => TemplatePart::RequestUri,
            _ => {
                return Err(format!(
                    "unknown variable ${name} in {text:?}: expected $host or $request_uri ($$ for a dollar sign)"
                ));
            }
        };
        if !literal.is_empty() {
            parts.push(TemplatePart::Text(std::mem::take(&mut literal)));
        }
        parts.push(part);
        rest = tail;
    }
    literal.push_str(rest);
    if parts.is_empty() {
        return header_value(&literal).map(ValueTemplate::Fixed);
    }
    if !literal.is_empty() {
        parts.push(TemplatePart::Text(literal));
    }
    if let Some(first) = parts.iter().position(|part| *part == TemplatePart::RequestUri)
        && !fixes_the_host(&parts[..first])
    {
        return Err(format!(
            "in {text:?} a request for //other.example could make $request_uri the host: put a scheme and host before it (\"https://$host$request_uri\") or a path starting with one / (\"/new$request_uri\")"
        ));
    }
    let texts: String = parts
        .iter()
        .filter_map(|part| match part {
            TemplatePart::Text(text) => Some(text.as_str()),
            _ => None,
        })
        .collect();
    header_value(&texts)?;
    Ok(ValueTemplate::Filled(parts))
}

/// Whether `before`, what precedes `$request_uri` in a value, leaves the target no way to
/// be read as a host, whatever it is (`//other.example/x`, as a client may send it): an
/// absolute URL with a host (`https://$host`, `https://example.com:8443/new`), or a path
/// that starts with one `/` (browsers read `\` as `/`). Without either, the target or a
/// bare scheme before it (`https:`) would make a URL whose host is the client's choice.
fn fixes_the_host(before: &[TemplatePart]) -> bool {
    // `$host`, the only variable before the first `$request_uri`, stands in as one
    // letter: it is filled with a host name, never empty and without slashes.
    let before: String = before
        .iter()
        .map(|part| match part {
            TemplatePart::Text(text) => text.as_str(),
            TemplatePart::Host | TemplatePart::RequestUri => "h",
        })
        .collect();
    if before.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return false;
    }
    if let Some(path) = before.strip_prefix('/') {
        return path.starts_with(|c: char| c != '/' && c != '\\');
    }
    let Some((scheme, rest)) = before.split_once("://") else {
        return false;
    };
    let scheme_is_valid = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    let host = rest.split(['/', '\\', '?', '#']).next().unwrap_or_default();
    scheme_is_valid && !host.is_empty()
}

/// The largest error page: each is held in memory, for every configuration loaded.
const MAX_PAGE: u64 = 1024 * 1024;

fn read_page(path: &Path) -> Result<Bytes, String> {
    let cannot = |e: std::io::Error| format!("cannot read {}: {e}", path.display());
    let mut body = Vec::new();
    std::fs::File::open(path)
        .and_then(|file| file.take(MAX_PAGE + 1).read_to_end(&mut body))
        .map_err(cannot)?;
    if body.len() as u64 > MAX_PAGE {
        return Err(format!("{} is larger than 1 MiB", path.display()));
    }
    Ok(Bytes::from(body))
}

/// The statuses `[server.errors]` may give a body for.
const ERROR_STATUSES: [u16; 10] = [400, 403, 404, 408, 413, 431, 501, 502, 503, 504];

/// `[server.errors]`: bodies read now (a `body_file` relative to the configuration's
/// directory).
pub(super) fn error_pages(
    raw: Option<&BTreeMap<String, Spanned<ErrorPageFile>>>,
    base: &Path,
    sink: &mut ErrorSink,
) -> HashMap<u16, ErrorPage> {
    let mut pages = HashMap::new();
    for (status, page) in raw.into_iter().flatten() {
        let key = format!("server.errors.{status}");
        let Some(code) = status.parse::<u16>().ok().filter(|s| ERROR_STATUSES.contains(s)) else {
            sink.push(
                Some(page.span()),
                key,
                format!("expected one of {ERROR_STATUSES:?}, got {status:?}"),
            );
            continue;
        };
        let raw = page.get_ref();
        let body = match (&raw.body, &raw.body_file) {
            (Some(body), None) => Some(Bytes::from(body.clone())),
            (None, Some(file)) => parse_spanned(file, format!("{key}.body_file"), sink, |path| {
                read_page(&base.join(path))
            }),
            _ => {
                sink.push(
                    Some(page.span()),
                    key.clone(),
                    "expected body = \"...\" or body_file = \"...\"",
                );
                None
            }
        };
        let content_type = super::content_type(&raw.content_type, &key, "text/plain; charset=utf-8", sink);
        if let (Some(body), Some(content_type)) = (body, content_type) {
            pages.insert(code, ErrorPage { body, content_type });
        }
    }
    pages
}
