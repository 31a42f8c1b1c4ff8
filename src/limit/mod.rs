//! The limiter core: the algorithms, the all-or-nothing decision, store keys, and the
//! stores that decide (in-process here, Redis in [`redis`]). It depends on nothing of the
//! gateway: the request path builds [`LimitCheck`]s and reads [`LimitDecision`]s.
//!
//! A request's limits are decided together, in one store call, all or nothing: the store
//! gets one [`LimitCheck`] per limit and answers one [`LimitDecision`] per limit. If any
//! limit rejects (or is locked), no limit consumes anything.

pub mod algorithm;
pub mod clock;
pub mod inflight;
pub mod key;
pub mod memory;
pub mod redis;
mod sharded;
pub mod store;

use std::time::Duration;

use smallvec::SmallVec;

pub use algorithm::Algorithm;

/// The most limits one route may name (the configuration enforces it): one request's
/// checks, a bound the Redis store's calling convention relies on.
pub const MAX_LIMITS_PER_ROUTE: usize = 64;

/// The longest time the stores report, in microseconds (2^50, 35 years): the decision
/// script caps delays, resets and retry times there, so that 4 × time + outcome stays
/// exact in a double, and a bucket's interval between tokens may be no longer.
pub const MAX_TIME_MICROS: u64 = 1 << 50;

/// One limit to decide for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct LimitCheck {
    /// The counter's store key ([`key::store_key`]).
    pub key: String,
    pub algorithm: Algorithm,
    /// With a lock-out penalty.
    pub lockout: Option<Lockout>,
    /// Units this request consumes (route `cost`, at least 1).
    pub cost: u64,
    /// The largest `cost` of the routes that apply this limit: a key with less left is
    /// refused by one of them, and a bounded store does not forget it (`cost` when larger).
    pub keep_below: u64,
    /// A shadow limit never refuses the request: its rejection does not stop the others,
    /// and it consumes only when the whole request is admitted and it admits too.
    pub shadow: bool,
}

/// A limit's lock-out penalty, as a check carries it: while the lock runs, the check
/// refuses.
#[derive(Debug, Clone, PartialEq)]
pub struct Lockout {
    /// The lock's store key.
    pub key: String,
    /// Its length, in microseconds.
    pub micros: u64,
    /// Whether the check's refusal starts it (a rate limit's lock-out). A limit that
    /// counts failures starts it only when a failure takes the last of the room
    /// ([`store::LimitStore::lock`]): a refusal there may be of attempts still in flight.
    pub starts_on_refusal: bool,
}

impl Lockout {
    /// A rate limit's lock-out: `micros` long, started by the check's refusal.
    pub fn on_refusal(key: String, micros: u64) -> Lockout {
        Lockout {
            key,
            micros,
            starts_on_refusal: true,
        }
    }
}

/// What one limit decided for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Within the limit (or within it but not consumed, because another limit refused).
    Allowed,
    /// Admitted after waiting this long for its turn (leaky bucket).
    Delayed(Duration),
    /// Over the limit.
    Rejected,
    /// The key is serving a lock-out penalty.
    Locked,
}

impl Outcome {
    pub fn admits(self) -> bool {
        matches!(self, Outcome::Allowed | Outcome::Delayed(_))
    }
}

/// One limit's decision, with what the rate-limit headers need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitDecision {
    pub outcome: Outcome,
    /// Requests of cost 1 still admissible.
    pub remaining: u64,
    /// Time until the limit is fully reset.
    pub reset: Duration,
    /// For a refused request: when to try again.
    pub retry_after: Duration,
}

/// One request's decisions, one per check, in order: inline for up to two limits (nearly
/// every route), so that deciding allocates nothing for them.
pub type Decisions = SmallVec<[LimitDecision; 2]>;

/// Decides every check of one request against stored state, all or nothing.
///
/// `stored(key)` reads a counter's live state, `lock_left(key)` the time left in a live
/// lock. Returns the decisions and the writes to apply: counter states when everything
/// was admitted, new locks otherwise. Both stores run exactly this.
pub(crate) fn decide_all<'a>(
    checks: &'a [LimitCheck],
    now: u64,
    mut stored: impl FnMut(&str) -> Option<algorithm::State>,
    mut lock_left: impl FnMut(&str) -> Option<u64>,
) -> (Decisions, SmallVec<[Write<'a>; 2]>) {
    // Per check: the time left in its live lock, and its evaluation.
    let evaluated: SmallVec<[(Option<u64>, algorithm::Evaluation); 2]> = checks
        .iter()
        .map(|check| {
            let lock = check.lockout.as_ref().and_then(|lockout| lock_left(&lockout.key));
            let evaluation = algorithm::evaluate(&check.algorithm, stored(&check.key), check.cost, now);
            (lock, evaluation)
        })
        .collect();
    let admitted = checks
        .iter()
        .zip(&evaluated)
        .all(|(check, (lock, evaluation))| check.shadow || (lock.is_none() && evaluation.admitted));
    let mut writes = SmallVec::new();
    let decisions = checks
        .iter()
        .zip(&evaluated)
        .map(|(check, (lock, evaluation))| {
            let micros = Duration::from_micros;
            if let Some(left) = *lock {
                return LimitDecision {
                    outcome: Outcome::Locked,
                    remaining: 0,
                    reset: micros(left),
                    retry_after: micros(left),
                };
            }
            if !evaluation.admitted {
                let mut retry_after = evaluation.retry_after;
                let mut reset = evaluation.reset;
                if let Some(lockout) = check.lockout.as_ref().filter(|l| l.starts_on_refusal) {
                    writes.push(Write::Lock {
                        key: &lockout.key,
                        ttl: lockout.micros,
                    });
                    // The lock now decides when the key is free again.
                    retry_after = retry_after.max(lockout.micros);
                    reset = reset.max(lockout.micros);
                }
                return LimitDecision {
                    outcome: Outcome::Rejected,
                    remaining: evaluation.remaining_before,
                    reset: micros(reset),
                    retry_after: micros(retry_after),
                };
            }
            if !admitted {
                return LimitDecision {
                    outcome: Outcome::Allowed,
                    remaining: evaluation.remaining_before,
                    reset: micros(evaluation.reset),
                    retry_after: Duration::ZERO,
                };
            }
            writes.push(Write::State {
                key: &check.key,
                state: evaluation.new_state,
                ttl: evaluation.ttl,
                used: Used::of(
                    evaluation.remaining_after,
                    check.algorithm.capacity(),
                    check.cost.max(check.keep_below),
                ),
            });
            LimitDecision {
                outcome: if evaluation.delay > 0 {
                    Outcome::Delayed(micros(evaluation.delay))
                } else {
                    Outcome::Allowed
                },
                remaining: evaluation.remaining_after,
                reset: micros(evaluation.reset),
                retry_after: Duration::ZERO,
            }
        })
        .collect();
    (decisions, writes)
}

/// One key's stored state as a store holds it, read without changing it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Peeked {
    /// The counter's live state (`None`: a fresh key).
    pub state: Option<algorithm::State>,
    /// Microseconds left in the key's lock, when locked.
    pub lock_left: Option<u64>,
    /// The store's clock, in microseconds.
    pub now: u64,
}

/// What a key's state means for its next request (of cost 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyState {
    pub remaining: u64,
    /// Time until the limit is fully reset.
    pub reset: Duration,
    /// Time left in a lock-out (zero when not locked).
    pub locked: Duration,
}

impl Peeked {
    /// The state as `algorithm` reads it.
    pub fn key_state(&self, algorithm: &Algorithm) -> KeyState {
        let evaluation = algorithm::evaluate(algorithm, self.state, 1, self.now);
        let locked = Duration::from_micros(self.lock_left.unwrap_or(0));
        KeyState {
            remaining: if locked.is_zero() {
                evaluation.remaining_before
            } else {
                0
            },
            reset: Duration::from_micros(evaluation.reset).max(locked),
            locked,
        }
    }
}

/// How much of its limit a key's state has used, for a bounded store to forget first
/// what is closest to a fresh key's state: from 0 (a fresh key's) up to [`Used::ALL`], a
/// key with less left than a request costs, which the next request would be refused (a
/// lock counts as that too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Used(u16);

impl Used {
    pub(crate) const ALL: Used = Used(u16::MAX);

    /// A state with `left` units left out of a fresh key's `capacity`, for requests that
    /// cost `cost` units each.
    pub(crate) fn of(left: u64, capacity: u64, cost: u64) -> Used {
        if left < cost.max(1) || capacity == 0 {
            return Used::ALL;
        }
        let spent = capacity.saturating_sub(left) as f64 / capacity as f64;
        // Below ALL whatever is spent, as long as something is left.
        Used((spent * f64::from(u16::MAX - 1)) as u16)
    }
}

/// A change a decision makes to the store.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Write<'a> {
    /// Store a counter's new state for `ttl` microseconds.
    State {
        key: &'a str,
        state: algorithm::State,
        ttl: u64,
        /// How much of its limit the state has used.
        used: Used,
    },
    /// Create a lock for `ttl` microseconds unless one exists.
    Lock { key: &'a str, ttl: u64 },
}
