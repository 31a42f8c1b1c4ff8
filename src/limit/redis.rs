//! The Redis store: every decision is one `EVALSHA` of `scripts/decide.lua` (loaded on
//! `NOSCRIPT` transparently by `redis::Script`), over one multiplexed, self-reconnecting
//! connection shared by all requests, with a hard per-decision deadline.
//!
//! The script takes a batch of requests and decides each atomically and all-or-nothing,
//! with Redis `TIME` as the only clock; today one call carries one request.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Script};

use super::{Algorithm, LimitCheck, LimitDecision, Outcome};

const DECIDE_LUA: &str = include_str!("scripts/decide.lua");
/// Values the script returns per check.
const FIELDS_PER_CHECK: usize = 5;

/// Why the store could not decide.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("redis answered {got} values for {checks} checks")]
    Malformed { got: usize, checks: usize },
}

/// A rate-limit store in Redis.
#[derive(Clone)]
pub struct RedisStore {
    connection: ConnectionManager,
    script: Script,
    timeout: Duration,
}

impl RedisStore {
    /// Connects to `url` (`redis://` or `rediss://`); `timeout` bounds each decision.
    pub async fn connect(url: &str, timeout: Duration) -> Result<Self, StoreError> {
        let client = Client::open(url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(100))))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1);
        let connection = tokio::time::timeout(timeout.max(Duration::from_secs(1)), async {
            ConnectionManager::new_with_config(client, config).await
        })
        .await
        .map_err(|_| StoreError::Timeout(timeout))??;
        Ok(RedisStore {
            connection,
            script: Script::new(DECIDE_LUA),
            timeout,
        })
    }

    /// Decides all of one request's limits in one round trip.
    pub async fn decide(&self, checks: &[LimitCheck]) -> Result<Vec<LimitDecision>, StoreError> {
        let mut invocation = self.script.prepare_invoke();
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
            invocation.arg(check.cost).arg(lockout);
        }
        let mut connection = self.connection.clone();
        let values: Vec<i64> = tokio::time::timeout(self.timeout, invocation.invoke_async(&mut connection))
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))??;
        if values.len() != checks.len() * FIELDS_PER_CHECK {
            return Err(StoreError::Malformed {
                got: values.len(),
                checks: checks.len(),
            });
        }
        Ok(values.chunks_exact(FIELDS_PER_CHECK).map(decision).collect())
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
