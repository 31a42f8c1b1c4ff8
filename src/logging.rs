//! Log setup: `FLOODGATE_LOG` is a tracing filter (default `info`), `FLOODGATE_LOG_FORMAT`
//! is `text` (default) or `json`. Logs go to standard output, as containers expect.
//!
//! The HTTP/2 library's own events are shown from `error` up unless the filter names
//! `h2`: it warns once per misbehaving connection (a rapid-reset client, say), so a flood
//! of such connections would flood the log with lines the operator can do nothing about.
//!
//! Access-log lines (target `access`, [`access`]) are formatted here, in the layout the
//! `tracing` formatter gives every other event, straight into a buffer that is written in
//! blocks, as nginx's `access_log ... buffer=` does, rather than with a `write(2)` per
//! request. The buffer is written when it holds 32 KB, every 100 ms, and at exit
//! ([`flush`]); every other event (start-up, warnings, errors) is written at once, after
//! whatever access lines precede it, so the order of lines is kept.

use std::io::{IsTerminal as _, Write};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use tracing::Metadata;

use crate::civil_time::{CivilTime, two_digits};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

/// Buffered access lines are written once they reach this size...
const FLUSH_AT: usize = 32 * 1024;
/// ...or at the next tick of this period (while the runtime gets to run the task).
const FLUSH_EVERY: Duration = Duration::from_millis(100);

/// Lines waiting to be written to standard output.
static PENDING: Mutex<Vec<u8>> = Mutex::new(Vec::new());
/// Whether lines are JSON objects (`FLOODGATE_LOG_FORMAT=json`) rather than text.
static JSON: AtomicBool = AtomicBool::new(false);

fn pending() -> MutexGuard<'static, Vec<u8>> {
    PENDING.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Writes out every buffered line.
pub fn flush() {
    let mut pending = pending();
    write_out(&mut pending);
}

fn write_out(pending: &mut Vec<u8>) {
    if !pending.is_empty() {
        let mut stdout = std::io::stdout().lock();
        let _ = stdout.write_all(pending);
        let _ = stdout.flush();
        pending.clear();
    }
}

/// The writer for one event: buffered for access lines, immediate (after the buffer) for
/// the others.
pub struct LineWriter {
    buffered: bool,
}

impl Write for LineWriter {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        let mut pending = pending();
        pending.extend_from_slice(line);
        if !self.buffered || pending.len() >= FLUSH_AT {
            write_out(&mut pending);
        }
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

struct Stdout;

impl<'a> MakeWriter<'a> for Stdout {
    type Writer = LineWriter;

    fn make_writer(&'a self) -> LineWriter {
        LineWriter { buffered: false }
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> LineWriter {
        LineWriter {
            buffered: meta.target() == "access",
        }
    }
}

/// `spec` with the `h2` target lowered to `error`, unless it names that target itself.
fn with_quiet_h2(spec: &str) -> String {
    let names_h2 = spec.split(',').any(|directive| {
        let target = directive.split(['=', '[']).next().unwrap_or("").trim();
        target == "h2" || target.starts_with("h2::")
    });
    if names_h2 || spec.trim().is_empty() {
        spec.to_owned()
    } else {
        format!("{spec},h2=error")
    }
}

/// Installs the global subscriber from the environment; [`flush_periodically`], run on the
/// runtime, writes buffered access lines out.
pub fn init() -> Result<(), String> {
    let spec = std::env::var("FLOODGATE_LOG").unwrap_or_else(|_| "info".to_owned());
    let filter = EnvFilter::try_new(with_quiet_h2(&spec))
        .map_err(|e| format!("FLOODGATE_LOG={spec:?} is not a valid filter: {e}"))?;
    let format = std::env::var("FLOODGATE_LOG_FORMAT").unwrap_or_else(|_| "text".to_owned());
    // Colour only for a terminal: escape codes in a file, pipe or log collector would split
    // `key=value` pairs and break grep and parsers.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(Stdout)
        .with_ansi(std::io::stdout().is_terminal());
    match format.as_str() {
        "text" => builder.init(),
        "json" => {
            JSON.store(true, Ordering::Relaxed);
            builder.json().flatten_event(true).init();
        }
        other => {
            return Err(format!(
                "FLOODGATE_LOG_FORMAT={other:?}: expected \"text\" or \"json\""
            ));
        }
    }
    Ok(())
}

/// Writes buffered access lines out every [`FLUSH_EVERY`], on the runtime rather than on a
/// thread of its own: with one worker the process then serves on one thread (blocking-pool
/// threads come and go for file reads and reloads), and in a single-threaded process each
/// socket call is cheaper (glibc and the kernel take their single-threaded fast paths).
/// While the runtime is blocked, buffered lines wait; they are written at exit
/// ([`flush`]) in any case.
pub async fn flush_periodically() {
    let mut ticks = tokio::time::interval(FLUSH_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        flush();
    }
}

/// Writes one access line, `fields` its fields in order, unless the filter leaves the
/// `access` target out at `info` (the filter's field directives do not apply to it).
/// Formatted here rather than as a `tracing` event: through the formatting layer a line
/// cost more instructions than proxying the request.
pub(crate) fn access(fields: impl FnOnce(&mut AccessLine<'_>)) {
    if !tracing::enabled!(target: "access", tracing::Level::INFO) {
        return;
    }
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let mut pending = pending();
    let mut line = AccessLine {
        out: &mut pending,
        json: JSON.load(Ordering::Relaxed),
    };
    line.open(now);
    fields(&mut line);
    line.close();
    if pending.len() >= FLUSH_AT {
        write_out(&mut pending);
    }
}

/// What a quoted value holds as it is: printable ASCII but the quote and the backslash.
static PLAIN: [bool; 256] = byte_set!(|b| b >= b' ' && b <= b'~' && b != b'"' && b != b'\\');

/// An access line being written: `key=value` pairs after the time, level and target (text),
/// or the members of one JSON object.
pub(crate) struct AccessLine<'a> {
    out: &'a mut Vec<u8>,
    json: bool,
}

impl AccessLine<'_> {
    /// `2026-11-27T15:20:28.278541Z  INFO access:`, or the object's first members.
    fn open(&mut self, now: Duration) {
        let time = CivilTime::of(now.as_secs());
        let mut stamp = *b"1970-01-01T00:00:00.000000Z";
        stamp[0..2].copy_from_slice(&two_digits(time.year / 100));
        stamp[2..4].copy_from_slice(&two_digits(time.year));
        stamp[5..7].copy_from_slice(&two_digits(time.month));
        stamp[8..10].copy_from_slice(&two_digits(time.day));
        stamp[11..13].copy_from_slice(&two_digits(time.hour));
        stamp[14..16].copy_from_slice(&two_digits(time.minute));
        stamp[17..19].copy_from_slice(&two_digits(time.second));
        let micros = u64::from(now.subsec_micros());
        for (i, pair) in stamp[20..26].chunks_exact_mut(2).enumerate() {
            pair.copy_from_slice(&two_digits(micros / [10_000, 100, 1][i]));
        }
        if self.json {
            self.out.extend_from_slice(b"{\"timestamp\":\"");
            self.out.extend_from_slice(&stamp);
            self.out.extend_from_slice(b"\",\"level\":\"INFO\"");
        } else {
            self.out.extend_from_slice(&stamp);
            self.out.extend_from_slice(b"  INFO access:");
        }
    }

    fn close(&mut self) {
        if self.json {
            self.out.extend_from_slice(b",\"target\":\"access\"}\n");
        } else {
            self.out.push(b'\n');
        }
    }

    #[inline(always)]
    fn key(&mut self, key: &str) {
        if self.json {
            self.out.extend_from_slice(b",\"");
            self.out.extend_from_slice(key.as_bytes());
            self.out.extend_from_slice(b"\":");
        } else {
            self.out.push(b' ');
            self.out.extend_from_slice(key.as_bytes());
            self.out.push(b'=');
        }
    }

    /// A text as it is in text lines (as `tracing` writes a `Display` value), a JSON string.
    #[inline(always)]
    pub(crate) fn plain(&mut self, key: &str, value: &str) {
        self.key(key);
        if self.json {
            self.string(value);
        } else {
            self.out.extend_from_slice(value.as_bytes());
        }
    }

    /// A text quoted and escaped (as `tracing` writes a `&str`), a JSON string.
    #[inline(always)]
    pub(crate) fn quoted(&mut self, key: &str, value: &str) {
        self.key(key);
        self.string(value);
    }

    /// `value` in quotes: escaped as Rust's `Debug` does in text lines, as JSON does in
    /// JSON ones (the two agree on printable ASCII, which is what values hold).
    fn string(&mut self, value: &str) {
        if value.bytes().all(|b| PLAIN[usize::from(b)]) {
            self.out.push(b'"');
            self.out.extend_from_slice(value.as_bytes());
            self.out.push(b'"');
        } else if self.json {
            let _ = serde_json::to_writer(&mut *self.out, value);
        } else {
            let _ = write!(self.out, "{value:?}");
        }
    }

    /// An address, written as its text (in quotes in JSON).
    #[inline(always)]
    pub(crate) fn ip(&mut self, key: &str, ip: IpAddr) {
        self.key(key);
        if self.json {
            self.out.push(b'"');
        }
        match ip {
            IpAddr::V4(v4) => {
                let mut digits = itoa::Buffer::new();
                for (i, octet) in v4.octets().into_iter().enumerate() {
                    if i > 0 {
                        self.out.push(b'.');
                    }
                    self.out.extend_from_slice(digits.format(octet).as_bytes());
                }
            }
            IpAddr::V6(v6) => {
                let _ = write!(self.out, "{v6}");
            }
        }
        if self.json {
            self.out.push(b'"');
        }
    }

    #[inline(always)]
    pub(crate) fn number(&mut self, key: &str, value: u64) {
        self.key(key);
        self.out
            .extend_from_slice(itoa::Buffer::new().format(value).as_bytes());
    }

    /// A duration in milliseconds, to the nanosecond (`0.054742`).
    #[inline(always)]
    pub(crate) fn millis(&mut self, key: &str, value: Duration) {
        self.key(key);
        let nanos = value.subsec_nanos();
        let whole = value
            .as_secs()
            .saturating_mul(1_000)
            .saturating_add(u64::from(nanos / 1_000_000));
        let mut digits = itoa::Buffer::new();
        self.out.extend_from_slice(digits.format(whole).as_bytes());
        let fraction = digits.format(nanos % 1_000_000 + 1_000_000);
        self.out.push(b'.');
        self.out.extend_from_slice(&fraction.as_bytes()[1..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h2_is_quiet_unless_named() {
        assert_eq!(with_quiet_h2("info"), "info,h2=error");
        assert_eq!(with_quiet_h2("warn,access=info"), "warn,access=info,h2=error");
        assert_eq!(with_quiet_h2("debug,h2=debug"), "debug,h2=debug");
        assert_eq!(with_quiet_h2("h2::proto=trace"), "h2::proto=trace");
        assert_eq!(with_quiet_h2("h2c_thing=info"), "h2c_thing=info,h2=error");
        assert!(EnvFilter::try_new(with_quiet_h2("info")).is_ok());
    }

    /// One line of each format, with `fields` written at `now`.
    fn lines(now: Duration, fields: impl Fn(&mut AccessLine<'_>)) -> (String, String) {
        let line = |json| {
            let mut out = Vec::new();
            let mut line = AccessLine { out: &mut out, json };
            line.open(now);
            fields(&mut line);
            line.close();
            String::from_utf8(out).unwrap()
        };
        (line(false), line(true))
    }

    #[test]
    fn access_lines_have_the_layout_of_other_events() {
        let now = Duration::new(1_795_793_228, 278_541_999);
        let (text, json) = lines(now, |line| {
            line.plain("method", "GET");
            line.plain("route", "");
            line.number("status", 200);
            line.millis("duration_ms", Duration::from_nanos(54_742_001));
            line.ip("client_ip", "127.0.0.1".parse().unwrap());
            line.quoted("limit", "none");
        });
        assert_eq!(
            text,
            "2026-11-27T15:27:08.278541Z  INFO access: method=GET route= status=200 \
             duration_ms=54.742001 client_ip=127.0.0.1 limit=\"none\"\n"
        );
        assert_eq!(
            json,
            "{\"timestamp\":\"2026-11-27T15:27:08.278541Z\",\"level\":\"INFO\",\"method\":\"GET\",\
             \"route\":\"\",\"status\":200,\"duration_ms\":54.742001,\"client_ip\":\"127.0.0.1\",\
             \"limit\":\"none\",\"target\":\"access\"}\n"
        );
        // Dates from 1970 to the end of 9999.
        assert!(
            lines(Duration::ZERO, |_| {})
                .0
                .starts_with("1970-01-01T00:00:00.000000Z  INFO")
        );
        assert!(
            lines(Duration::new(253_402_300_799, 999_999_999), |_| {})
                .0
                .starts_with("9999-12-31T23:59:59.999999Z")
        );
    }

    #[test]
    fn values_are_escaped_as_the_tracing_formatters_escape_them() {
        for value in [
            "plain",
            "a\"b",
            "back\\slash",
            "line\nbreak\ttab\u{7f}",
            "café €",
            "",
        ] {
            let (text, json) = lines(Duration::ZERO, |line| {
                line.quoted("q", value);
                line.plain("p", value);
            });
            assert!(text.contains(&format!(" q={value:?} ")), "{text}");
            let event: serde_json::Value = serde_json::from_str(&json).unwrap();
            assert_eq!((&event["q"], &event["p"]), (&value.into(), &value.into()));
        }
        let (text, json) = lines(Duration::ZERO, |line| {
            line.ip("ip", "2001:db8::1".parse().unwrap())
        });
        assert!(text.ends_with(" ip=2001:db8::1\n"), "{text}");
        assert!(json.contains(",\"ip\":\"2001:db8::1\","), "{json}");
    }

    #[test]
    fn milliseconds_are_written_to_the_nanosecond() {
        for (duration, written) in [
            (Duration::ZERO, "0.000000"),
            (Duration::from_nanos(1), "0.000001"),
            (Duration::from_nanos(999_999), "0.999999"),
            (Duration::from_millis(1_234), "1234.000000"),
            (Duration::MAX, "18446744073709551615.999999"),
        ] {
            let (text, _) = lines(Duration::ZERO, |line| line.millis("d", duration));
            assert!(text.ends_with(&format!(" d={written}\n")), "{text}");
        }
    }
}
