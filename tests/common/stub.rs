//! Stub upstreams whose answers a test writes itself, after linkerd2-proxy's integration
//! test server (`server::http1().route_fn("/path", |req| ...)`): an HTTP/1.1 server on a
//! free port, in the clear or over TLS, that answers each path with a closure. The
//! describing [`super::Upstream`] serves every test that needs no answer of its own.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

/// A closure that answers a request.
type Answer = Box<dyn Fn(Request<Incoming>) -> Response<Full<Bytes>> + Send + Sync>;

/// What a stub upstream answers, before it listens ([`StubUpstream::run`]).
#[derive(Default)]
pub(crate) struct StubUpstream {
    routes: HashMap<String, Answer>,
    fallback: Option<Answer>,
    tls: Option<Arc<rustls::ServerConfig>>,
}

/// A stub upstream listening; dropped, it accepts no more connections.
pub(crate) struct ListeningStub {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl StubUpstream {
    /// A stub speaking HTTP/1.1 in the clear.
    pub(crate) fn http1() -> StubUpstream {
        StubUpstream::default()
    }

    /// A stub speaking HTTP/1.1 over TLS, with `config`.
    pub(crate) fn http1_tls(config: Arc<rustls::ServerConfig>) -> StubUpstream {
        StubUpstream {
            tls: Some(config),
            ..StubUpstream::default()
        }
    }

    /// Answers requests for `path` (the whole path, without the query) with `answer`.
    pub(crate) fn route_fn<B: Into<Bytes>>(
        mut self,
        path: &str,
        answer: impl Fn(Request<Incoming>) -> Response<B> + Send + Sync + 'static,
    ) -> StubUpstream {
        self.routes.insert(path.to_owned(), boxed(answer));
        self
    }

    /// Answers the requests no route takes with `answer`; without one they get a 404.
    pub(crate) fn fallback_fn<B: Into<Bytes>>(
        mut self,
        answer: impl Fn(Request<Incoming>) -> Response<B> + Send + Sync + 'static,
    ) -> StubUpstream {
        self.fallback = Some(boxed(answer));
        self
    }

    /// Listens on a free port of 127.0.0.1.
    pub(crate) async fn run(self) -> ListeningStub {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let tls = self.tls.clone().map(TlsAcceptor::from);
        let stub = Arc::new(self);
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (stub, tls) = (stub.clone(), tls.clone());
                tokio::spawn(async move {
                    match tls {
                        Some(acceptor) => {
                            if let Ok(stream) = acceptor.accept(tcp).await {
                                stub.serve(stream).await;
                            }
                        }
                        None => stub.serve(tcp).await,
                    }
                });
            }
        });
        ListeningStub { addr, task }
    }

    /// Serves one connection until it ends.
    async fn serve(self: Arc<Self>, io: impl AsyncRead + AsyncWrite + Unpin + Send + 'static) {
        let service = service_fn(move |request: Request<Incoming>| {
            let response = self.answer(request);
            async move { Ok::<_, Infallible>(response) }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(io), service)
            .await;
    }

    fn answer(&self, request: Request<Incoming>) -> Response<Full<Bytes>> {
        match self.routes.get(request.uri().path()).or(self.fallback.as_ref()) {
            Some(answer) => answer(request),
            None => {
                let mut response = Response::new(Full::default());
                *response.status_mut() = StatusCode::NOT_FOUND;
                response
            }
        }
    }
}

fn boxed<B: Into<Bytes>>(
    answer: impl Fn(Request<Incoming>) -> Response<B> + Send + Sync + 'static,
) -> Answer {
    Box::new(move |request| answer(request).map(|body| Full::new(body.into())))
}

impl ListeningStub {
    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for ListeningStub {
    fn drop(&mut self) {
        self.task.abort();
    }
}
