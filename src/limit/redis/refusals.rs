//! Refused requests remembered until they could pass: a client hammering a limit it has
//! exhausted (or a locked-out key) is answered without asking the store again, so a flood
//! of refused requests costs no Redis round trip and no Redis CPU.
//!
//! A refusal is remembered until the refusing limit could admit again at the earliest
//! (`retry_after`: the window's end, the lock's expiry, the time for the bucket to hold
//! enough tokens, the queue to have room), other requests being able only to consume
//! before then, but at most [`REMEMBERED_AT_MOST`]: an operator may reset a key through
//! the admin API on any instance, and every instance must see that soon. Decisions
//! served from here report their times shortened by the time elapsed; the remaining
//! counts of limits that did not refuse are as of the refusal. A reload starts a new
//! cache.

use std::hash::Hasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::limit::key::identity::KeyedHash;
use crate::limit::sharded::{Expiring, ShardedMap};
use crate::limit::{Algorithm, Decisions, LimitCheck, LimitDecision};

const SHARDS: usize = 16;
/// The longest a refusal is remembered: how soon every instance sees a key reset through
/// the admin API, and at most one store call per refused key per this period.
pub(crate) const REMEMBERED_AT_MOST: Duration = Duration::from_secs(1);
/// Refusals remembered at most (about 150 bytes each).
const MAX_ENTRIES: usize = 65_536;

struct Refusal {
    decided_at: CacheTime,
    /// Microseconds after the cache's epoch.
    until: u64,
    decisions: Decisions,
}

impl Expiring for Refusal {
    fn expires_at(&self) -> u64 {
        self.until
    }
}

/// A time on a cache's clock: microseconds after its epoch. A request reads it once for
/// both [`RefusalCache::may_hold`] and [`RefusalCache::get`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct CacheTime(u64);

/// Recent refusals by the identity of the checks refused.
pub(crate) struct RefusalCache {
    refusals: ShardedMap<Refusal, SHARDS>,
    /// When the cache was made: the origin of its times.
    epoch: Instant,
    /// Microseconds after `epoch` until which some remembered refusal may hold: past it,
    /// no request needs its identity hashed or looked up.
    holds_until: AtomicU64,
}

impl Default for RefusalCache {
    fn default() -> Self {
        RefusalCache {
            refusals: ShardedMap::bounded(MAX_ENTRIES),
            epoch: Instant::now(),
            holds_until: AtomicU64::new(0),
        }
    }
}

impl RefusalCache {
    /// `instant` on the cache's clock.
    pub(crate) fn time(&self, instant: Instant) -> CacheTime {
        CacheTime(
            u64::try_from(instant.saturating_duration_since(self.epoch).as_micros()).unwrap_or(u64::MAX),
        )
    }

    /// Whether any refusal remembered may still hold at `at` (if not, [`Self::get`]
    /// would find none).
    pub(crate) fn may_hold(&self, at: CacheTime) -> bool {
        at.0 < self.holds_until.load(Ordering::Relaxed)
    }

    /// The identity of a request's checks: a randomly keyed 128-bit hash of every key,
    /// algorithm parameter and cost.
    pub(crate) fn identity(&self, checks: &[LimitCheck]) -> u128 {
        let mut state = self.refusals.hasher();
        for check in checks {
            state.write(check.key.as_bytes());
            state.write_u8(0xff);
            match check.algorithm {
                Algorithm::FixedWindow { limit, window } | Algorithm::SlidingWindow { limit, window } => {
                    state.write_u64(limit);
                    state.write_u64(window);
                }
                Algorithm::TokenBucket { rate, per, burst } | Algorithm::LeakyBucket { rate, per, burst } => {
                    state.write_u64(rate.to_bits());
                    state.write_u64(per);
                    state.write_u64(burst);
                }
            }
            state.write_u64(check.cost);
            state.write_u8(u8::from(check.lockout.is_some()));
        }
        KeyedHash::finish(&state)
    }

    /// The remembered refusal of these checks, if it still holds at `at`.
    pub(crate) fn get(&self, identity: u128, at: CacheTime) -> Option<Decisions> {
        let refusals = self.refusals.lock(identity);
        let refusal = refusals.get(identity).filter(|r| r.until > at.0)?;
        let elapsed = Duration::from_micros(at.0.saturating_sub(refusal.decided_at.0));
        Some(
            refusal
                .decisions
                .iter()
                .map(|d| LimitDecision {
                    reset: d.reset.saturating_sub(elapsed),
                    retry_after: d.retry_after.saturating_sub(elapsed),
                    ..*d
                })
                .collect(),
        )
    }

    /// Forgets every refusal (a key was reset).
    pub(crate) fn clear(&self) {
        self.refusals.clear();
    }

    /// Remembers a refusal decided at `now` that holds for `holds_for`.
    pub(crate) fn insert(&self, identity: u128, decisions: Decisions, now: Instant, holds_for: Duration) {
        if holds_for.is_zero() {
            return;
        }
        let decided_at = self.time(now);
        let held = u64::try_from(holds_for.min(REMEMBERED_AT_MOST).as_micros()).unwrap_or(u64::MAX);
        let until = decided_at.0.saturating_add(held);
        self.holds_until
            .fetch_max(until.saturating_add(1), Ordering::Relaxed);
        let refusal = Refusal {
            decided_at,
            until,
            decisions,
        };
        let mut refusals = self.refusals.lock(identity);
        match refusals.get_mut(identity) {
            Some(remembered) => *remembered = refusal,
            // A shard still full of refusals that hold forgets them all: each only spares
            // a store call.
            None => {
                refusals.insert_new(identity, refusal, decided_at.0, |all, _| {
                    all.clear();
                    true
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Outcome;

    fn check(key: &str) -> LimitCheck {
        LimitCheck {
            key: key.to_owned(),
            algorithm: Algorithm::FixedWindow {
                limit: 1,
                window: 1_000_000,
            },
            lockout: None,
            cost: 1,
            keep_below: 0,
            shadow: false,
        }
    }

    fn refused(retry_ms: u64) -> LimitDecision {
        LimitDecision {
            outcome: Outcome::Rejected,
            remaining: 0,
            reset: Duration::from_millis(retry_ms),
            retry_after: Duration::from_millis(retry_ms),
        }
    }

    #[test]
    fn a_refusal_holds_until_its_time_then_is_forgotten() {
        let cache = RefusalCache::default();
        let id = cache.identity(&[check("a")]);
        assert_ne!(id, cache.identity(&[check("b")]));
        let now = Instant::now();
        cache.insert(
            id,
            smallvec::smallvec![refused(500)],
            now,
            Duration::from_millis(500),
        );
        let at = |after_ms| cache.time(now + Duration::from_millis(after_ms));
        let later = cache.get(id, at(200)).unwrap();
        assert_eq!(later[0].retry_after, Duration::from_millis(300));
        assert!(cache.get(id, at(500)).is_none());
        assert!(cache.get(cache.identity(&[check("b")]), at(0)).is_none());
    }

    #[test]
    fn it_may_hold_only_until_the_last_refusal_it_remembers_ends() {
        let cache = RefusalCache::default();
        let now = Instant::now();
        assert!(!cache.may_hold(cache.time(now)));
        cache.insert(
            cache.identity(&[check("a")]),
            smallvec::smallvec![refused(500)],
            now,
            Duration::from_millis(500),
        );
        cache.insert(
            cache.identity(&[check("b")]),
            smallvec::smallvec![refused(100)],
            now,
            Duration::from_millis(100),
        );
        assert!(cache.may_hold(cache.time(now + Duration::from_millis(499))));
        assert!(!cache.may_hold(cache.time(now + Duration::from_millis(501))));
    }

    #[test]
    fn the_cost_is_part_of_the_identity() {
        let cache = RefusalCache::default();
        let mut heavy = check("a");
        heavy.cost = 5;
        assert_ne!(cache.identity(&[check("a")]), cache.identity(&[heavy]));
    }
}
