//! Waiting for a server's response head, and going on without the client: when a cap
//! counts a request (`max_requests`, a concurrency limit), the server's work outlives a
//! client that leaves, so the exchange is handed to a task of its own that reads the
//! answer and discards it before what the request holds is given back. Nothing is spawned
//! while clients stay.

use std::future::{Future, poll_fn};
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::Body;
use http_body_util::BodyExt;

use crate::proxy::request_body::RequestBody;

/// An exchange with a server, whatever the protocol, as it waits for its response head.
pub(super) trait Exchanging: Send + 'static {
    type Head;
    type Error;
    type Body: Body + Send + Unpin + 'static;

    fn poll_head(&mut self, cx: &mut Context<'_>) -> Poll<Result<Self::Head, Self::Error>>;

    /// Whether the deadline of the connection's timer has passed, the server's `timeout`
    /// counted as the protocol's exchange counts it.
    fn poll_deadline(&mut self, cx: &mut Context<'_>, timeout: Duration) -> Poll<()>;

    /// When the connection's timer passes, as `poll_deadline` last set it (`None`
    /// without a connection).
    fn deadline(&self) -> Option<tokio::time::Instant>;

    /// The response body the exchange goes on to read.
    fn into_response_body(self: Box<Self>) -> Self::Body;

    /// Whether `error` is the connection closing or failing, as a pooled one the server
    /// had closed does.
    fn closed(error: &Self::Error) -> bool;

    /// Whether the server has sent nothing back.
    fn unanswered(&self) -> bool;

    /// Whether nothing of the request reached the server and none of its body was read.
    fn untouched(&self) -> bool;

    /// The request body (for another try), when the request is untouched.
    fn into_body(self: Box<Self>) -> Option<RequestBody>;
}

/// Waits for `exchange`'s response head until the deadline of its connection's timer
/// (then `Err(None)`), and gives the exchange back with it.
///
/// `keep`, when a cap counts the request, is what the request holds while the server
/// works on it: if this future is dropped before the head and before that deadline (its
/// client left), the exchange goes on in a task of its own that takes `keep`, reads the
/// answer and discards it for at most `timeout` ([`go_on`]).
pub(super) async fn head<X: Exchanging, K: Send + 'static>(
    exchange: Box<X>,
    keep: Option<&mut Option<K>>,
    timeout: Duration,
) -> (Box<X>, Result<X::Head, Option<X::Error>>) {
    let mut detached = Detached {
        exchange: Some(exchange),
        keep,
        timeout,
    };
    let answer = poll_fn(|cx| {
        let exchange = detached.exchange.as_mut().expect("until answered");
        poll_answer(&mut **exchange, cx, timeout)
    })
    .await;
    (detached.exchange.take().expect("until answered"), answer)
}

/// The response head, or `Err(None)` once the connection's timer has passed.
fn poll_answer<X: Exchanging>(
    exchange: &mut X,
    cx: &mut Context<'_>,
    timeout: Duration,
) -> Poll<Result<X::Head, Option<X::Error>>> {
    match exchange.poll_head(cx) {
        Poll::Pending if exchange.poll_deadline(cx, timeout).is_ready() => Poll::Ready(Err(None)),
        polled => polled.map_err(Some),
    }
}

/// An exchange awaited for its head; dropped before (its client left) with `keep` and
/// before the deadline, it goes on in a task of its own.
struct Detached<'a, X: Exchanging, K: Send + 'static> {
    exchange: Option<Box<X>>,
    keep: Option<&'a mut Option<K>>,
    timeout: Duration,
}

impl<X: Exchanging, K: Send + 'static> Drop for Detached<'_, X, K> {
    fn drop(&mut self) {
        let (Some(mut exchange), Some(keep)) = (self.exchange.take(), self.keep.take()) else {
            return;
        };
        let Some(deadline) = exchange.deadline() else {
            return;
        };
        let timeout = self.timeout;
        let body = async move {
            poll_fn(|cx| poll_answer(&mut *exchange, cx, timeout))
                .await
                .ok()?;
            Some(exchange.into_response_body())
        };
        go_on(body, keep, deadline, timeout);
    }
}

/// Goes on with an exchange whose client left, in a task of its own: takes `keep`, waits
/// for the response `body` (which gives up at the connection's timer), reads and
/// discards it ([`discard`]), and only then drops what it took. Past `deadline`, the
/// timer's when the client left (read only now, on this rare path), the try failed:
/// nothing goes on, and `keep` stays with the caller, who answers the failure.
fn go_on<B, K>(
    body: impl Future<Output = Option<B>> + Send + 'static,
    keep: &mut Option<K>,
    deadline: tokio::time::Instant,
    timeout: Duration,
) where
    B: Body + Send + Unpin + 'static,
    K: Send + 'static,
{
    if tokio::time::Instant::now() >= deadline {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let keep = keep.take();
    runtime.spawn(async move {
        if let Some(body) = body.await {
            discard(body, keep, timeout).await;
        }
    });
}

/// Reads and drops the rest of a response no one waits for, for at most `timeout`, then
/// drops `keep` (what the request holds while the server works on it): the server is
/// done with a request once it has sent all of its response. Read to its end, the
/// connection goes back to the pool first.
pub(super) async fn discard<B: Body + Unpin, K>(mut body: B, keep: K, timeout: Duration) {
    let rest = async { while let Some(Ok(_)) = body.frame().await {} };
    let _ = tokio::time::timeout(timeout, rest).await;
    drop(body);
    drop(keep);
}
