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

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll};

    use bytes::Bytes;
    use http_body_util::Empty;

    use super::*;
    use crate::upstream::places::{ConnectionPlaces, Place};

    type Stream = tokio::io::DuplexStream;

    /// An exchange on a pooled connection the server had closed: it fails at once,
    /// having sent nothing.
    struct Closed {
        connection: Connection<Stream>,
        body: RequestBody,
    }

    impl Exchanging for Closed {
        type Head = ();
        type Error = ();
        type Body = Empty<Bytes>;

        fn poll_head(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ()>> {
            Poll::Ready(Err(()))
        }

        fn poll_deadline(&mut self, _: &mut Context<'_>, _: Duration) -> Poll<()> {
            Poll::Pending
        }

        fn deadline(&self) -> Option<Instant> {
            Some(self.connection.deadline.deadline())
        }

        fn into_response_body(self: Box<Self>) -> Empty<Bytes> {
            Empty::new()
        }

        fn closed((): &()) -> bool {
            true
        }

        fn unanswered(&self) -> bool {
            true
        }

        fn untouched(&self) -> bool {
            true
        }

        fn into_body(self: Box<Self>) -> Option<RequestBody> {
            Some(self.body)
        }
    }

    type Opening = Pin<Box<dyn Future<Output = Result<Connection<Stream>, ()>> + Send>>;

    #[tokio::test]
    async fn a_resend_after_a_handed_over_connection_keeps_the_deadline_its_wait_moved_on() {
        let places = ConnectionPlaces::new(1);
        let pool = IdlePool::new(Duration::from_secs(60), 4, &places);
        // The one place, held by another request's connection until it is done.
        let (stream, _server) = tokio::io::duplex(64);
        let busy = Connection::new(stream, places.free().expect("one place"), Instant::now());
        // The deadlines new connections were opened with, in order.
        let opened_with = Arc::new(Mutex::new(Vec::new()));
        let opener = Opener {
            timeout: Duration::from_secs(5),
            open: {
                let opened_with = opened_with.clone();
                move |_: Place, _: Instant, deadline: Instant| -> Opening {
                    opened_with.lock().unwrap().push(deadline);
                    Box::pin(async { Err(()) })
                }
            },
        };
        // Exchanges made: one on the connection handed over, none on a new one.
        let exchanges = AtomicUsize::new(0);
        let span = SpanId([1; 8]);
        let mut keep = None::<()>;
        let deadline = Instant::now() + Duration::from_secs(1);
        let waited = Duration::from_millis(100);
        let giving_back = async {
            tokio::time::sleep(waited).await;
            pool.check_in(busy);
        };
        let trying = attempt(
            &pool,
            opener,
            |connection, body| {
                exchanges.fetch_add(1, Ordering::Relaxed);
                Box::new(Closed { connection, body })
            },
            Try {
                span: &span,
                body: RequestBody::empty(),
                repeatable: true,
                deadline,
                timeout: Duration::from_secs(1),
                keep: &mut keep,
                detach: false,
                reached: None,
            },
        );
        let ((), tried) = tokio::join!(giving_back, trying);
        assert!(tried.is_err(), "the resend found no connection to open");
        assert_eq!(
            exchanges.load(Ordering::Relaxed),
            1,
            "the request went out once, on the connection handed over"
        );
        let opened_with = opened_with.lock().unwrap().clone();
        assert_eq!(opened_with.len(), 1, "one connection opened: the resend's");
        // Moved on by the wait (less the moment between the wait's start and the try's).
        let moved = opened_with[0] - deadline;
        assert!(
            moved >= waited / 2,
            "the resend's deadline is {moved:?} after the first try's, not moved on by the {waited:?} waited for a place"
        );
    }
}
