//! The Redis store: every decision is one `EVALSHA` of `scripts/decide.lua` (loaded on
//! `NOSCRIPT` transparently by `redis::Script`), over one multiplexed, self-reconnecting
//! connection shared by all requests, with a hard per-decision deadline.
//!
//! The connection is made in the background: the gateway starts, and serves under its
//! failure policy, whether or not Redis is up. The script takes a batch of requests and
//! decides each atomically and all-or-nothing, with Redis `TIME` as the only clock; today
//! one call carries one request.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{Client, Script};

use super::{Algorithm, LimitCheck, LimitDecision, Outcome};
use crate::config::RedisTarget;

const DECIDE_LUA: &str = include_str!("scripts/decide.lua");
const REFUND_LUA: &str = include_str!("scripts/refund.lua");
const HEARTBEAT_LUA: &str = include_str!("scripts/heartbeat.lua");
/// Values the script returns per check.
const FIELDS_PER_CHECK: usize = 5;
/// Longest pause between two connection attempts.
const MAX_RECONNECT_BACKOFF: Duration = Duration::from_secs(1);
/// At most one "cannot connect" log line per this period.
const CONNECT_LOG_EVERY: Duration = Duration::from_secs(30);

/// Why the store could not decide.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("not connected to redis yet")]
    NotConnected,
    #[error("redis is failing; not asked during the breaker's cool-down")]
    BreakerOpen,
    #[error("redis answered {got} values for {checks} checks")]
    Malformed { got: usize, checks: usize },
}

/// Where connections come from: one address, or the master that sentinels point at.
enum Source {
    Direct(Client),
    Sentinel(tokio::sync::Mutex<SentinelClient>),
}

impl Source {
    fn new(target: &RedisTarget) -> Result<Self, StoreError> {
        Ok(match target {
            RedisTarget::Url(url) => Source::Direct(Client::open(url.as_str())?),
            RedisTarget::Sentinel {
                sentinels,
                master_name,
            } => Source::Sentinel(tokio::sync::Mutex::new(SentinelClient::build(
                sentinels.iter().map(String::as_str).collect(),
                master_name.as_str(),
                None,
                SentinelServerType::Master,
            )?)),
        })
    }

    /// A client for the current master.
    async fn client(&self) -> Result<Client, StoreError> {
        match self {
            Source::Direct(client) => Ok(client.clone()),
            Source::Sentinel(sentinel) => Ok(sentinel.lock().await.async_get_client().await?),
        }
    }
}

struct Shared {
    connection: ArcSwapOption<ConnectionManager>,
    source: Source,
    manager_config: ConnectionManagerConfig,
    decide: Script,
    refund: Script,
    heartbeat: Script,
    timeout: Duration,
}

/// A rate-limit store in Redis.
#[derive(Clone)]
pub struct RedisStore {
    shared: Arc<Shared>,
}

impl RedisStore {
    /// Starts connecting to `target` in the background; `timeout` bounds each decision.
    /// Fails only for a target that cannot be used at all.
    pub fn start(target: &RedisTarget, timeout: Duration) -> Result<Self, StoreError> {
        let shared = Arc::new(Shared {
            connection: ArcSwapOption::empty(),
            source: Source::new(target)?,
            manager_config: ConnectionManagerConfig::new()
                .set_connection_timeout(Some(timeout.max(Duration::from_millis(250))))
                .set_response_timeout(Some(timeout))
                .set_number_of_retries(1),
            decide: Script::new(DECIDE_LUA),
            refund: Script::new(REFUND_LUA),
            heartbeat: Script::new(HEARTBEAT_LUA),
            timeout,
        });
        tokio::spawn(connect_in_background(target.describe(), Arc::downgrade(&shared)));
        Ok(RedisStore { shared })
    }

    /// Starts with `url` and waits until connected (at least 2 s, or `timeout`).
    pub async fn connect(url: &str, timeout: Duration) -> Result<Self, StoreError> {
        let store = RedisStore::start(&RedisTarget::Url(url.to_owned()), timeout)?;
        let deadline = Instant::now() + timeout.max(Duration::from_secs(2));
        while store.shared.connection.load().is_none() {
            if Instant::now() > deadline {
                return Err(StoreError::NotConnected);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(store)
    }

    fn connection(&self) -> Result<ConnectionManager, StoreError> {
        self.shared
            .connection
            .load()
            .as_deref()
            .cloned()
            .ok_or(StoreError::NotConnected)
    }

    /// Decides all of one request's limits in one round trip.
    pub async fn decide(&self, checks: &[LimitCheck]) -> Result<Vec<LimitDecision>, StoreError> {
        let mut connection = self.connection()?;
        let mut invocation = self.shared.decide.prepare_invoke();
        invocation.arg(1).arg(checks.len());
        for check in checks {
            invocation.key(&check.key);
            let lockout = match &check.lockout {
                Some((lock, micros)) => {
                    invocation.key(lock);
                    *micros
                }
                None => 0,
            };
            match check.algorithm {
                Algorithm::FixedWindow { limit, window } => invocation.arg(1).arg(limit).arg(window).arg(0),
                Algorithm::SlidingWindow { limit, window } => invocation.arg(2).arg(limit).arg(window).arg(0),
                Algorithm::TokenBucket { rate, per, burst } => {
                    invocation.arg(3).arg(rate).arg(per).arg(burst)
                }
                Algorithm::LeakyBucket { rate, per, burst } => {
                    invocation.arg(4).arg(rate).arg(per).arg(burst)
                }
            };
            invocation
                .arg(check.cost)
                .arg(lockout)
                .arg(u8::from(check.shadow));
        }
        let timeout = self.shared.timeout;
        let values: Vec<i64> = tokio::time::timeout(timeout, invocation.invoke_async(&mut connection))
            .await
            .map_err(|_| StoreError::Timeout(timeout))??;
        if values.len() != checks.len() * FIELDS_PER_CHECK {
            return Err(StoreError::Malformed {
                got: values.len(),
                checks: checks.len(),
            });
        }
        Ok(values.chunks_exact(FIELDS_PER_CHECK).map(decision).collect())
    }

    /// Gives back the queue slot of a leaky-bucket request that will not be forwarded.
    pub async fn refund(&self, check: &LimitCheck) -> Result<(), StoreError> {
        let Algorithm::LeakyBucket { rate, per, .. } = check.algorithm else {
            return Ok(());
        };
        let mut connection = self.connection()?;
        let slot = check.cost as f64 * per as f64 / rate;
        let timeout = self.shared.timeout;
        let mut invocation = self.shared.refund.prepare_invoke();
        invocation.key(&check.key).arg(slot);
        tokio::time::timeout(timeout, invocation.invoke_async::<()>(&mut connection))
            .await
            .map_err(|_| StoreError::Timeout(timeout))??;
        Ok(())
    }
}

impl RedisStore {
    /// Whether a connection has been made (it may have failed since).
    pub fn connected(&self) -> bool {
        self.shared.connection.load().is_some()
    }

    /// After failures: checks that Redis answers again. Through sentinels, first asks
    /// them for the current master and connects to it (following a failover).
    pub async fn recover(&self) -> Result<(), StoreError> {
        if let Source::Sentinel(_) = self.shared.source {
            let timeout = self.shared.timeout.max(Duration::from_millis(500));
            let connection = tokio::time::timeout(timeout, async {
                let client = self.shared.source.client().await?;
                let mut connection =
                    ConnectionManager::new_with_config(client, self.shared.manager_config.clone()).await?;
                redis::cmd("PING").query_async::<()>(&mut connection).await?;
                Ok::<_, StoreError>(connection)
            })
            .await
            .map_err(|_| StoreError::Timeout(timeout))??;
            self.shared.connection.store(Some(Arc::new(connection)));
            return Ok(());
        }
        self.ping().await
    }

    /// `PING`, within the decision deadline.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut connection = self.connection()?;
        let timeout = self.shared.timeout;
        tokio::time::timeout(timeout, redis::cmd("PING").query_async::<()>(&mut connection))
            .await
            .map_err(|_| StoreError::Timeout(timeout))??;
        Ok(())
    }

    /// Announces instance `id` in the `key` set for `ttl`; returns the live instance count.
    pub async fn heartbeat(&self, key: &str, id: &str, ttl: Duration) -> Result<u64, StoreError> {
        let mut connection = self.connection()?;
        let timeout = self.shared.timeout.max(Duration::from_millis(500));
        let mut invocation = self.shared.heartbeat.prepare_invoke();
        invocation.key(key).arg(id).arg(ttl.as_millis() as u64);
        let count = tokio::time::timeout(timeout, invocation.invoke_async::<u64>(&mut connection))
            .await
            .map_err(|_| StoreError::Timeout(timeout))??;
        Ok(count)
    }
}

/// Connects, retrying with backoff, until the store is dropped or a connection is made;
/// the connection manager reconnects by itself after that.
async fn connect_in_background(address: String, shared: Weak<Shared>) {
    let mut backoff = Duration::from_millis(10);
    let mut last_log: Option<Instant> = None;
    loop {
        let Some(strong) = shared.upgrade() else { return };
        let attempt = async {
            let client = strong.source.client().await?;
            Ok::<_, StoreError>(
                ConnectionManager::new_with_config(client, strong.manager_config.clone()).await?,
            )
        };
        match attempt.await {
            Ok(connection) => {
                strong.connection.store(Some(Arc::new(connection)));
                tracing::info!(redis = %address, "connected to redis");
                return;
            }
            Err(e) => {
                if last_log.is_none_or(|at| at.elapsed() >= CONNECT_LOG_EVERY) {
                    tracing::warn!(redis = %address, error = %e, "cannot connect to redis; retrying");
                    last_log = Some(Instant::now());
                }
                drop(strong);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_RECONNECT_BACKOFF);
            }
        }
    }
}

/// `url` without its password, for logs.
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => {
            let user = rest[..at].split(':').next().unwrap_or("");
            format!("{scheme}://{user}:***@{}", &rest[at + 1..])
        }
        None => url.to_owned(),
    }
}

fn decision(fields: &[i64]) -> LimitDecision {
    let micros = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
    let outcome = match fields[0] {
        0 => Outcome::Allowed,
        1 => Outcome::Delayed(micros(fields[4])),
        3 => Outcome::Locked,
        _ => Outcome::Rejected,
    };
    LimitDecision {
        outcome,
        remaining: u64::try_from(fields[1]).unwrap_or(0),
        reset: micros(fields[2]),
        retry_after: micros(fields[3]),
    }
}

#[cfg(test)]
mod tests {
    use super::redacted;

    #[test]
    fn passwords_never_reach_the_log() {
        assert_eq!(
            redacted("redis://:s3cret@10.0.0.5:6379/0"),
            "redis://:***@10.0.0.5:6379/0"
        );
        assert_eq!(redacted("redis://app:s3cret@host/0"), "redis://app:***@host/0");
        assert_eq!(redacted("redis://host:6379"), "redis://host:6379");
    }
}
