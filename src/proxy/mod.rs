//! Forwarding to upstreams: one pool of keep-alive HTTP/1.1 connections per upstream,
//! the request rewritten for it, errors classified once, and `Upgrade` tunnels (WebSocket).

pub(crate) mod headers;
pub(crate) mod pool;
pub(crate) mod request_body;

use std::error::Error as _;
use std::sync::Arc;

use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode, Uri};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

use crate::config::UpstreamConfig;
use crate::error::{GatewayError, UpstreamFailure};
use pool::{Pool, SendError};
use request_body::{RequestBody, RequestBodyError};

/// An upstream's response body, on its way to the client.
pub(crate) type UpstreamBody = pool::UpstreamBody<RequestBody>;

/// Forwards requests to one upstream.
pub struct UpstreamClient {
    pub config: Arc<UpstreamConfig>,
    name: Arc<str>,
    pool: Pool<RequestBody>,
}

impl UpstreamClient {
    pub fn new(config: Arc<UpstreamConfig>) -> Self {
        UpstreamClient {
            name: Arc::from(config.name.as_str()),
            pool: Pool::new(config.authority.to_string(), config.connect_timeout),
            config,
        }
    }

    pub fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// The request target (origin form) for `path` (already normalized) and `query` on
    /// this upstream.
    pub fn uri_for(&self, path: &str, query: Option<&str>) -> Result<Uri, http::Error> {
        let base = &self.config.base_path;
        let mut target = String::with_capacity(base.len() + path.len() + query.map_or(0, |q| q.len() + 1));
        target.push_str(base);
        target.push_str(path);
        if let Some(query) = query {
            target.push('?');
            target.push_str(query);
        }
        Ok(Uri::from(PathAndQuery::try_from(target)?))
    }

    /// Sends `request` and waits for the response headers, at most the upstream's `timeout`.
    pub async fn send(&self, request: Request<RequestBody>) -> Result<Response<UpstreamBody>, GatewayError> {
        match tokio::time::timeout(self.config.timeout, self.pool.send(request)).await {
            Ok(Ok(response)) => Ok(response),
            Err(_elapsed) => {
                Err(self.failure(UpstreamFailure::Timeout, "no response headers in time".into()))
            }
            Ok(Err(e)) => Err(self.classify(e)),
        }
    }

    fn classify(&self, error: SendError) -> GatewayError {
        if matches!(error, SendError::Connect { .. } | SendError::ConnectTimeout(_)) {
            return self.failure(UpstreamFailure::Connect, detail(&error));
        }
        let mut source = error.source();
        while let Some(cause) = source {
            if let Some(body_error) = cause.downcast_ref::<RequestBodyError>() {
                return match body_error {
                    RequestBodyError::TooLarge => GatewayError::BodyTooLarge,
                    RequestBodyError::TimedOut => GatewayError::BodyTimeout,
                    RequestBodyError::Client(_) => GatewayError::BadRequestBody(detail(&error)),
                };
            }
            source = cause.source();
        }
        self.failure(UpstreamFailure::Reset, detail(&error))
    }

    fn failure(&self, kind: UpstreamFailure, detail: String) -> GatewayError {
        GatewayError::Upstream {
            upstream: self.name.clone(),
            kind,
            detail,
        }
    }
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

/// When the upstream accepted a protocol switch, joins the client's and the upstream's
/// upgraded connections and copies bytes both ways until either side closes.
pub(crate) fn tunnel(client: OnUpgrade, response: &mut Response<UpstreamBody>, upstream: Arc<str>) {
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
}
