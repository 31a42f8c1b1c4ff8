//! Requests in flight per key, in process: the in-process store's concurrency limits (and
//! the local fallback's, when Redis fails). A slot is taken when a request is admitted and
//! given back when its response is done. Keys are held by identity in a [`ShardedMap`],
//! as the store holds its own; a key with no slot taken is not held, so the map holds
//! no more keys than there are requests in flight.

use super::sharded::ShardedMap;

const SHARDS: usize = 16;

/// Counts of requests in flight, by store key.
pub struct InFlightCounts {
    counts: ShardedMap<u64, SHARDS>,
}

impl Default for InFlightCounts {
    fn default() -> Self {
        InFlightCounts {
            counts: ShardedMap::unbounded(),
        }
    }
}

impl InFlightCounts {
    /// Takes a slot of `key` unless `limit` are taken.
    pub fn acquire(&self, key: &str, limit: u64) -> bool {
        let identity = self.counts.identity(key);
        let mut counts = self.counts.lock(identity);
        let taken = counts.get(identity).copied().unwrap_or(0);
        if taken >= limit {
            return false;
        }
        counts.insert(identity, taken + 1);
        true
    }

    /// Gives back a slot of `key`.
    pub fn release(&self, key: &str) {
        let identity = self.counts.identity(key);
        let mut counts = self.counts.lock(identity);
        if let Some(count) = counts.get_mut(identity) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                counts.remove(identity);
            }
        }
    }

    /// Slots of `key` taken now.
    pub fn count(&self, key: &str) -> u64 {
        let identity = self.counts.identity(key);
        self.counts.lock(identity).get(identity).copied().unwrap_or(0)
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
