//! One attempt to obtain the certificate (RFC 8555 §7.4): an order for every name, each
//! name proven over http-01 on the plain listener and, for the names http-01 did not
//! prove, over tls-alpn-01 on the TLS listener in a second order of the same attempt;
//! then a new key, its signing request, and the issued chain.

use std::collections::HashSet;
use std::time::Duration;

use instant_acme::{
    Account, AuthorizationStatus, ChallengeType, Identifier, NewOrder, Order, OrderStatus, RetryPolicy,
};

use super::challenge::{Challenges, NOTICE, Published};
use super::storage::{Challenge, Storage, StoredCertificate};

/// How long the CA may take to validate the challenges, and to issue.
const VALIDATION: Duration = Duration::from_secs(120);

/// Why no certificate was obtained.
#[derive(Debug)]
pub(super) enum Failure {
    /// The CA does not know the account (it was deactivated, or a test CA restarted).
    UnknownAccount(String),
    Other(String),
}

impl From<String> for Failure {
    fn from(detail: String) -> Self {
        Failure::Other(detail)
    }
}

impl From<Failure> for String {
    fn from(failure: Failure) -> String {
        match failure {
            Failure::UnknownAccount(detail) | Failure::Other(detail) => detail,
        }
    }
}

/// Obtains a certificate for `domains`, publishing the challenges through `challenges`.
pub(super) async fn obtain(
    account: &Account,
    domains: &[String],
    challenges: &Challenges,
    storage: &Storage,
) -> Result<StoredCertificate, Failure> {
    let identifiers: Vec<Identifier> = domains.iter().map(|name| Identifier::Dns(name.clone())).collect();
    let mut over_tls: HashSet<String> = HashSet::new();
    loop {
        let mut order = account
            .new_order(&NewOrder::new(&identifiers))
            .await
            .map_err(|e| match &e {
                instant_acme::Error::Api(problem)
                    if problem.r#type.as_deref()
                        == Some("urn:ietf:params:acme:error:accountDoesNotExist") =>
                {
                    Failure::UnknownAccount(format!("new order: {e}"))
                }
                _ => Failure::Other(format!("new order: {e}")),
            })?;
        let mut published = Published::new(challenges, storage);
        let validated = validate(&mut order, &over_tls, storage.shared(), &mut published).await;
        published.withdraw().await;
        match validated {
            Ok(OrderStatus::Ready) => return Ok(finalize(&mut order, domains).await?),
            outcome => {
                let (ended, problems) = failures(&mut order).await;
                let failed = unproven_over_http(&ended, &over_tls);
                let mut detail = match outcome {
                    Ok(status) => format!("the order is {status:?}"),
                    Err(error) => error,
                };
                if !problems.is_empty() {
                    detail = format!("{detail}; {}", problems.join("; "));
                }
                if failed.is_empty() || !over_tls.is_empty() {
                    return Err(Failure::Other(detail));
                }
                tracing::info!(names = ?failed, %detail, "http-01 validation failed; trying tls-alpn-01 for these names");
                over_tls = failed;
            }
        }
    }
}

/// Answers the pending authorizations of `order` and waits for the CA's verdict.
async fn validate(
    order: &mut Order,
    over_tls: &HashSet<String>,
    shared: bool,
    published: &mut Published<'_>,
) -> Result<OrderStatus, String> {
    let mut noticed = !shared;
    let mut authorizations = order.authorizations();
    while let Some(authorization) = authorizations.next().await {
        let mut authorization = authorization.map_err(|e| format!("authorization: {e}"))?;
        match authorization.status {
            AuthorizationStatus::Pending => {}
            AuthorizationStatus::Valid => continue,
            status => return Err(format!("an authorization is {status:?}")),
        }
        let name = authorization.identifier().to_string();
        // http-01 first, unless it failed for this name or the CA does not offer it.
        let offers_http = authorization
            .challenges
            .iter()
            .any(|c| c.r#type == ChallengeType::Http01);
        let kind = if over_tls.contains(&name) || !offers_http {
            ChallengeType::TlsAlpn01
        } else {
            ChallengeType::Http01
        };
        let mut challenge = authorization
            .challenge(kind.clone())
            .ok_or_else(|| format!("the CA offers neither http-01 nor tls-alpn-01 for {name}"))?;
        let answer = match kind {
            ChallengeType::Http01 => Challenge::Http(challenge.token.clone()),
            _ => Challenge::TlsAlpn(name.clone()),
        };
        published
            .publish(answer, challenge.key_authorization().as_str())
            .await?;
        if !noticed {
            tokio::time::sleep(NOTICE).await;
            noticed = true;
        }
        challenge
            .set_ready()
            .await
            .map_err(|e| format!("challenge for {name}: {e}"))?;
    }
    order
        .poll_ready(&RetryPolicy::new().timeout(VALIDATION))
        .await
        .map_err(|e| format!("validation: {e}"))
}

/// What the CA says of each of `order`'s authorizations once it failed: each name's
/// status (`None`: it could not be read), and the problem of each failed challenge.
async fn failures(order: &mut Order) -> (Vec<(String, Option<AuthorizationStatus>)>, Vec<String>) {
    let mut ended = Vec::new();
    let mut problems = Vec::new();
    let mut authorizations = order.authorizations();
    while let Some(Ok(mut authorization)) = authorizations.next().await {
        let name = authorization.identifier().to_string();
        if authorization.refresh().await.is_err() {
            ended.push((name, None));
            continue;
        }
        if authorization.status == AuthorizationStatus::Invalid {
            for challenge in &authorization.challenges {
                if let Some(problem) = &challenge.error {
                    problems.push(format!("{name} over {:?}: {problem}", challenge.r#type));
                }
            }
        }
        ended.push((name, Some(authorization.status)));
    }
    (ended, problems)
}

/// The names to prove over tls-alpn-01 in the next order: every one that `ended` does not
/// say is valid, unless it was tried over TLS already (`over_tls`). Not only the invalid
/// ones: a CA marks the order invalid at the first failure, while the other names may
/// still be validating over http-01 (and fail there too, with port 80 closed).
fn unproven_over_http(
    ended: &[(String, Option<AuthorizationStatus>)],
    over_tls: &HashSet<String>,
) -> HashSet<String> {
    ended
        .iter()
        .filter(|(name, status)| *status != Some(AuthorizationStatus::Valid) && !over_tls.contains(name))
        .map(|(name, _)| name.clone())
        .collect()
}

/// A new key, the request to sign it for `domains`, and the issued chain.
async fn finalize(order: &mut Order, domains: &[String]) -> Result<StoredCertificate, String> {
    let key = rcgen::KeyPair::generate().map_err(|e| format!("key: {e}"))?;
    let mut params = rcgen::CertificateParams::new(domains.to_vec()).map_err(|e| format!("request: {e}"))?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    let request = params
        .serialize_request(&key)
        .map_err(|e| format!("request: {e}"))?;
    order
        .finalize_csr(request.der())
        .await
        .map_err(|e| format!("finalize: {e}"))?;
    let chain = order
        .poll_certificate(&RetryPolicy::new().timeout(VALIDATION))
        .await
        .map_err(|e| format!("certificate: {e}"))?;
    Ok(StoredCertificate {
        chain,
        key: key.serialize_pem(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_not_yet_valid_goes_over_tls_not_only_the_invalid_ones() {
        let ended = [
            ("a.test", Some(AuthorizationStatus::Invalid)),
            ("b.test", Some(AuthorizationStatus::Pending)),
            ("c.test", Some(AuthorizationStatus::Valid)),
            ("d.test", None),
            ("e.test", Some(AuthorizationStatus::Invalid)),
        ]
        .map(|(name, status)| (name.to_owned(), status));
        let tried_over_tls = HashSet::from(["e.test".to_owned()]);
        let mut next: Vec<String> = unproven_over_http(&ended, &tried_over_tls).into_iter().collect();
        next.sort();
        assert_eq!(next, ["a.test", "b.test", "d.test"]);
    }
}
