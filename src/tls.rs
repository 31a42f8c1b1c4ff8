//! The HTTPS listener's TLS: the handshakes under each loaded configuration (so a reload's
//! certificates serve the next ones), with the certificate chosen by the client's SNI
//! name among the files' and the ACME one, tls-alpn-01 challenges answered, and the
//! handshake failures' accounting.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use rustls::server::{Acceptor, ClientHello, ResolvesServerCert};
use rustls::sign::{CertifiedKey, SingleCertAndKey};
use rustls::version::{TLS12, TLS13};
use rustls::{ServerConfig, SupportedProtocolVersion};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt as _};
use tokio_rustls::server::TlsStream;
use tokio_rustls::{LazyConfigAcceptor, TlsAcceptor};

use crate::acme::Acme;
use crate::config::{TlsConfig, TlsVersion, tls_provider};
use crate::host::normalize_host;

/// The ALPN protocol of tls-alpn-01 handshakes (RFC 8737).
const ACME_TLS_ALPN: &[u8] = b"acme-tls/1";

/// The HTTPS listener's handshakes under one configuration: its certificates, and with
/// `[server.tls.acme]`, the ACME certificate and the answers to tls-alpn-01.
pub(crate) struct Handshakes {
    versions: &'static [&'static SupportedProtocolVersion],
    config: Arc<ServerConfig>,
    acme: Option<Arc<Acme>>,
}

impl Handshakes {
    /// For `config`'s certificates and versions, offering HTTP/2 and HTTP/1.1 by ALPN.
    pub(crate) fn new(config: &TlsConfig, acme: Option<Arc<Acme>>) -> Handshakes {
        const BOTH: &[&SupportedProtocolVersion] = &[&TLS13, &TLS12];
        const ONLY_13: &[&SupportedProtocolVersion] = &[&TLS13];
        let versions = match config.min_version {
            TlsVersion::Tls12 => BOTH,
            TlsVersion::Tls13 => ONLY_13,
        };
        let resolver = ByServerName {
            certificates: config
                .certificates
                .iter()
                .map(|c| (c.names.clone(), c.key.clone()))
                .collect(),
            acme: acme.clone(),
        };
        let mut server = server_config(versions, Arc::new(resolver));
        server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Handshakes {
            versions,
            config: Arc::new(server),
            acme,
        }
    }

    /// Completes the server side of a handshake on `stream`: `None` when it answered a
    /// tls-alpn-01 challenge (the connection is then closed, RFC 8737 §3).
    pub(crate) async fn accept<S>(&self, stream: S) -> io::Result<Option<TlsStream<S>>>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let Some(acme) = &self.acme else {
            return TlsAcceptor::from(self.config.clone())
                .accept(stream)
                .await
                .map(Some);
        };
        let start = LazyConfigAcceptor::new(Acceptor::default(), stream).await?;
        let hello = start.client_hello();
        // A validation offers acme-tls/1 alone.
        let challenge = hello
            .alpn()
            .is_some_and(|mut offered| offered.next() == Some(ACME_TLS_ALPN) && offered.next().is_none());
        if !challenge {
            return start.into_stream(self.config.clone()).await.map(Some);
        }
        let name = hello.server_name().and_then(normalize_host);
        let answer = match name {
            Some(name) => acme.alpn_answer(&name).await,
            None => None,
        };
        let Some(answer) = answer else {
            return Err(io::Error::other(
                "a tls-alpn-01 handshake for a name with no pending challenge",
            ));
        };
        let mut config = server_config(self.versions, Arc::new(SingleCertAndKey::from(answer)));
        config.alpn_protocols = vec![ACME_TLS_ALPN.to_vec()];
        let mut stream = start.into_stream(Arc::new(config)).await?;
        let _ = stream.shutdown().await;
        Ok(None)
    }
}

fn server_config(
    versions: &[&'static SupportedProtocolVersion],
    resolver: Arc<dyn ResolvesServerCert>,
) -> ServerConfig {
    ServerConfig::builder_with_provider(tls_provider())
        .with_protocol_versions(versions)
        .expect("the provider supports TLS 1.2 and 1.3")
        .with_no_client_auth()
        .with_cert_resolver(resolver)
}

/// Chooses the certificate for the client's SNI name, read as routing reads a `Host`
/// (lowercase, no trailing dot: a client may send `shop.example.net.`): the ACME
/// certificate when it covers the name, else the first file certificate that does, else
/// the first file certificate (also for handshakes without SNI), else the ACME one.
#[derive(Debug)]
struct ByServerName {
    /// `(names, key)` in file order.
    certificates: Vec<(Vec<String>, Arc<CertifiedKey>)>,
    acme: Option<Arc<Acme>>,
}

impl ResolvesServerCert for ByServerName {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let asked = hello.server_name().and_then(normalize_host);
        let acme = self.acme.as_ref().and_then(|acme| acme.served());
        if let (Some(asked), Some(acme)) = (&asked, &acme)
            && acme.names.iter().any(|name| matches(name, asked))
        {
            return Some(acme.key.clone());
        }
        let chosen = asked.and_then(|asked| {
            self.certificates
                .iter()
                .find(|(names, _)| names.iter().any(|name| matches(name, &asked)))
        });
        chosen
            .or(self.certificates.first())
            .map(|(_, key)| key.clone())
            .or_else(|| acme.map(|acme| acme.key.clone()))
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
