//! A route's limits in the request path: build one check per applicable limit, decide them
//! in one store call, count the outcomes, and tell the service what to do: pass (perhaps
//! after holding the request), or answer the rejection.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use http::StatusCode;
use http::header::HeaderValue;
use smallvec::SmallVec;

use super::limit_headers::{Described, LimitHeaders, ceil_seconds, policy_value, render};
use super::own_answer::{OwnAnswer, Refusal};
use super::request_key::{AmbiguousKey, KeySource, key_tuple, keyed_tuple};
use crate::config::{Concurrency, LimitConfig, LimitKind, Mode, Override, RateLimit, RateLimitHeaders};
use crate::error::GatewayError;
use crate::limit::algorithm::micros;
use crate::limit::key::{KeyedTuple, lock_key, slots_key};
use crate::limit::redis::refusals::RefusalCache;
use crate::limit::store::{Fallback, HeldSlots, LimitStore, OnError, StoreAnswer, Unit};
use crate::limit::{Algorithm, Decisions, LimitCheck, LimitDecision, Lockout, Outcome};
use crate::metrics::{LimitOutcome, Metrics};

/// What a route's limits need at request time, computed once at load.
pub(crate) struct RouteLimits {
    limits: Vec<Arc<LimitConfig>>,
    cost: u64,
    /// For each limit, the largest `cost` of the routes that apply it.
    keep_below: Vec<u64>,
    /// `RateLimit-Policy` for the route's enforced limits.
    policy: Option<HeaderValue>,
}

/// One request's checks, one per applied limit: inline for up to two.
type Checks = SmallVec<[LimitCheck; 2]>;

/// Gateway-wide settings the decision needs, and when the request arrived.
pub(crate) struct LimitSettings<'a> {
    pub store: &'a LimitStore,
    pub prefix: &'a str,
    pub on_error: OnError,
    pub headers: RateLimitHeaders,
    pub metrics: &'a Metrics,
    /// Remembered refusals (`None`: every request asks the store).
    pub refusals: Option<&'a RefusalCache>,
    /// When the request arrived: a remembered refusal refuses it if it held then.
    pub arrived: Instant,
}

/// What the limits decided for one request.
pub(crate) struct Verdict {
    pub action: Action,
    /// Concurrency slots the request holds until its response is done.
    pub slots: HeldSlots,
    /// The access log's `limit` field.
    pub outcome: LimitOutcome,
}

pub(crate) enum Action {
    /// Forward, after holding the request this long (leaky bucket); `held` are the places
    /// to give back if the client leaves before then; `attempts` the units
    /// limits that count failures took, each to settle on the response's status (failure
    /// when it is one of theirs).
    Pass {
        delay: Duration,
        held: Vec<Unit>,
        attempts: Option<Attempts>,
    },
    /// Answer this instead: a limit's refusal, or the error of a failed store under
    /// `on_error = "deny"`.
    Reject(OwnAnswer),
}

/// `limit`'s refusal, to be tried again after `retry_after` seconds.
fn refused_by(limit: &LimitConfig, retry_after: u64) -> Action {
    Action::Reject(OwnAnswer::Refused(Refusal {
        status: limit.status,
        message: limit.message.clone(),
        content_type: limit.content_type.clone(),
        retry_after,
    }))
}

impl RouteLimits {
    /// `keep_below` has, for each of `limits`, the largest `cost` of the routes that
    /// apply it.
    pub(crate) fn new(limits: Vec<Arc<LimitConfig>>, cost: u64, keep_below: Vec<u64>) -> Self {
        let policy = policy_value(
            limits
                .iter()
                .filter(|l| l.mode == Mode::Enforce)
                .filter_map(|limit| {
                    let rate = limit.rate()?;
                    Some(Described {
                        name: &limit.name,
                        algorithm: &rate.algorithm,
                    })
                }),
        );
        RouteLimits {
            limits,
            cost,
            keep_below,
            policy,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.limits.is_empty()
    }

    /// Decides this request's limits, all in one store call; writes the rate-limit headers
    /// for the response, whatever it turns out to be, into `headers`.
    pub(crate) async fn decide(
        &self,
        settings: &LimitSettings<'_>,
        client_ip: IpAddr,
        source: &KeySource<'_>,
        headers: &mut LimitHeaders,
    ) -> Result<Verdict, AmbiguousKey> {
        let mut planned = Planned::default();
        let mut concurrent: SmallVec<[(&LimitConfig, String, Concurrency); 1]> = SmallVec::new();
        // Whether every limit applies as configured (no exemption, no override): then the
        // route's RateLimit-Policy, computed at load, describes the request.
        let mut as_configured = true;
        for (index, limit) in self.limits.iter().enumerate() {
            if limit.exempt.iter().any(|net| net.contains(&client_ip)) {
                as_configured = false;
                continue;
            }
            let tuple = keyed_tuple(&limit.key, source, (settings.prefix, &limit.name))?;
            let rate = match &limit.kind {
                LimitKind::Rate(rate) => rate,
                LimitKind::Concurrency(concurrency) => {
                    concurrent.push((
                        limit,
                        slots_key(settings.prefix, tuple.tuple(), &limit.name),
                        *concurrency,
                    ));
                    continue;
                }
            };
            let algorithm = if rate.overrides.is_empty() {
                &rate.algorithm
            } else {
                let part =
                    |i: usize| key_tuple(std::slice::from_ref(&limit.key[i]), source).unwrap_or_default();
                match rate.overrides.find(tuple.tuple(), client_ip, part) {
                    None => &rate.algorithm,
                    Some(Override::Exempt) => {
                        as_configured = false;
                        continue;
                    }
                    Some(Override::Algorithm(overridden)) => {
                        as_configured = false;
                        overridden
                    }
                }
            };
            let applied = AppliedRate {
                limit,
                rate,
                algorithm,
            };
            let keep_below = self.keep_below.get(index).copied().unwrap_or(self.cost);
            planned.push(
                applied,
                applied.check(settings.prefix, tuple, (self.cost, keep_below)),
            );
        }
        // Concurrency limits take their slots first: one that has none free refuses the
        // request before anything is consumed; the slots taken go back if another limit
        // refuses (they are dropped with the verdict).
        let mut slots = HeldSlots::default();
        // What the access log says when no rate limit decides.
        let mut outcome = LimitOutcome::Exempt;
        for (limit, key, concurrency) in concurrent {
            match settings
                .store
                .acquire(&key, concurrency.limit, concurrency.lease, settings.on_error)
                .await
            {
                Ok(Some(slot)) => {
                    settings
                        .metrics
                        .record_decision(&limit.name, LimitOutcome::Allowed);
                    slots.push(slot);
                    if outcome == LimitOutcome::Exempt {
                        outcome = LimitOutcome::Allowed;
                    }
                }
                Ok(None) if limit.mode == Mode::Shadow => {
                    tracing::info!(limit = %limit.name, "shadow limit would have rejected the request");
                    settings
                        .metrics
                        .record_decision(&limit.name, LimitOutcome::ShadowRejected);
                    outcome = LimitOutcome::ShadowRejected;
                }
                Ok(None) => {
                    settings
                        .metrics
                        .record_decision(&limit.name, LimitOutcome::Rejected);
                    return Ok(Verdict {
                        action: refused_by(limit, 1),
                        slots: HeldSlots::default(),
                        outcome: LimitOutcome::Rejected,
                    });
                }
                Err(()) => return Ok(store_refused()),
            }
        }
        let verdict = if planned.checks.is_empty() {
            pass(outcome)
        } else {
            self.decide_rates(settings, &mut planned, as_configured, headers)
                .await
        };
        Ok(Verdict { slots, ..verdict })
    }

    /// Decides the rate limits, `checks` in one store call, after the concurrency slots
    /// were taken. A limit that counts failures takes its unit here like any other.
    async fn decide_rates(
        &self,
        settings: &LimitSettings<'_>,
        planned: &mut Planned<'_>,
        as_configured: bool,
        headers: &mut LimitHeaders,
    ) -> Verdict {
        // Shadow limits must be evaluated every time, so their requests are never served
        // from remembered refusals; nor are those of limits that count failures, whose
        // room comes back when an attempt in flight is not one.
        let refusals = settings.refusals.filter(|_| {
            !planned.checks.iter().any(|c| c.shadow)
                && !planned.applied.iter().any(|a| a.rate.failures.is_some())
        });
        // The checks' identity is hashed only while some refusal may hold, or to remember one.
        let mut identity = None;
        if let Some(cache) = refusals
            && let at = cache.time(settings.arrived)
            && cache.may_hold(at)
        {
            let id = *identity.insert(cache.identity(&planned.checks));
            if let Some(decisions) = cache.get(id, at) {
                return self.verdict(settings, planned, as_configured, &decisions, false, headers);
            }
        }
        let started = Instant::now();
        let answer = settings.store.decide(&planned.checks, settings.on_error).await;
        let store = settings.store.label();
        settings.metrics.record_store_call(store, started.elapsed());
        let decisions = match answer {
            StoreAnswer::Decided(decisions) => decisions,
            // Counted and logged by the store (limit::redis::fallback::ResilientRedis::failed).
            StoreAnswer::Failed(fallback) => {
                let refused = match fallback {
                    // Counted as what the local store decided; the failure itself is in
                    // floodgate_store_errors_total.
                    Fallback::Local(decisions) => {
                        return self.verdict(settings, planned, as_configured, &decisions, true, headers);
                    }
                    Fallback::Admit => false,
                    Fallback::Refuse => true,
                };
                for applied in &planned.applied {
                    settings
                        .metrics
                        .record_decision(&applied.limit.name, LimitOutcome::StoreError);
                }
                if !refused {
                    return pass(LimitOutcome::StoreError);
                }
                return store_refused();
            }
        };
        if let Some(cache) = refusals {
            remember_refusal(cache, identity, &planned.checks, &decisions, started);
        }
        self.verdict(settings, planned, as_configured, &decisions, false, headers)
    }

    /// The verdict on `decisions`, the store's (or its in-process fallback's, `by_fallback`),
    /// with their rate-limit headers written into `headers`.
    fn verdict(
        &self,
        settings: &LimitSettings<'_>,
        planned: &mut Planned<'_>,
        as_configured: bool,
        decisions: &[LimitDecision],
        by_fallback: bool,
        headers: &mut LimitHeaders,
    ) -> Verdict {
        let applied = &planned.applied;
        let mut enforced: SmallVec<[(Described<'_>, LimitDecision); 2]> = SmallVec::new();
        // The first refusing limit, whether it is locked, and the longest wait of all.
        let mut refusal: Option<(&LimitConfig, bool, Duration)> = None;
        let mut delay = Duration::ZERO;
        let mut outcome = LimitOutcome::Allowed;
        for (applied, decision) in applied.iter().zip(decisions) {
            let limit = applied.limit;
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
                    let locked = refused == Outcome::Locked;
                    refusal = Some(match refusal {
                        None => (limit, locked, decision.retry_after),
                        Some((first, first_locked, retry)) => {
                            (first, first_locked, retry.max(decision.retry_after))
                        }
                    });
                    if locked {
                        LimitOutcome::Locked
                    } else {
                        LimitOutcome::Rejected
                    }
                }
            };
            settings.metrics.record_decision(&limit.name, label);
            if limit.mode == Mode::Enforce {
                enforced.push((
                    applied.described(),
                    failure_room(applied.rate, decision, self.cost),
                ));
            }
        }
        // A limit the client is exempt from was skipped: the policy computed at load
        // would still name it, so describe only the limits that were decided.
        let partial;
        let policy = if as_configured {
            self.policy.as_ref()
        } else {
            partial = policy_value(enforced.iter().map(|(described, _)| *described));
            partial.as_ref()
        };
        render(settings.headers, policy, &enforced, refusal.is_none(), headers);
        if let Some((limit, locked, retry)) = refusal {
            return Verdict {
                action: refused_by(limit, ceil_seconds(retry).max(1)),
                slots: HeldSlots::default(),
                outcome: if locked {
                    LimitOutcome::Locked
                } else {
                    LimitOutcome::Rejected
                },
            };
        }
        // Units are kept only for a request held (delayed), or by limits that count failures.
        if delay.is_zero() && applied.iter().all(|applied| applied.rate.failures.is_none()) {
            return pass(outcome);
        }
        if !delay.is_zero() {
            outcome = LimitOutcome::Delayed;
        }
        let mut held = Vec::new();
        let mut attempts = Vec::new();
        let checks = std::mem::take(&mut planned.checks);
        for ((check, decision), applied) in checks.into_iter().zip(decisions).zip(applied) {
            let taken = |check| {
                Unit::taken(
                    check,
                    settings.store,
                    settings.on_error,
                    by_fallback,
                    decision.remaining,
                )
            };
            match &applied.rate.failures {
                // A shadow limit counts failures too: it never refuses, but says when it
                // would have. Its unit was taken only if it admitted.
                Some(statuses) if decision.outcome.admits() => {
                    attempts.push((taken(check), statuses.clone()))
                }
                Some(_) => {}
                None if !check.shadow && matches!(decision.outcome, Outcome::Delayed(_)) => {
                    held.push(taken(check))
                }
                None => {}
            }
        }
        Verdict {
            action: Action::Pass {
                delay,
                held,
                attempts: (!attempts.is_empty()).then(|| Attempts::new(attempts)),
            },
            slots: HeldSlots::default(),
            outcome,
        }
    }
}

/// What the rate-limit headers say of a limit that counts failures: the room left before
/// this attempt took its unit (a `401` that takes the last of the room still says `r=1`),
/// as they said when failures were read rather than taken.
fn failure_room(rate: &RateLimit, decision: &LimitDecision, cost: u64) -> LimitDecision {
    if rate.failures.is_none() || !decision.outcome.admits() {
        return *decision;
    }
    LimitDecision {
        remaining: decision.remaining + cost,
        ..*decision
    }
}

/// The units a request's limits that count failures took, each with the statuses its
/// limit counts as failures, to settle on the app's answer ([`Attempts::settle`]).
/// Dropped unsettled (the client left) once the request has reached the app, they are
/// kept as failures: the app works on an attempt whatever its client does, and a client
/// that hangs up must not get it for free. Before then they go back.
pub(crate) struct Attempts {
    units: Vec<(Unit, Vec<StatusCode>)>,
    reached: Arc<AtomicBool>,
}

impl Attempts {
    fn new(units: Vec<(Unit, Vec<StatusCode>)>) -> Attempts {
        Attempts {
            units,
            reached: Arc::default(),
        }
    }

    /// Set once the request is sent to a server.
    pub(crate) fn reached_the_app(&self) -> Arc<AtomicBool> {
        self.reached.clone()
    }

    /// Settles each unit on the app's response `status` (`None`: the app did not answer,
    /// floodgate did): a failure keeps its unit (and starts the lock-out when it was the
    /// last of the room), anything else gives it back. The settling runs as a task of its
    /// own, awaited here: a client that hangs up meanwhile stops waiting, not settling.
    pub(crate) async fn settle(mut self, status: Option<StatusCode>) {
        let units = std::mem::take(&mut self.units);
        let settling = tokio::spawn(async move {
            for (unit, failures) in units {
                unit.settle(status.is_some_and(|status| failures.contains(&status)))
                    .await;
            }
        });
        // It ends by itself; a panic in it is the task's own.
        let _ = settling.await;
    }
}

impl Drop for Attempts {
    fn drop(&mut self) {
        if self.units.is_empty() || !self.reached.load(Ordering::Acquire) {
            return;
        }
        let units = std::mem::take(&mut self.units);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                for (unit, _) in units {
                    unit.settle(true).await;
                }
            });
        }
    }
}

/// `on_error = "deny"` with a failing store.
fn store_refused() -> Verdict {
    Verdict {
        action: Action::Reject(OwnAnswer::Error(GatewayError::StoreUnavailable)),
        slots: HeldSlots::default(),
        outcome: LimitOutcome::StoreError,
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
            attempts: None,
        },
        slots: HeldSlots::default(),
        outcome,
    }
}

/// A rate limit as it applies to one request: the limit, and the algorithm that decides
/// (an override's when one matched the request's key).
#[derive(Clone, Copy)]
pub(crate) struct AppliedRate<'a> {
    pub(crate) limit: &'a LimitConfig,
    pub(crate) rate: &'a RateLimit,
    pub(crate) algorithm: &'a Algorithm,
}

impl<'a> AppliedRate<'a> {
    /// What the store is asked on key tuple `tuple`: its keys, its algorithm and
    /// lock-out, `cost`.
    pub(crate) fn check(
        &self,
        prefix: &str,
        tuple: KeyedTuple,
        (cost, keep_below): (u64, u64),
    ) -> LimitCheck {
        let name = &self.limit.name;
        let lockout = self.rate.lockout.map(|penalty| Lockout {
            key: lock_key(prefix, tuple.tuple(), name),
            micros: micros(penalty),
            // A failure-counting limit's refusal may be of attempts still in flight.
            starts_on_refusal: self.rate.failures.is_none(),
        });
        LimitCheck {
            key: tuple.into_store_key(name, self.algorithm),
            algorithm: *self.algorithm,
            lockout,
            cost,
            keep_below,
            shadow: self.limit.mode == Mode::Shadow,
        }
    }

    fn described(&self) -> Described<'a> {
        Described {
            name: &self.limit.name,
            algorithm: self.algorithm,
        }
    }
}

/// The rate limits one request is decided against, each with its check. The store takes
/// the checks as one slice and answers in their order, so they are kept apart from the
/// limits, and pushed only together.
#[derive(Default)]
struct Planned<'a> {
    applied: SmallVec<[AppliedRate<'a>; 2]>,
    checks: Checks,
}

impl<'a> Planned<'a> {
    fn push(&mut self, applied: AppliedRate<'a>, check: LimitCheck) {
        self.applied.push(applied);
        self.checks.push(check);
    }
}
