//! Content codings (docs/configuration.md#routescompress): which of zstd, br and gzip a
//! client's `Accept-Encoding` prefers, which responses may be compressed on the way out,
//! and the streaming encoder that does it.
//!
//! The file server picks precompressed siblings (`app.js.br`) by the same preference.

use std::io;
use std::pin::Pin;

use async_compression::Level;
use async_compression::tokio::bufread::{BrotliEncoder, GzipEncoder, ZstdEncoder};
use bytes::Bytes;
use futures_util::{Stream, TryStreamExt};
use http::StatusCode;
use http::header::{self, HeaderMap, HeaderValue};
use http_body::{Body, Frame};
use http_body_util::{BodyDataStream, StreamBody};
use tokio::io::AsyncRead;
use tokio::sync::{Semaphore, SemaphorePermit};
use tokio_util::io::{ReaderStream, StreamReader};

/// The codings floodgate sends, in the order it prefers them when a client accepts
/// several equally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Coding {
    Zstd,
    Brotli,
    Gzip,
}

impl Coding {
    /// Every coding, most preferred first.
    pub(crate) const ALL: [Coding; 3] = [Coding::Zstd, Coding::Brotli, Coding::Gzip];

    /// The `Content-Encoding` token.
    pub(crate) fn token(self) -> &'static str {
        match self {
            Coding::Zstd => "zstd",
            Coding::Brotli => "br",
            Coding::Gzip => "gzip",
        }
    }

    /// The extension of a precompressed sibling file.
    pub(crate) fn extension(self) -> &'static str {
        match self {
            Coding::Zstd => "zst",
            Coding::Brotli => "br",
            Coding::Gzip => "gz",
        }
    }
}

/// A client's `Accept-Encoding`: the quality (in thousandths) it gives each of
/// [`Coding::ALL`]; 0 is "not acceptable".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Accepted([u16; 3]);

impl Accepted {
    /// What the `Accept-Encoding` fields of `headers` accept. A coding the client does
    /// not name takes the quality of `*`, or none; an element that does not parse is
    /// ignored.
    pub(crate) fn from_headers(headers: &HeaderMap) -> Accepted {
        let mut named = [None::<u16>; 3];
        let mut any = None;
        for value in headers.get_all(header::ACCEPT_ENCODING) {
            let Ok(value) = value.to_str() else { continue };
            for element in value.split(',') {
                let mut parts = element.split(';');
                let coding = parts.next().unwrap_or_default().trim();
                let Some(quality) = quality(parts) else { continue };
                let slot = if coding == "*" {
                    &mut any
                } else if let Some(index) = Coding::ALL.iter().position(|c| {
                    coding.eq_ignore_ascii_case(c.token())
                        || (*c == Coding::Gzip && coding.eq_ignore_ascii_case("x-gzip"))
                }) {
                    &mut named[index]
                } else {
                    continue;
                };
                *slot = Some(quality);
            }
        }
        Accepted(named.map(|quality| quality.or(any).unwrap_or(0)))
    }

    /// The coding the client prefers among those `available`, if it accepts any.
    pub(crate) fn best(self, available: impl Fn(Coding) -> bool) -> Option<Coding> {
        self.ranked().find(|coding| available(*coding))
    }

    /// The codings the client accepts, the one it prefers first (floodgate's order among
    /// equals).
    pub(crate) fn ranked(self) -> impl Iterator<Item = Coding> {
        let mut ranked: [(Coding, u16); 3] = std::array::from_fn(|i| (Coding::ALL[i], self.0[i]));
        // Stable, so equals keep the order of `Coding::ALL`; in place, three elements.
        ranked.sort_by_key(|(_, quality)| std::cmp::Reverse(*quality));
        ranked
            .into_iter()
            .filter(|(_, quality)| *quality > 0)
            .map(|(coding, _)| coding)
    }
}

/// The quality of an `Accept-Encoding` element from its parameters: 1 without `q`,
/// `None` when `q` is not a quality value (RFC 9110 §12.4.2).
fn quality<'a>(parameters: impl Iterator<Item = &'a str>) -> Option<u16> {
    let mut quality = 1000;
    for parameter in parameters {
        let (name, value) = parameter.split_once('=')?;
        if !name.trim().eq_ignore_ascii_case("q") {
            continue;
        }
        let value = value.trim();
        let (whole, fraction) = value.split_once('.').unwrap_or((value, ""));
        if fraction.len() > 3 || !fraction.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let thousandths = fraction.bytes().chain(std::iter::repeat(b'0')).take(3);
        let fraction = thousandths.fold(0u16, |sum, digit| sum * 10 + u16::from(digit - b'0'));
        quality = match whole {
            "0" => fraction,
            "1" if fraction == 0 => 1000,
            _ => return None,
        };
    }
    Some(quality)
}

/// Responses shorter than this are sent as they are.
const MIN_LENGTH: u64 = 1024;

/// Whether a response with `status`, `headers` and a body of `length` bytes (when known
/// before it is read) is one a route with `compress` encodes when the client accepts a
/// coding: a text-like type, not already encoded, not a part, not an event stream, no
/// `no-transform`, at least 1 KB when its length is known (from `Content-Length` or
/// the body).
pub(crate) fn compressible(status: StatusCode, headers: &HeaderMap, length: Option<u64>) -> bool {
    if status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::PARTIAL_CONTENT
        || headers.contains_key(header::CONTENT_RANGE)
    {
        return false;
    }
    let encoded = headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .any(|value| !value.as_bytes().eq_ignore_ascii_case(b"identity"));
    let no_transform = headers.get_all(header::CACHE_CONTROL).iter().any(|value| {
        value.to_str().is_ok_and(|text| {
            text.split(',')
                .any(|directive| directive.trim().eq_ignore_ascii_case("no-transform"))
        })
    });
    let short = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|text| text.parse::<u64>().ok())
        .or(length)
        .is_some_and(|length| length < MIN_LENGTH);
    let text_like = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(text_like);
    text_like && !encoded && !no_transform && !short
}

/// Whether a `Content-Type` is text that compresses: `text/*` (not an event stream),
/// JSON, JavaScript, XML, SVG, wasm, and any `+json` or `+xml` type.
fn text_like(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or_default().trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    let is = |name: &str| subtype.eq_ignore_ascii_case(name);
    let suffixed = |suffix: &str| {
        subtype.len() > suffix.len()
            && subtype.as_bytes()[subtype.len() - suffix.len()..].eq_ignore_ascii_case(suffix.as_bytes())
    };
    if kind.eq_ignore_ascii_case("text") {
        !is("event-stream")
    } else if kind.eq_ignore_ascii_case("application") {
        ["json", "javascript", "x-javascript", "ecmascript", "xml", "wasm"]
            .into_iter()
            .any(is)
            || suffixed("+json")
            || suffixed("+xml")
    } else {
        kind.eq_ignore_ascii_case("image") && is("svg+xml")
    }
}

/// Adds `Accept-Encoding` to the `Vary` of `headers`, unless it is there (or `*` is).
pub(crate) fn vary_on_encoding(headers: &mut HeaderMap) {
    let present = headers.get_all(header::VARY).iter().any(|value| {
        value.to_str().is_ok_and(|text| {
            text.split(',').any(|name| {
                let name = name.trim();
                name == "*" || name.eq_ignore_ascii_case("accept-encoding")
            })
        })
    });
    if !present {
        headers.append(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    }
}

/// Marks `headers` as those of the `coding` of the representation they describe: the
/// coding named, the length unknown, a strong `ETag` made weak (the bytes differ, the
/// content does not), ranges no longer offered.
pub(crate) fn encode_headers(headers: &mut HeaderMap, coding: Coding) {
    headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static(coding.token()));
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(header::ACCEPT_RANGES);
    weaken_etag(headers);
}

/// Makes a strong `ETag` weak: that of a representation whose bytes differ from the
/// stored one's (encoded), or of a `304` for it.
pub(crate) fn weaken_etag(headers: &mut HeaderMap) {
    if let Some(etag) = headers.get(header::ETAG)
        && !etag.as_bytes().starts_with(b"W/")
    {
        let mut weak = b"W/".to_vec();
        weak.extend_from_slice(etag.as_bytes());
        if let Ok(weak) = HeaderValue::from_bytes(&weak) {
            headers.insert(header::ETAG, weak);
        }
    }
}

/// The quality levels: zstd's default, gzip's default, and the brotli quality whose CPU
/// cost is no more than gzip's (docs/performance.md#compression).
const ZSTD_LEVEL: i32 = 3;
const GZIP_LEVEL: i32 = 6;
const BROTLI_QUALITY: i32 = 3;

/// The window of brotli and zstd, as a power of two: 256 KB, where their defaults (4 MB and
/// 2 MB at these levels) made an encoder take 9 and 4.4 MB while a client that reads
/// slowly held it. Few responses floodgate compresses are longer, and for those the
/// ratio gives up little.
const WINDOW_LOG: u32 = 18;
/// Responses encoded at once at most: past it, responses go out as they are. An encoder
/// lives as long as its client takes to read the response.
const MAX_ENCODERS: usize = 512;
/// The encoders' places ([`MAX_ENCODERS`]).
static ENCODERS: Semaphore = Semaphore::const_new(MAX_ENCODERS);

/// A place for one more encoder, if any is free.
pub(crate) fn encoder_place() -> Option<EncoderPlace> {
    EncoderPlace::from(&ENCODERS)
}

/// An encoder's place among those allowed at once, given back with its body.
pub(crate) struct EncoderPlace {
    _permit: SemaphorePermit<'static>,
}

impl EncoderPlace {
    fn from(places: &'static Semaphore) -> Option<EncoderPlace> {
        let permit = places.try_acquire().ok()?;
        Some(EncoderPlace { _permit: permit })
    }
}

/// A body encoded with a coding as it streams; trailers are not kept.
pub(crate) type Encoded = StreamBody<Pin<Box<dyn Stream<Item = io::Result<Frame<Bytes>>> + Send>>>;

/// `body`, encoded with `coding`: async-compression's encoder reading the body's data,
/// holding `place` as long as it lives.
pub(crate) fn encode<B>(body: B, coding: Coding, place: EncoderPlace) -> Encoded
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let source = BodyDataStream::new(body).map_err(|error| io::Error::other(error.into()));
    let reader = StreamReader::new(source);
    StreamBody::new(match coding {
        Coding::Zstd => frames(
            ZstdEncoder::with_quality_and_params(
                reader,
                Level::Precise(ZSTD_LEVEL),
                &[async_compression::zstd::CParameter::window_log(WINDOW_LOG)],
            ),
            place,
        ),
        Coding::Brotli => frames(
            BrotliEncoder::with_params(
                reader,
                async_compression::brotli::EncoderParams::default()
                    .quality(Level::Precise(BROTLI_QUALITY))
                    .window_size(WINDOW_LOG as i32),
            ),
            place,
        ),
        Coding::Gzip => frames(
            GzipEncoder::with_quality(reader, Level::Precise(GZIP_LEVEL)),
            place,
        ),
    })
}

/// What `encoder` writes, as body frames, holding `place` until the last.
fn frames(
    encoder: impl AsyncRead + Send + 'static,
    place: EncoderPlace,
) -> Pin<Box<dyn Stream<Item = io::Result<Frame<Bytes>>> + Send>> {
    Box::pin(ReaderStream::new(encoder).map_ok(move |data| {
        let _held = &place;
        Frame::data(data)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepted(value: &'static str) -> Accepted {
        let mut headers = HeaderMap::new();
        headers.insert(header::ACCEPT_ENCODING, HeaderValue::from_static(value));
        Accepted::from_headers(&headers)
    }

    #[test]
    fn the_client_chooses_by_quality_and_floodgate_breaks_ties() {
        let all = |_| true;
        assert_eq!(accepted("gzip, deflate, br, zstd").best(all), Some(Coding::Zstd));
        assert_eq!(accepted("gzip, br").best(all), Some(Coding::Brotli));
        assert_eq!(accepted("gzip;q=1, br;q=0.5").best(all), Some(Coding::Gzip));
        assert_eq!(accepted("br;q=0, gzip;q=0.1").best(all), Some(Coding::Gzip));
        assert_eq!(accepted("*").best(all), Some(Coding::Zstd));
        assert_eq!(accepted("*;q=0.5, zstd;q=0").best(all), Some(Coding::Brotli));
        assert_eq!(accepted("identity").best(all), None);
        assert_eq!(accepted("x-gzip").best(all), Some(Coding::Gzip));
        assert_eq!(accepted("GZIP;Q=0.5").best(all), Some(Coding::Gzip));
        assert_eq!(Accepted::from_headers(&HeaderMap::new()).best(all), None);
        // Only what is available: a precompressed sibling that exists.
        assert_eq!(
            accepted("zstd, br, gzip").best(|c| c == Coding::Gzip),
            Some(Coding::Gzip)
        );
        assert_eq!(accepted("br").best(|c| c == Coding::Gzip), None);
    }

    #[test]
    fn a_quality_that_does_not_parse_drops_its_element() {
        let all = |_| true;
        assert_eq!(accepted("br;q=2, gzip").best(all), Some(Coding::Gzip));
        assert_eq!(accepted("br;q=0.5555, gzip;q=0.1").best(all), Some(Coding::Gzip));
        assert_eq!(accepted("br;q=, gzip;q=0.1").best(all), Some(Coding::Gzip));
        assert_eq!(accepted("br;q=1.000").best(all), Some(Coding::Brotli));
        assert_eq!(accepted("br;q=1.001").best(all), None);
        assert_eq!(accepted("br;q=0.000").best(all), None);
    }

    fn response(content_type: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        headers
    }

    #[test]
    fn what_may_be_compressed() {
        let ok = StatusCode::OK;
        for text in [
            "text/html; charset=utf-8",
            "application/json",
            "application/problem+json",
            "application/atom+xml",
            "image/svg+xml",
            "text/javascript",
            "application/wasm",
        ] {
            assert!(compressible(ok, &response(text), None), "{text}");
        }
        for other in [
            "image/png",
            "application/octet-stream",
            "text/event-stream",
            "video/mp4",
        ] {
            assert!(!compressible(ok, &response(other), None), "{other}");
        }
        let mut encoded = response("text/html");
        encoded.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        assert!(!compressible(ok, &encoded, None));
        let mut no_transform = response("text/html");
        no_transform.insert(
            header::CACHE_CONTROL,
            HeaderValue::from_static("public, No-Transform"),
        );
        assert!(!compressible(ok, &no_transform, None));
        let mut short = response("text/html");
        short.insert(header::CONTENT_LENGTH, HeaderValue::from_static("1023"));
        assert!(!compressible(ok, &short, None));
        short.insert(header::CONTENT_LENGTH, HeaderValue::from_static("1024"));
        assert!(compressible(ok, &short, None));
        // A body that knows its length, without the header (a file's).
        assert!(!compressible(ok, &response("text/html"), Some(1023)));
        assert!(compressible(ok, &response("text/html"), Some(1024)));
        assert!(!compressible(
            StatusCode::PARTIAL_CONTENT,
            &response("text/html"),
            None
        ));
        assert!(compressible(StatusCode::NOT_FOUND, &response("text/html"), None));
    }

    #[test]
    fn vary_is_added_once() {
        let mut headers = HeaderMap::new();
        headers.insert(header::VARY, HeaderValue::from_static("Origin"));
        vary_on_encoding(&mut headers);
        vary_on_encoding(&mut headers);
        let vary: Vec<_> = headers.get_all(header::VARY).iter().collect();
        assert_eq!(vary, ["Origin", "Accept-Encoding"]);
    }

    #[test]
    fn encoded_headers_weaken_the_etag_and_drop_the_length() {
        let mut headers = response("text/css");
        headers.insert(header::ETAG, HeaderValue::from_static("\"abc\""));
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5000"));
        headers.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
        encode_headers(&mut headers, Coding::Brotli);
        assert_eq!(headers["content-encoding"], "br");
        assert_eq!(headers["etag"], "W/\"abc\"");
        assert!(!headers.contains_key(header::CONTENT_LENGTH));
        assert!(!headers.contains_key(header::ACCEPT_RANGES));
    }

    /// No more encoders live at once than there are places; a place comes back with its
    /// encoder's body.
    #[tokio::test]
    async fn encoders_are_bounded_and_give_their_place_back() {
        let places: &'static Semaphore = Box::leak(Box::new(Semaphore::new(1)));
        let body = || http_body_util::Full::new(Bytes::from_static(b"text"));
        let first = encode(body(), Coding::Gzip, EncoderPlace::from(places).expect("free"));
        assert!(EncoderPlace::from(places).is_none(), "one place only");
        drop(first);
        let second = EncoderPlace::from(places).expect("given back");
        drop(encode(body(), Coding::Zstd, second));
        assert!(EncoderPlace::from(places).is_some());
    }

    #[tokio::test]
    async fn every_coding_decodes_to_the_original() {
        use async_compression::tokio::bufread::{BrotliDecoder, GzipDecoder, ZstdDecoder};
        use http_body_util::BodyExt;
        use tokio::io::AsyncReadExt;
        let original: Vec<u8> = (0..200_000u32)
            .flat_map(|i| format!("line {i}\n").into_bytes())
            .collect();
        for coding in Coding::ALL {
            let body = http_body_util::Full::new(Bytes::from(original.clone()));
            let place = encoder_place().expect("a free place");
            let encoded = encode(body, coding, place).collect().await.unwrap().to_bytes();
            assert!(encoded.len() < original.len() / 4, "{coding:?}");
            let mut decoded = Vec::new();
            let input = &encoded[..];
            match coding {
                Coding::Zstd => ZstdDecoder::new(input).read_to_end(&mut decoded).await,
                Coding::Brotli => BrotliDecoder::new(input).read_to_end(&mut decoded).await,
                Coding::Gzip => GzipDecoder::new(input).read_to_end(&mut decoded).await,
            }
            .unwrap();
            assert_eq!(decoded, original, "{coding:?}");
        }
    }
}
