//! Forwarding to an upstream: its servers and their connection pools, which server a
//! request goes to, when a server is out of rotation, trying another server after a
//! failure, and the concurrency cap with its queue (docs/configuration.md#upstreamsname).
//!
//! A request takes a [`ServerSlot`] on one server before it is sent. With `max_requests`, slots
//! are counted under the queue's lock: a request that finds every server at its cap waits
//! in the queue (no polling: the request that frees a slot hands it to the first waiter
//! that can use it), and leaves it when its client goes or `queue_timeout` passes.
//!
//! Once sent, a request holds its slot and its concurrency-limit slots ([`Held`]) for as
//! long as the server works on it: until its response body is done, its tunnel closed
//! ([`tunnel`]), or it failed. When a cap counts the request (a concurrency limit, or
//! `max_requests`), a client that leaves does not end that: an exchange dropped before
//! the response head runs on in a task of its own ([`Pool::send`]), and a response dropped
//! before its end is read and discarded ([`detach::discard`]), each for at most the
//! upstream's `timeout`; only then are the slots given back.
//!
//! A reload that changes an upstream builds a new generation of it beside the old one,
//! which keeps its requests in flight (and its queue) until they end. Both count a
//! server's requests in one gauge, so a slot freed in one generation may be what a
//! request queued in the other waits for: the generations of one upstream share a
//! [`Lineage`], and a slot freed while several are alive wakes the others' queues.

mod attempt;
mod balance;
mod detach;
mod exchange;
pub(crate) mod fastcgi;
mod h1;
mod health;
mod idle;
pub(crate) mod names;
pub(crate) mod places;
pub(crate) mod pool;
pub(crate) mod read_ahead;
mod sending;
mod server;
mod tunnel;

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Either;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use rustls::RootCertStore;
use smallvec::SmallVec;
use tokio::sync::oneshot;
use tokio_rustls::TlsConnector;
use tokio_util::task::AbortOnDropHandle;

use crate::config::{
    Balance, KeyPart, ServerAddress, UpstreamConfig, UpstreamTls, server_name, tls_provider,
};
use crate::error::{GatewayError, UpstreamFailure};
use crate::limit::store::HeldSlots;
use crate::metrics::Metrics;
use crate::proxy::request_body::RequestBody;
use crate::trace::context::SpanId;
use crate::trace::{RequestTrace, TryEnd};
use attempt::{Try, Unsent};
use balance::Balancer;
use exchange::ExchangeError;
pub(crate) use fastcgi::FastCgiHead;
pub(crate) use h1::HttpHead;
use places::ConnectionPlaces;
use pool::{Pool, SendError};
use server::{Server, Transport};
pub(crate) use tunnel::tunnel;

/// A request's head as each try sends it, written once by the request path.
pub(crate) enum UpstreamHead {
    Http(HttpHead),
    FastCgi(FastCgiHead),
}

impl UpstreamHead {
    /// The span the head's `traceparent` names: the first try's.
    fn span(&self) -> Option<SpanId> {
        match self {
            UpstreamHead::Http(head) => head.span(),
            UpstreamHead::FastCgi(head) => head.span,
        }
    }
}

/// A request on its way to an upstream.
pub(crate) struct Outgoing {
    pub(crate) head: UpstreamHead,
    /// Whether the request may go to another server after one took it and failed:
    /// repeating it is harmless (an idempotent method, no body).
    pub(crate) repeatable: bool,
    pub(crate) body: RequestBody,
}

/// The servers a request has tried, by index.
type Tried = SmallVec<[usize; 4]>;

/// What the tries of one request tell its trace and its access record.
pub(crate) struct Tries<'a> {
    pub(crate) trace: &'a RequestTrace,
    /// The server of the last try, and its time until the response head (or the failure).
    pub(crate) last: Option<(Arc<str>, Duration)>,
    /// Set when a try starts sending the request to a server.
    pub(crate) reached_the_app: Option<Arc<AtomicBool>>,
}

impl<'a> Tries<'a> {
    pub(crate) fn new(trace: &'a RequestTrace) -> Self {
        Tries {
            trace,
            last: None,
            reached_the_app: None,
        }
    }
}

/// Forwards requests to one upstream's servers.
pub(crate) struct Upstream {
    pub(crate) config: Arc<UpstreamConfig>,
    name: Arc<str>,
    rotation: Arc<Rotation>,
    retries: Counter,
    failures: Failures,
    _checks: Option<AbortOnDropHandle<()>>,
}

impl Upstream {
    /// The runtime of `config`, counting in `metrics`; must run inside the runtime when
    /// the upstream has active health checks. `previous` is the generation it replaces
    /// in a reload, whose requests may still be in flight.
    /// Its connections take their places in `places`.
    pub(crate) fn new(
        config: Arc<UpstreamConfig>,
        metrics: &Metrics,
        places: &Arc<ConnectionPlaces>,
        previous: Option<&Upstream>,
    ) -> Self {
        let name: Arc<str> = Arc::from(config.name.as_str());
        let single = config.servers.len() == 1;
        let client_tls = config.tls.as_ref().map(client_tls);
        let servers: Vec<Server> = config
            .servers
            .iter()
            .map(|server| {
                let label: Arc<str> = Arc::from(server.address.label());
                let transport = match (&server.address, &config.fastcgi) {
                    (address, Some(_)) => Transport::FastCgi(fastcgi::Pool::new(
                        match address {
                            ServerAddress::Tcp(authority) => fastcgi::Address::Tcp(authority.to_string()),
                            ServerAddress::Unix(path) => fastcgi::Address::Unix(path.clone()),
                        },
                        config.connect_timeout,
                        (config.max_requests > 0).then_some(config.max_requests as usize),
                        places,
                    )),
                    (ServerAddress::Tcp(authority), None) => {
                        let tls = client_tls.as_ref().map(|connector| pool::Tls {
                            connector: connector.clone(),
                            // Validation made sure one of the two is there.
                            server_name: config
                                .tls
                                .as_ref()
                                .and_then(|tls| tls.server_name.clone())
                                .or_else(|| server_name(authority))
                                .expect("an https server has a name to check"),
                        });
                        Transport::Http(Pool::new(label.to_string(), config.connect_timeout, tls, places))
                    }
                    (ServerAddress::Unix(_), None) => {
                        unreachable!("only fastcgi:// servers are unix sockets")
                    }
                };
                Server::new(
                    label.clone(),
                    server.weight,
                    transport,
                    metrics.upstream_server(&name, &label),
                    // One server is never taken out: there would be nowhere else to go.
                    (config.max_fails > 0 && !single).then_some((config.max_fails, config.fail_timeout)),
                )
            })
            .collect();
        let gate = (config.max_requests > 0).then(|| Gate {
            max_requests: u64::from(config.max_requests),
            limit: config.queue as usize,
            timeout: config.queue_timeout,
            cap: AtomicU64::new(u64::from(config.max_requests)),
            waiting: Mutex::default(),
            depth: metrics.upstream_queue_depth(&name),
        });
        let lineage = previous.map_or_else(Arc::default, |previous| previous.rotation.lineage.clone());
        let rotation = Arc::new(Rotation {
            balancer: Balancer::new(&config.balance, &servers),
            servers,
            gate,
            timeout: config.timeout,
            lineage,
        });
        rotation.lineage.join(&rotation);
        let checks = config
            .health_check
            .clone()
            .map(|check| health::start(&rotation, check));
        Upstream {
            retries: metrics.upstream_retries(&name),
            failures: Failures::new(metrics, &name),
            name,
            rotation,
            config,
            _checks: checks,
        }
    }

    pub(crate) fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// How much of a response is read ahead of a slow client: with a cap or from PHP-FPM,
    /// unless `response_buffer` is 0.
    pub(crate) fn read_ahead(&self) -> Option<usize> {
        let capped = self.config.max_requests > 0 || self.config.fastcgi.is_some();
        (capped && self.config.response_buffer > 0).then_some(self.config.response_buffer)
    }

    /// The key parts that pick a server (`balance = "hash"`), if any.
    pub(crate) fn hash_key(&self) -> Option<&[KeyPart]> {
        match &self.config.balance {
            Balance::Hash(parts) => Some(parts),
            Balance::RoundRobin | Balance::LeastRequests => None,
        }
    }

    /// The request target (origin form) for `path` (already normalized) and `query` on
    /// this upstream, as the pieces it is written from: the base path, the path, and `?`
    /// and the query if there is one. Each piece is valid in a target as it is: the base
    /// path was parsed from the upstream's URL, the path and the query from the client's.
    pub(crate) fn target<'a>(&'a self, path: &'a str, query: Option<&'a str>) -> [&'a str; 4] {
        let (mark, query) = query.map_or(("", ""), |query| ("?", query));
        [&self.config.base_path, path, mark, query]
    }

    /// Sends `request` to a server and waits for the response headers, the upstream's
    /// `timeout` per try (as `upstream::exchange` counts it while a body goes out); after a failure, tries other servers as `retries`
    /// allows. `hash_tuple` is the request's `hash_key` tuple (with `balance = "hash"`);
    /// `instances` the live gateway instances that share `max_requests`; `limits` the
    /// request's concurrency-limit slots, held with its server slot from then on. Each try
    /// passes its own span on in `traceparent` and is told to `tries`.
    pub(crate) async fn send(
        &self,
        request: Outgoing,
        (hash_tuple, instances): (Option<&str>, u64),
        mut limits: HeldSlots,
        tries: &mut Tries<'_>,
    ) -> Result<Response<UpstreamBody>, GatewayError> {
        let trace = tries.trace;
        let affinity = hash_tuple.map(balance::affinity);
        let most = 1 + (self.config.retries as usize).min(self.rotation.servers.len() - 1);
        let Outgoing {
            head,
            repeatable,
            body,
        } = request;
        let mut body = Some(body);
        let mut tried_servers = Tried::new();
        let mut last_failure = None;
        for _ in 0..most {
            // A request that reached a server goes to another only when repeating it is
            // harmless: an idempotent method without a body.
            let Some(this_body) = body.take().or_else(|| repeatable.then(RequestBody::empty)) else {
                break;
            };
            let slot = match self.rotation.acquire(affinity, &tried_servers, instances).await {
                Ok(slot) => slot,
                // Nowhere left to try: the last failure is the answer.
                Err(UpstreamFailure::NoServer) if last_failure.is_some() => break,
                Err(kind) => {
                    self.failures.get(kind).inc();
                    return Err(self.failure(kind, "no server could take the request".into()));
                }
            };
            if !tried_servers.is_empty() {
                self.retries.inc();
            }
            tried_servers.push(slot.index);
            let server = &self.rotation.servers[slot.index];
            let held = Held { server: slot, limits };
            let counted = held.counted();
            let mut held = Some(held);
            let timeout = self.config.timeout;
            // The first try names the span its head was written with: the head then
            // goes as it is, where each later try's is a copy naming its own.
            let span = match head.span() {
                Some(id) if tried_servers.len() == 1 => trace.begin_try_as(id),
                _ => trace.begin_try(),
            };
            let started = Instant::now();
            let deadline = tokio::time::Instant::from_std(started) + timeout;
            let plan = Try {
                span: &span.id,
                body: this_body,
                repeatable,
                deadline,
                timeout,
                keep: &mut held,
                detach: counted,
                reached: tries.reached_the_app.as_deref(),
            };
            let tried = match (&server.transport, &head) {
                (Transport::Http(pool), UpstreamHead::Http(head)) => match pool.send(head, plan).await {
                    Ok(response) => Ok(response.map(Either::Left)),
                    Err(Unsent { error, body }) => Err((classify(error)?, body)),
                },
                (Transport::FastCgi(pool), UpstreamHead::FastCgi(head)) => {
                    match pool.send(head, plan).await {
                        Ok(response) => Ok(response.map(Either::Right)),
                        Err(Unsent { error, body }) => Err((classify_fastcgi(error)?, body)),
                    }
                }
                // Validation gives a site's PHP only FastCGI servers, and them only to it.
                _ => Err((
                    (
                        UpstreamFailure::Connect,
                        Failed::of_server_saying("a server of another protocol".to_owned()),
                    ),
                    None,
                )),
            };
            let held = held.expect("taken only by an exchange whose client left");
            let elapsed = started.elapsed();
            tries.last = Some((server.label.clone(), elapsed));
            let mut end = TryEnd {
                server: &server.label,
                resends: tried_servers.len() - 1,
                status: None,
                error: None,
            };
            let ((kind, detail), unsent) = match tried {
                Ok(response) => {
                    server.duration.observe(elapsed);
                    end.status = Some(response.status().as_u16());
                    trace.end_try(span, end);
                    server.succeeded();
                    return Ok(response.map(|inner| UpstreamBody {
                        inner: Some(inner),
                        held: Some(held),
                    }));
                }
                Err(failed) => failed,
            };
            end.error = Some(kind.label());
            trace.end_try(span, end);
            // The server slot goes back with the rest of `held`; another try takes another.
            limits = held.limits;
            self.failures.get(kind).inc();
            let failure = self.failure(kind, format!("{}: {}", server.label, detail.text));
            if !detail.server_failed {
                return Err(failure);
            }
            server.failed(Instant::now());
            last_failure = Some(failure);
            body = unsent;
        }
        Err(last_failure.unwrap_or_else(|| self.failure(UpstreamFailure::NoServer, "no server tried".into())))
    }

    /// The error of a response this upstream gave that cannot be passed on (`detail` says
    /// why), counted as its `kind` of failure.
    pub(crate) fn unrelayable(&self, kind: UpstreamFailure, detail: String) -> GatewayError {
        self.failures.get(kind).inc();
        self.failure(kind, detail)
    }

    fn failure(&self, kind: UpstreamFailure, detail: String) -> GatewayError {
        GatewayError::Upstream {
            upstream: self.name.clone(),
            kind,
            detail,
        }
    }
}

/// The TLS client for an upstream's `https://` servers: its `tls_ca` or the system's
/// roots, HTTP/1.1 by ALPN. Certificate checking cannot be turned off.
fn client_tls(tls: &UpstreamTls) -> TlsConnector {
    let mut roots = RootCertStore::empty();
    match &tls.roots {
        Some(certificates) => {
            roots.add_parsable_certificates(certificates.iter().cloned());
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            for error in &native.errors {
                tracing::warn!(%error, "a system root certificate could not be loaded");
            }
            roots.add_parsable_certificates(native.certs);
        }
    }
    let mut config = rustls::ClientConfig::builder_with_provider(tls_provider())
        .with_safe_default_protocol_versions()
        .expect("the provider supports TLS 1.2 and 1.3")
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    TlsConnector::from(Arc::new(config))
}

/// Methods whose repetition has the effect of one request (RFC 9110 §9.2.2).
pub(crate) fn idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}

/// What a failed try tells, for the log and for the server's health.
struct Failed {
    text: String,
    /// Whether the server failed: counted against it, and the request tried on another.
    /// Not when it answered, but with a head that cannot be relayed (a PHP script's): the
    /// application's answer, which another server would give again.
    server_failed: bool,
}

impl Failed {
    fn of_server(error: &dyn std::error::Error) -> Failed {
        Failed::of_server_saying(detail(error))
    }

    fn of_server_saying(text: String) -> Failed {
        Failed {
            text,
            server_failed: true,
        }
    }
}

/// A failure of the try (`Ok`), or of the client's request body or of this process
/// (`Err`, answered as it is: no other server would do better, and the server did not
/// fail: out of descriptors, floodgate could not open a connection to any).
fn classify(error: SendError) -> Result<(UpstreamFailure, Failed), GatewayError> {
    match &error {
        SendError::Connect { source, .. } if crate::room::exhausted(source) => {
            Err(GatewayError::OutOfDescriptors)
        }
        SendError::NoPlace => Ok(no_place(&error)),
        SendError::Connect { .. } | SendError::ConnectTimeout(_) => {
            Ok((UpstreamFailure::Connect, Failed::of_server(&error)))
        }
        SendError::Tls { .. } => Ok((UpstreamFailure::Tls, Failed::of_server(&error))),
        SendError::Timeout => Ok(timed_out()),
        SendError::Exchange(ExchangeError::Body(body_error)) => Err(body_error.answer(detail(&error))),
        SendError::Exchange(_) => Ok((UpstreamFailure::Reset, Failed::of_server(&error))),
    }
}

/// [`classify`] for a FastCGI server.
fn classify_fastcgi(error: fastcgi::FastCgiError) -> Result<(UpstreamFailure, Failed), GatewayError> {
    use fastcgi::{ExchangeError, FastCgiError};
    match &error {
        FastCgiError::Connect { source, .. } if crate::room::exhausted(source) => {
            Err(GatewayError::OutOfDescriptors)
        }
        FastCgiError::NoPlace => Ok(no_place(&error)),
        FastCgiError::Connect { .. } | FastCgiError::ConnectTimeout(_) => {
            Ok((UpstreamFailure::Connect, Failed::of_server(&error)))
        }
        FastCgiError::Timeout => Ok(timed_out()),
        FastCgiError::Exchange(ExchangeError::Body(body_error)) => Err(body_error.answer(detail(&error))),
        // PHP-FPM answered in FastCGI; the script's head is what cannot be relayed.
        FastCgiError::Exchange(ExchangeError::Malformed(_)) => Ok((
            UpstreamFailure::Reset,
            Failed {
                text: detail(&error),
                server_failed: false,
            },
        )),
        FastCgiError::Exchange(_) => Ok((UpstreamFailure::Reset, Failed::of_server(&error))),
    }
}

/// No place for a new connection: floodgate's failure, not the server's.
fn no_place(error: &dyn std::error::Error) -> (UpstreamFailure, Failed) {
    (
        UpstreamFailure::NoPlace,
        Failed {
            text: detail(error),
            server_failed: false,
        },
    )
}

fn timed_out() -> (UpstreamFailure, Failed) {
    (
        UpstreamFailure::Timeout,
        Failed::of_server_saying("no response headers in time".to_owned()),
    )
}

/// The error and its causes on one line, for the log; a cause whose text an error
/// already ends with (as `thiserror` messages with `{source}` do) is not repeated.
fn detail(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// `floodgate_upstream_errors_total` of one upstream, by kind.
struct Failures([Counter; UpstreamFailure::ALL.len()]);

impl Failures {
    fn new(metrics: &Metrics, upstream: &Arc<str>) -> Self {
        Failures(UpstreamFailure::ALL.map(|kind| metrics.upstream_errors(upstream, kind.label())))
    }

    fn get(&self, kind: UpstreamFailure) -> &Counter {
        &self.0[kind as usize]
    }
}

/// An upstream's servers, how one is picked, and the queue for them: what the requests
/// in flight share, and what a reload keeps when the upstream did not change.
struct Rotation {
    servers: Vec<Server>,
    balancer: Balancer,
    /// With `max_requests`.
    gate: Option<Gate>,
    /// The upstream's `timeout`, also the longest the rest of a response whose client
    /// left is read for.
    timeout: Duration,
    lineage: Arc<Lineage>,
}

impl Drop for Rotation {
    fn drop(&mut self) {
        self.lineage.leave();
    }
}

/// The generations of one upstream that are alive: the current one, and those a reload
/// replaced that still have requests.
#[derive(Default)]
struct Lineage {
    generations: Mutex<Vec<Weak<Rotation>>>,
    /// Whether more than one is alive: only then does a freed slot concern the others.
    several: AtomicBool,
}

impl Lineage {
    fn lock(&self) -> MutexGuard<'_, Vec<Weak<Rotation>>> {
        self.generations.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn join(&self, rotation: &Arc<Rotation>) {
        self.update(|generations| generations.push(Arc::downgrade(rotation)));
    }

    /// A generation is gone (its weak reference no longer upgrades).
    fn leave(&self) {
        self.update(|_| {});
    }

    /// Applies `change` to the live generations, then says whether several are.
    fn update(&self, change: impl FnOnce(&mut Vec<Weak<Rotation>>)) {
        let mut generations = self.lock();
        generations.retain(|generation| generation.strong_count() > 0);
        change(&mut generations);
        self.several.store(generations.len() > 1, Ordering::SeqCst);
    }

    /// A slot of `freed` was given back to its server: the other generations' queued
    /// requests may take it.
    #[cold]
    fn serve_others(&self, freed: &Rotation) {
        // Upgraded under the lock, served (and maybe dropped, which locks) after it.
        let others: SmallVec<[Arc<Rotation>; 2]> = self
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|generation| !std::ptr::eq(Arc::as_ptr(generation), freed))
            .collect();
        for generation in others {
            generation.serve_queue();
        }
    }
}

/// The concurrency cap and its queue.
struct Gate {
    max_requests: u64,
    /// Requests that may wait.
    limit: usize,
    timeout: Duration,
    /// `max_requests` for this instance: divided by the live instance count.
    cap: AtomicU64,
    waiting: Mutex<Waiting>,
    /// `floodgate_upstream_queue_depth`.
    depth: Gauge,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Default)]
struct Waiting {
    queue: VecDeque<Waiter>,
    next_id: u64,
}

/// A request waiting for a slot.
struct Waiter {
    id: u64,
    affinity: Option<u64>,
    tried: Tried,
    /// Where the index of the server whose slot it gets is sent.
    handoff: oneshot::Sender<usize>,
}

impl Rotation {
    /// A slot on a server that `tried` does not name: at once when one is free, else
    /// after waiting in the queue (with a cap).
    async fn acquire(
        self: &Arc<Self>,
        affinity: Option<u64>,
        tried: &Tried,
        instances: u64,
    ) -> Result<ServerSlot, UpstreamFailure> {
        let Some(gate) = &self.gate else {
            let index = self.take(affinity, tried, u64::MAX)?;
            return Ok(ServerSlot {
                rotation: self.clone(),
                index,
            });
        };
        let cap = gate.max_requests.div_ceil(instances.max(1));
        // Written only when the instance count changed it: every request reads it.
        if gate.cap.load(Ordering::Relaxed) != cap {
            gate.cap.store(cap, Ordering::Relaxed);
        }
        let (id, handoff) = {
            let mut waiting = gate.lock();
            match self.take(affinity, tried, cap) {
                Ok(index) => {
                    return Ok(ServerSlot {
                        rotation: self.clone(),
                        index,
                    });
                }
                Err(UpstreamFailure::QueueFull) => {}
                Err(other) => return Err(other),
            }
            if waiting.queue.len() >= gate.limit {
                return Err(UpstreamFailure::QueueFull);
            }
            let (sender, receiver) = oneshot::channel();
            let id = waiting.next_id;
            waiting.next_id += 1;
            waiting.queue.push_back(Waiter {
                id,
                affinity,
                tried: tried.clone(),
                handoff: sender,
            });
            gate.depth.inc();
            (id, receiver)
        };
        let mut queued = Queued {
            rotation: self.clone(),
            id,
            handoff: Some(handoff),
        };
        let waited = tokio::time::timeout(gate.timeout, queued.handoff.as_mut().expect("set above")).await;
        match waited {
            Ok(Ok(index)) => {
                queued.handoff = None;
                Ok(ServerSlot {
                    rotation: self.clone(),
                    index,
                })
            }
            Ok(Err(_)) | Err(_) => Err(UpstreamFailure::QueueTimeout),
        }
    }

    /// Counts a request in flight on an available server below `cap`: `NoServer` when
    /// none is available, `QueueFull` when every available one is at its cap. A keyed
    /// request (`hash`) goes to its key's server or waits for it, so that a session stays
    /// on its server when that server is busiest too.
    fn take(&self, affinity: Option<u64>, tried: &Tried, cap: u64) -> Result<usize, UpstreamFailure> {
        // No cap, no server tried or troubled: round robin's turn needs no look at each.
        if cap == u64::MAX
            && tried.is_empty()
            && self.servers.iter().all(Server::untroubled)
            && let Some(index) = self.balancer.turn(self.servers.len())
        {
            self.servers[index].in_flight.inc();
            return Ok(index);
        }
        // Read once the fast path is ruled out: only a troubled server's health needs it.
        let now = Instant::now();
        let mut skip = tried.clone();
        loop {
            let picked = match affinity {
                Some(_) => self
                    .balancer
                    .pick(&self.servers, affinity, |i| {
                        !skip.contains(&i) && self.servers[i].available(now)
                    })
                    .filter(|&i| self.servers[i].load() < cap),
                None => self.balancer.pick(&self.servers, affinity, |i| {
                    !skip.contains(&i) && self.servers[i].load() < cap && self.servers[i].available(now)
                }),
            };
            match picked {
                Some(index) if self.servers[index].claim(now) => {
                    self.servers[index].in_flight.inc();
                    return Ok(index);
                }
                // Its one trial request went to another request meanwhile.
                Some(index) => skip.push(index),
                None => {
                    let any = (0..self.servers.len())
                        .any(|i| !tried.contains(&i) && self.servers[i].available(now));
                    return Err(if any {
                        UpstreamFailure::QueueFull
                    } else {
                        UpstreamFailure::NoServer
                    });
                }
            }
        }
    }

    /// Gives back a slot on server `index`: to the first waiter that can use it, or to
    /// the server, where another generation's waiters may take it.
    fn release(&self, index: usize) {
        if self.hand_over(index) {
            return;
        }
        if self.lineage.several.load(Ordering::SeqCst) {
            self.lineage.serve_others(self);
        }
    }

    /// Hands a slot on server `index` to the first waiter that can use it, or gives it
    /// back to the server (under the queue's lock, so that no request queues meanwhile
    /// for a slot about to be free): true for the waiter.
    fn hand_over(&self, index: usize) -> bool {
        let server = &self.servers[index];
        let Some(gate) = &self.gate else {
            server.in_flight.dec();
            return false;
        };
        let mut waiting = gate.lock();
        if server.load() <= gate.cap.load(Ordering::Relaxed) && server.in_rotation() {
            while let Some(position) = waiting.queue.iter().position(|w| self.accepts(w, index)) {
                let Some(waiter) = waiting.queue.remove(position) else {
                    break;
                };
                gate.depth.dec();
                if waiter.handoff.send(index).is_ok() {
                    return true;
                }
            }
        }
        server.in_flight.dec();
        false
    }

    /// Gives each waiter, in order, a slot if one is free for it now: after another
    /// generation freed one.
    fn serve_queue(&self) {
        let Some(gate) = &self.gate else {
            return;
        };
        let cap = gate.cap.load(Ordering::Relaxed);
        let mut waiting = gate.lock();
        let mut position = 0;
        while let Some(waiter) = waiting.queue.get(position) {
            let Ok(index) = self.take(waiter.affinity, &waiter.tried, cap) else {
                position += 1;
                continue;
            };
            let waiter = waiting.queue.remove(position).expect("looked at above");
            gate.depth.dec();
            if waiter.handoff.send(index).is_err() {
                self.servers[index].in_flight.dec();
            }
        }
    }

    /// Whether `waiter` would go to server `index`: one it has not tried, and for a
    /// hashed request, its key's server.
    fn accepts(&self, waiter: &Waiter, index: usize) -> bool {
        if waiter.tried.contains(&index) {
            return false;
        }
        match waiter.affinity {
            None => true,
            Some(affinity) => {
                let own = self.balancer.pick(&self.servers, Some(affinity), |i| {
                    !waiter.tried.contains(&i) && self.servers[i].in_rotation()
                });
                own == Some(index)
            }
        }
    }
}

/// A request in the queue; dropped (its client left, or it timed out) before it got a
/// slot, it leaves the queue, and a slot handed to it meanwhile goes back.
struct Queued {
    rotation: Arc<Rotation>,
    id: u64,
    /// `None` once the slot is taken.
    handoff: Option<oneshot::Receiver<usize>>,
}

impl Drop for Queued {
    fn drop(&mut self) {
        let Some(mut handoff) = self.handoff.take() else {
            return;
        };
        let Some(gate) = &self.rotation.gate else {
            return;
        };
        {
            let mut waiting = gate.lock();
            if let Some(position) = waiting.queue.iter().position(|w| w.id == self.id) {
                waiting.queue.remove(position);
                gate.depth.dec();
                return;
            }
        }
        // Out of the queue: a slot was handed over before the wait ended.
        if let Ok(index) = handoff.try_recv() {
            self.rotation.release(index);
        }
    }
}

/// A request's place on one server, held until its response body is done.
pub(crate) struct ServerSlot {
    rotation: Arc<Rotation>,
    index: usize,
}

impl Drop for ServerSlot {
    fn drop(&mut self) {
        self.rotation.release(self.index);
    }
}

/// What a request sent to a server holds while the server works on it: its place on the
/// server and its concurrency-limit slots. Dropped, they are given back.
pub(crate) struct Held {
    server: ServerSlot,
    limits: HeldSlots,
}

impl Held {
    /// Whether a cap counts the request (a concurrency limit, or `max_requests`): only
    /// then does it outlive a client that leaves. Without one nothing waits for its
    /// slots, and the upstream connection is closed at once.
    fn counted(&self) -> bool {
        !self.limits.is_empty() || self.server.rotation.gate.is_some()
    }
}

/// A response body from an upstream server, with what its request holds. Read to its
/// end, its connection goes back to the pool and its slots to the next requests; dropped
/// before (its client left) while a cap counts the request, the rest is read and
/// discarded in the background first.
pub(crate) struct UpstreamBody {
    /// Taken when dropped.
    inner: Option<Transported>,
    /// Taken by a tunnel, which holds it until it closes.
    held: Option<Held>,
}

/// A response body as its server's protocol carries it.
type Transported = Either<pool::UpstreamBody, fastcgi::FastCgiBody>;

impl UpstreamBody {
    /// The server's connection after a protocol switch, with what it sent past its `101`.
    pub(crate) fn take_switched(&mut self) -> Option<pool::Connection> {
        match self.inner.as_mut()? {
            Either::Left(body) => body.take_switched(),
            Either::Right(_) => None,
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match &mut self.inner {
            Some(inner) => Pin::new(inner).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // Finished, or uncounted: the fields are dropped in order, the connection first.
        match (&self.inner, &self.held) {
            (Some(body), Some(held)) if !body.is_end_stream() && held.counted() => {}
            _ => return,
        }
        let (Some(body), Some(held)) = (self.inner.take(), self.held.take()) else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let timeout = held.server.rotation.timeout;
            runtime.spawn(detach::discard(body, held, timeout));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_is_written_once() {
        let refused = || std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let error = SendError::Connect {
            address: "127.0.0.1:9".into(),
            source: refused(),
        };
        let text = detail(&error);
        assert_eq!(text, format!("cannot connect to 127.0.0.1:9: {}", refused()));
    }

    #[test]
    fn a_connect_floodgate_has_no_descriptor_for_is_not_the_servers_failure() {
        let connect = |source| SendError::Connect {
            address: "127.0.0.1:9".into(),
            source,
        };
        let exhausted = classify(connect(std::io::Error::from_raw_os_error(libc::EMFILE)));
        assert!(matches!(exhausted, Err(GatewayError::OutOfDescriptors)));
        // Nor one that found no place free (`server.max_connections`), whatever it speaks.
        assert!(matches!(
            classify(SendError::NoPlace),
            Ok((
                UpstreamFailure::NoPlace,
                Failed {
                    server_failed: false,
                    ..
                }
            ))
        ));
        assert!(matches!(
            classify_fastcgi(fastcgi::FastCgiError::NoPlace),
            Ok((
                UpstreamFailure::NoPlace,
                Failed {
                    server_failed: false,
                    ..
                }
            ))
        ));
        let refused = classify(connect(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        assert!(matches!(
            refused,
            Ok((
                UpstreamFailure::Connect,
                Failed {
                    server_failed: true,
                    ..
                }
            ))
        ));
    }
}
