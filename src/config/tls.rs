//! Validation of `[server.tls]` and of upstreams' `tls_ca` (docs/configuration.md#servertls):
//! every certificate and key is loaded here, at load, and each key checked against its
//! certificate, so that `floodgate check` and a reload find what a handshake would.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use toml::Spanned;

use super::acme::{AcmeConfig, validate_acme};
use super::error::ErrorSink;
use super::file::{CertificateFile, TlsFile};
use super::{parse_or, parse_spanned, socket_addr, values};

/// `[server.tls]`: the HTTPS listener.
#[derive(Debug, Clone)]
pub struct TlsConfig {
    pub listen: SocketAddr,
    /// The files' certificates, the first the default; at least one unless `acme`.
    pub certificates: Vec<Certificate>,
    pub min_version: TlsVersion,
    /// The plain listener answers every request with a 308 to https.
    pub redirect_http: bool,
    /// The `Strict-Transport-Security` value (`max-age=N`), when `hsts` is above zero.
    pub hsts: Option<http::HeaderValue>,
    /// `[server.tls.acme]`.
    pub acme: Option<AcmeConfig>,
}

/// The oldest TLS version the listener accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsVersion {
    Tls12,
    Tls13,
}

/// One certificate chain and its key, loaded.
#[derive(Debug, Clone)]
pub struct Certificate {
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
    pub key: Arc<CertifiedKey>,
    /// The leaf's DNS names (subject alternative names), lower case; `*.` wildcards kept.
    pub names: Vec<String>,
    /// The leaf's notAfter, in Unix seconds.
    pub not_after: i64,
}

impl Certificate {
    /// The metric label: the first DNS name, or the file when there is none.
    pub fn label(&self) -> String {
        self.names
            .first()
            .cloned()
            .unwrap_or_else(|| self.cert_path.display().to_string())
    }
}

/// The crypto provider of every TLS connection floodgate makes or accepts.
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub(super) fn validate_tls(raw: &Spanned<TlsFile>, base: &Path, sink: &mut ErrorSink) -> Option<TlsConfig> {
    let raw = raw.get_ref();
    let listen = parse_spanned(&raw.listen, "server.tls.listen", sink, socket_addr);
    let acme = raw.acme.as_ref().map(|acme| validate_acme(acme, base, sink));
    let listed = raw
        .certificates
        .as_ref()
        .map_or(&[][..], |c| c.get_ref().as_slice());
    if listed.is_empty() && acme.is_none() {
        sink.push(
            raw.certificates.as_ref().map(Spanned::span),
            "server.tls.certificates",
            "expected at least one { cert = \"...\", key = \"...\" }, or [server.tls.acme]",
        );
    }
    let certificates: Option<Vec<Certificate>> = listed
        .iter()
        .enumerate()
        .map(|(i, pair)| {
            load_pair(
                &format!("server.tls.certificates[{i}]"),
                pair.get_ref(),
                base,
                sink,
            )
        })
        .collect();
    let min_version = parse_or(
        &raw.min_version,
        "server.tls.min_version",
        TlsVersion::Tls12,
        sink,
        |text| match text {
            "1.2" => Ok(TlsVersion::Tls12),
            "1.3" => Ok(TlsVersion::Tls13),
            other => Err(format!("expected \"1.2\" or \"1.3\", got {other:?}")),
        },
    );
    let hsts = parse_or(
        &raw.hsts,
        "server.tls.hsts",
        Duration::ZERO,
        sink,
        values::duration,
    );
    let acme = acme.map(|acme| acme.ok_or(())).transpose().ok()?;
    let certificates = certificates.filter(|c| !c.is_empty() || acme.is_some())?;
    Some(TlsConfig {
        listen: listen?,
        certificates,
        acme,
        min_version,
        redirect_http: raw.redirect_http.unwrap_or(false),
        hsts: (!hsts.is_zero()).then(|| {
            http::HeaderValue::try_from(format!("max-age={}", hsts.as_secs()))
                .expect("digits are a valid header value")
        }),
    })
}

fn load_pair(key: &str, raw: &CertificateFile, base: &Path, sink: &mut ErrorSink) -> Option<Certificate> {
    let cert_path = base.join(raw.cert.get_ref());
    let key_path = base.join(raw.key.get_ref());
    let chain = parse_spanned(&raw.cert, format!("{key}.cert"), sink, |_| load_chain(&cert_path));
    let private = parse_spanned(&raw.key, format!("{key}.key"), sink, |_| {
        PrivateKeyDer::from_pem_file(&key_path).map_err(|e| {
            format!(
                "{}: expected a PEM private key (PKCS#8, PKCS#1 RSA or SEC1 EC): {e}",
                key_path.display()
            )
        })
    });
    let (chain, private) = (chain?, private?);
    let leaf = parse_spanned(&raw.cert, format!("{key}.cert"), sink, |_| {
        leaf_facts(&chain[0]).map_err(|e| format!("{}: {e}", cert_path.display()))
    });
    let certified = parse_spanned(&raw.key, format!("{key}.key"), sink, |_| {
        certified_key(chain.clone(), private).map_err(|e| match e {
            KeyProblem::Unusable(e) => format!("{}: unusable private key: {e}", key_path.display()),
            KeyProblem::Mismatch => format!(
                "{}: the key does not match the certificate in {}",
                key_path.display(),
                cert_path.display()
            ),
        })
    });
    let leaf = leaf?;
    Some(Certificate {
        cert_path,
        key_path,
        key: Arc::new(certified?),
        names: leaf.names,
        not_after: leaf.not_after,
    })
}

/// Why a key cannot serve a chain.
#[derive(Debug)]
pub(crate) enum KeyProblem {
    Unusable(rustls::Error),
    Mismatch,
}

/// `chain` with its `key`, checked to belong together.
pub(crate) fn certified_key(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<CertifiedKey, KeyProblem> {
    let signing = provider()
        .key_provider
        .load_private_key(key)
        .map_err(KeyProblem::Unusable)?;
    let certified = CertifiedKey::new(chain, signing);
    certified.keys_match().map_err(|_| KeyProblem::Mismatch)?;
    Ok(certified)
}

/// The certificates of a PEM file: a listener's chain, or an upstream's `tls_ca` roots.
pub(super) fn load_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let chain = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{}: expected a PEM certificate chain: {e}", path.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no certificate in the file", path.display()));
    }
    Ok(chain)
}

/// What serving a certificate needs to know of its leaf.
pub(crate) struct LeafFacts {
    /// DNS names (subject alternative names), lower case.
    pub(crate) names: Vec<String>,
    /// Unix seconds.
    pub(crate) not_before: i64,
    pub(crate) not_after: i64,
}

/// The leaf's DNS names and validity.
pub(crate) fn leaf_facts(leaf: &CertificateDer<'_>) -> Result<LeafFacts, String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(leaf)
        .map_err(|e| format!("the first certificate cannot be read: {e}"))?;
    let names = parsed
        .subject_alternative_name()
        .ok()
        .flatten()
        .map(|extension| {
            extension
                .value
                .general_names
                .iter()
                .filter_map(|name| match name {
                    x509_parser::extensions::GeneralName::DNSName(dns) => Some(dns.to_ascii_lowercase()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(LeafFacts {
        names,
        not_before: parsed.validity().not_before.timestamp(),
        not_after: parsed.validity().not_after.timestamp(),
    })
}
