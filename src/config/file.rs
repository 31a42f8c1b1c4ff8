//! The raw shape of `gateway.toml`, exactly as serde reads it.
//!
//! Every table rejects unknown keys, so a typo is an error instead of a silently ignored
//! setting. Values that need more than a type check (durations, sizes, addresses, CIDRs,
//! URLs, references) are kept as [`Spanned`] strings so that validation in
//! [`super::Config`] can point at their `file:line:column`.

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

/// The whole file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileConfig {
    #[serde(default)]
    pub server: ServerFile,
    pub redis: Option<Spanned<RedisFile>>,
    #[serde(default)]
    pub upstreams: BTreeMap<String, Spanned<UpstreamFile>>,
    #[serde(default)]
    pub limits: BTreeMap<String, Spanned<LimitFile>>,
    #[serde(default)]
    pub routes: Vec<Spanned<RouteFile>>,
    pub tracing: Option<Spanned<TracingFile>>,
}

/// `[tracing]`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TracingFile {
    pub endpoint: Spanned<String>,
    pub sample: Option<Spanned<f64>>,
    pub service_name: Option<Spanned<String>>,
}

/// `[server]`
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ServerFile {
    pub listen: Option<Spanned<String>>,
    pub admin_listen: Option<Spanned<String>>,
    pub trusted_proxies: Option<Vec<Spanned<String>>>,
    pub deny: Option<Vec<Spanned<String>>>,
    pub admin_token: Option<Spanned<String>>,
    pub shutdown_grace: Option<Spanned<String>>,
    pub header_timeout: Option<Spanned<String>>,
    pub body_timeout: Option<Spanned<String>>,
    pub send_timeout: Option<Spanned<String>>,
    pub tunnel_idle_timeout: Option<Spanned<String>>,
    pub workers: Option<Spanned<i64>>,
    pub max_connections: Option<Spanned<i64>>,
    pub ratelimit_headers: Option<Spanned<String>>,
    pub max_body: Option<Spanned<String>>,
    pub tls: Option<Spanned<TlsFile>>,
    pub errors: Option<BTreeMap<String, Spanned<ErrorPageFile>>>,
    pub request_headers: Option<Spanned<HeaderRulesFile>>,
    pub response_headers: Option<Spanned<HeaderRulesFile>>,
    pub drop_invalid_headers: Option<bool>,
    pub request_id: Option<Spanned<String>>,
}

/// One entry of `[server.errors]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ErrorPageFile {
    pub body: Option<String>,
    pub body_file: Option<Spanned<String>>,
    pub content_type: Option<Spanned<String>>,
}

/// A route's `request_headers` or `response_headers`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct HeaderRulesFile {
    pub set: Option<Spanned<BTreeMap<String, Spanned<String>>>>,
    pub remove: Option<Vec<Spanned<String>>>,
}

/// `[server.tls]`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TlsFile {
    pub listen: Spanned<String>,
    pub certificates: Option<Spanned<Vec<Spanned<CertificateFile>>>>,
    pub min_version: Option<Spanned<String>>,
    pub redirect_http: Option<bool>,
    pub hsts: Option<Spanned<String>>,
    pub acme: Option<Spanned<AcmeFile>>,
}

/// `[server.tls.acme]`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AcmeFile {
    pub directory: Spanned<String>,
    /// One `mailto:` URL, or several.
    pub contact: Option<Spanned<toml::Value>>,
    pub domains: Spanned<Vec<Spanned<String>>>,
    pub storage: Option<Spanned<String>>,
    pub ca: Option<Spanned<String>>,
    pub eab: Option<Spanned<EabFile>>,
}

/// `eab = { kid = "...", hmac_key = "..." }`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EabFile {
    pub kid: Spanned<String>,
    pub hmac_key: Spanned<String>,
}

/// `{ cert = "...", key = "..." }`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CertificateFile {
    pub cert: Spanned<String>,
    pub key: Spanned<String>,
}

/// `[upstreams.NAME]`: `url` or `servers`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct UpstreamFile {
    pub url: Option<Spanned<String>>,
    /// Each a URL or `{ url, weight }`: read as TOML values, since serde's untagged
    /// enums lose the positions of what they hold.
    pub servers: Option<Spanned<Vec<Spanned<toml::Value>>>>,
    pub balance: Option<Spanned<String>>,
    pub hash_key: Option<Spanned<Vec<Spanned<String>>>>,
    pub max_fails: Option<Spanned<i64>>,
    pub fail_timeout: Option<Spanned<String>>,
    pub retries: Option<Spanned<i64>>,
    pub health_check: Option<Spanned<HealthCheckFile>>,
    pub max_requests: Option<Spanned<i64>>,
    pub queue: Option<Spanned<i64>>,
    pub queue_timeout: Option<Spanned<String>>,
    pub connect_timeout: Option<Spanned<String>>,
    pub timeout: Option<Spanned<String>>,
    pub tls_ca: Option<Spanned<String>>,
    pub tls_server_name: Option<Spanned<String>>,
    pub env: Option<Spanned<BTreeMap<String, Spanned<String>>>>,
    pub response_buffer: Option<Spanned<String>>,
}

/// `health_check = { path, interval, timeout }`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct HealthCheckFile {
    pub path: Spanned<String>,
    pub interval: Option<Spanned<String>>,
    pub timeout: Option<Spanned<String>>,
}

/// One `[[routes]]` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RouteFile {
    pub name: Spanned<String>,
    pub host: Option<Spanned<String>>,
    pub path: Option<Spanned<String>>,
    pub path_prefix: Option<Spanned<String>>,
    pub methods: Option<Vec<Spanned<String>>>,
    pub upstream: Option<Spanned<String>>,
    pub respond: Option<Spanned<RespondFile>>,
    pub limits: Option<Vec<Spanned<String>>>,
    pub cost: Option<Spanned<i64>>,
    pub allow: Option<Vec<Spanned<String>>>,
    pub deny: Option<Vec<Spanned<String>>>,
    pub strip_prefix: Option<Spanned<String>>,
    pub request_headers: Option<Spanned<HeaderRulesFile>>,
    pub response_headers: Option<Spanned<HeaderRulesFile>>,
    pub root: Option<Spanned<String>>,
    pub php_root: Option<Spanned<String>>,
    pub index: Option<Spanned<String>>,
    pub split_path: Option<Spanned<String>>,
    pub compress: Option<bool>,
}

/// A route's inline `respond = { ... }` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RespondFile {
    pub status: Option<Spanned<i64>>,
    pub body: Option<String>,
    pub content_type: Option<Spanned<String>>,
    pub headers: Option<Spanned<BTreeMap<String, Spanned<String>>>>,
}

/// `[redis]`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RedisFile {
    pub url: Option<Spanned<String>>,
    pub cluster: Option<Spanned<bool>>,
    pub sentinels: Option<Spanned<Vec<String>>>,
    pub master_name: Option<Spanned<String>>,
    pub prefix: Option<Spanned<String>>,
    pub timeout: Option<Spanned<String>>,
    pub on_error: Option<Spanned<String>>,
}

/// `[limits.NAME]`: every key of every algorithm; validation rejects those that do not
/// belong to the chosen one.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LimitFile {
    pub algorithm: Spanned<String>,
    pub limit: Option<Spanned<i64>>,
    pub window: Option<Spanned<String>>,
    pub rate: Option<Spanned<f64>>,
    pub per: Option<Spanned<String>>,
    pub burst: Option<Spanned<i64>>,
    pub key: Option<Vec<Spanned<String>>>,
    pub lockout: Option<Spanned<String>>,
    pub exempt: Option<Vec<Spanned<String>>>,
    pub mode: Option<Spanned<String>>,
    pub status: Option<Spanned<i64>>,
    pub message: Option<Spanned<String>>,
    pub overrides: Option<Vec<Spanned<OverrideFile>>>,
    pub count: Option<Spanned<String>>,
    pub failure_status: Option<Spanned<Vec<Spanned<i64>>>>,
    pub lease: Option<Spanned<String>>,
    pub content_type: Option<Spanned<String>>,
}

impl LimitFile {
    /// A copy of everything but `overrides` (which may be large).
    pub(crate) fn clone_without_overrides(&self) -> LimitFile {
        LimitFile {
            algorithm: self.algorithm.clone(),
            limit: self.limit.clone(),
            window: self.window.clone(),
            rate: self.rate.clone(),
            per: self.per.clone(),
            burst: self.burst.clone(),
            key: self.key.clone(),
            lockout: self.lockout.clone(),
            exempt: self.exempt.clone(),
            mode: self.mode.clone(),
            status: self.status.clone(),
            message: self.message.clone(),
            overrides: None,
            count: self.count.clone(),
            failure_status: self.failure_status.clone(),
            lease: self.lease.clone(),
            content_type: self.content_type.clone(),
        }
    }
}

/// One entry of a limit's `overrides`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct OverrideFile {
    pub key: Vec<Spanned<String>>,
    pub exempt: Option<bool>,
    pub limit: Option<Spanned<i64>>,
    pub window: Option<Spanned<String>>,
    pub rate: Option<Spanned<f64>>,
    pub per: Option<Spanned<String>>,
    pub burst: Option<Spanned<i64>>,
}
