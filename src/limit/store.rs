//! The store a gateway decides with: in-process, or Redis when `[redis]` is configured.

use std::sync::Arc;

use super::clock::MonotonicClock;
use super::memory::MemoryStore;
use super::redis::StoreError;
use super::resilient::ResilientRedis;
use super::{Decisions, LimitCheck};
use crate::config::RedisConfig;
use crate::metrics::Metrics;

/// Keys the in-process store keeps at most (about 150 bytes each).
pub const MEMORY_STORE_MAX_KEYS: usize = 200_000;

/// One of the two stores, chosen by the configuration.
#[derive(Clone)]
pub enum LimitStore {
    Memory(Arc<MemoryStore>),
    Redis(Arc<ResilientRedis>),
}

impl LimitStore {
    /// The store for `redis` (`None`: in-process), counting in `metrics`. Must run inside
    /// the runtime.
    pub fn from_config(redis: Option<&RedisConfig>, metrics: &Metrics) -> Result<Self, StoreError> {
        Ok(match redis {
            None => LimitStore::Memory(Arc::new(MemoryStore::new(
                Arc::new(MonotonicClock::default()),
                MEMORY_STORE_MAX_KEYS,
                metrics.keys_not_kept("memory"),
            ))),
            Some(redis) => LimitStore::Redis(ResilientRedis::start(redis, metrics.keys_not_kept("local"))?),
        })
    }

    /// The `store` label of the store metrics.
    pub fn label(&self) -> &'static str {
        match self {
            LimitStore::Memory(_) => "memory",
            LimitStore::Redis(_) => "redis",
        }
    }

    pub async fn decide(&self, checks: &[LimitCheck]) -> Result<Decisions, StoreError> {
        match self {
            LimitStore::Memory(store) => Ok(store.decide(checks)),
            LimitStore::Redis(store) => store.decide(checks).await,
        }
    }

    /// The `on_error = "local"` fallback: the in-process store with each limit divided by
    /// the live instance count (the in-process store itself never fails).
    pub fn decide_locally(&self, checks: &[LimitCheck]) -> Decisions {
        match self {
            LimitStore::Memory(store) => store.decide(checks),
            LimitStore::Redis(store) => store.decide_locally(checks),
        }
    }

    /// Waits until the store can decide, at most `limit` (so that the first requests after
    /// a start are decided by Redis when it is there; past `limit`, `on_error` applies
    /// until it connects).
    pub async fn wait_ready(&self, limit: std::time::Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while !self.usable() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
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
