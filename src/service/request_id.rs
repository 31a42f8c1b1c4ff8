//! Which ID a request carries (docs/configuration.md#serverrequest_id): the one a trusted
//! proxy sent, so that one ID follows the request through every hop, or a new one; a
//! client cannot choose the ID an app logs.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::trace::RequestTrace;
use crate::trace::context::TraceId;

/// The longest request ID taken from a trusted proxy.
const MAX_LEN: usize = 200;

/// The request's ID: the single value of `name` in `headers` when the peer is `trusted`
/// and the value is 1 to 200 visible ASCII characters; otherwise new: the ID of the trace
/// the request begins (so that the two match), or 128 random bits when the trace came
/// from the client; as 32 hex digits.
///
/// Marked sensitive, which HTTP/2's header compression (HPACK) takes as "never index":
/// a value that no other response repeats would otherwise go into the connection's
/// table at each response and push out the names and values that do repeat, which then
/// have to be sent and stored again.
#[inline(always)]
pub(crate) fn decide(
    name: &HeaderName,
    headers: &HeaderMap,
    trusted: bool,
    trace: &RequestTrace,
) -> HeaderValue {
    let mut id = match trusted_id(name, headers, trusted) {
        Some(value) => value.clone(),
        None => {
            let id = if trace.continued() {
                TraceId::random()
            } else {
                trace.trace_id
            };
            hex_value(id.hex())
        }
    };
    id.set_sensitive(true);
    id
}

/// `hex` as a value owned by its `Bytes` from the start: the ID is cloned into the
/// upstream request and the response, and a `Bytes` copied from a slice allocates again on
/// its first clone.
#[allow(unsafe_code)] // checking the digits again cost about 30 instructions a request
fn hex_value(hex: [u8; 32]) -> HeaderValue {
    debug_assert!(hex.iter().all(u8::is_ascii_hexdigit));
    // SAFETY: hex digits, which a `HeaderValue` may hold.
    unsafe { HeaderValue::from_maybe_shared_unchecked(Bytes::from_owner(hex)) }
}

/// The ID a trusted proxy sent, if it is one acceptable value.
fn trusted_id<'h>(name: &HeaderName, headers: &'h HeaderMap, trusted: bool) -> Option<&'h HeaderValue> {
    if !trusted {
        return None;
    }
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (Some(value), None) if acceptable(value) => Some(value),
        _ => None,
    }
}

fn acceptable(value: &HeaderValue) -> bool {
    (1..=MAX_LEN).contains(&value.len()) && value.as_bytes().iter().all(|b| (0x21..=0x7e).contains(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append("x-request-id", HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    fn decided(values: &[&str], trusted: bool) -> String {
        let headers = headers(values);
        let trace = RequestTrace::begin(&http::Method::GET, &headers, None, false);
        let id = decide(
            &HeaderName::from_static("x-request-id"),
            &headers,
            trusted,
            &trace,
        );
        id.to_str().unwrap().to_owned()
    }

    #[test]
    fn a_trusted_proxys_id_is_kept_anyone_elses_replaced() {
        assert_eq!(decided(&["abc-123"], true), "abc-123");
        let replaced = decided(&["abc-123"], false);
        assert_ne!(replaced, "abc-123");
        assert_eq!(replaced.len(), 32);
        assert!(
            replaced
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
    }

    #[test]
    fn a_trusted_value_must_be_one_short_visible_token() {
        let long = "a".repeat(201);
        for bad in [&["a b"][..], &["a", "b"], &[long.as_str()], &[""], &["tab\there"]] {
            let id = decided(bad, true);
            assert_eq!(id.len(), 32, "{bad:?} gave {id:?}");
        }
        assert_eq!(decided(&[&"a".repeat(200)], true).len(), 200);
        assert_eq!(decided(&["!~"], true), "!~");
    }

    #[test]
    fn ids_are_kept_out_of_http2_header_tables() {
        let name = HeaderName::from_static("x-request-id");
        let sent = headers(&["abc-123"]);
        let trace = RequestTrace::begin(&http::Method::GET, &sent, None, false);
        for trusted in [true, false] {
            assert!(decide(&name, &sent, trusted, &trace).is_sensitive());
        }
    }

    #[test]
    fn a_new_id_is_the_new_traces_and_unique() {
        let headers = HeaderMap::new();
        let trace = RequestTrace::begin(&http::Method::GET, &headers, None, false);
        let name = HeaderName::from_static("x-request-id");
        let id = decide(&name, &headers, false, &trace);
        assert_eq!(id.as_bytes(), trace.trace_id.hex());
        let ids: std::collections::HashSet<_> = (0..1000)
            .map(|_| {
                decide(
                    &name,
                    &headers,
                    false,
                    &RequestTrace::begin(&http::Method::GET, &headers, None, false),
                )
            })
            .collect();
        assert_eq!(ids.len(), 1000);
    }
}
