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
//! request. The buffer is handed to a writer thread of its own when it holds 32 KB, every
//! 100 ms, and at exit ([`flush`]); every other event (start-up, warnings, errors) is
//! handed over at once, after whatever access lines precede it, so the order of lines is
//! kept. Only that thread writes to standard output, so a stdout that blocks (a stalled
//! log collector, a pipe nobody reads) blocks no request: lines wait for it, up to
//! [`MAX_BACKLOG`], and past that are dropped and counted
//! (`floodgate_log_lines_dropped_total`).

use std::io::{IsTerminal as _, Write};
use std::net::IpAddr;
use std::os::fd::AsFd as _;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, Once, OnceLock, PoisonError};

use prometheus_client::metrics::counter::Counter;
use rustix::event::{PollFd, PollFlags, Timespec};
use std::time::{Duration, SystemTime};

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

use crate::civil_time::{CivilTime, two_digits};
use crate::client_ip::push_ip_text;

/// Buffered access lines are written once they reach this size...
const FLUSH_AT: usize = 32 * 1024;
/// ...or at the next tick of this period (while the runtime gets to run the task).
const FLUSH_EVERY: Duration = Duration::from_millis(100);

/// The most bytes of lines kept waiting for standard output; lines past it are dropped.
const MAX_BACKLOG: usize = 4 * 1024 * 1024;
/// How long [`flush`] waits for the writer thread to write what waits.
const EXIT_WAIT: Duration = Duration::from_secs(2);

/// Lines waiting for the writer thread, and whether it is writing some.
struct Pending {
    lines: Vec<u8>,
    writing: bool,
}

static PENDING: Mutex<Pending> = Mutex::new(Pending {
    lines: Vec::new(),
    writing: false,
});
/// Wakes the writer thread when lines wait.
static LINES_WAIT: Condvar = Condvar::new();
static WRITER: Once = Once::new();
/// Lines dropped while standard output was blocked.
static DROPPED: OnceLock<Counter> = OnceLock::new();
/// How access lines are written, as [`init`] found the environment: not at all (the filter
/// leaves the `access` target out at `info`, or no subscriber was installed), as text, or
/// as JSON objects (`FLOODGATE_LOG_FORMAT=json`). The filter does not change while the
/// process runs, so it is asked once rather than at every request.
static ACCESS_LINES: AtomicU8 = AtomicU8::new(OFF);
const OFF: u8 = 0;
const TEXT: u8 = 1;
const JSON: u8 = 2;

fn lock_pending() -> MutexGuard<'static, Pending> {
    PENDING.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `floodgate_log_lines_dropped_total`: the lines dropped while standard output was
/// blocked.
pub(crate) fn dropped_lines() -> Counter {
    DROPPED.get_or_init(Counter::default).clone()
}

/// Whether `pending` has no room for another line; the line is then counted as dropped.
fn backlog_full(pending: &Pending) -> bool {
    let full = pending.lines.len() >= MAX_BACKLOG;
    if full {
        DROPPED.get_or_init(Counter::default).inc();
    }
    full
}

/// Writes out every waiting line: waits for the writer thread (at most [`EXIT_WAIT`],
/// standard output may be blocked for good), and writes what is left itself.
pub fn flush() {
    let deadline = std::time::Instant::now() + EXIT_WAIT;
    let mut pending = lock_pending();
    while WRITER.is_completed()
        && (pending.writing || !pending.lines.is_empty())
        && std::time::Instant::now() < deadline
    {
        LINES_WAIT.notify_one();
        drop(pending);
        std::thread::sleep(Duration::from_millis(5));
        pending = lock_pending();
    }
    let lines = std::mem::take(&mut pending.lines);
    drop(pending);
    // Without blocking (the writer thread may hold standard output, blocked for good):
    // what it has not taken by the deadline is lost.
    let mut done = 0;
    while done < lines.len() {
        done += write_while_writable(&lines[done..]);
        if done < lines.len() {
            if std::time::Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn write_out(lines: &[u8]) {
    if !lines.is_empty() {
        let mut stdout = std::io::stdout().lock();
        let _ = stdout.write_all(lines);
        let _ = stdout.flush();
    }
}

/// Writes the waiting lines as far as standard output takes them without blocking, and
/// hands the rest, if any, to the writer thread (started the first time; from then on it
/// writes everything, so that lines keep their order). A process with one worker thus
/// stays a single thread until its standard output first blocks.
fn write_soon() {
    let mut pending = lock_pending();
    // Decided under the lock: once the writer thread writes, nothing else does.
    if !WRITER.is_completed() && !pending.writing {
        let written = write_while_writable(&pending.lines);
        pending.lines.drain(..written);
        if pending.lines.is_empty() {
            return;
        }
    }
    drop(pending);
    WRITER.call_once(|| {
        let started = std::thread::Builder::new()
            .name("floodgate-log".to_owned())
            .spawn(write_waiting_lines);
        if let Err(error) = started {
            eprintln!("floodgate: cannot start the log writer: {error}");
        }
    });
    LINES_WAIT.notify_one();
}

/// Writes the front of `lines` to standard output while it has room for them, in pieces
/// no larger than a pipe's atomic write, each after `poll` says there is room (so that no
/// write blocks); returns how many bytes are done with (all of them when standard output
/// fails: they are lost, as a failed write's always were).
fn write_while_writable(lines: &[u8]) -> usize {
    /// `PIPE_BUF` on Linux: a pipe that polls writable takes this much at once.
    const PIECE: usize = 4096;
    let stdout = std::io::stdout();
    let fd = stdout.as_fd();
    let mut written = 0;
    while written < lines.len() {
        let mut ready = [PollFd::new(&fd, PollFlags::OUT)];
        let no_wait = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        match rustix::event::poll(&mut ready, Some(&no_wait)) {
            Ok(1) if ready[0].revents().contains(PollFlags::OUT) => {}
            Ok(_) => break,
            Err(_) => return lines.len(),
        }
        let piece = &lines[written..lines.len().min(written + PIECE)];
        match rustix::io::write(fd, piece) {
            Ok(n) => written += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => return lines.len(),
        }
    }
    written
}

/// The writer thread: writes lines as they wait, blocking on standard output as long as
/// it does without holding anyone else up.
fn write_waiting_lines() {
    let mut block = Vec::new();
    let mut pending = lock_pending();
    loop {
        while pending.lines.is_empty() {
            pending.writing = false;
            pending = LINES_WAIT.wait(pending).unwrap_or_else(PoisonError::into_inner);
        }
        pending.writing = true;
        // The emptied block goes back in, so that neither buffer is allocated again.
        std::mem::swap(&mut block, &mut pending.lines);
        drop(pending);
        write_out(&block);
        block.clear();
        pending = lock_pending();
    }
}

/// The writer of an event other than an access line: handed over at once, after the
/// access lines buffered before it.
pub struct LineWriter;

impl Write for LineWriter {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        let mut pending = lock_pending();
        if !backlog_full(&pending) {
            pending.lines.extend_from_slice(line);
        }
        drop(pending);
        write_soon();
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
        LineWriter
    }
}

/// Libraries whose own logs repeat what floodgate reports once, and the level they are
/// lowered to unless the filter names them: a client's HTTP/2 errors (warnings); each
/// failed connection to a Redis node and each failed recovery of a cluster client, which
/// logs errors several times a second while a cluster's seed node is down (floodgate's
/// store says when Redis or a node fails and when it answers again, and that it cannot
/// connect at most every 30 s).
const QUIET_LIBRARIES: [(&str, &str); 2] = [("h2", "error"), ("redis", "off")];

/// `spec` with each of [`QUIET_LIBRARIES`] lowered, unless it names that target itself.
fn with_quiet_libraries(spec: &str) -> String {
    if spec.trim().is_empty() {
        return spec.to_owned();
    }
    let mut quieted = spec.to_owned();
    for (library, level) in QUIET_LIBRARIES {
        let named = spec.split(',').any(|directive| {
            let target = directive.split(['=', '[']).next().unwrap_or("").trim();
            target == library
                || target
                    .strip_prefix(library)
                    .is_some_and(|rest| rest.starts_with("::"))
        });
        if !named {
            quieted.push_str(&format!(",{library}={level}"));
        }
    }
    quieted
}

/// Installs the global subscriber from the environment; [`flush_periodically`], run on the
/// runtime, writes buffered access lines out.
pub fn init() -> Result<(), String> {
    let spec = std::env::var("FLOODGATE_LOG").unwrap_or_else(|_| "info".to_owned());
    let filter = EnvFilter::try_new(with_quiet_libraries(&spec))
        .map_err(|e| format!("FLOODGATE_LOG={spec:?} is not a valid filter: {e}"))?;
    let format = std::env::var("FLOODGATE_LOG_FORMAT").unwrap_or_else(|_| "text".to_owned());
    // Colour only for a terminal: escape codes in a file, pipe or log collector would split
    // `key=value` pairs and break grep and parsers.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(Stdout)
        .with_ansi(std::io::stdout().is_terminal());
    let lines = match format.as_str() {
        "text" => {
            builder.init();
            TEXT
        }
        "json" => {
            builder.json().flatten_event(true).init();
            JSON
        }
        other => {
            return Err(format!(
                "FLOODGATE_LOG_FORMAT={other:?}: expected \"text\" or \"json\""
            ));
        }
    };
    if tracing::enabled!(target: "access", tracing::Level::INFO) {
        ACCESS_LINES.store(lines, Ordering::Relaxed);
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
        if !lock_pending().lines.is_empty() {
            write_soon();
        }
    }
}

/// Writes one access line, `fields` its fields in order, unless the filter leaves the
/// `access` target out at `info` ([`ACCESS_LINES`]). Formatted here, in the layout of the `tracing` formatter
/// (without colour), rather than as a `tracing` event: through the formatting layer a line
/// cost more instructions than proxying the request.
pub(crate) fn access(fields: impl FnOnce(&mut AccessLine<'_>)) {
    let lines = ACCESS_LINES.load(Ordering::Relaxed);
    if lines == OFF {
        return;
    }
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let mut pending = lock_pending();
    if backlog_full(&pending) {
        return;
    }
    let mut line = AccessLine {
        out: &mut pending.lines,
        json: lines == JSON,
    };
    // Nothing in between can panic: a line is always whole.
    line.open(now);
    fields(&mut line);
    line.close();
    if pending.lines.len() >= FLUSH_AT && !pending.writing {
        drop(pending);
        write_soon();
    }
}

/// What a quoted value holds as it is: printable ASCII but the quote and the backslash.
static PLAIN: [bool; 256] = byte_set!(|b| b >= b' ' && b <= b'~' && b != b'"' && b != b'\\');
/// What an unquoted text value holds: the same, but for the space.
static BARE: [bool; 256] = byte_set!(|b| b > b' ' && b <= b'~' && b != b'"' && b != b'\\');

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

    /// A text as it is in text lines (as `tracing` writes a `Display` value), unless it
    /// holds a space, a quote, a backslash or anything but printable ASCII (a path that
    /// could not be normalized, say): then quoted, so that it cannot pass for other
    /// fields; a JSON string.
    #[inline(always)]
    pub(crate) fn plain(&mut self, key: &str, value: &str) {
        self.key(key);
        if !self.json && value.bytes().all(|b| BARE[usize::from(b)]) {
            self.out.extend_from_slice(value.as_bytes());
        } else {
            self.string(value);
        }
    }

    /// A token (a method, hex digits: nothing [`Self::plain`] would quote), as it is in
    /// text lines; a JSON string.
    #[inline(always)]
    pub(crate) fn token(&mut self, key: &str, value: &str) {
        debug_assert!(value.bytes().all(|b| BARE[usize::from(b)]), "{value:?}");
        self.key(key);
        if self.json {
            self.in_quotes(value);
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
            self.in_quotes(value);
        } else if self.json {
            self.json_string(value);
        } else {
            let _ = write!(self.out, "{value:?}");
        }
    }

    /// `value` as a JSON string that is one line by any reader's rule: besides what JSON
    /// requires, the C1 controls and DEL, the Unicode line and paragraph separators and
    /// the bidirectional controls are escaped, as the text format's quoting escapes them.
    fn json_string(&mut self, value: &str) {
        self.out.push(b'"');
        let mut plain = 0;
        for (at, c) in value.char_indices() {
            let escape = match c {
                '"' => Some("\\\""),
                '\\' => Some("\\\\"),
                '\n' => Some("\\n"),
                '\r' => Some("\\r"),
                '\t' => Some("\\t"),
                _ => None,
            };
            let hex = c.is_control()
                || matches!(c, '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
            if escape.is_none() && !hex {
                continue;
            }
            self.out.extend_from_slice(&value.as_bytes()[plain..at]);
            plain = at + c.len_utf8();
            match escape {
                Some(text) => self.out.extend_from_slice(text.as_bytes()),
                None => {
                    let _ = write!(self.out, "\\u{:04x}", u32::from(c));
                }
            }
        }
        self.out.extend_from_slice(&value.as_bytes()[plain..]);
        self.out.push(b'"');
    }

    /// `value`, which needs no escaping, in quotes.
    fn in_quotes(&mut self, value: &str) {
        self.out.push(b'"');
        self.out.extend_from_slice(value.as_bytes());
        self.out.push(b'"');
    }

    /// An address, written as its text (in quotes in JSON).
    #[inline(always)]
    pub(crate) fn ip(&mut self, key: &str, ip: IpAddr) {
        self.key(key);
        if self.json {
            self.out.push(b'"');
        }
        push_ip_text(ip, |piece| self.out.extend_from_slice(piece.as_bytes()));
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
        let whole = value.as_millis();
        let mut digits = itoa::Buffer::new();
        // In 64 bits unless it is half a billion years.
        let whole = match u64::try_from(whole) {
            Ok(whole) => digits.format(whole),
            Err(_) => digits.format(whole),
        };
        self.out.extend_from_slice(whole.as_bytes());
        let fraction = digits.format(value.subsec_nanos() % 1_000_000 + 1_000_000);
        self.out.push(b'.');
        self.out.extend_from_slice(&fraction.as_bytes()[1..]);
    }
}

/// Logs at most once a minute: failures a client or a dead Redis can repeat must not
/// flood the log.
#[derive(Default)]
pub(crate) struct LogThrottle(Mutex<Option<std::time::Instant>>);

impl LogThrottle {
    /// Whether to log now.
    pub(crate) fn ready(&self) -> bool {
        let mut last = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let ready = last.is_none_or(|at| at.elapsed() >= Duration::from_secs(60));
        if ready {
            *last = Some(std::time::Instant::now());
        }
        ready
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h2_and_redis_are_quiet_unless_named() {
        assert_eq!(with_quiet_libraries("info"), "info,h2=error,redis=off");
        assert_eq!(
            with_quiet_libraries("warn,access=info"),
            "warn,access=info,h2=error,redis=off"
        );
        assert_eq!(with_quiet_libraries("debug,h2=debug"), "debug,h2=debug,redis=off");
        assert_eq!(
            with_quiet_libraries("h2::proto=trace"),
            "h2::proto=trace,redis=off"
        );
        assert_eq!(
            with_quiet_libraries("redis::cluster=warn"),
            "redis::cluster=warn,h2=error"
        );
        assert_eq!(
            with_quiet_libraries("h2c_thing=info,redisish=info"),
            "h2c_thing=info,redisish=info,h2=error,redis=off"
        );
        assert_eq!(with_quiet_libraries(""), "");
        assert!(EnvFilter::try_new(with_quiet_libraries("info")).is_ok());
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
            line.token("method", "GET");
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

    /// An access line's fields but the durations.
    struct Fields<'a> {
        path: &'a str,
        route: &'a str,
        client_ip: &'a str,
        request_id: Option<&'a str>,
        upstream_server: Option<&'a str>,
    }

    const TIME: &str = "2026-11-27T15:27:08.278541Z";

    /// The line that `tracing-subscriber`'s formatter writes for `fields` as the `access`
    /// event they once were.
    fn formatted_by_tracing(json: bool, fields: &Fields<'_>) -> String {
        use tracing_subscriber::fmt::format::Writer;
        use tracing_subscriber::fmt::time::FormatTime;
        struct At;
        impl FormatTime for At {
            fn format_time(&self, w: &mut Writer<'_>) -> std::fmt::Result {
                w.write_str(TIME)
            }
        }
        #[derive(Clone, Default)]
        struct Lines(std::sync::Arc<Mutex<Vec<u8>>>);
        impl Write for Lines {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let lines = Lines::default();
        let writer = lines.clone();
        let builder = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_timer(At);
        let event = || {
            let client_ip: IpAddr = fields.client_ip.parse().unwrap();
            tracing::info!(
                target: "access",
                method = %"GET",
                path = %fields.path,
                route = %fields.route,
                status = 200,
                client_ip = %client_ip,
                bytes = 12,
                limit = "allowed",
                request_id = fields.request_id,
                trace_id = %"0af7651916cd43dd8448eb211c80319c",
                upstream_server = fields.upstream_server,
            );
        };
        if json {
            tracing::subscriber::with_default(builder.json().flatten_event(true).finish(), event);
        } else {
            tracing::subscriber::with_default(builder.finish(), event);
        }
        String::from_utf8(lines.0.lock().unwrap().clone()).unwrap()
    }

    fn written_here(json: bool, fields: &Fields<'_>) -> String {
        let now = Duration::new(1_795_793_228, 278_541_999);
        let mut out = Vec::new();
        let mut line = AccessLine { out: &mut out, json };
        line.open(now);
        line.token("method", "GET");
        line.plain("path", fields.path);
        line.plain("route", fields.route);
        line.number("status", 200);
        line.ip("client_ip", fields.client_ip.parse().unwrap());
        line.number("bytes", 12);
        line.quoted("limit", "allowed");
        if let Some(id) = fields.request_id {
            line.quoted("request_id", id);
        }
        line.token("trace_id", "0af7651916cd43dd8448eb211c80319c");
        if let Some(server) = fields.upstream_server {
            line.quoted("upstream_server", server);
        }
        line.close();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn access_lines_are_what_the_tracing_formatter_wrote() {
        let visible: String = (b'!'..=b'~').map(char::from).collect();
        let plain = Fields {
            path: "/items/a%20b",
            route: "app",
            client_ip: "127.0.0.1",
            request_id: Some("abc-123"),
            upstream_server: Some("127.0.0.1:8080"),
        };
        let cases = [
            Fields { ..plain },
            Fields {
                route: "",
                request_id: None,
                upstream_server: None,
                ..plain
            },
            Fields {
                client_ip: "2001:db8::1",
                request_id: Some(&visible),
                // DEL and the like aside: JSON lines escape more than the formatter does
                // (`a_text_that_could_pass_for_other_fields_is_quoted`).
                upstream_server: Some("/run/php/caf\u{e9} \"x\"\\\u{1}\n.sock"),
                ..plain
            },
        ];
        for fields in &cases {
            for json in [false, true] {
                assert_eq!(written_here(json, fields), formatted_by_tracing(json, fields));
            }
        }
    }

    #[test]
    fn a_text_that_could_pass_for_other_fields_is_quoted() {
        for path in [
            "x\" route=admin",
            "/a b",
            "/caf\u{e9}",
            "/\u{2028}",
            "/back\\slash",
            "/nel\u{85}x",
            "/ps\u{2029}x",
            "/csi\u{9b}31m",
            "/rlo\u{202e}x",
            "/del\u{7f}x",
        ] {
            let fields = Fields {
                path,
                route: "app",
                client_ip: "127.0.0.1",
                request_id: None,
                upstream_server: None,
            };
            let text = written_here(false, &fields);
            assert!(text.contains(&format!(" path={path:?} route=app ")), "{text}");
            let line = written_here(true, &fields);
            // One line by any reader's rule, and no control that could restyle a terminal.
            assert_eq!(line.lines().count(), 1, "{line:?}");
            assert!(
                !line.trim_end().chars().any(|c| c.is_control()
                    || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')),
                "{line:?}"
            );
            let json: serde_json::Value = serde_json::from_str(&line).unwrap();
            assert_eq!(json["path"], path);
        }
        let ip = written_here(
            true,
            &Fields {
                path: "/",
                route: "",
                client_ip: "2001:db8::1",
                request_id: None,
                upstream_server: None,
            },
        );
        assert!(ip.contains(",\"client_ip\":\"2001:db8::1\","), "{ip}");
    }

    #[test]
    fn milliseconds_are_written_to_the_nanosecond() {
        for (duration, written) in [
            (Duration::ZERO, "0.000000"),
            (Duration::from_nanos(1), "0.000001"),
            (Duration::from_nanos(999_999), "0.999999"),
            (Duration::from_millis(1_234), "1234.000000"),
            (Duration::MAX, "18446744073709551615999.999999"),
        ] {
            let (text, _) = lines(Duration::ZERO, |line| line.millis("d", duration));
            assert!(text.ends_with(&format!(" d={written}\n")), "{text}");
        }
    }
}
