//! The answers to a CA's challenges: those this instance published (kept in memory), then
//! those another instance published (in shared storage), and tls-alpn-01's certificate
//! (RFC 8737) built from the key authorization.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;
use sha2::Digest as _;

use super::storage::{Challenge, Storage};
use crate::logging::LogThrottle;

/// The path prefix of http-01 (RFC 8555 §8.3).
const HTTP_PREFIX: &str = "/.well-known/acme-challenge/";
/// How long a read of the challenges in shared storage answers lookups: however many
/// requests ask for challenges, made-up tokens included, storage is read at most this often.
const STORED_SEEN_FOR: Duration = Duration::from_millis(500);
/// How long an instance that orders waits after publishing before asking the CA to
/// validate: longer than [`STORED_SEEN_FOR`], so that every instance reads storage anew
/// before the CA asks.
pub(super) const NOTICE: Duration = Duration::from_secs(1);

/// The token of an http-01 request's `path`: base64url (RFC 8555 §8.1), of a sane length.
pub(crate) fn http_token(path: &str) -> Option<&str> {
    let token = path.strip_prefix(HTTP_PREFIX)?;
    let valid = (16..=256).contains(&token.len())
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    valid.then_some(token)
}

pub(super) struct Challenges {
    own: Mutex<HashMap<Challenge, String>>,
    /// What shared storage held.
    stored: SharedRead<HashMap<Challenge, String>>,
    warnings: LogThrottle,
}

impl Challenges {
    pub(super) fn new() -> Challenges {
        Challenges {
            own: Mutex::default(),
            stored: SharedRead::default(),
            warnings: LogThrottle::default(),
        }
    }

    /// The key authorization that answers `challenge`, if any instance published one.
    pub(super) async fn answer(&self, storage: &Storage, challenge: &Challenge) -> Option<String> {
        if let Some(own) = self.own().get(challenge) {
            return Some(own.clone());
        }
        if !storage.shared() {
            return None;
        }
        let stored = self
            .stored
            .get(|| async {
                storage.published().await.unwrap_or_else(|error| {
                    if self.warnings.ready() {
                        tracing::warn!(%error, "ACME: cannot read the challenges in storage (logged once a minute at most)");
                    }
                    HashMap::new()
                })
            })
            .await;
        stored.get(challenge).cloned()
    }

    fn own(&self) -> std::sync::MutexGuard<'_, HashMap<Challenge, String>> {
        self.own.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A value read from elsewhere, shared by every lookup: one lookup reads it while the
/// others wait for that read, so a flood of lookups is one read of storage (and the CA's
/// own lookup is never turned away for want of room). A read answers the lookups that
/// arrived before it began, however long it took, and later ones for
/// [`STORED_SEEN_FOR`] from its start.
struct SharedRead<T> {
    last: tokio::sync::Mutex<Option<(Instant, T)>>,
}

impl<T> Default for SharedRead<T> {
    fn default() -> Self {
        SharedRead {
            last: tokio::sync::Mutex::new(None),
        }
    }
}

impl<T> SharedRead<T> {
    async fn get<F: Future<Output = T>>(
        &self,
        read: impl FnOnce() -> F,
    ) -> tokio::sync::MappedMutexGuard<'_, T> {
        let arrived = Instant::now();
        let mut last = self.last.lock().await;
        let answers = |(began, _): &(Instant, T)| *began >= arrived || began.elapsed() < STORED_SEEN_FOR;
        if !last.as_ref().is_some_and(answers) {
            // Timed from before the read: what it returns is at least that recent.
            let began = Instant::now();
            *last = Some((began, read().await));
        }
        tokio::sync::MutexGuard::map(last, |last| {
            &mut last.as_mut().expect("read just above when absent").1
        })
    }
}

/// The challenges one order published: withdrawn when the order is done, and from this
/// instance's memory when it is dropped half way (a timeout, a lost lock); what stays in
/// shared storage then expires with its TTL.
pub(super) struct Published<'a> {
    challenges: &'a Challenges,
    storage: &'a Storage,
    published: Vec<Challenge>,
}

impl<'a> Published<'a> {
    pub(super) fn new(challenges: &'a Challenges, storage: &'a Storage) -> Published<'a> {
        Published {
            challenges,
            storage,
            published: Vec::new(),
        }
    }

    /// Answers `challenge` with `key_authorization` from now on, on every instance.
    pub(super) async fn publish(
        &mut self,
        challenge: Challenge,
        key_authorization: &str,
    ) -> Result<(), String> {
        self.storage.publish(&challenge, key_authorization).await?;
        self.challenges
            .own()
            .insert(challenge.clone(), key_authorization.to_owned());
        self.published.push(challenge);
        Ok(())
    }

    pub(super) async fn withdraw(mut self) {
        for challenge in std::mem::take(&mut self.published) {
            self.challenges.own().remove(&challenge);
            if let Err(error) = self.storage.withdraw(&challenge).await {
                tracing::debug!(%error, "an answered ACME challenge stays in storage until its TTL");
            }
        }
    }
}

impl Drop for Published<'_> {
    fn drop(&mut self) {
        let mut own = self.challenges.own();
        for challenge in &self.published {
            own.remove(challenge);
        }
    }
}

/// The self-signed certificate that answers tls-alpn-01 for `name` (RFC 8737 §3): the
/// name, and the SHA-256 of the key authorization in the critical acmeIdentifier extension.
pub(super) fn alpn_certificate(name: &str, key_authorization: &str) -> Result<Arc<CertifiedKey>, String> {
    let digest = sha2::Sha256::digest(key_authorization.as_bytes());
    let mut params = rcgen::CertificateParams::new(vec![name.to_owned()]).map_err(|e| e.to_string())?;
    params.custom_extensions = vec![rcgen::CustomExtension::new_acme_identifier(&digest)];
    let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
    let certificate = params.self_signed(&key).map_err(|e| e.to_string())?;
    let chain = vec![CertificateDer::from(certificate.der().to_vec())];
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let signing = crate::config::tls_provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| e.to_string())?;
    // Not checked with `keys_match`: webpki refuses to parse a certificate with the critical
    // acmeIdentifier extension, and this pair was made together just above.
    Ok(Arc::new(CertifiedKey::new(chain, signing)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn lookups_that_waited_for_a_slow_read_share_it() {
        let shared = Arc::new(SharedRead::default());
        let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let lookup = |taking: Duration| {
            let (shared, reads) = (shared.clone(), reads.clone());
            async move {
                *shared
                    .get(|| async {
                        tokio::time::sleep(taking).await;
                        reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1
                    })
                    .await
            }
        };
        // Storage that hangs until its timeout: the lookups queued behind the read get it.
        let lookups: Vec<_> = (0..5)
            .map(|_| tokio::spawn(lookup(Duration::from_secs(5))))
            .collect();
        for lookup in lookups {
            assert_eq!(lookup.await.unwrap(), 1);
        }
        // A lookup that arrives after a read began reads anew once that read is old...
        assert_eq!(lookup(Duration::ZERO).await, 2);
        // ...and takes it while it is recent.
        tokio::time::advance(STORED_SEEN_FOR / 2).await;
        assert_eq!(lookup(Duration::ZERO).await, 2);
        tokio::time::advance(STORED_SEEN_FOR / 2).await;
        assert_eq!(lookup(Duration::ZERO).await, 3);
    }

    #[test]
    fn only_well_formed_tokens_are_looked_up() {
        let token = "LoqXcYV8q5ONbJQxbmR7SCTNo3tiAXDfowyjxAjEuX0";
        assert_eq!(http_token(&format!("{HTTP_PREFIX}{token}")), Some(token));
        for bad in [
            "/.well-known/acme-challenge/",
            "/.well-known/acme-challenge/short",
            "/.well-known/acme-challenge/LoqXcYV8q5ONbJQxbmR7SC/../x",
            "/.well-known/acme-challenge/LoqXcYV8q5ONbJQxbmR7SCTNo3tiAXDf%2e",
            "/.well-known/acme-challenge/LoqXcYV8q5ONbJQxbmR7SCTNo3tiAXDf.x",
            "/well-known/acme-challenge/LoqXcYV8q5ONbJQxbmR7SCTNo3tiAXDfowyjxAjEuX0",
        ] {
            assert_eq!(http_token(bad), None, "{bad}");
        }
        assert_eq!(http_token(&format!("{HTTP_PREFIX}{}", "a".repeat(257))), None);
    }

    #[test]
    fn the_alpn_certificate_carries_the_digest_in_a_critical_extension() {
        let certified = alpn_certificate("www.example.com", "token.thumbprint").unwrap();
        let (_, parsed) = x509_parser::parse_x509_certificate(&certified.cert[0]).unwrap();
        let acme_identifier = x509_parser::oid_registry::Oid::from(&[1, 3, 6, 1, 5, 5, 7, 1, 31]).unwrap();
        let extension = parsed
            .extensions()
            .iter()
            .find(|e| e.oid == acme_identifier)
            .expect("the acmeIdentifier extension");
        assert!(extension.critical);
        // An OCTET STRING of the 32-byte digest.
        let digest = sha2::Sha256::digest(b"token.thumbprint");
        assert_eq!(extension.value, [&[0x04, 0x20][..], &digest[..]].concat());
        let names: Vec<String> = parsed
            .subject_alternative_name()
            .unwrap()
            .unwrap()
            .value
            .general_names
            .iter()
            .map(|n| n.to_string())
            .collect();
        assert_eq!(names, ["DNSName(www.example.com)"]);
    }
}
