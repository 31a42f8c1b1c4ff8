//! FastCGI upstreams (`fastcgi://host:port`, `fastcgi:///path.sock`): PHP-FPM spoken to
//! directly (docs/php-fpm.md). The record layer is floodgate's own ([`record`]): it is
//! small, and owning it lets the request body and the response stream through the same
//! poll, with the connections kept in the upstream's pool like HTTP ones.
//!
//! [`params`] builds what a request tells PHP (nginx's `fastcgi_params`), [`pool`] keeps
//! the connections and sends, [`exchange`] runs one request on one connection, [`head`]
//! reads the CGI response head.

mod exchange;
mod head;
pub(crate) mod params;
pub(crate) mod pool;
mod record;

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame};

use crate::trace::context::{self, SpanId};

pub(crate) use exchange::ExchangeError;
pub(crate) use pool::{Address, FastCgiError, Pool};

use exchange::Exchange;

/// A response body from PHP-FPM, streamed as it is read; read to its end, its connection
/// goes back to the pool.
pub(crate) struct FastCgiBody {
    /// `None` once ended. Boxed: an HTTP response body is what most responses carry, and
    /// it need not be as large as an exchange.
    exchange: Option<Box<Exchange>>,
}

impl Body for FastCgiBody {
    type Data = Bytes;
    type Error = ExchangeError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let Some(exchange) = self.exchange.as_mut() else {
            return Poll::Ready(None);
        };
        match exchange.poll_data(cx) {
            Poll::Ready(Some(data)) => Poll::Ready(Some(data.map(Frame::data))),
            Poll::Ready(None) => {
                self.exchange = None;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.exchange.as_deref().is_none_or(Exchange::is_ended)
    }
}

/// A FastCGI request's begin and parameter records ([`params::request_head`]), built by
/// the request path (which chose the script) and passed with the request to the
/// upstream, for each try.
#[derive(Debug, Clone, Default)]
pub(crate) struct FastCgiHead {
    pub(crate) records: Bytes,
    /// Where the value of `HTTP_TRACEPARENT` starts in `records`: a try whose span it
    /// does not name writes its own span ID there, in a copy.
    pub(crate) traceparent: usize,
    /// The span `HTTP_TRACEPARENT` names (the first try's), if any.
    pub(crate) span: Option<SpanId>,
}

impl FastCgiHead {
    /// The records for a try whose span is `span`, whose `traceparent` names it: shared
    /// when they name it already, a copy otherwise.
    fn for_try(&self, span: &SpanId) -> Bytes {
        if self.span == Some(*span) {
            return self.records.clone();
        }
        let mut records = BytesMut::from(&self.records[..]);
        let at = self.traceparent;
        if let Some(parent) = records.get_mut(at + context::PARENT_ID.start..at + context::PARENT_ID.end) {
            context::write_span_id(span, parent);
        }
        records.freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_try_of_a_fastcgi_request_names_its_own_span() {
        let records = Bytes::from_static(b"....00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01....");
        let head = FastCgiHead {
            records,
            traceparent: 4,
            span: Some(SpanId([0xb7, 0xad, 0x6b, 0x71, 0x69, 0x20, 0x33, 0x31])),
        };
        // The first try's span, named already: the records go as they are.
        let first = head.for_try(&head.span.unwrap());
        assert_eq!(first.as_ptr(), head.records.as_ptr());
        let span = SpanId([1, 2, 3, 4, 5, 6, 7, 0xff]);
        assert_eq!(
            &head.for_try(&span)[..],
            b"....00-0af7651916cd43dd8448eb211c80319c-01020304050607ff-01...."
        );
        // Records too short to hold one (none were built) go as they are.
        assert!(FastCgiHead::default().for_try(&span).is_empty());
    }
}
