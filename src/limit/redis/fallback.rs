//! Redis as the gateway uses it (docs/operations.md#when-redis-fails): a circuit breaker so that an outage does not
//! cost `redis.timeout` on every request, a background probe that opens it while no
//! decision shows Redis answering (so that readiness follows Redis without traffic) and
//! closes it again as soon as Redis answers, a heartbeat that counts the live instances,
//! the renewal of the concurrency leases this instance holds, and the one rule of what a
//! failed operation becomes under each `on_error` ([`ResilientRedis::failed`]): for
//! `local`, done by the in-process store (see [`crate::limit::store`]) with each limit
//! divided by the live instance count ([`ResilientRedis::share`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use super::breakers::{Breaker, Breakers, Chosen};
use super::{RedisStore, RedisTarget, StoreError};
use crate::limit::algorithm::Algorithm;
use crate::limit::store::OnError;
use crate::limit::{Decisions, LimitCheck, Peeked};

/// How often the store probes Redis: an open breaker to see it recover, a closed one when
/// no decision was answered since the last probe (with three failures to open a breaker,
/// an outage is seen within a second without any traffic).
const PROBE_EVERY: Duration = Duration::from_millis(250);
/// How often this instance announces itself, and how long an announcement lives.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
const HEARTBEAT_TTL: Duration = Duration::from_secs(5);
/// How often held concurrency leases are renewed (a lease lasts at least 3 s).
const LEASE_RENEWAL: Duration = Duration::from_secs(1);

/// An operation on the store, for the one rule of what its failure means
/// ([`ResilientRedis::failed`]); those whose failure `on_error` decides carry it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Operation {
    /// Decide a request's rate limits.
    Decide(OnError),
    /// Take a concurrency slot.
    Acquire(OnError),
    /// Give a concurrency slot back.
    Release,
    /// Give back what an admitted request consumed (a held request that left, an attempt
    /// that was not a failure).
    Refund,
    /// Start a lock-out (a counted failure that took the last of the room).
    Lock(OnError),
    /// Read a key's state (the limit-state API).
    Peek,
    /// Count a key's concurrency slots taken (the limit-state API).
    Count,
    /// Reset a key and lift its lock-out (the limit-state API).
    Clear,
}

/// What becomes of a failed operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recovery {
    /// `on_error = "local"`: done in the in-process fallback store instead.
    Local,
    /// `on_error = "allow"`: the request goes on, unlimited by it.
    Admit,
    /// `on_error = "deny"`: the request is refused with 503.
    Refuse,
    /// Nothing stands in for it: a refund or a released lease is lost (the window or the
    /// lease ends it), a lock-out is not started, the limit-state API answers 503.
    Lost,
}

/// The Redis store with its breaker, heartbeat and leases.
pub(crate) struct ResilientRedis {
    redis: RedisStore,
    breakers: Breakers,
    /// `floodgate_store_errors_total{store="redis"}`.
    errors: Counter,
    /// Live instances last seen in Redis (at least 1).
    instances: AtomicU64,
    /// Whether a decision was answered since the last probe.
    answered: AtomicBool,
    /// Concurrency leases this instance holds in Redis, renewed while held: by lease id,
    /// the key and the lease's length.
    leases: Mutex<HashMap<String, (String, Duration)>>,
    /// Makes lease ids unique within the instance.
    next_lease: AtomicU64,
    /// This instance's id (the heartbeat's), the prefix of its lease ids.
    id: String,
    /// The sorted set the instances announce themselves in.
    instance_key: String,
    address: String,
}

impl ResilientRedis {
    /// Starts connecting, probing and heart-beating (under `prefix`) in the background.
    /// `errors` counts the operations that failed; `breaker_open` is 1 while the breaker is.
    pub(crate) fn start(
        target: &RedisTarget,
        timeout: Duration,
        prefix: &str,
        errors: Counter,
        breaker_open: Gauge,
    ) -> Result<Arc<Self>, StoreError> {
        let redis = RedisStore::start(target, timeout)?;
        let store = Arc::new(ResilientRedis {
            breakers: Breakers::new(redis.is_cluster(), breaker_open),
            redis,
            errors,
            instances: AtomicU64::new(1),
            answered: AtomicBool::new(false),
            leases: Mutex::default(),
            next_lease: AtomicU64::new(0),
            id: instance_id(),
            instance_key: format!("{prefix}:instances"),
            address: target.describe(),
        });
        tokio::spawn(probe(Arc::downgrade(&store)));
        tokio::spawn(heartbeat(Arc::downgrade(&store)));
        tokio::spawn(renew_leases(Arc::downgrade(&store)));
        Ok(store)
    }

    /// Announces this instance (a script that writes, as a decision does) and keeps the
    /// live instance count it returns.
    async fn announce(&self) -> Result<(), StoreError> {
        let count = self
            .redis
            .heartbeat(&self.instance_key, &self.id, HEARTBEAT_TTL)
            .await?;
        self.instances.store(count.max(1), Ordering::Relaxed);
        Ok(())
    }

    /// Whether Redis can decide: on one server (or a Sentinel master), whether it takes
    /// this instance's heartbeat, a write; a Redis that answers `PING` may refuse every
    /// write (full under `noeviction`, a read-only replica). On a cluster, a `PING` to any
    /// node, for the slots no known node serves: the heartbeat's key lives on one node,
    /// whose loss would keep that breaker open for every such key.
    async fn probe(&self) -> Result<(), StoreError> {
        if self.redis.is_cluster() {
            self.redis.ping().await
        } else {
            self.announce().await
        }
    }

    /// On a cluster: whether each node whose breaker is open (every node, with `all`)
    /// serves a key of its slots, in parallel (a read routed as decisions are: a node that
    /// answers `PING` may not be serving yet, or the client may still send its slots to
    /// a node they moved from); a node that does has its breaker closed, and with `all`
    /// one that does not is counted as failing.
    async fn probe_nodes(&self, all: bool) {
        let nodes = self.breakers.nodes(all);
        let answers =
            futures_util::future::join_all(nodes.iter().map(|node| self.redis.probe_key(&node.probe))).await;
        for (node, answer) in nodes.iter().zip(answers) {
            match answer {
                Ok(()) if self.breakers.close(&node.breaker) => {
                    let node = node.breaker.node().unwrap_or_default();
                    tracing::info!(redis = %self.address, %node, "the redis cluster node answers again; deciding its keys in redis");
                }
                Ok(()) => self.breakers.success(&node.breaker),
                Err(error) if all => self.breaker_failure(&node.breaker, &error),
                Err(_) => {}
            }
        }
    }

    /// Live gateway instances sharing this Redis, as last seen (at least 1).
    pub(crate) fn instances(&self) -> u64 {
        self.instances.load(Ordering::Relaxed).max(1)
    }

    /// Decides in Redis, unless the breaker is open.
    pub(crate) async fn decide(&self, checks: &[LimitCheck]) -> Result<Decisions, StoreError> {
        let breakers = self
            .breakers
            .for_keys(checks.iter().map(|check| check.key.as_str()));
        let decided = self.through_breaker(breakers, self.redis.decide(checks)).await;
        if decided.is_ok() && !self.answered.load(Ordering::Relaxed) {
            self.answered.store(true, Ordering::Relaxed);
        }
        decided
    }

    /// The one place that decides what a failed `operation` means: it is counted
    /// (`floodgate_store_errors_total`) and logged, and becomes what `on_error` makes of
    /// it for that operation (docs/operations.md#when-redis-fails). The breaker heard of it
    /// already, from the operation.
    pub(crate) fn failed(&self, operation: Operation, error: &StoreError) -> Recovery {
        self.errors.inc();
        tracing::debug!(redis = %self.address, ?operation, %error, "a rate-limit store operation failed");
        match operation {
            Operation::Decide(OnError::Allow) | Operation::Acquire(OnError::Allow) => Recovery::Admit,
            Operation::Decide(OnError::Deny) | Operation::Acquire(OnError::Deny) => Recovery::Refuse,
            Operation::Decide(OnError::Local)
            | Operation::Acquire(OnError::Local)
            | Operation::Lock(OnError::Local) => Recovery::Local,
            Operation::Lock(OnError::Allow | OnError::Deny) => Recovery::Lost,
            // The unit or the lease was taken in Redis: the in-process store has nothing
            // of it to give back.
            Operation::Release | Operation::Refund => Recovery::Lost,
            // The limit-state API reads and resets what every instance shares.
            Operation::Peek | Operation::Count | Operation::Clear => Recovery::Lost,
        }
    }

    /// Feeds `breaker` with a failure (of an operation, or of a probe).
    fn breaker_failure(&self, breaker: &Breaker, error: &StoreError) {
        if !self.breakers.failure(breaker) {
            return;
        }
        match breaker.node() {
            Some(node) => tracing::warn!(
                redis = %self.address, %node, %error,
                "a redis cluster node is failing; deciding its keys by on_error until it answers again"
            ),
            None => tracing::warn!(
                redis = %self.address, %error,
                "redis is failing; deciding by on_error until it answers again"
            ),
        }
    }

    /// `check` as the in-process store decides it in Redis's stead: its limit divided by
    /// the live instances.
    pub(crate) fn share(&self, check: &LimitCheck) -> LimitCheck {
        LimitCheck {
            algorithm: divided(check.algorithm, self.instances()),
            ..check.clone()
        }
    }

    /// A concurrency limit of `limit` slots as the in-process store counts it in Redis's
    /// stead: divided by the live instances (rounded up, at least 1).
    pub(crate) fn slots_share(&self, limit: u64) -> u64 {
        limit.div_ceil(self.instances()).max(1)
    }

    /// Reads `key` (and its lock) in Redis, changing nothing, unless the breaker is open.
    pub(crate) async fn peek(
        &self,
        algorithm: &Algorithm,
        key: &str,
        lock: Option<&str>,
    ) -> Result<Peeked, StoreError> {
        self.through_breaker(
            self.breakers.for_keys([key]),
            self.redis.peek(algorithm, key, lock),
        )
        .await
    }

    /// Starts lock-out `key` for `ttl` µs in Redis, unless it runs or the breaker is open.
    pub(crate) async fn lock(&self, key: &str, ttl: u64) -> Result<(), StoreError> {
        self.through_breaker(self.breakers.for_keys([key]), self.redis.lock(key, ttl))
            .await
    }

    /// Runs `call` unless one of `breakers` (those of the nodes its keys live on) is open,
    /// and feeds them with what became of it: the one guard every operation on Redis goes
    /// through. A call across slots that fails is a failure of the nodes whose slots'
    /// calls failed, and an answer from the others.
    async fn through_breaker<T>(
        &self,
        breakers: Chosen,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        if breakers.iter().any(|breaker| breaker.is_open()) {
            return Err(StoreError::BreakerOpen);
        }
        let result = call.await;
        // A call across slots says which of its slots' calls failed.
        let failed = match &result {
            Err(StoreError::InSlots { failed, .. }) => {
                Some(self.breakers.for_keys(failed.iter().map(String::as_str)))
            }
            _ => None,
        };
        for breaker in &breakers {
            let failed_here = failed.as_ref().map_or(result.is_err(), |failed| {
                failed.iter().any(|known| Arc::ptr_eq(known, breaker))
            });
            match &result {
                Err(error) if failed_here => self.breaker_failure(breaker, error),
                _ => self.breakers.success(breaker),
            }
        }
        result
    }

    /// Gives back what an admitted request consumed from `check`, unless the breaker is
    /// open.
    pub(crate) async fn refund(&self, check: &LimitCheck) -> Result<(), StoreError> {
        self.through_breaker(
            self.breakers.for_keys([check.key.as_str()]),
            self.redis.refund(check),
        )
        .await
    }

    /// Takes a concurrency slot of `key` (one of `limit`) as a lease of `lease` that this
    /// instance renews while it holds it: the lease's id, or `None` when every slot is
    /// taken.
    pub(crate) async fn acquire(
        &self,
        key: &str,
        limit: u64,
        lease: Duration,
    ) -> Result<Option<String>, StoreError> {
        let id = format!("{}:{}", self.id, self.next_lease.fetch_add(1, Ordering::Relaxed));
        let taken = self
            .through_breaker(self.breakers.for_keys([key]), async {
                // Registered first, so that a renewal never misses a lease being taken.
                self.lock_leases().insert(id.clone(), (key.to_owned(), lease));
                self.redis.acquire(key, &id, limit, lease).await
            })
            .await;
        match taken {
            Ok(true) => Ok(Some(id)),
            taken_or_failed => {
                self.lock_leases().remove(&id);
                taken_or_failed.map(|_| None)
            }
        }
    }

    /// Gives back lease `id` of `key` (in the background: nothing waits for it; lost, it
    /// expires).
    pub(crate) fn release(self: &Arc<Self>, key: String, id: String) {
        self.lock_leases().remove(&id);
        let store = self.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let breakers = store.breakers.for_keys([key.as_str()]);
                let released = store
                    .through_breaker(breakers, store.redis.release(&key, &id))
                    .await;
                if let Err(error) = released {
                    store.failed(Operation::Release, &error);
                }
            });
        }
    }

    /// Reads how many concurrency slots of `key` are taken, unless the breaker is open.
    pub(crate) async fn leases(&self, key: &str) -> Result<u64, StoreError> {
        self.through_breaker(self.breakers.for_keys([key]), self.redis.leases(key))
            .await
    }

    /// Resets `key` and lifts its lock-out, unless the breaker is open.
    pub(crate) async fn clear(&self, key: &str, lock: Option<&str>) -> Result<(), StoreError> {
        let keys = std::iter::once(key).chain(lock);
        self.through_breaker(self.breakers.for_keys(keys), self.redis.clear(key, lock))
            .await
    }

    fn lock_leases(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Duration)>> {
        self.leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether decisions can currently go to Redis (on a cluster, to some node).
    pub(crate) fn usable(&self) -> bool {
        self.redis.connected() && !self.breakers.all_open()
    }
}

/// A limit's share for one of `instances` gateways (at least 1 request or token).
fn divided(algorithm: Algorithm, instances: u64) -> Algorithm {
    let share = |n: u64| (n / instances).max(1);
    let n = instances as f64;
    match algorithm {
        Algorithm::FixedWindow { limit, window } => Algorithm::FixedWindow {
            limit: share(limit),
            window,
        },
        Algorithm::SlidingWindow { limit, window } => Algorithm::SlidingWindow {
            limit: share(limit),
            window,
        },
        Algorithm::TokenBucket { rate, per, burst } => Algorithm::TokenBucket {
            rate: rate / n,
            per,
            burst: share(burst),
        },
        Algorithm::LeakyBucket { rate, per, burst } => Algorithm::LeakyBucket {
            rate: rate / n,
            per,
            burst: share(burst),
        },
    }
}

/// A name for this instance in the heartbeat set: host, process and start time.
fn instance_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros());
    format!("{}:{}:{started}", host.trim(), std::process::id())
}

/// Probes (see [`PROBE_EVERY`]) until the store is dropped. A probe that waits for a hung
/// Redis delays the next one by no more than that wait (missed ticks fire at once).
async fn probe(store: Weak<ResilientRedis>) {
    let mut every = tokio::time::interval(PROBE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    every.tick().await;
    loop {
        every.tick().await;
        let Some(store) = store.upgrade() else { return };
        let unanswered = !store.answered.swap(false, Ordering::Relaxed);
        if store.redis.is_cluster() {
            store.probe_nodes(unanswered).await;
        }
        let whole = store.breakers.whole();
        if whole.is_open() {
            if store.redis.recover().await.is_ok()
                && store.probe().await.is_ok()
                && store.breakers.close(whole)
            {
                tracing::info!(redis = %store.address, "redis answers again; deciding in redis");
            }
        } else if unanswered {
            match store.probe().await {
                Ok(()) => store.breakers.success(whole),
                Err(error) => store.breaker_failure(whole, &error),
            }
        }
    }
}

/// Renews the leases this instance holds, every second, until the store is gone.
async fn renew_leases(store: Weak<ResilientRedis>) {
    loop {
        tokio::time::sleep(LEASE_RENEWAL).await;
        let Some(live) = store.upgrade() else { return };
        let mut by_key: HashMap<(String, Duration), Vec<String>> = HashMap::new();
        for (id, (key, lease)) in live.lock_leases().iter() {
            by_key.entry((key.clone(), *lease)).or_default().push(id.clone());
        }
        // All at once: one after another, keys on a node that hangs would each take
        // `redis.timeout`, and the leases on the other nodes would expire meanwhile.
        let redis = &live.redis;
        let renewals = by_key.iter().map(|((key, lease), ids)| async move {
            if let Err(error) = redis.renew(key, ids, *lease).await {
                tracing::debug!(%error, key, "concurrency leases could not be renewed");
            }
        });
        futures_util::future::join_all(renewals).await;
    }
}

/// Announces this instance and reads the live instance count (and on a cluster, which
/// node serves which slot) until the store is dropped.
async fn heartbeat(store: Weak<ResilientRedis>) {
    loop {
        let Some(live) = store.upgrade() else { return };
        let _ = live.announce().await;
        if live.redis.is_cluster()
            && let Ok(ranges) = live.redis.slot_ranges().await
        {
            live.breakers.learn(&ranges);
        }
        drop(live);
        tokio::time::sleep(HEARTBEAT_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_shared_out_between_instances() {
        let fixed = Algorithm::FixedWindow {
            limit: 600,
            window: 1,
        };
        assert_eq!(
            divided(fixed, 3),
            Algorithm::FixedWindow {
                limit: 200,
                window: 1
            }
        );
        let tiny = Algorithm::FixedWindow { limit: 2, window: 1 };
        assert_eq!(divided(tiny, 5), Algorithm::FixedWindow { limit: 1, window: 1 });
        let bucket = Algorithm::TokenBucket {
            rate: 10.0,
            per: 1,
            burst: 20,
        };
        assert_eq!(
            divided(bucket, 4),
            Algorithm::TokenBucket {
                rate: 2.5,
                per: 1,
                burst: 5
            }
        );
    }
}
