//! Redis as the gateway uses it (docs/operations.md#when-redis-fails): a circuit breaker so that an outage does not
//! cost `redis.timeout` on every request, a background probe that opens it while no
//! decision shows Redis answering (so that readiness follows Redis without traffic) and
//! closes it again as soon as Redis answers, a heartbeat that counts the live instances,
//! the renewal of the concurrency leases this instance holds, and the one rule of what a
//! failed operation becomes under each `on_error` ([`ResilientRedis::failed`]): for
//! `local`, done by the in-process store (see [`crate::limit::store`]) with each limit
//! divided by the live instance count ([`ResilientRedis::share`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use super::{RedisStore, RedisTarget, StoreError};
use crate::limit::algorithm::Algorithm;
use crate::limit::store::OnError;
use crate::limit::{Decisions, LimitCheck, Peeked};

/// Consecutive failures that open the breaker.
const FAILURES_TO_OPEN: u32 = 3;
/// How often the store probes Redis: an open breaker to see it recover, a closed one when
/// no decision was answered since the last probe (with [`FAILURES_TO_OPEN`], an outage is
/// seen within a second without any traffic).
const PROBE_EVERY: Duration = Duration::from_millis(250);
/// How often this instance announces itself, and how long an announcement lives.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
const HEARTBEAT_TTL: Duration = Duration::from_secs(5);
/// How often held concurrency leases are renewed (a lease lasts at least 3 s).
const LEASE_RENEWAL: Duration = Duration::from_secs(1);

/// Counts consecutive failures; open means "do not ask Redis".
#[derive(Debug, Default)]
pub(crate) struct Breaker {
    failures: AtomicU32,
    open: AtomicBool,
    /// `floodgate_store_breaker_open`.
    gauge: Gauge,
}

impl Breaker {
    pub(crate) fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Records a failure; returns true when this failure opened the breaker.
    pub(crate) fn failure(&self) -> bool {
        let failures = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        let opened = failures >= FAILURES_TO_OPEN && !self.open.swap(true, Ordering::AcqRel);
        if opened {
            self.gauge.set(1);
        }
        opened
    }

    pub(crate) fn success(&self) {
        self.failures.store(0, Ordering::Release);
    }

    /// Closes the breaker; returns true when it was open.
    pub(crate) fn close(&self) -> bool {
        self.failures.store(0, Ordering::Release);
        let closed = self.open.swap(false, Ordering::AcqRel);
        if closed {
            self.gauge.set(0);
        }
        closed
    }
}

impl Drop for Breaker {
    /// A store replaced (a reload without `[redis]`, or with another Redis) leaves no
    /// open breaker behind in the metrics.
    fn drop(&mut self) {
        if self.is_open() {
            self.gauge.set(0);
        }
    }
}

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
    breaker: Breaker,
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
        breaker_open.set(0);
        let store = Arc::new(ResilientRedis {
            redis: RedisStore::start(target, timeout)?,
            breaker: Breaker {
                failures: AtomicU32::new(0),
                open: AtomicBool::new(false),
                gauge: breaker_open,
            },
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
    /// write (full under `noeviction`, a read-only replica). On a cluster, whose nodes
    /// fail one by one while the breaker is one for all, a `PING`: the heartbeat's key
    /// lives on one node, whose loss would keep the breaker open for every key.
    async fn probe(&self) -> Result<(), StoreError> {
        if self.redis.is_cluster() {
            self.redis.ping().await
        } else {
            self.announce().await
        }
    }

    /// Live gateway instances sharing this Redis, as last seen (at least 1).
    pub(crate) fn instances(&self) -> u64 {
        self.instances.load(Ordering::Relaxed).max(1)
    }

    /// Decides in Redis, unless the breaker is open.
    pub(crate) async fn decide(&self, checks: &[LimitCheck]) -> Result<Decisions, StoreError> {
        let decided = self.through_breaker(self.redis.decide(checks)).await;
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

    /// Feeds the breaker with a failure (of an operation, or of a probe).
    fn breaker_failure(&self, error: &StoreError) {
        if self.breaker.failure() {
            tracing::warn!(
                redis = %self.address, %error,
                "redis is failing; deciding by on_error until it answers again"
            );
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
        self.through_breaker(self.redis.peek(algorithm, key, lock)).await
    }

    /// Starts lock-out `key` for `ttl` µs in Redis, unless it runs or the breaker is open.
    pub(crate) async fn lock(&self, key: &str, ttl: u64) -> Result<(), StoreError> {
        self.through_breaker(self.redis.lock(key, ttl)).await
    }

    /// Runs `call` unless the breaker is open, and feeds the breaker with what became of
    /// it: the one guard every operation on Redis goes through.
    async fn through_breaker<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        if self.breaker.is_open() {
            return Err(StoreError::BreakerOpen);
        }
        let result = call.await;
        match &result {
            Ok(_) => self.breaker.success(),
            Err(error) => self.breaker_failure(error),
        }
        result
    }

    /// Gives back what an admitted request consumed from `check`, unless the breaker is
    /// open.
    pub(crate) async fn refund(&self, check: &LimitCheck) -> Result<(), StoreError> {
        self.through_breaker(self.redis.refund(check)).await
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
            .through_breaker(async {
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
                let released = store.through_breaker(store.redis.release(&key, &id)).await;
                if let Err(error) = released {
                    store.failed(Operation::Release, &error);
                }
            });
        }
    }

    /// Reads how many concurrency slots of `key` are taken, unless the breaker is open.
    pub(crate) async fn leases(&self, key: &str) -> Result<u64, StoreError> {
        self.through_breaker(self.redis.leases(key)).await
    }

    /// Resets `key` and lifts its lock-out, unless the breaker is open.
    pub(crate) async fn clear(&self, key: &str, lock: Option<&str>) -> Result<(), StoreError> {
        self.through_breaker(self.redis.clear(key, lock)).await
    }

    fn lock_leases(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Duration)>> {
        self.leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether decisions can currently go to Redis.
    pub(crate) fn usable(&self) -> bool {
        self.redis.connected() && !self.breaker.is_open()
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
        if store.breaker.is_open() {
            if store.redis.recover().await.is_ok() && store.probe().await.is_ok() && store.breaker.close() {
                tracing::info!(redis = %store.address, "redis answers again; deciding in redis");
            }
        } else if !store.answered.swap(false, Ordering::Relaxed) {
            match store.probe().await {
                Ok(()) => store.breaker.success(),
                Err(error) => store.breaker_failure(&error),
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
        for ((key, lease), ids) in by_key {
            if let Err(error) = live.redis.renew(&key, &ids, lease).await {
                tracing::debug!(%error, key, "concurrency leases could not be renewed");
            }
        }
    }
}

/// Announces this instance and reads the live instance count until the store is dropped.
async fn heartbeat(store: Weak<ResilientRedis>) {
    loop {
        let Some(live) = store.upgrade() else { return };
        let _ = live.announce().await;
        drop(live);
        tokio::time::sleep(HEARTBEAT_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breaker_opens_after_consecutive_failures_only() {
        let breaker = Breaker::default();
        assert!(!breaker.failure());
        breaker.success();
        assert!(!breaker.failure());
        assert!(!breaker.failure());
        assert_eq!(breaker.gauge.get(), 0);
        assert!(breaker.failure(), "the third consecutive failure opens it");
        assert!(breaker.is_open());
        assert_eq!(breaker.gauge.get(), 1);
        assert!(!breaker.failure(), "it opens once");
        assert!(breaker.close());
        assert!(!breaker.is_open());
        assert_eq!(breaker.gauge.get(), 0);
        // A store dropped with its breaker open leaves none open in the metrics.
        let gauge = breaker.gauge.clone();
        for _ in 0..FAILURES_TO_OPEN {
            breaker.failure();
        }
        assert_eq!(gauge.get(), 1);
        drop(breaker);
        assert_eq!(gauge.get(), 0);
    }

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
