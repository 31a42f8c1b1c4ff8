//! One request on one connection to PHP-FPM: the request (begin, parameters, the body as
//! `FCGI_STDIN` while it streams in), and the answer read back as it comes (the CGI head,
//! then the body from `FCGI_STDOUT`; `FCGI_STDERR` to the log). Writing and reading go on
//! together, so that a script that answers before it has read its whole body never waits
//! on floodgate, nor floodgate on it. Neither side is buffered beyond one read and the
//! records of one body frame: memory does not grow with the body or the response.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, StatusCode};
use tokio_util::io::poll_read_buf;

use super::head;
use super::pool::{Connection, Endpoint};
use super::record::{self, ProtocolError, Reader, Received};
use crate::proxy::request_body::{RequestBody, RequestBodyError};
use crate::upstream::sending::{BodyFraming, Sending};

/// How much is read from PHP-FPM at a time.
const READ_SIZE: usize = 16 * 1024;

/// Why an exchange with PHP-FPM failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ExchangeError {
    #[error("the connection to PHP-FPM failed: {0}")]
    Io(#[from] io::Error),
    #[error("PHP-FPM closed the connection before it answered")]
    Closed,
    #[error("PHP-FPM sent something that is not FastCGI: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("PHP-FPM's response head is malformed: {0}")]
    Malformed(&'static str),
    #[error(transparent)]
    Body(#[from] RequestBodyError),
}

/// A request on a connection, from the first byte written to the end of its answer.
pub(crate) struct Exchange {
    connection: Option<Connection>,
    endpoint: Arc<Endpoint>,
    /// The request: its head records, then the body as `FCGI_STDIN` as it comes.
    sending: Sending<Stdin>,
    reader: Reader,
    /// `FCGI_STDOUT` content read while the head is incomplete.
    head: BytesMut,
    /// Content of `FCGI_STDOUT` read past the head, not yet handed out.
    ahead: Option<Bytes>,
    ended: bool,
    /// Whether anything of the answer came: until then, a reused connection that closes
    /// was closed by PHP-FPM while idle.
    answered: bool,
    /// A failure found while looking past a piece already handed out: the next one.
    deferred: Option<ExchangeError>,
}

impl Exchange {
    /// An exchange of the request `head` (its begin and parameter records) and `body`
    /// on `connection`.
    pub(super) fn new(
        connection: Connection,
        endpoint: Arc<Endpoint>,
        head: Bytes,
        body: RequestBody,
    ) -> Self {
        Exchange {
            connection: Some(connection),
            endpoint,
            sending: Sending::new([head, Bytes::new()], body, Stdin),
            reader: Reader::default(),
            head: BytesMut::new(),
            ahead: None,
            ended: false,
            answered: false,
            deferred: None,
        }
    }

    /// Whether PHP-FPM has sent nothing back.
    pub(super) fn unanswered(&self) -> bool {
        !self.answered
    }

    /// Whether nothing of the request reached PHP-FPM and none of its body was read.
    pub(super) fn untouched(&self) -> bool {
        self.sending.untouched()
    }

    /// Takes back the request body (for another try), when the request is untouched.
    pub(super) fn into_body(self: Box<Self>) -> Option<RequestBody> {
        self.sending.into_body()
    }

    /// The response head: its status and headers.
    pub(crate) fn poll_head(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(StatusCode, HeaderMap), ExchangeError>> {
        loop {
            match ready!(self.poll_received(cx))? {
                Received::Stdout(mut content) => {
                    // The usual case: the whole head in the first piece, read where it is.
                    if self.head.is_empty()
                        && let Some(end) = head::end(&content)
                    {
                        let parsed = head::parse(&content[..end]).map_err(ExchangeError::Malformed)?;
                        let rest = content.split_off(end);
                        self.ahead = Some(rest).filter(|rest| !rest.is_empty());
                        return Poll::Ready(Ok(parsed));
                    }
                    self.head.extend_from_slice(&content);
                    if let Some(end) = head::end(&self.head) {
                        let head = self.head.split_to(end);
                        let parsed = head::parse(&head).map_err(ExchangeError::Malformed)?;
                        let rest = std::mem::take(&mut self.head).freeze();
                        self.ahead = Some(rest).filter(|rest| !rest.is_empty());
                        return Poll::Ready(Ok(parsed));
                    }
                    if self.head.len() > head::MAX_HEAD {
                        return Poll::Ready(Err(ExchangeError::Malformed("a head larger than 64 KB")));
                    }
                }
                Received::Stderr(text) => self.endpoint.log_stderr(&text),
                Received::End { .. } => return Poll::Ready(Err(ExchangeError::Malformed("no head"))),
            }
        }
    }

    /// Whether the deadline of the connection's timer has passed (then the response head
    /// came too late).
    pub(super) fn poll_deadline(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match self.connection.as_mut() {
            Some(connection) => connection.deadline.as_mut().poll(cx),
            None => Poll::Pending,
        }
    }

    /// When the connection's timer passes.
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
        let data = match self.ahead.take() {
            Some(ahead) => ahead,
            None if self.ended => return Poll::Ready(None),
            None => loop {
                match ready!(self.poll_received(cx)) {
                    Err(error) => return Poll::Ready(Some(Err(error))),
                    Ok(received) => match self.take_in(received) {
                        Some(content) => break content,
                        None if self.ended => return Poll::Ready(None),
                        None => {}
                    },
                }
            },
        };
        self.look_past();
        Poll::Ready(Some(Ok(data)))
    }

    /// Takes in the records already read past the piece about to be handed out, up to the
    /// next content: when the answer's end is among them, the body knows it is done with
    /// this piece, and the client's response ends in the same write (no task reads ahead
    /// of a response that is all there).
    fn look_past(&mut self) {
        while let Some(connection) = self.connection.as_mut() {
            match self.reader.next(&mut connection.read) {
                Ok(None) => return,
                Ok(Some(received)) => {
                    if let Some(content) = self.take_in(received) {
                        self.ahead = Some(content);
                        return;
                    }
                }
                Err(error) => {
                    self.deferred = Some(error.into());
                    return;
                }
            }
        }
    }

    /// What a record of the response body comes to: content to hand out, or nothing (an
    /// empty `FCGI_STDOUT`; `FCGI_STDERR`, logged; the end, when the connection is checked
    /// in, and which leaves no connection to read more from).
    fn take_in(&mut self, received: Received) -> Option<Bytes> {
        match received {
            Received::Stdout(content) if !content.is_empty() => Some(content),
            Received::Stdout(_) => None,
            Received::Stderr(text) => {
                self.endpoint.log_stderr(&text);
                None
            }
            Received::End { .. } => {
                self.ended = true;
                self.check_in();
                None
            }
        }
    }

    /// Whether the whole answer has been read and handed out.
    pub(crate) fn is_ended(&self) -> bool {
        self.ended && self.ahead.is_none() && self.deferred.is_none()
    }

    /// The connection back to the pool, when the exchange left it clean: the whole
    /// request written, the whole answer read.
    fn check_in(&mut self) {
        let Some(connection) = self.connection.take() else {
            return;
        };
        if self.sending.is_done() && !self.reader.mid_record() {
            self.endpoint.check_in(connection);
        }
    }

    /// The next record piece, writing what can be written meanwhile.
    fn poll_received(&mut self, cx: &mut Context<'_>) -> Poll<Result<Received, ExchangeError>> {
        loop {
            self.poll_write(cx)?;
            let connection = self.connection.as_mut().ok_or(ExchangeError::Closed)?;
            if let Some(received) = self.reader.next(&mut connection.read)? {
                self.answered = true;
                return Poll::Ready(Ok(received));
            }
            let buffer = &mut connection.read;
            buffer.reserve(READ_SIZE);
            let filled = ready!(poll_read_buf(Pin::new(&mut connection.stream), cx, buffer))?;
            if filled == 0 {
                return Poll::Ready(Err(ExchangeError::Closed));
            }
        }
    }

    /// Writes what can be written of the request until it would wait. Once the answer
    /// has ended, nothing more is written.
    fn poll_write(&mut self, cx: &mut Context<'_>) -> Result<(), ExchangeError> {
        match self.connection.as_mut() {
            Some(connection) => self.sending.poll_write(&mut connection.stream, cx),
            None => Ok(()),
        }
    }
}

/// A request body as `FCGI_STDIN` records.
struct Stdin;

impl BodyFraming for Stdin {
    type Error = ExchangeError;

    fn data(&mut self, data: &[u8], out: &mut BytesMut) -> Result<(), ExchangeError> {
        record::stdin(out, data);
        Ok(())
    }

    fn end(&mut self) -> Result<&'static [u8], ExchangeError> {
        Ok(&record::END_OF_STDIN)
    }
}
