//! The in-process store: the same semantics as Redis for a single instance.
//!
//! Keys are spread over shards, each behind its own mutex, so decisions for different
//! clients rarely contend. One decision locks every shard its keys live in (in index
//! order, so two decisions never deadlock) and runs [`super::decide_all`] under them:
//! atomic and all-or-nothing like the Redis script. Entries expire after their TTL, and a
//! shard that reaches its share of `max_keys` first drops expired entries, then the
//! entries closest to expiry, so a client spraying random keys cannot grow it without
//! bound.

use std::sync::{Arc, Mutex, MutexGuard};

use smallvec::SmallVec;

use super::algorithm::{State, refund};
use super::clock::Clock;
use super::keyed_hash::{IdentityMap, KeyedHash};
use super::{Decisions, LimitCheck, Write, decide_all};

const SHARDS: usize = 64;

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// `None` for a lock.
    state: Option<State>,
    expires_at: u64,
}

/// A key's identity in the store ([`KeyedHash`]): the store keeps 16 bytes per key
/// instead of the text (which halves its memory), and clients cannot make two of their
/// keys, or theirs and someone else's, collide.
type Slot = u128;

type Shard = IdentityMap<Entry>;

/// The in-process rate-limit store.
pub struct MemoryStore {
    shards: Vec<Mutex<Shard>>,
    hash: KeyedHash,
    clock: Arc<dyn Clock>,
    max_per_shard: usize,
}

impl MemoryStore {
    /// A store keeping at most about `max_keys` keys, on `clock`.
    pub fn new(clock: Arc<dyn Clock>, max_keys: usize) -> Self {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            hash: KeyedHash::random(),
            clock,
            max_per_shard: max_keys.div_ceil(SHARDS).max(1),
        }
    }

    fn slot(&self, key: &str) -> Slot {
        self.hash.of(key)
    }

    fn shard_of(slot: Slot) -> usize {
        (slot >> 64) as usize % SHARDS
    }

    /// Decides all of one request's limits, atomically.
    pub fn decide(&self, checks: &[LimitCheck]) -> Decisions {
        // Each key's slot, hashed once: the reads and writes below find theirs here.
        let mut slots: SmallVec<[(&str, Slot); 2]> = SmallVec::new();
        for check in checks {
            slots.push((&check.key, self.slot(&check.key)));
            if let Some((lock, _)) = &check.lockout {
                slots.push((lock, self.slot(lock)));
            }
        }
        // The keys asked for below are the checks' own strings: found by address.
        let slot_of = |key: &str| {
            slots
                .iter()
                .find(|(known, _)| std::ptr::eq(*known, key))
                .map_or_else(|| self.slot(key), |&(_, slot)| slot)
        };
        let mut indexes: SmallVec<[usize; 2]> = slots
            .iter()
            .map(|&(_, slot)| MemoryStore::shard_of(slot))
            .collect();
        indexes.sort_unstable();
        indexes.dedup();
        let mut guards: SmallVec<[(usize, MutexGuard<'_, Shard>); 2]> = indexes
            .iter()
            .map(|&i| {
                (
                    i,
                    self.shards[i]
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner()),
                )
            })
            .collect();
        let now = self.clock.now_micros();
        let live = |guards: &[(usize, MutexGuard<'_, Shard>)], key: &str| -> Option<Entry> {
            let slot = slot_of(key);
            let shard = MemoryStore::shard_of(slot);
            let (_, guard) = guards.iter().find(|(i, _)| *i == shard)?;
            guard.get(&slot).copied().filter(|entry| entry.expires_at > now)
        };
        let (decisions, writes) = decide_all(
            checks,
            now,
            |key| live(&guards, key).and_then(|entry| entry.state),
            |key| live(&guards, key).map(|entry| entry.expires_at - now),
        );
        for write in writes {
            let (key, entry, only_if_absent) = match write {
                Write::State { key, state, ttl } => (
                    key,
                    Entry {
                        state: Some(state),
                        expires_at: now + ttl,
                    },
                    false,
                ),
                Write::Lock { key, ttl } => (
                    key,
                    Entry {
                        state: None,
                        expires_at: now + ttl,
                    },
                    true,
                ),
            };
            let slot = slot_of(key);
            let shard = MemoryStore::shard_of(slot);
            let Some((_, guard)) = guards.iter_mut().find(|(i, _)| *i == shard) else {
                continue;
            };
            if let Some(existing) = guard.get_mut(&slot) {
                if !(only_if_absent && existing.expires_at > now) {
                    *existing = entry;
                }
                continue;
            }
            if guard.len() >= self.max_per_shard {
                make_room(guard, now, self.max_per_shard);
            }
            guard.insert(slot, entry);
        }
        decisions
    }

    /// Gives back what an admitted request consumed from `check`'s limit.
    pub fn refund(&self, check: &LimitCheck) {
        let slot = self.slot(&check.key);
        let mut guard = self.shards[MemoryStore::shard_of(slot)]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = self.clock.now_micros();
        let stored = guard
            .get(&slot)
            .filter(|entry| entry.expires_at > now)
            .and_then(|entry| Some((entry.state?, entry.expires_at - now)));
        if let Some((state, ttl)) = refund(&check.algorithm, stored, check.cost, now) {
            guard.insert(
                slot,
                Entry {
                    state: Some(state),
                    expires_at: now + ttl,
                },
            );
        }
    }

    /// Keys currently held (expired ones included until they are swept).
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Drops expired entries; if the shard is still full, the quarter closest to expiry.
fn make_room(shard: &mut Shard, now: u64, max: usize) {
    let live = shard.values().filter(|entry| entry.expires_at > now).count();
    let keep_after = if live < max {
        now
    } else {
        let mut expiries: Vec<u64> = shard
            .values()
            .map(|entry| entry.expires_at)
            .filter(|&expires_at| expires_at > now)
            .collect();
        let cut = (max / 4).max(1).min(expiries.len() - 1);
        *expiries.select_nth_unstable(cut).1
    };
    shard.retain(|_, entry| entry.expires_at > keep_after);
    // Removed entries may leave tombstones, which the table reclaims only by growing: once
    // they have taken room the share needs before its next sweep, the table is rebuilt at
    // the share's size (a shard kept full by a client spraying keys would otherwise double).
    if shard.capacity() < max {
        let mut rebuilt = Shard::with_capacity_and_hasher(max, Default::default());
        rebuilt.extend(shard.drain());
        *shard = rebuilt;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::limit::clock::ManualClock;
    use crate::limit::{Algorithm, Outcome};

    const S: u64 = 1_000_000;

    fn check(key: &str, algorithm: Algorithm) -> LimitCheck {
        LimitCheck {
            key: key.to_owned(),
            algorithm,
            lockout: None,
            cost: 1,
            shadow: false,
        }
    }

    fn fixed(limit: u64) -> Algorithm {
        Algorithm::FixedWindow { limit, window: S }
    }

    #[test]
    fn concurrent_decisions_admit_exactly_the_limit() {
        let store = Arc::new(MemoryStore::new(Arc::new(ManualClock::default()), 10_000));
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
        let store = MemoryStore::new(Arc::new(ManualClock::default()), 10_000);
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
        let store = MemoryStore::new(clock.clone(), 10_000);
        let mut locked = check("k", fixed(1));
        locked.lockout = Some(("k:lock".into(), 10 * S));
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
        let store = MemoryStore::new(clock.clone(), max_keys);
        for i in 0..4 * max_keys {
            store.decide(&[check(&format!("client-{i}"), fixed(5))]);
            clock.advance(Duration::from_micros(1));
        }
        assert!(store.len() <= max_keys + SHARDS, "{}", store.len());
        // ...and so does their memory: no shard's table outgrows its share of the keys.
        let share = Shard::with_capacity_and_hasher(store.max_per_shard, Default::default()).capacity();
        for shard in &store.shards {
            let capacity = shard.lock().unwrap().capacity();
            assert!(
                capacity <= share,
                "a shard holds {capacity} slots, its share needs {share}"
            );
        }
    }
}
