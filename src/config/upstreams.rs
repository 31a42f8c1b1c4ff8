//! Validation of `[upstreams.NAME]` (docs/configuration.md#upstreamsname): one `url` or
//! several `servers`, how requests are spread over them, when a server is taken out of
//! rotation, retries, and the concurrency cap with its queue.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::{CertificateDer, ServerName};

use http::Uri;
use http::uri::{Authority, PathAndQuery};
use toml::Spanned;

use super::error::ErrorSink;
use super::file::{HealthCheckFile, UpstreamFile};
use super::limits::{KeyPart, key_part};
use super::{parse_or, parse_spanned, values};

const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
const DEFAULT_MAX_FAILS: u32 = 1;
const DEFAULT_FAIL_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_RETRIES: u32 = 1;
const DEFAULT_QUEUE: u32 = 100;
const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_secs(5);
const DEFAULT_CHECK_INTERVAL: Duration = Duration::from_secs(5);
const DEFAULT_CHECK_TIMEOUT: Duration = Duration::from_secs(1);
/// `response_buffer` when the file does not set it.
const DEFAULT_RESPONSE_BUFFER: usize = 1024 * 1024;
/// The largest `response_buffer`: it is per request.
const MAX_RESPONSE_BUFFER: u64 = 64 * 1024 * 1024;
/// The largest `weight`: enough to express any practical ratio.
const MAX_WEIGHT: i64 = 1000;
/// The largest count a count key (`max_fails`, `retries`, `max_requests`, `queue`) takes.
const MAX_COUNT: i64 = 1_000_000;

/// `[upstreams.NAME]`
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamConfig {
    pub name: String,
    /// At least one; in file order.
    pub servers: Vec<UpstreamServer>,
    /// Path prefixed to every forwarded path (the servers' URLs share it); empty, or
    /// starting with `/` and without a trailing `/`.
    pub base_path: String,
    pub balance: Balance,
    /// Failures within `fail_timeout` that take a server out of rotation (0: never).
    pub max_fails: u32,
    pub fail_timeout: Duration,
    /// Tries on other servers after a failure.
    pub retries: u32,
    pub health_check: Option<HealthCheck>,
    /// Requests in flight to one server at most (0: no cap).
    pub max_requests: u32,
    /// Requests that may wait for a free slot, per upstream.
    pub queue: u32,
    pub queue_timeout: Duration,
    pub connect_timeout: Duration,
    /// Time allowed until the upstream's response headers arrive.
    pub timeout: Duration,
    /// For `https://` servers.
    pub tls: Option<UpstreamTls>,
    /// For `fastcgi://` servers.
    pub fastcgi: Option<FastCgi>,
    /// Bytes of a response read ahead of a slow client (with `max_requests`, or from
    /// PHP-FPM).
    pub response_buffer: usize,
}

/// What `fastcgi://` servers are told besides the request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FastCgi {
    /// `env`: extra parameters, in name order.
    pub env: Vec<(String, String)>,
}

/// How `https://` servers are checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamTls {
    /// `tls_ca`'s certificates; `None`: the system's roots.
    pub roots: Option<Vec<CertificateDer<'static>>>,
    /// `tls_server_name`; `None`: each server's host.
    pub server_name: Option<ServerName<'static>>,
}

/// One server of an upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamServer {
    pub address: ServerAddress,
    pub weight: u32,
}

/// Where a server listens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ServerAddress {
    /// `host:port`, the port explicit.
    Tcp(Authority),
    /// A unix socket (`fastcgi:///run/php/php8.2-fpm.sock`).
    Unix(PathBuf),
}

impl ServerAddress {
    /// The server's metric label: `host:port`, or the socket's path.
    pub fn label(&self) -> String {
        match self {
            ServerAddress::Tcp(authority) => authority.to_string(),
            ServerAddress::Unix(path) => path.display().to_string(),
        }
    }

    /// The `host:port`, for a TCP server.
    pub fn authority(&self) -> Option<&Authority> {
        match self {
            ServerAddress::Tcp(authority) => Some(authority),
            ServerAddress::Unix(_) => None,
        }
    }
}

/// What an upstream's servers speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Scheme {
    #[default]
    Http,
    Https,
    FastCgi,
}

impl Scheme {
    fn name(self) -> &'static str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
            Scheme::FastCgi => "fastcgi",
        }
    }
}

/// How requests are spread over an upstream's servers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Balance {
    /// In proportion to weight, evenly interleaved.
    RoundRobin,
    /// To the server with the fewest requests in flight.
    LeastRequests,
    /// One key tuple to one server, by consistent hashing.
    Hash(Vec<KeyPart>),
}

/// `health_check = { path, interval, timeout }`
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    pub path: PathAndQuery,
    pub interval: Duration,
    pub timeout: Duration,
}

pub(super) fn validate_upstreams(
    raw: BTreeMap<String, Spanned<UpstreamFile>>,
    base: &Path,
    sink: &mut ErrorSink,
) -> BTreeMap<String, Arc<UpstreamConfig>> {
    let mut upstreams = BTreeMap::new();
    for (name, upstream) in raw {
        let span = upstream.span();
        if let Some(config) = validate_upstream(&name, span, upstream.into_inner(), base, sink) {
            upstreams.insert(name, Arc::new(config));
        }
    }
    upstreams
}

fn validate_upstream(
    name: &str,
    span: std::ops::Range<usize>,
    raw: UpstreamFile,
    base: &Path,
    sink: &mut ErrorSink,
) -> Option<UpstreamConfig> {
    let key = format!("upstreams.{name}");
    let servers = servers(&key, span.clone(), &raw, sink);
    let tls = match &servers {
        Some((_, _, Scheme::Https)) => upstream_tls(&key, &raw, base, sink),
        _ => {
            for (what, value) in [("tls_ca", &raw.tls_ca), ("tls_server_name", &raw.tls_server_name)] {
                if let Some(value) = value {
                    sink.push(
                        Some(value.span()),
                        format!("{key}.{what}"),
                        format!("{what} applies only to https:// servers"),
                    );
                }
            }
            Some(None)
        }
    };
    let balance = balance(&key, &raw, sink);
    let count = |value: &Option<Spanned<i64>>, what: &str, default: u32, sink: &mut ErrorSink| {
        let Some(value) = value else {
            return Some(default);
        };
        match u32::try_from(*value.get_ref()) {
            Ok(n) if i64::from(n) <= MAX_COUNT => Some(n),
            _ => {
                sink.push(
                    Some(value.span()),
                    format!("{key}.{what}"),
                    format!(
                        "expected a whole number from 0 to {MAX_COUNT}, got {}",
                        value.get_ref()
                    ),
                );
                None
            }
        }
    };
    let max_fails = count(&raw.max_fails, "max_fails", DEFAULT_MAX_FAILS, sink);
    let retries = count(&raw.retries, "retries", DEFAULT_RETRIES, sink);
    let max_requests = count(&raw.max_requests, "max_requests", 0, sink);
    let queue = count(&raw.queue, "queue", DEFAULT_QUEUE, sink);
    let duration = |value: &Option<Spanned<String>>, what: &str, default, sink: &mut ErrorSink| {
        parse_or(
            value,
            &format!("{key}.{what}"),
            default,
            sink,
            values::positive_duration,
        )
    };
    let fail_timeout = duration(&raw.fail_timeout, "fail_timeout", DEFAULT_FAIL_TIMEOUT, sink);
    let queue_timeout = duration(&raw.queue_timeout, "queue_timeout", DEFAULT_QUEUE_TIMEOUT, sink);
    let connect_timeout = duration(
        &raw.connect_timeout,
        "connect_timeout",
        DEFAULT_CONNECT_TIMEOUT,
        sink,
    );
    let timeout = duration(&raw.timeout, "timeout", DEFAULT_TIMEOUT, sink);
    let response_buffer = parse_or(
        &raw.response_buffer,
        &format!("{key}.response_buffer"),
        DEFAULT_RESPONSE_BUFFER,
        sink,
        |text| match values::size(text)? {
            size if size <= MAX_RESPONSE_BUFFER => Ok(size as usize),
            _ => Err(format!("expected at most 64MB, got {text:?}")),
        },
    );
    let health_check = match &raw.health_check {
        None => Some(None),
        Some(check) => health_check(&format!("{key}.health_check"), check.get_ref(), sink).map(Some),
    };
    let fastcgi = match (&servers, &raw.env) {
        (Some((_, _, Scheme::FastCgi)), env) => Some(Some(FastCgi {
            env: fastcgi_env(&key, env.as_ref(), sink)?,
        })),
        (_, Some(env)) => {
            sink.push(
                Some(env.span()),
                format!("{key}.env"),
                "env applies only to fastcgi:// servers",
            );
            None
        }
        (_, None) => Some(None),
    };
    let (servers, base_path, _) = servers?;
    let tls = tls?;
    if let Some(UpstreamTls {
        server_name: None, ..
    }) = &tls
        && let Some(authority) = servers
            .iter()
            .filter_map(|s| s.address.authority())
            .find(|authority| server_name(authority).is_none())
    {
        sink.push(
            Some(span),
            format!("{key}.tls_server_name"),
            format!(
                "{} is not a name a certificate can have; set tls_server_name",
                authority.host()
            ),
        );
        return None;
    }
    Some(UpstreamConfig {
        name: name.to_owned(),
        servers,
        base_path,
        balance: balance?,
        max_fails: max_fails?,
        fail_timeout,
        retries: retries?,
        health_check: health_check?,
        max_requests: max_requests?,
        queue: queue?,
        queue_timeout,
        connect_timeout,
        timeout,
        tls,
        fastcgi: fastcgi?,
        response_buffer,
    })
}

/// `env`: names and values as PHP reads them from `$_SERVER`.
fn fastcgi_env(
    key: &str,
    env: Option<&Spanned<BTreeMap<String, Spanned<String>>>>,
    sink: &mut ErrorSink,
) -> Option<Vec<(String, String)>> {
    let mut valid = true;
    let mut pairs = Vec::new();
    for (name, value) in env.map(|env| env.get_ref().iter()).into_iter().flatten() {
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            sink.push(
                Some(value.span()),
                format!("{key}.env.{name}"),
                "expected a name of letters, digits and _",
            );
            valid = false;
            continue;
        }
        pairs.push((name.clone(), value.get_ref().clone()));
    }
    valid.then_some(pairs)
}

/// The name a server's certificate must have by default: its host.
pub(crate) fn server_name(authority: &Authority) -> Option<ServerName<'static>> {
    let host = authority.host().trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_owned()).ok()
}

fn upstream_tls(
    key: &str,
    raw: &UpstreamFile,
    base: &Path,
    sink: &mut ErrorSink,
) -> Option<Option<UpstreamTls>> {
    let roots = match &raw.tls_ca {
        None => Some(None),
        Some(path) => parse_spanned(path, format!("{key}.tls_ca"), sink, |text| {
            super::tls::load_chain(&base.join(text))
        })
        .map(Some),
    };
    let server_name = match &raw.tls_server_name {
        None => Some(None),
        Some(name) => parse_spanned(name, format!("{key}.tls_server_name"), sink, |text| {
            ServerName::try_from(text.to_owned())
                .map_err(|_| format!("expected a DNS name or IP address, got {text:?}"))
        })
        .map(Some),
    };
    Some(Some(UpstreamTls {
        roots: roots?,
        server_name: server_name?,
    }))
}

fn servers(
    key: &str,
    span: std::ops::Range<usize>,
    raw: &UpstreamFile,
    sink: &mut ErrorSink,
) -> Option<(Vec<UpstreamServer>, String, Scheme)> {
    let server = |url: &Spanned<String>, key: String, weight: u32, sink: &mut ErrorSink| {
        parse_spanned(url, key, sink, upstream_url)
            .map(|(scheme, address, base_path)| (UpstreamServer { address, weight }, (base_path, scheme)))
    };
    match (&raw.url, &raw.servers) {
        (Some(url), None) => {
            let (server, (base_path, tls)) = server(url, format!("{key}.url"), 1, sink)?;
            Some((vec![server], base_path, tls))
        }
        (None, Some(list)) if list.get_ref().is_empty() => {
            sink.push(
                Some(list.span()),
                format!("{key}.servers"),
                "expected at least one server, e.g. [\"http://10.0.0.5:9000\"]",
            );
            None
        }
        (None, Some(list)) => {
            let mut servers = Vec::with_capacity(list.get_ref().len());
            let mut base: Option<(String, Scheme)> = None;
            let mut seen = HashSet::new();
            let mut valid = true;
            for (i, entry) in list.get_ref().iter().enumerate() {
                let at = format!("{key}.servers[{i}]");
                let Some((url, weight)) = server_entry(&at, entry, sink) else {
                    valid = false;
                    continue;
                };
                match (
                    server(&url, format!("{at}.url"), weight.unwrap_or(1), sink),
                    weight,
                ) {
                    (Some((server, here)), Some(_)) => {
                        let first = base.get_or_insert_with(|| here.clone());
                        if *first != here {
                            sink.push(
                                Some(url.span()),
                                format!("{at}.url"),
                                format!(
                                    "every server of an upstream must have the same scheme and path; expected {} {:?}, got {} {:?}",
                                    first.1.name(),
                                    first.0,
                                    here.1.name(),
                                    here.0
                                ),
                            );
                            valid = false;
                        }
                        if !seen.insert(server.address.clone()) {
                            sink.push(
                                Some(entry.span()),
                                at,
                                format!(
                                    "{} is listed twice; give one entry a weight instead",
                                    server.address.label()
                                ),
                            );
                            valid = false;
                        }
                        servers.push(server);
                    }
                    _ => valid = false,
                }
            }
            let (base_path, tls) = base.unwrap_or_default();
            valid.then_some((servers, base_path, tls))
        }
        (Some(url), Some(_)) => {
            sink.both(url.span(), format!("{key}.url"), "url", "servers");
            None
        }
        (None, None) => {
            sink.push(
                Some(span),
                key.to_owned(),
                "expected url = \"http://host:port\" or servers = [...]",
            );
            None
        }
    }
}

/// One entry of `servers`, `"url"` or `{ url, weight }`: the URL (spanned as the entry)
/// and the weight, `None` when invalid.
fn server_entry(
    key: &str,
    entry: &Spanned<toml::Value>,
    sink: &mut ErrorSink,
) -> Option<(Spanned<String>, Option<u32>)> {
    let spanned = |text: &str| Spanned::new(entry.span(), text.to_owned());
    let mut fail = |key: String, message: String| {
        sink.push(Some(entry.span()), key, message);
        None
    };
    match entry.get_ref() {
        toml::Value::String(url) => Some((spanned(url), Some(1))),
        toml::Value::Table(table) => {
            if let Some(unknown) = table.keys().find(|k| !matches!(k.as_str(), "url" | "weight")) {
                return fail(
                    format!("{key}.{unknown}"),
                    "unknown field; expected url or weight".into(),
                );
            }
            let Some(toml::Value::String(url)) = table.get("url") else {
                return fail(
                    format!("{key}.url"),
                    "expected a URL string such as \"http://10.0.0.5:9000\"".into(),
                );
            };
            let weight = match table.get("weight") {
                None => Some(1),
                Some(toml::Value::Integer(w @ 1..=MAX_WEIGHT)) => Some(*w as u32),
                Some(other) => {
                    sink.push(
                        Some(entry.span()),
                        format!("{key}.weight"),
                        format!("expected a weight from 1 to {MAX_WEIGHT}, got {other}"),
                    );
                    None
                }
            };
            Some((spanned(url), weight))
        }
        other => fail(
            key.to_owned(),
            format!("expected a URL or {{ url = \"...\", weight = N }}, got {other}"),
        ),
    }
}

fn balance(key: &str, raw: &UpstreamFile, sink: &mut ErrorSink) -> Option<Balance> {
    let hashed = match raw.balance.as_ref().map(|b| (b, b.get_ref().as_str())) {
        None | Some((_, "round_robin")) => Balance::RoundRobin,
        Some((_, "least_requests")) => Balance::LeastRequests,
        Some((_, "hash")) => Balance::Hash(vec![KeyPart::ClientIp]),
        Some((balance, other)) => {
            sink.push(
                Some(balance.span()),
                format!("{key}.balance"),
                format!("expected \"round_robin\", \"least_requests\" or \"hash\", got {other:?}"),
            );
            return None;
        }
    };
    let Some(parts) = &raw.hash_key else {
        return Some(hashed);
    };
    if !matches!(hashed, Balance::Hash(_)) {
        sink.push(
            Some(parts.span()),
            format!("{key}.hash_key"),
            "hash_key applies only with balance = \"hash\"",
        );
        return None;
    }
    if parts.get_ref().is_empty() {
        sink.push(
            Some(parts.span()),
            format!("{key}.hash_key"),
            "expected at least one key part, e.g. [\"cookie:PHPSESSID\"]",
        );
        return None;
    }
    parts
        .get_ref()
        .iter()
        .enumerate()
        .map(|(i, part)| parse_spanned(part, format!("{key}.hash_key[{i}]"), sink, key_part))
        .collect::<Option<Vec<_>>>()
        .map(Balance::Hash)
}

/// The longest `health_check.path`: a FastCGI check sends it in three parameters, which
/// must fit in one record.
pub(crate) const MAX_CHECK_PATH: usize = 8192;

fn health_check(key: &str, raw: &HealthCheckFile, sink: &mut ErrorSink) -> Option<HealthCheck> {
    let path = parse_spanned(
        &raw.path,
        format!("{key}.path"),
        sink,
        |text| match text.parse::<PathAndQuery>() {
            Ok(_) if text.len() > MAX_CHECK_PATH => Err(format!(
                "expected a path of at most {MAX_CHECK_PATH} bytes, got {} bytes",
                text.len()
            )),
            Ok(path) if text.starts_with('/') => Ok(path),
            _ => Err(format!("expected a path such as \"/health\", got {text:?}")),
        },
    );
    let interval = parse_or(
        &raw.interval,
        &format!("{key}.interval"),
        DEFAULT_CHECK_INTERVAL,
        sink,
        values::positive_duration,
    );
    let timeout = parse_or(
        &raw.timeout,
        &format!("{key}.timeout"),
        DEFAULT_CHECK_TIMEOUT,
        sink,
        values::positive_duration,
    );
    Some(HealthCheck {
        path: path?,
        interval,
        timeout,
    })
}

/// `http[s]://host[:port]/optional/base`, `fastcgi://host[:port]` or
/// `fastcgi:///socket/path` → (scheme, address with an explicit port, base path).
fn upstream_url(text: &str) -> Result<(Scheme, ServerAddress, String), String> {
    let expected = || {
        format!(
            "expected an upstream URL such as \"http://127.0.0.1:9000\" or \"fastcgi://127.0.0.1:9000\", got {text:?}"
        )
    };
    let text = text.trim();
    if let Some(socket) = text
        .strip_prefix("fastcgi://")
        .filter(|rest| rest.starts_with('/'))
    {
        return Ok((
            Scheme::FastCgi,
            ServerAddress::Unix(PathBuf::from(socket)),
            String::new(),
        ));
    }
    let uri: Uri = text.parse().map_err(|_| expected())?;
    let (scheme, default_port) = match uri.scheme_str() {
        Some("http") => (Scheme::Http, 80),
        Some("https") => (Scheme::Https, 443),
        Some("fastcgi") => (Scheme::FastCgi, 9000),
        _ => return Err(expected()),
    };
    let authority = uri.authority().ok_or_else(expected)?;
    if authority.host().is_empty() || authority.as_str().contains('@') {
        return Err(expected());
    }
    if uri.query().is_some() {
        return Err(format!(
            "expected an upstream URL without a query string, got {text:?}"
        ));
    }
    let authority: Authority = match authority.port_u16() {
        Some(_) => authority.clone(),
        None => format!("{}:{default_port}", authority.host())
            .parse()
            .map_err(|_| expected())?,
    };
    let base_path = uri.path().trim_end_matches('/').to_owned();
    if scheme == Scheme::FastCgi && !base_path.is_empty() {
        return Err(format!(
            "expected a fastcgi:// URL without a path (the script is chosen per request under the route's root), got {text:?}"
        ));
    }
    Ok((scheme, ServerAddress::Tcp(authority), base_path))
}
