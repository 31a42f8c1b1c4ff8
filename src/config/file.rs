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
    #[serde(default)]
    pub upstreams: BTreeMap<String, Spanned<UpstreamFile>>,
    #[serde(default)]
    pub routes: Vec<Spanned<RouteFile>>,
}

/// `[server]`
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ServerFile {
    pub listen: Option<Spanned<String>>,
    pub admin_listen: Option<Spanned<String>>,
    pub trusted_proxies: Option<Vec<Spanned<String>>>,
    pub shutdown_grace: Option<Spanned<String>>,
    pub header_timeout: Option<Spanned<String>>,
    pub workers: Option<Spanned<i64>>,
    pub ratelimit_headers: Option<Spanned<String>>,
    pub max_body: Option<Spanned<String>>,
}

/// `[upstreams.NAME]`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct UpstreamFile {
    pub url: Spanned<String>,
    pub connect_timeout: Option<Spanned<String>>,
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
}

/// A route's inline `respond = { ... }` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RespondFile {
    pub status: Option<Spanned<i64>>,
    pub body: Option<String>,
    pub content_type: Option<Spanned<String>>,
}
