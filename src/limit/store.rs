//! The store a gateway decides with (in-process, or Redis when `[redis]` is configured),
//! and the one place that decides what a store failure means for a request (`on_error`).

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;

use super::clock::MonotonicClock;
use super::memory::{self, MemoryStore};
use super::redis::fallback::{Operation, Recovery, ResilientRedis};
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
pub struct ConcurrencySlot(Held);

enum Held {
    /// Not held anywhere: Redis failed and `on_error = "allow"` let the request through.
    Nothing,
    Counted(Arc<MemoryStore>, String),
    /// In the local fallback's counts (Redis failed, `on_error = "local"`).
    Fallback(Arc<ResilientRedis>, String),
    /// A lease in Redis: its store, key and id, and the `on_error` it was taken under.
    Lease(Arc<ResilientRedis>, String, String, OnError),
}

impl Drop for ConcurrencySlot {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.0, Held::Nothing) {
            Held::Nothing => {}
            Held::Counted(store, key) => store.in_flight.release(&key),
            Held::Fallback(store, key) => store.local_in_flight().0.release(&key),
            Held::Lease(store, key, id, on_error) => store.release(key, id, on_error),
        }
    }
}

/// What an admitted request took from one limit, in the store or the in-process fallback
/// that decided, while it may still have to go back: a leaky-bucket request's place until
/// its turn ([`Unit::keep`]), a failure-counting attempt's unit until its answer
/// ([`Unit::settle`], docs/configuration.md#limitsnamecount). Dropped before either, it
/// goes back (in the background): the client left, or floodgate answered itself.
pub struct Unit {
    check: LimitCheck,
    taken: Taken,
    /// The unit was the last of the key's room.
    last: bool,
    on_error: OnError,
}

/// Where a unit was taken.
enum Taken {
    Store(LimitStore),
    /// In the in-process fallback of a failing Redis (`on_error = "local"`).
    Fallback(Arc<ResilientRedis>),
    /// Given back, or kept as a failure.
    Settled,
}

impl Unit {
    /// The unit a decision of `store` (or of its in-process fallback, `by_fallback`) under
    /// `on_error` took for `check`, leaving `remaining`.
    pub fn taken(
        check: LimitCheck,
        store: &LimitStore,
        on_error: OnError,
        by_fallback: bool,
        remaining: u64,
    ) -> Unit {
        let taken = match store {
            LimitStore::Redis(redis) if by_fallback => Taken::Fallback(redis.clone()),
            _ => Taken::Store(store.clone()),
        };
        Unit {
            check,
            taken,
            last: remaining == 0,
            on_error,
        }
    }

    /// The request keeps what it took (a held request's turn came).
    pub fn keep(mut self) {
        self.taken = Taken::Settled;
    }

    /// Settles a failure-counting attempt on its answer: a failure keeps the unit (and
    /// starts the lock-out when it was the last of the room), anything else gives it back.
    pub async fn settle(mut self, failure: bool) {
        let taken = std::mem::replace(&mut self.taken, Taken::Settled);
        let check = &self.check;
        let result = match (taken, failure) {
            (Taken::Settled, _) => Ok(()),
            (Taken::Store(store), false) => store.refund(check, self.on_error).await,
            (Taken::Fallback(redis), false) => {
                redis.refund_locally(check);
                Ok(())
            }
            (_, true) if !self.last => Ok(()),
            (Taken::Store(store), true) => store.lock(check, self.on_error).await,
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
                "what a request took could not be given back"
            };
            tracing::warn!(%error, key = %check.key, "{what}");
        }
    }
}

impl Drop for Unit {
    fn drop(&mut self) {
        if matches!(self.taken, Taken::Settled) {
            return;
        }
        let unit = Unit {
            check: self.check.clone(),
            taken: std::mem::replace(&mut self.taken, Taken::Settled),
            last: self.last,
            on_error: self.on_error,
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(unit.settle(false));
        }
    }
}

/// The store's answer for one request, with `on_error` applied.
#[derive(Debug)]
pub enum StoreAnswer {
    /// The store decided.
    Decided(Decisions),
    /// The store failed (counted and logged by it): what `on_error` makes of that.
    Failed(Fallback),
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
    /// `prefix`; `local_not_kept` counts what the full local fallback did not keep, and
    /// `errors` the operations that failed. Must run inside the runtime (it connects in
    /// the background).
    pub fn redis(
        target: &RedisTarget,
        timeout: Duration,
        prefix: &str,
        local_not_kept: Counter,
        errors: Counter,
    ) -> Result<Self, StoreError> {
        Ok(LimitStore::Redis(ResilientRedis::start(
            target,
            timeout,
            prefix,
            local_not_kept,
            errors,
        )?))
    }

    /// `check`'s key as stored, changing nothing.
    pub async fn peek(&self, check: &LimitCheck, on_error: OnError) -> Result<Peeked, StoreError> {
        let lock = check.lockout.as_ref().map(|lockout| lockout.key.as_str());
        match self {
            LimitStore::Memory(store) => Ok(store.peek(&check.key, lock)),
            LimitStore::Redis(store) => {
                let peeked = store.peek(&check.algorithm, &check.key, lock).await;
                lost_on_failure(store, Operation::Peek, peeked, on_error)
            }
        }
    }

    /// Starts `check`'s lock-out (its key exhausted by a counted failure), unless it runs;
    /// with Redis failing, in the in-process fallback under `on_error = "local"`.
    pub async fn lock(&self, check: &LimitCheck, on_error: OnError) -> Result<(), StoreError> {
        let Some(lockout) = &check.lockout else {
            return Ok(());
        };
        match self {
            LimitStore::Memory(store) => {
                store.lock(&lockout.key, lockout.micros);
                Ok(())
            }
            LimitStore::Redis(store) => match store.lock(&lockout.key, lockout.micros).await {
                Ok(()) => Ok(()),
                Err(error) => match store.failed(Operation::Lock, &error, on_error) {
                    Recovery::Local => {
                        store.lock_locally(&lockout.key, lockout.micros);
                        Ok(())
                    }
                    Recovery::Admit | Recovery::Refuse | Recovery::Lost => Err(error),
                },
            },
        }
    }

    /// Resets `check`'s key and lifts its lock-out (in Redis, for every instance).
    pub async fn clear(&self, check: &LimitCheck, on_error: OnError) -> Result<(), StoreError> {
        let lock = check.lockout.as_ref().map(|lockout| lockout.key.as_str());
        match self {
            LimitStore::Memory(store) => {
                store.clear(&check.key, lock);
                Ok(())
            }
            LimitStore::Redis(store) => {
                let cleared = store.clear(&check.key, lock).await;
                lost_on_failure(store, Operation::Clear, cleared, on_error)
            }
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
    pub async fn decide(&self, checks: &[LimitCheck], on_error: OnError) -> StoreAnswer {
        let store = match self {
            LimitStore::Memory(store) => return StoreAnswer::Decided(store.decide(checks)),
            LimitStore::Redis(store) => store,
        };
        let error = match store.decide(checks).await {
            Ok(decisions) => return StoreAnswer::Decided(decisions),
            Err(error) => error,
        };
        let fallback = match store.failed(Operation::Decide, &error, on_error) {
            Recovery::Local => Fallback::Local(store.decide_locally(checks)),
            Recovery::Admit => Fallback::Admit,
            Recovery::Refuse | Recovery::Lost => Fallback::Refuse,
        };
        StoreAnswer::Failed(fallback)
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
    ) -> Result<Option<ConcurrencySlot>, ()> {
        let store = match self {
            LimitStore::Memory(store) => {
                return Ok(store
                    .in_flight
                    .acquire(key, limit)
                    .then(|| ConcurrencySlot(Held::Counted(store.clone(), key.to_owned()))));
            }
            LimitStore::Redis(store) => store,
        };
        match store.acquire(key, limit, lease).await {
            Ok(lease) => {
                Ok(lease.map(|id| ConcurrencySlot(Held::Lease(store.clone(), key.to_owned(), id, on_error))))
            }
            Err(error) => match store.failed(Operation::Acquire, &error, on_error) {
                Recovery::Admit => Ok(Some(ConcurrencySlot(Held::Nothing))),
                Recovery::Refuse | Recovery::Lost => Err(()),
                Recovery::Local => {
                    let (counts, instances) = store.local_in_flight();
                    let share = limit.div_ceil(instances).max(1);
                    Ok(counts
                        .acquire(key, share)
                        .then(|| ConcurrencySlot(Held::Fallback(store.clone(), key.to_owned()))))
                }
            },
        }
    }

    /// Concurrency slots of `key` taken now.
    pub async fn in_flight(&self, key: &str, on_error: OnError) -> Result<u64, StoreError> {
        match self {
            LimitStore::Memory(store) => Ok(store.in_flight.count(key)),
            LimitStore::Redis(store) => {
                let counted = store.leases(key).await;
                lost_on_failure(store, Operation::Count, counted, on_error)
            }
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

    /// Gives back what an admitted request consumed from `check`.
    pub async fn refund(&self, check: &LimitCheck, on_error: OnError) -> Result<(), StoreError> {
        match self {
            LimitStore::Memory(store) => {
                store.refund(check);
                Ok(())
            }
            LimitStore::Redis(store) => {
                let refunded = store.refund(check).await;
                lost_on_failure(store, Operation::Refund, refunded, on_error)
            }
        }
    }
}

/// `result` of an operation that nothing stands in for when it fails
/// ([`ResilientRedis::failed`] says so for each).
fn lost_on_failure<T>(
    store: &ResilientRedis,
    operation: Operation,
    result: Result<T, StoreError>,
    on_error: OnError,
) -> Result<T, StoreError> {
    result.inspect_err(|error| {
        let recovery = store.failed(operation, error, on_error);
        debug_assert_eq!(recovery, Recovery::Lost, "{operation:?} has a fallback");
    })
}
