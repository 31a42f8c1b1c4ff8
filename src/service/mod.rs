//! The request path, in named phases:
//!
//! ```text
//! request → normalize path → route → client_ip → limits (one store call; reject, hold, or
//!         pass) → respond | forward upstream → rewrite response headers, add rate-limit
//!         headers → stream body → access log + metrics
//! ```
//!
//! [`handle`] is the outer handler: it never fails, renders a [`GatewayError`] into a
//! response in exactly one place, and attaches the access record to the response body.
//! [`serve`] is the inner one and returns `Result`.

use std::borrow::Cow;
use std::convert::Infallible;
#[cfg(test)]
use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use futures_util::FutureExt as _;
use http::header::{self, HeaderValue};
use http::request::Parts;
use http::{Method, Request, Response, Uri};
use http_body_util::{BodyExt as _, Collected};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;

pub mod limit_headers;
pub(crate) mod limits;
mod own_answer;
pub(crate) mod request_head;
mod request_id;
pub mod request_key;
mod response_body;
mod site;
pub(crate) mod state;

use crate::access_log::AccessRecord;
use crate::client_ip::{Peer, client_ip};
use crate::compression::Accepted;
use crate::config::{
    CombinedRules, Php, RespondConfig, RouteConfig, ServerConfig, TemplatePart, ValueTemplate,
};
use crate::connection::InFlight;
use crate::connection::disconnect::ClientSocket;
use crate::connection::fold;
use crate::connection::framing::HeadRefusal;
use crate::error::{CLIENT_CLOSED_REQUEST, GatewayError, UpstreamFailure};
use crate::files::choice::Script;
use crate::host::normalize_host;
use crate::limit::store::{HeldSlots, Unit};
use crate::metrics::Metrics;
use crate::path::{normalize_path, slashes_decoded};
use crate::proxy::headers::{
    AsForwarded, ForwardingContext, apply_rules, remove_hop_by_hop, requested_upgrade,
    set_forwarding_headers, switches_as_asked,
};
use crate::proxy::request_body::RequestBody;
use crate::room::Room;
use crate::trace::context::SpanId;
use crate::trace::{RequestTrace, TRACESTATE};
use crate::upstream::read_ahead::ReadAhead;
use crate::upstream::{HttpHead, Outgoing, Tries, Upstream, UpstreamHead, idempotent, tunnel};
use http_body::Body as _;
use limit_headers::LimitHeaders;
use limits::{Action, LimitSettings};
use own_answer::OwnAnswer;
use request_head::InvalidNames;
use request_key::{KeySource, key_tuple};
use response_body::{Payload, ResponseBody, full};
use state::{GatewayState, Target};

/// State shared by every connection of one gateway instance.
pub struct Instance {
    pub(crate) state: ArcSwap<GatewayState>,
    pub(crate) metrics: Arc<Metrics>,
    /// Set from the first shutdown signal on; `/readyz` answers 503.
    pub(crate) draining: AtomicBool,
    /// The route label of requests no route matched.
    no_route: Arc<str>,
    /// The HTTPS listener's port, for `redirect_http`.
    https_port: Option<u16>,
    /// The open files and the memory requests may hold beyond their connections.
    room: Room,
}

impl Instance {
    /// `state` was built counting in `metrics`.
    pub(crate) fn new(
        state: GatewayState,
        metrics: Arc<Metrics>,
        https_port: Option<u16>,
        room: Room,
    ) -> Self {
        Instance {
            state: ArcSwap::from_pointee(state),
            metrics,
            draining: AtomicBool::new(false),
            no_route: Arc::from(""),
            https_port,
            room,
        }
    }

    /// Live gateway instances sharing the store's limits, as last seen (1 without Redis).
    pub fn instances(&self) -> u64 {
        self.state.load().store.instances()
    }

    /// Counts and logs a request head from `peer` that hyper could not parse and answered
    /// itself with `status` (its automatic `400`, without a body: a head the framing
    /// guard reads as hyper does not, which the guard leaves to hyper): `-` for its method
    /// and path.
    pub(crate) fn record_unparsed_head(&self, peer: &Peer, status: u16) {
        let mut record = self.unparsed_head_record(peer, RequestTrace::unrecorded());
        record.status = status;
        record.finish(0);
    }

    /// floodgate's answer to a request head from `peer` that the framing guard refused
    /// before hyper read it, as the bytes of an HTTP/1.1 response that closes the
    /// connection: the error's one-line body (or its `[server.errors]` page), the server's
    /// response rules, HSTS and a new request ID, as every answer of floodgate's has. It is
    /// counted and logged, with `-` for its method and path.
    pub(crate) fn answer_unparsed_head(&self, peer: &Peer, refusal: HeadRefusal) -> Bytes {
        let state = self.state.load();
        let trace = RequestTrace::unrecorded();
        let request_id = state
            .config
            .server
            .request_id
            .as_ref()
            .map(|name| request_id::decide(name, &http::HeaderMap::new(), false, &trace));
        let mut record = self.unparsed_head_record(peer, trace);
        record.request_id = request_id;
        let error = match refusal {
            HeadRefusal::Ambiguous => {
                GatewayError::AmbiguousFraming("Content-Length with Transfer-Encoding, or twice")
            }
            HeadRefusal::Malformed => GatewayError::MalformedRequest("a request head that cannot be parsed"),
            HeadRefusal::TooLarge => GatewayError::HeadersTooLarge,
        };
        let mut response = own_answer::render(
            error.into(),
            &record,
            http::Version::HTTP_11,
            &state.config.server.errors,
        );
        apply_rules(&state.config.server.response_headers, response.headers_mut());
        mark_own(
            response.headers_mut(),
            &state,
            peer.tls,
            record.request_id.as_ref(),
        );
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        let (head, body) = response.into_parts();
        let body = body
            .collect()
            .now_or_never()
            .and_then(Result::ok)
            .map(Collected::to_bytes)
            .unwrap_or_default();
        record.status = head.status.as_u16();
        let message = http1_message(&head, &body);
        record.finish(body.len() as u64);
        message
    }

    fn unparsed_head_record(&self, peer: &Peer, trace: RequestTrace) -> AccessRecord {
        let method = Method::from_bytes(b"-").expect("- is a token");
        let mut record = AccessRecord::new(
            self.metrics.clone(),
            Instant::now(),
            (method, peer.scheme()),
            peer.ip,
            trace,
            self.no_route.clone(),
        );
        record.path = "-".to_owned();
        record
    }
}

/// A response floodgate writes itself, with its `Content-Length` and `Date`.
fn http1_message(head: &http::response::Parts, body: &Bytes) -> Bytes {
    let mut message = Vec::with_capacity(256 + body.len());
    let status = head.status;
    message.extend_from_slice(b"HTTP/1.1 ");
    message.extend_from_slice(status.as_str().as_bytes());
    message.push(b' ');
    message.extend_from_slice(status.canonical_reason().unwrap_or("Error").as_bytes());
    message.extend_from_slice(b"\r\n");
    for (name, value) in &head.headers {
        message.extend_from_slice(name.as_str().as_bytes());
        message.extend_from_slice(b": ");
        message.extend_from_slice(value.as_bytes());
        message.extend_from_slice(b"\r\n");
    }
    message.extend_from_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
    message.extend_from_slice(b"date: ");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    message.extend_from_slice(&crate::files::serve::http_date(now));
    message.extend_from_slice(b"\r\n\r\n");
    message.extend_from_slice(body);
    Bytes::from(message)
}

/// Answers one request from `peer`, whose connection is `socket` (held `in_flight` until
/// the response body is done); never fails.
pub(crate) async fn handle(
    shared: Arc<Instance>,
    peer: Arc<Peer>,
    socket: Arc<ClientSocket>,
    in_flight: InFlight,
    mut request: Request<Incoming>,
) -> Result<Response<ResponseBody>, Infallible> {
    let start = Instant::now();
    // Before anything reads the head.
    fold::unfold(&mut request);
    let state = shared.state.load_full();
    let client_ip = client_ip(peer.ip, request.headers(), &state.trusted_proxies);
    let trusted = state.trusted_proxies.contains(peer.ip);
    let trace = RequestTrace::begin(
        request.method(),
        request.headers(),
        state.tracer.as_ref(),
        trusted,
    );
    let request_id = state
        .config
        .server
        .request_id
        .as_ref()
        .map(|name| request_id::decide(name, request.headers(), trusted, &trace));
    // Boxed: the record goes from the request's future into the response body, which
    // hyper moves several times; a pointer moves cheaper than the record.
    let mut record = Box::new(AccessRecord::new(
        shared.metrics.clone(),
        start,
        (request.method().clone(), peer.scheme()),
        client_ip,
        trace,
        shared.no_route.clone(),
    ));
    record.request_id = request_id;
    let mut record = Unanswered(Some(record));
    let mut leftovers = Leftovers::default();
    // Split once and lent from here: the phases below borrow the head and take the body,
    // where passing the request on by value moved its 264 bytes at every call.
    let (mut parts, body) = request.into_parts();
    let served = serve(
        &shared,
        &state,
        Client {
            peer: &peer,
            ip: client_ip,
            socket: &socket,
            connection: &in_flight,
        },
        (&mut parts, body),
        record.0.as_mut().expect("answered only below"),
        &mut leftovers,
    )
    .await;
    let mut record = record.0.take().expect("answered once");
    let mut response = match served {
        Ok(response) => response,
        Err(answer) => own_answer::render(answer, &record, parts.version, &state.config.server.errors),
    };
    // The server's response rules, then the route's (unless applied as an HTTP server's
    // response head was read); none may touch what follows.
    if !leftovers.response_ruled {
        apply_rules(&state.config.server.response_headers, response.headers_mut());
        if let Some(route) = leftovers.route {
            apply_rules(
                &state.router.routes()[route].response_headers,
                response.headers_mut(),
            );
        }
    }
    // Not stepped through when empty: that and the empty list's drop are calls.
    if !leftovers.limit_headers.is_empty() {
        for (name, value) in leftovers.limit_headers {
            response.headers_mut().append(name, value);
        }
    }
    response.body_mut().hold(leftovers.slots);
    if let Some(accepted) = leftovers.compress {
        response = response_body::compress(response, accepted, &record.method);
    }
    mark_own(
        response.headers_mut(),
        &state,
        peer.tls,
        record.request_id.as_ref(),
    );
    // Values that no other response repeats (the request ID, the room left) are marked
    // never to be indexed by HTTP/2's header compression, which then spells out their names
    // too unless the connection's table already has them: a connection's first response
    // leaves them indexable, so that its table gets each name once.
    if parts.version == http::Version::HTTP_2 && in_flight.first_http2_response() {
        for value in response.headers_mut().values_mut() {
            value.set_sensitive(false);
        }
    }
    record.status = response.status().as_u16();
    Ok(response.map(|body| ResponseBody::new(body, record, in_flight)))
}

/// What every response gets last, whatever made it: HSTS over TLS, and the request ID.
#[inline(always)]
fn mark_own(
    headers: &mut http::HeaderMap,
    state: &GatewayState,
    tls: bool,
    request_id: Option<&HeaderValue>,
) {
    if tls && let Some(hsts) = state.config.server.tls.as_ref().and_then(|tls| tls.hsts.clone()) {
        headers.insert(header::STRICT_TRANSPORT_SECURITY, hsts);
    }
    if let (Some(name), Some(id)) = (&state.config.server.request_id, request_id) {
        headers.insert(name.clone(), id.clone());
    }
}

/// What the inner handler leaves for the outer one besides the response: the rate-limit
/// headers for whatever response follows, the concurrency slots to hold until it is done
/// (unless the request was forwarded: then its exchange holds them), and the route that
/// matched (whose response rules apply).
#[derive(Default)]
struct Leftovers {
    limit_headers: LimitHeaders,
    slots: HeldSlots,
    route: Option<usize>,
    /// For a route with `compress`, what the client accepts.
    compress: Option<Accepted>,
    /// Whether the response rules were applied already: to an HTTP server's response, as
    /// its head was read.
    response_ruled: bool,
}

/// The access record of a request not answered yet. hyper drops the request's future when
/// the client leaves before the response starts (a held request, a slow upstream); the
/// request is then logged and counted with nginx's 499, "client closed request".
struct Unanswered(Option<Box<AccessRecord>>);

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(mut record) = self.0.take() {
            record.status = CLIENT_CLOSED_REQUEST;
            record.finish(0);
        }
    }
}

/// Where a request comes from.
struct Client<'a> {
    /// The TCP peer.
    peer: &'a Peer,
    /// The client's address (docs/configuration.md#client-address).
    ip: IpAddr,
    socket: &'a ClientSocket,
    /// Its hold on its connection, which a tunnel takes over.
    connection: &'a InFlight,
}

/// The inner handler: route the request, apply its limits, and answer it or forward it:
/// `Ok` is a response to relay (the upstream's, or a `respond` route's), `Err` an answer
/// floodgate makes itself. `leftovers` receives what the outer handler needs besides.
async fn serve(
    shared: &Instance,
    state: &GatewayState,
    client: Client<'_>,
    (request, body): (&mut Parts, Incoming),
    record: &mut AccessRecord,
    leftovers: &mut Leftovers,
) -> Result<Response<Payload>, OwnAnswer> {
    // The access record owns the normalized path; the request path borrows it from there.
    let checked =
        request_head::check(request).and_then(|head| Ok((head, normalize_path(request.uri.path())?)));
    let (head, rewritten) = match checked {
        Ok((head, path)) => {
            // A path that normalization left as it was holds no escape.
            let rewritten = matches!(path, Cow::Owned(_));
            record.path = path.into_owned();
            (head, rewritten)
        }
        Err(e) => {
            record.path = request.uri.path().to_owned();
            return Err(e.into());
        }
    };
    let names = if state.config.server.drop_invalid_headers {
        InvalidNames::Drop
    } else {
        InvalidNames::Keep
    };
    // Rarely anything to tidy: then the authority is copied out of the head it changes.
    let (untidy, seen) = (head.untidy, head.seen);
    let host = if untidy.any(names) {
        let host = head.authority.to_owned();
        request_head::tidy(&mut request.headers, untidy, names, |n| {
            shared.metrics.record_dropped_headers(n);
        });
        Cow::Owned(host)
    } else {
        Cow::Borrowed(head.authority)
    };
    let host = host.as_ref();
    let path = record.path.as_str();
    // What routes, limits' keys and `strip_prefix` read: encoded slashes as slashes.
    let routed = match rewritten {
        true => slashes_decoded(path).map_err(GatewayError::from)?,
        false => Cow::Borrowed(path),
    };
    // Before routing, limits and redirect_http: the CA must reach it.
    // Boxed: rare, and its storage lookup would otherwise enlarge every request's future.
    if !client.peer.tls
        && let Some(acme) = &state.acme
        && let Some(token) = crate::acme::http_token(path)
        && let Some(answer) =
            Box::pin(acme.http_answer(&normalize_host(host).unwrap_or_default(), token)).await
    {
        return Err(match answer {
            Some(key_authorization) => OwnAnswer::AcmeChallenge(key_authorization),
            None => GatewayError::NoChallenge.into(),
        });
    }
    if !client.peer.tls
        && let Some(tls) = state.config.server.tls.as_ref().filter(|tls| tls.redirect_http)
    {
        let port = shared.https_port.unwrap_or(tls.listen.port());
        return Err(to_https(host, port, &request.uri));
    }
    if state
        .config
        .server
        .deny
        .iter()
        .any(|net| net.contains(&client.ip))
    {
        return Err(GatewayError::Forbidden("server.deny").into());
    }
    let route_host = normalize_host(host);
    // Not `ok_or`: an error made on every request is dropped by a call.
    let Some(index) = state
        .router
        .lookup(route_host.as_deref(), &routed, &request.method)
    else {
        return Err(GatewayError::NoRoute.into());
    };
    let route_config = &state.router.routes()[index];
    record.route = route_config.name.clone();
    leftovers.route = Some(index);
    if route_config.compress {
        leftovers.compress = Some(Accepted::from_headers(&request.headers));
    }
    if !route_config.admits(client.ip) {
        return Err(GatewayError::Forbidden("the route's allow or deny").into());
    }
    let route = &state.routes[index];
    let keyed_path = route_config.path.keyed(&routed);
    let mut attempts = None;
    if !route.limits.is_empty() {
        let client_ip = client.ip_text();
        let source = key_source(
            request,
            &client_ip,
            keyed_path,
            route_host.as_deref(),
            &record.route,
        );
        let settings = LimitSettings {
            store: &state.store,
            prefix: &state.key_prefix,
            on_error: state.on_error,
            headers: state.config.server.ratelimit_headers,
            metrics: &shared.metrics,
            refusals: state.refusals.as_ref(),
            arrived: record.start,
        };
        let verdict = (route
            .limits
            .decide(&settings, client.ip, &source, &mut leftovers.limit_headers))
        .await
        .map_err(GatewayError::from)?;
        record.limit_outcome = verdict.outcome;
        leftovers.slots = verdict.slots;
        match verdict.action {
            Action::Reject(answer) => return Err(answer),
            Action::Pass {
                delay,
                held,
                attempts: taken,
            } => {
                attempts = taken;
                if !delay.is_zero() {
                    hold(delay, held, client.socket).await?;
                }
            }
        }
    }
    let response = match &route.target {
        Target::Respond(respond) => {
            respond_with(respond, route_host.as_deref(), &request.uri).map_err(OwnAnswer::from)
        }
        Target::Files(site) => {
            let forwarded = forwarded_path(route_config, path, &routed);
            match Box::pin(site::prepare(site, (forwarded, path), request, &shared.room)).await {
                Err(answer) => answer,
                Ok(_) => Err(GatewayError::NotFound.into()),
            }
        }
        Target::Upstream(upstream) => 'forwarded: {
            // The path as the upstream gets it; limits and `hash` keys read the client's
            // (its encoded slashes as slashes).
            let forwarded = forwarded_path(route_config, path, &routed);
            // A site's path comes to a file, served here, or a script for PHP-FPM.
            let script = match &route_config.site {
                None => None,
                // Boxed: the request path's future need not hold a site's.
                Some(site) => {
                    match Box::pin(site::prepare(site, (forwarded, path), request, &shared.room)).await {
                        Err(answer) => break 'forwarded answer,
                        Ok(site::Prepared::Run(script)) => site.php.as_ref().map(|php| (php, script)),
                        Ok(site::Prepared::Unserved) if site.php.is_some() => {
                            break 'forwarded Err(GatewayError::NotFound.into());
                        }
                        Ok(site::Prepared::Unserved) => None,
                    }
                }
            };
            // The key that picks the server, with `balance = "hash"`: a key part the
            // request repeats makes the client's address the key.
            let hash_tuple = upstream.hash_key().map(|parts| {
                let client_ip = client.ip_text();
                let source = key_source(
                    request,
                    &client_ip,
                    keyed_path,
                    route_host.as_deref(),
                    &record.route,
                );
                key_tuple(parts, &source).unwrap_or_else(|_| client_ip.into_owned())
            });
            let destination = Destination {
                upstream,
                route: route_config,
                request_rules: route.request_rules.as_ref(),
                response_rules: route.response_rules.as_ref(),
                hash_tuple: hash_tuple.as_deref(),
                instances: state.store.instances(),
                host: route_config
                    .site
                    .as_ref()
                    .and(route_host.as_deref())
                    .map(str::to_owned),
            };
            let context = ForwardingContext {
                request_id: state
                    .config
                    .server
                    .request_id
                    .as_ref()
                    .zip(record.request_id.as_ref()),
                peer: client.peer,
                client_ip: client.ip,
                peer_trusted: state.trusted_proxies.contains(client.peer.ip),
                version: request.version,
                guarded_spellings: &state.guarded_spellings,
                folding_names: untidy.leaves_folding_names(names),
                seen,
            };
            let mut tries = Tries::new(&record.trace);
            tries.reached_the_app = attempts.as_ref().map(limits::Attempts::reached_the_app);
            let forwarded = forward(
                &destination,
                (request, body),
                (forwarded, script),
                &context,
                (&state.config.server, &shared.room),
                client.connection,
                (leftovers, &mut tries),
            )
            .await;
            record.upstream = tries.last;
            forwarded
        }
    };
    if let Some(attempts) = attempts {
        // floodgate's own answers (a 502, a 504) are not the app's: their units go back.
        attempts
            .settle(response.as_ref().ok().map(Response::status))
            .await;
    }
    response
}

impl Client<'_> {
    /// The client's address as text: usually the peer's, already written out.
    fn ip_text(&self) -> Cow<'_, str> {
        self.peer.text_of(self.ip)
    }
}

/// What key parts are read from, for limits and for `hash` balancing.
fn key_source<'a>(
    request: &'a Parts,
    client_ip: &'a str,
    path: &'a str,
    host: Option<&'a str>,
    route: &'a str,
) -> KeySource<'a> {
    KeySource {
        client_ip,
        headers: &request.headers,
        query: request.uri.query(),
        method: &request.method,
        path,
        host,
        route,
    }
}

/// Where a forwarded request goes.
struct Destination<'a> {
    upstream: &'a Upstream,
    /// The route that matched: its `strip_prefix` and request rules.
    route: &'a RouteConfig,
    /// Its request rules with the server's.
    request_rules: Option<&'a CombinedRules>,
    /// Its response rules with the server's.
    response_rules: Option<&'a Arc<CombinedRules>>,
    /// The request's `hash_key` tuple, with `balance = "hash"`.
    hash_tuple: Option<&'a str>,
    /// Live gateway instances sharing the upstream's `max_requests`.
    instances: u64,
    /// The host name the client asked for, as routing saw it (for a site's PHP only).
    host: Option<String>,
}

/// `redirect_http`: a 308 to the same host and target over HTTPS on `port`.
fn to_https(host: &str, port: u16, target: &Uri) -> OwnAnswer {
    // The name without the plain listener's port, as routing sees it (`$host`).
    let Some(name) = normalize_host(host) else {
        return GatewayError::MalformedRequest("the request has no host to redirect to").into();
    };
    let path = target.path_and_query().map_or("/", |p| p.as_str());
    let location = if port == 443 {
        format!("https://{name}{path}")
    } else {
        format!("https://{name}:{port}{path}")
    };
    match HeaderValue::try_from(location) {
        Ok(location) => OwnAnswer::Redirect(location),
        Err(_) => GatewayError::MalformedRequest("the request target cannot be redirected").into(),
    }
}

/// Holds a leaky-bucket request until its turn, without a thread. If the client leaves
/// first, the places it `held` are given back (dropped): when hyper sees it leave, by
/// dropping this future; when hyper does not (an unread request body, see
/// `connection::disconnect`), by answering [`GatewayError::ClientClosed`] instead of
/// forwarding.
async fn hold(delay: Duration, held: Vec<Unit>, client: &ClientSocket) -> Result<(), GatewayError> {
    tokio::select! {
        () = tokio::time::sleep(delay) => {
            held.into_iter().for_each(Unit::keep);
            Ok(())
        }
        () = client.closed() => Err(GatewayError::ClientClosed),
    }
}

fn respond_with(
    respond: &RespondConfig,
    host: Option<&str>,
    target: &Uri,
) -> Result<Response<Payload>, GatewayError> {
    let mut response = Response::new(full(respond.body.clone()));
    *response.status_mut() = respond.status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, respond.content_type.clone());
    for (name, value) in &respond.headers {
        let value = match value {
            ValueTemplate::Fixed(value) => value.clone(),
            ValueTemplate::Filled(parts) => filled(parts, host, target)?,
        };
        headers.insert(name.clone(), value);
    }
    Ok(response)
}

/// A `respond` header value with the request's host and target put in.
fn filled(parts: &[TemplatePart], host: Option<&str>, target: &Uri) -> Result<HeaderValue, GatewayError> {
    let mut value = String::new();
    for part in parts {
        value.push_str(match part {
            TemplatePart::Text(text) => text,
            TemplatePart::Host => host.ok_or(GatewayError::MalformedRequest("no Host to answer with"))?,
            TemplatePart::RequestUri => target.path_and_query().map_or("/", |p| p.as_str()),
        });
    }
    HeaderValue::try_from(value)
        .map_err(|_| GatewayError::MalformedRequest("the request cannot be put in a header"))
}

/// `path` as the upstream gets it: without the route's `strip_prefix`, taken from
/// `routed` (its encoded slashes read as slashes) where only that has it.
fn forwarded_path<'a>(route: &RouteConfig, path: &'a str, routed: &'a str) -> &'a str {
    let Some(prefix) = &route.strip_prefix else {
        return path;
    };
    // Whole segments only: "/api" is stripped from "/api/users" and "/api", not from
    // "/apix" (which a `path_prefix = "/api"` route also matches).
    let stripped = |path: &'a str| match path.strip_prefix(prefix.as_str()) {
        Some("") => Some("/"),
        Some(rest) if rest.starts_with('/') => Some(rest),
        _ => None,
    };
    stripped(path).or_else(|| stripped(routed)).unwrap_or(path)
}

/// How many headers floodgate may add to a request going upstream.
const ADDED_UPSTREAM_HEADERS: usize = 8;

/// Rewrites the request for `upstream`, sends it and relays the response; the request's
/// concurrency-limit slots, taken from `leftovers`, are held with the exchange, and
/// `tries` told of each try. `path` is without the route's prefix; `script`, for a site, what PHP-FPM
/// runs.
async fn forward(
    destination: &Destination<'_>,
    (parts, body): (&mut Parts, Incoming),
    (path, script): (&str, Option<(&Php, Script)>),
    context: &ForwardingContext<'_>,
    (server, room): (&ServerConfig, &Room),
    connection: &InFlight,
    (leftovers, tries): (&mut Leftovers, &mut Tries<'_>),
) -> Result<Response<Payload>, OwnAnswer> {
    // From here on the slots go with the exchange, which may outlive this request if its
    // client leaves (`upstream`'s module docs).
    let slots = std::mem::take(&mut leftovers.slots);
    let upstream = destination.upstream;
    let max_body = server.max_body;
    let declared = context.seen.declared;
    if let (Some(limit), Some(length)) = (max_body, declared)
        && length > limit
    {
        return Err(GatewayError::BodyTooLarge.into());
    }
    // hyper offers the connection for every HTTP/1.1 request with `Upgrade`; an upgrade
    // it does not offer could not be carried, so it is not asked for.
    let (upgrade, client_upgrade) = (context.seen.upgrade)
        .then(|| requested_upgrade(parts.version, &parts.headers))
        .flatten()
        .and_then(|protocol| Some((protocol, parts.extensions.remove::<OnUpgrade>()?)))
        .unzip();
    let fastcgi = match (script, &upstream.config.fastcgi) {
        (Some((php, script)), Some(fastcgi)) => Some((php, script, fastcgi)),
        _ => None,
    };
    // The host the target names (HTTP/2, absolute form), in place of the client's `Host`.
    let mut target_host = match parts.uri.authority() {
        Some(authority) => Some(
            HeaderValue::from_str(authority.as_str())
                .map_err(|_| GatewayError::MalformedRequest("invalid authority"))?,
        ),
        None => None,
    };
    let trace = tries.trace;
    let dropped = trace.drops_tracestate.then_some(&TRACESTATE);
    let mut body = RequestBody::new(body, max_body, server.body_timeout);
    // The length PHP-FPM is told, of the body as the client framed it: found before the
    // headers are rewritten (`Transfer-Encoding` goes as hop-by-hop), whichever way they go.
    let mut length = None;
    if fastcgi.is_some() && body.is_end_stream() {
        length = site::length_without_body(parts, declared);
    }
    // A body is read whole before a server is asked when it would otherwise hold a slot
    // while it comes: PHP-FPM's always (it must be told the length), an HTTP server's
    // under `max_requests` (as nginx buffers request bodies), so that a client sending
    // slowly holds neither a worker of the app nor a slot of the cap.
    let read_first = fastcgi.is_some() || (upstream.config.max_requests > 0 && upgrade.is_none());
    if read_first && !body.is_end_stream() {
        // A body waits for a place in the room only over HTTP/1: an HTTP/2 stream not
        // read keeps what it was sent counted against its connection's window, which
        // would stall the connection's other uploads (the one holding a place among them).
        let wait = match parts.version {
            http::Version::HTTP_2 => Duration::ZERO,
            _ => server.body_timeout,
        };
        // Boxed: the request path's future need not hold a body being read whole.
        (length, body) = Box::pin(site::read_whole(body, room, wait)).await?;
    }
    // The headers go as they are read (into PHP's parameters, or straight into the
    // request head); the map is rewritten first only where that cannot be done.
    let read_as_they_go =
        (fastcgi.is_some() || upgrade.is_none()) && AsForwarded::readable(&parts.headers, context);
    if !read_as_they_go {
        // Room for what floodgate adds (the forwarding headers, the request ID) made once:
        // the map hyper parsed has room for the client's only.
        parts.headers.reserve(ADDED_UPSTREAM_HEADERS);
        remove_hop_by_hop(&mut parts.headers);
        if let Some(host) = target_host.take() {
            parts.headers.insert(header::HOST, host);
        }
        set_forwarding_headers(&mut parts.headers, context);
        if let Some(dropped) = dropped {
            parts.headers.remove(dropped);
        }
        apply_rules(&server.request_headers, &mut parts.headers);
        apply_rules(&destination.route.request_headers, &mut parts.headers);
    }
    // An upgrade is asked of an HTTP server in the rewritten map.
    if let (None, Some(protocol)) = (&fastcgi, upgrade) {
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        parts.headers.insert(header::UPGRADE, protocol);
    }
    let as_forwarded = read_as_they_go.then(|| {
        AsForwarded::new(
            &parts.headers,
            target_host,
            dropped,
            context,
            destination.request_rules,
        )
    });
    let head = match fastcgi {
        Some((php, script, fastcgi)) => UpstreamHead::FastCgi(site::fastcgi_head(
            (parts, as_forwarded.as_ref()),
            &script,
            context,
            (destination.host.as_deref(), length),
            php,
            &fastcgi.env,
            trace,
        )?),
        None => UpstreamHead::Http(http_head(
            parts,
            &upstream.target(path, parts.uri.query()),
            as_forwarded.as_ref(),
            (trace, destination.response_rules),
        )),
    };
    let from_fastcgi = matches!(head, UpstreamHead::FastCgi(_));
    let request = Outgoing {
        head,
        repeatable: idempotent(&parts.method) && body.is_end_stream(),
        body,
    };
    let mut response = upstream
        .send(
            request,
            (destination.hash_tuple, destination.instances),
            slots,
            tries,
        )
        .await?;
    // A server switches only to a protocol the request asked for (RFC 9110 §15.2.2), and
    // never for a request that came over HTTP/2 (RFC 9113 §8.6), which asks for none.
    if response.status() == http::StatusCode::SWITCHING_PROTOCOLS
        && !(client_upgrade.is_some() && switches_as_asked(&parts.headers, response.headers()))
    {
        return Err(upstream
            .unrelayable(
                UpstreamFailure::Reset,
                "a protocol switch (101) the request did not ask for".to_owned(),
            )
            .into());
    }
    // An HTTP server's response head was read through the response rules.
    let mut ruled = !from_fastcgi;
    match client_upgrade {
        Some(client) if response.status() == http::StatusCode::SWITCHING_PROTOCOLS => {
            let relay = tunnel(
                client,
                &mut response,
                upstream.name().clone(),
                server.tunnel_idle_timeout,
            );
            if let Some(relay) = relay {
                connection.start_tunnel(Box::pin(relay));
            }
        }
        // An HTTP server's response comes without its hop-by-hop headers, but for a
        // protocol switch (`upstream::h1`), which is a tunnel's by now.
        _ if from_fastcgi => {
            remove_hop_by_hop(response.headers_mut());
            // `Connection` may have named a header the rules set: they apply again after
            // (to what they already shaped, that changes nothing else).
            ruled = false;
        }
        _ => {}
    }
    leftovers.response_ruled = ruled;
    let tunnelled = response.status() == http::StatusCode::SWITCHING_PROTOCOLS;
    match upstream.read_ahead() {
        Some(limit) if !tunnelled && !response.body().is_end_stream() => {
            Ok(response.map(|body| Payload::ReadAhead(ReadAhead::new(body, limit))))
        }
        _ => Ok(response.map(Payload::Upstream)),
    }
}

/// The head an HTTP server is sent for `parts`, to `target` (its pieces): its headers as they go
/// (`as_forwarded`), or as the rewritten map holds them, and `traceparent` naming the
/// first try's span (a later try's copy names its own).
fn http_head(
    parts: &Parts,
    target: &[&str],
    as_forwarded: Option<&AsForwarded<'_>>,
    (trace, response_rules): (&RequestTrace, Option<&Arc<CombinedRules>>),
) -> HttpHead {
    let mut head = HttpHead::writer(
        &parts.method,
        target,
        parts.headers.len() + ADDED_UPSTREAM_HEADERS,
    );
    match as_forwarded {
        // Four runs, not one chain of iterators: stepping through a chain costs more.
        Some(forwarded) => {
            for (name, value) in forwarded.sent() {
                head.header(name, value);
            }
            for (name, value) in forwarded.added() {
                head.header(name, value);
            }
            for (name, value) in forwarded.via() {
                head.header(name, value);
            }
            for (name, value) in forwarded.set() {
                head.header(name, value);
            }
        }
        None => {
            for (name, value) in &parts.headers {
                head.header(name, value);
            }
        }
    }
    head.traceparent(&trace.trace_id, SpanId::random(), trace.flags);
    head.finish(response_rules.cloned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of the future `f` returns, without calling it.
    fn future_size<A, B, C, D, E, F: Future>(_: impl Fn(A, B, C, D, E) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// A request's future is held for every request in flight (one per client connection
    /// in hyper's dispatcher). An `.await` nests its callee's future, and a large one
    /// nested twice per level (a connect with TLS, a Redis call) made it 92 KB: rare paths
    /// are boxed so that it stays a few KB.
    #[test]
    fn a_requests_future_stays_small() {
        let size = future_size(handle);
        assert!(size <= 7 * 1024, "the request's future is {size} bytes");
    }
}
