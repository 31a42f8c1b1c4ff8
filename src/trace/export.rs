//! Sending finished spans to the collector (OTLP/HTTP, protobuf) off the request path: the
//! request path puts a span in a bounded queue and never waits; one task takes them in
//! batches and posts each batch with a timeout. What cannot be queued (the queue is full)
//! or sent (the collector failed or took too long) is dropped and counted in
//! `floodgate_trace_spans_dropped_total`.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Uri, header};
use http_body_util::{BodyExt as _, Full};
use prometheus_client::metrics::counter::Counter;
use prost::Message as _;
use tokio::sync::{mpsc, oneshot};

use super::otlp;
use crate::config::TracingConfig;
use crate::outbound::OneShot;

/// Spans waiting for export at most; more are dropped.
const QUEUE: usize = 2048;
/// Spans sent in one request at most.
const MAX_BATCH: usize = 512;
/// How long a batch waits for more spans after its first.
const BATCH_DELAY: Duration = Duration::from_secs(1);
/// How long one export may take, connecting included.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// Failed exports are logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// A finished span, as the request path hands it over.
#[derive(Debug)]
pub(crate) struct FinishedSpan {
    pub(crate) trace_id: [u8; 16],
    pub(crate) span_id: [u8; 8],
    pub(crate) parent_id: Option<[u8; 8]>,
    pub(crate) trace_state: String,
    pub(crate) flags: u8,
    pub(crate) client: bool,
    pub(crate) name: String,
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) attributes: Vec<(&'static str, otlp::Value)>,
    /// Why the span failed, if it did.
    pub(crate) error: Option<String>,
}

/// What the export queue carries: spans, and requests to send what came before now.
enum Queued {
    Span(FinishedSpan),
    /// Send every span queued before this one, then say so.
    Flush(oneshot::Sender<()>),
}

/// The sending end of the export queue.
pub(crate) struct Exporter {
    queue: mpsc::Sender<Queued>,
    dropped: Counter,
}

impl Exporter {
    /// Starts the export task for `config` (inside the runtime); it ends once every
    /// [`Exporter`] is gone and the queue is sent.
    pub(crate) fn start(config: &TracingConfig, dropped: Counter) -> Exporter {
        let (queue, spans) = mpsc::channel(QUEUE);
        let collector = Collector::new(config);
        tokio::spawn(export(spans, collector, resource(config), dropped.clone()));
        Exporter { queue, dropped }
    }

    /// Queues `span`, or drops and counts it when the queue is full.
    pub(crate) fn send(&self, span: FinishedSpan) {
        if self.queue.try_send(Queued::Span(span)).is_err() {
            self.dropped.inc();
        }
    }

    /// Sends every span queued so far, waiting at most `within`; what is still queued
    /// then is counted as dropped.
    pub(crate) async fn flush(&self, within: Duration) {
        let (done, sent) = oneshot::channel();
        let flushed = tokio::time::timeout(within, async {
            if self.queue.send(Queued::Flush(done)).await.is_ok() {
                let _ = sent.await;
            }
        })
        .await;
        if flushed.is_err() {
            let queued = self.queue.max_capacity() - self.queue.capacity();
            self.dropped.inc_by(queued as u64);
        }
    }
}

/// The resource every span belongs to: this service.
fn resource(config: &TracingConfig) -> otlp::Resource {
    otlp::Resource {
        attributes: vec![
            otlp::KeyValue::new("service.name", otlp::Value::String(config.service_name.clone())),
            otlp::KeyValue::new(
                "service.version",
                otlp::Value::String(env!("CARGO_PKG_VERSION").to_owned()),
            ),
        ],
    }
}

/// Takes spans from `queue` in batches: a batch goes when it is full, `BATCH_DELAY` after
/// its first span, or at once when a flush asks.
async fn export(
    mut queue: mpsc::Receiver<Queued>,
    collector: Collector,
    resource: otlp::Resource,
    dropped: Counter,
) {
    let mut received = Vec::with_capacity(MAX_BATCH);
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut flushes = Vec::new();
    let mut logged: Option<Instant> = None;
    loop {
        if queue.recv_many(&mut received, MAX_BATCH).await == 0 {
            return;
        }
        let deadline = tokio::time::Instant::now() + BATCH_DELAY;
        loop {
            for queued in received.drain(..) {
                match queued {
                    Queued::Span(span) => batch.push(span),
                    Queued::Flush(done) => flushes.push(done),
                }
            }
            if batch.len() >= MAX_BATCH || !flushes.is_empty() {
                break;
            }
            let more = MAX_BATCH - batch.len();
            match tokio::time::timeout_at(deadline, queue.recv_many(&mut received, more)).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        if batch.is_empty() {
            flushes.drain(..).for_each(|done| {
                let _ = done.send(());
            });
            continue;
        }
        let count = batch.len() as u64;
        let body = encode(std::mem::take(&mut batch), &resource);
        batch.reserve(MAX_BATCH);
        let sent = match tokio::time::timeout(EXPORT_TIMEOUT, collector.post(body)).await {
            Ok(sent) => sent,
            Err(_) => Err(format!("no answer within {}s", EXPORT_TIMEOUT.as_secs())),
        };
        if let Err(error) = sent {
            dropped.inc_by(count);
            if logged.is_none_or(|at| at.elapsed() >= LOG_EVERY) {
                logged = Some(Instant::now());
                tracing::warn!(collector = %collector.url, %error, spans = count, "trace spans could not be exported; dropped");
            }
        }
        flushes.drain(..).for_each(|done| {
            let _ = done.send(());
        });
    }
}

/// `spans` as the body of an export request.
fn encode(spans: Vec<FinishedSpan>, resource: &otlp::Resource) -> Bytes {
    let spans = spans
        .into_iter()
        .map(|span| otlp::Span {
            trace_id: span.trace_id.to_vec(),
            span_id: span.span_id.to_vec(),
            trace_state: span.trace_state,
            parent_span_id: span.parent_id.map(|id| id.to_vec()).unwrap_or_default(),
            name: span.name,
            kind: if span.client {
                otlp::KIND_CLIENT
            } else {
                otlp::KIND_SERVER
            },
            start_time_unix_nano: span.start,
            end_time_unix_nano: span.end,
            attributes: span
                .attributes
                .into_iter()
                .map(|(key, value)| otlp::KeyValue::new(key, value))
                .collect(),
            status: span.error.map(|message| otlp::Status {
                message,
                code: otlp::STATUS_ERROR,
            }),
            flags: u32::from(span.flags),
        })
        .collect();
    let request = otlp::ExportTraceServiceRequest {
        resource_spans: vec![otlp::ResourceSpans {
            resource: Some(resource.clone()),
            scope_spans: vec![otlp::ScopeSpans {
                scope: Some(otlp::InstrumentationScope {
                    name: "floodgate".to_owned(),
                    version: env!("CARGO_PKG_VERSION").to_owned(),
                }),
                spans,
            }],
        }],
    };
    Bytes::from(request.encode_to_vec())
}

/// Where batches go: the collector's `/v1/traces`, over a connection of its own per batch
/// (at most one batch a second is sent unless the queue is busy).
struct Collector {
    url: Uri,
    client: OneShot,
}

impl Collector {
    fn new(config: &TracingConfig) -> Collector {
        let endpoint = &config.endpoint;
        let path = format!("{}/v1/traces", endpoint.path().trim_end_matches('/'));
        let url = Uri::builder()
            .scheme(endpoint.scheme_str().unwrap_or("http"))
            .authority(
                endpoint
                    .authority()
                    .expect("validated: the endpoint has a host")
                    .as_str(),
            )
            .path_and_query(path)
            .build()
            .expect("built from a valid URL");
        let client = if endpoint.scheme_str() == Some("https") {
            OneShot::with_native_roots()
        } else {
            OneShot::new(rustls::RootCertStore::empty())
        };
        Collector { url, client }
    }

    async fn post(&self, body: Bytes) -> Result<(), String> {
        let request = Request::post(self.url.clone())
            .header(header::CONTENT_TYPE, "application/x-protobuf")
            .body(Full::new(body))
            .map_err(|error| error.to_string())?;
        let response = self.client.send(request).await?;
        let status = response.status();
        // Read to the end: the collector's answer says nothing floodgate acts on.
        let _ = response.into_body().collect().await;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("the collector answered {status}"))
        }
    }
}
