//! The store a gateway decides with (in-process, or Redis when `[redis]` is configured),
//! and the one place that decides what a store failure means for a request (`on_error`).

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;

use super::clock::MonotonicClock;
use super::memory::{self, MemoryStore};
use super::redis::fallback::ResilientRedis;
use super::redis::{RedisTarget, StoreError};
use super::{Decisions, LimitCheck, Peeked};

/// One of the two stores, chosen by the configuration.
#[derive(Clone)]
pub enum LimitStore {
    Memory(Arc<MemoryStore>),
    Redis(Arc<ResilientRedis>),
}

/// What a request gets when the store fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    /// Forward the request (fail open).
    Allow,
    /// Answer 503.
    Deny,
    /// Decide in the in-process store, each limit divided by the live instance count.
    Local,
}

/// A concurrency slot held by a request: given back when dropped (its response done, its
/// client gone, or the request refused by another limit).
pub struct Slot(Held);

enum Held {
    /// Not held anywhere: Redis failed and `on_error = "allow"` let the request through.
    Nothing,
    Counted(Arc<MemoryStore>, String),
    /// In the local fallback's counts (Redis failed, `on_error = "local"`).
    Fallback(Arc<ResilientRedis>, String),
    Lease(Arc<ResilientRedis>, String, String),
}

impl Drop for Slot {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.0, Held::Nothing) {
            Held::Nothing => {}
            Held::Counted(store, key) => store.in_flight.release(&key),
            Held::Fallback(store, key) => store.local_in_flight().0.release(&key),
            Held::Lease(store, key, id) => store.release(key, id),
        }
    }
}

/// The unit a failure-counting limit took for one attempt before it was forwarded
/// (docs/configuration.md#limitsnamecount): kept when the answer is a failure, which
/// starts the lock-out when the unit was the last of the room; given back when it is not,
/// or when the attempt ends unanswered (dropped).
pub struct Attempt {
    check: LimitCheck,
    taken: Taken,
    /// The unit was the last of the key's room.
    last: bool,
}

/// Where an attempt's unit was taken.
enum Taken {
    Store(LimitStore),
    /// In the in-process fallback of a failing Redis (`on_error = "local"`).
    Fallback(Arc<ResilientRedis>),
    /// Given back, or kept as a failure.
    Settled,
}

impl Attempt {
    /// The unit a decision of `store` (or of its in-process fallback, `by_fallback`) took
    /// for `check`, leaving `remaining`.
    pub fn taken(check: LimitCheck, store: &LimitStore, by_fallback: bool, remaining: u64) -> Attempt {
        let taken = match store {
            LimitStore::Redis(redis) if by_fallback => Taken::Fallback(redis.clone()),
            _ => Taken::Store(store.clone()),
        };
        Attempt {
            check,
            taken,
            last: remaining == 0,
        }
    }

    /// Settles the attempt on its answer: a failure keeps the unit (and starts the
    /// lock-out when it was the last of the room), anything else gives it back.
    pub async fn settle(mut self, failure: bool) {
        let taken = std::mem::replace(&mut self.taken, Taken::Settled);
        let check = &self.check;
        let result = match (taken, failure) {
            (Taken::Settled, _) => Ok(()),
            (Taken::Store(store), false) => store.refund(check).await,
            (Taken::Fallback(redis), false) => {
                redis.refund_locally(check);
                Ok(())
            }
            (_, true) if !self.last => Ok(()),
            (Taken::Store(store), true) => store.lock(check).await,
            (Taken::Fallback(redis), true) => {
                if let Some(lockout) = &check.lockout {
                    redis.lock_locally(&lockout.key, lockout.micros);
                }
                Ok(())
            }
        };
        if let Err(error) = result {
            let what = if failure {
                "a lock-out could not be started"
            } else {
                "an attempt's unit could not be given back"
            };
            tracing::warn!(%error, key = %check.key, "{what}");
        }
    }
}

impl Drop for Attempt {
    /// An attempt dropped unsettled (its client left before an answer, or floodgate
    /// answered itself) gives its unit back, in the background.
    fn drop(&mut self) {
        if matches!(self.taken, Taken::Settled) {
            return;
        }
        let attempt = Attempt {
            check: self.check.clone(),
            taken: std::mem::replace(&mut self.taken, Taken::Settled),
            last: self.last,
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(attempt.settle(false));
        }
    }
}

/// The store's answer for one request, with `on_error` applied.
#[derive(Debug)]
pub enum Answer {
    /// The store decided.
    Decided(Decisions),
    /// The store failed with `error`; `fallback` is what `on_error` makes of that.
    Failed { error: StoreError, fallback: Fallback },
}

/// What `on_error` makes of a failed decision.
#[derive(Debug)]
pub enum Fallback {
    /// `local`: the in-process fallback decided.
    Local(Decisions),
    /// `allow`: the request passes, unlimited.
    Admit,
    /// `deny`: the request is refused with 503.
    Refuse,
}

impl LimitStore {
    /// The in-process store; `not_kept` counts the new keys a full store did not keep.
    pub fn memory(not_kept: Counter) -> Self {
        LimitStore::Memory(Arc::new(MemoryStore::new(
            Arc::new(MonotonicClock::default()),
            memory::MAX_KEYS,
            not_kept,
        )))
    }

    /// The Redis store at `target`, each decision within `timeout`, its heartbeat under
    /// `prefix`; `local_not_kept` counts what the full local fallback did not keep. Must
    /// run inside the runtime (it connects in the background).
    pub fn redis(
        target: &RedisTarget,
        timeout: Duration,
        prefix: &str,
        local_not_kept: Counter,
    ) -> Result<Self, StoreError> {
        Ok(LimitStore::Redis(ResilientRedis::start(
            target,
            timeout,
            prefix,
            local_not_kept,
        )?))
    }

    /// `check`'s key as stored, changing nothing.
    pub async fn peek(&self, check: &LimitCheck) -> Result<Peeked, StoreError> {
        let lock = check.lockout.as_ref().map(|lockout| lockout.key.as_str());
        match self {
            LimitStore::Memory(store) => Ok(store.peek(&check.key, lock)),
            LimitStore::Redis(store) => store.peek(&check.algorithm, &check.key, lock).await,
        }
    }

    /// Starts `check`'s lock-out (its key exhausted by a counted failure), unless it runs.
    pub async fn lock(&self, check: &LimitCheck) -> Result<(), StoreError> {
        let Some(lockout) = &check.lockout else {
            return Ok(());
        };
        match self {
            LimitStore::Memory(store) => {
                store.lock(&lockout.key, lockout.micros);
                Ok(())
            }
            LimitStore::Redis(store) => store.lock(&lockout.key, lockout.micros).await,
        }
    }

    /// Resets `check`'s key and lifts its lock-out (in Redis, for every instance).
    pub async fn clear(&self, check: &LimitCheck) -> Result<(), StoreError> {
        let lock = check.lockout.as_ref().map(|lockout| lockout.key.as_str());
        match self {
            LimitStore::Memory(store) => {
                store.clear(&check.key, lock);
                Ok(())
            }
            LimitStore::Redis(store) => store.redis().clear(&check.key, lock).await,
        }
    }

    /// Live gateway instances sharing the store's limits (1 for the in-process store).
    pub fn instances(&self) -> u64 {
        match self {
            LimitStore::Memory(_) => 1,
            LimitStore::Redis(store) => store.instances(),
        }
    }

    /// The `store` label of the store metrics.
    pub fn label(&self) -> &'static str {
        match self {
            LimitStore::Memory(_) => "memory",
            LimitStore::Redis(_) => "redis",
        }
    }

    /// Decides `checks`, all or nothing; when the store fails, `on_error` decides.
    pub async fn decide(&self, checks: &[LimitCheck], on_error: OnError) -> Answer {
        let error = match self {
            LimitStore::Memory(store) => return Answer::Decided(store.decide(checks)),
            LimitStore::Redis(store) => match store.decide(checks).await {
                Ok(decisions) => return Answer::Decided(decisions),
                Err(error) => error,
            },
        };
        let fallback = match (on_error, self) {
            (OnError::Allow, _) => Fallback::Admit,
            (OnError::Deny, _) => Fallback::Refuse,
            (OnError::Local, LimitStore::Redis(store)) => Fallback::Local(store.decide_locally(checks)),
            (OnError::Local, LimitStore::Memory(store)) => Fallback::Local(store.decide(checks)),
        };
        Answer::Failed { error, fallback }
    }

    /// Takes one of `limit` slots of `key` for a request, a lease of `lease` in Redis:
    /// `Ok(None)` when every slot is taken; when the store fails, `on_error` decides
    /// (`Err(())`: refuse with 503).
    pub async fn acquire(
        &self,
        key: &str,
        limit: u64,
        lease: Duration,
        on_error: OnError,
    ) -> Result<Option<Slot>, ()> {
        let store = match self {
            LimitStore::Memory(store) => {
                return Ok(store
                    .in_flight
                    .acquire(key, limit)
                    .then(|| Slot(Held::Counted(store.clone(), key.to_owned()))));
            }
            LimitStore::Redis(store) => store,
        };
        match store.acquire(key, limit, lease).await {
            Ok(lease) => Ok(lease.map(|id| Slot(Held::Lease(store.clone(), key.to_owned(), id)))),
            Err(error) => {
                tracing::debug!(%error, key, "rate-limit store failed taking a concurrency slot");
                match on_error {
                    OnError::Allow => Ok(Some(Slot(Held::Nothing))),
                    OnError::Deny => Err(()),
                    OnError::Local => {
                        let (counts, instances) = store.local_in_flight();
                        let share = limit.div_ceil(instances).max(1);
                        Ok(counts
                            .acquire(key, share)
                            .then(|| Slot(Held::Fallback(store.clone(), key.to_owned()))))
                    }
                }
            }
        }
    }

    /// Concurrency slots of `key` taken now.
    pub async fn in_flight(&self, key: &str) -> Result<u64, StoreError> {
        match self {
            LimitStore::Memory(store) => Ok(store.in_flight.count(key)),
            LimitStore::Redis(store) => store.redis().leases(key).await,
        }
    }

    /// Whether a gateway deciding with this store under `on_error` is ready for traffic:
    /// under `deny` a failing store refuses every limited request; under `allow` and
    /// `local` the gateway still serves.
    pub fn ready(&self, on_error: OnError) -> bool {
        on_error != OnError::Deny || self.usable()
    }

    /// Waits until the store can decide, at most `limit` (so that the first requests after
    /// a start are decided by Redis when it is there; past `limit`, `on_error` applies
    /// until it connects).
    pub async fn wait_ready(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while !self.usable() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Whether decisions can currently be made by this store (not failing over).
    pub fn usable(&self) -> bool {
        match self {
            LimitStore::Memory(_) => true,
            LimitStore::Redis(store) => store.usable(),
        }
    }

    pub async fn refund(&self, check: &LimitCheck) -> Result<(), StoreError> {
        match self {
            LimitStore::Memory(store) => {
                store.refund(check);
                Ok(())
            }
            LimitStore::Redis(store) => store.refund(check).await,
        }
    }
}
