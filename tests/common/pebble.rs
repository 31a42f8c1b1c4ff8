//! A private ACME CA per test: Debian's `pebble` on free loopback ports, its DNS pointed at
//! `pebble-challtestsrv`, which answers every name with 127.0.0.1, so that pebble
//! validates challenges against the gateway's listeners on `http_port` and `tls_port`.
//! Both processes are killed when dropped.

use std::net::{TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use super::free_port;
use super::tls::{TestCa, connect};

pub(crate) struct Pebble {
    /// pebble's own CA (for its TLS), as a PEM file: the gateway's `ca`.
    pub ca_file: PathBuf,
    ca: TestCa,
    pub port: u16,
    management: u16,
    dns: u16,
    children: Vec<Child>,
    dir: tempfile::TempDir,
}

impl Pebble {
    /// Validates http-01 on `http_port` and tls-alpn-01 on `tls_port`; issues certificates
    /// valid `validity` (pebble's default: five years).
    pub(crate) fn start(http_port: u16, tls_port: u16, validity: Option<Duration>) -> Pebble {
        Pebble::start_with(http_port, tls_port, validity, None)
    }

    /// As [`Pebble::start`], creating accounts only with External Account Binding to the
    /// key ID `eab.0` and the base64url HMAC key `eab.1`.
    pub(crate) fn start_requiring_eab(http_port: u16, tls_port: u16, eab: (&str, &str)) -> Pebble {
        Pebble::start_with(http_port, tls_port, None, Some(eab))
    }

    fn start_with(
        http_port: u16,
        tls_port: u16,
        validity: Option<Duration>,
        eab: Option<(&str, &str)>,
    ) -> Pebble {
        let dir = tempfile::tempdir().unwrap();
        let ca = TestCa::new("pebble test CA");
        let leaf = ca.issue(&["localhost", "127.0.0.1"]);
        let ca_file = dir.path().join("pebble-ca.pem");
        std::fs::write(&ca_file, ca.pem()).unwrap();
        std::fs::write(dir.path().join("pebble.pem"), &leaf.cert).unwrap();
        std::fs::write(dir.path().join("pebble.key"), &leaf.key).unwrap();
        let dns = UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let (port, management, dns_management) = (free_port(), free_port(), free_port());
        let validity = validity.map_or(String::new(), |v| {
            format!(", \"certificateValidityPeriod\": {}", v.as_secs())
        });
        let eab = eab.map_or("false".to_owned(), |(kid, key)| {
            format!("true, \"externalAccountMACKeys\": {{\"{kid}\": \"{key}\"}}")
        });
        std::fs::write(
            dir.path().join("pebble.json"),
            format!(
                r#"{{"pebble": {{"listenAddress": "127.0.0.1:{port}", "managementListenAddress": "127.0.0.1:{management}",
                "certificate": "{cert}", "privateKey": "{key}", "httpPort": {http_port}, "tlsPort": {tls_port},
                "ocspResponderURL": "", "externalAccountBindingRequired": {eab}{validity}}}}}"#,
                cert = dir.path().join("pebble.pem").display(),
                key = dir.path().join("pebble.key").display(),
            ),
        )
        .unwrap();
        let log = |name: &str| std::fs::File::create(dir.path().join(name)).unwrap();
        let dns_server = Command::new("pebble-challtestsrv")
            .args(["-defaultIPv4", "127.0.0.1", "-defaultIPv6", ""])
            .args(["-dns01", &format!("127.0.0.1:{dns}")])
            .args(["-http01", "", "-https01", "", "-tlsalpn01", ""])
            .args(["-management", &format!("127.0.0.1:{dns_management}")])
            .stdout(log("challtestsrv.log"))
            .stderr(Stdio::null())
            .spawn()
            .expect("pebble-challtestsrv (Debian's pebble package) is installed");
        let mut pebble = Pebble {
            ca_file,
            ca,
            port,
            management,
            dns,
            children: vec![dns_server],
            dir,
        };
        pebble.run();
        pebble
    }

    /// Restarts pebble on the same ports: it forgets every account and order, and issues
    /// under a new root.
    pub(crate) fn restart(&mut self) {
        let mut pebble = self.children.pop().expect("pebble runs");
        let _ = pebble.kill();
        let _ = pebble.wait();
        self.run();
    }

    fn run(&mut self) {
        let dns = self.dns;
        let dir = self.dir.path();
        let child = Command::new("pebble")
            .arg("-config")
            .arg(dir.join("pebble.json"))
            .args(["-dnsserver", &format!("127.0.0.1:{dns}")])
            // Validations at once, every nonce accepted, every order validated anew.
            .env("PEBBLE_VA_NOSLEEP", "1")
            .env("PEBBLE_WFE_NONCEREJECT", "0")
            .env("PEBBLE_AUTHZREUSE", "0")
            .stdout(std::fs::File::create(dir.join("pebble.log")).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .expect("pebble (Debian's pebble package) is installed");
        self.children.push(child);
        // Up when both its ACME and its management interface listen (pebble opens them one
        // after the other).
        let deadline = Instant::now() + Duration::from_secs(10);
        while [self.port, self.management]
            .iter()
            .any(|&port| TcpStream::connect(("127.0.0.1", port)).is_err())
        {
            assert!(Instant::now() < deadline, "pebble did not start:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The directory URL.
    pub(crate) fn directory(&self) -> String {
        format!("https://127.0.0.1:{}/dir", self.port)
    }

    /// What pebble logged (for failure messages).
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pebble.log")).unwrap_or_default()
    }

    /// The body of a GET of `path` from pebble's `port` (its ACME or management interface),
    /// over TLS checked against pebble's own CA.
    async fn get(&self, port: u16, path: &str) -> bytes::Bytes {
        let stream = connect(
            &self.ca.client(&[b"http/1.1"]),
            ([127, 0, 0, 1], port).into(),
            "127.0.0.1",
        )
        .await;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(connection);
        let request = http::Request::get(path)
            .header("host", format!("127.0.0.1:{port}"))
            .body(Empty::<bytes::Bytes>::new())
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        response.into_body().collect().await.unwrap().to_bytes()
    }

    /// The root pebble issues under (a new one each start), from its management interface.
    pub(crate) async fn root(&self) -> CertificateDer<'static> {
        let body = self.get(self.management, "/roots/0").await;
        CertificateDer::from_pem_slice(&body).unwrap().into_owned()
    }

    /// A TLS client that trusts pebble's root, offering HTTP/1.1.
    pub(crate) async fn client(&self) -> tokio_rustls::TlsConnector {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.root().await).unwrap();
        let mut config =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        tokio_rustls::TlsConnector::from(Arc::new(config))
    }

    /// The directory of the test's files.
    pub(crate) fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Pebble {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// pebble's directory with renewal information (ARI, RFC 9773) added, which Debian's
/// pebble 2.4 lacks: an HTTPS server, trusted through the same `ca_file`, that serves
/// pebble's directory with a `renewalInfo` URL of its own and answers every
/// renewal-information request with the window `window()` gives (Unix seconds), asked anew
/// each time. Everything else is pebble's own.
pub(crate) struct AriFront {
    pub port: u16,
    /// Renewal-information requests answered.
    pub asked: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl AriFront {
    pub(crate) fn directory(&self) -> String {
        format!("https://127.0.0.1:{}/dir", self.port)
    }
}

impl Drop for AriFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Pebble {
    pub(crate) async fn ari_front(&self, window: fn() -> (i64, i64)) -> AriFront {
        use std::sync::atomic::{AtomicUsize, Ordering};
        // pebble's directory, as JSON, with the front's renewalInfo.
        let body = self.get(self.port, "/dir").await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut directory: serde_json::Value = serde_json::from_slice(&body).unwrap();
        directory["renewalInfo"] = format!("https://127.0.0.1:{port}/renewal-info").into();
        let directory = bytes::Bytes::from(directory.to_string());
        let issued = self.ca.issue(&["127.0.0.1", "localhost"]);
        let server =
            rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(
                    vec![issued.der.clone()],
                    rustls::pki_types::PrivateKeyDer::from_pem_slice(issued.key.as_bytes()).unwrap(),
                )
                .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let asked = Arc::new(AtomicUsize::new(0));
        let counted = asked.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, directory, counted) = (acceptor.clone(), directory.clone(), counted.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service =
                        hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                            let (directory, counted) = (directory.clone(), counted.clone());
                            async move {
                                let path = request.uri().path();
                                let response = if path == "/dir" {
                                    http::Response::builder()
                                        .header("content-type", "application/json")
                                        .body(http_body_util::Full::new(directory))
                                } else if path.starts_with("/renewal-info/") {
                                    counted.fetch_add(1, Ordering::SeqCst);
                                    let (start, end) = window();
                                    let at = |s: i64| {
                                        humantime::format_rfc3339_seconds(
                                            std::time::UNIX_EPOCH + Duration::from_secs(s as u64),
                                        )
                                    };
                                    http::Response::builder()
                                        .header("content-type", "application/json")
                                        .header("retry-after", "3600")
                                        .body(http_body_util::Full::new(bytes::Bytes::from(format!(
                                            r#"{{"suggestedWindow": {{"start": "{}", "end": "{}"}}}}"#,
                                            at(start),
                                            at(end)
                                        ))))
                                } else {
                                    http::Response::builder()
                                        .status(404)
                                        .body(http_body_util::Full::new(bytes::Bytes::new()))
                                };
                                Ok::<_, std::convert::Infallible>(response.unwrap())
                            }
                        });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        AriFront { port, asked, task }
    }
}
