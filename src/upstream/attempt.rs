//! One try of a request on one server, whatever the protocol: a pooled connection or a new
//! one, the exchange on it, and the wait for its response head ([`detach::head`]). A pooled
//! connection the server had closed meanwhile gives the request to another connection
//! when that is safe: none of it was written, or it is idempotent without a body.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::AsyncRead;
use tokio::time::Instant;

use super::detach::{self, Exchanging};
use super::idle::{Connection, IdlePool, Open, Opener, PoolError};
use crate::proxy::request_body::RequestBody;
use crate::trace::context::SpanId;

/// What one try is given besides its protocol's head: the span its `traceparent` names,
/// the request body (`repeatable` when the request is idempotent without one), the try's
/// deadline and the upstream's `timeout`, and what the request holds while the server
/// works on it (`keep`), which with `detach` outlives a client that leaves
/// ([`detach::head`]).
pub(crate) struct Try<'a, K> {
    pub(crate) span: &'a SpanId,
    pub(crate) body: RequestBody,
    pub(crate) repeatable: bool,
    pub(crate) deadline: Instant,
    pub(crate) timeout: Duration,
    pub(crate) keep: &'a mut Option<K>,
    pub(crate) detach: bool,
    /// Set once the request goes out on a connection (a limit counting failures keeps
    /// the unit of a request that reached the app: `service::limits::Attempts`).
    pub(crate) reached: Option<&'a AtomicBool>,
}

/// A try that got no response head: why, and the request body when none of it was read
/// and nothing reached the server.
pub(crate) struct Unsent<E> {
    pub(crate) error: E,
    pub(crate) body: Option<RequestBody>,
}

/// Sends the request of `plan` on a connection from `idle` or from `opener`, in the
/// exchange `exchange` makes, and waits for the response head until the plan's deadline
/// (the connection's timer, which the exchange may move on while the body goes out).
pub(super) async fn attempt<S, X, E, O, K>(
    idle: &IdlePool<Connection<S>>,
    opener: Opener<O>,
    exchange: impl Fn(Connection<S>, RequestBody) -> Box<X>,
    plan: Try<'_, K>,
) -> Result<(Box<X>, X::Head), Unsent<E>>
where
    S: AsyncRead + Unpin + Send,
    X: Exchanging,
    E: From<X::Error> + PoolError,
    O: Open<S, E>,
    K: Send + 'static,
{
    let Try {
        mut body,
        repeatable,
        mut deadline,
        timeout,
        keep,
        detach,
        reached,
        ..
    } = plan;
    loop {
        let (connection, reused) = match idle.take_or_connect(deadline, &opener).await {
            Ok(taken) => taken,
            // Nothing sent: the body goes on to another try, whatever the method.
            Err(error) => {
                return Err(Unsent {
                    error,
                    body: Some(body),
                });
            }
        };
        // Moved on by a wait for a place or a connection, which is not the server's: a
        // resend on another connection keeps to it.
        deadline = connection.deadline.deadline();
        if let Some(reached) = reached {
            reached.store(true, Ordering::Release);
        }
        let exchange = exchange(connection, body);
        let (exchange, answer) = detach::head(exchange, detach.then_some(&mut *keep), timeout).await;
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
            // Past the deadline the exchange is dropped, its connection closed; its body
            // goes on only if none of the request was sent.
            Err(None) => {
                return Err(Unsent {
                    error: E::timed_out(),
                    body: exchange.into_body(),
                });
            }
            Err(Some(error)) => {
                return Err(Unsent {
                    body: exchange.into_body(),
                    error: error.into(),
                });
            }
        }
    }
}
