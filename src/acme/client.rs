//! instant-acme's HTTP over floodgate's own client ([`OneShot`]): each call bounded in
//! time, and the CA's `Retry-After` on a refusal kept for the backoff (instant-acme's
//! errors do not carry it).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{Request, StatusCode, header};
use instant_acme::{BodyWrapper, BytesResponse, HttpClient};

use crate::outbound::OneShot;

/// How long one call to the CA may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

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
            let response = tokio::time::timeout(CALL_TIMEOUT, this.client.send(request))
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

/// A `Retry-After` value: seconds, or an HTTP date.
fn retry_after(value: &str) -> Option<SystemTime> {
    match value.trim().parse::<u64>() {
        Ok(seconds) => Some(SystemTime::now() + Duration::from_secs(seconds)),
        Err(_) => httpdate::parse_http_date(value.trim()).ok(),
    }
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
    }
}
