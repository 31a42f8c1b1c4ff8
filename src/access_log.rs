//! The access log: one line per request, target `access` ([`crate::logging::access`]),
//! written when the response body is finished, together with the request metrics and the
//! request's span.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{HeaderValue, Method};

use crate::metrics::{LimitOutcome, Metrics};
use crate::trace::{RequestEnd, RequestTrace};

/// What is known about a request by the time its response starts.
pub(crate) struct AccessRecord {
    pub metrics: Arc<Metrics>,
    pub start: Instant,
    pub method: Method,
    /// `http` or `https`: the listener's.
    pub scheme: &'static str,
    pub path: String,
    pub route: Arc<str>,
    pub status: u16,
    pub client_ip: IpAddr,
    /// What the route's limits made of the request.
    pub limit_outcome: LimitOutcome,
    /// The request's ID, unless `server.request_id` is off.
    pub request_id: Option<HeaderValue>,
    pub trace: RequestTrace,
    /// The server of the last upstream try, and its time until the response head.
    pub upstream: Option<(Arc<str>, Duration)>,
}

impl AccessRecord {
    /// The record of a request that started at `start`, counted in
    /// `floodgate_requests_in_flight` until it is finished.
    pub(crate) fn new(
        metrics: Arc<Metrics>,
        start: Instant,
        (method, scheme): (Method, &'static str),
        client_ip: IpAddr,
        trace: RequestTrace,
        no_route: Arc<str>,
    ) -> AccessRecord {
        metrics.requests_in_flight().inc();
        AccessRecord {
            metrics,
            start,
            method,
            scheme,
            path: String::new(),
            route: no_route,
            status: 0,
            client_ip,
            limit_outcome: LimitOutcome::None,
            request_id: None,
            trace,
            upstream: None,
        }
    }

    /// Emits the log event, records the request metrics and ends the request's span.
    pub(crate) fn finish(self, bytes: u64) {
        let elapsed = self.start.elapsed();
        self.metrics.requests_in_flight().dec();
        self.metrics.record_request(&self.route, self.status, elapsed);
        crate::logging::access(|line| {
            line.token("method", self.method.as_str());
            line.plain("path", &self.path);
            line.plain("route", &self.route);
            line.number("status", u64::from(self.status));
            line.millis("duration_ms", elapsed);
            line.ip("client_ip", self.client_ip);
            line.number("bytes", bytes);
            line.quoted("limit", self.limit_outcome.as_str());
            if let Some(id) = self.request_id.as_ref().and_then(|id| id.to_str().ok()) {
                line.quoted("request_id", id);
            }
            let trace_id = self.trace.trace_id.hex();
            line.token("trace_id", std::str::from_utf8(&trace_id).expect("hex digits"));
            if let Some((server, duration)) = &self.upstream {
                line.quoted("upstream_server", server);
                line.millis("upstream_duration_ms", *duration);
            }
        });
        self.trace.end(RequestEnd {
            scheme: self.scheme,
            path: &self.path,
            route: &self.route,
            status: self.status,
            client_ip: self.client_ip,
            // Exempt from every limit: none applied.
            limit_outcome: match self.limit_outcome {
                LimitOutcome::Exempt => LimitOutcome::None.as_str(),
                outcome => outcome.as_str(),
            },
        });
    }
}
