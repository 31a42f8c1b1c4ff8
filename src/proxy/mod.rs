//! The request as it is forwarded: header rewriting between client and upstream, and
//! the request body, bounded while it streams.

pub(crate) mod headers;
pub(crate) mod request_body;
pub(crate) mod spool;
