//! 128-bit identities for what clients name (store keys, a request's checks): one pass of
//! SipHash-1-3 with a 128-bit output, keyed at random per process. The key is secret, so
//! clients cannot choose texts whose identities collide; 128 bits make a chance collision
//! negligible. Maps keyed by such an identity use its bits as they are ([`IdentityMap`]).

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};

use siphasher::sip128::{Hasher128, SipHasher13};

/// A randomly keyed 128-bit hash.
pub(crate) struct KeyedHash {
    key: (u64, u64),
}

impl KeyedHash {
    /// A hash with a new random key: two outputs of std's randomly keyed SipHash.
    pub(crate) fn random() -> Self {
        let seed = RandomState::new();
        KeyedHash {
            key: (seed.hash_one(0u8), seed.hash_one(1u8)),
        }
    }

    /// A hasher to write a composite value into; [`Self::finish`] gives its identity.
    pub(crate) fn hasher(&self) -> SipHasher13 {
        SipHasher13::new_with_keys(self.key.0, self.key.1)
    }

    pub(crate) fn finish(hasher: &SipHasher13) -> u128 {
        hasher.finish128().as_u128()
    }

    /// The identity of `text`.
    pub(crate) fn of(&self, text: &str) -> u128 {
        let mut hasher = self.hasher();
        hasher.write(text.as_bytes());
        KeyedHash::finish(&hasher)
    }
}

/// A map keyed by identities: they are uniformly random already, so the map takes its
/// bucket from their low bits instead of hashing them again.
pub(crate) type IdentityMap<V> = HashMap<u128, V, BuildHasherDefault<IdentityHasher>>;

#[derive(Default)]
pub(crate) struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes.iter().take(8) {
            self.0 = self.0 << 8 | u64::from(byte);
        }
    }

    fn write_u128(&mut self, identity: u128) {
        self.0 = identity as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_depend_on_the_text_and_the_random_key() {
        let hash = KeyedHash::random();
        assert_eq!(hash.of("fg:per_ip:10.0.0.1"), hash.of("fg:per_ip:10.0.0.1"));
        assert_ne!(hash.of("fg:per_ip:10.0.0.1"), hash.of("fg:per_ip:10.0.0.2"));
        assert_ne!(
            hash.of("fg:per_ip:10.0.0.1"),
            KeyedHash::random().of("fg:per_ip:10.0.0.1")
        );
        // Both halves carry the hash (the map uses the low, the shards the high bits).
        let identity = hash.of("fg:per_ip:10.0.0.1");
        assert_ne!(identity >> 64, 0);
        assert_ne!(identity as u64, 0);
    }
}
