//! A private `redis-server` per test: started on a free port in a temporary directory and
//! killed when dropped, so tests can stop, pause or restart it and run in parallel.
//! Self-contained, so that benches can include it too.

use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) struct RedisServer {
    pub port: u16,
    child: Child,
    dir: tempfile::TempDir,
    /// Arguments beyond port, bind, persistence and directory.
    extra: Vec<String>,
}

impl RedisServer {
    pub(crate) fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// Starts with extra `redis-server` arguments (`--requirepass`, ...). With
    /// `--tls-port`, pass `PORT` for the port: it becomes the TLS port and plain TCP is off.
    pub(crate) fn start_with(extra: &[&str]) -> RedisServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        RedisServer::start_on(port, extra)
    }

    /// Starts on `port` (which must be free), with extra arguments as in `start_with`.
    pub(crate) fn start_on(port: u16, extra: &[&str]) -> RedisServer {
        let dir = tempfile::tempdir().expect("temp dir");
        let extra: Vec<String> = extra
            .iter()
            .map(|a| a.replace("PORT", &port.to_string()))
            .collect();
        let child = spawn(port, dir.path(), &extra);
        RedisServer {
            port,
            child,
            dir,
            extra,
        }
    }

    /// The server's directory (for certificates and the like).
    pub(crate) fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Runs a redis-cli command against this server and returns its output.
    pub(crate) fn cli(&self, args: &[&str]) -> String {
        let output = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// How many times `command` (lower case) has run, as `INFO commandstats` counts it
    /// (commands a script runs included); 0 before its first run.
    pub(crate) fn command_calls(&self, command: &str) -> u64 {
        let prefix = format!("cmdstat_{command}:calls=");
        self.cli(&["info", "commandstats"])
            .lines()
            .find_map(|line| line.strip_prefix(prefix.as_str()))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |calls| calls.parse().expect("a call count"))
    }

    /// SIGSTOP: the server keeps its connections but answers nothing.
    pub(crate) fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`RedisServer::pause`].
    pub(crate) fn resume(&self) {
        self.signal("-CONT");
    }

    /// Kills the server (its data is gone).
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts a fresh server on the same port.
    pub(crate) fn restart(&mut self) {
        self.kill();
        self.child = spawn(self.port, self.dir.path(), &self.extra);
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal} failed");
    }
}

fn spawn(port: u16, dir: &Path, extra: &[String]) -> Child {
    let tls = extra.iter().any(|a| a == "--tls-port");
    let plain_port = if tls { "0".to_owned() } else { port.to_string() };
    let child = Command::new("redis-server")
        .args([
            "--port",
            &plain_port,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(dir)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server must be installed (apt-get install redis-server)");
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "redis-server did not start on port {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // A paused server must be woken to die promptly.
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
        self.kill();
    }
}
