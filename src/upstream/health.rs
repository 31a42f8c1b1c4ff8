//! Active health checks: every `interval`, each server of the upstream is sent
//! `GET path` on a connection of its own (to PHP-FPM, a FastCGI request for the script
//! `path`, as its `ping.path` answers); a 2xx or 3xx within `timeout` is healthy.
//! The task ends when the upstream it checks is gone (replaced by a reload).

use std::sync::{Arc, Weak};

use tokio::time::MissedTickBehavior;
use tokio_util::task::AbortOnDropHandle;

use super::Rotation;
use super::server::{Server, Transport};
use crate::config::HealthCheck;

/// Starts checking `rotation`'s servers; the checks stop when the handle is dropped.
pub(super) fn start(rotation: &Arc<Rotation>, check: HealthCheck) -> AbortOnDropHandle<()> {
    AbortOnDropHandle::new(tokio::spawn(run(Arc::downgrade(rotation), check)))
}

async fn run(rotation: Weak<Rotation>, check: HealthCheck) {
    let mut every = tokio::time::interval(check.interval);
    every.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Some(rotation) = rotation.upgrade() else {
            return;
        };
        let results =
            futures_util::future::join_all(rotation.servers.iter().map(|server| probe(server, &check))).await;
        for (server, healthy) in rotation.servers.iter().zip(results) {
            server.checked(healthy);
        }
    }
}

/// One check of `server`, over TLS for an `https://` one, on a connection of its own
/// (closed when the check ends, answered or not).
async fn probe(server: &Server, check: &HealthCheck) -> bool {
    let status = match &server.transport {
        Transport::Http(pool) => tokio::time::timeout(check.timeout, pool.check(check.path.as_str())).await,
        Transport::FastCgi(pool) => tokio::time::timeout(check.timeout, pool.check(check.path.path())).await,
    };
    matches!(status, Ok(Some(status)) if status.is_success() || status.is_redirection())
}
