//! The copy of a request head that lets an idempotent request without a body go to
//! another server after the first one took it and failed (hyper consumes what it sends).
//!
//! Every request sent to an upstream of several servers pays for the copy and only a
//! failed one reads it, so the head is packed into one buffer: one allocation and a copy
//! of its bytes, where cloning the `HeaderMap` costs two allocations and a reference
//! count per value (docs/performance.md#upstreams-several-servers-the-cap-overrides).

use http::uri::PathAndQuery;
use http::{HeaderName, HeaderValue, Method, Request, Uri, Version};

use crate::proxy::request_body::RequestBody;

/// Bytes a packed head starts with per header (both lengths, name and value).
const ROOM_PER_HEADER: usize = 64;

/// A request head (origin-form target), to be sent again.
pub(super) struct Replay {
    method: Method,
    version: Version,
    /// The target, then each header's name and value (repeated names once per value, in
    /// order), each after its length as four little-endian bytes.
    packed: Vec<u8>,
}

impl Replay {
    pub(super) fn of<B>(request: &Request<B>) -> Self {
        let target = origin_form(request.uri());
        let headers = request.headers();
        // Room for a typical head: sizing it exactly would take a pass of its own.
        let mut packed = Vec::with_capacity(4 + target.len() + headers.len() * ROOM_PER_HEADER);
        put(&mut packed, target.as_bytes());
        for (name, value) in headers {
            put(&mut packed, name.as_str().as_bytes());
            put(&mut packed, value.as_bytes());
        }
        Replay {
            method: request.method().clone(),
            version: request.version(),
            packed,
        }
    }

    /// The request again, without a body. `None` cannot happen for a copy of a request
    /// (its names and values were valid): it would mean no second try.
    pub(super) fn request(&self) -> Option<Request<RequestBody>> {
        let mut rest = self.packed.as_slice();
        let target = PathAndQuery::try_from(take(&mut rest)?).ok()?;
        let mut request = Request::new(RequestBody::empty());
        *request.method_mut() = self.method.clone();
        *request.uri_mut() = Uri::from(target);
        *request.version_mut() = self.version;
        let headers = request.headers_mut();
        while !rest.is_empty() {
            let name = HeaderName::from_bytes(take(&mut rest)?).ok()?;
            let value = HeaderValue::from_bytes(take(&mut rest)?).ok()?;
            headers.append(name, value);
        }
        Some(request)
    }
}

/// The target as it goes on the request line to a server: path and query.
fn origin_form(uri: &Uri) -> &str {
    debug_assert!(
        uri.scheme().is_none(),
        "upstream requests carry origin-form targets"
    );
    uri.path_and_query().map_or("/", PathAndQuery::as_str)
}

fn put(packed: &mut Vec<u8>, field: &[u8]) {
    let length = u32::try_from(field.len()).expect("a request head is far below 4 GiB");
    packed.extend_from_slice(&length.to_le_bytes());
    packed.extend_from_slice(field);
}

fn take<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
    let (length, after) = rest.split_first_chunk::<4>()?;
    let (field, after) = after.split_at_checked(u32::from_le_bytes(*length) as usize)?;
    *rest = after;
    Some(field)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header;

    #[test]
    fn the_request_comes_back_as_it_was_sent() {
        let mut original = Request::new(());
        *original.method_mut() = Method::DELETE;
        *original.uri_mut() = Uri::from_static("/api/items/7?force=1&x=%20");
        let headers = original.headers_mut();
        headers.insert(header::HOST, HeaderValue::from_static("app.example"));
        headers.append("x-tag", HeaderValue::from_static("one"));
        headers.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
        headers.append("x-tag", HeaderValue::from_static("two"));
        headers.insert("x-empty", HeaderValue::from_static(""));
        // obs-text, which clients may send and HTTP/1 parsers keep.
        headers.insert("x-latin", HeaderValue::from_bytes(b"caf\xe9").unwrap());

        let again = Replay::of(&original)
            .request()
            .expect("a copy of a valid request");
        assert_eq!(again.method(), Method::DELETE);
        assert_eq!(again.uri(), "/api/items/7?force=1&x=%20");
        assert_eq!(again.version(), Version::HTTP_11);
        let pairs = |headers: &http::HeaderMap| -> Vec<(String, Vec<u8>)> {
            headers
                .iter()
                .map(|(name, value)| (name.to_string(), value.as_bytes().to_vec()))
                .collect()
        };
        assert_eq!(pairs(again.headers()), pairs(original.headers()));
        assert_eq!(
            again.headers().get_all("x-tag").iter().collect::<Vec<_>>(),
            ["one", "two"]
        );
    }

    #[test]
    fn a_bare_request_comes_back_bare() {
        let original = Request::get("/").body(()).unwrap();
        let again = Replay::of(&original).request().unwrap();
        assert_eq!(again.uri(), "/");
        assert!(again.headers().is_empty());
    }

    #[test]
    fn a_truncated_copy_gives_no_request() {
        let original = Request::get("/x").header("x-a", "b").body(()).unwrap();
        let mut replay = Replay::of(&original);
        replay.packed.pop();
        assert!(replay.request().is_none());
    }
}
