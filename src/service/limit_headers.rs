//! Rate-limit response headers (docs/configuration.md#rate-limit-headers): `ietf` (draft-ietf-httpapi-ratelimit-headers),
//! `legacy` (`X-RateLimit-*` for the most restrictive limit), `both` or `none`.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use smallvec::SmallVec;

use crate::config::RateLimitHeaders;
use crate::limit::{Algorithm, LimitDecision};

pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// One response's rate-limit headers: inline for `ietf`'s two (the default).
pub type LimitHeaders = SmallVec<[(HeaderName, HeaderValue); 2]>;

/// Whole seconds, rounded up.
pub fn ceil_seconds(duration: Duration) -> u64 {
    // Of whole microseconds (what the stores count in), without 128-bit division.
    duration
        .as_secs()
        .saturating_add(u64::from(duration.subsec_micros() > 0))
}

/// A rate limit as the headers name it: its name, and the algorithm that decides the
/// request (an override's when one applies).
#[derive(Debug, Clone, Copy)]
pub struct Described<'a> {
    pub name: &'a str,
    pub algorithm: &'a Algorithm,
}

impl Described<'_> {
    /// The `q` and `w` of the `RateLimit-Policy` header: the quota, and the window in
    /// whole seconds (for buckets, the time to refill an empty bucket, rounded up).
    pub fn policy(&self) -> (u64, u64) {
        let seconds = |us: f64| (us / 1e6).ceil().max(1.0) as u64;
        match *self.algorithm {
            Algorithm::FixedWindow { limit, window } | Algorithm::SlidingWindow { limit, window } => {
                (limit, seconds(window as f64))
            }
            Algorithm::TokenBucket { rate, per, burst } | Algorithm::LeakyBucket { rate, per, burst } => {
                (burst, seconds(burst as f64 * per as f64 / rate))
            }
        }
    }
}

/// The `RateLimit-Policy` value for `limits` (computed once per route at load).
pub fn policy_value<'a>(limits: impl IntoIterator<Item = Described<'a>>) -> Option<HeaderValue> {
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

/// The headers for the enforced limits that were decided for one request, `admitted`
/// or refused. An admitted request's units count the remaining room down, so its
/// `RateLimit` and `X-RateLimit-Remaining` values are new at each response: they are
/// marked sensitive, for HTTP/2's header compression never to index them (each would
/// otherwise take a place in the connection's table and push out the headers that
/// repeat). A refused request consumes nothing: its values repeat within the second,
/// and are indexed.
pub fn render(
    mode: RateLimitHeaders,
    policy: Option<&HeaderValue>,
    decided: &[(Described<'_>, LimitDecision)],
    admitted: bool,
    out: &mut LimitHeaders,
) {
    if decided.is_empty() {
        return;
    }
    if matches!(mode, RateLimitHeaders::Ietf | RateLimitHeaders::Both) {
        if let Some(policy) = policy {
            out.push((RATELIMIT_POLICY.clone(), policy.clone()));
        }
        // Written into a buffer of its exact length, which the value then owns: one
        // allocation and no copy.
        let decimals = |n: u64| n.checked_ilog10().map_or(1, |log| log as usize + 1);
        let len = decided
            .iter()
            .map(|(limit, d)| {
                limit.name.len()
                    + "\"\";r=;t=".len()
                    + decimals(d.remaining)
                    + decimals(ceil_seconds(d.reset))
            })
            .sum::<usize>()
            + ", ".len() * (decided.len() - 1);
        let mut value = Vec::with_capacity(len);
        let mut digits = itoa::Buffer::new();
        for (i, (limit, d)) in decided.iter().enumerate() {
            if i > 0 {
                value.extend_from_slice(b", ");
            }
            value.push(b'"');
            value.extend_from_slice(limit.name.as_bytes());
            value.extend_from_slice(b"\";r=");
            value.extend_from_slice(digits.format(d.remaining).as_bytes());
            value.extend_from_slice(b";t=");
            value.extend_from_slice(digits.format(ceil_seconds(d.reset)).as_bytes());
        }
        debug_assert_eq!(value.len(), len);
        let mut value = ratelimit_value(value);
        value.set_sensitive(admitted);
        out.push((RATELIMIT.clone(), value));
    }
    if matches!(mode, RateLimitHeaders::Legacy | RateLimitHeaders::Both) {
        let (limit, decision) = decided
            .iter()
            .min_by_key(|(_, d)| d.remaining)
            .expect("decided is not empty");
        out.push((X_RATELIMIT_LIMIT.clone(), HeaderValue::from(limit.policy().0)));
        let mut remaining = HeaderValue::from(decision.remaining);
        remaining.set_sensitive(admitted);
        out.push((X_RATELIMIT_REMAINING.clone(), remaining));
        out.push((
            X_RATELIMIT_RESET.clone(),
            HeaderValue::from(ceil_seconds(decision.reset)),
        ));
    }
}

/// A `RateLimit` value as [`render`] writes it: quotes, a limit's name (`A-Z a-z 0-9 _ -
/// .`, checked at load), digits, `;`, `=`, `,` and spaces.
#[allow(unsafe_code)] // checking the bytes again cost about 75 instructions a response
fn ratelimit_value(value: Vec<u8>) -> HeaderValue {
    debug_assert!(value.iter().all(|b| b.is_ascii_graphic() || *b == b' '));
    // SAFETY: visible ASCII and spaces, which a `HeaderValue` may hold.
    unsafe { HeaderValue::from_maybe_shared_unchecked(Bytes::from(value)) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Outcome;

    fn decision(remaining: u64, reset_ms: u64) -> LimitDecision {
        LimitDecision {
            outcome: Outcome::Allowed,
            remaining,
            reset: Duration::from_millis(reset_ms),
            retry_after: Duration::ZERO,
        }
    }

    fn rendered(mode: RateLimitHeaders) -> Vec<(String, String)> {
        let minute = Described {
            name: "per_ip_minute",
            algorithm: &Algorithm::FixedWindow {
                limit: 600,
                window: 60_000_000,
            },
        };
        let burst = Described {
            name: "search_burst",
            algorithm: &Algorithm::TokenBucket {
                rate: 10.0,
                per: 1_000_000,
                burst: 20,
            },
        };
        let policy = policy_value([minute, burst]);
        let decided = [(minute, decision(599, 41_200)), (burst, decision(19, 100))];
        let mut out = LimitHeaders::new();
        render(mode, policy.as_ref(), &decided, true, &mut out);
        out.into_iter()
            .map(|(name, value)| (name.to_string(), value.to_str().unwrap().to_owned()))
            .collect()
    }

    fn pairs(expected: &[(&str, &str)]) -> Vec<(String, String)> {
        expected
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn ietf_lists_every_limit() {
        assert_eq!(
            rendered(RateLimitHeaders::Ietf),
            pairs(&[
                (
                    "ratelimit-policy",
                    "\"per_ip_minute\";q=600;w=60, \"search_burst\";q=20;w=2"
                ),
                (
                    "ratelimit",
                    "\"per_ip_minute\";r=599;t=42, \"search_burst\";r=19;t=1"
                ),
            ])
        );
    }

    #[test]
    fn legacy_names_the_most_restrictive_limit() {
        assert_eq!(
            rendered(RateLimitHeaders::Legacy),
            pairs(&[
                ("x-ratelimit-limit", "20"),
                ("x-ratelimit-remaining", "19"),
                ("x-ratelimit-reset", "1")
            ])
        );
        assert_eq!(rendered(RateLimitHeaders::Both).len(), 5);
        assert!(rendered(RateLimitHeaders::None).is_empty());
    }

    #[test]
    fn only_the_values_that_count_down_are_kept_out_of_http2_header_tables() {
        let minute = Described {
            name: "per_ip_minute",
            algorithm: &Algorithm::FixedWindow {
                limit: 600,
                window: 60_000_000,
            },
        };
        let policy = policy_value([minute]);
        let sensitive = |admitted| {
            let mut out = LimitHeaders::new();
            // A refusal by another limit leaves this one's room as it was.
            render(
                RateLimitHeaders::Both,
                policy.as_ref(),
                &[(minute, decision(599, 41_200)), (minute, decision(0, 900))],
                admitted,
                &mut out,
            );
            out.iter()
                .filter(|(_, value)| value.is_sensitive())
                .map(|(name, _)| name.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(sensitive(true), ["ratelimit", "x-ratelimit-remaining"]);
        // Refused: nothing consumed, the same values within the second.
        assert!(sensitive(false).is_empty());
    }

    #[test]
    fn every_count_is_written_whole() {
        let limit = Described {
            name: "n",
            algorithm: &Algorithm::FixedWindow { limit: 1, window: 1 },
        };
        for remaining in [0, 9, 10, 99, 100, 999_999, u64::MAX] {
            for reset_ms in [0, 1, 9_001, 10_000, 100_000_000] {
                let decided = [
                    (limit, decision(remaining, reset_ms)),
                    (limit, decision(remaining, 0)),
                ];
                let mut out = LimitHeaders::new();
                render(RateLimitHeaders::Ietf, None, &decided, true, &mut out);
                let reset = reset_ms.div_ceil(1000);
                assert_eq!(
                    out[0].1.to_str().unwrap(),
                    format!("\"n\";r={remaining};t={reset}, \"n\";r={remaining};t=0")
                );
            }
        }
    }

    #[test]
    fn seconds_round_up_whole_microseconds() {
        let cases = [
            (Duration::ZERO, 0),
            (Duration::from_nanos(999), 0),
            (Duration::from_micros(1), 1),
            (Duration::from_secs(1), 1),
            (Duration::new(1, 500), 1),
            (Duration::new(1, 1_000), 2),
            (Duration::from_micros(41_200_000), 42),
            (Duration::MAX, u64::MAX),
        ];
        for (duration, seconds) in cases {
            assert_eq!(ceil_seconds(duration), seconds, "{duration:?}");
        }
    }
}
