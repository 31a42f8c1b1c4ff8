//! The admin listener (docs/operations.md#admin-listener): `/healthz`, `/readyz` and
//! `/metrics`, and with `server.admin_token` the limit-state API (`/limits`, to see a
//! key's state and lift a lock-out), on its own address so that it is never exposed with
//! the proxy port by accident. Its connections are closed after `server.header_timeout`
//! without a request, as the proxy's are (`connection::serve_until_idle`).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::connection::{ConnectionState, serve_until_idle};
use crate::service::Instance;

mod limits;

/// Serves admin requests until the task is aborted. Connections stay open while the
/// proxy drains: `/readyz` tells load balancers about it.
pub(crate) async fn serve(listener: TcpListener, shared: Arc<Instance>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "admin accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        // Read per connection, so that a reload's header_timeout applies to new ones.
        let idle_limit = shared.state.load().config.server.header_timeout;
        let shared = shared.clone();
        tokio::spawn(async move {
            let state = ConnectionState::new();
            let requests = state.clone();
            let service = service_fn(move |request| {
                let shared = shared.clone();
                let in_flight = requests.begin();
                async move {
                    let response = answer(&shared, &request).await;
                    // The answer is whole: the request ends here, and the connection is
                    // idle from now on.
                    drop(in_flight);
                    Ok::<_, Infallible>(response)
                }
            });
            let connection = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
            let result = serve_until_idle(
                connection,
                &state,
                (idle_limit, None),
                std::future::pending(),
                peer,
            )
            .await;
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "admin connection ended with an error");
            }
        });
    }
}

async fn answer(shared: &Instance, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    if request.uri().path() == "/limits" || request.uri().path().starts_with("/limits/") {
        return limits::answer(shared, request).await;
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
    }
    match request.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" if shared.draining.load(Ordering::SeqCst) => {
            text(StatusCode::SERVICE_UNAVAILABLE, "draining\n")
        }
        "/readyz" if !store_ready(shared) => text(StatusCode::SERVICE_UNAVAILABLE, "redis unavailable\n"),
        "/readyz" => text(StatusCode::OK, "ready\n"),
        "/metrics" => {
            let mut response = Response::new(Full::new(Bytes::from(shared.metrics.render())));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            response
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

fn store_ready(shared: &Instance) -> bool {
    let state = shared.state.load();
    state.store.ready(state.on_error)
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
