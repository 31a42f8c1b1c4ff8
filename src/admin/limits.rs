//! The limit-state API (docs/operations.md#limit-state-api): `GET /limits` lists the
//! limits, `GET /limits/NAME/state?PART=VALUE...` reads one key's state without consuming
//! anything (`HEAD` as `GET`), and `DELETE` on it resets the key and lifts its lock-out in
//! the store (so every instance sees it). Enabled by `server.admin_token`; every call
//! carries it as a bearer token, in one `Authorization` header, compared in constant
//! time. Without a token the paths do not exist (404).

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use serde_json::{Value, json};
use subtle::ConstantTimeEq;

use std::net::IpAddr;

use crate::config::{LimitConfig, LimitKind, Mode, Override};
use crate::limit::algorithm::Algorithm;
use crate::limit::key::{KeyedTuple, slots_key};
use crate::service::Instance;
use crate::service::limits::AppliedRate;
use crate::service::request_key::{NamedTuple, named_tuple};

pub(super) async fn answer(shared: &Instance, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    let state = shared.state.load_full();
    let Some(token) = &state.config.server.admin_token else {
        return json_answer(StatusCode::NOT_FOUND, json!({ "error": "not found" }));
    };
    // Which of two a proxy in front checked or logged is unknown: neither is trusted.
    if request
        .headers()
        .get_all(header::AUTHORIZATION)
        .iter()
        .nth(1)
        .is_some()
    {
        return json_answer(
            StatusCode::BAD_REQUEST,
            json!({ "error": "more than one Authorization header" }),
        );
    }
    if !authorized(request, token) {
        let mut response = json_answer(
            StatusCode::UNAUTHORIZED,
            json!({ "error": "a valid bearer token is required" }),
        );
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return response;
    }
    // HEAD is answered as GET; hyper leaves the body out.
    let method = match request.method() {
        &Method::HEAD => &Method::GET,
        method => method,
    };
    let path = request.uri().path();
    if path == "/limits" {
        if method != Method::GET {
            return json_answer(
                StatusCode::METHOD_NOT_ALLOWED,
                json!({ "error": "GET or HEAD only" }),
            );
        }
        let limits: Vec<Value> = state
            .config
            .limits
            .values()
            .map(|limit| describe(limit))
            .collect();
        return json_answer(StatusCode::OK, json!({ "limits": limits }));
    }
    let Some(name) = path
        .strip_prefix("/limits/")
        .and_then(|rest| rest.strip_suffix("/state"))
    else {
        return json_answer(StatusCode::NOT_FOUND, json!({ "error": "not found" }));
    };
    let Some(limit) = state.config.limits.get(name) else {
        return json_answer(
            StatusCode::NOT_FOUND,
            json!({ "error": format!("no limit named {name:?}") }),
        );
    };
    let NamedTuple { tuple, named, parts } =
        match named_tuple(&limit.key, request.uri().query().unwrap_or("")) {
            Ok(found) => found,
            Err(message) => return json_answer(StatusCode::BAD_REQUEST, json!({ "error": message })),
        };
    // The parameters that apply to this key: an override's, when one matches.
    let client_ip = named
        .iter()
        .find(|(name, _)| name == "client_ip")
        .and_then(|(_, value)| value.parse().ok())
        .unwrap_or(IpAddr::from([0, 0, 0, 0]));
    let prefix = &state.key_prefix;
    let key: serde_json::Map<String, Value> = named.into_iter().map(|(k, v)| (k, Value::String(v))).collect();
    let rate = match &limit.kind {
        LimitKind::Rate(rate) => rate,
        LimitKind::Concurrency(_) if method != Method::GET => {
            return json_answer(
                StatusCode::METHOD_NOT_ALLOWED,
                json!({ "error": "a concurrency limit's slots are held by requests in flight; GET or HEAD only" }),
            );
        }
        LimitKind::Concurrency(_) => {
            return match state
                .store
                .in_flight(&slots_key(prefix, &tuple, &limit.name))
                .await
            {
                Ok(in_flight) => json_answer(
                    StatusCode::OK,
                    json!({ "limit": limit.name.as_ref(), "key": key, "in_flight": in_flight }),
                ),
                Err(error) => store_failed(&error),
            };
        }
    };
    // The parameters that apply to this key: an override's, when one matches.
    let algorithm = match rate.overrides.find(&tuple, client_ip, |i| parts[i].clone()) {
        None => &rate.algorithm,
        Some(Override::Algorithm(overridden)) => overridden,
        // Decided against nothing, an exempt key has no state to tell; a reset clears what
        // it held under the limit's own parameters (before it was exempt).
        Some(Override::Exempt) if method == Method::DELETE => &rate.algorithm,
        Some(Override::Exempt) => {
            return json_answer(
                StatusCode::OK,
                json!({ "limit": limit.name.as_ref(), "key": key, "exempt": true }),
            );
        }
    };
    let check = AppliedRate {
        limit,
        rate,
        algorithm,
    }
    .check(prefix, KeyedTuple::of(prefix, &tuple, &limit.name), (1, 1));
    match *method {
        Method::GET => match state.store.peek(&check).await {
            Ok(peeked) => {
                let now = peeked.key_state(algorithm);
                json_answer(
                    StatusCode::OK,
                    json!({
                        "limit": limit.name.as_ref(),
                        "key": key,
                        "remaining": now.remaining,
                        "reset_seconds": now.reset.as_secs_f64().ceil() as u64,
                        "locked_seconds": now.locked.as_secs_f64().ceil() as u64,
                    }),
                )
            }
            Err(error) => store_failed(&error),
        },
        Method::DELETE => match state.store.clear(&check).await {
            Ok(()) => {
                // This instance's remembered refusals go now; the others' within
                // REMEMBERED_AT_MOST.
                if let Some(refusals) = &state.refusals {
                    refusals.clear();
                }
                let key = Value::Object(key);
                tracing::info!(limit = %limit.name, %key, "admin: a key's limit state was reset and its lock-out lifted");
                let mut response = Response::new(Full::new(Bytes::new()));
                *response.status_mut() = StatusCode::NO_CONTENT;
                response
            }
            Err(error) => store_failed(&error),
        },
        _ => json_answer(
            StatusCode::METHOD_NOT_ALLOWED,
            json!({ "error": "GET, HEAD or DELETE" }),
        ),
    }
}

/// Whether `request` carries `Authorization: Bearer TOKEN`, compared in constant time.
fn authorized(request: &Request<Incoming>, token: &str) -> bool {
    // The scheme is case-insensitive (RFC 9110 §11.1).
    let Some(given) = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|value| value.as_bytes())
        .filter(|value| value.len() > 7 && value[..7].eq_ignore_ascii_case(b"bearer "))
        .map(|value| &value[7..])
    else {
        return false;
    };
    given.ct_eq(token.as_bytes()).into()
}

/// A limit as `GET /limits` lists it.
fn describe(limit: &LimitConfig) -> Value {
    let seconds = |micros: u64| micros as f64 / 1e6;
    let rate = match &limit.kind {
        LimitKind::Rate(rate) => rate,
        LimitKind::Concurrency(concurrency) => {
            return json!({
                "name": limit.name.as_ref(),
                "algorithm": "concurrency",
                "parameters": { "limit": concurrency.limit, "lease_seconds": concurrency.lease.as_secs_f64() },
                "key": limit.key.iter().map(|part| part.name()).collect::<Vec<_>>(),
                "mode": match limit.mode { Mode::Enforce => "enforce", Mode::Shadow => "shadow" },
            });
        }
    };
    let parameters = match rate.algorithm {
        Algorithm::FixedWindow { limit, window } | Algorithm::SlidingWindow { limit, window } => {
            json!({ "limit": limit, "window_seconds": seconds(window) })
        }
        Algorithm::TokenBucket { rate, per, burst } | Algorithm::LeakyBucket { rate, per, burst } => {
            json!({ "rate": rate, "per_seconds": seconds(per), "burst": burst })
        }
    };
    json!({
        "name": limit.name.as_ref(),
        "algorithm": algorithm_name(&rate.algorithm),
        "parameters": parameters,
        "key": limit.key.iter().map(|part| part.name()).collect::<Vec<_>>(),
        "mode": match limit.mode { Mode::Enforce => "enforce", Mode::Shadow => "shadow" },
        "lockout_seconds": rate.lockout.map(|d| d.as_secs_f64()),
    })
}

fn algorithm_name(algorithm: &Algorithm) -> &'static str {
    match algorithm {
        Algorithm::FixedWindow { .. } => "fixed_window",
        Algorithm::SlidingWindow { .. } => "sliding_window",
        Algorithm::TokenBucket { .. } => "token_bucket",
        Algorithm::LeakyBucket { .. } => "leaky_bucket",
    }
}

fn store_failed(error: &crate::limit::redis::StoreError) -> Response<Full<Bytes>> {
    tracing::warn!(%error, "admin: the rate-limit store failed");
    json_answer(
        StatusCode::SERVICE_UNAVAILABLE,
        json!({ "error": "the rate-limit store is unavailable" }),
    )
}

fn json_answer(status: StatusCode, body: Value) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(format!("{body}\n"))));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}
