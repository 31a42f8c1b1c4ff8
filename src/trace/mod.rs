//! A request's place in a distributed trace (docs/operations.md#following-a-request): the
//! W3C trace context it came with, continued or begun anew; the span ID each upstream try
//! passes on as the parent; and, with `[tracing]`, the spans exported for the sampled
//! ones: one server span per request, one client span per upstream try.

pub(crate) mod context;
mod export;
mod otlp;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::header::HeaderName;
use http::{HeaderMap, Method};
use prometheus_client::metrics::counter::Counter;

use crate::config::TracingConfig;
use context::{SAMPLED, SpanId, TraceId, TraceParent};
use export::{Exporter, FinishedSpan};
pub(crate) use otlp::Value;

pub(crate) static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub(crate) static TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// `[tracing]` at work: which new traces are recorded, and where spans go.
pub(crate) struct Tracer {
    exporter: Exporter,
    /// A new trace is recorded when the low 8 bytes of its ID are below this; `None`:
    /// every one (`sample = 1.0`).
    threshold: Option<u64>,
    pub(crate) config: TracingConfig,
}

impl Tracer {
    /// Starts exporting to `config`'s collector (inside the runtime), counting the spans
    /// dropped in `dropped`.
    pub(crate) fn start(config: &TracingConfig, dropped: Counter) -> Tracer {
        Tracer {
            exporter: Exporter::start(config, dropped),
            threshold: (config.sample < 1.0).then(|| (config.sample * 2f64.powi(64)) as u64),
            config: config.clone(),
        }
    }

    /// Sends the spans still queued, for at most `within` (at shutdown).
    pub(crate) async fn flush(&self, within: Duration) {
        self.exporter.flush(within).await;
    }

    /// Whether a trace whose ratio draw is `draw` is recorded: the low bits of a new
    /// trace's ID, so that every hop of a trace decides alike.
    fn samples(&self, draw: u64) -> bool {
        self.threshold.is_none_or(|threshold| draw < threshold)
    }
}

/// A request's trace context.
pub(crate) struct RequestTrace {
    pub(crate) trace_id: TraceId,
    /// The request's own (server) span: the parent of every upstream try's.
    span_id: SpanId,
    /// The client's span, when the trace was continued.
    parent: Option<SpanId>,
    /// The `trace-flags` passed on: `sampled` when this request is recorded, or when a
    /// continued trace said so and floodgate records nothing.
    pub(crate) flags: u8,
    /// Whether the client sent a `tracestate` that must not go on: it goes on only with a
    /// valid `traceparent`, and well formed itself.
    pub(crate) drops_tracestate: bool,
    /// Boxed: requests that are not recorded carry a pointer, not the recording.
    recording: Option<Box<Recording>>,
}

/// A request being recorded.
struct Recording {
    tracer: Arc<Tracer>,
    /// Unix nanoseconds.
    start: u64,
    trace_state: String,
    /// The request's method, which names its spans.
    method: Method,
}

impl Recording {
    /// The method as the spans name it ([`known_method`]).
    fn method(&self) -> &str {
        known_method(&self.method)
    }

    /// What every span of the request says first: its method.
    fn method_attributes(&self) -> Vec<(&'static str, Value)> {
        let mut attributes = vec![("http.request.method", Value::String(self.method().to_owned()))];
        if self.method() == OTHER {
            attributes.push((
                "http.request.method_original",
                Value::String(self.method.to_string()),
            ));
        }
        attributes
    }
}

/// An upstream try, begun.
pub(crate) struct TrySpan {
    pub(crate) id: SpanId,
    start: u64,
}

/// What a recorded upstream try came to.
pub(crate) struct TryEnd<'a> {
    /// The server: `host:port`, or a socket's path.
    pub(crate) server: &'a str,
    /// The tries before this one.
    pub(crate) resends: usize,
    pub(crate) status: Option<u16>,
    pub(crate) error: Option<&'a str>,
}

/// What a recorded request came to.
pub(crate) struct RequestEnd<'a> {
    /// The route's name; empty when none matched.
    pub(crate) route: &'a str,
    /// `http` or `https`.
    pub(crate) scheme: &'static str,
    /// The normalized path.
    pub(crate) path: &'a str,
    pub(crate) status: u16,
    pub(crate) client_ip: std::net::IpAddr,
    /// A value of `floodgate_ratelimit_decisions_total{outcome}`, or `none`.
    pub(crate) limit_outcome: &'static str,
}

impl RequestTrace {
    /// The context of a request with `headers`: the client's `traceparent` continued when
    /// it is the only one and valid, a new trace otherwise; recorded when `tracer` is
    /// there and samples it: a trace continued from a `trusted` peer by its `sampled`
    /// flag, any other by ratio (a client's flag alone would have every request of its
    /// recorded, each several times the cost of one that is not).
    pub(crate) fn begin(
        method: &Method,
        headers: &HeaderMap,
        tracer: Option<&Arc<Tracer>>,
        trusted: bool,
    ) -> RequestTrace {
        // One pass over the few headers a request has costs less than looking up both
        // names, and tells whether there is a `tracestate` to drop.
        let (mut parents, mut states) = (0, 0);
        let mut sent_parent = None;
        for (name, value) in headers {
            if *name == TRACEPARENT {
                parents += 1;
                sent_parent = Some(value);
            } else if *name == TRACESTATE {
                states += 1;
            }
        }
        let parent = sent_parent
            .filter(|_| parents == 1)
            .and_then(|value| TraceParent::parse(value.as_bytes()));
        let keeps_tracestate =
            parent.is_some() && states > 0 && context::valid_tracestate(headers.get_all(&TRACESTATE).iter());
        let trace_id = parent.map_or_else(TraceId::random, |parent| parent.trace_id);
        let recorded = tracer.filter(|tracer| match parent {
            Some(parent) if trusted => parent.flags & SAMPLED != 0,
            // The client chose this ID, and with it where the ratio would place it.
            Some(_) => tracer.samples(fastrand::u64(..)),
            None => tracer.samples(trace_id.low()),
        });
        let recording = recorded.map(|tracer| {
            Box::new(Recording {
                tracer: tracer.clone(),
                start: unix_nanos(),
                trace_state: if keeps_tracestate {
                    joined(headers, &TRACESTATE)
                } else {
                    String::new()
                },
                method: method.clone(),
            })
        });
        let flags = match (&recording, tracer, parent) {
            (Some(_), _, _) => SAMPLED,
            // Without `[tracing]` nothing is recorded here: the client's decision goes on,
            // and a new trace is `sampled` as `sample`'s default says, so that an app
            // sampling by its parent keeps recording.
            (None, None, Some(parent)) => parent.flags & SAMPLED,
            (None, None, None) => SAMPLED,
            (None, Some(_), _) => 0,
        };
        RequestTrace {
            trace_id,
            span_id: SpanId::random(),
            parent: parent.map(|parent| parent.parent_id),
            flags,
            drops_tracestate: states > 0 && !keeps_tracestate,
            recording,
        }
    }

    /// A new trace nothing records: of a request answered before its head could be read.
    pub(crate) fn unrecorded() -> RequestTrace {
        RequestTrace {
            trace_id: TraceId::random(),
            span_id: SpanId::random(),
            parent: None,
            flags: 0,
            drops_tracestate: false,
            recording: None,
        }
    }

    /// Whether the trace came from the client.
    pub(crate) fn continued(&self) -> bool {
        self.parent.is_some()
    }

    /// Begins an upstream try: its span ID, to pass on as the parent.
    pub(crate) fn begin_try(&self) -> TrySpan {
        self.begin_try_as(SpanId::random())
    }

    /// Begins an upstream try whose span ID is `id` (the one its head was written with).
    pub(crate) fn begin_try_as(&self, id: SpanId) -> TrySpan {
        TrySpan {
            id,
            start: if self.recording.is_some() { unix_nanos() } else { 0 },
        }
    }

    /// Ends an upstream try: its client span is exported when the request is recorded.
    pub(crate) fn end_try(&self, span: TrySpan, end: TryEnd<'_>) {
        let Some(recording) = &self.recording else {
            return;
        };
        let (address, port) = match end.server.rsplit_once(':') {
            Some((host, port)) if !end.server.starts_with('/') => (host, port.parse().ok()),
            _ => (end.server, None),
        };
        let mut attributes = recording.method_attributes();
        attributes.push((
            "server.address",
            Value::String(address.trim_start_matches('[').trim_end_matches(']').to_owned()),
        ));
        if let Some(port) = port {
            attributes.push(("server.port", Value::Int(port)));
        }
        if end.resends > 0 {
            attributes.push(("http.request.resend_count", Value::Int(end.resends as i64)));
        }
        if let Some(status) = end.status {
            attributes.push(("http.response.status_code", Value::Int(i64::from(status))));
        }
        // A client span fails with a 4xx or 5xx answer, or without one.
        let error = match (end.error, end.status) {
            (Some(error), _) => Some(error.to_owned()),
            (None, Some(status)) if status >= 400 => Some(status.to_string()),
            (None, _) => None,
        };
        if let Some(error) = &error {
            attributes.push(("error.type", Value::String(error.clone())));
        }
        recording.tracer.exporter.send(FinishedSpan {
            client: true,
            name: recording.method().to_owned(),
            start: span.start,
            attributes,
            error,
            ..self.finished(recording, span.id, Some(self.span_id))
        });
    }

    /// Ends the request: its server span is exported when it is recorded.
    pub(crate) fn end(&self, end: RequestEnd<'_>) {
        let Some(recording) = &self.recording else {
            return;
        };
        let name = if end.route.is_empty() {
            recording.method().to_owned()
        } else {
            format!("{} {}", recording.method(), end.route)
        };
        let mut attributes = recording.method_attributes();
        attributes.extend([
            ("url.scheme", Value::String(end.scheme.to_owned())),
            ("url.path", Value::String(end.path.to_owned())),
            ("http.response.status_code", Value::Int(i64::from(end.status))),
            ("client.address", Value::String(end.client_ip.to_string())),
            (
                "floodgate.limit.outcome",
                Value::String(end.limit_outcome.to_owned()),
            ),
        ]);
        if !end.route.is_empty() {
            attributes.push(("http.route", Value::String(end.route.to_owned())));
        }
        // A server span fails with a 5xx answer (a 4xx is the client's).
        let error = (end.status >= 500).then(|| end.status.to_string());
        if let Some(error) = &error {
            attributes.push(("error.type", Value::String(error.clone())));
        }
        recording.tracer.exporter.send(FinishedSpan {
            name,
            start: recording.start,
            attributes,
            error,
            ..self.finished(recording, self.span_id, self.parent)
        });
    }

    /// A span of this request's trace ending now: `span`, child of `parent`; its kind,
    /// name, start and attributes for the caller to fill in.
    fn finished(&self, recording: &Recording, span: SpanId, parent: Option<SpanId>) -> FinishedSpan {
        FinishedSpan {
            trace_id: self.trace_id.0,
            span_id: span.0,
            parent_id: parent.map(|parent| parent.0),
            trace_state: recording.trace_state.clone(),
            flags: self.flags,
            client: false,
            name: String::new(),
            start: 0,
            end: unix_nanos(),
            attributes: Vec::new(),
            error: None,
        }
    }
}

/// The method as the semantic conventions name it: one of the standard methods, or
/// `_OTHER` (a client's own method would otherwise name spans).
fn known_method(method: &Method) -> &str {
    match *method {
        Method::GET
        | Method::HEAD
        | Method::POST
        | Method::PUT
        | Method::DELETE
        | Method::CONNECT
        | Method::OPTIONS
        | Method::TRACE
        | Method::PATCH => method.as_str(),
        _ => OTHER,
    }
}

const OTHER: &str = "_OTHER";

/// Every value of `name`, joined with commas.
fn joined(headers: &HeaderMap, name: &HeaderName) -> String {
    let values: Vec<&str> = headers
        .get_all(name)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .collect();
    values.join(",")
}

fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_tracing_a_new_trace_is_sampled_and_a_continued_one_keeps_its_flag() {
        let headers = HeaderMap::new();
        assert_eq!(
            RequestTrace::begin(&Method::GET, &headers, None, false).flags,
            SAMPLED
        );
        let mut headers = HeaderMap::new();
        headers.insert(
            &TRACEPARENT,
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
                .parse()
                .unwrap(),
        );
        let trace = RequestTrace::begin(&Method::GET, &headers, None, false);
        assert_eq!(trace.flags, 0);
        assert!(trace.continued());
    }

    #[test]
    fn methods_outside_the_standard_ones_are_other() {
        assert_eq!(known_method(&Method::PATCH), "PATCH");
        assert_eq!(known_method(&Method::from_bytes(b"PROPFIND").unwrap()), "_OTHER");
    }
}
