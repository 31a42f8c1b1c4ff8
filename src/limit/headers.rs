//! Rate-limit response headers (SPEC §5): `ietf` (draft-ietf-httpapi-ratelimit-headers),
//! `legacy` (`X-RateLimit-*` for the most restrictive limit), `both` or `none`.

use std::time::Duration;

use http::header::{HeaderName, HeaderValue};

use super::LimitDecision;
use crate::config::{LimitConfig, RateLimitHeaders};

pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// Whole seconds, rounded up.
pub fn ceil_seconds(duration: Duration) -> u64 {
    duration.as_micros().div_ceil(1_000_000) as u64
}

/// The `RateLimit-Policy` value for `limits` (computed once per route at load).
pub fn policy_value<'a>(limits: impl IntoIterator<Item = &'a LimitConfig>) -> Option<HeaderValue> {
    let items: Vec<String> = limits
        .into_iter()
        .map(|limit| {
            let (quota, window) = limit.policy();
            format!("\"{}\";q={quota};w={window}", limit.name)
        })
        .collect();
    if items.is_empty() {
        return None;
    }
    HeaderValue::from_str(&items.join(", ")).ok()
}

/// The headers for the enforced limits that were decided for one request.
pub fn render(
    mode: RateLimitHeaders,
    policy: Option<&HeaderValue>,
    decided: &[(&LimitConfig, LimitDecision)],
    out: &mut Vec<(HeaderName, HeaderValue)>,
) {
    if decided.is_empty() {
        return;
    }
    if matches!(mode, RateLimitHeaders::Ietf | RateLimitHeaders::Both) {
        if let Some(policy) = policy {
            out.push((RATELIMIT_POLICY.clone(), policy.clone()));
        }
        let items: Vec<String> = decided
            .iter()
            .map(|(limit, d)| format!("\"{}\";r={};t={}", limit.name, d.remaining, ceil_seconds(d.reset)))
            .collect();
        if let Ok(value) = HeaderValue::from_str(&items.join(", ")) {
            out.push((RATELIMIT.clone(), value));
        }
    }
    if matches!(mode, RateLimitHeaders::Legacy | RateLimitHeaders::Both) {
        let (limit, decision) = decided
            .iter()
            .min_by_key(|(_, d)| d.remaining)
            .expect("decided is not empty");
        out.push((X_RATELIMIT_LIMIT.clone(), HeaderValue::from(limit.policy().0)));
        out.push((
            X_RATELIMIT_REMAINING.clone(),
            HeaderValue::from(decision.remaining),
        ));
        out.push((
            X_RATELIMIT_RESET.clone(),
            HeaderValue::from(ceil_seconds(decision.reset)),
        ));
    }
}
