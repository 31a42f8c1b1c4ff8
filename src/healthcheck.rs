//! `floodgate healthcheck`: asks a running gateway's admin listener for `GET /healthz` and
//! reports healthy (200) or not, so that a container image needs no curl for its
//! `HEALTHCHECK`. A plain blocking `std` socket with one deadline: the probe starts no
//! runtime and needs nothing from the request path.
//!
//! The admin address is read from the configuration file leniently (only
//! `[server].admin_listen`, with the same default and syntax as [`crate::Config`]): a file
//! edited into something invalid does not make a running gateway unhealthy, since that
//! gateway keeps serving its previous configuration (reload keeps the old one).

use std::io::{Read as _, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::config::DEFAULT_ADMIN_LISTEN;

/// The longest status line read before the answer is called malformed.
const MAX_HEAD: usize = 1024;

/// Why the gateway is not known to be healthy.
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    #[error("{path}: cannot read the file: {source}")]
    ReadConfig { path: String, source: std::io::Error },
    #[error("{path}: {message}")]
    Config { path: String, message: String },
    #[error("cannot connect to the admin listener at {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("no answer from the admin listener at {addr} within {timeout:?}")]
    Timeout { addr: SocketAddr, timeout: Duration },
    #[error("talking to the admin listener at {addr}: {source}")]
    Io {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("GET http://{addr}/healthz answered {status}")]
    Status { addr: SocketAddr, status: u16 },
    #[error("GET http://{addr}/healthz: not an HTTP answer: {head:?}")]
    Malformed { addr: SocketAddr, head: String },
}

/// The admin address configured in the file at `path` (`[server].admin_listen`, default
/// `127.0.0.1:9901`). Only that key is read; the rest of the file may be anything TOML.
pub fn admin_listen(path: &Path) -> Result<SocketAddr, HealthError> {
    let text = std::fs::read_to_string(path).map_err(|source| HealthError::ReadConfig {
        path: path.display().to_string(),
        source,
    })?;
    admin_listen_in(&text).map_err(|message| HealthError::Config {
        path: path.display().to_string(),
        message,
    })
}

/// [`admin_listen`] on the file's text.
pub fn admin_listen_in(text: &str) -> Result<SocketAddr, String> {
    let table: toml::Table = toml::from_str(text).map_err(|e| e.message().to_owned())?;
    let value = table
        .get("server")
        .and_then(|server| server.as_table())
        .and_then(|server| server.get("admin_listen"));
    match value {
        None => Ok(DEFAULT_ADMIN_LISTEN),
        Some(toml::Value::String(text)) => text.trim().parse().map_err(|_| {
            format!("server.admin_listen: expected an address such as \"127.0.0.1:9901\", got {text:?}")
        }),
        Some(other) => Err(format!(
            "server.admin_listen: expected a string, got {}",
            other.type_str()
        )),
    }
}

/// Where to probe a listener bound to `listen`: the loopback address of the same family
/// when it binds every address (`0.0.0.0`, `[::]`), else `listen` itself.
pub fn probe_address(listen: SocketAddr) -> SocketAddr {
    match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), listen.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), listen.port()),
        _ => listen,
    }
}

/// `GET /healthz` on `addr`; `Ok` on a 200 answer, all of it within `timeout`.
pub fn probe(addr: SocketAddr, timeout: Duration) -> Result<(), HealthError> {
    let deadline = Instant::now() + timeout;
    let timed_out = || HealthError::Timeout { addr, timeout };
    let io = |source: std::io::Error| match source.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            HealthError::Timeout { addr, timeout }
        }
        _ => HealthError::Io { addr, source },
    };

    let mut stream = TcpStream::connect_timeout(&addr, timeout).map_err(|source| match source.kind() {
        std::io::ErrorKind::TimedOut => timed_out(),
        _ => HealthError::Connect { addr, source },
    })?;
    let remaining = |deadline: Instant| {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|left| !left.is_zero())
    };
    stream
        .set_write_timeout(Some(remaining(deadline).ok_or_else(timed_out)?))
        .map_err(io)?;
    let request = format!(
        "GET /healthz HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: floodgate-healthcheck\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).map_err(io)?;

    let mut head = Vec::with_capacity(128);
    let mut buf = [0u8; 256];
    while !head.windows(2).any(|w| w == b"\r\n") && head.len() < MAX_HEAD {
        stream
            .set_read_timeout(Some(remaining(deadline).ok_or_else(timed_out)?))
            .map_err(io)?;
        let n = stream.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&head);
    let status_line = head.split("\r\n").next().unwrap_or("");
    let mut parts = status_line.split(' ');
    let status = match (parts.next(), parts.next()) {
        (Some(version), Some(code)) if version.starts_with("HTTP/") && code.len() == 3 => code.parse().ok(),
        _ => None,
    };
    match status {
        Some(200) => Ok(()),
        Some(status) => Err(HealthError::Status { addr, status }),
        None => Err(HealthError::Malformed {
            addr,
            head: status_line.chars().take(80).collect(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_admin_address_is_the_configs() {
        let config = crate::Config::parse(Path::new("t.toml"), "").unwrap();
        assert_eq!(admin_listen_in("").unwrap(), config.server.admin_listen);
        assert_eq!(admin_listen_in("[server]\n").unwrap(), DEFAULT_ADMIN_LISTEN);
    }

    #[test]
    fn the_admin_address_is_read_alone() {
        let text = "[server]\nadmin_listen = \" 0.0.0.0:9902 \"\nbogus = 1\n[routes]\n";
        assert_eq!(admin_listen_in(text).unwrap(), "0.0.0.0:9902".parse().unwrap());
        let bad = admin_listen_in("[server]\nadmin_listen = \"localhost\"\n").unwrap_err();
        assert!(bad.contains("server.admin_listen"), "{bad}");
        assert!(admin_listen_in("[server]\nadmin_listen = 9901\n").is_err());
        assert!(admin_listen_in("[server\n").is_err());
    }

    #[test]
    fn wildcard_listeners_are_probed_on_loopback() {
        let probe = |s: &str| probe_address(s.parse().unwrap()).to_string();
        assert_eq!(probe("0.0.0.0:9901"), "127.0.0.1:9901");
        assert_eq!(probe("[::]:9901"), "[::1]:9901");
        assert_eq!(probe("10.1.2.3:9901"), "10.1.2.3:9901");
        assert_eq!(probe("[fe80::1]:80"), "[fe80::1]:80");
    }
}
