//! A route's limits in the request path: build one check per applicable limit, decide them
//! in one store call, count the outcomes, and tell the service what to do: pass (perhaps
//! after holding the request), or answer the rejection.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use http::header::HeaderValue;
use smallvec::SmallVec;

use super::limit_headers::{LimitHeaders, ceil_seconds, policy_value, render};
use super::request_key::{AmbiguousKey, KeySource, key_tuple};
use crate::config::{LimitConfig, Mode, Override, RateLimitHeaders};
use crate::limit::key::{lock_key, store_key};
use crate::limit::redis::refusals::RefusalCache;
use crate::limit::store::{Answer, Fallback, LimitStore, OnError};
use crate::limit::{Decisions, LimitCheck, LimitDecision, Outcome};
use crate::metrics::{LimitOutcome, Metrics};

/// What a route's limits need at request time, computed once at load.
pub(crate) struct RouteLimits {
    limits: Vec<Arc<LimitConfig>>,
    cost: u64,
    /// `RateLimit-Policy` for the route's enforced limits.
    policy: Option<HeaderValue>,
}

/// One request's checks, one per applied limit: inline for up to two.
type Checks = SmallVec<[LimitCheck; 2]>;

/// Gateway-wide settings the decision needs.
pub(crate) struct LimitSettings<'a> {
    pub store: &'a LimitStore,
    pub prefix: &'a str,
    pub on_error: OnError,
    pub headers: RateLimitHeaders,
    pub metrics: &'a Metrics,
    /// Remembered refusals (`None`: every request asks the store).
    pub refusals: Option<&'a RefusalCache>,
}

/// What the limits decided for one request.
pub(crate) struct Verdict {
    pub action: Action,
    /// The access log's `limit` field.
    pub outcome: LimitOutcome,
    /// Rate-limit headers for the response, whatever it turns out to be.
    pub headers: LimitHeaders,
}

pub(crate) enum Action {
    /// Forward, after holding the request this long (leaky bucket); `held` are the checks
    /// whose slots to give back if the client leaves before then.
    Pass { delay: Duration, held: Vec<LimitCheck> },
    /// Answer with this status, body and `Retry-After` seconds.
    Reject {
        status: StatusCode,
        message: Bytes,
        retry_after: u64,
    },
}

impl RouteLimits {
    pub(crate) fn new(limits: Vec<Arc<LimitConfig>>, cost: u64) -> Self {
        let policy = policy_value(limits.iter().filter(|l| l.mode == Mode::Enforce).map(|l| &**l));
        RouteLimits { limits, cost, policy }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.limits.is_empty()
    }

    /// Decides this request's limits, all in one store call.
    pub(crate) async fn decide(
        &self,
        settings: &LimitSettings<'_>,
        client_ip: IpAddr,
        source: &KeySource<'_>,
    ) -> Result<Verdict, AmbiguousKey> {
        let mut applied: SmallVec<[&LimitConfig; 2]> = SmallVec::new();
        let mut checks: Checks = SmallVec::new();
        // Whether every limit applies as configured (no exemption, no override): then the
        // route's RateLimit-Policy, computed at load, describes the request.
        let mut as_configured = true;
        for limit in &self.limits {
            if limit.exempt.iter().any(|net| net.contains(&client_ip)) {
                as_configured = false;
                continue;
            }
            let tuple = key_tuple(&limit.key, source)?;
            let limit: &LimitConfig = if limit.overrides.is_empty() {
                limit
            } else {
                let part =
                    |i: usize| key_tuple(std::slice::from_ref(&limit.key[i]), source).unwrap_or_default();
                match limit.overrides.find(&tuple, client_ip, part) {
                    None => limit,
                    Some(Override::Exempt) => {
                        as_configured = false;
                        continue;
                    }
                    Some(Override::Limit(overridden)) => {
                        as_configured = false;
                        overridden
                    }
                }
            };
            checks.push(LimitCheck {
                key: store_key(settings.prefix, &tuple, &limit.name, &limit.algorithm),
                algorithm: limit.algorithm,
                lockout: limit
                    .lockout
                    .map(|penalty| (lock_key(settings.prefix, &tuple, &limit.name), micros(penalty))),
                cost: self.cost,
                shadow: limit.mode == Mode::Shadow,
            });
            applied.push(limit);
        }
        if checks.is_empty() {
            return Ok(pass(LimitOutcome::Exempt));
        }
        // Shadow limits must be evaluated every time, so their requests are never served
        // from remembered refusals.
        let refusals = settings.refusals.filter(|_| !checks.iter().any(|c| c.shadow));
        let started = Instant::now();
        // The checks' identity is hashed only while some refusal may hold, or to remember one.
        let mut identity = None;
        if let Some(cache) = refusals
            && cache.may_hold(started)
        {
            let id = *identity.insert(cache.identity(&checks));
            if let Some(decisions) = cache.get(id, started) {
                return Ok(self.verdict(settings, &applied, as_configured, checks, &decisions));
            }
        }
        let answer = settings.store.decide(&checks, settings.on_error).await;
        let store = settings.store.label();
        settings
            .metrics
            .record_store_call(store, started.elapsed().as_secs_f64());
        let decisions = match answer {
            Answer::Decided(decisions) => decisions,
            Answer::Failed { error, fallback } => {
                settings.metrics.record_store_error(store);
                tracing::debug!(%error, store, "rate-limit store failed");
                let refused = match fallback {
                    // Counted as what the local store decided; the failure itself is in
                    // floodgate_store_errors_total.
                    Fallback::Local(decisions) => {
                        return Ok(self.verdict(settings, &applied, as_configured, checks, &decisions));
                    }
                    Fallback::Admit => false,
                    Fallback::Refuse => true,
                };
                for limit in &applied {
                    settings
                        .metrics
                        .record_decision(&limit.name, LimitOutcome::StoreError);
                }
                if !refused {
                    return Ok(pass(LimitOutcome::StoreError));
                }
                return Ok(Verdict {
                    action: Action::Reject {
                        status: StatusCode::SERVICE_UNAVAILABLE,
                        message: Bytes::from_static(b"Service Unavailable\n"),
                        retry_after: 1,
                    },
                    outcome: LimitOutcome::StoreError,
                    headers: LimitHeaders::new(),
                });
            }
        };
        if let Some(cache) = refusals {
            remember_refusal(cache, identity, &checks, &decisions, started);
        }
        Ok(self.verdict(settings, &applied, as_configured, checks, &decisions))
    }

    fn verdict(
        &self,
        settings: &LimitSettings<'_>,
        applied: &[&LimitConfig],
        as_configured: bool,
        checks: Checks,
        decisions: &[LimitDecision],
    ) -> Verdict {
        let mut enforced: SmallVec<[(&LimitConfig, LimitDecision); 2]> = SmallVec::new();
        let mut refusal: Option<(&LimitConfig, Duration)> = None;
        let mut delay = Duration::ZERO;
        let mut outcome = LimitOutcome::Allowed;
        for (limit, decision) in applied.iter().zip(decisions) {
            let label = match (limit.mode, decision.outcome) {
                (Mode::Shadow, Outcome::Rejected | Outcome::Locked) => {
                    tracing::info!(limit = %limit.name, "shadow limit would have rejected the request");
                    if outcome == LimitOutcome::Allowed {
                        outcome = LimitOutcome::ShadowRejected;
                    }
                    LimitOutcome::ShadowRejected
                }
                (Mode::Shadow, _) => LimitOutcome::Allowed,
                (Mode::Enforce, Outcome::Allowed) => LimitOutcome::Allowed,
                (Mode::Enforce, Outcome::Delayed(wait)) => {
                    delay = delay.max(wait);
                    LimitOutcome::Delayed
                }
                (Mode::Enforce, refused @ (Outcome::Rejected | Outcome::Locked)) => {
                    let retry = refusal.map_or(decision.retry_after, |(_, r)| r.max(decision.retry_after));
                    refusal = Some((refusal.map_or(*limit, |(first, _)| first), retry));
                    if refused == Outcome::Locked {
                        LimitOutcome::Locked
                    } else {
                        LimitOutcome::Rejected
                    }
                }
            };
            settings.metrics.record_decision(&limit.name, label);
            if limit.mode == Mode::Enforce {
                enforced.push((limit, *decision));
            }
        }
        // A limit the client is exempt from was skipped: the policy computed at load
        // would still name it, so describe only the limits that were decided.
        let partial;
        let policy = if as_configured {
            self.policy.as_ref()
        } else {
            partial = policy_value(enforced.iter().map(|(limit, _)| *limit));
            partial.as_ref()
        };
        let mut headers = LimitHeaders::new();
        render(settings.headers, policy, &enforced, &mut headers);
        if let Some((limit, retry)) = refusal {
            let locked = enforced
                .iter()
                .any(|(l, d)| std::ptr::eq(*l, limit) && d.outcome == Outcome::Locked);
            return Verdict {
                action: Action::Reject {
                    status: limit.status,
                    message: limit.message.clone(),
                    retry_after: ceil_seconds(retry).max(1),
                },
                outcome: if locked {
                    LimitOutcome::Locked
                } else {
                    LimitOutcome::Rejected
                },
                headers,
            };
        }
        if !delay.is_zero() {
            outcome = LimitOutcome::Delayed;
        }
        let held = if delay.is_zero() {
            Vec::new()
        } else {
            checks
                .into_iter()
                .zip(decisions)
                .filter(|(check, d)| !check.shadow && matches!(d.outcome, Outcome::Delayed(_)))
                .map(|(check, _)| check)
                .collect()
        };
        Verdict {
            action: Action::Pass { delay, held },
            outcome,
            headers,
        }
    }
}

/// Remembers the store's answer in `cache` when it refused the request (`identity`: the
/// checks' identity, if already hashed).
fn remember_refusal(
    cache: &RefusalCache,
    identity: Option<u128>,
    checks: &[LimitCheck],
    decisions: &[LimitDecision],
    decided_at: Instant,
) {
    // A refusal holds until the last refusing limit could admit.
    let holds_for = decisions
        .iter()
        .filter(|d| !d.outcome.admits())
        .map(|d| d.retry_after)
        .max()
        .unwrap_or_default();
    if holds_for.is_zero() {
        return;
    }
    let identity = identity.unwrap_or_else(|| cache.identity(checks));
    // Those that started a lock-out answer `locked` from now on, as the store would.
    let remembered: Decisions = checks
        .iter()
        .zip(decisions)
        .map(|(check, d)| match d.outcome {
            Outcome::Rejected if check.lockout.is_some() => LimitDecision {
                outcome: Outcome::Locked,
                remaining: 0,
                ..*d
            },
            _ => *d,
        })
        .collect();
    cache.insert(identity, remembered, decided_at, holds_for);
}

fn pass(outcome: LimitOutcome) -> Verdict {
    Verdict {
        action: Action::Pass {
            delay: Duration::ZERO,
            held: Vec::new(),
        },
        outcome,
        headers: LimitHeaders::new(),
    }
}

fn micros(duration: Duration) -> u64 {
    crate::limit::algorithm::micros(duration)
}
