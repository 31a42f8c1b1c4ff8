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

use bytes::Bytes;
use http_body::{Body, Frame};

pub(crate) use exchange::ExchangeError;
pub(crate) use pool::{Address, FastCgiError, Pool, Unsent};

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
