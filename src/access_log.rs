//! The access log: one `tracing` event per request, target `access`, written
//! when the response body is finished, together with the request metrics.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use http::Method;

use crate::metrics::{LimitOutcome, Metrics};

/// What is known about a request by the time its response starts.
pub(crate) struct AccessRecord {
    pub metrics: Arc<Metrics>,
    pub start: Instant,
    pub method: Method,
    pub path: String,
    pub route: Arc<str>,
    pub status: u16,
    pub client_ip: IpAddr,
    /// What the route's limits made of the request.
    pub limit_outcome: LimitOutcome,
}

impl AccessRecord {
    /// Emits the log event and records the request metrics.
    pub(crate) fn finish(self, bytes: u64) {
        let elapsed = self.start.elapsed();
        self.metrics
            .record_request(&self.route, self.status, elapsed.as_secs_f64());
        tracing::info!(
            target: "access",
            method = %self.method,
            path = %self.path,
            route = %self.route,
            status = self.status,
            duration_ms = elapsed.as_secs_f64() * 1000.0,
            client_ip = %self.client_ip,
            bytes,
            limit = self.limit_outcome.as_str(),
        );
    }
}
