//! Which server a request goes to: smooth weighted round robin (as nginx), the fewest
//! requests in flight, or a consistent-hash ring over a key tuple (sticky sessions).
//!
//! Every choice is among the servers a predicate accepts (in rotation, not tried yet by
//! this request, below the concurrency cap), so that a server out of rotation simply
//! drops out: round robin keeps its proportions among the others, and the ring sends a
//! key whose server is out to the next server on the ring, moving no other key.

use std::cell::Cell;
use std::hash::Hasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use siphasher::sip::SipHasher13;
use smallvec::SmallVec;

use super::server::Server;
use crate::config::Balance;

/// Ring points per unit of weight: enough for an even spread of keys over a few servers.
const POINTS_PER_WEIGHT: u32 = 160;
/// Fixed hash keys: every instance must map a key tuple to the same server.
const RING_KEYS: (u64, u64) = (0x666c_6f6f_6467_6174, 0x7570_7374_7265_616d);

/// How an upstream picks a server.
pub(super) enum Balancer {
    /// Each server's current weight (nginx's smooth weighted round robin), and with equal
    /// weights, the next server in turn (see [`Balancer::turn`]).
    RoundRobin {
        current: Mutex<Vec<i64>>,
        turns: Option<AtomicUsize>,
    },
    LeastRequests,
    /// `(point, server)`, sorted by point.
    Hash(Vec<(u64, usize)>),
}

impl Balancer {
    pub(super) fn new(balance: &Balance, servers: &[Server]) -> Self {
        match balance {
            Balance::RoundRobin => Balancer::RoundRobin {
                current: Mutex::new(vec![0; servers.len()]),
                turns: servers
                    .iter()
                    .all(|server| server.weight == servers[0].weight)
                    .then(AtomicUsize::default),
            },
            Balance::LeastRequests => Balancer::LeastRequests,
            Balance::Hash(_) => {
                let mut ring: Vec<(u64, usize)> = servers
                    .iter()
                    .enumerate()
                    .flat_map(|(index, server)| {
                        (0..POINTS_PER_WEIGHT * server.weight).map(move |point| {
                            let mut hasher = SipHasher13::new_with_keys(RING_KEYS.0, RING_KEYS.1);
                            hasher.write(server.label.as_bytes());
                            hasher.write_u32(point);
                            (hasher.finish(), index)
                        })
                    })
                    .collect();
                ring.sort_unstable();
                Balancer::Hash(ring)
            }
        }
    }

    /// With every one of `servers` eligible, and round robin over equal weights: the next
    /// server in turn. That is what the smooth round robin would pick, but taken without
    /// its lock or a look at each server (a request to a pool of healthy servers pays
    /// for nothing else).
    pub(super) fn turn(&self, servers: usize) -> Option<usize> {
        match self {
            Balancer::RoundRobin {
                turns: Some(turns), ..
            } => Some(turns.fetch_add(1, Ordering::Relaxed) % servers),
            _ => None,
        }
    }

    /// Picks a server that `eligible` accepts; `affinity` is the request's key hash
    /// (for `hash`; see [`affinity`]).
    pub(super) fn pick(
        &self,
        servers: &[Server],
        affinity: Option<u64>,
        eligible: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        if let [_] = servers {
            return eligible(0).then_some(0);
        }
        match self {
            Balancer::RoundRobin { current, .. } => {
                let mut current = current.lock().unwrap_or_else(PoisonError::into_inner);
                let mut total = 0;
                let mut best: Option<(usize, i64)> = None;
                for (index, (server, weight)) in servers.iter().zip(current.iter_mut()).enumerate() {
                    if !eligible(index) {
                        continue;
                    }
                    *weight += i64::from(server.weight);
                    total += i64::from(server.weight);
                    if best.is_none_or(|(_, heaviest)| *weight > heaviest) {
                        best = Some((index, *weight));
                    }
                }
                let (best, _) = best?;
                current[best] -= total;
                Some(best)
            }
            Balancer::LeastRequests => {
                let mut best: Option<(usize, u64)> = None;
                let mut ties = 0u32;
                for (index, server) in servers.iter().enumerate() {
                    if !eligible(index) {
                        continue;
                    }
                    let load = server.load();
                    let better = match best {
                        None => true,
                        Some((b, best_load)) => {
                            (load, std::cmp::Reverse(server.weight))
                                < (best_load, std::cmp::Reverse(servers[b].weight))
                        }
                    };
                    if better {
                        best = Some((index, load));
                        ties = 1;
                    } else if let Some((b, best_load)) = best
                        && load == best_load
                        && server.weight == servers[b].weight
                    {
                        // Reservoir sampling: each of the tied servers equally likely.
                        ties += 1;
                        if random_below(ties) == 0 {
                            best = Some((index, load));
                        }
                    }
                }
                best.map(|(index, _)| index)
            }
            Balancer::Hash(ring) => {
                let start = ring.partition_point(|&(point, _)| point < affinity.unwrap_or(0));
                let mut seen: SmallVec<[bool; 16]> = SmallVec::from_elem(false, servers.len());
                let mut left = servers.len();
                for &(_, index) in ring[start..].iter().chain(&ring[..start]) {
                    if seen[index] {
                        continue;
                    }
                    if eligible(index) {
                        return Some(index);
                    }
                    seen[index] = true;
                    left -= 1;
                    if left == 0 {
                        break;
                    }
                }
                None
            }
        }
    }
}

/// The ring position of a request's key tuple (as built for `hash_key`).
pub(super) fn affinity(tuple: &str) -> u64 {
    let mut hasher = SipHasher13::new_with_keys(RING_KEYS.0, RING_KEYS.1);
    hasher.write(tuple.as_bytes());
    hasher.finish()
}

/// A number below `n` (at least 1), from a per-thread xorshift: for breaking ties, where
/// nothing depends on it being unpredictable.
fn random_below(n: u32) -> u32 {
    thread_local! {
        static STATE: Cell<u64> = Cell::new(
            std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), 0u8) | 1,
        );
    }
    STATE.with(|state| {
        let mut x = state.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        state.set(x);
        (x % u64::from(n)) as u32
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use super::*;
    use crate::upstream::places::ConnectionPlaces;
    use crate::upstream::pool::Pool;
    use crate::upstream::server::Transport;

    fn servers(weights: &[u32]) -> Vec<Server> {
        weights
            .iter()
            .enumerate()
            .map(|(i, &weight)| {
                let label = format!("10.0.0.{i}:80");
                let pool = Pool::new(
                    label.clone(),
                    Duration::from_secs(1),
                    None,
                    &ConnectionPlaces::new(8),
                );
                let series =
                    crate::metrics::Metrics::new().upstream_server(&"u".into(), &label.as_str().into());
                Server::new(label.into(), weight, Transport::Http(pool), series, None)
            })
            .collect()
    }

    #[test]
    fn round_robin_is_weighted_and_smooth() {
        let servers = servers(&[1, 1, 2]);
        let balancer = Balancer::new(&Balance::RoundRobin, &servers);
        let picks: Vec<usize> = (0..8)
            .map(|_| balancer.pick(&servers, None, |_| true).unwrap())
            .collect();
        // nginx's sequence for weights 1, 1, 2: interleaved, not 2, 2, 0, 1.
        assert_eq!(picks, [2, 0, 1, 2, 2, 0, 1, 2]);
        let mut counts = [0; 3];
        for _ in 0..40 {
            counts[balancer.pick(&servers, None, |_| true).unwrap()] += 1;
        }
        assert_eq!(counts, [10, 10, 20]);
        // A server out of rotation drops out; the others keep their proportions.
        let mut counts = [0; 3];
        for _ in 0..30 {
            counts[balancer.pick(&servers, None, |i| i != 2).unwrap()] += 1;
        }
        assert_eq!(counts, [15, 15, 0]);
        assert_eq!(balancer.pick(&servers, None, |_| false), None);
    }

    #[test]
    fn equal_weights_take_turns_and_unequal_ones_do_not() {
        let equal = servers(&[2, 2, 2]);
        let balancer = Balancer::new(&Balance::RoundRobin, &equal);
        let turns: Vec<Option<usize>> = (0..7).map(|_| balancer.turn(equal.len())).collect();
        assert_eq!(turns, [0, 1, 2, 0, 1, 2, 0].map(Some));
        let unequal = servers(&[1, 1, 2]);
        assert_eq!(Balancer::new(&Balance::RoundRobin, &unequal).turn(3), None);
        assert_eq!(Balancer::new(&Balance::LeastRequests, &equal).turn(3), None);
        assert_eq!(Balancer::new(&Balance::Hash(Vec::new()), &equal).turn(3), None);
    }

    #[test]
    fn least_requests_prefers_the_idlest_then_the_heaviest() {
        let servers = servers(&[1, 3, 1]);
        let balancer = Balancer::new(&Balance::LeastRequests, &servers);
        servers[0].in_flight.set(2);
        servers[1].in_flight.set(1);
        servers[2].in_flight.set(1);
        assert_eq!(balancer.pick(&servers, None, |_| true), Some(1));
        servers[1].in_flight.set(5);
        assert_eq!(balancer.pick(&servers, None, |_| true), Some(2));
        assert_eq!(balancer.pick(&servers, None, |i| i != 2), Some(0));
        // Equal load and weight: both get picked.
        servers[0].in_flight.set(0);
        servers[2].in_flight.set(0);
        let mut seen = [false; 3];
        for _ in 0..200 {
            seen[balancer.pick(&servers, None, |_| true).unwrap()] = true;
        }
        assert_eq!(seen, [true, false, true]);
    }

    #[test]
    fn the_ring_moves_only_the_keys_of_a_server_that_leaves() {
        let servers = servers(&[1, 1, 1]);
        let balancer = Balancer::new(&Balance::Hash(Vec::new()), &servers);
        let keys: Vec<u64> = (0..3000).map(|i| affinity(&format!("session-{i}"))).collect();
        let before: Vec<usize> = keys
            .iter()
            .map(|&k| balancer.pick(&servers, Some(k), |_| true).unwrap())
            .collect();
        let mut share: HashMap<usize, usize> = HashMap::new();
        for &s in &before {
            *share.entry(s).or_default() += 1;
        }
        for s in 0..3 {
            assert!((700..1300).contains(&share[&s]), "uneven spread: {share:?}");
        }
        let after: Vec<usize> = keys
            .iter()
            .map(|&k| balancer.pick(&servers, Some(k), |i| i != 1).unwrap())
            .collect();
        for (b, a) in before.iter().zip(&after) {
            if *b != 1 {
                assert_eq!(a, b, "a key of a server that stayed moved");
            } else {
                assert_ne!(*a, 1);
            }
        }
        assert_eq!(balancer.pick(&servers, Some(keys[0]), |_| false), None);
    }
}
