//! A private PHP-FPM per test (`php-fpm8.2 -F -R -y CONF`): a static pool on a free port
//! or a unix socket in a temporary directory, serving a site directory the test fills;
//! killed when dropped, and restartable on the same address.

use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the pool listens.
pub(crate) enum Listen {
    Tcp(u16),
    Unix(PathBuf),
}

pub(crate) struct PhpFpm {
    pub listen: Listen,
    child: Child,
    dir: tempfile::TempDir,
    site: tempfile::TempDir,
}

impl PhpFpm {
    /// A pool of `children` workers on a free TCP port.
    pub(crate) fn start(children: u32) -> PhpFpm {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        PhpFpm::start_listening(Listen::Tcp(port), children)
    }

    /// A pool of `children` workers on a unix socket.
    pub(crate) fn start_unix(children: u32) -> PhpFpm {
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("php-fpm.sock");
        let mut fpm = PhpFpm::start_listening(Listen::Unix(socket), children);
        // The socket's directory lives as long as the server.
        fpm.dir = dir;
        fpm
    }

    fn start_listening(listen: Listen, children: u32) -> PhpFpm {
        let dir = tempfile::tempdir().expect("temp dir");
        let site = tempfile::tempdir().expect("site dir");
        let address = match &listen {
            Listen::Tcp(port) => format!("127.0.0.1:{port}"),
            Listen::Unix(path) => path.display().to_string(),
        };
        let config = format!(
            "[global]\npid = {dir}/fpm.pid\nerror_log = {dir}/error.log\ndaemonize = no\n\n\
             [www]\nlisten = {address}\npm = static\npm.max_children = {children}\n\
             ping.path = /ping\nclear_env = no\nsecurity.limit_extensions = .php\n",
            dir = dir.path().display()
        );
        std::fs::write(dir.path().join("fpm.conf"), config).expect("fpm.conf");
        let child = spawn(dir.path(), &listen);
        PhpFpm {
            listen,
            child,
            dir,
            site,
        }
    }

    /// The site's directory: `root` for the gateway, as PHP-FPM sees it too.
    pub(crate) fn site(&self) -> &Path {
        self.site.path()
    }

    /// Writes `content` to `path` under the site.
    pub(crate) fn file(&self, path: &str, content: &str) {
        let full = self.site.path().join(path.trim_start_matches('/'));
        std::fs::create_dir_all(full.parent().expect("a parent")).expect("site directory");
        std::fs::write(full, content).expect("site file");
    }

    /// The upstream URL.
    pub(crate) fn url(&self) -> String {
        match &self.listen {
            Listen::Tcp(port) => format!("fastcgi://127.0.0.1:{port}"),
            Listen::Unix(path) => format!("fastcgi://{}", path.display()),
        }
    }

    /// Kills the server and starts it again on the same address.
    pub(crate) fn restart(&mut self) {
        self.kill();
        // The killed workers close the pool's socket as they go: until then a new master
        // could not bind it, and a probe would find the old one still listening.
        let deadline = Instant::now() + Duration::from_secs(10);
        while listening(&self.listen) {
            assert!(Instant::now() < deadline, "the killed PHP-FPM still listens");
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Listen::Unix(path) = &self.listen {
            let _ = std::fs::remove_file(path);
        }
        self.child = spawn(self.dir.path(), &self.listen);
    }

    /// Kills the master and its workers (a killed master leaves its workers running, still
    /// accepting on the pool's socket): the whole process group, which is the master's.
    #[allow(unsafe_code)] // kill(2)
    fn kill(&mut self) {
        if let Ok(group) = libc::pid_t::try_from(self.child.id()) {
            // SAFETY: kill(2) takes plain integers; the group is our own child's, not yet reaped.
            unsafe { libc::kill(-group, libc::SIGKILL) };
        }
        let _ = self.child.wait();
    }
}

fn spawn(dir: &Path, listen: &Listen) -> Child {
    let mut child = Command::new("php-fpm8.2")
        .process_group(0)
        .args(["-F", "-R", "-y"])
        .arg(dir.join("fpm.conf"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("php-fpm8.2 must be installed (apt-get install php8.2-fpm)");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !listening(listen) {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("php-fpm did not start");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn listening(listen: &Listen) -> bool {
    match listen {
        Listen::Tcp(port) => TcpStream::connect(("127.0.0.1", *port)).is_ok(),
        Listen::Unix(path) => UnixStream::connect(path).is_ok(),
    }
}

impl Drop for PhpFpm {
    fn drop(&mut self) {
        self.kill();
    }
}
