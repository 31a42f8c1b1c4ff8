//! The real `floodgate` binary as a child process: a config written to a temporary
//! directory, ports read back from the "floodgate listening" log line, standard output and
//! error collected line by line, and the child killed on drop.

use std::fmt::Display;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::config::config_file;

/// The compiled binary under test.
pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_floodgate");

/// Environment variables the binary reads; cleared so that the caller's shell cannot leak in.
const FLOODGATE_ENV: [&str; 5] = [
    "FLOODGATE_ADMIN_TOKEN",
    "FLOODGATE_CONFIG",
    "FLOODGATE_LOG",
    "FLOODGATE_LOG_FORMAT",
    "FLOODGATE_REDIS_URL",
];

/// How long a started gateway may take to log that it listens.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// A `floodgate` command with a clean environment, `args` and `envs`, in `dir`.
pub(crate) fn command(dir: &Path, args: &[&str], envs: &[(&str, &str)]) -> Command {
    let mut command = Command::new(BIN);
    command.current_dir(dir).args(args);
    for name in FLOODGATE_ENV {
        command.env_remove(name);
    }
    command.envs(envs.iter().copied());
    command
}

/// Runs `floodgate` to completion; panics if it is still running after `timeout` (a
/// command that should fail at start-up but serves instead must not hang the test).
pub(crate) fn run(dir: &Path, args: &[&str], envs: &[(&str, &str)], timeout: Duration) -> Output {
    let mut child = command(dir, args, envs)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn floodgate");
    let stdout = drain(child.stdout.take().expect("piped"));
    let stderr = drain(child.stderr.take().expect("piped"));
    let status = wait_timeout(&mut child, timeout).unwrap_or_else(|| {
        let _ = child.kill();
        let _ = child.wait();
        panic!("floodgate {args:?} still running after {timeout:?}");
    });
    Output {
        status,
        stdout: stdout.join().expect("stdout reader"),
        stderr: stderr.join().expect("stderr reader"),
    }
}

fn drain(mut pipe: impl Read + Send + 'static) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut out = Vec::new();
        let _ = pipe.read_to_end(&mut out);
        out
    })
}

/// Polls `child` until it exits or `timeout` passes.
pub(crate) fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A running `floodgate` serving a config of the test's own.
pub(crate) struct FloodgateProcess {
    pub child: Child,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    /// The config file, inside `dir`.
    pub config: PathBuf,
    pub dir: TempDir,
    stdout: Lines,
    stderr: Lines,
    /// Set while standard output is not read ([`FloodgateProcess::hold_stdout`]).
    stdout_held: Arc<std::sync::atomic::AtomicBool>,
    /// The threads reading standard output and error, which end with the pipes.
    readers: [JoinHandle<()>; 2],
}

type Lines = Arc<Mutex<Vec<String>>>;

impl FloodgateProcess {
    /// Writes `toml` (a [`GatewayToml`](super::config::GatewayToml), or text with a
    /// `[server]` table of its own) to a temporary `gateway.toml` and runs
    /// `floodgate --config` on it with `envs`. Returns once the gateway logs that it
    /// listens; panics if it exits first.
    pub(crate) fn start(toml: impl Display, envs: &[(&str, &str)]) -> FloodgateProcess {
        let (dir, config) = config_file(toml);
        let config_arg = config.to_str().expect("utf-8 temp path").to_owned();
        let mut child = command(dir.path(), &["--config", &config_arg], envs)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn floodgate");
        let stdout_held = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (stdout, stdout_reader) = collect_lines(child.stdout.take().expect("piped"), stdout_held.clone());
        let (stderr, stderr_reader) = collect_lines(child.stderr.take().expect("piped"), Arc::default());

        let deadline = Instant::now() + START_TIMEOUT;
        let line = loop {
            if let Some(line) = stdout
                .lock()
                .unwrap()
                .iter()
                .find(|l| l.contains("floodgate listening"))
            {
                break line.clone();
            }
            if let Some(status) = child.try_wait().expect("try_wait") {
                // Let the readers catch the last lines before reporting them.
                std::thread::sleep(Duration::from_millis(50));
                panic!(
                    "floodgate exited with {status} before listening\nstdout:\n{}\nstderr:\n{}",
                    stdout.lock().unwrap().join("\n"),
                    stderr.lock().unwrap().join("\n")
                );
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                panic!("floodgate did not log \"floodgate listening\" within {START_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        // Colour codes are a bug of their own (pinned in tests/process.rs); read the ports anyway.
        let line = strip_ansi(&line);
        let listen = log_field(&line, "listen").unwrap_or_else(|| panic!("no listen= in {line:?}"));
        let admin = log_field(&line, "admin").unwrap_or_else(|| panic!("no admin= in {line:?}"));
        FloodgateProcess {
            child,
            listen: listen.parse().expect("listen address"),
            admin: admin.parse().expect("admin address"),
            config,
            dir,
            stdout,
            stderr,
            stdout_held,
            readers: [stdout_reader, stderr_reader],
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.listen, path)
    }

    pub(crate) fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    /// Standard output so far, one entry per line.
    pub(crate) fn stdout_lines(&self) -> Vec<String> {
        self.stdout.lock().unwrap().clone()
    }

    /// Stops reading standard output while the guard lives: once the pipe and the
    /// reader's buffer are full, the gateway's writes to it block.
    pub(crate) fn hold_stdout(&self) -> StdoutHeld<'_> {
        self.stdout_held.store(true, std::sync::atomic::Ordering::SeqCst);
        StdoutHeld(&self.stdout_held)
    }

    /// Standard error so far, one entry per line.
    pub(crate) fn stderr_lines(&self) -> Vec<String> {
        self.stderr.lock().unwrap().clone()
    }

    /// The first stdout line matching `predicate`, waiting up to `timeout` for it.
    pub(crate) fn wait_for_line(
        &self,
        timeout: Duration,
        predicate: impl Fn(&str) -> bool,
    ) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = self.stdout.lock().unwrap().iter().find(|l| predicate(l)) {
                return Some(line.clone());
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends `signal` (e.g. `libc::SIGTERM`) to the process.
    #[allow(unsafe_code)] // kill(2)
    pub(crate) fn signal(&self, signal: libc::c_int) {
        let pid = libc::pid_t::try_from(self.pid()).expect("pid fits pid_t");
        // SAFETY: kill(2) takes plain integers; the pid is our own child, not yet reaped.
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(
            rc,
            0,
            "kill({pid}, {signal}): {}",
            std::io::Error::last_os_error()
        );
    }

    /// Waits up to `timeout` for the process to exit.
    /// Waits for the gateway to exit, then (a few seconds at most) for its last lines to be
    /// read, so that what it wrote before exiting is in the lines.
    pub(crate) fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let status = wait_timeout(&mut self.child, timeout)?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.readers.iter().any(|reader| !reader.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        Some(status)
    }

    /// A `Key:   value` field of `/proc/PID/status`, in kB for the memory fields.
    pub(crate) fn proc_status_kb(&self, key: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("read status");
        status
            .lines()
            .find_map(|line| line.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in /proc/PID/status"))
    }

    /// The names (`comm`) of the process's threads.
    pub(crate) fn thread_names(&self) -> Vec<String> {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", self.pid())).expect("read task dir");
        tasks
            .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
            .map(|name| name.trim_end().to_owned())
            .collect()
    }
}

impl Drop for FloodgateProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What [`FloodgateProcess::hold_stdout`] gives: reading goes on when it is dropped.
pub(crate) struct StdoutHeld<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for StdoutHeld<'_> {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The lines of `pipe` as they come, read only while `held` is not set, and the thread
/// reading them (it ends with the pipe).
fn collect_lines(
    pipe: impl Read + Send + 'static,
    held: Arc<std::sync::atomic::AtomicBool>,
) -> (Lines, JoinHandle<()>) {
    let lines = Lines::default();
    let sink = lines.clone();
    let reader = std::thread::spawn(move || {
        let mut reader = BufReader::new(pipe);
        loop {
            while held.load(std::sync::atomic::Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => sink
                    .lock()
                    .unwrap()
                    .push(line.trim_end_matches(['\n', '\r']).to_owned()),
            }
        }
    });
    (lines, reader)
}

/// The value of `name` in a text (`name=value`) or JSON (`"name":"value"`) log line.
pub(crate) fn log_field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let text = format!(" {name}=");
    let json = format!("\"{name}\":\"");
    let start = line
        .find(&text)
        .map(|i| i + text.len())
        .or_else(|| line.find(&json).map(|i| i + json.len()))?;
    let rest = &line[start..];
    let end = rest.find([' ', '"']).unwrap_or(rest.len());
    Some(&rest[..end])
}

/// `line` without ANSI escape sequences (`ESC [ ... letter`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            chars
                .by_ref()
                .take_while(|c| !c.is_ascii_alphabetic())
                .for_each(drop);
        } else {
            out.push(c);
        }
    }
    out
}
