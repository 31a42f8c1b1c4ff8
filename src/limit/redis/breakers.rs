//! The circuit breakers in front of Redis: one for a single server (or a Sentinel
//! master); on a Redis Cluster, one per master node, chosen by the slot a call's keys hash
//! to, so that a node going down sends only its own keys to `on_error` while the others'
//! are still decided in Redis. One breaker for a whole cluster opened on the lost node's
//! failures and closed again on the next `PING` another node answered: every key went back
//! and forth between Redis and `on_error`, and readiness with it.
//!
//! Which node serves which slot is read with `CLUSTER SLOTS` ([`Breakers::learn`]); a
//! slot no known node serves (before the first reading) goes through the breaker for
//! the whole cluster, which the probe's `PING` to any node feeds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use arc_swap::ArcSwap;
use prometheus_client::metrics::gauge::Gauge;
use smallvec::SmallVec;

/// Consecutive failures that open a breaker.
const FAILURES_TO_OPEN: u32 = 3;
/// Redis Cluster's key slots.
const SLOTS: usize = 16384;
/// In [`Nodes::owner`], a slot no known node serves.
const UNKNOWN: u16 = u16::MAX;

/// Counts consecutive failures; open means "do not ask Redis".
#[derive(Debug, Default)]
pub(crate) struct Breaker {
    /// The cluster node's `host:port` (none: the whole store's).
    node: Option<String>,
    failures: AtomicU32,
    open: AtomicBool,
    /// Its node left the cluster: calls still in flight through it open it no more (it
    /// would stay open, probed by no one, in the metrics).
    retired: AtomicBool,
}

impl Breaker {
    fn of_node(address: &str) -> Breaker {
        Breaker {
            node: Some(address.to_owned()),
            ..Breaker::default()
        }
    }

    /// The cluster node's `host:port`, for a node's breaker.
    pub(crate) fn node(&self) -> Option<&str> {
        self.node.as_deref()
    }

    pub(crate) fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Records a failure; returns true when this failure opened the breaker.
    fn failure(&self) -> bool {
        let failures = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        failures >= FAILURES_TO_OPEN
            && !self.retired.load(Ordering::Acquire)
            && !self.open.swap(true, Ordering::AcqRel)
    }

    fn success(&self) {
        self.failures.store(0, Ordering::Release);
    }

    /// Closes the breaker; returns true when it was open.
    fn close(&self) -> bool {
        self.failures.store(0, Ordering::Release);
        self.open.swap(false, Ordering::AcqRel)
    }
}

/// A cluster's master nodes, each with its breaker, and which serves each slot.
#[derive(Default)]
struct Nodes {
    nodes: Vec<Node>,
    /// Per slot, the index of its node in `nodes` ([`UNKNOWN`]: none known).
    owner: Vec<u16>,
}

/// One master node of a cluster.
#[derive(Clone)]
pub(crate) struct Node {
    /// Its breaker, which knows its `host:port`.
    pub(crate) breaker: Arc<Breaker>,
    /// A key of a slot it serves, which probes it as a decision reaches it: routed by the
    /// client's own map of the slots (a node the slots moved away from is still asked
    /// until the client learns they moved), and refused while the node cannot serve it.
    pub(crate) probe: String,
}

impl Node {
    fn serves_at(&self, address: &str) -> bool {
        self.breaker.node() == Some(address)
    }
}

/// The breakers of one Redis store, and `floodgate_store_breaker_open` (1 while any is
/// open).
pub(crate) struct Breakers {
    /// A single server's; on a cluster, that of slots no known node serves.
    whole: Arc<Breaker>,
    /// On a cluster: its nodes as last read.
    nodes: Option<ArcSwap<Nodes>>,
    gauge: Gauge,
}

/// The breakers one call goes through: one, or on a cluster those of each node its keys
/// live on.
pub(crate) type Chosen = SmallVec<[Arc<Breaker>; 1]>;

impl Breakers {
    /// One breaker, or (`cluster`) one per node; `gauge` is 1 while any is open.
    pub(crate) fn new(cluster: bool, gauge: Gauge) -> Breakers {
        gauge.set(0);
        Breakers {
            whole: Arc::default(),
            nodes: cluster.then(|| ArcSwap::from_pointee(Nodes::default())),
            gauge,
        }
    }

    /// The breakers of a call on `keys`: the whole store's, or each node's they live on.
    pub(crate) fn for_keys<'k>(&self, keys: impl IntoIterator<Item = &'k str>) -> Chosen {
        let Some(nodes) = &self.nodes else {
            return SmallVec::from_elem(self.whole.clone(), 1);
        };
        let nodes = nodes.load();
        let mut chosen = Chosen::new();
        for key in keys {
            let owner = nodes.owner.get(slot(key)).copied().unwrap_or(UNKNOWN);
            let breaker = nodes
                .nodes
                .get(usize::from(owner))
                .map_or(&self.whole, |node| &node.breaker);
            if !chosen.iter().any(|known| Arc::ptr_eq(known, breaker)) {
                chosen.push(breaker.clone());
            }
        }
        if chosen.is_empty() {
            chosen.push(self.whole.clone());
        }
        chosen
    }

    /// The breaker of the whole store (on a cluster, of slots no known node serves).
    pub(crate) fn whole(&self) -> &Breaker {
        &self.whole
    }

    /// The cluster's nodes whose breaker is open, or, with `all`, every node.
    pub(crate) fn nodes(&self, all: bool) -> Vec<Node> {
        let Some(nodes) = &self.nodes else {
            return Vec::new();
        };
        nodes
            .load()
            .nodes
            .iter()
            .filter(|node| all || node.breaker.is_open())
            .cloned()
            .collect()
    }

    /// Records a failure; returns true when this failure opened the breaker.
    pub(crate) fn failure(&self, breaker: &Breaker) -> bool {
        let opened = breaker.failure();
        if opened {
            self.show();
        }
        opened
    }

    pub(crate) fn success(&self, breaker: &Breaker) {
        breaker.success();
    }

    /// Closes `breaker`; returns true when it was open.
    pub(crate) fn close(&self, breaker: &Breaker) -> bool {
        let closed = breaker.close();
        if closed {
            self.show();
        }
        closed
    }

    /// Sets the gauge from the breakers as they are (1 while any in use is open): counted
    /// again at each change rather than kept as a count, which a node's breaker retired
    /// while a call through it failed would leave wrong.
    fn show(&self) {
        self.gauge.set(i64::from(self.any_open()));
    }

    fn any_open(&self) -> bool {
        self.whole.is_open()
            || self
                .nodes
                .as_ref()
                .is_some_and(|nodes| nodes.load().nodes.iter().any(|node| node.breaker.is_open()))
    }

    /// Whether no call can go to Redis: the one breaker is open, or on a cluster every
    /// known node's (or, before any is known, the whole cluster's).
    pub(crate) fn all_open(&self) -> bool {
        match &self.nodes {
            None => self.whole.is_open(),
            Some(nodes) => {
                let nodes = nodes.load();
                if nodes.nodes.is_empty() {
                    self.whole.is_open()
                } else {
                    nodes.nodes.iter().all(|node| node.breaker.is_open())
                }
            }
        }
    }

    /// Takes `ranges` (`CLUSTER SLOTS`: the first and last slot of each range, and the
    /// `host:port` of its master) as the cluster's nodes now. A node still there keeps its
    /// breaker; a node gone takes its breaker with it, closed.
    pub(crate) fn learn(&self, ranges: &[(u16, u16, String)]) {
        // No ranges at all is a node that knows no cluster (restarted without its
        // configuration), not a cluster without nodes.
        let Some(current) = self.nodes.as_ref().filter(|_| !ranges.is_empty()) else {
            return;
        };
        let old = current.load_full();
        let mut nodes = Nodes {
            nodes: Vec::new(),
            owner: vec![UNKNOWN; SLOTS],
        };
        // Each node's first range, for a probe key when it needs a new one.
        let mut first_ranges = Vec::new();
        for (first, last, address) in ranges {
            let range = usize::from(*first)..=usize::from(*last).min(SLOTS - 1);
            let index = match nodes.nodes.iter().position(|node| node.serves_at(address)) {
                Some(index) => index,
                None => {
                    let kept = old.nodes.iter().find(|node| node.serves_at(address));
                    nodes.nodes.push(Node {
                        breaker: kept.map_or_else(
                            || Arc::new(Breaker::of_node(address)),
                            |node| node.breaker.clone(),
                        ),
                        probe: kept.map(|node| node.probe.clone()).unwrap_or_default(),
                    });
                    first_ranges.push(range.clone());
                    nodes.nodes.len() - 1
                }
            };
            let Ok(index) = u16::try_from(index) else {
                continue;
            };
            if let Some(owners) = nodes.owner.get_mut(range) {
                owners.fill(index);
            }
        }
        // A probe key stays while its node still serves its slot.
        for (index, (node, range)) in nodes.nodes.iter_mut().zip(first_ranges).enumerate() {
            let serves = |key: &str| {
                nodes
                    .owner
                    .get(slot(key))
                    .is_some_and(|&owner| usize::from(owner) == index)
            };
            if node.probe.is_empty() || !serves(&node.probe) {
                node.probe = probe_key(&range);
            }
        }
        for node in &old.nodes {
            if !nodes
                .nodes
                .iter()
                .any(|known| Arc::ptr_eq(&known.breaker, &node.breaker))
            {
                node.breaker.retired.store(true, Ordering::Release);
                node.breaker.close();
            }
        }
        current.store(Arc::new(nodes));
        self.show();
    }
}

impl Drop for Breakers {
    /// A store replaced (a reload without `[redis]`, or with another Redis) leaves no
    /// open breaker behind in the metrics.
    fn drop(&mut self) {
        if self.any_open() {
            self.gauge.set(0);
        }
    }
}

/// A key whose slot is in `range` (`floodgate:probe:N`, the first such N: every slot has
/// one below 160,000).
fn probe_key(range: &std::ops::RangeInclusive<usize>) -> String {
    (0u32..1 << 20)
        .map(|n| format!("floodgate:probe:{n}"))
        .find(|key| range.contains(&slot(key)))
        .unwrap_or_default()
}

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of its hash tag, modulo 16384.
fn slot(key: &str) -> usize {
    usize::from(crc16::State::<crc16::XMODEM>::calculate(
        super::hash_tag(key).as_bytes(),
    )) % SLOTS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_breaker_opens_after_consecutive_failures_only() {
        let breakers = Breakers::new(false, Gauge::default());
        let breaker = breakers.whole.clone();
        assert!(!breakers.failure(&breaker));
        breakers.success(&breaker);
        assert!(!breakers.failure(&breaker));
        assert!(!breakers.failure(&breaker));
        assert_eq!(breakers.gauge.get(), 0);
        assert!(
            breakers.failure(&breaker),
            "the third consecutive failure opens it"
        );
        assert!(breaker.is_open() && breakers.all_open());
        assert_eq!(breakers.gauge.get(), 1);
        assert!(!breakers.failure(&breaker), "it opens once");
        assert!(breakers.close(&breaker));
        assert!(!breaker.is_open());
        assert_eq!(breakers.gauge.get(), 0);
        // A store dropped with its breaker open leaves none open in the metrics.
        let gauge = breakers.gauge.clone();
        for _ in 0..3 {
            breakers.failure(&breaker);
        }
        assert_eq!(gauge.get(), 1);
        drop(breakers);
        assert_eq!(gauge.get(), 0);
    }

    #[test]
    fn slots_are_redis_clusters() {
        // `CLUSTER KEYSLOT` of these, as Redis 7 answers.
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("{user1000}.following"), slot("user1000"));
        assert_eq!(slot("user1000"), 3443);
        assert_eq!(slot("foo{}{bar}"), 8363);
    }

    #[test]
    fn on_a_cluster_each_node_has_its_breaker_and_keeps_it_while_it_serves() {
        let breakers = Breakers::new(true, Gauge::default());
        let key_on = |wanted: usize| {
            (0..)
                .map(|i| format!("k{{{i}}}"))
                .find(|key| (slot(key) < 8192) == (wanted == 0))
                .unwrap()
        };
        let (first, second) = (key_on(0), key_on(1));
        // Before the nodes are known: the whole cluster's breaker.
        assert!(breakers.for_keys([first.as_str()])[0].node().is_none());
        breakers.learn(&[(0, 8191, "a:1".into()), (8192, 16383, "b:2".into())]);
        let a = breakers.for_keys([first.as_str()]);
        let b = breakers.for_keys([second.as_str()]);
        assert_eq!(a[0].node(), Some("a:1"));
        assert_eq!(b[0].node(), Some("b:2"));
        assert_eq!(
            breakers
                .for_keys([first.as_str(), second.as_str(), first.as_str()])
                .len(),
            2
        );

        for _ in 0..3 {
            breakers.failure(&a[0]);
        }
        assert!(a[0].is_open() && !b[0].is_open());
        assert!(!breakers.all_open(), "one node still answers");
        assert_eq!(breakers.gauge.get(), 1);
        assert_eq!(breakers.nodes(false).len(), 1);
        let nodes = breakers.nodes(true);
        assert_eq!(nodes.len(), 2);
        // Each probed on a key of its own slots.
        assert!(slot(&nodes[0].probe) < 8192 && slot(&nodes[1].probe) >= 8192);

        // The slots move: `a` serves half as much, still open; `b` goes, `c` comes.
        breakers.learn(&[(0, 4095, "a:1".into()), (4096, 16383, "c:3".into())]);
        assert!(breakers.for_keys([first.as_str()])[0].is_open() || slot(&first) >= 4096);
        assert!(Arc::ptr_eq(&breakers.nodes(false)[0].breaker, &a[0]));
        // `a` gone too: its open breaker goes with it, and the gauge falls; calls still in
        // flight through it do not open it again.
        breakers.learn(&[(0, 16383, "c:3".into())]);
        assert_eq!(breakers.gauge.get(), 0);
        for _ in 0..3 {
            assert!(!breakers.failure(&a[0]));
        }
        assert_eq!(breakers.gauge.get(), 0);
        // A reading with no ranges (a node that knows no cluster) changes nothing.
        breakers.learn(&[]);
        assert_eq!(breakers.nodes(true).len(), 1);
        assert!(!breakers.for_keys([first.as_str()])[0].is_open());
    }
}
