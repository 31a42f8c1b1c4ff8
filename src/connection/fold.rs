//! HTTP/1.1 request heads with more fields than hyper's parser is given room for.
//!
//! hyper parses a head into two arrays sized by its field limit: on the stack up to its
//! default of [`HYPER_FIELDS`], on the heap above it, allocated for every head whatever it
//! holds. floodgate takes any number of fields within 32 KB, so rather than raise that
//! limit for every request, the framing guard, which reads each head before hyper does,
//! folds the fields of a larger head past the 99th into one field whose name only this
//! process knows ([`fold`]), and the service unfolds them first thing, before anything
//! reads the head ([`unfold`]). The fields hyper acts on (the body's framing, `Connection`,
//! `Expect`, `Upgrade`, `TE`) are never folded, so that hyper frames the body, keeps or
//! closes the connection and sends trailers as it would have with all the fields in view.
//!
//! A folded field holds each field as `name:length,value` (values as the parser trims
//! them), one after the other. A field of that name that floodgate did not make (which
//! would take guessing 64 random bits) is unfolded only if it is well formed and holds no
//! field hyper acts on: it can give a request no field its client could not have sent.

use std::hash::{BuildHasher, Hasher};
use std::io::Write as _;
use std::sync::LazyLock;

use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Request, Version};
use memchr::memchr;

use super::framing::HeadRefusal;

/// The fields hyper's HTTP/1 parser takes in a head: its default, which keeps its arrays
/// on the stack. A folded head holds exactly this many, and so does the map hyper makes
/// of it: hyper leaves out only a repeated or overridden `Content-Length`, which the
/// framing guard refuses.
pub(crate) const HYPER_FIELDS: usize = 100;

/// The folded field's name: `x-floodgate-fold-` and 64 bits that differ in each process
/// (from the standard library's randomly keyed hasher).
static FOLDED: LazyLock<HeaderName> = LazyLock::new(|| {
    let mut secret = std::collections::hash_map::RandomState::new().build_hasher();
    secret.write_u64(u64::from(std::process::id()));
    let name = format!("x-floodgate-fold-{:016x}", secret.finish());
    HeaderName::from_bytes(name.as_bytes()).expect("a token")
});

/// Whether hyper's parser acts on a field of this name.
fn acted_on(name: &[u8]) -> bool {
    [
        header::CONTENT_LENGTH,
        header::TRANSFER_ENCODING,
        header::CONNECTION,
        header::EXPECT,
        header::UPGRADE,
        header::TE,
    ]
    .iter()
    .any(|acted| name.eq_ignore_ascii_case(acted.as_str().as_bytes()))
}

/// `head`, a whole request head (its request line first) that the framing guard took,
/// with more than [`HYPER_FIELDS`] fields and at most `room`: its request line as sent,
/// the fields hyper acts on and the first others up to 99 fields, then one field holding
/// the rest. Refused as hyper would refuse it, or as too large if it has 100 or more
/// fields that hyper acts on.
pub(crate) fn fold(head: &[u8], room: usize) -> Result<Vec<u8>, HeadRefusal> {
    let mut fields = vec![httparse::EMPTY_HEADER; room];
    let mut request = httparse::Request::new(&mut fields);
    match request.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Err(httparse::Error::TooManyHeaders) => return Err(HeadRefusal::TooLarge),
        Ok(httparse::Status::Partial) | Err(_) => return Err(HeadRefusal::Malformed),
    }
    let acted = request
        .headers
        .iter()
        .filter(|field| acted_on(field.name.as_bytes()))
        .count();
    let Some(mut others_in_view) = (HYPER_FIELDS - 1).checked_sub(acted) else {
        return Err(HeadRefusal::TooLarge);
    };
    let request_line = memchr(b'\n', head).map_or(head.len(), |lf| lf + 1);
    let mut folded = Vec::with_capacity(head.len() + head.len() / 4);
    folded.extend_from_slice(&head[..request_line]);
    let mut rest = Vec::with_capacity(head.len());
    for field in request.headers.iter() {
        let name = field.name.as_bytes();
        let hyper_reads = acted_on(name);
        if hyper_reads || others_in_view > 0 {
            if !hyper_reads {
                others_in_view -= 1;
            }
            folded.extend_from_slice(name);
            folded.extend_from_slice(b": ");
            folded.extend_from_slice(field.value);
            folded.extend_from_slice(b"\r\n");
        } else {
            rest.extend_from_slice(name);
            let _ = write!(rest, ":{},", field.value.len());
            rest.extend_from_slice(field.value);
        }
    }
    folded.extend_from_slice(FOLDED.as_str().as_bytes());
    folded.extend_from_slice(b": ");
    folded.extend_from_slice(&rest);
    folded.extend_from_slice(b"\r\n\r\n");
    Ok(folded)
}

/// Puts the fields [`fold`] folded back in `request`'s head, after the others, as hyper
/// would have appended them; leaves every other head as it is.
#[inline]
pub(crate) fn unfold<B>(request: &mut Request<B>) {
    if request.headers().len() == HYPER_FIELDS && request.version() <= Version::HTTP_11 {
        unfold_fields(request.headers_mut());
    }
}

#[cold]
fn unfold_fields(headers: &mut HeaderMap) {
    let Some(folded) = headers.get(&*FOLDED) else {
        return;
    };
    let Some(fields) = unfolded(folded.as_bytes()) else {
        tracing::debug!("left a folded field as it is: not one floodgate made");
        return;
    };
    headers.remove(&*FOLDED);
    for (name, value) in fields {
        headers.append(name, value);
    }
}

/// The fields `folded` holds, if it is well formed and holds none hyper acts on.
fn unfolded(mut folded: &[u8]) -> Option<Vec<(HeaderName, HeaderValue)>> {
    let mut fields = Vec::new();
    while !folded.is_empty() {
        let colon = memchr(b':', folded)?;
        let name = &folded[..colon];
        if acted_on(name) {
            return None;
        }
        let name = HeaderName::from_bytes(name).ok()?;
        let after_colon = &folded[colon + 1..];
        let comma = memchr(b',', after_colon)?;
        let digits = &after_colon[..comma];
        if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let length: usize = std::str::from_utf8(digits).ok()?.parse().ok()?;
        let (value, rest) = after_colon[comma + 1..].split_at_checked(length)?;
        fields.push((name, HeaderValue::from_bytes(value).ok()?));
        folded = rest;
    }
    Some(fields)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MAX_FIELDS: usize = 8192;

    /// The head hyper is given parsed as hyper parses it, with room for `room` fields:
    /// the fields in order, as hyper appends them to the request's map.
    fn parsed(head: &[u8], room: usize) -> Result<Request<()>, httparse::Error> {
        let mut fields = vec![httparse::EMPTY_HEADER; room];
        let mut parsed = httparse::Request::new(&mut fields);
        let status = parsed.parse(head)?;
        assert!(status.is_complete(), "a whole head");
        let mut request = Request::new(());
        *request.version_mut() = Version::HTTP_11;
        for field in parsed.headers.iter() {
            request.headers_mut().append(
                HeaderName::from_bytes(field.name.as_bytes()).unwrap(),
                HeaderValue::from_bytes(field.value).unwrap(),
            );
        }
        Ok(request)
    }

    /// Each name's values in order: what a head means, the order of different names aside
    /// (RFC 9110 §5.3).
    fn meaning(headers: &HeaderMap) -> Vec<(String, Vec<Vec<u8>>)> {
        let mut names: Vec<_> = headers
            .keys()
            .map(|name| {
                let values = headers.get_all(name).iter().map(|v| v.as_bytes().to_vec());
                (name.to_string(), values.collect())
            })
            .collect();
        names.sort();
        names
    }

    fn head_of(fields: &[(String, Vec<u8>)]) -> Vec<u8> {
        let mut head = b"POST /many?x=1 HTTP/1.1\r\n".to_vec();
        for (name, value) in fields {
            head.extend_from_slice(name.as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(value);
            head.extend_from_slice(b"\r\n");
        }
        head.extend_from_slice(b"\r\n");
        head
    }

    /// Folds `head`, checks hyper can parse what it becomes, unfolds that, and returns the
    /// folded bytes and the request as the service sees it.
    fn through_the_fold(head: &[u8]) -> (Vec<u8>, Request<()>) {
        let folded = fold(head, MAX_FIELDS).expect("folded");
        let mut request = parsed(&folded, HYPER_FIELDS).expect("hyper parses a folded head");
        assert_eq!(request.headers().len(), HYPER_FIELDS);
        unfold(&mut request);
        (folded, request)
    }

    #[test]
    fn a_folded_head_means_what_it_meant() {
        let mut fields: Vec<(String, Vec<u8>)> = (0..300)
            .map(|i| {
                (
                    format!("X-Field-{i}"),
                    format!("value {i}\twith  spaces").into_bytes(),
                )
            })
            .collect();
        // A name on both sides of the 99th field, an empty value, bytes beyond ASCII, and
        // the separators the folded field uses, in values.
        fields[50].0 = "x-twice".into();
        fields[200].0 = "X-Twice".into();
        fields[120].1 = Vec::new();
        fields[130].1 = b"caf\xc3\xa9 \xff".to_vec();
        fields[140].1 = b"a:3,bcd, 12:x".to_vec();
        let head = head_of(&fields);
        let (folded, request) = through_the_fold(&head);
        assert!(folded.starts_with(b"POST /many?x=1 HTTP/1.1\r\n"));
        let expected = parsed(&head, MAX_FIELDS).unwrap();
        assert_eq!(meaning(request.headers()), meaning(expected.headers()));
        assert_eq!(request.headers().len(), 300);
        assert!(!request.headers().contains_key(&*FOLDED));
        // In the order sent, the fields past the 99th after the others.
        let order: Vec<_> = request
            .headers()
            .keys()
            .map(|name| name.as_str().to_owned())
            .collect();
        assert_eq!(order[0], "x-field-0");
        assert_eq!(order[50], "x-twice");
        assert_eq!(order[98], "x-field-98");
        assert_eq!(order[99], "x-field-99");
        assert_eq!(order[100], "x-field-100");
    }

    #[test]
    fn the_fields_hyper_acts_on_stay_in_view_wherever_they_were() {
        let mut fields: Vec<(String, Vec<u8>)> =
            (0..200).map(|i| (format!("x-{i}"), b"v".to_vec())).collect();
        fields[150] = ("Transfer-Encoding".into(), b"chunked".to_vec());
        fields[160] = ("connection".into(), b"close".to_vec());
        fields[170] = ("Expect".into(), b"100-continue".to_vec());
        fields[180] = ("upgrade".into(), b"websocket".to_vec());
        fields[185] = ("TE".into(), b"trailers".to_vec());
        fields[190] = ("content-length".into(), b"5".to_vec());
        let head = head_of(&fields);
        let (folded, request) = through_the_fold(&head);
        let in_view = parsed(&folded, HYPER_FIELDS).unwrap();
        for name in [
            "transfer-encoding",
            "connection",
            "expect",
            "upgrade",
            "te",
            "content-length",
        ] {
            assert!(in_view.headers().contains_key(name), "{name} folded");
        }
        let expected = parsed(&head, MAX_FIELDS).unwrap();
        assert_eq!(meaning(request.headers()), meaning(expected.headers()));
    }

    #[test]
    fn a_head_with_too_many_fields_hyper_acts_on_is_too_large() {
        let fields: Vec<(String, Vec<u8>)> = (0..150)
            .map(|i| ("connection".into(), format!("x{i}").into_bytes()))
            .collect();
        assert_eq!(fold(&head_of(&fields), MAX_FIELDS), Err(HeadRefusal::TooLarge));
        let mut fields: Vec<(String, Vec<u8>)> =
            (0..150).map(|i| (format!("x-{i}"), b"v".to_vec())).collect();
        assert_eq!(fold(&head_of(&fields[..130]), 120), Err(HeadRefusal::TooLarge));
        fields[120].1 = b"a\x01b".to_vec();
        assert_eq!(fold(&head_of(&fields), MAX_FIELDS), Err(HeadRefusal::Malformed));
    }

    /// A request whose head holds exactly [`HYPER_FIELDS`] fields, one of them named as
    /// the folded field, with `value`.
    fn forged(value: &[u8], version: Version) -> Request<()> {
        let mut request = Request::new(());
        *request.version_mut() = version;
        for i in 0..HYPER_FIELDS - 1 {
            request.headers_mut().append(
                HeaderName::from_bytes(format!("x-{i}").as_bytes()).unwrap(),
                HeaderValue::from_static("v"),
            );
        }
        request
            .headers_mut()
            .append(FOLDED.clone(), HeaderValue::from_bytes(value).unwrap());
        request
    }

    #[test]
    fn a_folded_field_floodgate_did_not_make_is_left_as_it_is() {
        for value in [
            &b"content-length:1,5"[..],
            b"Transfer-Encoding:7,chunked",
            b"x-a:5,ab",
            b"x-a:2,ab;",
            b"x-a",
            b"x a:1,b",
            b"x-a:z,b",
            b"x-a:+1,b",
            b"x-a:,",
            b"x-a:18446744073709551615,b",
            b"x-a:99999999999999999999999,b",
            b"te:8,trailers",
        ] {
            let mut request = forged(value, Version::HTTP_11);
            unfold(&mut request);
            assert_eq!(request.headers().get(&*FOLDED).unwrap().as_bytes(), value);
            assert_eq!(request.headers().len(), HYPER_FIELDS, "{value:?}");
        }
        // Not over HTTP/2, whose heads are never folded.
        let mut request = forged(b"x-a:1,b", Version::HTTP_2);
        unfold(&mut request);
        assert!(request.headers().contains_key(&*FOLDED));
        // Nor with a field more.
        let mut request = forged(b"x-a:1,b", Version::HTTP_11);
        request
            .headers_mut()
            .append("x-more", HeaderValue::from_static("v"));
        unfold(&mut request);
        assert!(request.headers().contains_key(&*FOLDED));
        // Well formed, it holds nothing its client could not have sent.
        let mut request = forged(b"x-a:1,b", Version::HTTP_11);
        unfold(&mut request);
        assert_eq!(request.headers()["x-a"], "b");
        assert!(!request.headers().contains_key(&*FOLDED));
    }

    fn field() -> impl Strategy<Value = (String, Vec<u8>)> {
        let name = prop_oneof![
            8 => "[a-z]{1,3}".prop_map(|n| format!("x-{n}")),
            8 => "[!#$%&'*+.^_`|~0-9A-Za-z-]{1,12}",
            1 => Just("Connection".to_owned()),
            1 => Just("upgrade".to_owned()),
            1 => Just("Transfer-Encoding".to_owned()),
            1 => Just("content-length".to_owned()),
            1 => Just("Expect".to_owned()),
            1 => Just("te".to_owned()),
        ];
        // Values as a parser leaves them: no whitespace at either end.
        let value = proptest::collection::vec(
            prop_oneof![
                Just(b' '),
                Just(b'\t'),
                0x21u8..0x7f,
                0x80u8..=0xff,
                Just(b':'),
                Just(b',')
            ],
            0..20,
        )
        .prop_map(|mut value| {
            while value.last().is_some_and(|b| matches!(b, b' ' | b'\t')) {
                value.pop();
            }
            while value.first().is_some_and(|b| matches!(b, b' ' | b'\t')) {
                value.remove(0);
            }
            value
        });
        (name, value)
    }

    proptest! {
        #[test]
        fn any_head_folds_and_unfolds_to_what_it_meant(
            fields in proptest::collection::vec(field(), HYPER_FIELDS + 1..400)
        ) {
            let head = head_of(&fields);
            match fold(&head, MAX_FIELDS) {
                Ok(folded) => {
                    let mut request = parsed(&folded, HYPER_FIELDS).expect("hyper parses it");
                    prop_assert_eq!(request.headers().len(), HYPER_FIELDS);
                    unfold(&mut request);
                    let expected = parsed(&head, MAX_FIELDS).unwrap();
                    prop_assert_eq!(meaning(request.headers()), meaning(expected.headers()));
                }
                Err(refusal) => {
                    prop_assert_eq!(refusal, HeadRefusal::TooLarge);
                    let acted = fields.iter().filter(|(n, _)| acted_on(n.as_bytes())).count();
                    prop_assert!(acted >= HYPER_FIELDS);
                }
            }
        }
    }
}
