//! Prometheus metrics (docs/operations.md#metrics), owned by the gateway instance (no globals), rendered by
//! the admin listener in the text exposition format.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

mod histogram;

pub(crate) use histogram::DurationHistogram;

/// A label value shared with the configuration (route and upstream names) so that
/// recording a metric does not copy the name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Name(pub Arc<str>);

impl EncodeLabelValue for Name {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(&self.0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RequestLabels {
    route: Name,
    status: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct UpstreamLabels {
    upstream: Name,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ServerLabels {
    upstream: Name,
    server: Name,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CertificateLabels {
    certificate: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RouteLabels {
    route: Name,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct UpstreamErrorLabels {
    upstream: Name,
    kind: &'static str,
}

/// What the limits made of a request: the access log's `limit` field and, per limit, the
/// `outcome` label of `floodgate_ratelimit_decisions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum LimitOutcome {
    /// The route has no limits (access log only).
    None,
    /// The client is exempt from every limit of the route (access log only).
    Exempt,
    Allowed,
    /// Admitted after being held (leaky bucket).
    Delayed,
    Rejected,
    /// Refused by a lock-out.
    Locked,
    /// A shadow limit would have refused the request.
    ShadowRejected,
    /// The store failed and `on_error` decided.
    StoreError,
}

impl LimitOutcome {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            LimitOutcome::None => "none",
            LimitOutcome::Exempt => "exempt",
            LimitOutcome::Allowed => "allowed",
            LimitOutcome::Delayed => "delayed",
            LimitOutcome::Rejected => "rejected",
            LimitOutcome::Locked => "locked",
            LimitOutcome::ShadowRejected => "shadow_rejected",
            LimitOutcome::StoreError => "store_error",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DecisionLabels {
    limit: Name,
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StoreLabels {
    store: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
}

/// The series of one server of an upstream.
pub(crate) struct ServerSeries {
    /// 1 while in rotation.
    pub(crate) up: Gauge,
    pub(crate) in_flight: Gauge,
    /// Until the response head, per try.
    pub(crate) duration: DurationHistogram,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

type HistogramFamily<L> = Family<L, DurationHistogram, fn() -> DurationHistogram>;

/// Hashes label-value addresses: a cache key is a name's address (the cache keeps the
/// name alive, so the address cannot be reused) and a small number.
#[derive(Default)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn write_u16(&mut self, n: u16) {
        self.write_u64(u64::from(n));
    }
}

type AddressMap<K, V> = HashMap<K, V, BuildHasherDefault<AddressHasher>>;

/// The series of one route and status, looked up once.
struct RequestSeries {
    _route: Arc<str>,
    count: Counter,
    duration: DurationHistogram,
}

/// The series of one limit and outcome, looked up once (with the name it keeps alive).
struct DecisionSeries {
    _limit: Arc<str>,
    count: Counter,
}

/// Series handles by the address of their label values, so that recording costs a
/// pointer hash instead of hashing label text into the families on every request.
/// Emptied on reload, when the configuration's names are replaced (the store labels are
/// static and stay).
#[derive(Default)]
struct SeriesCache {
    requests: RwLock<AddressMap<(usize, u16), RequestSeries>>,
    decisions: RwLock<AddressMap<(usize, usize), DecisionSeries>>,
    store_calls: RwLock<AddressMap<usize, DurationHistogram>>,
}

fn address(name: &Arc<str>) -> usize {
    Arc::as_ptr(name).cast::<u8>() as usize
}

/// The served certificates' expiry series.
#[derive(Clone)]
pub(crate) struct CertificateExpiry(Family<CertificateLabels, Gauge>);

impl CertificateExpiry {
    /// Publishes `certificate`'s notAfter (Unix seconds).
    pub(crate) fn set(&self, certificate: &str, not_after: i64) {
        self.0
            .get_or_create(&CertificateLabels {
                certificate: certificate.to_owned(),
            })
            .set(not_after);
    }
}

/// Every metric floodgate exports.
pub(crate) struct Metrics {
    cache: SeriesCache,
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    request_duration: HistogramFamily<RouteLabels>,
    upstream_errors: Family<UpstreamErrorLabels, Counter>,
    upstream_retries: Family<UpstreamLabels, Counter>,
    upstream_queue_depth: Family<UpstreamLabels, Gauge>,
    server_up: Family<ServerLabels, Gauge>,
    server_in_flight: Family<ServerLabels, Gauge>,
    upstream_duration: HistogramFamily<ServerLabels>,
    requests_in_flight: Gauge,
    client_connections: Gauge,
    spans_dropped: Counter,
    breaker_open: Family<StoreLabels, Gauge>,
    tls_handshake_errors: Counter,
    dropped_headers: Counter,
    certificate_expiry: Family<CertificateLabels, Gauge>,
    decisions: Family<DecisionLabels, Counter>,
    store_duration: HistogramFamily<StoreLabels>,
    store_errors: Family<StoreLabels, Counter>,
    keys_not_kept: Family<StoreLabels, Counter>,
    reloads: Family<ResultLabels, Counter>,
    acme_orders: Family<ResultLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub(crate) fn new() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let request_duration: HistogramFamily<RouteLabels> =
            Family::new_with_constructor(DurationHistogram::default);
        let upstream_errors = Family::<UpstreamErrorLabels, Counter>::default();
        registry.register(
            "floodgate_requests",
            "Requests answered, by route (\"\" when none matched) and status",
            requests.clone(),
        );
        registry.register(
            "floodgate_request_duration_seconds",
            "Time from request to the end of the response body, by route",
            request_duration.clone(),
        );
        let kinds = crate::error::UpstreamFailure::ALL
            .map(|kind| kind.label())
            .join(", ");
        registry.register(
            "floodgate_upstream_errors",
            format!("Upstream failures by upstream and kind ({kinds})"),
            upstream_errors.clone(),
        );
        let upstream_retries = Family::<UpstreamLabels, Counter>::default();
        registry.register(
            "floodgate_upstream_retries",
            "Requests tried again on another server after a failure, by upstream",
            upstream_retries.clone(),
        );
        let upstream_queue_depth = Family::<UpstreamLabels, Gauge>::default();
        registry.register(
            "floodgate_upstream_queue_depth",
            "Requests waiting for a free slot under max_requests, by upstream",
            upstream_queue_depth.clone(),
        );
        let server_up = Family::<ServerLabels, Gauge>::default();
        registry.register(
            "floodgate_upstream_server_up",
            "Whether a server is in rotation (1) or out (0), by upstream and server (host:port)",
            server_up.clone(),
        );
        let server_in_flight = Family::<ServerLabels, Gauge>::default();
        registry.register(
            "floodgate_upstream_in_flight",
            "Requests in flight to a server, by upstream and server (host:port)",
            server_in_flight.clone(),
        );
        let upstream_duration: HistogramFamily<ServerLabels> =
            Family::new_with_constructor(DurationHistogram::default);
        registry.register(
            "floodgate_upstream_duration_seconds",
            "Time from sending a request to a server until its response head, by upstream and server",
            upstream_duration.clone(),
        );
        let requests_in_flight = Gauge::default();
        registry.register(
            "floodgate_requests_in_flight",
            "Requests on the plain and TLS listeners not yet answered in full",
            requests_in_flight.clone(),
        );
        let client_connections = Gauge::default();
        registry.register(
            "floodgate_client_connections",
            "Client connections open on the plain and TLS listeners (server.max_connections caps them)",
            client_connections.clone(),
        );
        let build_info = Family::<BuildLabels, Gauge>::default();
        build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        registry.register(
            "floodgate_build_info",
            "floodgate's version, always 1",
            build_info,
        );
        let spans_dropped = Counter::default();
        registry.register(
            "floodgate_trace_spans_dropped",
            "Trace spans not exported: the export queue was full, or the export failed",
            spans_dropped.clone(),
        );
        registry.register(
            "floodgate_log_lines_dropped",
            "Log lines dropped while standard output was blocked and 4 MB of lines waited for it",
            crate::logging::dropped_lines(),
        );
        let breaker_open = Family::<StoreLabels, Gauge>::default();
        registry.register(
            "floodgate_store_breaker_open",
            "1 while the store's circuit breaker is open (Redis is not asked), by store",
            breaker_open.clone(),
        );
        let tls_handshake_errors = Counter::default();
        registry.register(
            "floodgate_tls_handshake_errors",
            "TLS handshakes on the HTTPS listener that failed or did not finish in time",
            tls_handshake_errors.clone(),
        );
        let dropped_headers = Counter::default();
        registry.register(
            "floodgate_request_headers_dropped",
            "Request header fields dropped for names with characters other than letters, digits and -",
            dropped_headers.clone(),
        );
        let certificate_expiry = Family::<CertificateLabels, Gauge>::default();
        registry.register(
            "floodgate_tls_certificate_expiry_timestamp_seconds",
            "Each served certificate's notAfter as a Unix time, by its first DNS name",
            certificate_expiry.clone(),
        );
        let decisions = Family::<DecisionLabels, Counter>::default();
        let store_duration: HistogramFamily<StoreLabels> =
            Family::new_with_constructor(DurationHistogram::default);
        let store_errors = Family::<StoreLabels, Counter>::default();
        registry.register(
            "floodgate_ratelimit_decisions",
            "Rate-limit decisions by limit and outcome (allowed, rejected, locked, delayed, shadow_rejected, store_error)",
            decisions.clone(),
        );
        registry.register(
            "floodgate_store_duration_seconds",
            "Time of one rate-limit store call, by store (memory, redis)",
            store_duration.clone(),
        );
        registry.register(
            "floodgate_store_errors",
            "Rate-limit store calls that failed, by store",
            store_errors.clone(),
        );
        let keys_not_kept = Family::<StoreLabels, Counter>::default();
        registry.register(
            "floodgate_store_keys_not_kept",
            "Decisions whose new key a full in-process store did not keep (decided as fresh), by store (memory, local)",
            keys_not_kept.clone(),
        );
        let reloads = Family::<ResultLabels, Counter>::default();
        registry.register(
            "floodgate_config_reloads",
            "Configuration reloads by result (ok, error)",
            reloads.clone(),
        );
        let acme_orders = Family::<ResultLabels, Counter>::default();
        registry.register(
            "floodgate_acme_orders",
            "Attempts to obtain a certificate from the ACME CA, by result (ok, error)",
            acme_orders.clone(),
        );
        Metrics {
            cache: SeriesCache::default(),
            reloads,
            acme_orders,
            registry,
            requests,
            request_duration,
            upstream_errors,
            upstream_retries,
            upstream_queue_depth,
            server_up,
            server_in_flight,
            upstream_duration,
            requests_in_flight,
            client_connections,
            spans_dropped,
            breaker_open,
            tls_handshake_errors,
            dropped_headers,
            certificate_expiry,
            decisions,
            store_duration,
            store_errors,
            keys_not_kept,
        }
    }

    /// Counts one answered request and its duration.
    pub(crate) fn record_request(&self, route: &Arc<str>, status: u16, duration: Duration) {
        let key = (address(route), status);
        let create = || {
            let name = Name(route.clone());
            RequestSeries {
                _route: route.clone(),
                count: self
                    .requests
                    .get_or_create(&RequestLabels {
                        route: name.clone(),
                        status,
                    })
                    .clone(),
                duration: self
                    .request_duration
                    .get_or_create(&RouteLabels { route: name })
                    .clone(),
            }
        };
        with_series(&self.cache.requests, key, create, |series| {
            series.count.inc();
            series.duration.observe(duration);
        });
    }

    /// The failure counter of `upstream` for `kind`.
    pub(crate) fn upstream_errors(&self, upstream: &Arc<str>, kind: &'static str) -> Counter {
        self.upstream_errors
            .get_or_create(&UpstreamErrorLabels {
                upstream: Name(upstream.clone()),
                kind,
            })
            .clone()
    }

    /// The retry counter of `upstream`.
    pub(crate) fn upstream_retries(&self, upstream: &Arc<str>) -> Counter {
        self.upstream_retries
            .get_or_create(&UpstreamLabels {
                upstream: Name(upstream.clone()),
            })
            .clone()
    }

    /// The queue-depth gauge of `upstream`.
    pub(crate) fn upstream_queue_depth(&self, upstream: &Arc<str>) -> Gauge {
        self.upstream_queue_depth
            .get_or_create(&UpstreamLabels {
                upstream: Name(upstream.clone()),
            })
            .clone()
    }

    pub(crate) fn record_dropped_headers(&self, fields: usize) {
        self.dropped_headers.inc_by(fields as u64);
    }

    pub(crate) fn record_tls_handshake_error(&self) {
        self.tls_handshake_errors.inc();
    }

    /// Publishes the served certificates' expiry (replacing those of an earlier
    /// configuration). Of certificates with the same first name, the first is served for
    /// it, and its expiry is the series'.
    pub(crate) fn set_certificate_expiry(&self, certificates: &[(String, i64)]) {
        self.certificate_expiry.clear();
        for (certificate, not_after) in certificates.iter().rev() {
            self.certificate_expiry().set(certificate, *not_after);
        }
    }

    /// `floodgate_tls_certificate_expiry_timestamp_seconds`, for the ACME manager to set
    /// when it serves a new certificate.
    pub(crate) fn certificate_expiry(&self) -> CertificateExpiry {
        CertificateExpiry(self.certificate_expiry.clone())
    }

    /// `floodgate_acme_orders_total` of `result` (`ok` or `error`).
    pub(crate) fn acme_orders(&self, result: &'static str) -> Counter {
        self.acme_orders.get_or_create(&ResultLabels { result }).clone()
    }

    /// Drops the series of a server no longer configured (after a reload), so that its
    /// last `server_up` does not stay behind.
    pub(crate) fn forget_upstream_server(&self, upstream: &str, server: &str) {
        let labels = ServerLabels {
            upstream: Name(Arc::from(upstream)),
            server: Name(Arc::from(server)),
        };
        self.server_up.remove(&labels);
        self.server_in_flight.remove(&labels);
        self.upstream_duration.remove(&labels);
    }

    /// The series of `server` of `upstream`.
    pub(crate) fn upstream_server(&self, upstream: &Arc<str>, server: &Arc<str>) -> ServerSeries {
        let labels = ServerLabels {
            upstream: Name(upstream.clone()),
            server: Name(server.clone()),
        };
        ServerSeries {
            up: self.server_up.get_or_create(&labels).clone(),
            in_flight: self.server_in_flight.get_or_create(&labels).clone(),
            duration: self.upstream_duration.get_or_create(&labels).clone(),
        }
    }

    /// `floodgate_client_connections`, for the listeners to count in.
    pub(crate) fn client_connections(&self) -> &Gauge {
        &self.client_connections
    }

    /// `floodgate_requests_in_flight`, for the request path to count in.
    pub(crate) fn requests_in_flight(&self) -> &Gauge {
        &self.requests_in_flight
    }

    /// `floodgate_trace_spans_dropped_total`, for the span exporter to count in.
    pub(crate) fn spans_dropped(&self) -> Counter {
        self.spans_dropped.clone()
    }

    /// `floodgate_store_breaker_open` of `store`, for its breaker to set.
    pub(crate) fn breaker_open(&self, store: &'static str) -> Gauge {
        self.breaker_open.get_or_create(&StoreLabels { store }).clone()
    }

    pub(crate) fn record_decision(&self, limit: &Arc<str>, outcome: LimitOutcome) {
        let key = (address(limit), outcome as usize);
        let create = || DecisionSeries {
            _limit: limit.clone(),
            count: self
                .decisions
                .get_or_create(&DecisionLabels {
                    limit: Name(limit.clone()),
                    outcome: outcome.as_str(),
                })
                .clone(),
        };
        with_series(&self.cache.decisions, key, create, |series| {
            series.count.inc();
        });
    }

    pub(crate) fn record_store_call(&self, store: &'static str, duration: Duration) {
        let create = || self.store_duration.get_or_create(&StoreLabels { store }).clone();
        with_series(
            &self.cache.store_calls,
            store.as_ptr() as usize,
            create,
            |histogram| histogram.observe(duration),
        );
    }

    /// The counter an in-process store (`memory`, or Redis's `local` fallback) counts
    /// the new keys it had no room for in.
    pub(crate) fn keys_not_kept(&self, store: &'static str) -> Counter {
        self.keys_not_kept.get_or_create(&StoreLabels { store }).clone()
    }

    /// `floodgate_store_errors_total` of `store`, for the store to count its failures.
    pub(crate) fn store_errors(&self, store: &'static str) -> Counter {
        self.store_errors.get_or_create(&StoreLabels { store }).clone()
    }

    pub(crate) fn record_reload(&self, ok: bool) {
        if ok {
            write(&self.cache.requests).clear();
            write(&self.cache.decisions).clear();
        }
        let result = if ok { "ok" } else { "error" };
        self.reloads.get_or_create(&ResultLabels { result }).inc();
    }

    /// The Prometheus text exposition of every metric.
    pub(crate) fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
            let _ = writeln!(out, "# metrics encoding failed");
        }
        out
    }
}

/// Records into the series cached at `key`, created by `create` (and cached) the first
/// time: a read lock and a pointer hash per record once it exists.
fn with_series<K: Hash + Eq, S>(
    cache: &RwLock<AddressMap<K, S>>,
    key: K,
    create: impl FnOnce() -> S,
    record: impl FnOnce(&S),
) {
    if let Some(series) = read(cache).get(&key) {
        record(series);
        return;
    }
    let series = create();
    record(&series);
    write(cache).insert(key, series);
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_with_labels() {
        let metrics = Metrics::new();
        metrics.record_request(&Arc::from("api"), 200, Duration::from_secs_f64(0.003));
        metrics.record_request(&Arc::from("api"), 200, Duration::from_secs_f64(0.004));
        metrics.upstream_errors(&Arc::from("php"), "timeout").inc();
        let text = metrics.render();
        assert!(
            text.contains("floodgate_requests_total{route=\"api\",status=\"200\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("floodgate_request_duration_seconds_count{route=\"api\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("floodgate_upstream_errors_total{upstream=\"php\",kind=\"timeout\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn a_certificates_expiry_is_the_first_of_its_names() {
        let metrics = Metrics::new();
        let series = |name: &str| {
            format!("floodgate_tls_certificate_expiry_timestamp_seconds{{certificate=\"{name}\"}}")
        };
        metrics.set_certificate_expiry(&[
            ("a.test".into(), 100),
            ("b.test".into(), 300),
            ("a.test".into(), 200),
        ]);
        let text = metrics.render();
        assert!(text.contains(&format!("{} 100\n", series("a.test"))), "{text}");
        assert!(text.contains(&format!("{} 300\n", series("b.test"))), "{text}");
        metrics.set_certificate_expiry(&[]);
        assert!(!metrics.render().contains("certificate=\""));
    }

    #[test]
    fn store_calls_are_counted_by_store() {
        let metrics = Metrics::new();
        metrics.record_store_call("memory", Duration::from_secs_f64(0.0001));
        metrics.record_store_call("memory", Duration::from_secs_f64(0.0002));
        metrics.record_store_call("redis", Duration::from_secs_f64(0.002));
        metrics.record_reload(true);
        metrics.record_store_call("memory", Duration::from_secs_f64(0.0001));
        let text = metrics.render();
        for series in [
            "floodgate_store_duration_seconds_count{store=\"memory\"} 3",
            "floodgate_store_duration_seconds_count{store=\"redis\"} 1",
        ] {
            assert!(text.contains(series), "{series} in\n{text}");
        }
    }

    #[test]
    fn equal_names_from_different_configurations_share_a_series() {
        let metrics = Metrics::new();
        let before_reload: Arc<str> = Arc::from("api");
        metrics.record_request(&before_reload, 200, Duration::from_secs_f64(0.001));
        metrics.record_decision(&before_reload, LimitOutcome::Allowed);
        metrics.record_reload(true);
        let after_reload: Arc<str> = Arc::from("api");
        metrics.record_request(&after_reload, 200, Duration::from_secs_f64(0.001));
        metrics.record_request(&before_reload, 200, Duration::from_secs_f64(0.001));
        metrics.record_request(&after_reload, 429, Duration::from_secs_f64(0.001));
        metrics.record_decision(&after_reload, LimitOutcome::Allowed);
        let text = metrics.render();
        for series in [
            "floodgate_requests_total{route=\"api\",status=\"200\"} 3",
            "floodgate_requests_total{route=\"api\",status=\"429\"} 1",
            "floodgate_request_duration_seconds_count{route=\"api\"} 4",
            "floodgate_ratelimit_decisions_total{limit=\"api\",outcome=\"allowed\"} 2",
        ] {
            assert!(text.contains(series), "{series} in\n{text}");
        }
    }
}
