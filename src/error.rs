//! Errors of the request path and their statuses (docs/configuration.md#status-codes);
//! `service::own_answer` renders them.
//!
//! The mapping is an exhaustive `match` without a catch-all, so a new failure cannot be
//! added without deciding its status. Clients get a fixed one-line body; the detail goes
//! to the log.

use http::StatusCode;

use crate::path::PathError;

/// nginx's "client closed request": the status logged for a request whose client left
/// before its response started. The client never sees it.
pub(crate) const CLIENT_CLOSED_REQUEST: u16 = 499;

/// How an upstream failed; also the `kind` label of `floodgate_upstream_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UpstreamFailure {
    /// Refused, unreachable, or not connected within `connect_timeout`.
    Connect,
    /// No response headers within the upstream's `timeout`.
    Timeout,
    /// The connection broke or the upstream answered with something that is not HTTP.
    Reset,
    /// Every server at its `max_requests` and the queue full.
    QueueFull,
    /// Queued longer than `queue_timeout`.
    QueueTimeout,
    /// No server in rotation.
    NoServer,
    /// The TLS handshake with the server failed (its certificate, say).
    Tls,
    /// No place for a new connection within `connect_timeout`: as many connections to
    /// upstream servers are open as `server.max_connections` and the open-file limit
    /// allow, none idle. Floodgate's, not the server's.
    NoPlace,
}

impl UpstreamFailure {
    /// Every kind, each at the index of its discriminant.
    pub(crate) const ALL: [UpstreamFailure; 8] = [
        UpstreamFailure::Connect,
        UpstreamFailure::Timeout,
        UpstreamFailure::Reset,
        UpstreamFailure::QueueFull,
        UpstreamFailure::QueueTimeout,
        UpstreamFailure::NoServer,
        UpstreamFailure::Tls,
        UpstreamFailure::NoPlace,
    ];

    /// The `kind` label of `floodgate_upstream_errors_total`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            UpstreamFailure::Connect => "connect",
            UpstreamFailure::Timeout => "timeout",
            UpstreamFailure::Reset => "reset",
            UpstreamFailure::QueueFull => "queue_full",
            UpstreamFailure::QueueTimeout => "queue_timeout",
            UpstreamFailure::NoServer => "no_server",
            UpstreamFailure::Tls => "tls",
            UpstreamFailure::NoPlace => "no_place",
        }
    }
}

/// Why floodgate answered a request itself instead of relaying the upstream's response.
#[derive(Debug, thiserror::Error)]
pub(crate) enum GatewayError {
    #[error("no route matches the request")]
    NoRoute,
    #[error("no file or script under the site's root for the path")]
    NotFound,
    #[error("no pending ACME http-01 challenge has this token")]
    NoChallenge,
    #[error("a method other than GET or HEAD for a file")]
    NotAFileMethod,
    #[error("{0}")]
    SpoolFailed(String),
    #[error(
        "no place for the request body's temporary file: the places for bodies read whole (an eighth of server.max_connections) are all taken"
    )]
    NoBodyPlace,
    #[error(
        "no room for the file being served: the places for files that stream (an eighth of server.max_connections), or the memory for files read whole, are all taken"
    )]
    NoFilePlace,
    #[error("the process or the system is out of file descriptors or memory")]
    OutOfDescriptors,
    #[error("the client's address is denied by {0}")]
    Forbidden(&'static str),
    #[error("bad request path: {0}")]
    BadPath(#[from] PathError),
    #[error("the rate-limit key {0} occurs more than once")]
    AmbiguousKey(String),
    #[error("malformed request: {0}")]
    MalformedRequest(&'static str),
    #[error("ambiguous request framing: {0}")]
    AmbiguousFraming(&'static str),
    #[error("a transfer coding other than chunked")]
    UnsupportedTransferCoding,
    #[error("bad Host: {0}")]
    BadHost(&'static str),
    #[error("the request's header fields exceed 32 KB")]
    HeadersTooLarge,
    #[error("a FastCGI parameter (the request target, or a path made of it) longer than a record holds")]
    ParameterTooLong,
    #[error("the client paused its request body longer than server.body_timeout")]
    BodyTimeout,
    #[error("the request body could not be read: {0}")]
    BadRequestBody(String),
    #[error("the request body exceeds server.max_body")]
    BodyTooLarge,
    #[error("upstream {upstream:?} failed ({kind:?}): {detail}")]
    Upstream {
        upstream: std::sync::Arc<str>,
        kind: UpstreamFailure,
        detail: String,
    },
    #[error("the rate-limit store failed and on_error = \"deny\"")]
    StoreUnavailable,
    #[error("the client closed the connection while its request was held")]
    ClientClosed,
}

impl GatewayError {
    /// The status a client sees for this error.
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            GatewayError::NoRoute | GatewayError::NotFound | GatewayError::NoChallenge => {
                StatusCode::NOT_FOUND
            }
            GatewayError::NotAFileMethod => StatusCode::METHOD_NOT_ALLOWED,
            GatewayError::SpoolFailed(_) => StatusCode::INTERNAL_SERVER_ERROR,
            GatewayError::Forbidden(_) => StatusCode::FORBIDDEN,
            GatewayError::BadPath(_)
            | GatewayError::AmbiguousKey(_)
            | GatewayError::MalformedRequest(_)
            | GatewayError::AmbiguousFraming(_)
            | GatewayError::BadHost(_)
            | GatewayError::BadRequestBody(_) => StatusCode::BAD_REQUEST,
            GatewayError::UnsupportedTransferCoding => StatusCode::NOT_IMPLEMENTED,
            GatewayError::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            GatewayError::ParameterTooLong => StatusCode::URI_TOO_LONG,
            GatewayError::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            GatewayError::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            GatewayError::Upstream { kind, .. } => match kind {
                UpstreamFailure::Connect
                | UpstreamFailure::Reset
                | UpstreamFailure::NoServer
                | UpstreamFailure::Tls => StatusCode::BAD_GATEWAY,
                UpstreamFailure::Timeout => StatusCode::GATEWAY_TIMEOUT,
                UpstreamFailure::QueueFull | UpstreamFailure::QueueTimeout | UpstreamFailure::NoPlace => {
                    StatusCode::SERVICE_UNAVAILABLE
                }
            },
            GatewayError::StoreUnavailable
            | GatewayError::NoBodyPlace
            | GatewayError::NoFilePlace
            | GatewayError::OutOfDescriptors => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::ClientClosed => {
                StatusCode::from_u16(CLIENT_CLOSED_REQUEST).expect("499 is a status code")
            }
        }
    }

    /// Whether the connection must close after this answer: the request's body was not
    /// read to its end, or its framing cannot be trusted to find the next request, or the
    /// process is out of descriptors (a connection closed gives one back).
    pub(crate) fn closes_connection(&self) -> bool {
        match self {
            GatewayError::AmbiguousFraming(_)
            | GatewayError::UnsupportedTransferCoding
            | GatewayError::BodyTimeout
            | GatewayError::SpoolFailed(_)
            | GatewayError::NoBodyPlace
            | GatewayError::OutOfDescriptors => true,
            GatewayError::NoRoute
            | GatewayError::NotFound
            | GatewayError::NoChallenge
            | GatewayError::NotAFileMethod
            | GatewayError::Forbidden(_)
            | GatewayError::BadPath(_)
            | GatewayError::AmbiguousKey(_)
            | GatewayError::MalformedRequest(_)
            | GatewayError::BadHost(_)
            | GatewayError::HeadersTooLarge
            | GatewayError::ParameterTooLong
            | GatewayError::BadRequestBody(_)
            | GatewayError::BodyTooLarge
            | GatewayError::Upstream { .. }
            | GatewayError::StoreUnavailable
            | GatewayError::NoFilePlace
            | GatewayError::ClientClosed => false,
        }
    }

    /// Whether the failure is logged as a warning: floodgate's or the upstream's (a 5xx),
    /// except a store failure, which the store reports once itself, and a place for an
    /// open file or an upstream connection not found or descriptors run out, which the
    /// room, the places and the accept loop report at most once a minute and a second (a
    /// flood would otherwise log a line a request).
    pub(crate) fn warns(&self) -> bool {
        self.status().is_server_error()
            && !matches!(
                self,
                GatewayError::StoreUnavailable
                    | GatewayError::NoBodyPlace
                    | GatewayError::NoFilePlace
                    | GatewayError::OutOfDescriptors
                    | GatewayError::Upstream {
                        kind: UpstreamFailure::NoPlace,
                        ..
                    }
            )
    }

    /// The `Retry-After` seconds of the answer, when it has one: a request shed by an
    /// upstream's concurrency cap, or for want of a place for an open file or an upstream
    /// connection, may be tried again at once.
    pub(crate) fn retry_after(&self) -> Option<u64> {
        match self {
            GatewayError::Upstream {
                kind: UpstreamFailure::QueueFull | UpstreamFailure::QueueTimeout | UpstreamFailure::NoPlace,
                ..
            }
            | GatewayError::StoreUnavailable
            | GatewayError::NoBodyPlace
            | GatewayError::NoFilePlace
            | GatewayError::OutOfDescriptors => Some(1),
            _ => None,
        }
    }

    /// The one-line body a client sees: the status's reason phrase, nothing internal.
    pub(crate) fn body(&self) -> String {
        let status = self.status();
        format!("{}\n", status.canonical_reason().unwrap_or("Error"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_upstream_failure_kind_is_listed_once_at_its_index() {
        for (index, kind) in UpstreamFailure::ALL.into_iter().enumerate() {
            assert_eq!(kind as usize, index, "{kind:?}");
        }
        let mut labels = UpstreamFailure::ALL.map(UpstreamFailure::label).to_vec();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), UpstreamFailure::ALL.len());
    }

    fn upstream(kind: UpstreamFailure) -> GatewayError {
        GatewayError::Upstream {
            upstream: "php".into(),
            kind,
            detail: "connection refused at 10.1.2.3:9000".into(),
        }
    }

    #[test]
    fn every_error_has_its_status() {
        assert_eq!(GatewayError::NoRoute.status(), StatusCode::NOT_FOUND);
        for full in [
            GatewayError::NoBodyPlace,
            GatewayError::NoFilePlace,
            upstream(UpstreamFailure::NoPlace),
            GatewayError::OutOfDescriptors,
        ] {
            assert_eq!(
                (full.status(), full.retry_after(), full.warns()),
                (StatusCode::SERVICE_UNAVAILABLE, Some(1), false),
                "{full}"
            );
        }
        // Only a body left unread, or a process out of descriptors, closes the connection.
        assert!(GatewayError::NoBodyPlace.closes_connection());
        assert!(GatewayError::OutOfDescriptors.closes_connection());
        assert!(!GatewayError::NoFilePlace.closes_connection());
        assert!(!upstream(UpstreamFailure::NoPlace).closes_connection());
        assert_eq!(GatewayError::Forbidden("x").status(), StatusCode::FORBIDDEN);
        assert_eq!(
            GatewayError::BadPath(PathError::AboveRoot).status(),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            GatewayError::MalformedRequest("x").status(),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            GatewayError::BadRequestBody("x".into()).status(),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(GatewayError::BodyTooLarge.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(
            GatewayError::AmbiguousFraming("x").status(),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            GatewayError::UnsupportedTransferCoding.status(),
            StatusCode::NOT_IMPLEMENTED
        );
        assert_eq!(GatewayError::BadHost("x").status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            GatewayError::HeadersTooLarge.status(),
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
        );
        assert_eq!(GatewayError::ParameterTooLong.status(), StatusCode::URI_TOO_LONG);
        assert_eq!(GatewayError::BodyTimeout.status(), StatusCode::REQUEST_TIMEOUT);
        assert_eq!(
            upstream(UpstreamFailure::Connect).status(),
            StatusCode::BAD_GATEWAY
        );
        assert_eq!(upstream(UpstreamFailure::Reset).status(), StatusCode::BAD_GATEWAY);
        assert_eq!(
            upstream(UpstreamFailure::Timeout).status(),
            StatusCode::GATEWAY_TIMEOUT
        );
        assert_eq!(GatewayError::ClientClosed.status().as_u16(), 499);
        assert_eq!(
            upstream(UpstreamFailure::NoServer).status(),
            StatusCode::BAD_GATEWAY
        );
        for shed in [UpstreamFailure::QueueFull, UpstreamFailure::QueueTimeout] {
            assert_eq!(upstream(shed).status(), StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(upstream(shed).retry_after(), Some(1));
        }
        assert_eq!(upstream(UpstreamFailure::Connect).retry_after(), None);
        assert_eq!(
            GatewayError::StoreUnavailable.status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(GatewayError::StoreUnavailable.retry_after(), Some(1));
    }

    #[test]
    fn bodies_are_one_line_and_leak_nothing() {
        let body = upstream(UpstreamFailure::Connect).body();
        assert_eq!(body, "Bad Gateway\n");
        assert_eq!(GatewayError::NoRoute.body(), "Not Found\n");
        assert_eq!(upstream(UpstreamFailure::Timeout).body(), "Gateway Timeout\n");
    }
}
