//! One request on one HTTP/1.1 connection to an upstream server, in the request's own
//! task: the head and the body written as the body streams in, and the answer read back
//! as it comes (the response head, then the body by its framing). Writing and reading go
//! on together, so that a server that answers before it has read the whole body never
//! waits on floodgate, nor floodgate on it. Neither side is buffered beyond one read and
//! one body frame: memory does not grow with the body or the response.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::Response;
use http_body::{Body, SizeHint};
use tokio_util::io::poll_read_buf;

use super::h1::{self, Chunks, Decoded, HttpHead, Malformed, RequestFraming, ResponseFraming};
use super::pool::{Connection, Endpoint};
use super::sending::{BodyFraming, Sending};
use crate::config::CombinedRules;
use crate::proxy::request_body::{RequestBody, RequestBodyError};
use crate::trace::context::SpanId;

/// How much is read from the server at a time.
const READ_SIZE: usize = 16 * 1024;

/// Why an exchange with a server failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ExchangeError {
    #[error("the connection to the upstream failed: {0}")]
    Io(#[from] io::Error),
    #[error("the upstream closed the connection before it answered")]
    Closed,
    #[error("the upstream closed the connection before the end of its response body")]
    Incomplete,
    #[error(transparent)]
    Malformed(#[from] Malformed),
    #[error("the request body did not match its Content-Length")]
    BodyLength,
    #[error(transparent)]
    Body(#[from] RequestBodyError),
}

/// Where the response is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    Head,
    Length(u64),
    Chunked(Chunks),
    UntilClose,
    /// Read to its end, or the connection switched protocols.
    Done,
}

/// A request on a connection, from the first byte written to the end of its answer.
pub(crate) struct Exchange {
    connection: Option<Connection>,
    endpoint: Arc<Endpoint>,
    /// The request, in its framing.
    sending: Sending<RequestFraming>,
    head_request: bool,
    /// The rules the response head is read through.
    response_rules: Option<Arc<CombinedRules>>,
    /// Whether the request said `Connection: close` (an active check).
    asked_to_close: bool,
    reading: Reading,
    /// Whether the connection may carry another request once the response is read.
    keep_alive: bool,
    /// Data decoded past the piece last handed out.
    ahead: Option<Bytes>,
    /// Whether anything of the answer came: until then, a reused connection that closes
    /// was closed by the server while idle.
    answered: bool,
    /// A failure found while looking past a piece already handed out: the next one.
    deferred: Option<ExchangeError>,
    /// A write that failed (the server closed its side): kept while the answer is read,
    /// since a server may answer before it has read the whole request, and close.
    write_failed: Option<io::Error>,
    /// Whether the deadline was set again from the end of the request's body.
    timed_from_body_end: bool,
}

impl Exchange {
    /// An exchange of the request whose head is `head`, for the try whose span is
    /// `span`, and `body`, on `connection`.
    pub(super) fn new(
        connection: Connection,
        endpoint: Arc<Endpoint>,
        (head, span): (&HttpHead, &SpanId),
        body: RequestBody,
    ) -> Self {
        let length = match body.is_end_stream() {
            true => Some(0),
            false => body.size_hint().exact(),
        };
        let (first, framing) = head.for_try(span, length);
        Exchange {
            connection: Some(connection),
            endpoint,
            sending: Sending::new(first, body, framing),
            head_request: head.is_head_request(),
            response_rules: head.response_rules().cloned(),
            asked_to_close: head.closes(),
            reading: Reading::Head,
            keep_alive: false,
            ahead: None,
            answered: false,
            deferred: None,
            write_failed: None,
            timed_from_body_end: false,
        }
    }

    /// Whether the server has sent nothing back.
    pub(super) fn unanswered(&self) -> bool {
        !self.answered
    }

    /// Whether nothing of the request reached the server and none of its body was read.
    pub(super) fn untouched(&self) -> bool {
        self.sending.untouched()
    }

    /// Takes back the request body (for another try), when the request is untouched.
    pub(super) fn into_body(self: Box<Self>) -> Option<RequestBody> {
        self.sending.into_body()
    }

    /// The response head, its body to come from this exchange.
    pub(super) fn poll_head(&mut self, cx: &mut Context<'_>) -> Poll<Result<Response<()>, ExchangeError>> {
        loop {
            self.poll_write(cx)?;
            let connection = self.connection.as_mut().ok_or(ExchangeError::Closed)?;
            if !connection.read.is_empty() {
                self.answered = true;
                if let Some(head) = h1::read_response_head(
                    &mut connection.read,
                    self.head_request,
                    self.response_rules.as_deref(),
                )? {
                    self.keep_alive = head.keep_alive && !self.asked_to_close;
                    self.reading = match head.framing {
                        ResponseFraming::Length(length) => Reading::Length(length),
                        ResponseFraming::Chunked => Reading::Chunked(Chunks::Size),
                        ResponseFraming::UntilClose => Reading::UntilClose,
                        ResponseFraming::Switched => Reading::Done,
                    };
                    if self.reading == Reading::Length(0) {
                        self.end();
                    }
                    let mut response = Response::new(());
                    *response.status_mut() = head.status;
                    *response.headers_mut() = head.headers;
                    return Poll::Ready(Ok(response));
                }
            }
            ready!(self.poll_read(cx))?;
        }
    }

    /// Whether the deadline of the connection's timer has passed (then the response head
    /// came too late). `timeout` is the server's time to answer, from the body's end for
    /// a request with a body; while the body is still going out, the deadline passes only
    /// after `timeout` without progress: it moves on while the client has yet to send the
    /// body's next frame (`server.body_timeout` bounds those pauses) or when bytes went to
    /// the server since it was last reached.
    pub(super) fn poll_deadline(&mut self, cx: &mut Context<'_>, timeout: Duration) -> Poll<()> {
        let Some(connection) = self.connection.as_mut() else {
            return Poll::Pending;
        };
        let mut deadline = connection.deadline.as_mut();
        if !self.timed_from_body_end && self.sending.had_body() && self.sending.is_done() {
            self.timed_from_body_end = true;
            deadline.as_mut().reset(tokio::time::Instant::now() + timeout);
        }
        loop {
            ready!(deadline.as_mut().poll(cx));
            let progressing =
                !self.sending.is_done() && (self.sending.awaits_client() || self.sending.take_progress());
            if !progressing {
                return Poll::Ready(());
            }
            deadline.as_mut().reset(tokio::time::Instant::now() + timeout);
        }
    }

    /// When the connection's timer passes, as [`Exchange::poll_deadline`] last set it.
    pub(super) fn deadline(&self) -> Option<tokio::time::Instant> {
        self.connection
            .as_ref()
            .map(|connection| connection.deadline.deadline())
    }

    /// The next piece of the response body; `None` at its end, when the connection goes
    /// back to the pool if it can carry another request.
    pub(crate) fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, ExchangeError>>> {
        if let Some(error) = self.deferred.take() {
            return Poll::Ready(Some(Err(error)));
        }
        if let Some(ahead) = self.ahead.take() {
            self.look_past();
            return Poll::Ready(Some(Ok(ahead)));
        }
        loop {
            match self.decode() {
                Err(error) => return Poll::Ready(Some(Err(error))),
                Ok(Some(data)) => {
                    self.look_past();
                    return Poll::Ready(Some(Ok(data)));
                }
                Ok(None) if self.reading == Reading::Done => return Poll::Ready(None),
                Ok(None) => {}
            }
            if let Err(error) = self.poll_write(cx) {
                return Poll::Ready(Some(Err(error)));
            }
            match ready!(self.poll_read(cx)) {
                Ok(()) => {}
                Err(ExchangeError::Closed) if self.reading == Reading::UntilClose => {
                    self.reading = Reading::Done;
                    self.connection = None;
                    return Poll::Ready(None);
                }
                Err(ExchangeError::Closed) => return Poll::Ready(Some(Err(ExchangeError::Incomplete))),
                Err(error) => return Poll::Ready(Some(Err(error))),
            }
        }
    }

    /// The next piece of the body from what has been read, if any; at the body's end,
    /// the exchange ends.
    fn decode(&mut self) -> Result<Option<Bytes>, ExchangeError> {
        let Some(connection) = self.connection.as_mut() else {
            return Ok(None);
        };
        let read = &mut connection.read;
        let data = match &mut self.reading {
            Reading::Head | Reading::Done => return Ok(None),
            Reading::Length(left) => {
                if read.is_empty() {
                    return Ok(None);
                }
                let take = (*left).min(read.len() as u64);
                *left -= take;
                let data = read.split_to(take as usize).freeze();
                if *left == 0 {
                    self.end();
                }
                data
            }
            Reading::Chunked(chunks) => match chunks.decode(read)? {
                Decoded::Data(data) => data,
                Decoded::Short => return Ok(None),
                Decoded::End => {
                    self.end();
                    return Ok(None);
                }
            },
            Reading::UntilClose if read.is_empty() => return Ok(None),
            Reading::UntilClose => read.split().freeze(),
        };
        Ok(Some(data))
    }

    /// Decodes past the piece about to be handed out, up to the next one: when the body's
    /// end is already there, the body knows it is done with this piece, and the client's
    /// response ends in the same write.
    fn look_past(&mut self) {
        match self.decode() {
            Ok(data) => self.ahead = data,
            Err(error) => self.deferred = Some(error),
        }
    }

    /// The response has been read: the connection goes back to the pool when the exchange
    /// left it clean (the whole request written, nothing read past the response, the
    /// server willing), else it is closed.
    fn end(&mut self) {
        self.reading = Reading::Done;
        let Some(connection) = self.connection.take() else {
            return;
        };
        if self.keep_alive && self.sending.is_done() && connection.read.is_empty() {
            self.endpoint.check_in(connection);
        }
    }

    /// What is known of the body's length.
    pub(crate) fn size_hint(&self) -> SizeHint {
        let ahead = self.ahead.as_ref().map_or(0, |ahead| ahead.len() as u64);
        match self.reading {
            Reading::Length(left) => SizeHint::with_exact(left + ahead),
            Reading::Done if self.deferred.is_none() => SizeHint::with_exact(ahead),
            _ => SizeHint::default(),
        }
    }

    /// Whether the whole answer has been read and handed out.
    pub(crate) fn is_ended(&self) -> bool {
        self.reading == Reading::Done && self.ahead.is_none() && self.deferred.is_none()
    }

    /// The connection after a protocol switch, with what the server sent past its `101`.
    pub(crate) fn into_switched(mut self: Box<Self>) -> Option<Connection> {
        match self.reading {
            Reading::Done if !self.keep_alive => self.connection.take(),
            _ => None,
        }
    }

    /// Reads more of the answer, writing what can be written meanwhile; the server
    /// closing the connection is [`ExchangeError::Closed`].
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ExchangeError>> {
        let connection = self.connection.as_mut().ok_or(ExchangeError::Closed)?;
        let buffer = &mut connection.read;
        buffer.reserve(READ_SIZE);
        let read = ready!(poll_read_buf(Pin::new(&mut connection.stream), cx, buffer));
        Poll::Ready(match (read, self.write_failed.take()) {
            (Ok(filled), write_failed) if filled > 0 => {
                self.write_failed = write_failed;
                Ok(())
            }
            (_, Some(write_failed)) => Err(ExchangeError::Io(write_failed)),
            (Ok(_), None) => Err(ExchangeError::Closed),
            (Err(error), None) => Err(ExchangeError::Io(error)),
        })
    }

    /// Writes what can be written of the request until it would wait. Once the answer
    /// has ended, nothing more is written.
    /// A failed write is kept until the answer shows whether the server answered anyway.
    fn poll_write(&mut self, cx: &mut Context<'_>) -> Result<(), ExchangeError> {
        let Some(connection) = self.connection.as_mut() else {
            return Ok(());
        };
        if self.write_failed.is_some() {
            return Ok(());
        }
        match self.sending.poll_write(&mut connection.stream, cx) {
            Err(ExchangeError::Io(error)) => {
                self.write_failed = Some(error);
                Ok(())
            }
            written => written,
        }
    }
}

impl BodyFraming for RequestFraming {
    type Error = ExchangeError;

    fn data(&mut self, data: &[u8], out: &mut BytesMut) -> Result<(), ExchangeError> {
        match self {
            RequestFraming::Length(left) => {
                *left = left
                    .checked_sub(data.len() as u64)
                    .ok_or(ExchangeError::BodyLength)?;
                out.extend_from_slice(data);
            }
            RequestFraming::Chunked => h1::write_chunk(data, out),
        }
        Ok(())
    }

    fn end(&mut self) -> Result<&'static [u8], ExchangeError> {
        match self {
            RequestFraming::Length(0) => Ok(b""),
            RequestFraming::Length(_) => Err(ExchangeError::BodyLength),
            RequestFraming::Chunked => Ok(h1::LAST_CHUNK),
        }
    }
}
