//! Connections to Redis for the store: one server (a multiplexed `ConnectionManager` that
//! reconnects by itself), the master that sentinels name (re-asked after failures, so a
//! failover is followed), or a Redis Cluster (the async cluster client, which follows
//! slot moves).

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{Client, Cmd, Pipeline, RedisFuture, Value};
use std::time::Duration;

use super::StoreError;

/// Which Redis to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// `redis://[user:password@]host:port[/db]` or `rediss://...` (TLS).
    Url(String),
    /// The master that these sentinels monitor under `master_name`, followed on failover.
    Sentinel {
        sentinels: Vec<String>,
        master_name: String,
    },
    /// A Redis Cluster, discovered from this seed node.
    Cluster(String),
}

impl RedisTarget {
    /// A description for logs, without passwords.
    pub fn describe(&self) -> String {
        match self {
            RedisTarget::Url(url) => redacted(url),
            RedisTarget::Cluster(seed) => format!("cluster via {}", redacted(seed)),
            RedisTarget::Sentinel {
                sentinels,
                master_name,
            } => {
                let nodes: Vec<String> = sentinels.iter().map(|s| redacted(s)).collect();
                format!("master {master_name:?} via sentinels {}", nodes.join(", "))
            }
        }
    }
}

/// `url` without its password, for logs.
fn redacted(url: &str) -> String {
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

/// Where connections come from.
pub(crate) enum Source {
    Direct(Client, ConnectionManagerConfig),
    Sentinel(tokio::sync::Mutex<SentinelClient>, ConnectionManagerConfig),
    Cluster(ClusterClient),
}

impl Source {
    pub(crate) fn new(target: &RedisTarget, timeout: Duration) -> Result<Self, StoreError> {
        let manager = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(250))))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1);
        Ok(match target {
            RedisTarget::Url(url) => Source::Direct(Client::open(url.as_str())?, manager),
            RedisTarget::Sentinel {
                sentinels,
                master_name,
            } => Source::Sentinel(
                tokio::sync::Mutex::new(SentinelClient::build(
                    sentinels.iter().map(String::as_str).collect(),
                    master_name.as_str(),
                    None,
                    SentinelServerType::Master,
                )?),
                manager,
            ),
            RedisTarget::Cluster(seed) => Source::Cluster(
                ClusterClient::builder(vec![seed.as_str()])
                    .connection_timeout(timeout.max(Duration::from_millis(250)))
                    .response_timeout(timeout)
                    .retries(1)
                    .build()?,
            ),
        })
    }

    /// A new connection (for sentinels: to the master they name now).
    pub(crate) async fn connect(&self) -> Result<Connection, StoreError> {
        Ok(match self {
            Source::Direct(client, config) => {
                Connection::Single(ConnectionManager::new_with_config(client.clone(), config.clone()).await?)
            }
            Source::Sentinel(sentinel, config) => {
                let client = sentinel.lock().await.async_get_client().await?;
                Connection::Single(ConnectionManager::new_with_config(client, config.clone()).await?)
            }
            Source::Cluster(client) => Connection::Cluster(client.get_async_connection().await?),
        })
    }

    /// Whether a new connection can find a different server than the current one
    /// (after a failover), so recovering means reconnecting rather than retrying.
    pub(crate) fn follows_failover(&self) -> bool {
        matches!(self, Source::Sentinel(..))
    }

    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Source::Cluster(_))
    }
}

/// A shared, multiplexed connection of either kind.
#[derive(Clone)]
pub(crate) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(connection) => connection.req_packed_command(cmd),
            Connection::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(connection) => connection.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(connection) => connection.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(connection) => connection.get_db(),
            Connection::Cluster(connection) => connection.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
