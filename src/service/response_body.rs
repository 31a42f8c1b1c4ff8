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
use crate::limit::store::HeldSlots;
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
    /// Any of the above, on HTTP/2, in pieces.
    Pieces(Box<Pieces>),
}

impl Payload {
    /// Has floodgate's own body hold `slots`, the concurrency slots of the request it
    /// answers, until written (a forwarded request's travel with its upstream exchange).
    pub(crate) fn hold(&mut self, slots: HeldSlots) {
        if let Payload::Own(own) = self {
            own.slots = slots;
        }
    }
}

/// `response` as a route with `compress` sends it to a client that accepts `accepted`
/// (docs/configuration.md#routescompress): encoded when it may be and the client takes a
/// coding, with `Vary` whenever it may be; a `HEAD` gets the headers alone, a `304` the
/// weak `ETag` alone (no `Content-Encoding`, RFC 9110 §15.4.5: the copy it revalidates
/// may be one that went as it was while every encoder was busy).
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
    if status == StatusCode::NOT_MODIFIED {
        compression::weaken_etag(response.headers_mut());
        return response;
    }
    if method == Method::HEAD {
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
        slots: HeldSlots::default(),
    })
}

impl Body for Payload {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    #[inline]
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
            Payload::Pieces(body) => Pin::new(body.as_mut()).poll_frame(cx),
        }
    }

    #[inline]
    fn is_end_stream(&self) -> bool {
        match self {
            Payload::Upstream(body) => body.is_end_stream(),
            Payload::Own(body) => body.is_end_stream(),
            Payload::File(body) => body.is_end_stream(),
            Payload::ReadAhead(body) => body.is_end_stream(),
            Payload::Encoded(body) => body.is_end_stream(),
            Payload::Pieces(body) => body.is_end_stream(),
        }
    }

    #[inline]
    fn size_hint(&self) -> SizeHint {
        match self {
            Payload::Upstream(body) => body.size_hint(),
            Payload::Own(body) => body.size_hint(),
            Payload::File(body) => body.size_hint(),
            Payload::ReadAhead(body) => body.size_hint(),
            Payload::Encoded(body) => body.size_hint(),
            Payload::Pieces(body) => body.size_hint(),
        }
    }
}

/// Floodgate's own bytes, and the concurrency slots of the request they answer.
pub(crate) struct Own {
    body: Full<Bytes>,
    slots: HeldSlots,
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
        progress: Option<ResponseProgress>,
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
            progress: in_flight.watch_response(),
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

    #[inline]
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.project();
        if let Some(progress) = this.progress.as_ref() {
            progress.polled();
        }
        let mut polled = ready!(Pin::new(&mut *this.inner).poll_frame(cx));
        if let Some(Ok(frame)) = &mut polled
            && let Some(data) = frame.data_mut()
        {
            if let Some(progress) = this.progress.as_ref() {
                if data.len() > PIECE {
                    *data = Pieces::first(this.inner, std::mem::take(data));
                }
                progress.waits_for_client();
            }
            *this.bytes += data.len() as u64;
        }
        Poll::Ready(polled)
    }

    #[inline]
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    #[inline]
    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// An HTTP/2 response's body once it gave a data frame larger than [`PIECE`], handed to
/// hyper a piece at a time: hyper asks for more only once what it was given has gone out,
/// so the connection's stall check (`server.send_timeout`, [`ResponseProgress`]) times
/// one piece, and a client that reads slowly but steadily is not taken for one that
/// stopped.
pub(crate) struct Pieces {
    inner: Payload,
    /// What is left of the last data frame.
    rest: Bytes,
}

/// One HTTP/2 `DATA` frame of the default maximum size.
const PIECE: usize = 16 * 1024;

impl Pieces {
    /// The first piece of `data`, which `inner` gave; `inner` becomes its pieces.
    #[cold]
    fn first(inner: &mut Payload, mut data: Bytes) -> Bytes {
        let first = data.split_to(PIECE.min(data.len()));
        let body = std::mem::replace(inner, full(Bytes::new()));
        *inner = Payload::Pieces(Box::new(Pieces {
            inner: body,
            rest: data,
        }));
        first
    }
}

impl Body for Pieces {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.rest.is_empty() {
            match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => self.rest = data,
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                other => return Poll::Ready(other),
            }
        }
        let piece = self.rest.len().min(PIECE);
        Poll::Ready(Some(Ok(Frame::data(self.rest.split_to(piece)))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.inner.size_hint();
        let rest = self.rest.len() as u64;
        // The upper first: neither may pass the other.
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper + rest);
        }
        hint.set_lower(hint.lower() + rest);
        hint
    }
}
