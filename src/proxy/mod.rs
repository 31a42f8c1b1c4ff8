//! Forwarding to upstreams: one pooled, keep-alive HTTP/1.1 client per upstream, the
//! request rewritten for it, errors classified once, and `Upgrade` tunnels (WebSocket).

pub mod headers;

use std::error::Error as _;
use std::sync::Arc;
use std::time::Duration;

use http::uri::{PathAndQuery, Scheme};
use http::{Request, Response, StatusCode, Uri};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use crate::body::{RequestBody, RequestBodyError};
use crate::config::UpstreamConfig;
use crate::error::{GatewayError, UpstreamFailure};

/// How long an idle upstream connection stays in the pool.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// A connection pool to one upstream.
pub struct UpstreamClient {
    pub config: Arc<UpstreamConfig>,
    name: Arc<str>,
    client: Client<HttpConnector, RequestBody>,
}

impl UpstreamClient {
    pub fn new(config: Arc<UpstreamConfig>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.enforce_http(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_timer(TokioTimer::new())
            .build(connector);
        UpstreamClient {
            name: Arc::from(config.name.as_str()),
            config,
            client,
        }
    }

    pub fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// The URI for `path_and_query` (already normalized) on this upstream.
    pub fn uri_for(&self, path: &str, query: Option<&str>) -> Result<Uri, http::Error> {
        let base = &self.config.base_path;
        let mut target = String::with_capacity(base.len() + path.len() + query.map_or(0, |q| q.len() + 1));
        target.push_str(base);
        target.push_str(path);
        if let Some(query) = query {
            target.push('?');
            target.push_str(query);
        }
        Uri::builder()
            .scheme(Scheme::HTTP)
            .authority(self.config.authority.clone())
            .path_and_query(PathAndQuery::try_from(target)?)
            .build()
    }

    /// Sends `request` and waits for the response headers, at most the upstream's `timeout`.
    pub async fn send(&self, request: Request<RequestBody>) -> Result<Response<Incoming>, GatewayError> {
        match tokio::time::timeout(self.config.timeout, self.client.request(request)).await {
            Ok(Ok(response)) => Ok(response),
            Err(_elapsed) => {
                Err(self.failure(UpstreamFailure::Timeout, "no response headers in time".into()))
            }
            Ok(Err(e)) => Err(self.classify(e)),
        }
    }

    fn classify(&self, error: hyper_util::client::legacy::Error) -> GatewayError {
        let mut source = error.source();
        while let Some(cause) = source {
            if let Some(body_error) = cause.downcast_ref::<RequestBodyError>() {
                return match body_error {
                    RequestBodyError::TooLarge => GatewayError::BodyTooLarge,
                    RequestBodyError::Client(_) => GatewayError::BadRequestBody(detail(&error)),
                };
            }
            source = cause.source();
        }
        let kind = if error.is_connect() {
            UpstreamFailure::Connect
        } else {
            UpstreamFailure::Reset
        };
        self.failure(kind, detail(&error))
    }

    fn failure(&self, kind: UpstreamFailure, detail: String) -> GatewayError {
        GatewayError::Upstream {
            upstream: self.name.clone(),
            kind,
            detail,
        }
    }
}

/// The error and its causes on one line, for the log.
fn detail(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// When the upstream accepted a protocol switch, joins the client's and the upstream's
/// upgraded connections and copies bytes both ways until either side closes.
pub fn tunnel(client: OnUpgrade, response: &mut Response<Incoming>, upstream: Arc<str>) {
    if response.status() != StatusCode::SWITCHING_PROTOCOLS {
        return;
    }
    let upstream_side = hyper::upgrade::on(response);
    tokio::spawn(async move {
        match tokio::try_join!(client, upstream_side) {
            Ok((client, upstream_io)) => {
                let mut client = TokioIo::new(client);
                let mut upstream_io = TokioIo::new(upstream_io);
                if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut upstream_io).await {
                    tracing::debug!(%upstream, error = %e, "upgraded connection ended with an error");
                }
            }
            Err(e) => tracing::warn!(%upstream, error = %e, "protocol upgrade failed"),
        }
    });
}
