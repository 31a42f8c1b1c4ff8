//! Validation of `[redis]` and `[limits.NAME]` (docs/configuration.md#redis, #limitsname): each algorithm accepts only its
//! own keys, every value is range-checked, and key parts are parsed once.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http::header::{HeaderName, HeaderValue};
use ipnet::IpNet;
use toml::Spanned;

use super::error::ErrorSink;
use super::file::{LimitFile, RedisFile};
use super::{parse_or, parse_spanned, status_in, values};
use crate::client_ip::ip_text;
use crate::host::normalize_host;
use crate::limit::algorithm::{interval, micros};
use crate::limit::key::{MAX_LIMIT_NAME_LEN, MAX_PREFIX_LEN, PartKind, TupleEncoder};
use crate::limit::redis::RedisTarget;
use crate::limit::store::OnError;
use crate::limit::{Algorithm, MAX_TIME_MICROS};
use crate::path::{normalize_path, slashes_decoded};

/// `redis.prefix` when the file does not set it; the in-process store's keys start with it too.
pub(crate) const DEFAULT_PREFIX: &str = "floodgate";
const DEFAULT_REDIS_TIMEOUT: Duration = Duration::from_millis(50);
const DEFAULT_MESSAGE: &str = "Too Many Requests\n";
const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The shortest `lease`: renewals go out every second.
const MIN_LEASE: Duration = Duration::from_secs(3);

/// `[redis]`: present means the shared Redis store decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    pub target: RedisTarget,
    /// Every key floodgate writes starts with this.
    pub prefix: String,
    /// Deadline for one decision.
    pub timeout: Duration,
    pub on_error: OnError,
}

impl RedisConfig {
    /// Defaults for everything but the URL (for `FLOODGATE_REDIS_URL` without `[redis]`).
    pub fn with_url(url: String) -> Self {
        RedisConfig {
            target: RedisTarget::Url(url),
            prefix: DEFAULT_PREFIX.to_owned(),
            timeout: DEFAULT_REDIS_TIMEOUT,
            on_error: OnError::Allow,
        }
    }
}

/// A named limit, shared by every route that lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct LimitConfig {
    pub name: Arc<str>,
    pub key: Vec<KeyPart>,
    pub exempt: Vec<IpNet>,
    pub mode: Mode,
    pub status: StatusCode,
    pub message: Bytes,
    /// The `Content-Type` of `message`.
    pub content_type: HeaderValue,
    pub kind: LimitKind,
}

/// What a limit counts.
#[derive(Debug, Clone, PartialEq)]
pub enum LimitKind {
    /// Requests (or failures) over time.
    Rate(RateLimit),
    /// `algorithm = "concurrency"`: requests in flight (no RateLimit header items).
    Concurrency(Concurrency),
}

/// A rate limit: its algorithm, and what else only a rate limit has.
#[derive(Debug, Clone, PartialEq)]
pub struct RateLimit {
    pub algorithm: Algorithm,
    pub lockout: Option<Duration>,
    /// With `count = "failures"`: the response statuses that consume (`None`: every
    /// admitted request consumes).
    pub failures: Option<Vec<StatusCode>>,
    /// Other parameters, or an exemption, for some keys.
    pub overrides: Overrides,
}

impl LimitConfig {
    /// The rate limit, unless this is a concurrency limit.
    pub fn rate(&self) -> Option<&RateLimit> {
        match &self.kind {
            LimitKind::Rate(rate) => Some(rate),
            LimitKind::Concurrency(_) => None,
        }
    }

    /// Whether the limit counts failed responses (`count = "failures"`).
    pub fn counts_failures(&self) -> bool {
        self.rate().is_some_and(|rate| rate.failures.is_some())
    }
}

/// `algorithm = "concurrency"`: at most `limit` requests of one key in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Concurrency {
    pub limit: u64,
    /// In Redis, how long a slot whose instance stopped renewing it stays taken.
    pub lease: Duration,
}

/// A limit's `overrides`: found by the request's key tuple in one lookup; entries with a
/// CIDR for a `client_ip` part are tried one by one (first match in file order wins).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Overrides {
    /// Entries by the tuple their values make (entries with addresses only).
    exact: HashMap<String, usize>,
    /// Entries with a network, in file order: per key part, what matches.
    networks: Vec<(usize, Vec<PartMatch>)>,
    /// What each entry does, in file order.
    entries: Vec<Override>,
}

/// What an override does to its keys.
#[derive(Debug, Clone, PartialEq)]
pub enum Override {
    Exempt,
    /// The limit with the entry's parameters.
    Algorithm(Algorithm),
}

/// How one key part of a network entry matches.
#[derive(Debug, Clone, PartialEq)]
enum PartMatch {
    /// The client's address is in it.
    Network(IpNet),
    /// The part, encoded as a one-part tuple, is this.
    Encoded(String),
}

impl Overrides {
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The first entry matching a request whose key tuple is `tuple`; `part(i)` encodes
    /// the request's key part `i` alone (asked only for network entries).
    pub fn find(&self, tuple: &str, client_ip: IpAddr, part: impl Fn(usize) -> String) -> Option<&Override> {
        let exact = self.exact.get(tuple).copied();
        let network = self
            .networks
            .iter()
            .take_while(|(index, _)| exact.is_none_or(|exact| *index < exact))
            .find(|(_, matches)| {
                matches.iter().enumerate().all(|(i, matcher)| match matcher {
                    PartMatch::Network(net) => net.contains(&client_ip),
                    PartMatch::Encoded(encoded) => part(i) == *encoded,
                })
            })
            .map(|(index, _)| *index);
        network.or(exact).map(|index| &self.entries[index])
    }
}

/// `enforce` or `shadow` (count and log, never reject).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Enforce,
    Shadow,
}

/// One part of a limit's key tuple.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    ClientIp,
    Header(HeaderName),
    Query(String),
    Cookie(String),
    Method,
    Path,
    Host,
    Route,
}

impl KeyPart {
    /// The part as `key` names it: `client_ip`, `header:x-api-key`, ...
    pub fn name(&self) -> String {
        match self {
            KeyPart::ClientIp => "client_ip".into(),
            KeyPart::Header(name) => format!("header:{name}"),
            KeyPart::Query(name) => format!("query:{name}"),
            KeyPart::Cookie(name) => format!("cookie:{name}"),
            KeyPart::Method => "method".into(),
            KeyPart::Path => "path".into(),
            KeyPart::Host => "host".into(),
            KeyPart::Route => "route".into(),
        }
    }

    /// How a request's part reads when its client sent `value` (the path normalized with
    /// encoded slashes read as slashes, the host in lower case without port or trailing
    /// dot): an override entry or an admin query that differs from it names what requests
    /// read instead. `Err` when no request reads so.
    pub(crate) fn as_requests_read(&self, value: &str) -> Result<String, String> {
        match self {
            KeyPart::Path => {
                let normalized = normalize_path(value).map_err(|e| format!("{e}"))?;
                Ok(slashes_decoded(&normalized)
                    .map_err(|e| format!("{e}"))?
                    .into_owned())
            }
            KeyPart::Host => normalize_host(value)
                .map(Cow::into_owned)
                .ok_or_else(|| "a request's host is never empty".to_owned()),
            _ => Ok(value.to_owned()),
        }
    }
}

pub(super) fn validate_redis(raw: Option<Spanned<RedisFile>>, sink: &mut ErrorSink) -> Option<RedisConfig> {
    let raw = raw?;
    let span = raw.span();
    let raw = raw.into_inner();
    let cluster = raw.cluster.as_ref().is_some_and(|c| *c.get_ref());
    let url = raw
        .url
        .as_ref()
        .and_then(|url| parse_spanned(url, "redis.url", sink, redis_url));
    let target = match (&raw.url, &raw.sentinels, &raw.master_name) {
        (Some(_), None, None) if cluster => url.map(RedisTarget::Cluster),
        (Some(_), None, None) => url.map(RedisTarget::Url),
        (None, Some(sentinels), Some(_)) if cluster => {
            sink.push(
                Some(sentinels.span()),
                "redis.sentinels",
                "expected either `cluster = true` with a seed `url`, or `sentinels`",
            );
            None
        }
        (None, Some(sentinels), Some(master)) => {
            let nodes: Option<Vec<String>> = sentinels
                .get_ref()
                .iter()
                .map(|node| match redis_url(node) {
                    Ok(node) => Some(node),
                    Err(message) => {
                        sink.push(Some(sentinels.span()), "redis.sentinels", message);
                        None
                    }
                })
                .collect();
            if sentinels.get_ref().is_empty() {
                sink.push(
                    Some(sentinels.span()),
                    "redis.sentinels",
                    "expected at least one sentinel URL",
                );
            }
            if master.get_ref().trim().is_empty() {
                sink.push(
                    Some(master.span()),
                    "redis.master_name",
                    "expected the monitored master's name",
                );
            }
            nodes
                .filter(|n| !n.is_empty())
                .map(|sentinels| RedisTarget::Sentinel {
                    sentinels,
                    master_name: master.get_ref().trim().to_owned(),
                })
        }
        (Some(url), Some(_), _) => {
            sink.both(url.span(), "redis.url", "url", "sentinels");
            None
        }
        (None, Some(sentinels), None) => {
            sink.push(
                Some(sentinels.span()),
                "redis.master_name",
                "is required with `sentinels`",
            );
            None
        }
        (_, None, Some(master)) => {
            sink.push(
                Some(master.span()),
                "redis.sentinels",
                "is required with `master_name`",
            );
            None
        }
        (None, None, None) => {
            sink.push(
                Some(span),
                "redis",
                "expected `url = \"redis://host:port\"`, or `sentinels` and `master_name`",
            );
            None
        }
    };
    let prefix = parse_or(
        &raw.prefix,
        "redis.prefix",
        DEFAULT_PREFIX.to_owned(),
        sink,
        key_prefix,
    );
    let timeout = parse_or(
        &raw.timeout,
        "redis.timeout",
        DEFAULT_REDIS_TIMEOUT,
        sink,
        values::positive_duration,
    );
    let on_error = parse_or(
        &raw.on_error,
        "redis.on_error",
        OnError::Allow,
        sink,
        |text| match text {
            "allow" => Ok(OnError::Allow),
            "deny" => Ok(OnError::Deny),
            "local" => Ok(OnError::Local),
            other => Err(format!(
                "expected \"allow\", \"deny\" or \"local\", got {other:?}"
            )),
        },
    );
    Some(RedisConfig {
        target: target?,
        prefix,
        timeout,
        on_error,
    })
}

/// A Redis URL, checked without ever echoing its password.
pub(super) fn redis_url(text: &str) -> Result<String, String> {
    let text = text.trim();
    if !text.starts_with("redis://") && !text.starts_with("rediss://") {
        return Err(
            "expected a URL such as \"redis://127.0.0.1:6379/0\" or \"rediss://...\" (TLS)".to_owned(),
        );
    }
    redis::IntoConnectionInfo::into_connection_info(text)
        .map(|_| text.to_owned())
        .map_err(|_| "expected a URL such as \"redis://[user:password@]host:port/db\"".to_owned())
}

fn key_prefix(text: &str) -> Result<String, String> {
    let valid = !text.is_empty()
        && text.len() <= MAX_PREFIX_LEN
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.:".contains(&b));
    if valid {
        Ok(text.to_owned())
    } else {
        Err(format!(
            "expected 1 to {MAX_PREFIX_LEN} characters from A-Z a-z 0-9 _ - . :, got {text:?}"
        ))
    }
}

pub(super) fn validate_limits(
    raw: BTreeMap<String, Spanned<LimitFile>>,
    sink: &mut ErrorSink,
) -> BTreeMap<String, Arc<LimitConfig>> {
    let mut limits = BTreeMap::new();
    for (name, limit) in raw {
        let span = limit.span();
        if let Some(limit) = validate_limit(&name, span, limit.into_inner(), sink) {
            limits.insert(name, Arc::new(limit));
        }
    }
    limits
}

fn validate_limit(
    name: &str,
    span: std::ops::Range<usize>,
    raw: LimitFile,
    sink: &mut ErrorSink,
) -> Option<LimitConfig> {
    let key = format!("limits.{name}");
    if name.len() > MAX_LIMIT_NAME_LEN
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
    {
        sink.push(
            Some(span.clone()),
            key.clone(),
            format!("expected a limit name of 1 to {MAX_LIMIT_NAME_LEN} characters from A-Z a-z 0-9 _ - ."),
        );
    }
    let key_parts = match &raw.key {
        None => Some(vec![KeyPart::ClientIp]),
        Some(parts) if parts.is_empty() => {
            sink.push(
                None,
                format!("{key}.key"),
                "expected at least one key part, e.g. [\"client_ip\"]",
            );
            None
        }
        Some(parts) => parts
            .iter()
            .enumerate()
            .map(|(i, part)| parse_spanned(part, format!("{key}.key[{i}]"), sink, key_part))
            .collect::<Option<Vec<_>>>(),
    };
    let kind = match raw.algorithm.get_ref().as_str() {
        "concurrency" => validate_concurrency(&key, span, &raw, sink).map(LimitKind::Concurrency),
        _ => validate_rate(&key, span, &raw, key_parts.as_deref(), sink).map(LimitKind::Rate),
    };
    let exempt = super::cidrs(&raw.exempt, &format!("{key}.exempt"), sink);
    let mode = parse_or(
        &raw.mode,
        &format!("{key}.mode"),
        Mode::Enforce,
        sink,
        |text| match text {
            "enforce" => Ok(Mode::Enforce),
            "shadow" => Ok(Mode::Shadow),
            other => Err(format!("expected \"enforce\" or \"shadow\", got {other:?}")),
        },
    );
    let status = match &raw.status {
        None => Some(StatusCode::TOO_MANY_REQUESTS),
        Some(status) => status_in(status, 400..=599, format!("{key}.status"), sink),
    };
    let content_type = super::content_type(&raw.content_type, &key, "text/plain; charset=utf-8", sink);
    let message = raw.message.as_ref().map_or_else(
        || Bytes::from_static(DEFAULT_MESSAGE.as_bytes()),
        |m| Bytes::from(m.get_ref().clone()),
    );
    Some(LimitConfig {
        name: Arc::from(name),
        key: key_parts?,
        exempt,
        mode,
        status: status?,
        message,
        content_type: content_type?,
        kind: kind?,
    })
}

/// A rate limit: its algorithm, `lockout`, `count` and `overrides` (of a limit whose key
/// parts are `parts`, when they are valid).
fn validate_rate(
    key: &str,
    span: std::ops::Range<usize>,
    raw: &LimitFile,
    parts: Option<&[KeyPart]>,
    sink: &mut ErrorSink,
) -> Option<RateLimit> {
    if let Some(lease) = &raw.lease {
        sink.push(
            Some(lease.span()),
            format!("{key}.lease"),
            "lease applies only to algorithm = \"concurrency\"",
        );
    }
    let algorithm = validate_algorithm(key, span, raw, sink);
    let lockout = raw
        .lockout
        .as_ref()
        .and_then(|l| parse_spanned(l, format!("{key}.lockout"), sink, values::positive_duration));
    let failures = validate_count(key, raw, sink);
    let overrides = validate_overrides(key, raw, parts?, sink);
    Some(RateLimit {
        algorithm: algorithm?,
        lockout,
        failures: failures?,
        overrides: overrides?,
    })
}

/// `overrides` of a limit whose key parts are `parts`.
fn validate_overrides(
    key: &str,
    raw: &LimitFile,
    parts: &[KeyPart],
    sink: &mut ErrorSink,
) -> Option<Overrides> {
    let mut overrides = Overrides::default();
    let mut valid = true;
    // The limit's own keys, which an entry's parameters replace (without the table itself,
    // so that a large table is not copied for each of its entries).
    let base = LimitFile {
        overrides: None,
        key: None,
        exempt: None,
        ..raw.clone_without_overrides()
    };
    for (index, entry) in raw.overrides.iter().flatten().enumerate() {
        let at = format!("{key}.overrides[{index}]");
        let span = entry.span();
        let entry = entry.get_ref();
        if entry.key.len() != parts.len() {
            sink.push(
                Some(span.clone()),
                format!("{at}.key"),
                format!(
                    "expected {} value(s), one per key part {:?}",
                    parts.len(),
                    parts.iter().map(KeyPart::name).collect::<Vec<_>>()
                ),
            );
            valid = false;
            continue;
        }
        let mut matches = Vec::with_capacity(entry.key.len());
        for (i, (value, part)) in entry.key.iter().zip(parts).enumerate() {
            let matcher = if *part == KeyPart::ClientIp {
                match parse_spanned(value, format!("{at}.key[{i}]"), sink, values::cidr) {
                    Some(net) if net.prefix_len() == net.max_prefix_len() => PartMatch::Encoded(one_part(
                        PartKind::ClientIp,
                        ip_text(net.addr().to_canonical()).as_bytes(),
                    )),
                    Some(net) => PartMatch::Network(net),
                    None => {
                        valid = false;
                        continue;
                    }
                }
            } else {
                match part.as_requests_read(value.get_ref()) {
                    Ok(read) if read == *value.get_ref() => {}
                    Ok(read) => {
                        sink.push(
                            Some(value.span()),
                            format!("{at}.key[{i}]"),
                            format!(
                                "never matches: a request's {} reads as \"{read}\"; write that",
                                part.name()
                            ),
                        );
                        valid = false;
                        continue;
                    }
                    Err(why) => {
                        sink.push(
                            Some(value.span()),
                            format!("{at}.key[{i}]"),
                            format!("never matches: {why}"),
                        );
                        valid = false;
                        continue;
                    }
                }
                PartMatch::Encoded(one_part(PartKind::Value, value.get_ref().as_bytes()))
            };
            matches.push(matcher);
        }
        let action = if entry.exempt == Some(true) {
            let named = [
                entry.limit.as_ref().map(Spanned::span),
                entry.window.as_ref().map(Spanned::span),
                entry.rate.as_ref().map(|s| s.span()),
                entry.per.as_ref().map(Spanned::span),
                entry.burst.as_ref().map(Spanned::span),
            ];
            if let Some(span) = named.into_iter().flatten().next() {
                sink.push(Some(span), at.clone(), "an exempt entry takes no parameters");
                valid = false;
            }
            Override::Exempt
        } else {
            let mut merged = base.clone();
            merged.limit = entry.limit.clone().or(merged.limit);
            merged.window = entry.window.clone().or(merged.window);
            merged.rate = entry.rate.clone().or(merged.rate);
            merged.per = entry.per.clone().or(merged.per);
            merged.burst = entry.burst.clone().or(merged.burst);
            let Some(algorithm) = validate_algorithm(&at, span.clone(), &merged, sink) else {
                valid = false;
                continue;
            };
            Override::Algorithm(algorithm)
        };
        if matches.len() != parts.len() {
            continue;
        }
        let index = overrides.entries.len();
        overrides.entries.push(action);
        if matches.iter().all(|m| matches!(m, PartMatch::Encoded(_))) {
            let mut tuple = TupleEncoder::default();
            for (value, part) in entry.key.iter().zip(parts) {
                let (kind, bytes) = match part {
                    KeyPart::ClientIp => match values::cidr(value.get_ref()) {
                        Ok(net) => (
                            PartKind::ClientIp,
                            ip_text(net.addr().to_canonical()).into_bytes(),
                        ),
                        Err(_) => continue,
                    },
                    _ => (PartKind::Value, value.get_ref().as_bytes().to_vec()),
                };
                tuple.part(kind, &bytes);
            }
            // The first entry for a tuple wins.
            overrides.exact.entry(tuple.finish()).or_insert(index);
        } else {
            overrides.networks.push((index, matches));
        }
    }
    valid.then_some(overrides)
}

/// A concurrency limit: `limit` and `lease`; what only rate limits have is an error.
fn validate_concurrency(
    key: &str,
    span: std::ops::Range<usize>,
    raw: &LimitFile,
    sink: &mut ErrorSink,
) -> Option<Concurrency> {
    let foreign = [
        ("window", raw.window.as_ref().map(Spanned::span)),
        ("rate", raw.rate.as_ref().map(|r| r.span())),
        ("per", raw.per.as_ref().map(Spanned::span)),
        ("burst", raw.burst.as_ref().map(|b| b.span())),
        ("lockout", raw.lockout.as_ref().map(Spanned::span)),
        ("count", raw.count.as_ref().map(Spanned::span)),
        ("failure_status", raw.failure_status.as_ref().map(Spanned::span)),
        (
            "overrides",
            raw.overrides.as_ref().and_then(|o| o.first()).map(Spanned::span),
        ),
    ];
    let mut valid = true;
    for (field, at) in foreign {
        if let Some(at) = at {
            sink.push(
                Some(at),
                format!("{key}.{field}"),
                "does not apply to algorithm \"concurrency\"; remove it",
            );
            valid = false;
        }
    }
    let limit = required_count(&raw.limit, key, span, sink);
    let lease =
        parse_or(
            &raw.lease,
            &format!("{key}.lease"),
            DEFAULT_LEASE,
            sink,
            |text| match values::duration(text)? {
                d if d < MIN_LEASE => Err(format!("expected a lease of at least 3s, got {text:?}")),
                d => Ok(d),
            },
        );
    let concurrency = Concurrency { limit: limit?, lease };
    valid.then_some(concurrency)
}

/// `limit`: a required whole number ≥ 1.
fn required_count(
    limit: &Option<Spanned<i64>>,
    key: &str,
    span: std::ops::Range<usize>,
    sink: &mut ErrorSink,
) -> Option<u64> {
    match limit {
        Some(limit) if *limit.get_ref() >= 1 => Some(*limit.get_ref() as u64),
        Some(limit) => {
            sink.push(
                Some(limit.span()),
                format!("{key}.limit"),
                "expected a whole number ≥ 1",
            );
            None
        }
        None => {
            sink.push(
                Some(span),
                format!("{key}.limit"),
                "is required for this algorithm",
            );
            None
        }
    }
}

/// `count` and `failure_status`: `Some(None)` when every request counts.
fn validate_count(key: &str, raw: &LimitFile, sink: &mut ErrorSink) -> Option<Option<Vec<StatusCode>>> {
    let failures = match raw.count.as_ref().map(|c| (c, c.get_ref().as_str())) {
        None | Some((_, "requests")) => false,
        Some((count, "failures")) => {
            if !matches!(
                raw.algorithm.get_ref().as_str(),
                "fixed_window" | "sliding_window" | "token_bucket"
            ) {
                sink.push(
                    Some(count.span()),
                    format!("{key}.count"),
                    "count = \"failures\" applies to fixed_window, sliding_window and token_bucket",
                );
                return None;
            }
            true
        }
        Some((count, other)) => {
            sink.push(
                Some(count.span()),
                format!("{key}.count"),
                format!("expected \"requests\" or \"failures\", got {other:?}"),
            );
            return None;
        }
    };
    let Some(statuses) = &raw.failure_status else {
        return Some(failures.then(|| vec![StatusCode::UNAUTHORIZED, StatusCode::FORBIDDEN]));
    };
    if !failures {
        sink.push(
            Some(statuses.span()),
            format!("{key}.failure_status"),
            "failure_status applies only with count = \"failures\"",
        );
        return None;
    }
    statuses
        .get_ref()
        .iter()
        .enumerate()
        .map(|(i, status)| status_in(status, 100..=599, format!("{key}.failure_status[{i}]"), sink))
        .collect::<Option<Vec<_>>>()
        .map(Some)
}

/// `value` as a one-part tuple.
fn one_part(kind: PartKind, value: &[u8]) -> String {
    let mut tuple = TupleEncoder::default();
    tuple.part(kind, value);
    tuple.finish()
}

fn validate_algorithm(
    key: &str,
    span: std::ops::Range<usize>,
    raw: &LimitFile,
    sink: &mut ErrorSink,
) -> Option<Algorithm> {
    let algorithm = raw.algorithm.get_ref().as_str();
    let windowed = matches!(algorithm, "fixed_window" | "sliding_window");
    let bucket = matches!(algorithm, "token_bucket" | "leaky_bucket");
    if !windowed && !bucket {
        sink.push(
            Some(raw.algorithm.span()),
            format!("{key}.algorithm"),
            format!(
                "expected \"fixed_window\", \"sliding_window\", \"token_bucket\" or \"leaky_bucket\", got {algorithm:?}"
            ),
        );
        return None;
    }
    let mut foreign = |present: Option<std::ops::Range<usize>>, field: &str| {
        if let Some(field_span) = present {
            sink.push(
                Some(field_span),
                format!("{key}.{field}"),
                format!("does not apply to algorithm {algorithm:?}; remove it"),
            );
        }
    };
    if windowed {
        foreign(raw.rate.as_ref().map(Spanned::span), "rate");
        foreign(raw.per.as_ref().map(Spanned::span), "per");
        foreign(raw.burst.as_ref().map(Spanned::span), "burst");
    } else {
        foreign(raw.limit.as_ref().map(Spanned::span), "limit");
        foreign(raw.window.as_ref().map(Spanned::span), "window");
    }
    if windowed {
        let limit = required_count(&raw.limit, key, span.clone(), sink);
        let window = match &raw.window {
            Some(window) => parse_spanned(window, format!("{key}.window"), sink, at_least_a_millisecond),
            None => {
                sink.push(
                    Some(span),
                    format!("{key}.window"),
                    "is required for this algorithm",
                );
                None
            }
        };
        let (limit, window) = (limit?, micros(window?));
        // The stores keep a window twice its length, and report no time past 2^50 µs.
        if window > MAX_TIME_MICROS {
            let span = raw.window.as_ref().map(Spanned::span);
            sink.push(span, format!("{key}.window"), "expected at most 35 years");
            return None;
        }
        return Some(if algorithm == "fixed_window" {
            Algorithm::FixedWindow { limit, window }
        } else {
            Algorithm::SlidingWindow { limit, window }
        });
    }
    let rate = match &raw.rate {
        Some(rate) if rate.get_ref().is_finite() && *rate.get_ref() > 0.0 => Some(*rate.get_ref()),
        Some(rate) => {
            sink.push(Some(rate.span()), format!("{key}.rate"), "expected a number > 0");
            None
        }
        None => {
            sink.push(
                Some(span),
                format!("{key}.rate"),
                "is required for this algorithm",
            );
            None
        }
    };
    let per = parse_or(
        &raw.per,
        &format!("{key}.per"),
        Duration::from_secs(1),
        sink,
        at_least_a_millisecond,
    );
    let burst = match &raw.burst {
        Some(burst) if *burst.get_ref() >= 1 => Some(*burst.get_ref() as u64),
        Some(burst) => {
            sink.push(
                Some(burst.span()),
                format!("{key}.burst"),
                "expected a whole number ≥ 1",
            );
            None
        }
        None => rate.map(|r| r.ceil().max(1.0) as u64),
    };
    let (rate, per, burst) = (rate?, micros(per), burst?);
    // A token (or turn) must come within the longest time the stores report, 2^50 µs
    // (35 years): slower, the interval overflows the decision's arithmetic.
    if interval(rate, per) > MAX_TIME_MICROS as f64 {
        let span = raw.rate.as_ref().map(Spanned::span);
        sink.push(span, format!("{key}.rate"), "expected at least one per 35 years");
        return None;
    }
    // So must an empty token bucket's refill, and a full leaky bucket's last turn.
    if burst as f64 * interval(rate, per) > MAX_TIME_MICROS as f64 {
        let span = raw
            .burst
            .as_ref()
            .map(Spanned::span)
            .or_else(|| raw.rate.as_ref().map(Spanned::span));
        sink.push(
            span,
            format!("{key}.burst"),
            "expected burst × per / rate to be at most 35 years",
        );
        return None;
    }
    Some(if algorithm == "token_bucket" {
        Algorithm::TokenBucket { rate, per, burst }
    } else {
        Algorithm::LeakyBucket { rate, per, burst }
    })
}

fn at_least_a_millisecond(text: &str) -> Result<Duration, String> {
    match values::duration(text)? {
        d if d < Duration::from_millis(1) => {
            Err(format!("expected a duration of at least 1ms, got {text:?}"))
        }
        d => Ok(d),
    }
}

pub(super) fn key_part(text: &str) -> Result<KeyPart, String> {
    let expected = || {
        format!(
            "expected \"client_ip\", \"header:NAME\", \"query:NAME\", \"cookie:NAME\", \"method\", \"path\", \"host\" or \"route\", got {text:?}"
        )
    };
    match text.split_once(':') {
        None => match text {
            "client_ip" => Ok(KeyPart::ClientIp),
            "method" => Ok(KeyPart::Method),
            "path" => Ok(KeyPart::Path),
            "host" => Ok(KeyPart::Host),
            "route" => Ok(KeyPart::Route),
            _ => Err(expected()),
        },
        Some((_, "")) => Err(expected()),
        Some(("header", name)) => HeaderName::from_bytes(name.trim().as_bytes())
            .map(KeyPart::Header)
            .map_err(|_| expected()),
        // What separates parameters (cookies) cannot be in a name: it would never match.
        Some(("query", name)) if name.contains(['&', ';', '=']) => Err(format!(
            "a query parameter's name cannot hold '&', ';' or '=', which separate parameters, got {text:?}"
        )),
        Some(("cookie", name)) if name.contains([';', '=']) => Err(format!(
            "a cookie's name cannot hold ';' or '=', which separate cookies, got {text:?}"
        )),
        Some(("query", name)) => Ok(KeyPart::Query(name.to_owned())),
        Some(("cookie", name)) => Ok(KeyPart::Cookie(name.to_owned())),
        Some(_) => Err(expected()),
    }
}
