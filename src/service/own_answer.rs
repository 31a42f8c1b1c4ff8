//! The answers floodgate makes itself instead of relaying an upstream's: its errors (each
//! [`GatewayError`] with its status), a limit's refusal, its redirects, and the answers
//! to ACME http-01 challenges; and
//! [`render`], the one place each becomes a response (docs/configuration.md#status-codes).
//! The outer handler then gives it what every response gets: the header rules, the
//! rate-limit headers and HSTS.

use std::cell::RefCell;
use std::collections::HashMap;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode, Version};

use super::response_body::{Payload, full};
use crate::access_log::AccessRecord;
use crate::config::ErrorPage;
use crate::error::GatewayError;

/// An answer floodgate makes itself.
#[derive(Debug)]
pub(crate) enum OwnAnswer {
    /// A request floodgate could not serve.
    Error(GatewayError),
    /// A limit refused the request.
    Refused(Refusal),
    /// A 308 to this location: `redirect_http`'s, or a site directory's with its slash.
    Redirect(HeaderValue),
    /// The key authorization answering an ACME http-01 challenge (RFC 8555 §8.3).
    AcmeChallenge(Bytes),
}

/// A limit's refusal: its status, and its `message` as the body, of its `content_type`.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub(crate) status: StatusCode,
    pub(crate) message: Bytes,
    pub(crate) content_type: HeaderValue,
    /// `Retry-After` seconds.
    pub(crate) retry_after: u64,
}

impl From<GatewayError> for OwnAnswer {
    fn from(error: GatewayError) -> Self {
        OwnAnswer::Error(error)
    }
}

/// The response for `answer` to a request of `version`: an error's body comes from
/// `pages` (`[server.errors]`) when it has its status, a refusal's is the limit's message.
/// An error is logged here, once.
pub(crate) fn render(
    answer: OwnAnswer,
    record: &AccessRecord,
    version: Version,
    pages: &HashMap<u16, ErrorPage>,
) -> Response<Payload> {
    let (status, body, content_type, retry_after) = match &answer {
        OwnAnswer::Error(error) => {
            let status = error.status();
            if error.warns() {
                tracing::warn!(route = %record.route, path = %record.path, client_ip = %record.client_ip, %error, "request failed");
            } else {
                tracing::debug!(route = %record.route, path = %record.path, client_ip = %record.client_ip, %error, "request refused");
            }
            let (body, content_type) = match pages.get(&status.as_u16()) {
                Some(page) => (page.body.clone(), page.content_type.clone()),
                None => (Bytes::from(error.body()), plain_text()),
            };
            (status, body, Some(content_type), error.retry_after())
        }
        OwnAnswer::Refused(refusal) => (
            refusal.status,
            refusal.message.clone(),
            Some(refusal.content_type.clone()),
            Some(refusal.retry_after),
        ),
        OwnAnswer::Redirect(_) => (StatusCode::PERMANENT_REDIRECT, Bytes::new(), None, None),
        OwnAnswer::AcmeChallenge(key_authorization) => (
            StatusCode::OK,
            key_authorization.clone(),
            Some(HeaderValue::from_static("application/octet-stream")),
            None,
        ),
    };
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    if let Some(content_type) = content_type {
        headers.insert(header::CONTENT_TYPE, content_type);
    }
    if let Some(seconds) = retry_after {
        headers.insert(header::RETRY_AFTER, retry_after_value(seconds));
    }
    match answer {
        OwnAnswer::Redirect(location) => {
            headers.insert(header::LOCATION, location);
        }
        OwnAnswer::Error(GatewayError::NotAFileMethod) => {
            headers.insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        }
        // HTTP/2 ends only the stream; the connection-wide header is HTTP/1's alone.
        OwnAnswer::Error(error) if error.closes_connection() && version < Version::HTTP_2 => {
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        OwnAnswer::Error(_) | OwnAnswer::Refused(_) | OwnAnswer::AcmeChallenge(_) => {}
    }
    response
}

/// `seconds` as a `Retry-After` value. The last one made on this thread is kept and
/// shared: refusals in a flood carry the same few values, and making each anew was an
/// allocation per refusal.
fn retry_after_value(seconds: u64) -> HeaderValue {
    thread_local! {
        static LAST: RefCell<Option<(u64, HeaderValue)>> = const { RefCell::new(None) };
    }
    LAST.with_borrow_mut(|last| match last {
        Some((made_for, value)) if *made_for == seconds => value.clone(),
        _ => {
            let value = HeaderValue::from(seconds);
            *last = Some((seconds, value.clone()));
            value
        }
    })
}

fn plain_text() -> HeaderValue {
    HeaderValue::from_static("text/plain; charset=utf-8")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_values_are_the_seconds_asked_whatever_came_before() {
        for seconds in [1, 1, 2, 3600, 3600, 1, 0, u64::MAX] {
            assert_eq!(retry_after_value(seconds), seconds.to_string().as_str());
        }
    }
}
