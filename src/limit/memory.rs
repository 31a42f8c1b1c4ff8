//! The in-process store: the same semantics as Redis for a single instance.
//!
//! Keys live in a [`ShardedMap`], by identity ([`KeySlot`]). One decision locks every
//! shard its keys live in (together, so two decisions never deadlock) and runs
//! [`super::decide_all`] under them: atomic and all-or-nothing like the Redis script.
//! Entries expire after their TTL.
//!
//! A shard that reaches its share of `max_keys` first drops expired entries, then the
//! entries whose state is closest to a fresh key's (a counter at 1, a full bucket: what
//! costs least to forget), so a client spraying random keys cannot grow it without bound.
//! It never drops a key with less left than a request costs, or a lock: a spray must not
//! free an exhausted counter or a lock-out. When only such keys are left, the shard keeps
//! no new counter until one of them expires; new keys are then decided as fresh without
//! being stored, and counted in `floodgate_store_keys_not_kept_total`. A new lock is kept
//! beyond the share, by up to half of it, so that a spray of exhausted counters does not
//! cost a client its lock-out, and lock-outs too stay bounded.

use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use smallvec::SmallVec;

use super::algorithm::{State, refund};
use super::clock::Clock;
use super::inflight::InFlightCounts;
use super::key::identity::IdentityMap;
use super::sharded::{Expiring, ShardedMap};
use super::{Decisions, LimitCheck, Peeked, Used, Write, decide_all};

/// Keys the gateway's in-process stores (the store, and Redis's local fallback) keep at
/// most: about 150 bytes each.
pub const MAX_KEYS: usize = 200_000;

const SHARDS: usize = 64;

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// `None` for a lock.
    state: Option<State>,
    expires_at: u64,
    used: Used,
}

impl Entry {
    /// The order in which a full shard forgets live entries: least used first, then the
    /// sooner to expire.
    fn eviction_rank(&self) -> (Used, u64) {
        (self.used, self.expires_at)
    }
}

impl Expiring for Entry {
    fn expires_at(&self) -> u64 {
        self.expires_at
    }
}

/// A key's identity in the store (a [`ShardedMap`] identity): the store keeps 16 bytes
/// per key instead of the text (which halves its memory), and clients cannot make two of
/// their keys, or theirs and someone else's, collide.
type KeySlot = u128;

/// The in-process rate-limit store.
pub struct MemoryStore {
    keys: ShardedMap<Entry, SHARDS>,
    clock: Arc<dyn Clock>,
    /// Decisions whose new key a full store did not keep.
    not_kept: Counter,
    /// Concurrency limits' slots.
    pub(crate) in_flight: InFlightCounts,
}

impl MemoryStore {
    /// A store keeping at most about `max_keys` keys, on `clock`, counting in `not_kept`
    /// the new keys it had no room for.
    pub fn new(clock: Arc<dyn Clock>, max_keys: usize, not_kept: Counter) -> Self {
        MemoryStore {
            keys: ShardedMap::bounded(max_keys),
            clock,
            not_kept,
            in_flight: InFlightCounts::default(),
        }
    }

    fn slot(&self, key: &str) -> KeySlot {
        self.keys.identity(key)
    }

    /// `key`'s entry, if it is live at `now`.
    fn live(&self, key: &str, now: u64) -> Option<Entry> {
        let slot = self.slot(key);
        self.keys
            .lock(slot)
            .get(slot)
            .copied()
            .filter(|entry| entry.expires_at > now)
    }

    /// Decides all of one request's limits, atomically.
    pub fn decide(&self, checks: &[LimitCheck]) -> Decisions {
        // Each key's slot, hashed once: the reads and writes below find theirs here.
        let mut slots: SmallVec<[(&str, KeySlot); 2]> = SmallVec::new();
        for check in checks {
            slots.push((&check.key, self.slot(&check.key)));
            if let Some(lockout) = &check.lockout {
                slots.push((&lockout.key, self.slot(&lockout.key)));
            }
        }
        // The keys asked for below are the checks' own strings: found by address.
        let slot_of = |key: &str| {
            slots
                .iter()
                .find(|(known, _)| std::ptr::eq(*known, key))
                .map_or_else(|| self.slot(key), |&(_, slot)| slot)
        };
        let mut shards = self.keys.lock_all(slots.iter().map(|&(_, slot)| slot));
        let now = self.clock.now_micros();
        let live = |key: &str| -> Option<Entry> {
            let slot = slot_of(key);
            shards
                .shard(slot)?
                .get(slot)
                .copied()
                .filter(|entry| entry.expires_at > now)
        };
        let (decisions, writes) = decide_all(
            checks,
            now,
            |key| live(key).and_then(|entry| entry.state),
            |key| live(key).map(|entry| entry.expires_at - now),
        );
        let mut not_kept = false;
        for write in writes {
            let (key, entry, only_if_absent) = match write {
                Write::State {
                    key,
                    state,
                    ttl,
                    used,
                } => (
                    key,
                    Entry {
                        state: Some(state),
                        expires_at: now + ttl,
                        used,
                    },
                    false,
                ),
                Write::Lock { key, ttl } => (
                    key,
                    Entry {
                        state: None,
                        expires_at: now + ttl,
                        used: Used::ALL,
                    },
                    true,
                ),
            };
            let slot = slot_of(key);
            let Some(shard) = shards.shard_mut(slot) else {
                continue;
            };
            if let Some(existing) = shard.get_mut(slot) {
                if !(only_if_absent && existing.expires_at > now) {
                    *existing = entry;
                }
                continue;
            }
            let kept = if only_if_absent {
                shard.insert_new_beyond_share(slot, entry, now, evict_least_used)
            } else {
                shard.insert_new(slot, entry, now, evict_least_used)
            };
            not_kept |= !kept;
        }
        if not_kept {
            self.not_kept.inc();
        }
        decisions
    }

    /// Gives back what an admitted request consumed from `check`'s limit.
    pub fn refund(&self, check: &LimitCheck) {
        let slot = self.slot(&check.key);
        let mut shard = self.keys.lock(slot);
        let now = self.clock.now_micros();
        let Some(existing) = shard.get_mut(slot).filter(|entry| entry.expires_at > now) else {
            return;
        };
        let stored = existing.state.map(|state| (state, existing.expires_at - now));
        if let Some((state, ttl)) = refund(&check.algorithm, stored, check.cost, now) {
            *existing = Entry {
                state: Some(state),
                expires_at: now + ttl,
                used: existing.used,
            };
        }
    }

    /// One key's live state and its lock's time left, without changing either.
    pub fn peek(&self, key: &str, lock: Option<&str>) -> Peeked {
        let now = self.clock.now_micros();
        Peeked {
            state: self.live(key, now).and_then(|entry| entry.state),
            lock_left: lock
                .and_then(|lock| self.live(lock, now))
                .map(|entry| entry.expires_at - now),
            now,
        }
    }

    /// Locks `key` for `ttl` microseconds, unless it is locked already; within the bound,
    /// as a decision's lock (see the module docs).
    pub fn lock(&self, key: &str, ttl: u64) {
        let now = self.clock.now_micros();
        let slot = self.slot(key);
        let mut shard = self.keys.lock(slot);
        let lock = Entry {
            state: None,
            expires_at: now + ttl,
            used: Used::ALL,
        };
        if let Some(existing) = shard.get_mut(slot) {
            if existing.expires_at <= now {
                *existing = lock;
            }
        } else if !shard.insert_new_beyond_share(slot, lock, now, evict_least_used) {
            self.not_kept.inc();
        }
    }

    /// Forgets one key and its lock: the next request finds them fresh.
    pub fn clear(&self, key: &str, lock: Option<&str>) {
        for key in std::iter::once(key).chain(lock) {
            let slot = self.slot(key);
            self.keys.lock(slot).remove(slot);
        }
    }

    /// Keys currently held (expired ones included until they are swept).
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a full shard of live entries gives up (see the module docs): the quarter of its
/// `share` that is least used, never an entry with nothing left or a lock. False when
/// every entry must be kept.
fn evict_least_used(entries: &mut IdentityMap<Entry>, share: usize) -> bool {
    let mut ranks: Vec<(Used, u64)> = entries
        .values()
        .filter(|entry| entry.used < Used::ALL)
        .map(Entry::eviction_rank)
        .collect();
    if ranks.is_empty() {
        return false;
    }
    let cut = (share / 4).clamp(1, ranks.len()) - 1;
    let last_dropped = *ranks.select_nth_unstable(cut).1;
    entries.retain(|_, entry| entry.used == Used::ALL || entry.eviction_rank() > last_dropped);
    true
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::limit::Lockout;
    use crate::limit::clock::ManualClock;
    use crate::limit::{Algorithm, Outcome};

    const S: u64 = 1_000_000;

    fn check(key: &str, algorithm: Algorithm) -> LimitCheck {
        LimitCheck {
            key: key.to_owned(),
            algorithm,
            lockout: None,
            cost: 1,
            keep_below: 0,
            shadow: false,
        }
    }

    fn fixed(limit: u64) -> Algorithm {
        Algorithm::FixedWindow { limit, window: S }
    }

    #[test]
    fn concurrent_decisions_admit_exactly_the_limit() {
        let store = Arc::new(MemoryStore::new(
            Arc::new(ManualClock::default()),
            10_000,
            Counter::default(),
        ));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let store = store.clone();
                std::thread::spawn(move || {
                    (0..25)
                        .filter(|_| store.decide(&[check("k", fixed(50))])[0].outcome.admits())
                        .count()
                })
            })
            .collect();
        let admitted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(admitted, 50);
    }

    #[test]
    fn a_rejection_by_one_limit_consumes_nothing_from_the_others() {
        let store = MemoryStore::new(Arc::new(ManualClock::default()), 10_000, Counter::default());
        let both = [check("wide", fixed(10)), check("narrow", fixed(1))];
        assert!(store.decide(&both).iter().all(|d| d.outcome.admits()));
        let refused = store.decide(&both);
        assert_eq!(refused[0].outcome, Outcome::Allowed);
        assert_eq!(refused[0].remaining, 9);
        assert_eq!(refused[1].outcome, Outcome::Rejected);
        assert_eq!(store.decide(&[check("wide", fixed(10))])[0].remaining, 8);
    }

    #[test]
    fn lockout_outlives_the_window() {
        let clock = Arc::new(ManualClock::default());
        let store = MemoryStore::new(clock.clone(), 10_000, Counter::default());
        let mut locked = check("k", fixed(1));
        locked.lockout = Some(Lockout::on_refusal("k:lock".into(), 10 * S));
        assert!(store.decide(std::slice::from_ref(&locked))[0].outcome.admits());
        let first = store.decide(std::slice::from_ref(&locked))[0];
        assert_eq!(first.outcome, Outcome::Rejected);
        assert_eq!(first.retry_after, Duration::from_secs(10));
        clock.advance(Duration::from_secs(5));
        let during = store.decide(std::slice::from_ref(&locked))[0];
        assert_eq!(during.outcome, Outcome::Locked);
        assert_eq!(during.retry_after, Duration::from_secs(5));
        clock.advance(Duration::from_secs(5));
        assert!(store.decide(std::slice::from_ref(&locked))[0].outcome.admits());
    }

    #[test]
    fn sprayed_keys_stay_bounded() {
        let clock = Arc::new(ManualClock::default());
        // A share of 448 keys fills its table to the last slot (512 buckets), as the
        // gateway's share of 200,000 nearly does (3,125 keys in a table for 3,584).
        let max_keys = 448 * SHARDS;
        let store = MemoryStore::new(clock.clone(), max_keys, Counter::default());
        for i in 0..4 * max_keys {
            store.decide(&[check(&format!("client-{i}"), fixed(5))]);
            clock.advance(Duration::from_micros(1));
        }
        assert!(store.len() <= max_keys + SHARDS, "{}", store.len());
        // ...and so does their memory: no shard's table outgrows its share of the keys.
        let share =
            IdentityMap::<Entry>::with_capacity_and_hasher(max_keys.div_ceil(SHARDS), Default::default())
                .capacity();
        for capacity in store.keys.capacities() {
            assert!(
                capacity <= share,
                "a shard holds {capacity} slots, its share needs {share}"
            );
        }
    }

    fn admits(store: &MemoryStore, check: &LimitCheck) -> bool {
        store.decide(std::slice::from_ref(check))[0].outcome.admits()
    }

    #[test]
    fn a_spray_of_keys_never_frees_an_exhausted_counter_or_a_lock_out() {
        let clock = Arc::new(ManualClock::default());
        let max_keys = 16 * SHARDS;
        let store = MemoryStore::new(clock.clone(), max_keys, Counter::default());
        let exhausted = check("exhausted", fixed(3));
        let mut locked = check("locked", fixed(1));
        locked.lockout = Some(Lockout::on_refusal("locked:lock".into(), 100 * S));
        let heavy: Vec<LimitCheck> = (0..max_keys / 4)
            .map(|i| check(&format!("heavy-{i}"), fixed(5)))
            .collect();
        for _ in 0..3 {
            assert!(admits(&store, &exhausted));
        }
        assert!(admits(&store, &locked));
        assert!(!admits(&store, &locked), "locked out now");
        for key in &heavy {
            for _ in 0..4 {
                assert!(admits(&store, key));
            }
        }
        // Each sprayed key has used a fifth of its limit: those are what a full shard gives up.
        for i in 0..20 * max_keys {
            store.decide(&[check(&format!("spray-{i}"), fixed(5))]);
            clock.advance(Duration::from_micros(1));
        }
        assert!(
            !admits(&store, &exhausted),
            "the exhausted counter is still there"
        );

        assert_eq!(
            store.decide(std::slice::from_ref(&locked))[0].outcome,
            Outcome::Locked
        );
        let forgotten = heavy
            .iter()
            .filter(|key| store.decide(std::slice::from_ref(*key))[0].remaining != 0)
            .count();
        assert_eq!(forgotten, 0, "keys that used more were kept before sprayed ones");
        assert!(store.len() <= max_keys + SHARDS, "{}", store.len());
    }

    #[test]
    fn a_store_full_of_exhausted_keys_keeps_no_new_one_and_counts_it() {
        let clock = Arc::new(ManualClock::default());
        let max_keys = 4 * SHARDS;
        let not_kept = Counter::default();
        let store = MemoryStore::new(clock.clone(), max_keys, not_kept.clone());
        // Limit 1: every key is exhausted by its first request.
        for i in 0..8 * max_keys {
            store.decide(&[check(&format!("spray-{i}"), fixed(1))]);
        }
        assert!(store.len() <= max_keys + SHARDS, "{}", store.len());
        let kept = store.len() as u64;
        assert_eq!(not_kept.get(), 8 * max_keys as u64 - kept);
        let unkept: Vec<String> = (0..8 * max_keys)
            .map(|i| format!("spray-{i}"))
            .filter(|key| admits(&store, &check(key, fixed(1))))
            .collect();
        assert_eq!(
            unkept.len() as u64,
            8 * max_keys as u64 - kept,
            "not kept: decided as fresh"
        );
        // Once they expire (the window, 1 s), new keys are kept again.
        clock.advance(Duration::from_secs(1));
        let fresh = check("after", fixed(1));
        assert!(admits(&store, &fresh));
        assert!(!admits(&store, &fresh), "kept this time");
    }

    /// A store a spray filled with exhausted counters keeps the counters its clients'
    /// requests are refused by (those with less left than a request costs too), and the
    /// lock-outs of the clients it knew, beyond its bound by up to half of it; lock-outs of
    /// failures, taken outside a decision, are bounded as well.
    #[test]
    fn refusals_and_lock_outs_are_kept_past_a_full_store_and_stay_bounded() {
        let clock = Arc::new(ManualClock::default());
        let max_keys = 8 * SHARDS;
        let not_kept = Counter::default();
        let store = MemoryStore::new(clock.clone(), max_keys, not_kept.clone());
        let mut locked = check("locked", fixed(1));
        locked.lockout = Some(Lockout::on_refusal("locked:lock".into(), 100 * S));
        assert!(admits(&store, &locked));
        // Two units left, and each request costs four.
        let mut costly = check("costly", fixed(10));
        costly.cost = 4;
        for _ in 0..2 {
            assert!(admits(&store, &costly));
        }
        assert!(!admits(&store, &costly));
        for i in 0..8 * max_keys {
            store.decide(&[check(&format!("spray-{i}"), fixed(1))]);
        }
        assert!(not_kept.get() > 0, "the store is full");
        assert!(!admits(&store, &costly), "still refused");
        let refused = store.decide(std::slice::from_ref(&locked))[0];
        assert_eq!(refused.outcome, Outcome::Rejected);
        clock.advance(Duration::from_secs(10));
        let later = store.decide(std::slice::from_ref(&locked))[0];
        assert_eq!(later.outcome, Outcome::Locked, "the lock-out was kept");
        assert_eq!(later.retry_after, Duration::from_secs(90));

        // Failures' lock-outs sprayed over new keys.
        for i in 0..8 * max_keys {
            store.lock(&format!("failures-{i}:lock"), 100 * S);
        }
        assert!(
            store.len() <= max_keys + max_keys / 2 + 2 * SHARDS,
            "{} entries",
            store.len()
        );
        assert!(
            store
                .peek("failures-0:lock", Some("failures-0:lock"))
                .lock_left
                .is_some()
        );
    }

    /// A key one route of its limit is refused on (it costs more than is left) is kept by a
    /// full store, even when a cheaper route of the same limit touched it last.
    #[test]
    fn a_key_the_costliest_route_is_refused_on_is_kept_whatever_came_last() {
        let clock = Arc::new(ManualClock::default());
        let max_keys = 8 * SHARDS;
        let store = MemoryStore::new(clock.clone(), max_keys, Counter::default());
        let mut costly = check("shared", fixed(10));
        costly.cost = 4;
        costly.keep_below = 4;
        let mut cheap = check("shared", fixed(10));
        cheap.keep_below = 4;
        for _ in 0..2 {
            assert!(admits(&store, &costly));
        }
        assert!(!admits(&store, &costly));
        assert!(admits(&store, &cheap), "one unit of the two left");
        for i in 0..8 * max_keys {
            store.decide(&[check(&format!("spray-{i}"), fixed(1))]);
        }
        assert!(!admits(&store, &costly), "still refused: kept");
        assert_eq!(store.decide(std::slice::from_ref(&cheap))[0].remaining, 0);
    }

    #[test]
    fn how_much_is_used_orders_what_is_forgotten() {
        let used = |left, capacity| Used::of(left, capacity, 1);
        assert!(used(4, 5) < used(3, 5));
        assert!(used(1, 5) < Used::ALL);
        assert_eq!(used(0, 5), Used::ALL);
        assert!(used(1, u64::MAX) < Used::ALL, "something left is never ALL");
        assert_eq!(used(5, 5), used(10, 10), "a fresh key's state");
        assert_eq!(
            Used::of(3, 10, 4),
            Used::ALL,
            "too little left for the request's cost"
        );
        assert!(Used::of(4, 10, 4) < Used::ALL);
    }

    #[test]
    fn an_entry_costs_no_more_than_before_it_carried_its_use() {
        assert_eq!(std::mem::size_of::<(KeySlot, Entry)>(), 64);
    }
}
