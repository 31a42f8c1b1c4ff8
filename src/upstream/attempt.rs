//! One try of a request on one server, whatever the protocol: a pooled connection or a new
//! one, the exchange on it, and the wait for its response head ([`detach::head`]). A pooled
//! connection the server had closed meanwhile gives the request to another connection
//! when that is safe: none of it was written, or it is idempotent without a body.

use std::future::Future;
use std::time::Duration;

use tokio::io::AsyncRead;
use tokio::time::Instant;

use super::detach::{self, Exchanging};
use super::idle::{Connection, IdlePool};
use crate::proxy::request_body::RequestBody;

/// Why a try got no response head.
pub(super) enum Failed<C, E> {
    /// No connection could be made.
    Connect(C),
    /// The exchange failed.
    Exchange(E),
    /// The deadline passed: what was sent of the request is lost.
    TimedOut,
}

/// Sends `body` (`repeatable` when it is idempotent without a body) on a connection from
/// `idle` or from `connect`, in the exchange `exchange` makes, and waits for the response
/// head until `deadline`; `keep` and `detach` as [`detach::head`] takes them. A failure
/// gives the body back when none of it was read and nothing reached the server.
#[allow(clippy::too_many_arguments)]
pub(super) async fn attempt<S, X, C, F, K>(
    idle: &IdlePool<Connection<S>>,
    connect: impl Fn() -> F,
    exchange: impl Fn(Connection<S>, RequestBody) -> Box<X>,
    (mut body, repeatable): (RequestBody, bool),
    (deadline, timeout): (Instant, Duration),
    keep: &mut Option<K>,
    detach: bool,
) -> Result<(Box<X>, X::Head), (Failed<C, X::Error>, Option<RequestBody>)>
where
    S: AsyncRead + Unpin,
    X: Exchanging,
    F: Future<Output = Result<Connection<S>, C>>,
    K: Send + 'static,
{
    loop {
        let (connection, reused) = match idle.take_or_connect(deadline, &connect).await {
            Ok(taken) => taken,
            Err(Some(error)) => return Err((Failed::Connect(error), Some(body))),
            Err(None) => return Err((Failed::TimedOut, None)),
        };
        let exchange = exchange(connection, body);
        let (exchange, answer) =
            detach::head(exchange, detach.then_some(&mut *keep), deadline, timeout).await;
        match answer {
            Ok(head) => return Ok((exchange, head)),
            // A pooled connection the server had closed: the request goes out again on
            // another, unless the server may have acted on it.
            Err(Some(error))
                if X::closed(&error)
                    && reused
                    && exchange.unanswered()
                    && (repeatable || exchange.untouched()) =>
            {
                body = exchange.into_body().unwrap_or_else(RequestBody::empty);
            }
            // Past the deadline the exchange is dropped, its connection closed.
            Err(None) => return Err((Failed::TimedOut, None)),
            Err(Some(error)) => {
                let body = exchange.into_body();
                return Err((Failed::Exchange(error), body));
            }
        }
    }
}
