//! The Redis store: every call is one `EVALSHA` of `scripts/decide.lua` (loaded with
//! `SCRIPT LOAD` when Redis answers `NOSCRIPT`), over one multiplexed, self-reconnecting
//! connection shared by all requests, with a hard per-decision deadline.
//!
//! The connection is made in the background: the gateway starts, and serves under its
//! failure policy, whether or not Redis is up. The script takes a batch of requests and
//! decides each atomically and all-or-nothing, with Redis `TIME` as the only clock; on a
//! single server or Sentinel master, [`GroupCommit`] fills each call with the requests
//! that arrived while the previous one was in flight.
//!
//! On Redis Cluster, the keys of one request share a slot when its limits share a key
//! tuple (the tuple is the hash tag), and the decision stays one atomic call. When a
//! route's limits have different tuples, each slot's limits are decided concurrently (each
//! group atomic and all-or-nothing on its own), and if a group refuses the request, what
//! the other groups consumed is given back.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{ErrorKind, Script, ServerErrorKind};

mod batch;
mod breakers;
pub(crate) mod connection;
pub(crate) mod fallback;
pub(crate) mod refusals;
mod wire;

use super::algorithm::{Algorithm, State};
use super::{Decisions, LimitCheck, LimitDecision, Outcome, Peeked};
use batch::{GroupCommit, Pending};
pub use connection::RedisTarget;
use connection::{Connection, Source};

const DECIDE_LUA: &str = include_str!("scripts/decide.lua");
const REFUND_LUA: &str = include_str!("scripts/refund.lua");
const HEARTBEAT_LUA: &str = include_str!("scripts/heartbeat.lua");
const PEEK_LUA: &str = include_str!("scripts/peek.lua");
const ACQUIRE_LUA: &str = include_str!("scripts/acquire.lua");
const RENEW_LUA: &str = include_str!("scripts/renew.lua");
/// Longest pause between two connection attempts.
const MAX_RECONNECT_BACKOFF: Duration = Duration::from_secs(1);
/// At most one "cannot connect" log line per this period.
const CONNECT_LOG_EVERY: Duration = Duration::from_secs(30);

/// Why the store could not decide.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// Link: one failed call answers every request it carried.
    #[error("redis: {0}")]
    Redis(Arc<redis::RedisError>),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("not connected to redis yet")]
    NotConnected,
    #[error("redis is failing; not asked during the breaker's cool-down")]
    BreakerOpen,
    /// On a cluster, a decision across slots some of whose calls failed: the failure of
    /// the nodes serving `failed` (a key of each slot whose call failed), not of the others.
    #[error("{error}")]
    InSlots {
        failed: Vec<String>,
        error: Box<StoreError>,
    },
    #[error("redis answered {got} bytes for {checks} checks")]
    Malformed { got: usize, checks: usize },
    #[error(
        "one script call cannot number {0} keys, limits or checks (at most {max})",
        max = wire::PLAN_MAX
    )]
    Oversized(usize),
}

impl From<redis::RedisError> for StoreError {
    fn from(error: redis::RedisError) -> Self {
        StoreError::Redis(Arc::new(error))
    }
}

/// The connection to Redis, where it comes from, and the scripts run over it.
struct Link {
    connection: ArcSwapOption<Connection>,
    source: Source,
    decide: Script,
    refund: Script,
    heartbeat: Script,
    peek: Script,
    acquire: Script,
    renew: Script,
    timeout: Duration,
}

/// A counter's stored value as `scripts/decide.lua` writes it: a fixed window's plain
/// count (its window ends with the key), or `:` and the state's numbers as little-endian
/// doubles. `None` for anything else (read as a fresh key).
fn stored_state(algorithm: &Algorithm, value: &[u8], pttl: i64, now: u64) -> Option<State> {
    let numbers = |count: usize| -> Option<Vec<f64>> {
        let packed = value.strip_prefix(b":")?;
        (packed.len() == 8 * count).then(|| {
            packed
                .chunks_exact(8)
                .map(|bytes| f64::from_le_bytes(bytes.try_into().unwrap_or_default()))
                .collect()
        })
    };
    Some(match algorithm {
        Algorithm::FixedWindow { .. } => State::Fixed {
            count: std::str::from_utf8(value).ok()?.parse().ok()?,
            window_end: now + u64::try_from(pttl).ok()? * 1000,
        },
        Algorithm::SlidingWindow { .. } => match numbers(3)?[..] {
            [index, current, previous] => State::Sliding {
                window_index: index as u64,
                current: current as u64,
                previous: previous as u64,
            },
            _ => return None,
        },
        Algorithm::TokenBucket { .. } => match numbers(2)?[..] {
            [tokens, updated] => State::Bucket {
                tokens,
                updated: updated as u64,
            },
            _ => return None,
        },
        Algorithm::LeakyBucket { .. } => match numbers(2)?[..] {
            [tat, step] => State::Gcra {
                tat: tat as u64,
                step,
            },
            _ => return None,
        },
    })
}

/// A rate-limit store in Redis.
#[derive(Clone)]
pub struct RedisStore {
    link: Arc<Link>,
    /// Batches decisions on a single server or Sentinel master (not on a cluster, where
    /// one call reaches one slot).
    batch: Option<Arc<GroupCommit>>,
}

impl RedisStore {
    /// Starts connecting to `target` in the background; `timeout` bounds each decision.
    /// Fails only for a target that cannot be used at all.
    pub fn start(target: &RedisTarget, timeout: Duration) -> Result<Self, StoreError> {
        let link = Arc::new(Link {
            connection: ArcSwapOption::empty(),
            source: Source::new(target, timeout)?,
            decide: Script::new(DECIDE_LUA),
            refund: Script::new(REFUND_LUA),
            heartbeat: Script::new(HEARTBEAT_LUA),
            peek: Script::new(PEEK_LUA),
            acquire: Script::new(ACQUIRE_LUA),
            renew: Script::new(RENEW_LUA),
            timeout,
        });
        tokio::spawn(connect_in_background(target.describe(), Arc::downgrade(&link)));
        let batch = (!link.source.is_cluster()).then(|| {
            let weak = Arc::downgrade(&link);
            Arc::new(GroupCommit::start(timeout, move |batch, deadline| {
                decide_batch(weak.clone(), batch, deadline)
            }))
        });
        Ok(RedisStore { link, batch })
    }

    /// Starts with `target` and waits until connected (at least 2 s, or `timeout`).
    pub async fn connect(target: &RedisTarget, timeout: Duration) -> Result<Self, StoreError> {
        let store = RedisStore::start(target, timeout)?;
        let deadline = Instant::now() + timeout.max(Duration::from_secs(2));
        while !store.connected() {
            if Instant::now() > deadline {
                return Err(StoreError::NotConnected);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(store)
    }

    fn connection(&self) -> Result<Connection, StoreError> {
        self.link
            .connection
            .load()
            .as_deref()
            .cloned()
            .ok_or(StoreError::NotConnected)
    }

    /// Whether a connection has been made (it may have failed since).
    pub fn connected(&self) -> bool {
        self.link.connection.load().is_some()
    }

    /// Decides all of one request's limits: one round trip, unless (on Redis Cluster) they
    /// live in different slots.
    pub async fn decide(&self, checks: &[LimitCheck]) -> Result<Decisions, StoreError> {
        if checks.is_empty() {
            // Nothing to decide (and the script's plan has no room for a request of none).
            return Ok(Decisions::new());
        }
        if let Some(batch) = &self.batch {
            if !self.connected() {
                return Err(StoreError::NotConnected);
            }
            return batch.submit(checks).await;
        }
        // Boxed: without group commit, and across slots, the calls' futures are large,
        // and the common path (`batch.submit`) would carry their room, moved at each step.
        let mut connection = self.connection()?;
        let groups = slot_groups(checks);
        if groups.len() == 1 {
            return Box::pin(self.link.decide_together(&mut connection, checks)).await;
        }
        Box::pin(self.decide_across_slots(&connection, checks, groups)).await
    }

    /// Decides each slot's checks concurrently; if any enforced check refuses, gives back
    /// what the groups that admitted consumed, so the request consumes nothing.
    async fn decide_across_slots(
        &self,
        connection: &Connection,
        checks: &[LimitCheck],
        groups: Vec<Vec<usize>>,
    ) -> Result<Decisions, StoreError> {
        let calls = groups.iter().map(|group| {
            let mut connection = connection.clone();
            let subset: Vec<LimitCheck> = group.iter().map(|&i| checks[i].clone()).collect();
            async move { self.link.decide_together(&mut connection, &subset).await }
        });
        let answers = futures_util::future::join_all(calls).await;
        let mut decisions = vec![None; checks.len()];
        let mut failure = None;
        let mut failed = Vec::new();
        for (group, answer) in groups.iter().zip(answers) {
            match answer {
                Ok(decided) => {
                    for (&i, decision) in group.iter().zip(decided) {
                        decisions[i] = Some(decision);
                    }
                }
                Err(error) => {
                    failed.push(checks[group[0]].key.clone());
                    failure = Some(error);
                }
            }
        }
        let refused = checks
            .iter()
            .zip(&decisions)
            .any(|(check, d)| !check.shadow && d.is_some_and(|d| !d.outcome.admits()));
        if refused || failure.is_some() {
            // Give back every enforced check that consumed, so the request consumed nothing.
            for (check, decision) in checks.iter().zip(decisions.iter_mut()) {
                if let Some(d) = decision.as_mut().filter(|d| !check.shadow && d.outcome.admits()) {
                    if let Err(error) = self.refund(check).await {
                        tracing::warn!(%error, key = %check.key, "could not give back a cross-slot consumption");
                    }
                    *d = LimitDecision {
                        outcome: Outcome::Allowed,
                        remaining: d.remaining + check.cost,
                        ..*d
                    };
                }
            }
        }
        if let Some(error) = failure {
            return Err(StoreError::InSlots {
                failed,
                error: Box::new(error),
            });
        }
        Ok(decisions
            .into_iter()
            .map(|d| d.expect("every group answered"))
            .collect())
    }

    /// Gives back what an admitted request consumed from `check`'s limit.
    pub async fn refund(&self, check: &LimitCheck) -> Result<(), StoreError> {
        let mut connection = self.connection()?;
        let (code, a, b, c) = wire::parameters(&check.algorithm);
        let mut invocation = self.link.refund.prepare_invoke();
        invocation
            .key(&check.key)
            .arg(code)
            .arg(a)
            .arg(b)
            .arg(c)
            .arg(check.cost);
        self.within_deadline(invocation.invoke_async::<()>(&mut connection))
            .await
    }

    /// One key's state and its lock's time left, as `algorithm` stores it, changing
    /// nothing.
    pub async fn peek(
        &self,
        algorithm: &Algorithm,
        key: &str,
        lock: Option<&str>,
    ) -> Result<Peeked, StoreError> {
        let mut connection = self.connection()?;
        let mut invocation = self.link.peek.prepare_invoke();
        invocation.key(key);
        if let Some(lock) = lock {
            invocation.key(lock);
        }
        let (seconds, micros, value, pttl, lock_pttl): (u64, u64, Option<Vec<u8>>, i64, i64) = self
            .within_deadline(invocation.invoke_async(&mut connection))
            .await?;
        let now = seconds * 1_000_000 + micros;
        Ok(Peeked {
            state: value.and_then(|value| stored_state(algorithm, &value, pttl, now)),
            lock_left: (lock_pttl > 0).then(|| lock_pttl as u64 * 1000),
            now,
        })
    }

    /// Locks `key` for `ttl` microseconds (rounded up to the millisecond), unless it is
    /// locked already.
    pub async fn lock(&self, key: &str, ttl: u64) -> Result<(), StoreError> {
        let mut connection = self.connection()?;
        let mut set = redis::cmd("SET");
        set.arg(key)
            .arg(1)
            .arg("PX")
            .arg(ttl.div_ceil(1000).max(1))
            .arg("NX");
        self.within_deadline(set.query_async::<()>(&mut connection)).await
    }

    /// Takes one of `limit` slots of `key` as lease `id` for `lease`: false when every
    /// slot is taken.
    pub async fn acquire(
        &self,
        key: &str,
        id: &str,
        limit: u64,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let mut connection = self.connection()?;
        let mut invocation = self.link.acquire.prepare_invoke();
        invocation
            .key(key)
            .arg(id)
            .arg(limit)
            .arg(lease.as_millis() as u64);
        let taken: u8 = self
            .within_deadline(invocation.invoke_async(&mut connection))
            .await?;
        Ok(taken == 1)
    }

    /// Renews the leases `ids` of `key` for another `lease`.
    pub async fn renew(&self, key: &str, ids: &[String], lease: Duration) -> Result<(), StoreError> {
        let mut connection = self.connection()?;
        let mut invocation = self.link.renew.prepare_invoke();
        invocation.key(key).arg(lease.as_millis() as u64);
        for id in ids {
            invocation.arg(id);
        }
        self.within_deadline(invocation.invoke_async::<()>(&mut connection))
            .await
    }

    /// Leases of `key` held now (those of a crashed instance until they expire).
    pub async fn leases(&self, key: &str) -> Result<u64, StoreError> {
        let mut connection = self.connection()?;
        self.within_deadline(redis::cmd("ZCARD").arg(key).query_async::<u64>(&mut connection))
            .await
    }

    /// Gives back lease `id` of `key`.
    pub async fn release(&self, key: &str, id: &str) -> Result<(), StoreError> {
        let mut connection = self.connection()?;
        self.within_deadline(
            redis::cmd("ZREM")
                .arg(key)
                .arg(id)
                .query_async::<()>(&mut connection),
        )
        .await
    }

    /// Deletes one key and its lock.
    pub async fn clear(&self, key: &str, lock: Option<&str>) -> Result<(), StoreError> {
        let mut connection = self.connection()?;
        let mut delete = redis::cmd("DEL");
        delete.arg(key);
        if let Some(lock) = lock {
            delete.arg(lock);
        }
        self.within_deadline(delete.query_async::<()>(&mut connection))
            .await
    }

    /// After failures: checks that Redis answers again. Through sentinels, first asks
    /// them for the current master and connects to it (following a failover).
    pub async fn recover(&self) -> Result<(), StoreError> {
        if self.link.source.follows_failover() {
            let timeout = self.link.timeout.max(Duration::from_millis(500));
            let connection = tokio::time::timeout(timeout, async {
                let mut connection = self.link.source.connect().await?;
                redis::cmd("PING").query_async::<()>(&mut connection).await?;
                Ok::<_, StoreError>(connection)
            })
            .await
            .map_err(|_| StoreError::Timeout(timeout))??;
            self.link.connection.store(Some(Arc::new(connection)));
            return Ok(());
        }
        self.ping().await
    }

    /// Whether this is a Redis Cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        self.link.source.is_cluster()
    }

    /// `PING`, within the decision deadline; on a cluster, to one node, whichever (the
    /// cluster client sends a plain `PING` to every master and fails when one does not
    /// answer).
    pub async fn ping(&self) -> Result<(), StoreError> {
        match self.connection()? {
            Connection::Cluster(mut connection) => {
                let anyone = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);
                self.within_deadline(connection.route_command(redis::cmd("PING"), anyone))
                    .await
                    .map(drop)
            }
            mut connection => {
                self.within_deadline(redis::cmd("PING").query_async::<()>(&mut connection))
                    .await
            }
        }
    }

    /// On a cluster, its slot ranges (`CLUSTER SLOTS`): the first and last slot of each, and
    /// the `host:port` of the master serving it.
    pub async fn slot_ranges(&self) -> Result<Vec<(u16, u16, String)>, StoreError> {
        let mut connection = self.connection()?;
        let ranges: Vec<Vec<redis::Value>> = self
            .within_deadline(redis::cmd("CLUSTER").arg("SLOTS").query_async(&mut connection))
            .await?;
        Ok(ranges.iter().filter_map(|range| slot_range(range)).collect())
    }

    /// Whether `key` can be read (`EXISTS`), where the connection sends it.
    pub async fn probe_key(&self, key: &str) -> Result<(), StoreError> {
        let mut connection = self.connection()?;
        self.within_deadline(redis::cmd("EXISTS").arg(key).query_async::<u64>(&mut connection))
            .await
            .map(drop)
    }

    /// Announces instance `id` in the `key` set for `ttl`; returns the live instance count.
    pub async fn heartbeat(&self, key: &str, id: &str, ttl: Duration) -> Result<u64, StoreError> {
        let mut connection = self.connection()?;
        let mut invocation = self.link.heartbeat.prepare_invoke();
        invocation.key(key).arg(id).arg(ttl.as_millis() as u64);
        self.within_deadline(invocation.invoke_async::<u64>(&mut connection))
            .await
    }

    async fn within_deadline<T>(
        &self,
        call: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        self.link.within_deadline(call).await
    }
}

impl Link {
    async fn within_deadline<T>(
        &self,
        call: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        self.by(tokio::time::Instant::now() + self.timeout, call).await
    }

    /// `call`'s answer, unless `deadline` comes first.
    async fn by<T>(
        &self,
        deadline: tokio::time::Instant,
        call: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        Ok(tokio::time::timeout_at(deadline, call)
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))??)
    }

    /// One script call for `checks`, atomic and all-or-nothing.
    async fn decide_together(
        &self,
        connection: &mut Connection,
        checks: &[LimitCheck],
    ) -> Result<Decisions, StoreError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        Ok(self
            .decide_requests(connection, &[checks], deadline)
            .await?
            .pop()
            .unwrap_or_default())
    }

    /// One script call deciding several requests, each atomic and all-or-nothing, answered
    /// by `deadline`. The script is loaded (`SCRIPT LOAD`) when Redis does not know it, e.g.
    /// after a restart.
    async fn decide_requests(
        &self,
        connection: &mut Connection,
        requests: &[&[LimitCheck]],
        deadline: tokio::time::Instant,
    ) -> Result<Vec<Decisions>, StoreError> {
        let call = wire::command(self.decide.get_hash(), requests)
            .map_err(|wire::Oversized(n)| StoreError::Oversized(n))?;
        let reply: Vec<u8> = match self.by(deadline, call.query_async(connection)).await {
            Err(StoreError::Redis(error)) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.by(deadline, self.decide.prepare_invoke().load_async(connection))
                    .await?;
                self.by(deadline, call.query_async(connection)).await?
            }
            answer => answer?,
        };
        wire::decisions(requests, &reply).ok_or_else(|| StoreError::Malformed {
            got: reply.len(),
            checks: requests.iter().map(|checks| checks.len()).sum(),
        })
    }
}

/// The group-commit dispatcher's work: one script call for a batch of requests, by
/// `deadline`, each answered with its own decisions (or the call's error).
async fn decide_batch(link: Weak<Link>, batch: Vec<Pending>, deadline: tokio::time::Instant) {
    let Some(link) = link.upgrade() else { return };
    let result = match link.connection.load().as_deref().cloned() {
        Some(mut connection) => {
            let requests: Vec<&[LimitCheck]> = batch.iter().map(|p| p.checks.as_slice()).collect();
            link.decide_requests(&mut connection, &requests, deadline).await
        }
        None => Err(StoreError::NotConnected),
    };
    match result {
        Ok(decided) => {
            for (pending, decisions) in batch.into_iter().zip(decided) {
                let _ = pending.reply.send(Ok(decisions));
            }
        }
        Err(error) => {
            for pending in batch {
                let _ = pending.reply.send(Err(error.clone()));
            }
        }
    }
}

/// Indexes of `checks` grouped by the hash tag of their keys (one Redis Cluster slot per
/// group), in first-seen order.
fn slot_groups(checks: &[LimitCheck]) -> Vec<Vec<usize>> {
    let mut groups: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    let mut order: Vec<&str> = Vec::new();
    for (i, check) in checks.iter().enumerate() {
        let tag = hash_tag(&check.key);
        if !groups.contains_key(tag) {
            order.push(tag);
        }
        groups.entry(tag).or_default().push(i);
    }
    order.into_iter().filter_map(|tag| groups.remove(tag)).collect()
}

/// One range of `CLUSTER SLOTS`: `[first, last, [host, port, id, ...], replicas...]`.
fn slot_range(range: &[redis::Value]) -> Option<(u16, u16, String)> {
    use redis::{FromRedisValue, Value};
    let [first, last, master, ..] = range else {
        return None;
    };
    let Value::Array(master) = master else {
        return None;
    };
    let [host, port, ..] = &master[..] else {
        return None;
    };
    let host = String::from_redis_value(host.clone()).ok()?;
    let port = u16::from_redis_value(port.clone()).ok()?;
    let first = u16::from_redis_value(first.clone()).ok()?;
    let last = u16::from_redis_value(last.clone()).ok()?;
    // Slots are 0 to 16383.
    (first <= last && last < 16384).then(|| (first, last, format!("{host}:{port}")))
}

/// The part of `key` Redis Cluster hashes: between the first `{` and the next `}`.
fn hash_tag(key: &str) -> &str {
    key.find('{')
        .and_then(|open| {
            key[open + 1..]
                .find('}')
                .map(|close| &key[open + 1..open + 1 + close])
        })
        .filter(|tag| !tag.is_empty())
        .unwrap_or(key)
}

/// Connects, retrying with backoff, until the store is dropped or a connection is made;
/// the connection reconnects by itself after that.
async fn connect_in_background(address: String, link: Weak<Link>) {
    let mut backoff = Duration::from_millis(10);
    let mut last_log: Option<Instant> = None;
    loop {
        let Some(strong) = link.upgrade() else { return };
        match strong.source.connect().await {
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
            }
        }
        drop(strong);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_RECONNECT_BACKOFF);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Algorithm;

    #[test]
    fn checks_are_grouped_by_hash_tag() {
        let check = |key: &str| LimitCheck {
            key: key.to_owned(),
            algorithm: Algorithm::FixedWindow { limit: 1, window: 1 },
            lockout: None,
            cost: 1,
            keep_below: 0,
            shadow: false,
        };
        let checks = [
            check("fg:{ip}:a:fw"),
            check("fg:{key}:b:tb"),
            check("fg:{ip}:c:sw"),
        ];
        assert_eq!(slot_groups(&checks), vec![vec![0, 2], vec![1]]);
        assert_eq!(hash_tag("fg:{}:x"), "fg:{}:x");
        assert_eq!(hash_tag("plain"), "plain");
    }
}
