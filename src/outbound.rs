//! HTTP requests floodgate makes for itself rather than for a client (span exports to a
//! collector, ACME calls to a CA): one HTTP/1.1 connection per request, since they are
//! few, over TLS with the given roots for `https` URLs. Callers bound each request's time.

use std::sync::Arc;

use http::{Request, Response, Uri, header};
use hyper::body::{Body, Incoming};
use hyper_util::rt::TokioIo;
use rustls::RootCertStore;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::config::tls_provider;

/// Sends requests to absolute `http://` and `https://` URLs.
pub(crate) struct OneShot {
    tls: TlsConnector,
}

impl OneShot {
    /// Trusting `roots` for `https`.
    pub(crate) fn new(roots: RootCertStore) -> OneShot {
        let config = rustls::ClientConfig::builder_with_provider(tls_provider())
            .with_safe_default_protocol_versions()
            .expect("the provider supports TLS 1.2 and 1.3")
            .with_root_certificates(roots)
            .with_no_client_auth();
        OneShot {
            tls: TlsConnector::from(Arc::new(config)),
        }
    }

    /// Trusting the system's roots for `https`.
    pub(crate) fn with_native_roots() -> OneShot {
        let mut roots = RootCertStore::empty();
        roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        OneShot::new(roots)
    }

    /// Sends `request`, whose URI is absolute, on a new connection to its authority.
    pub(crate) async fn send<B>(&self, mut request: Request<B>) -> Result<Response<Incoming>, String>
    where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let uri = request.uri().clone();
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(format!("{uri}: expected an http:// or https:// URL")),
        };
        let authority = uri.authority().ok_or_else(|| format!("{uri}: no host"))?;
        let host = authority.host().trim_start_matches('[').trim_end_matches(']');
        let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
        let stream = TcpStream::connect((host, port))
            .await
            .map_err(|error| format!("cannot connect to {authority}: {error}"))?;
        let _ = stream.set_nodelay(true);
        request.headers_mut().insert(
            header::HOST,
            authority
                .as_str()
                .parse()
                .map_err(|_| format!("{uri}: the host is not a header value"))?,
        );
        *request.uri_mut() = Uri::from(
            uri.path_and_query()
                .cloned()
                .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
        );
        if https {
            let name = ServerName::try_from(host.to_owned())
                .map_err(|_| format!("{uri}: {host:?} is not a TLS server name"))?;
            let stream = self
                .tls
                .connect(name, stream)
                .await
                .map_err(|error| format!("TLS with {authority}: {error}"))?;
            exchange(stream, request).await
        } else {
            exchange(stream, request).await
        }
    }
}

async fn exchange<S, B>(stream: S, request: Request<B>) -> Result<Response<Incoming>, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|error| error.to_string())?;
    tokio::spawn(connection);
    sender
        .send_request(request)
        .await
        .map_err(|error| error.to_string())
}
