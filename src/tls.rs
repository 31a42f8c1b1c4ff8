//! The HTTPS listener's TLS: the rustls server configuration built from `[server.tls]`
//! for each loaded configuration (so a reload's certificates serve the next handshakes),
//! with the certificate chosen by the client's SNI name, and the handshake failures'
//! accounting.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::version::{TLS12, TLS13};
use tokio_rustls::TlsAcceptor;

use crate::config::{TlsConfig, TlsVersion, tls_provider};
use crate::router::normalize_host;

/// The acceptor for `config`'s certificates and versions, offering HTTP/2 and HTTP/1.1
/// by ALPN.
pub(crate) fn acceptor(config: &TlsConfig) -> TlsAcceptor {
    let versions: &[&'static rustls::SupportedProtocolVersion] = match config.min_version {
        TlsVersion::Tls12 => &[&TLS13, &TLS12],
        TlsVersion::Tls13 => &[&TLS13],
    };
    let resolver = ByServerName {
        certificates: config
            .certificates
            .iter()
            .map(|c| (c.names.clone(), c.key.clone()))
            .collect(),
    };
    let mut server = rustls::ServerConfig::builder_with_provider(tls_provider())
        .with_protocol_versions(versions)
        .expect("the provider supports TLS 1.2 and 1.3")
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    TlsAcceptor::from(Arc::new(server))
}

/// Chooses the certificate whose DNS names match the client's SNI name, read as routing
/// reads a `Host` (lowercase, no trailing dot: a client may send `shop.example.net.`);
/// the first one when there is no SNI name or no match.
#[derive(Debug)]
struct ByServerName {
    /// `(names, key)` in file order; at least one.
    certificates: Vec<(Vec<String>, Arc<CertifiedKey>)>,
}

impl ResolvesServerCert for ByServerName {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let chosen = hello.server_name().and_then(normalize_host).and_then(|asked| {
            self.certificates
                .iter()
                .find(|(names, _)| names.iter().any(|name| matches(name, &asked)))
        });
        chosen.or(self.certificates.first()).map(|(_, key)| key.clone())
    }
}

/// Whether certificate name `name` (perhaps `*.example.com`) covers `host`: a wildcard
/// stands for exactly one leftmost label.
fn matches(name: &str, host: &str) -> bool {
    match name.strip_prefix("*.") {
        Some(parent) => host
            .split_once('.')
            .is_some_and(|(label, rest)| !label.is_empty() && rest == parent),
        None => name == host,
    }
}

/// Logs a failed handshake at most once a second (they are all counted): a scanner
/// sending plain HTTP to the TLS port must not flood the log.
pub(crate) fn log_handshake_failure(peer: std::net::SocketAddr, error: &std::io::Error) {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if LAST.swap(now, Ordering::Relaxed) != now {
        tracing::warn!(%peer, %error, "TLS handshake failed (one line a second at most; all are counted in floodgate_tls_handshake_errors_total)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_cover_one_label() {
        assert!(matches("example.com", "example.com"));
        assert!(!matches("example.com", "www.example.com"));
        assert!(matches("*.example.com", "shop.example.com"));
        assert!(!matches("*.example.com", "example.com"));
        assert!(!matches("*.example.com", "a.shop.example.com"));
        assert!(!matches("*.example.com", ".example.com"));
    }
}
