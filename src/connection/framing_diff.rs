//! Differential test of the framing guard against hyper itself.
//!
//! Each case is one HTTP/1.1 connection's bytes: random pipelined requests (Content-Length
//! bodies, chunked bodies with odd chunk-size lines and trailers, odd heads), then a
//! "canary" carrying both `Content-Length` and `Transfer-Encoding`, delivered in random
//! reads (with `Pending` between some). The bytes are served twice by hyper's HTTP/1
//! server configured as floodgate's (`server::http1_builder`): once straight, with room
//! for every field (the reference: what hyper reads), once through a `FramingGuard`,
//! with the fields it folded unfolded (`fold`). Through the guard:
//! - no request with both headers (the canary, or any request the generator marked) is
//!   ever served;
//! - what is served is a prefix of what hyper serves straight, each request the same
//!   (method, path, fields, body), but for the last, whose body the guard may have made
//!   fail.
//!
//! 2,000 cases by default (a few seconds); more, another seed, or one case again:
//! `FRAMING_DIFF_CASES=50000 FRAMING_DIFF_SEED=2 cargo test --lib framing_diff -- --nocapture`,
//! `FRAMING_DIFF_CASE=N`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::ConnectionState;
use super::fold::{self, HYPER_FIELDS};
use super::framing::{AnswerRefusal, FramingGuard, HeadLimits, HeadRefusal};
use crate::server::{HTTP1_LIMITS, http1_builder};

const LIMITS: HeadLimits = HTTP1_LIMITS;

// ---------------------------------------------------------------------------------------
// PRNG

/// The cases' randomness: a seeded `fastrand` generator, and what this connection's
/// generators lean to.
struct Rng {
    numbers: fastrand::Rng,
    /// How often (percent) a generator picks a spelling hyper may refuse.
    odd_percent: usize,
    /// Whether this connection may carry long lines and large bodies (slow to run).
    long: bool,
}

impl Rng {
    fn new(seed: u64) -> Self {
        let mut rng = Rng {
            numbers: fastrand::Rng::with_seed(seed),
            odd_percent: 0,
            long: false,
        };
        rng.odd_percent = rng.pick(&[0, 1, 3, 10, 30]);
        rng.long = rng.chance(15);
        rng
    }
    /// Whether to write something odd (that hyper may refuse) here.
    fn odd(&mut self) -> bool {
        self.chance(self.odd_percent)
    }
    /// Whether to write something long here.
    fn big(&mut self, percent: usize) -> bool {
        self.long && self.chance(percent)
    }
    fn below(&mut self, n: usize) -> usize {
        self.numbers.usize(..n)
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())].clone()
    }
}

// ---------------------------------------------------------------------------------------
// Generators

const CANARY_PATH: &str = "/canary";

/// Bytes of body data: random, or text that looks like requests (with both headers).
fn body_bytes(rng: &mut Rng, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let texts: [&[u8]; 6] = [
        b"\r\n",
        b"\n",
        b"\r",
        b"0\r\n\r\n",
        b"POST /amb-in-body HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"GET /in-body HTTP/1.1\r\n\r\n",
    ];
    while out.len() < len {
        if rng.chance(20) {
            out.extend_from_slice(rng.pick(&texts));
        } else {
            out.push(rng.pick(&[b'a', b'0', b' ', b';', b':', b'\t', b'"', 0u8, 0xff]));
        }
    }
    out.truncate(len);
    out
}

fn line_end(rng: &mut Rng) -> &'static [u8] {
    if rng.chance(85) { b"\r\n" } else { b"\n" }
}

/// A `Content-Length` value.
fn cl_value(rng: &mut Rng, len: usize) -> Vec<u8> {
    let plain = len.to_string();
    if !rng.odd() {
        return match rng.below(6) {
            0 => format!("0{plain}").into_bytes(),
            1 => format!(" {plain}").into_bytes(),
            2 => format!("{plain} \t").into_bytes(),
            3 => format!("00000000000000000000000000000{plain}").into_bytes(),
            _ => plain.into_bytes(),
        };
    }
    match rng.below(14) {
        0 => format!("0{plain}").into_bytes(),
        1 => format!("000000000000000000000000{plain}").into_bytes(),
        2 => format!("+{plain}").into_bytes(),
        3 => format!(" {plain}").into_bytes(),
        4 => format!("{plain} ").into_bytes(),
        5 => format!("{plain},{plain}").into_bytes(),
        6 => format!("\t{plain}\t").into_bytes(),
        7 => b"18446744073709551616".to_vec(),
        8 => b"18446744073709551615".to_vec(),
        9 => format!("{plain}\x0c").into_bytes(),
        10 => format!("-{plain}").into_bytes(),
        _ => plain.into_bytes(),
    }
}

/// A `Transfer-Encoding` value ending (mostly) with chunked.
fn te_value(rng: &mut Rng) -> Vec<u8> {
    if !rng.odd() {
        return rng
            .pick(&[
                &b"chunked"[..],
                b"Chunked",
                b"CHUNKED",
                b"gzip, chunked",
                b"gzip,chunked",
                b"gzip,  chunked \t",
                b",chunked",
                b"identity , chunked",
            ])
            .to_vec();
    }
    rng.pick(&[
        &b"chunked"[..],
        b"chunked",
        b"chunked",
        b"Chunked",
        b"CHUNKED",
        b"gzip, chunked",
        b"gzip,chunked",
        b"gzip,  chunked \t",
        b"chunked, gzip",
        b"identity",
        b"chunked;q=1",
        b" chunked",
        b"\xc3\xa9, chunked",
        b"",
        b",chunked",
    ])
    .to_vec()
}

/// A chunk-size line (without the data): size in hex with odd spellings.
fn chunk_size_line(rng: &mut Rng, size: u64, ext_budget: &mut usize) -> Vec<u8> {
    let mut line = Vec::new();
    if rng.chance(10) {
        let zeros = if rng.big(30) {
            rng.range(8150, 8200)
        } else {
            rng.range(1, 20)
        };
        line.extend(std::iter::repeat_n(b'0', zeros));
    }
    let hex = if rng.chance(50) {
        format!("{size:x}")
    } else {
        format!("{size:X}")
    };
    line.extend_from_slice(hex.as_bytes());
    if rng.chance(10) {
        for _ in 0..rng.range(1, 3) {
            line.push(rng.pick(b" \t"));
        }
    }
    if rng.chance(25) {
        let mut kind = if rng.odd() {
            rng.below(9)
        } else {
            rng.pick(&[0, 1, 2, 5, 6, 7, 8])
        };
        if matches!(kind, 5 | 6) && !rng.long {
            kind = 0;
        }
        let ext: Vec<u8> = match kind {
            0 => b";a=b".to_vec(),
            1 => b"; a = \"q;\\\"x\"".to_vec(),
            2 => b";name".to_vec(),
            3 => b";a=\"\n\"".to_vec(),
            4 => b";a\rb".to_vec(),
            5 => {
                // Near the guard's 8 KB line limit.
                let n = rng.range(8180, 8200).saturating_sub(line.len() + 3);
                let mut e = b";x=".to_vec();
                e.extend(std::iter::repeat_n(b'a', n));
                e
            }
            6 => {
                // Uses up hyper's 16 KB extension budget over several lines.
                let n = rng.range(5000, 8100);
                let mut e = b";y=".to_vec();
                e.extend(std::iter::repeat_n(b'b', n));
                e
            }
            7 => b";\x00\xff\t ".to_vec(),
            _ => b";".to_vec(),
        };
        *ext_budget = ext_budget.saturating_sub(ext.len());
        line.extend_from_slice(&ext);
    }
    match if rng.odd() { rng.below(4) } else { 4 } {
        0 => line.extend_from_slice(b"\n"),
        1 => line.extend_from_slice(b"\r"),
        2 => line.extend_from_slice(b"\r\r\n"),
        3 => line.extend_from_slice(b" \r\n"),
        _ => line.extend_from_slice(b"\r\n"),
    }
    line
}

/// A trailer section (after the last chunk's line), through its end.
fn trailers(rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::new();
    if rng.chance(50) {
        for _ in 0..rng.range(1, 3) {
            let mut kind = if rng.odd() {
                rng.below(13)
            } else {
                rng.pick(&[0, 5, 7, 8, 11, 12])
            };
            if matches!(kind, 5 | 6) && !rng.long {
                kind = 0;
            }
            let line: Vec<u8> = match kind {
                0 => b"X-T: 1".to_vec(),
                1 => b"\nX-T: 1".to_vec(),
                2 => b"X-T: a\nb".to_vec(),
                3 => b" folded".to_vec(),
                4 => b"X-T: a\rb".to_vec(),
                5 => {
                    let mut l = b"X-L: ".to_vec();
                    l.extend(std::iter::repeat_n(b'l', rng.range(8180, 8200)));
                    l
                }
                6 => {
                    let mut l = b"X-L: ".to_vec();
                    l.extend(std::iter::repeat_n(b'l', rng.range(16370, 16390)));
                    l
                }
                7 => b"Content-Length: 5".to_vec(),
                8 => b"Transfer-Encoding: chunked".to_vec(),
                9 => b"\n".to_vec(),
                10 => b"GET /in-trailer HTTP/1.1".to_vec(),
                11 => b"X-T:".to_vec(),
                _ => b"x:y".to_vec(),
            };
            out.extend_from_slice(&line);
            out.extend_from_slice(match if rng.odd() { rng.below(2) } else { 2 } {
                0 => &b"\n"[..],
                1 => b"\r",
                _ => b"\r\n",
            });
        }
    }
    out.extend_from_slice(match if rng.odd() { rng.below(3) } else { 3 } {
        0 => &b"\n"[..],
        1 => b"",
        2 => b"\r",
        _ => b"\r\n",
    });
    out
}

/// A chunked body.
fn chunked_body(rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::new();
    let mut ext_budget = 16 * 1024;
    for _ in 0..rng.range(0, 4) {
        let size = if rng.big(20) {
            rng.range(100, 20000)
        } else {
            rng.range(1, 40)
        };
        out.extend_from_slice(&chunk_size_line(rng, size as u64, &mut ext_budget));
        out.extend_from_slice(&body_bytes(rng, size));
        out.extend_from_slice(match if rng.odd() { rng.below(5) } else { 5 } {
            0 => &b"\n"[..],
            1 => b"\r",
            2 => b"",
            3 => b"\rX",
            4 => b"x\r\n",
            _ => b"\r\n",
        });
    }
    out.extend_from_slice(&chunk_size_line(rng, 0, &mut ext_budget));
    out.extend_from_slice(&trailers(rng));
    out
}

fn odd_field(rng: &mut Rng) -> Vec<u8> {
    if !rng.odd() {
        return rng
            .pick(&[
                &b"X-A: b"[..],
                b"Connection: keep-alive",
                b"Expect: 100-continue",
                b"Upgrade: websocket",
                b"X-Empty:",
                b"X: \x80\xff",
            ])
            .to_vec();
    }
    rng.pick(&[
        &b"X-A: b"[..],
        b"X-Folded: a\r\n b",
        b"X-Folded: a\n\tb",
        b"Bad Name: x",
        b"Content-Length : 3",
        b" Transfer-Encoding: chunked",
        b"X: \x80\xff",
        b"Connection: keep-alive",
        b"Expect: 100-continue",
        b"Upgrade: websocket",
        b"X-Empty:",
        b"X-Cr: a\rb",
    ])
    .to_vec()
}

/// One request (not ambiguous, unless `amb`, which is marked in its path).
fn request(rng: &mut Rng, index: usize) -> Vec<u8> {
    let mut out = Vec::new();
    if rng.chance(5) {
        out.extend_from_slice(rng.pick(&[&b"\r\n"[..], b"\n", b"\r\n\r\n", b"\n\r\n"]));
        if rng.odd() {
            out.push(b'\r');
        }
    }
    let method = if rng.chance(2) {
        "CONNECT"
    } else if rng.chance(3) {
        // Methods the guard's plain reading must leave to the parser, or take as hyper does.
        rng.pick(&["G(T", "get", "M-SEARCH", "GE\"T"])
    } else {
        rng.pick(&["GET", "POST", "PUT", "OPTIONS", "HEAD"])
    };
    let version = if rng.chance(8) { "HTTP/1.0" } else { "HTTP/1.1" };
    let mut target = if method == "CONNECT" {
        format!("r{index}.example:443").into_bytes()
    } else {
        format!("/r{index}").into_bytes()
    };
    if method != "CONNECT" && rng.chance(8) {
        // Bytes hyper's URI rules refuse in a path or a query, and some they take.
        target.extend_from_slice(rng.pick(&[
            &b"<x>"[..],
            b"?q=\"x\"",
            b"`",
            b"\xff",
            b"\x7f",
            b"{\"a\"}|b^c\\d",
            b"?a=`b`{c}",
            b"#frag",
            b"/caf\xc3\xa9",
        ]));
    }
    out.extend_from_slice(format!("{method} ").as_bytes());
    out.extend_from_slice(&target);
    out.extend_from_slice(format!(" {version}").as_bytes());
    out.extend_from_slice(line_end(rng));
    let mut fields: Vec<Vec<u8>> = vec![b"Host: x".to_vec()];
    if version == "HTTP/1.0" && rng.chance(70) {
        fields.push(b"Connection: keep-alive".to_vec());
    }
    let mut body = Vec::new();
    match rng.below(10) {
        0..=1 => {}
        2..=4 => {
            let len = if rng.big(20) {
                rng.range(8000, 70000)
            } else {
                rng.range(0, 60)
            };
            fields.push([b"Content-Length: ".to_vec(), cl_value(rng, len)].concat());
            if rng.chance(10) {
                let again = if rng.chance(70) {
                    len.to_string()
                } else {
                    format!("0{len}")
                };
                fields.push(format!("content-length: {again}").into_bytes());
            }
            body = body_bytes(rng, len);
        }
        _ => {
            fields.push([b"Transfer-Encoding: ".to_vec(), te_value(rng)].concat());
            if rng.chance(8) {
                let first = fields.len() - 1;
                let other = if rng.chance(50) {
                    b"gzip".to_vec()
                } else {
                    b"chunked".to_vec()
                };
                fields.insert(first, [b"transfer-encoding: ".to_vec(), other].concat());
            }
            body = chunked_body(rng);
        }
    }
    for _ in 0..rng.range(0, 2) {
        if rng.chance(30) {
            fields.push(odd_field(rng));
        }
    }
    if rng.chance(8) {
        // More fields than hyper is given room for: the guard folds them.
        for i in 0..rng.range(HYPER_FIELDS - 3, 300) {
            let value = match i % 5 {
                0 => format!("v{i}\t\u{e9} :{},", i % 7),
                _ => format!("v{i} {}", i % 7),
            };
            fields.push(format!("X-Many-{}: {value}", i % 37).into_bytes());
        }
    }
    if rng.big(10) {
        // A head near hyper's read buffer limit.
        let n = rng.range(LIMITS.bytes - 200, LIMITS.bytes + 100);
        fields.push([b"X-Big: ".to_vec(), vec![b'v'; n]].concat());
    }
    // Shuffle the fields.
    for i in (1..fields.len()).rev() {
        let j = rng.below(i + 1);
        fields.swap(i, j);
    }
    for field in fields {
        out.extend_from_slice(&field);
        out.extend_from_slice(line_end(rng));
    }
    out.extend_from_slice(line_end(rng));
    out.extend_from_slice(&body);
    out
}

fn canary(rng: &mut Rng) -> Vec<u8> {
    let both: [&[u8]; 2] = [b"Content-Length: 5", b"Transfer-Encoding: chunked"];
    let (a, b) = if rng.chance(50) {
        (both[0], both[1])
    } else {
        (both[1], both[0])
    };
    let mut out = format!("POST {CANARY_PATH} HTTP/1.1").into_bytes();
    for field in [&b"Host: c"[..], a, b] {
        out.extend_from_slice(line_end(rng));
        out.extend_from_slice(field);
    }
    out.extend_from_slice(b"\r\n\r\n0\r\n\r\n");
    out
}

/// Small random edits (rarely), so that the guard meets bytes no generator above writes.
fn mutate(rng: &mut Rng, bytes: &mut Vec<u8>) {
    if bytes.is_empty() || !rng.chance(rng.odd_percent / 2) {
        return;
    }
    for _ in 0..rng.range(1, 3) {
        let at = rng.below(bytes.len());
        let byte = rng.pick(&[b'\r', b'\n', b' ', b'\t', b';', b':', b'0', b'a', b'F', 0u8, 0x80]);
        match rng.below(3) {
            0 => bytes[at] = byte,
            1 => bytes.insert(at, byte),
            _ => {
                bytes.remove(at);
            }
        }
    }
}

/// A connection's bytes: requests, then the canary, then one more request.
fn connection_bytes(rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::new();
    for index in 0..rng.range(1, 5) {
        if rng.chance(1) {
            // HTTP/2's preface where a head is due.
            out.extend_from_slice(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        }
        let mut one = request(rng, index);
        mutate(rng, &mut one);
        out.extend_from_slice(&one);
    }
    out.extend_from_slice(&canary(rng));
    out.extend_from_slice(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n");
    out
}

/// Where the reads split `len` bytes, and whether the socket says Pending before each.
fn splits(rng: &mut Rng, len: usize) -> Vec<(usize, bool)> {
    let mut out = Vec::new();
    let mut left = len;
    let style = rng.below(4);
    while left > 0 {
        let n = match style {
            0 if len < 3000 => 1,
            0 | 1 if len < 12000 => rng.range(1, 16),
            0 | 1 => rng.range(1, 2000),
            2 => rng.range(1, 9000),
            _ => {
                if rng.chance(10) {
                    left
                } else {
                    rng.range(1, 200)
                }
            }
        }
        .min(left);
        out.push((n, rng.chance(60)));
        left -= n;
    }
    out
}

// ---------------------------------------------------------------------------------------
// A socket that delivers scripted reads

struct Scripted {
    pieces: VecDeque<(Vec<u8>, bool)>,
}

impl Scripted {
    fn new(bytes: &[u8], split: &[(usize, bool)]) -> Self {
        let mut pieces = VecDeque::new();
        let mut at = 0;
        for &(n, pending) in split {
            pieces.push_back((bytes[at..at + n].to_vec(), pending));
            at += n;
        }
        Scripted { pieces }
    }
}

impl AsyncRead for Scripted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let Some((piece, pending)) = self.pieces.front_mut() else {
            return Poll::Ready(Ok(())); // end of stream
        };
        if *pending {
            *pending = false;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let n = piece.len().min(out.remaining());
        out.put_slice(&piece[..n]);
        piece.drain(..n);
        if piece.is_empty() {
            self.pieces.pop_front();
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Scripted {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

// ---------------------------------------------------------------------------------------
// hyper, as floodgate configures it

#[derive(Debug, Clone, PartialEq, Eq)]
struct Served {
    method: String,
    path: String,
    both_headers: bool,
    /// Each field name with its values in order, by name.
    fields: Vec<(String, Vec<Vec<u8>>)>,
    /// The body read to its end, or `None` when reading it failed.
    body: Option<Vec<u8>>,
}

impl Served {
    fn ambiguous(&self) -> bool {
        self.both_headers || self.path.contains("canary") || self.path.contains("amb")
    }
}

/// What hyper serves of `io`, each request in flight on `connection` as floodgate's
/// service keeps it, until its response is made: `straight`, as the reference, with room
/// for heads of any size and for every field; else as floodgate configures hyper, the
/// fields the guard folded unfolded.
async fn serve<S>(io: S, connection: Arc<ConnectionState>, straight: bool, read_bodies: bool) -> Vec<Served>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let log = Arc::new(Mutex::new(Vec::new()));
    let seen = log.clone();
    let service = service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
        let seen = seen.clone();
        let in_flight = connection.begin();
        async move {
            let _in_flight = in_flight;
            let mut request = request;
            if !straight {
                fold::unfold(&mut request);
            }
            let (parts, body) = request.into_parts();
            let mut fields: Vec<_> = parts
                .headers
                .keys()
                .map(|name| {
                    let values = parts.headers.get_all(name).iter();
                    (name.to_string(), values.map(|v| v.as_bytes().to_vec()).collect())
                })
                .collect();
            fields.sort();
            let both_headers = parts.headers.contains_key(http::header::CONTENT_LENGTH)
                && parts.headers.contains_key(http::header::TRANSFER_ENCODING);
            // Unread, the body is drained by hyper if it can be at once, else the
            // connection closed.
            let body = if read_bodies {
                body.collect().await.ok().map(|b| b.to_bytes().to_vec())
            } else {
                drop(body);
                Some(b"unread".to_vec())
            };
            seen.lock().unwrap().push(Served {
                method: parts.method.to_string(),
                path: parts.uri.to_string(),
                both_headers,
                fields,
                body,
            });
            Ok::<_, Infallible>(hyper::Response::new(Empty::<Bytes>::new()))
        }
    });
    let mut builder = http1_builder();
    match straight {
        true => builder.max_buf_size(1 << 20).max_headers(LIMITS.fields),
        false => builder.max_buf_size(LIMITS.bytes),
    };
    let connection = builder
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    let _ = tokio::time::timeout(Duration::from_secs(10), connection).await;
    log.lock().unwrap().clone()
}

/// The heads a guard refused, in order.
#[derive(Default, Clone)]
struct Refusals(Arc<Mutex<Vec<HeadRefusal>>>);

impl AnswerRefusal for Refusals {
    fn answer(&self, refusal: HeadRefusal) -> Bytes {
        self.0.lock().unwrap().push(refusal);
        Bytes::from_static(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
    }
}

/// What hyper serves straight, what it serves through a guard, and what that guard refused.
struct Run {
    straight: Vec<Served>,
    guarded: Vec<Served>,
    refused: Vec<HeadRefusal>,
}

async fn run_case(bytes: &[u8], split: &[(usize, bool)], read_bodies: bool) -> Run {
    // The reference reads heads of any size: how much of a head over the limit hyper takes
    // depends on how its reads fall, which the guard changes.
    let straight = serve(
        Scripted::new(bytes, split),
        ConnectionState::new(),
        true,
        read_bodies,
    )
    .await;
    let refusals = Refusals::default();
    let connection = ConnectionState::new();
    let guarded = serve(
        FramingGuard::new(
            Scripted::new(bytes, split),
            LIMITS,
            connection.clone(),
            refusals.clone(),
        ),
        connection,
        false,
        read_bodies,
    )
    .await;
    let refused = refusals.0.lock().unwrap().clone();
    Run {
        straight,
        guarded,
        refused,
    }
}

/// What is wrong with the guarded run, if anything.
fn verdict(run: &Run) -> Option<String> {
    let (straight, guarded) = (&run.straight, &run.guarded);
    if let Some(bad) = guarded.iter().find(|s| s.ambiguous()) {
        return Some(format!("served through the guard: {bad:?}"));
    }
    if guarded.len() > straight.len() {
        return Some("more requests served through the guard than straight".into());
    }
    // A head refused as malformed is one hyper refuses too: it serves none after it.
    if run.refused.contains(&HeadRefusal::Malformed) && straight.len() != guarded.len() {
        return Some(format!(
            "the guard refused request {} as malformed; hyper served it",
            guarded.len()
        ));
    }
    for (i, (g, s)) in guarded.iter().zip(straight).enumerate() {
        let last = i + 1 == guarded.len();
        let same = g == s || (last && g.body.is_none() && (g.method == s.method && g.path == s.path));
        if !same {
            return Some(format!("request {i} differs: guard {g:?}, straight {s:?}"));
        }
    }
    None
}

fn literal(bytes: &[u8]) -> String {
    let mut out = String::from("b\"");
    for &b in bytes {
        match b {
            b'\r' => out.push_str("\\r"),
            b'\n' => out.push_str("\\n"),
            b'\t' => out.push_str("\\t"),
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            0x20..=0x7e => out.push(b as char),
            _ => out.push_str(&format!("\\x{b:02x}")),
        }
    }
    out.push('"');
    out
}

#[test]
fn the_guard_and_hyper_agree_on_random_connections() {
    let cases: u64 = std::env::var("FRAMING_DIFF_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let seed: u64 = std::env::var("FRAMING_DIFF_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let only: Option<u64> = std::env::var("FRAMING_DIFF_CASE")
        .ok()
        .and_then(|v| v.parse().ok());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (mut reached, mut lossless, mut failures) = (0u64, 0u64, Vec::new());
    let range = match only {
        Some(case) => case..case + 1,
        None => 0..cases,
    };
    let mut total = 0;
    for case in range {
        total += 1;
        let mut rng = Rng::new(seed.wrapping_mul(1_000_003).wrapping_add(case));
        let bytes = connection_bytes(&mut rng);
        let split = splits(&mut rng, bytes.len());
        let read_bodies = !rng.chance(20);
        let run = runtime.block_on(run_case(&bytes, &split, read_bodies));
        let (straight, guarded) = (&run.straight, &run.guarded);
        if straight.iter().any(|s| s.path == CANARY_PATH) {
            reached += 1;
            if guarded.len() + 1 == straight.iter().position(|s| s.path == CANARY_PATH).unwrap() + 1 {
                lossless += 1;
            }
        }
        if let Some(problem) = verdict(&run) {
            eprintln!("case {case} (seed {seed}): {problem}");
            if bytes.len() < 4000 {
                eprintln!("  input: {}", literal(&bytes));
            } else {
                eprintln!("  input: {} bytes", bytes.len());
            }
            eprintln!("  reads: {:?}", split.iter().map(|s| s.0).collect::<Vec<_>>());
            let short = |l: &[Served]| {
                l.iter()
                    .map(|s| {
                        format!(
                            "{} {} both={} body={:?}",
                            s.method,
                            s.path,
                            s.both_headers,
                            s.body.as_ref().map(|b| b.len())
                        )
                    })
                    .collect::<Vec<_>>()
            };
            eprintln!(
                "  straight: {:?}\n  guarded: {:?}\n  refused: {:?}",
                short(straight),
                short(guarded),
                run.refused
            );
            failures.push(case);
            if failures.len() >= 10 {
                break;
            }
        }
    }
    eprintln!(
        "framing_diff: {total} cases, canary reached by hyper straight in {reached}, \
         guard served all before it in {lossless}, failures {failures:?}"
    );
    assert!(failures.is_empty(), "failing cases {failures:?}");
}

/// Heads the guard stops following (longer than hyper's buffer, or HTTP/2's preface where
/// a head is due) are ones hyper refuses, whatever the reads.
#[test]
fn what_the_guard_stops_following_hyper_refuses() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let canary = b"POST /canary HTTP/1.1\r\nHost: c\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
    let mut inputs = Vec::new();
    for extra in [-300i64, -1, 0, 1, 2, 100, 8000, 30000] {
        let n = (LIMITS.bytes as i64 + extra) as usize;
        let mut big = b"GET /big HTTP/1.1\r\nHost: x\r\nX-Big: ".to_vec();
        big.extend(std::iter::repeat_n(b'v', n));
        big.extend_from_slice(b"\r\n\r\n");
        inputs.push(big);
    }
    inputs.push(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nPRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec());
    for first in inputs {
        let mut bytes = first.clone();
        bytes.extend_from_slice(canary);
        for cut in [
            LIMITS.bytes / 2,
            LIMITS.bytes - 1,
            LIMITS.bytes,
            LIMITS.bytes + 1,
            LIMITS.bytes + 2,
            first.len() - 1,
        ] {
            let cut = cut.min(bytes.len() - 1).max(1);
            for second in [61, 4096, bytes.len()] {
                let mut split = vec![(cut, false)];
                let mut at = cut;
                while at < bytes.len() {
                    let n = second.min(bytes.len() - at);
                    split.push((n, true));
                    at += n;
                }
                let run = runtime.block_on(run_case(&bytes, &split, true));
                assert_eq!(verdict(&run), None, "{} bytes, cut at {cut}", first.len());
            }
        }
    }
}
