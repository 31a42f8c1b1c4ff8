//! Configuration: `gateway.toml` → [`file::FileConfig`] (raw serde) → [`Config`] (validated).
//!
//! Validation happens once, at load: every duration, size, address, CIDR and URL is parsed,
//! every reference resolved and every rule checked, and all problems are reported together
//! with `file:line:column`. Nothing downstream re-checks or unwraps a configuration value.

mod acme;
mod error;
mod file;
mod limits;
mod shaping;
mod site;
mod tls;
mod upstreams;
mod values;
mod warnings;

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, StatusCode, Uri};
use ipnet::IpNet;
use toml::Spanned;

pub use acme::{AcmeConfig, Eab};
use error::ErrorSink;
pub use error::{ConfigError, ConfigErrors};
use file::{FileConfig, RespondFile, RouteFile, ServerFile, TracingFile};
pub(crate) use limits::DEFAULT_PREFIX;
pub use limits::{
    Concurrency, KeyPart, LimitConfig, LimitKind, Mode, Override, Overrides, RateLimit, RedisConfig,
};
pub use shaping::{CombinedRules, ErrorPage, HeaderRules, TemplatePart, ValueTemplate};
pub use site::{Php, Site};
pub use tls::{Certificate, TlsConfig, TlsVersion};
pub(crate) use tls::{certified_key, leaf_facts, provider as tls_provider};
pub(crate) use upstreams::server_name;
pub use upstreams::{
    Balance, FastCgi, HealthCheck, ServerAddress, UpstreamConfig, UpstreamServer, UpstreamTls,
};

use crate::limit::MAX_LIMITS_PER_ROUTE;
use crate::path::normalize_path;

const DEFAULT_LISTEN: &str = "0.0.0.0:8080";
/// `server.admin_listen` when the file does not set it.
pub(crate) const DEFAULT_ADMIN_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9901);
const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(60);
const DEFAULT_TUNNEL_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it was read from (for messages and reloads).
    pub path: PathBuf,
    pub server: ServerConfig,
    /// The shared store; `None`: the in-process store.
    pub redis: Option<RedisConfig>,
    /// Upstreams by name.
    pub upstreams: BTreeMap<String, Arc<UpstreamConfig>>,
    /// Limits by name.
    pub limits: BTreeMap<String, Arc<LimitConfig>>,
    /// Routes in file order: the first match wins.
    pub routes: Vec<RouteConfig>,
    /// `[tracing]`: spans exported over OTLP/HTTP; `None`: none.
    pub tracing: Option<TracingConfig>,
}

/// `[tracing]` (docs/configuration.md#tracing).
#[derive(Debug, Clone, PartialEq)]
pub struct TracingConfig {
    /// The collector's base URL; spans go to `/v1/traces` under it.
    pub endpoint: Uri,
    /// The share of new traces recorded, 0 to 1.
    pub sample: f64,
    pub service_name: String,
}

/// `[server]`
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub trusted_proxies: Vec<IpNet>,
    /// Clients refused with 403 before routing.
    pub deny: Vec<IpNet>,
    /// Enables the admin API for limit state (`/limits`); every call must carry it.
    pub admin_token: Option<String>,
    pub shutdown_grace: Duration,
    /// How long a client may take to send a request's headers, and how long a connection
    /// may stay open without a request in flight (slowloris guard).
    pub header_timeout: Duration,
    /// Longest pause between two reads of a request body (slow-body guard): 408.
    pub body_timeout: Duration,
    /// Longest a response write to the client may make no progress (slow-reader guard):
    /// the connection is closed.
    pub send_timeout: Duration,
    /// Longest an upgrade tunnel may carry no byte either way before it is closed.
    pub tunnel_idle_timeout: Duration,
    /// Runtime worker threads; 0 = one per CPU core.
    pub workers: usize,
    /// Client connections open at once on the proxy listeners at most; `None`: half the
    /// open-file limit (`server::connection_cap`).
    pub max_connections: Option<usize>,
    pub ratelimit_headers: RateLimitHeaders,
    /// Largest accepted request body; `None` = unlimited.
    pub max_body: Option<u64>,
    /// The HTTPS listener, when `[server.tls]` is present.
    pub tls: Option<TlsConfig>,
    /// `[server.errors]`: bodies of floodgate's own error responses, by status.
    pub errors: std::collections::HashMap<u16, ErrorPage>,
    /// Header rules for every forwarded request and every response, before a route's.
    pub request_headers: HeaderRules,
    pub response_headers: HeaderRules,
    /// Request headers whose names have characters other than letters, digits and `-`
    /// are dropped before anything reads them (nginx's `ignore_invalid_headers`).
    pub drop_invalid_headers: bool,
    /// The header carrying request IDs; `None` (`request_id = ""`): none.
    pub request_id: Option<HeaderName>,
}

/// Which rate-limit response headers are sent (`server.ratelimit_headers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateLimitHeaders {
    Ietf,
    Legacy,
    Both,
    None,
}

/// One `[[routes]]` entry.
#[derive(Debug, Clone)]
pub struct RouteConfig {
    pub name: Arc<str>,
    pub host: Option<HostMatch>,
    pub path: PathMatch,
    pub methods: Option<Vec<Method>>,
    pub target: RouteTarget,
    /// All must admit a request (in this order).
    pub limits: Vec<Arc<LimitConfig>>,
    /// Units one request consumes from each limit.
    pub cost: u64,
    /// Only these clients may use the route (`None`: everyone); 403 before its limits.
    pub allow: Option<Vec<IpNet>>,
    /// Clients refused on the route (403, before its limits).
    pub deny: Vec<IpNet>,
    /// Removed from the forwarded path, after matching.
    pub strip_prefix: Option<String>,
    pub request_headers: HeaderRules,
    pub response_headers: HeaderRules,
    /// `root` and the keys that go with it.
    pub site: Option<Site>,
    /// Whether responses are compressed for clients that accept it.
    pub compress: bool,
}

impl RouteConfig {
    /// Whether the route's access lists let `client` in.
    pub fn admits(&self, client: std::net::IpAddr) -> bool {
        self.allow
            .as_ref()
            .is_none_or(|allow| allow.iter().any(|net| net.contains(&client)))
            && !self.deny.iter().any(|net| net.contains(&client))
    }
}

/// How a route matches the request's host (lower-case, port and trailing dot removed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostMatch {
    Exact(String),
    /// `*.example.com`, stored as `.example.com`: any subdomain, not the bare domain.
    Wildcard(String),
}

/// How a route matches the normalized path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    Exact(String),
    /// An exact `path` naming a PHP script (`/login.php`): also that path followed by `/`
    /// and anything, which PHP runs as the same script (PATH_INFO).
    Script(String),
    Prefix(String),
}

impl PathMatch {
    /// The extension that makes an exact `path` a [`PathMatch::Script`] (section 16's
    /// `split_path` default).
    const SCRIPT_EXTENSION: &'static str = ".php";

    /// An exact `path`: a script when its last segment ends in `.php` (in any case).
    fn exact(path: String) -> PathMatch {
        let last = path.rsplit('/').next().unwrap_or("");
        let ext = Self::SCRIPT_EXTENSION;
        let script = last.len() > ext.len()
            && last.as_bytes()[last.len() - ext.len()..].eq_ignore_ascii_case(ext.as_bytes());
        if script {
            PathMatch::Script(path)
        } else {
            PathMatch::Exact(path)
        }
    }

    /// The path as configured.
    pub fn as_str(&self) -> &str {
        match self {
            PathMatch::Exact(path) | PathMatch::Script(path) | PathMatch::Prefix(path) => path,
        }
    }

    /// What a `path` key part reads of a request to `path` that matched: a script's path,
    /// whatever PATH_INFO follows it (`/login.php/x` runs `/login.php`, and is no fresh
    /// key), else `path` itself.
    pub fn keyed<'a>(&'a self, path: &'a str) -> &'a str {
        match self {
            PathMatch::Script(script) => script,
            PathMatch::Exact(_) | PathMatch::Prefix(_) => path,
        }
    }

    /// Whether `path` matches: normalized, its encoded slashes read as slashes
    /// ([`crate::path::slashes_decoded`]).
    pub fn matches(&self, path: &str) -> bool {
        match self {
            PathMatch::Exact(exact) => exact == path,
            PathMatch::Script(script) => path
                .strip_prefix(script.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/')),
            PathMatch::Prefix(prefix) => path.starts_with(prefix.as_str()),
        }
    }
}

/// Where a matched request goes.
#[derive(Debug, Clone)]
pub enum RouteTarget {
    Upstream(Arc<UpstreamConfig>),
    Respond(RespondConfig),
    /// The site's files (`root`) alone.
    Files(Site),
}

/// A fixed response served by floodgate itself.
#[derive(Debug, Clone)]
pub struct RespondConfig {
    pub status: StatusCode,
    pub body: Bytes,
    pub content_type: HeaderValue,
    /// `headers`: set on the response, filled in from the request where they say so.
    pub headers: Vec<(http::HeaderName, ValueTemplate)>,
}

/// What the process's environment adds to the file (docs/configuration.md#environment):
/// `FLOODGATE_ADMIN_TOKEN` sets `server.admin_token`; `FLOODGATE_REDIS_URL` overrides
/// `[redis].url`, or enables Redis with defaults when the file has no `[redis]`.
#[derive(Debug, Default, Clone)]
pub struct Environment {
    pub admin_token: Option<String>,
    pub redis_url: Option<String>,
}

impl Environment {
    /// The variables as this process has them (an empty one counts as unset).
    pub fn of_process() -> Environment {
        let variable = |name| {
            std::env::var(name)
                .ok()
                .filter(|value: &String| !value.is_empty())
        };
        Environment {
            admin_token: variable("FLOODGATE_ADMIN_TOKEN"),
            redis_url: variable("FLOODGATE_REDIS_URL"),
        }
    }
}

impl Config {
    /// Reads and validates the file at `path`, on its own.
    pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
        Config::load_in(path, &Environment::default())
    }

    /// Reads and validates the file at `path` with what `environment` adds.
    pub fn load_in(path: &Path, environment: &Environment) -> Result<Config, ConfigErrors> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigErrors::single(path, "", format!("cannot read the file: {e}")))?;
        Config::parse_in(path, &text, environment)
    }

    /// Validates `text` as the contents of `path`, on its own.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigErrors> {
        Config::parse_in(path, text, &Environment::default())
    }

    /// Validates `text` as the contents of `path` with what `environment` adds: the
    /// rules that read the whole configuration (ACME storage, say) see it.
    pub fn parse_in(path: &Path, text: &str, environment: &Environment) -> Result<Config, ConfigErrors> {
        let raw = deserialize(path, text)?;
        let mut sink = ErrorSink::new(text);
        // Files the configuration names are relative to its directory.
        let base = path.parent().unwrap_or(Path::new(""));
        let acme_without_storage = raw
            .server
            .tls
            .as_ref()
            .and_then(|tls| tls.get_ref().acme.as_ref())
            .filter(|acme| acme.get_ref().storage.is_none())
            .map(Spanned::span);
        let mut server = validate_server(raw.server, base, &mut sink);
        let mut redis = limits::validate_redis(raw.redis, &mut sink);
        apply_environment(environment, (&mut server, &mut redis), &mut sink);
        // A FLOODGATE_REDIS_URL that is not a URL has its own error.
        if let Some(span) = acme_without_storage
            && redis.is_none()
            && environment.redis_url.is_none()
        {
            sink.push(
                Some(span),
                "server.tls.acme.storage",
                "expected a directory for the account, keys and certificates (or [redis], which then holds them for every instance)",
            );
        }
        let upstreams = upstreams::validate_upstreams(raw.upstreams, base, &mut sink);
        let limits = limits::validate_limits(raw.limits, &mut sink);
        let routes = validate_routes(
            raw.routes,
            (&upstreams, &limits, server.request_id.as_ref()),
            base,
            &mut sink,
        );
        let tracing = raw
            .tracing
            .and_then(|tracing| validate_tracing(tracing.into_inner(), &mut sink));
        sink.finish(path)?;
        Ok(Config {
            path: path.to_path_buf(),
            server,
            redis,
            upstreams,
            limits,
            routes,
            tracing,
        })
    }

    /// The certificate and key files `[server.tls]` names (watched for changes).
    pub fn tls_files(&self) -> Vec<PathBuf> {
        self.server
            .tls
            .iter()
            .flat_map(|tls| &tls.certificates)
            .flat_map(|c| [c.cert_path.clone(), c.key_path.clone()])
            .collect()
    }

    /// What is valid but deserves a look (docs/configuration.md#floodgate-check-warnings).
    pub fn warnings(&self) -> Vec<String> {
        warnings::warnings(self)
    }
}

/// Applies what `environment` adds to the file's `server` and `redis`.
fn apply_environment(
    environment: &Environment,
    (server, redis): (&mut ServerConfig, &mut Option<RedisConfig>),
    sink: &mut ErrorSink,
) {
    if let Some(token) = &environment.admin_token {
        match admin_token(token) {
            Ok(token) => server.admin_token = Some(token),
            Err(message) => sink.push(None, "FLOODGATE_ADMIN_TOKEN", message),
        }
    }
    if let Some(url) = &environment.redis_url {
        match limits::redis_url(url) {
            Ok(url) => match redis {
                Some(redis) => redis.target = crate::limit::redis::RedisTarget::Url(url),
                None => *redis = Some(RedisConfig::with_url(url)),
            },
            Err(message) => sink.push(None, "FLOODGATE_REDIS_URL", message),
        }
    }
}

/// TOML syntax, types and unknown keys: serde stops at the first such problem.
fn deserialize(path: &Path, text: &str) -> Result<FileConfig, ConfigErrors> {
    let fail = |span, key: String, message: String| {
        let mut sink = ErrorSink::new(text);
        sink.push(span, key, message);
        sink.into_errors(path)
    };
    let deserializer = toml::Deserializer::parse(text).map_err(|e| {
        fail(
            e.span(),
            String::new(),
            format!("invalid TOML: {}", e.message().trim()),
        )
    })?;
    serde_path_to_error::deserialize::<_, FileConfig>(deserializer).map_err(|e| {
        // `Spanned` values show up in the path as serde's private wrapper fields.
        let key = e
            .path()
            .to_string()
            .split('.')
            .filter(|segment| !segment.is_empty() && !segment.starts_with("$__serde_spanned"))
            .collect::<Vec<_>>()
            .join(".");
        let inner = e.into_inner();
        fail(inner.span(), key, inner.message().trim().to_owned())
    })
}

/// Parses a spanned string with `parse`, recording a failure at its position.
fn parse_spanned<T>(
    value: &Spanned<String>,
    key: impl Into<String>,
    sink: &mut ErrorSink,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Option<T> {
    match parse(value.get_ref()) {
        Ok(v) => Some(v),
        Err(message) => {
            sink.push(Some(value.span()), key, message);
            None
        }
    }
}

/// An HTTP status from `range`, read from a TOML integer; otherwise an error at `key`
/// naming the range.
fn status_in(
    value: &Spanned<i64>,
    range: std::ops::RangeInclusive<u16>,
    key: impl Into<String>,
    sink: &mut ErrorSink,
) -> Option<StatusCode> {
    let status = u16::try_from(*value.get_ref())
        .ok()
        .filter(|code| range.contains(code))
        .and_then(|code| StatusCode::from_u16(code).ok());
    if status.is_none() {
        sink.push(
            Some(value.span()),
            key,
            format!(
                "expected an HTTP status from {} to {}, got {}",
                range.start(),
                range.end(),
                value.get_ref()
            ),
        );
    }
    status
}

/// An optional spanned value, parsed, or `default` when absent or invalid.
fn parse_or<T>(
    value: &Option<Spanned<String>>,
    key: &str,
    default: T,
    sink: &mut ErrorSink,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> T {
    value
        .as_ref()
        .and_then(|v| parse_spanned(v, key, sink, parse))
        .unwrap_or(default)
}

/// `KEY.content_type`, or `default` when absent.
fn content_type(
    value: &Option<Spanned<String>>,
    key: &str,
    default: &'static str,
    sink: &mut ErrorSink,
) -> Option<HeaderValue> {
    match value {
        None => Some(HeaderValue::from_static(default)),
        Some(ct) => parse_spanned(ct, format!("{key}.content_type"), sink, |text| {
            HeaderValue::from_str(text)
                .map_err(|_| format!("expected a valid Content-Type value, got {text:?}"))
        }),
    }
}

/// The admin API's bearer token: long enough not to be guessed, and sendable in a header.
fn admin_token(text: &str) -> Result<String, String> {
    if text.len() < 16 || !text.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("expected a token of at least 16 visible ASCII characters".into());
    }
    Ok(text.to_owned())
}

fn socket_addr(text: &str) -> Result<SocketAddr, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("expected an address such as \"0.0.0.0:8080\" or \"[::]:8080\", got {text:?}"))
}

/// The largest `server.max_connections`: more than any machine's open-file limit.
const MAX_CONNECTIONS_CEILING: i64 = 100_000_000;

fn validate_server(raw: ServerFile, base: &Path, sink: &mut ErrorSink) -> ServerConfig {
    let default_listen = DEFAULT_LISTEN.parse().expect("valid default");
    let default_admin = DEFAULT_ADMIN_LISTEN;
    let trusted_proxies = cidrs(&raw.trusted_proxies, "server.trusted_proxies", sink);
    let workers = match raw.workers {
        Some(w) if *w.get_ref() < 0 || *w.get_ref() > 1024 => {
            sink.push(
                Some(w.span()),
                "server.workers",
                format!(
                    "expected 0 (one per CPU core) or a thread count up to 1024, got {}",
                    w.get_ref()
                ),
            );
            0
        }
        Some(w) => *w.get_ref() as usize,
        None => 0,
    };
    let max_connections = raw.max_connections.as_ref().and_then(|max| {
        let value = *max.get_ref();
        if (1..=MAX_CONNECTIONS_CEILING).contains(&value) {
            Some(value as usize)
        } else {
            sink.push(
                Some(max.span()),
                "server.max_connections",
                format!("expected a connection count from 1 to {MAX_CONNECTIONS_CEILING}, got {value}"),
            );
            None
        }
    });
    let request_id = match &raw.request_id {
        None => Some(HeaderName::from_static(DEFAULT_REQUEST_ID)),
        Some(name) if name.get_ref().is_empty() => None,
        Some(name) => parse_spanned(name, "server.request_id", sink, request_id_header),
    };
    ServerConfig {
        listen: parse_or(&raw.listen, "server.listen", default_listen, sink, socket_addr),
        admin_listen: parse_or(
            &raw.admin_listen,
            "server.admin_listen",
            default_admin,
            sink,
            socket_addr,
        ),
        trusted_proxies,
        deny: cidrs(&raw.deny, "server.deny", sink),
        admin_token: raw
            .admin_token
            .as_ref()
            .and_then(|token| parse_spanned(token, "server.admin_token", sink, admin_token)),
        shutdown_grace: parse_or(
            &raw.shutdown_grace,
            "server.shutdown_grace",
            DEFAULT_SHUTDOWN_GRACE,
            sink,
            values::duration,
        ),
        header_timeout: parse_or(
            &raw.header_timeout,
            "server.header_timeout",
            DEFAULT_HEADER_TIMEOUT,
            sink,
            values::positive_duration,
        ),
        body_timeout: parse_or(
            &raw.body_timeout,
            "server.body_timeout",
            DEFAULT_BODY_TIMEOUT,
            sink,
            values::positive_duration,
        ),
        send_timeout: parse_or(
            &raw.send_timeout,
            "server.send_timeout",
            DEFAULT_SEND_TIMEOUT,
            sink,
            values::positive_duration,
        ),
        tunnel_idle_timeout: parse_or(
            &raw.tunnel_idle_timeout,
            "server.tunnel_idle_timeout",
            DEFAULT_TUNNEL_IDLE_TIMEOUT,
            sink,
            values::positive_duration,
        ),
        workers,
        max_connections,
        ratelimit_headers: parse_or(
            &raw.ratelimit_headers,
            "server.ratelimit_headers",
            RateLimitHeaders::Ietf,
            sink,
            |text| match text {
                "ietf" => Ok(RateLimitHeaders::Ietf),
                "legacy" => Ok(RateLimitHeaders::Legacy),
                "both" => Ok(RateLimitHeaders::Both),
                "none" => Ok(RateLimitHeaders::None),
                other => Err(format!(
                    "expected one of \"ietf\", \"legacy\", \"both\", \"none\", got {other:?}"
                )),
            },
        ),
        max_body: raw
            .max_body
            .as_ref()
            .and_then(|v| parse_spanned(v, "server.max_body", sink, values::size)),
        tls: raw
            .tls
            .as_ref()
            .and_then(|tls| tls::validate_tls(tls, base, sink)),
        errors: shaping::error_pages(raw.errors.as_ref(), base, sink),
        // An invalid rule is in `sink`, which refuses the whole file.
        request_headers: shaping::header_rules(
            "server.request_headers",
            raw.request_headers.as_ref(),
            (shaping::Direction::Request, request_id.as_ref()),
            sink,
        )
        .unwrap_or_default(),
        response_headers: shaping::header_rules(
            "server.response_headers",
            raw.response_headers.as_ref(),
            (shaping::Direction::Response, request_id.as_ref()),
            sink,
        )
        .unwrap_or_default(),
        drop_invalid_headers: raw.drop_invalid_headers.unwrap_or(true),
        request_id,
    }
}

/// The header of request IDs unless `server.request_id` says otherwise.
const DEFAULT_REQUEST_ID: &str = "x-request-id";

/// `server.request_id`: a header name that carries nothing else, that PHP can read
/// (no `_`), and that floodgate does not manage itself.
fn request_id_header(text: &str) -> Result<HeaderName, String> {
    let name =
        HeaderName::from_bytes(text.as_bytes()).map_err(|_| format!("{text:?} is not a header name"))?;
    // Besides what frames a request and what floodgate sets for the upstream: the trace
    // context, and every forwarding header.
    const ALSO_RESERVED: [&str; 3] = ["traceparent", "tracestate", "forwarded"];
    if shaping::reserved_on_requests(&name)
        || ALSO_RESERVED.contains(&name.as_str())
        || name.as_str().starts_with("x-forwarded-")
    {
        return Err(format!(
            "{text:?} is a header floodgate or HTTP uses for something else; use a name of its own such as \"X-Request-Id\""
        ));
    }
    if name.as_str().contains('_') {
        return Err(format!(
            "{text:?} holds `_`, which PHP and CGI cannot tell from `-`; use `-`"
        ));
    }
    Ok(name)
}

fn validate_tracing(raw: TracingFile, sink: &mut ErrorSink) -> Option<TracingConfig> {
    let endpoint = parse_spanned(&raw.endpoint, "tracing.endpoint", sink, |text| {
        let uri: Uri = text.parse().map_err(|_| format!("{text:?} is not a URL"))?;
        match (uri.scheme_str(), uri.authority()) {
            (Some("http" | "https"), Some(authority)) if authority.as_str().contains('@') => Err(format!(
                "{text:?} holds credentials: floodgate sends none to the collector"
            )),
            (Some("http" | "https"), Some(_)) if uri.query().is_none() => Ok(uri),
            _ => Err(format!(
                "expected the collector's http:// or https:// base URL (such as \"http://otel-collector:4318\"), got {text:?}"
            )),
        }
    });
    let sample = match &raw.sample {
        None => 1.0,
        Some(sample) if (0.0..=1.0).contains(sample.get_ref()) => *sample.get_ref(),
        Some(sample) => {
            sink.push(
                Some(sample.span()),
                "tracing.sample",
                format!("expected a share from 0 to 1, got {}", sample.get_ref()),
            );
            return None;
        }
    };
    let service_name = match &raw.service_name {
        None => "floodgate".to_owned(),
        Some(name) if name.get_ref().trim().is_empty() => {
            sink.push(Some(name.span()), "tracing.service_name", "expected a name");
            return None;
        }
        Some(name) => name.get_ref().clone(),
    };
    Some(TracingConfig {
        endpoint: endpoint?,
        sample,
        service_name,
    })
}

/// Tables by name (`[upstreams.NAME]`, `[limits.NAME]`).
type Named<T> = BTreeMap<String, Arc<T>>;

/// What a route's table may name (the upstreams, the limits) and the request ID's header,
/// which its rules may not touch.
type Known<'a> = (
    &'a Named<UpstreamConfig>,
    &'a Named<LimitConfig>,
    Option<&'a HeaderName>,
);

fn validate_routes(
    raw: Vec<Spanned<RouteFile>>,
    known: Known<'_>,
    base: &Path,
    sink: &mut ErrorSink,
) -> Vec<RouteConfig> {
    let mut names = HashSet::new();
    let mut routes = Vec::with_capacity(raw.len());
    for (i, route) in raw.into_iter().enumerate() {
        let key = format!("routes[{i}]");
        let span = route.span();
        let route = route.into_inner();
        if let Some(route) = validate_route(&key, span, route, known, base, &mut names, sink) {
            routes.push(route);
        }
    }
    routes
}

fn validate_route(
    key: &str,
    span: std::ops::Range<usize>,
    raw: RouteFile,
    (upstreams, limits, request_id): Known<'_>,
    base: &Path,
    names: &mut HashSet<String>,
    sink: &mut ErrorSink,
) -> Option<RouteConfig> {
    let name = raw.name.get_ref().trim().to_owned();
    if name.is_empty() {
        sink.push(
            Some(raw.name.span()),
            format!("{key}.name"),
            "expected a non-empty route name",
        );
    } else if !names.insert(name.clone()) {
        sink.push(
            Some(raw.name.span()),
            format!("{key}.name"),
            format!("route name {name:?} is already used by an earlier route; expected unique names"),
        );
    }
    let host = raw
        .host
        .as_ref()
        .and_then(|h| parse_spanned(h, format!("{key}.host"), sink, host_match));
    let path = match (&raw.path, &raw.path_prefix) {
        (Some(_), Some(prefix)) => {
            sink.both(prefix.span(), format!("{key}.path_prefix"), "path", "path_prefix");
            None
        }
        (Some(path), None) => {
            parse_spanned(path, format!("{key}.path"), sink, route_path).map(PathMatch::exact)
        }
        (None, Some(prefix)) => {
            parse_spanned(prefix, format!("{key}.path_prefix"), sink, route_path).map(PathMatch::Prefix)
        }
        (None, None) => Some(PathMatch::Prefix("/".to_owned())),
    };
    let methods = match &raw.methods {
        None => Some(None),
        Some(list) if list.is_empty() => {
            sink.push(
                Some(span.clone()),
                format!("{key}.methods"),
                "expected at least one method",
            );
            None
        }
        Some(list) => list
            .iter()
            .enumerate()
            .map(|(i, m)| parse_spanned(m, format!("{key}.methods[{i}]"), sink, method))
            .collect::<Option<Vec<_>>>()
            .map(Some),
    };
    let beside = match raw
        .upstream
        .as_ref()
        .and_then(|name| upstreams.get(name.get_ref()))
    {
        Some(upstream) if upstream.fastcgi.is_some() => site::Beside::FastCgi,
        Some(_) => site::Beside::Http,
        None => site::Beside::Nothing,
    };
    let site = site::site(key, &raw, beside, base, sink);
    let has_respond = raw.respond.is_some();
    if let (Some(root), true) = (&raw.root, has_respond) {
        sink.both(root.span(), format!("{key}.root"), "respond", "root");
    }
    let target = match (&raw.upstream, raw.respond) {
        (Some(_), Some(respond)) => {
            sink.both(respond.span(), format!("{key}.respond"), "upstream", "respond");
            None
        }
        (Some(name), None) => match upstreams.get(name.get_ref()) {
            Some(upstream) => Some(RouteTarget::Upstream(upstream.clone())),
            None if sink.reported_in(&format!("upstreams.{}", name.get_ref())) => None,
            None => {
                let known: Vec<_> = upstreams.keys().map(|k| format!("{k:?}")).collect();
                sink.push(
                    Some(name.span()),
                    format!("{key}.upstream"),
                    format!(
                        "unknown upstream {:?}; expected one of the [upstreams.*] tables: {}",
                        name.get_ref(),
                        if known.is_empty() {
                            "none are defined".to_owned()
                        } else {
                            known.join(", ")
                        }
                    ),
                );
                None
            }
        },
        (None, Some(respond)) => {
            let span = respond.span();
            validate_respond(
                &format!("{key}.respond"),
                span,
                respond.into_inner(),
                request_id,
                sink,
            )
            .map(RouteTarget::Respond)
        }
        (None, None) if raw.root.is_some() => None,
        (None, None) => {
            sink.push(
                Some(span),
                key.to_owned(),
                "expected `upstream = \"NAME\"`, `respond = { status = ... }` or `root = \"DIRECTORY\"`",
            );
            None
        }
    };
    let route_limits = route_limits(key, &raw.limits, limits, sink);
    let strip_prefix = match (&raw.strip_prefix, &path) {
        (None, _) => Some(None),
        (Some(strip), _) if matches!(target, Some(RouteTarget::Respond(_))) => {
            sink.push(
                Some(strip.span()),
                format!("{key}.strip_prefix"),
                "strip_prefix applies only to a route with an upstream",
            );
            None
        }
        (Some(strip), Some(path)) => {
            let p = path.as_str();
            parse_spanned(strip, format!("{key}.strip_prefix"), sink, |text| {
                let prefix = text.trim_end_matches('/');
                // Whole path segments only: "/api" of "/api/", not "/ap".
                let whole = p
                    .strip_prefix(prefix)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'));
                if text.starts_with('/') && whole {
                    Ok(Some(prefix.to_owned()))
                } else {
                    Err(format!(
                        "expected a prefix of the route's path {p:?} made of whole segments, got {text:?}"
                    ))
                }
            })
        }
        (Some(_), None) => None,
    };
    let request_headers = shaping::header_rules(
        &format!("{key}.request_headers"),
        raw.request_headers.as_ref(),
        (shaping::Direction::Request, request_id),
        sink,
    );
    let response_headers = shaping::header_rules(
        &format!("{key}.response_headers"),
        raw.response_headers.as_ref(),
        (shaping::Direction::Response, request_id),
        sink,
    );
    let cost = match &raw.cost {
        None => Some(1),
        Some(cost) if *cost.get_ref() >= 1 => Some(*cost.get_ref() as u64),
        Some(cost) => {
            sink.push(
                Some(cost.span()),
                format!("{key}.cost"),
                "expected a whole number ≥ 1",
            );
            None
        }
    };
    let cost = cost.filter(|&cost| admitted_cost(key, cost, &raw.cost, route_limits.as_deref(), sink));
    // A route with `root` alone serves its site; one with an upstream has it beside.
    let (target, site) = match (target, site?) {
        (None, Some(site)) if raw.upstream.is_none() && !has_respond => {
            (Some(RouteTarget::Files(site)), None)
        }
        (target, site) => (target, site),
    };
    Some(RouteConfig {
        name: Arc::from(name.as_str()),
        host,
        path: path?,
        methods: methods?,
        target: target?,
        limits: route_limits?,
        cost: cost?,
        allow: raw
            .allow
            .is_some()
            .then(|| cidrs(&raw.allow, &format!("{key}.allow"), sink)),
        deny: cidrs(&raw.deny, &format!("{key}.deny"), sink),
        strip_prefix: strip_prefix?,
        request_headers: request_headers?,
        response_headers: response_headers?,
        site,
        compress: raw.compress.unwrap_or(false),
    })
}

/// Whether each rate limit of a route admits a request of its `cost` when nothing was
/// spent yet: one that never does refuses every request.
fn admitted_cost(
    key: &str,
    cost: u64,
    raw: &Option<Spanned<i64>>,
    limits: Option<&[Arc<LimitConfig>]>,
    sink: &mut ErrorSink,
) -> bool {
    let never = limits.into_iter().flatten().find_map(|limit| match &limit.kind {
        LimitKind::Rate(rate) => {
            let most = rate.algorithm.capacity();
            (most < cost).then_some((&limit.name, most))
        }
        LimitKind::Concurrency(_) => None,
    });
    let Some((name, most)) = never else {
        return true;
    };
    sink.push(
        raw.as_ref().map(Spanned::span),
        format!("{key}.cost"),
        format!("limit {name:?} admits at most {most} at once: every request would be refused"),
    );
    false
}

/// A list of CIDRs (or addresses), each error at its place.
pub(super) fn cidrs(raw: &Option<Vec<Spanned<String>>>, key: &str, sink: &mut ErrorSink) -> Vec<IpNet> {
    raw.iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, v)| parse_spanned(v, format!("{key}[{i}]"), sink, values::cidr))
        .collect()
}

/// A route's `limits = [...]`, each resolved to a defined limit, none twice.
fn route_limits(
    key: &str,
    names: &Option<Vec<Spanned<String>>>,
    limits: &BTreeMap<String, Arc<LimitConfig>>,
    sink: &mut ErrorSink,
) -> Option<Vec<Arc<LimitConfig>>> {
    let mut resolved: Vec<Arc<LimitConfig>> = Vec::new();
    let mut ok = true;
    for (i, name) in names.iter().flatten().enumerate() {
        let entry = format!("{key}.limits[{i}]");
        if i == MAX_LIMITS_PER_ROUTE {
            sink.push(
                Some(name.span()),
                entry.clone(),
                format!("a route names at most {MAX_LIMITS_PER_ROUTE} limits"),
            );
            ok = false;
        }
        match limits.get(name.get_ref()) {
            Some(_) if resolved.iter().any(|l| *l.name == **name.get_ref()) => {
                sink.push(
                    Some(name.span()),
                    entry,
                    format!("limit {:?} is listed twice", name.get_ref()),
                );
                ok = false;
            }
            Some(limit) => resolved.push(limit.clone()),
            None if sink.reported_in(&format!("limits.{}", name.get_ref())) => ok = false,
            None => {
                let known: Vec<_> = limits.keys().map(|k| format!("{k:?}")).collect();
                sink.push(
                    Some(name.span()),
                    entry,
                    format!(
                        "unknown limit {:?}; expected one of the [limits.*] tables: {}",
                        name.get_ref(),
                        if known.is_empty() {
                            "none are defined".to_owned()
                        } else {
                            known.join(", ")
                        }
                    ),
                );
                ok = false;
            }
        }
    }
    ok.then_some(resolved)
}

fn validate_respond(
    key: &str,
    span: std::ops::Range<usize>,
    raw: RespondFile,
    request_id: Option<&HeaderName>,
    sink: &mut ErrorSink,
) -> Option<RespondConfig> {
    let status = match raw.status {
        None => Some(StatusCode::OK),
        Some(status) => status_in(&status, 200..=599, format!("{key}.status"), sink),
    };
    let content_type = content_type(&raw.content_type, key, "text/plain", sink);
    let headers = shaping::respond_headers(key, raw.headers.as_ref(), (status, request_id), span, sink);
    Some(RespondConfig {
        status: status?,
        body: Bytes::from(raw.body.unwrap_or_default()),
        content_type: content_type?,
        headers: headers?,
    })
}

fn host_match(text: &str) -> Result<HostMatch, String> {
    let host = text.trim().trim_end_matches('.').to_ascii_lowercase();
    let valid_label = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
    };
    match host.strip_prefix("*.") {
        Some(domain) if valid_label(domain) => Ok(HostMatch::Wildcard(format!(".{domain}"))),
        None if valid_label(&host) => Ok(HostMatch::Exact(host)),
        _ => Err(format!(
            "expected a host name such as \"api.example.com\" or \"*.example.com\" (no port), got {text:?}"
        )),
    }
}

fn route_path(text: &str) -> Result<String, String> {
    match normalize_path(text) {
        // Routes read a request's encoded slashes as slashes: one here would never match.
        Ok(normalized) if normalized == text && !text.contains("%2F") => Ok(text.to_owned()),
        _ => Err(format!(
            "expected a normalized path starting with \"/\" (no \".\", \"..\" or \"//\" segments, no \"%2F\": write \"/\"), got {text:?}"
        )),
    }
}

fn method(text: &str) -> Result<Method, String> {
    let upper = text.trim().to_ascii_uppercase();
    if upper.is_empty()
        || !upper
            .bytes()
            .all(|b| b.is_ascii_alphabetic() || b == b'-' || b == b'_')
    {
        return Err(format!("expected an HTTP method such as \"GET\", got {text:?}"));
    }
    Method::from_bytes(upper.as_bytes())
        .map_err(|_| format!("expected an HTTP method such as \"GET\", got {text:?}"))
}

#[cfg(test)]
mod tests;
