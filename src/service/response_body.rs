//! The response body on its way to the client: it writes the access log when it is
//! finished or dropped (so the log carries the bytes actually sent and the whole
//! duration), and holds the connection's in-flight token until then. A body floodgate
//! writes itself holds the request's concurrency slots until written; a forwarded
//! request's travel with its upstream exchange (`upstream::UpstreamBody`).

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Method, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;

use crate::access_log::AccessRecord;
use crate::compression::{self, Accepted, Encoded};
use crate::connection::{InFlight, ResponseProgress};
use crate::files::serve::FileBody;
use crate::limit::store::ConcurrencySlot;
use crate::upstream::UpstreamBody;
use crate::upstream::read_ahead::ReadAhead;

/// What a response carries: the upstream's streamed body, floodgate's own bytes, or a
/// site's file; any of them compressed on the way.
pub(crate) enum Payload {
    Upstream(UpstreamBody),
    Own(Own),
    /// Boxed: most responses are not files, and need not be as large.
    File(Box<FileBody>),
    /// An upstream's body, read ahead of the client.
    ReadAhead(ReadAhead),
    /// Any of the above, compressed.
    Encoded(Encoded),
}

impl Payload {
    /// Has floodgate's own body hold `slots`, the concurrency slots of the request it
    /// answers, until written (a forwarded request's travel with its upstream exchange).
    pub(crate) fn hold(&mut self, slots: Vec<ConcurrencySlot>) {
        if let Payload::Own(own) = self {
            own.slots = slots;
        }
    }
}

/// `response` as a route with `compress` sends it to a client that accepts `accepted`
/// (docs/configuration.md#routescompress): encoded when it may be and the client takes a
/// coding, with `Vary` whenever it may be; a `HEAD` or `304` gets the headers alone.
pub(crate) fn compress(
    mut response: Response<Payload>,
    accepted: Accepted,
    method: &Method,
) -> Response<Payload> {
    let status = response.status();
    // A file's length decides for its GET, its HEAD and its `304` alike; other responses'
    // through their `Content-Length`.
    let length = match response.body() {
        Payload::File(body) => Some(body.file_length()),
        _ => None,
    };
    if !compression::compressible(status, response.headers(), length) {
        return response;
    }
    compression::vary_on_encoding(response.headers_mut());
    let Some(coding) = accepted.best(|_| true) else {
        return response;
    };
    if status == StatusCode::NOT_MODIFIED || method == Method::HEAD {
        compression::encode_headers(response.headers_mut(), coding);
        // A HEAD of floodgate's own answer still holds the answer, whose length hyper
        // would give: the encoded GET's is not known, so none is.
        if let Payload::Own(own) = response.body_mut() {
            own.body = Full::new(Bytes::new());
        }
        return response;
    }
    // With every encoder's place taken, the response goes as it is (its `Vary` set).
    let Some(place) = compression::encoder_place() else {
        return response;
    };
    compression::encode_headers(response.headers_mut(), coding);
    response.map(|body| Payload::Encoded(compression::encode(body, coding, place)))
}

/// A body floodgate writes itself.
pub(crate) fn full(bytes: impl Into<Bytes>) -> Payload {
    Payload::Own(Own {
        body: Full::new(bytes.into()),
        slots: Vec::new(),
    })
}

impl Body for Payload {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            Payload::Upstream(body) => Pin::new(body).poll_frame(cx),
            Payload::Own(body) => Pin::new(body).poll_frame(cx).map_err(|never| match never {}),
            Payload::File(body) => Pin::new(body.as_mut()).poll_frame(cx).map_err(Into::into),
            Payload::ReadAhead(body) => Pin::new(body).poll_frame(cx),
            Payload::Encoded(body) => Pin::new(body).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Payload::Upstream(body) => body.is_end_stream(),
            Payload::Own(body) => body.is_end_stream(),
            Payload::File(body) => body.is_end_stream(),
            Payload::ReadAhead(body) => body.is_end_stream(),
            Payload::Encoded(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Payload::Upstream(body) => body.size_hint(),
            Payload::Own(body) => body.size_hint(),
            Payload::File(body) => body.size_hint(),
            Payload::ReadAhead(body) => body.size_hint(),
            Payload::Encoded(body) => body.size_hint(),
        }
    }
}

/// Floodgate's own bytes, and the concurrency slots of the request they answer.
pub(crate) struct Own {
    body: Full<Bytes>,
    slots: Vec<ConcurrencySlot>,
}

impl Body for Own {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

pin_project! {
    /// The body sent to the client; logs the request when done.
    pub(crate) struct ResponseBody {
        inner: Payload,
        record: Option<Box<AccessRecord>>,
        bytes: u64,
        // Dropped with the body: the connection carries this request until then.
        in_flight: InFlight,
        // On HTTP/2, whether the body waits for its client.
        http2: Option<Http2Pieces>,
    }

    impl PinnedDrop for ResponseBody {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(record) = this.record.take() {
                record.finish(*this.bytes);
            }
        }
    }
}

impl ResponseBody {
    pub(crate) fn new(inner: Payload, record: Box<AccessRecord>, in_flight: InFlight) -> Self {
        ResponseBody {
            http2: in_flight.watch_response().map(|progress| Http2Pieces {
                progress,
                rest: Bytes::new(),
            }),
            inner,
            record: Some(record),
            bytes: 0,
            in_flight,
        }
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.project();
        let polled = match this.http2 {
            None => ready!(Pin::new(this.inner).poll_frame(cx)),
            Some(http2) => {
                http2.progress.polled();
                if http2.rest.is_empty() {
                    match ready!(Pin::new(this.inner).poll_frame(cx)) {
                        Some(Ok(frame)) => match frame.into_data() {
                            Ok(data) => {
                                http2.rest = data;
                                Some(Ok(Frame::data(http2.next_piece())))
                            }
                            Err(frame) => Some(Ok(frame)),
                        },
                        polled => polled,
                    }
                } else {
                    Some(Ok(Frame::data(http2.next_piece())))
                }
            }
        };
        if let Some(Ok(frame)) = &polled
            && let Some(data) = frame.data_ref()
        {
            *this.bytes += data.len() as u64;
            if let Some(http2) = this.http2.as_ref() {
                http2.progress.waits_for_client();
            }
        }
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        self.http2.as_ref().is_none_or(|http2| http2.rest.is_empty()) && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.inner.size_hint();
        if let Some(http2) = &self.http2 {
            let rest = http2.rest.len() as u64;
            // The upper first: neither may pass the other.
            if let Some(upper) = hint.upper() {
                hint.set_upper(upper + rest);
            }
            hint.set_lower(hint.lower() + rest);
        }
        hint
    }
}

/// An HTTP/2 response's [`ResponseProgress`], and what is left of the data frame it is
/// handing hyper a piece at a time: hyper asks for more only once what it was given has
/// gone out, so the stall check (`server.send_timeout`) times one piece, and a client
/// that reads slowly but steadily is not taken for one that stopped.
struct Http2Pieces {
    progress: ResponseProgress,
    rest: Bytes,
}

/// One HTTP/2 `DATA` frame of the default maximum size.
const HTTP2_PIECE: usize = 16 * 1024;

impl Http2Pieces {
    fn next_piece(&mut self) -> Bytes {
        self.rest.split_to(self.rest.len().min(HTTP2_PIECE))
    }
}
