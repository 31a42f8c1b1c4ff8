//! The store a gateway decides with, and what a request holds of it. Without `[redis]`
//! the in-process store decides; with it Redis does, and under `on_error = "local"` the
//! in-process store stands in while Redis fails, each limit divided by the live
//! instances. What a failed Redis operation becomes is decided in one place
//! ([`ResilientRedis::failed`]); [`LimitStore`] carries it out the same way for every
//! operation.

use std::borrow::Cow;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use super::clock::MonotonicClock;
use super::memory::{self, MemoryStore};
use super::redis::fallback::{Operation, Recovery, ResilientRedis};
use super::redis::{RedisTarget, StoreError};
use super::{Decisions, LimitCheck, Peeked};

/// The metrics a Redis store counts in.
#[derive(Clone, Default)]
pub struct RedisSeries {
    /// What the full in-process store standing in for Redis did not keep.
    pub local_not_kept: Counter,
    /// Operations that failed.
    pub errors: Counter,
    /// 1 while the breaker is open.
    pub breaker_open: Gauge,
}

/// The gateway's store: the in-process store, behind Redis when it is configured.
#[derive(Clone)]
pub struct LimitStore {
    /// Decides without Redis; with Redis, stands in for it under `on_error = "local"`.
    local: Arc<MemoryStore>,
    redis: Option<Arc<ResilientRedis>>,
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

/// The concurrency slots a request holds, given back as they are dropped. Most requests
/// hold none, and the drop of an empty set is inlined where an empty `Vec`'s is a call,
/// made at several steps of every request (docs/performance.md).
#[derive(Default)]
pub struct HeldSlots(ManuallyDrop<Option<Vec<ConcurrencySlot>>>);

impl HeldSlots {
    pub fn push(&mut self, slot: ConcurrencySlot) {
        self.0.get_or_insert_with(Vec::new).push(slot);
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }
}

impl Drop for HeldSlots {
    /// Inlined where the slots are dropped: only a set that holds some calls out (the
    /// field is `ManuallyDrop`, so that no drop of the `None` left follows).
    #[inline]
    fn drop(&mut self) {
        if let Some(slots) = self.0.take() {
            give_back(slots);
        }
    }
}

/// Out of line, so that dropping an empty [`HeldSlots`] is a check.
#[inline(never)]
fn give_back(slots: Vec<ConcurrencySlot>) {
    drop(slots);
}

enum Held {
    /// Not held anywhere: Redis failed and `on_error = "allow"` let the request through.
    Nothing,
    /// In the in-process store's counts (without Redis, or in its stead).
    Counted(Arc<MemoryStore>, String),
    /// A lease in Redis: its key and id.
    Lease(Arc<ResilientRedis>, String, String),
}

impl Drop for ConcurrencySlot {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.0, Held::Nothing) {
            Held::Nothing => {}
            Held::Counted(store, key) => store.in_flight.release(&key),
            Held::Lease(redis, key, id) => redis.release(key, id),
        }
    }
}

/// What an admitted request took from one limit, in the store or the in-process store in
/// Redis's stead, while it may still have to go back: a leaky-bucket request's place until
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
    /// In the store (Redis, or the in-process store without Redis).
    Store(LimitStore),
    /// In the in-process store, in the stead of a failing Redis (`on_error = "local"`).
    Fallback(LimitStore),
    /// Given back, or kept as a failure.
    Settled,
}

impl Unit {
    /// The unit a decision of `store` (or of the in-process store in Redis's stead,
    /// `by_fallback`) under `on_error` took for `check`, leaving `remaining`.
    pub fn taken(
        check: LimitCheck,
        store: &LimitStore,
        on_error: OnError,
        by_fallback: bool,
        remaining: u64,
    ) -> Unit {
        let store = store.clone();
        Unit {
            check,
            taken: if by_fallback {
                Taken::Fallback(store)
            } else {
                Taken::Store(store)
            },
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
            (Taken::Store(store), false) => store.refund(check).await,
            (Taken::Fallback(store), false) => {
                store.refund_locally(check);
                Ok(())
            }
            (_, true) if !self.last => Ok(()),
            (Taken::Store(store), true) => store.lock(check, self.on_error).await,
            (Taken::Fallback(store), true) => {
                store.lock_locally(check);
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
            // Not dropped if the task never runs: a runtime that is shutting down drops
            // what is spawned on it at once, and the unit's drop would spawn again.
            let unit = std::mem::ManuallyDrop::new(unit);
            runtime.spawn(async move { std::mem::ManuallyDrop::into_inner(unit).settle(false).await });
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

/// What became of one operation.
enum Done<T> {
    /// The store did it: Redis, or the in-process store without Redis.
    ByStore(T),
    /// The in-process store did it in the stead of a failing Redis.
    ByFallback(T),
    /// Redis failed, and this is what the failure became (not [`Recovery::Local`]).
    Failed(Recovery, StoreError),
}

impl<T> Done<T> {
    /// The operation's result, for those whose failure leaves only the error.
    fn result(self) -> Result<T, StoreError> {
        match self {
            Done::ByStore(done) | Done::ByFallback(done) => Ok(done),
            Done::Failed(_, error) => Err(error),
        }
    }
}

/// Does an operation of a [`LimitStore`]: in Redis when it is configured (`$in_redis`, with
/// `$redis` bound to it, awaited), else in the in-process store (`$locally`, with `$local`
/// bound to it). A failure in Redis becomes what [`ResilientRedis::failed`] makes of it:
/// under [`Recovery::Local`], `$locally`, the in-process store in Redis's stead. A macro
/// rather than an async fn: the Redis call is awaited in the operation's own future, and
/// the in-process store's path (every request's, without Redis) makes no future at all.
macro_rules! run {
    ($store:expr, $operation:expr, $redis:ident => $in_redis:expr, $local:ident => $locally:expr $(,)?) => {{
        let store: &LimitStore = $store;
        let locally = |$local: &Arc<MemoryStore>| $locally;
        match &store.redis {
            None => Done::ByStore(locally(&store.local)),
            Some($redis) => match Box::pin($in_redis).await {
                Ok(done) => Done::ByStore(done),
                Err(error) => match $redis.failed($operation, &error) {
                    Recovery::Local => Done::ByFallback(locally(&store.local)),
                    recovery => Done::Failed(recovery, error),
                },
            },
        }
    }};
}

impl LimitStore {
    /// The in-process store; `not_kept` counts the new keys a full store did not keep.
    pub fn memory(not_kept: Counter) -> Self {
        LimitStore {
            local: in_process(not_kept),
            redis: None,
        }
    }

    /// The Redis store at `target`, each decision within `timeout`, its heartbeat under
    /// `prefix`, counting in `series`. Must run inside the runtime (it connects in the
    /// background).
    pub fn redis(
        target: &RedisTarget,
        timeout: Duration,
        prefix: &str,
        series: RedisSeries,
    ) -> Result<Self, StoreError> {
        Ok(LimitStore {
            local: in_process(series.local_not_kept),
            redis: Some(ResilientRedis::start(
                target,
                timeout,
                prefix,
                series.errors,
                series.breaker_open,
            )?),
        })
    }

    /// Whether decisions are made in Redis (shared by the instances).
    pub fn in_redis(&self) -> bool {
        self.redis.is_some()
    }

    /// The `store` label of the store metrics.
    pub fn label(&self) -> &'static str {
        if self.in_redis() { "redis" } else { "memory" }
    }

    /// Live gateway instances sharing the store's limits (1 for the in-process store).
    pub fn instances(&self) -> u64 {
        self.redis.as_ref().map_or(1, |redis| redis.instances())
    }

    /// Whether a gateway deciding with this store under `on_error` is ready for traffic:
    /// under `deny` a failing store refuses every limited request; under `allow` and
    /// `local` the gateway still serves.
    pub fn ready(&self, on_error: OnError) -> bool {
        on_error != OnError::Deny || self.usable()
    }

    /// Waits until the store can decide, at most `limit` (so that the first requests after
    /// a start are decided by Redis when it is there; past `limit`, `on_error` applies
    /// until it connects). Returns whether it can.
    pub async fn wait_ready(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        while !self.usable() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.usable()
    }

    /// Whether decisions can currently be made by this store (not failing over).
    fn usable(&self) -> bool {
        self.redis.as_ref().is_none_or(|redis| redis.usable())
    }

    /// Decides `checks`, all or nothing; when the store fails, `on_error` decides.
    pub async fn decide(&self, checks: &[LimitCheck], on_error: OnError) -> StoreAnswer {
        let done = run!(
            self,
            Operation::Decide(on_error),
            redis => redis.decide(checks),
            local => local.decide(&self.local_checks(checks)),
        );
        match done {
            Done::ByStore(decisions) => StoreAnswer::Decided(decisions),
            Done::ByFallback(decisions) => StoreAnswer::Failed(Fallback::Local(decisions)),
            Done::Failed(Recovery::Admit, _) => StoreAnswer::Failed(Fallback::Admit),
            Done::Failed(..) => StoreAnswer::Failed(Fallback::Refuse),
        }
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
        let done = run!(
            self,
            Operation::Acquire(on_error),
            redis => async {
                let id = redis.acquire(key, limit, lease).await?;
                Ok(id.map(|id| ConcurrencySlot(Held::Lease(redis.clone(), key.to_owned(), id))))
            },
            local => {
                let limit = self.redis.as_ref().map_or(limit, |redis| redis.slots_share(limit));
                local
                    .in_flight
                    .acquire(key, limit)
                    .then(|| ConcurrencySlot(Held::Counted(local.clone(), key.to_owned())))
            },
        );
        match done {
            Done::ByStore(slot) | Done::ByFallback(slot) => Ok(slot),
            Done::Failed(Recovery::Admit, _) => Ok(Some(ConcurrencySlot(Held::Nothing))),
            Done::Failed(..) => Err(()),
        }
    }

    /// Gives back what an admitted request consumed from `check`.
    pub async fn refund(&self, check: &LimitCheck) -> Result<(), StoreError> {
        run!(
            self,
            Operation::Refund,
            redis => redis.refund(check),
            _local => self.refund_locally(check),
        )
        .result()
    }

    /// Starts `check`'s lock-out (its key exhausted by a counted failure), unless it runs;
    /// with Redis failing, in the in-process store under `on_error = "local"`.
    pub async fn lock(&self, check: &LimitCheck, on_error: OnError) -> Result<(), StoreError> {
        let Some(lockout) = &check.lockout else {
            return Ok(());
        };
        run!(
            self,
            Operation::Lock(on_error),
            redis => redis.lock(&lockout.key, lockout.micros),
            _local => self.lock_locally(check),
        )
        .result()
    }

    /// `check`'s key as stored, changing nothing.
    pub async fn peek(&self, check: &LimitCheck) -> Result<Peeked, StoreError> {
        let lock = check.lockout.as_ref().map(|lockout| lockout.key.as_str());
        run!(
            self,
            Operation::Peek,
            redis => redis.peek(&check.algorithm, &check.key, lock),
            local => local.peek(&check.key, lock),
        )
        .result()
    }

    /// Concurrency slots of `key` taken now.
    pub async fn in_flight(&self, key: &str) -> Result<u64, StoreError> {
        run!(
            self,
            Operation::Count,
            redis => redis.leases(key),
            local => local.in_flight.count(key),
        )
        .result()
    }

    /// Resets `check`'s key and lifts its lock-out (in Redis, for every instance).
    pub async fn clear(&self, check: &LimitCheck) -> Result<(), StoreError> {
        let lock = check.lockout.as_ref().map(|lockout| lockout.key.as_str());
        run!(
            self,
            Operation::Clear,
            redis => redis.clear(&check.key, lock),
            local => local.clear(&check.key, lock),
        )
        .result()
    }

    /// `checks` as the in-process store decides them: as they are without Redis; in its
    /// stead, each limit's share for one of the live instances.
    #[inline]
    fn local_checks<'c>(&self, checks: &'c [LimitCheck]) -> Cow<'c, [LimitCheck]> {
        match &self.redis {
            None => Cow::Borrowed(checks),
            Some(redis) => Cow::Owned(checks.iter().map(|check| redis.share(check)).collect()),
        }
    }

    /// Gives back, in the in-process store, what it took for `check`.
    fn refund_locally(&self, check: &LimitCheck) {
        self.local
            .refund(&self.local_checks(std::slice::from_ref(check))[0]);
    }

    /// Starts `check`'s lock-out in the in-process store, unless it runs.
    fn lock_locally(&self, check: &LimitCheck) {
        if let Some(lockout) = &check.lockout {
            self.local.lock(&lockout.key, lockout.micros);
        }
    }
}

/// An in-process store on the monotonic clock, of the gateway's size.
fn in_process(not_kept: Counter) -> Arc<MemoryStore> {
    Arc::new(MemoryStore::new(
        Arc::new(MonotonicClock::default()),
        memory::MAX_KEYS,
        not_kept,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn held_slots_go_back_when_dropped_and_none_held_is_empty() {
        let store = LimitStore::memory(Counter::default());
        let take = || store.acquire("room", 2, Duration::from_secs(60), OnError::Deny);
        let mut held = HeldSlots::default();
        assert!(held.is_empty());
        held.push(take().await.unwrap().expect("a first slot"));
        held.push(take().await.unwrap().expect("a second slot"));
        assert!(!held.is_empty());
        assert!(take().await.unwrap().is_none(), "both slots held");
        drop(held);
        let again = take().await.unwrap();
        assert!(again.is_some(), "the slots were given back");
        assert!(take().await.unwrap().is_some());
    }
}
