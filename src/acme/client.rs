//! instant-acme's HTTP over floodgate's own client ([`OneShot`]): each call, its body
//! included, bounded in time and size, and the CA's `Retry-After` on a refusal kept for the
//! backoff (instant-acme's errors do not carry it).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt as _, Full, Limited};
use instant_acme::{BodyWrapper, BytesResponse, HttpClient};

use crate::outbound::OneShot;

/// How long one call to the CA may take, its body read.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest answer read from the CA (a certificate chain is a few KB).
const MAX_BODY: usize = 1 << 20;
/// The longest `Retry-After` taken from the CA.
const LONGEST_ASKED: Duration = Duration::from_secs(30 * 86_400);

#[derive(Clone)]
pub(super) struct CaClient {
    client: Arc<OneShot>,
    /// The latest `Retry-After` of a 429 or 503 from the CA.
    retry_after: Arc<Mutex<Option<SystemTime>>>,
}

impl CaClient {
    pub(super) fn new(client: OneShot) -> CaClient {
        CaClient {
            client: Arc::new(client),
            retry_after: Arc::default(),
        }
    }

    /// How long the CA asked to wait, if it did since the last call of this.
    pub(super) fn take_retry_after(&self) -> Option<Duration> {
        let asked = self
            .retry_after
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        Some(asked.duration_since(SystemTime::now()).unwrap_or(Duration::ZERO))
    }
}

impl HttpClient for CaClient {
    fn request(
        &self,
        request: Request<BodyWrapper<Bytes>>,
    ) -> Pin<Box<dyn Future<Output = Result<BytesResponse, instant_acme::Error>> + Send>> {
        let this = self.clone();
        Box::pin(async move {
            let call = async {
                let response = this.client.send(request).await?;
                let (head, body) = response.into_parts();
                let body = Limited::new(body, MAX_BODY)
                    .collect()
                    .await
                    .map_err(|error| format!("the CA's answer: {error}"))?
                    .to_bytes();
                Ok::<_, String>(http::Response::from_parts(head, Full::new(body)))
            };
            let response = tokio::time::timeout(CALL_TIMEOUT, call)
                .await
                .map_err(|_| instant_acme::Error::Str("the CA did not answer within 30 s"))?
                .map_err(|error| instant_acme::Error::Other(error.into()))?;
            if matches!(
                response.status(),
                StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
            ) && let Some(at) = response
                .headers()
                .get(header::RETRY_AFTER)
                .and_then(|value| value.to_str().ok())
                .and_then(retry_after)
            {
                *this.retry_after.lock().unwrap_or_else(|p| p.into_inner()) = Some(at);
            }
            Ok(BytesResponse::from(response))
        })
    }
}

/// A `Retry-After` value: seconds, or an HTTP date; at most [`LONGEST_ASKED`] away.
fn retry_after(value: &str) -> Option<SystemTime> {
    let now = SystemTime::now();
    let at = match value.trim().parse::<u64>() {
        Ok(seconds) => now.checked_add(Duration::from_secs(seconds).min(LONGEST_ASKED))?,
        Err(_) => httpdate::parse_http_date(value.trim()).ok()?,
    };
    Some(at.min(now + LONGEST_ASKED))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_read_in_both_forms() {
        let in_two_minutes = retry_after("120").unwrap();
        let delay = in_two_minutes.duration_since(SystemTime::now()).unwrap();
        assert!(delay > Duration::from_secs(118) && delay <= Duration::from_secs(120));
        assert_eq!(
            retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_480))
        );
        assert_eq!(retry_after("soon"), None);
        // A CA asking for ages (or garbage that parses) waits 30 days at most.
        for ages in ["18446744073709551615", "Fri, 31 Dec 9999 23:59:59 GMT"] {
            let at = retry_after(ages).unwrap();
            assert!(at.duration_since(SystemTime::now()).unwrap() <= LONGEST_ASKED);
        }
    }
}
