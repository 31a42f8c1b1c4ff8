//! Requests in flight per key, in process: the in-process store's concurrency limits (and
//! the local fallback's, when Redis fails). A slot is taken when a request is admitted and
//! given back when its response is done.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use super::key::identity::KeyedHash;

const SHARDS: usize = 16;

/// Counts of requests in flight, by store key.
pub struct InFlightCounts {
    hash: KeyedHash,
    shards: Vec<Mutex<HashMap<String, u64>>>,
}

impl Default for InFlightCounts {
    fn default() -> Self {
        InFlightCounts {
            hash: KeyedHash::random(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }
}

impl InFlightCounts {
    fn shard(&self, key: &str) -> &Mutex<HashMap<String, u64>> {
        &self.shards[(self.hash.of(key) >> 64) as usize % SHARDS]
    }

    /// Takes a slot of `key` unless `limit` are taken.
    pub fn acquire(&self, key: &str, limit: u64) -> bool {
        let mut counts = self.shard(key).lock().unwrap_or_else(PoisonError::into_inner);
        let count = counts.entry(key.to_owned()).or_insert(0);
        if *count >= limit {
            return false;
        }
        *count += 1;
        true
    }

    /// Gives back a slot of `key`.
    pub fn release(&self, key: &str) {
        let mut counts = self.shard(key).lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = counts.get_mut(key) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                counts.remove(key);
            }
        }
    }

    /// Slots of `key` taken now.
    pub fn count(&self, key: &str) -> u64 {
        let counts = self.shard(key).lock().unwrap_or_else(PoisonError::into_inner);
        counts.get(key).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_counted_per_key_and_given_back() {
        let counts = InFlightCounts::default();
        assert!(counts.acquire("a", 2) && counts.acquire("a", 2));
        assert!(!counts.acquire("a", 2));
        assert!(counts.acquire("b", 2));
        counts.release("a");
        assert_eq!(counts.count("a"), 1);
        assert!(counts.acquire("a", 2));
        counts.release("a");
        counts.release("a");
        counts.release("a");
        assert_eq!(counts.count("a"), 0);
    }
}
