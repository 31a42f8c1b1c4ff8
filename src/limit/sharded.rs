//! The one sharded map of the limiter: what the in-process store keeps per key, the
//! requests in flight per key, and the refusals remembered in front of Redis.
//!
//! Entries are keyed by 128-bit identities ([`KeyedHash`], under the map's own random key):
//! the map keeps 16 bytes per key instead of its text, and clients cannot make their keys
//! collide. An identity's high bits pick its shard, each behind its own mutex, so that
//! callers working on different keys rarely contend; its low bits pick its bucket in the
//! shard's table ([`IdentityMap`]).
//!
//! A bounded map keeps at most a share of its bound in each shard. A new entry that finds
//! its shard full first has the expired entries dropped; if the shard is still full, its
//! owner's eviction drops what can be given up; when nothing can, the shard keeps no new
//! entry until the first of its entries expires. Removed entries may leave tombstones,
//! which the table reclaims only by growing: once they have taken room the share needs,
//! the table is rebuilt at the share's size (a shard kept full by a client spraying keys
//! would otherwise double).

use std::sync::{Mutex, MutexGuard, PoisonError};

use siphasher::sip128::SipHasher13;
use smallvec::SmallVec;

use super::key::identity::{IdentityMap, KeyedHash};

/// An entry of a bounded map: it is dropped once expired, at microseconds on its owner's
/// clock.
pub(crate) trait Expiring {
    fn expires_at(&self) -> u64;
}

/// `SHARDS` tables of `V` by identity, each behind its own mutex.
pub(crate) struct ShardedMap<V, const SHARDS: usize> {
    shards: [Mutex<Shard<V>>; SHARDS],
    hash: KeyedHash,
}

/// One shard's table, and what bounds it.
pub(crate) struct Shard<V> {
    entries: IdentityMap<V>,
    /// The entries a new one may find here and still be kept: the shard's share of the
    /// map's bound.
    share: usize,
    /// Until then the shard is full of entries its owner must keep: a new one is not stored.
    full_until: u64,
}

impl<V, const SHARDS: usize> ShardedMap<V, SHARDS> {
    /// A map that keeps about `bound` entries at most.
    pub(crate) fn bounded(bound: usize) -> Self {
        let share = bound.div_ceil(SHARDS).max(1);
        ShardedMap {
            shards: std::array::from_fn(|_| {
                Mutex::new(Shard {
                    entries: IdentityMap::default(),
                    share,
                    full_until: 0,
                })
            }),
            hash: KeyedHash::random(),
        }
    }

    /// A map that keeps whatever it is given (its owner bounds it otherwise).
    pub(crate) fn unbounded() -> Self {
        ShardedMap::bounded(usize::MAX)
    }

    /// `text`'s identity in this map.
    pub(crate) fn identity(&self, text: &str) -> u128 {
        self.hash.of(text)
    }

    /// A hasher to write a composite value into, under this map's key: its identity is
    /// [`KeyedHash::finish`].
    pub(crate) fn hasher(&self) -> SipHasher13 {
        self.hash.hasher()
    }

    fn index(identity: u128) -> usize {
        (identity >> 64) as usize % SHARDS
    }

    /// The shard of `identity`, locked.
    pub(crate) fn lock(&self, identity: u128) -> MutexGuard<'_, Shard<V>> {
        lock(&self.shards[Self::index(identity)])
    }

    /// The shards of all `identities`, locked together in index order (so that two callers
    /// never deadlock): a change to all of them is atomic.
    pub(crate) fn lock_all(&self, identities: impl IntoIterator<Item = u128>) -> Locked<'_, V, SHARDS> {
        const { assert!(SHARDS <= 64, "the shards to lock are a set of 64 bits") };
        let mut shards = identities
            .into_iter()
            .fold(0u64, |set, identity| set | 1 << Self::index(identity));
        let mut guards = SmallVec::new();
        while shards != 0 {
            let index = shards.trailing_zeros() as usize;
            guards.push((index, lock(&self.shards[index])));
            shards &= shards - 1;
        }
        Locked { guards }
    }

    /// Entries held (expired ones included until they are swept).
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|shard| lock(shard).entries.len()).sum()
    }

    /// Forgets every entry.
    pub(crate) fn clear(&self) {
        for shard in &self.shards {
            lock(shard).entries.clear();
        }
    }

    /// Each shard's table capacity.
    #[cfg(test)]
    pub(crate) fn capacities(&self) -> Vec<usize> {
        self.shards
            .iter()
            .map(|shard| lock(shard).entries.capacity())
            .collect()
    }
}

/// A shard whose holder panicked is used as it is: each change to an entry is whole.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Several shards of one map, locked together ([`ShardedMap::lock_all`]).
pub(crate) struct Locked<'a, V, const SHARDS: usize> {
    guards: SmallVec<[(usize, MutexGuard<'a, Shard<V>>); 2]>,
}

impl<V, const SHARDS: usize> Locked<'_, V, SHARDS> {
    /// The shard of `identity` (`None` when it was not locked with the others).
    pub(crate) fn shard(&self, identity: u128) -> Option<&Shard<V>> {
        let index = ShardedMap::<V, SHARDS>::index(identity);
        let (_, guard) = self.guards.iter().find(|(i, _)| *i == index)?;
        Some(&**guard)
    }

    /// The shard of `identity`, to change (`None` when it was not locked with the others).
    pub(crate) fn shard_mut(&mut self, identity: u128) -> Option<&mut Shard<V>> {
        let index = ShardedMap::<V, SHARDS>::index(identity);
        let (_, guard) = self.guards.iter_mut().find(|(i, _)| *i == index)?;
        Some(&mut **guard)
    }
}

impl<V> Shard<V> {
    pub(crate) fn get(&self, identity: u128) -> Option<&V> {
        self.entries.get(&identity)
    }

    pub(crate) fn get_mut(&mut self, identity: u128) -> Option<&mut V> {
        self.entries.get_mut(&identity)
    }

    /// Stores `value` as `identity`'s entry, whatever the bound.
    pub(crate) fn insert(&mut self, identity: u128, value: V) {
        self.entries.insert(identity, value);
    }

    pub(crate) fn remove(&mut self, identity: u128) {
        self.entries.remove(&identity);
    }
}

impl<V: Expiring> Shard<V> {
    /// Stores `value` as the entry of `identity`, which the shard does not hold, within
    /// the bound: a full shard first makes room (see the module docs), with `evict` to
    /// drop what its owner can give up of the live entries (given the share; false when
    /// nothing can go). Returns whether the entry was stored.
    pub(crate) fn insert_new(
        &mut self,
        identity: u128,
        value: V,
        now: u64,
        evict: impl FnOnce(&mut IdentityMap<V>, usize) -> bool,
    ) -> bool {
        self.insert_within(identity, value, now, evict, 0)
    }

    /// As [`insert_new`](Self::insert_new), for an entry worth more than any other the
    /// shard may hold: when nothing can go, it is stored all the same while the shard
    /// holds less than half as much again as its share. (A lock-out: a spray of keys that
    /// filled the shard with entries that must be kept must not cost a client its
    /// lock-out, nor may lock-outs grow the map without bound.)
    pub(crate) fn insert_new_beyond_share(
        &mut self,
        identity: u128,
        value: V,
        now: u64,
        evict: impl FnOnce(&mut IdentityMap<V>, usize) -> bool,
    ) -> bool {
        let over = self.share / 2;
        self.insert_within(identity, value, now, evict, over)
    }

    /// Stores a new entry if the shard makes room for it, or holds fewer than its share
    /// and `over` more.
    fn insert_within(
        &mut self,
        identity: u128,
        value: V,
        now: u64,
        evict: impl FnOnce(&mut IdentityMap<V>, usize) -> bool,
        over: usize,
    ) -> bool {
        if self.entries.len() >= self.share
            && !self.make_room(now, evict)
            && self.entries.len() >= self.share + over
        {
            return false;
        }
        self.entries.insert(identity, value);
        true
    }

    /// Makes room in a full shard: drops the expired entries, then, if it is still full,
    /// lets `evict` drop some of the rest. Returns false when nothing could go: the shard
    /// then keeps no new entry until the first of its entries expires.
    fn make_room(&mut self, now: u64, evict: impl FnOnce(&mut IdentityMap<V>, usize) -> bool) -> bool {
        if now < self.full_until {
            return false;
        }
        self.entries.retain(|_, entry| entry.expires_at() > now);
        let room = self.entries.len() < self.share || evict(&mut self.entries, self.share);
        if !room {
            self.full_until = self
                .entries
                .values()
                .map(Expiring::expires_at)
                .min()
                .unwrap_or(now);
        }
        if self.entries.capacity() < self.share {
            let mut rebuilt = IdentityMap::with_capacity_and_hasher(self.share, Default::default());
            rebuilt.extend(self.entries.drain());
            self.entries = rebuilt;
        }
        room
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An entry living until `.0`, that its owner may evict when `.1`.
    #[derive(Debug, Clone, Copy, PartialEq)]
    struct Timed(u64, bool);

    impl Expiring for Timed {
        fn expires_at(&self) -> u64 {
            self.0
        }
    }

    fn evict_evictable(entries: &mut IdentityMap<Timed>, _share: usize) -> bool {
        let before = entries.len();
        entries.retain(|_, entry| !entry.1);
        entries.len() < before
    }

    #[test]
    fn a_full_shard_drops_the_expired_then_the_evictable_then_keeps_nothing_new_until_an_expiry() {
        let map = ShardedMap::<Timed, 1>::bounded(2);
        let mut shard = map.lock(0);
        assert!(shard.insert_new(1, Timed(10, false), 0, evict_evictable));
        assert!(shard.insert_new(2, Timed(20, true), 0, evict_evictable));
        // Full: the evictable entry goes.
        assert!(shard.insert_new(3, Timed(30, false), 0, evict_evictable));
        assert_eq!(shard.get(2), None);
        // Full of entries to keep: nothing new until the first expires (10).
        assert!(!shard.insert_new(4, Timed(40, false), 5, evict_evictable));
        assert!(!shard.insert_new(4, Timed(40, false), 9, evict_evictable));
        assert!(shard.insert_new(4, Timed(40, false), 10, evict_evictable));
        assert_eq!(shard.get(1), None, "expired, dropped");
        assert_eq!(shard.get(4), Some(&Timed(40, false)));
    }

    #[test]
    fn identities_spread_over_the_shards_and_locks_are_taken_once_each() {
        let map = ShardedMap::<u64, 4>::unbounded();
        let identities: Vec<u128> = (0..4u128).map(|i| i << 64 | i).collect();
        let mut locked = map.lock_all(identities.iter().copied().chain(identities.iter().copied()));
        for &identity in &identities {
            locked.shard_mut(identity).unwrap().insert(identity, 1);
        }
        assert!(
            identities
                .iter()
                .all(|&i| locked.shard(i).unwrap().get(i) == Some(&1))
        );
        drop(locked);
        assert_eq!(map.len(), 4);
        assert_eq!(
            map.capacities().iter().filter(|&&c| c > 0).count(),
            4,
            "one per shard"
        );
        map.clear();
        assert_eq!(map.len(), 0);
    }
}
