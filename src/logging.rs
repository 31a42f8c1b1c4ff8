//! Log setup: `FLOODGATE_LOG` is a tracing filter (default `info`), `FLOODGATE_LOG_FORMAT`
//! is `text` (default) or `json`. Logs go to standard output, as containers expect.
//!
//! The HTTP/2 library's own events are shown from `error` up unless the filter names
//! `h2`: it warns once per misbehaving connection (a rapid-reset client, say), so a flood
//! of such connections would flood the log with lines the operator can do nothing about.
//!
//! Access-log lines (target `access`) are buffered and written in blocks, as nginx's
//! `access_log ... buffer=` does, rather than with a `write(2)` per request. The buffer is written when it holds 32 KB, every 100 ms, and at exit
//! ([`flush`]); every other event (start-up, warnings, errors) is written at once, after
//! whatever access lines precede it, so the order of lines is kept.

use std::io::{IsTerminal as _, Write};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tracing::Metadata;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

/// Buffered access lines are written once they reach this size...
const FLUSH_AT: usize = 32 * 1024;
/// ...or at the next tick of this period (while the runtime gets to run the task).
const FLUSH_EVERY: Duration = Duration::from_millis(100);

/// Lines waiting to be written to standard output.
static PENDING: Mutex<Vec<u8>> = Mutex::new(Vec::new());

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
        "json" => builder.json().flatten_event(true).init(),
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
}
