//! Certificates made in the tests: a private CA that issues leaf certificates (ECDSA
//! P-256) for the names a test needs, written as PEM files.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// When issued certificates expire: 2100-01-01T00:00:00Z, in seconds since the epoch.
pub(crate) const NOT_AFTER: f64 = 4_102_444_800.0;

/// A certificate authority of the test's own.
pub(crate) struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A leaf certificate and its key, as PEM.
pub(crate) struct Issued {
    pub cert: String,
    pub key: String,
    pub der: CertificateDer<'static>,
}

impl TestCa {
    pub(crate) fn new(name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        TestCa {
            issuer: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap(),
        }
    }

    /// The CA certificate, as PEM.
    pub(crate) fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A leaf certificate for `names` (DNS names or IP addresses), valid until
    /// [`NOT_AFTER`].
    pub(crate) fn issue(&self, names: &[&str]) -> Issued {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names).unwrap();
        params.not_after = rcgen::date_time_ymd(2100, 1, 1);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Issued {
            cert: cert.pem(),
            key: key.serialize_pem(),
            der: cert.der().clone(),
        }
    }

    /// A client that trusts this CA, offering `alpn`.
    pub(crate) fn client(&self, alpn: &[&[u8]]) -> TlsConnector {
        self.client_of_versions(alpn, rustls::DEFAULT_VERSIONS)
    }

    /// A client that trusts this CA, offering `alpn` and only the TLS `versions`.
    pub(crate) fn client_of_versions(
        &self,
        alpn: &[&[u8]],
        versions: &[&'static rustls::SupportedProtocolVersion],
    ) -> TlsConnector {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.issuer.der().clone()).unwrap();
        let mut config =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_protocol_versions(versions)
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        TlsConnector::from(Arc::new(config))
    }
}

impl Issued {
    /// Writes `NAME.crt` and `NAME.key` into `dir`; returns their paths.
    pub(crate) fn write(&self, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let cert = dir.join(format!("{name}.crt"));
        let key = dir.join(format!("{name}.key"));
        std::fs::write(&cert, &self.cert).unwrap();
        std::fs::write(&key, &self.key).unwrap();
        (cert, key)
    }
}

/// A TLS connection to `addr` asking for `server_name`.
pub(crate) async fn connect(
    connector: &TlsConnector,
    addr: std::net::SocketAddr,
    server_name: &str,
) -> TlsStream<TcpStream> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from(server_name.to_owned()).unwrap();
    connector.connect(name, tcp).await.unwrap()
}

/// The certificate the server presented on `stream`.
pub(crate) fn presented(stream: &TlsStream<TcpStream>) -> CertificateDer<'static> {
    stream.get_ref().1.peer_certificates().unwrap()[0]
        .clone()
        .into_owned()
}

/// A client that takes any certificate chain (checking only the handshake's signature),
/// offering `alpn`: to see what a handshake presents.
pub(crate) fn unverified_client(alpn: &[&[u8]]) -> TlsConnector {
    #[derive(Debug)]
    struct AcceptAnything(Arc<rustls::crypto::CryptoProvider>);
    impl rustls::client::danger::ServerCertVerifier for AcceptAnything {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: rustls::pki_types::UnixTime,
        ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }
        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }
        fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
            self.0.signature_verification_algorithms.supported_schemes()
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAnything(provider)))
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    TlsConnector::from(Arc::new(config))
}
