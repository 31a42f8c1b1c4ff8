//! Configurations for test gateways: [`GatewayToml`] writes the `[server]` table with both
//! listeners on port 0 once, and the tables a test adds after it; [`config_file`] and
//! [`write_config`] put a configuration where the binary or a reload reads it.

use std::fmt::{self, Display, Write as _};
use std::path::{Path, PathBuf};

use tempfile::TempDir;

/// A gateway configuration, rendered as TOML by `Display`: `[server]` with `listen` and
/// `admin_listen` on 127.0.0.1 port 0 and the keys of [`GatewayToml::server`], then every
/// other table in the order it was added (routes match in that order).
///
/// Each method takes the keys of its table as TOML lines (`"limit = 3\nwindow = \"1m\""`).
#[derive(Default)]
pub(crate) struct GatewayToml {
    server: String,
    tables: String,
}

impl GatewayToml {
    /// `[server]` alone, both listeners on port 0.
    pub(crate) fn new() -> GatewayToml {
        GatewayToml::default()
    }

    /// Adds one upstream, `app` at `url` with `upstream_keys`, and one route, `app`, that
    /// sends it everything.
    pub(crate) fn proxy_to(self, url: &str, upstream_keys: &str) -> GatewayToml {
        self.upstream("app", url, upstream_keys)
            .route("app", "path_prefix = \"/\"\nupstream = \"app\"")
    }

    /// Adds `keys` to `[server]`.
    pub(crate) fn server(mut self, keys: &str) -> GatewayToml {
        push_lines(&mut self.server, keys);
        self
    }

    /// `[redis]` with `url` and `keys`.
    pub(crate) fn redis(self, url: &str, keys: &str) -> GatewayToml {
        self.table("redis", &format!("url = \"{url}\"\n{keys}"))
    }

    /// `[upstreams.NAME]` with `url` and `keys`.
    pub(crate) fn upstream(self, name: &str, url: &str, keys: &str) -> GatewayToml {
        self.table(&format!("upstreams.{name}"), &format!("url = \"{url}\"\n{keys}"))
    }

    /// `[limits.NAME]` with `keys`.
    pub(crate) fn limit(self, name: &str, keys: &str) -> GatewayToml {
        self.table(&format!("limits.{name}"), keys)
    }

    /// A `[[routes]]` entry named `name`, with `keys`.
    pub(crate) fn route(mut self, name: &str, keys: &str) -> GatewayToml {
        let _ = write!(self.tables, "\n[[routes]]\nname = \"{name}\"\n");
        push_lines(&mut self.tables, keys);
        self
    }

    /// Any other table, `[HEADER]` with `keys` (`server.errors`, `server.tls`, an upstream
    /// of several `servers`).
    pub(crate) fn table(mut self, header: &str, keys: &str) -> GatewayToml {
        let _ = write!(self.tables, "\n[{header}]\n");
        push_lines(&mut self.tables, keys);
        self
    }
}

impl Display for GatewayToml {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}{}",
            self.server, self.tables
        )
    }
}

/// Appends `lines`, ending them with a newline.
fn push_lines(text: &mut String, lines: &str) {
    text.push_str(lines);
    if !lines.is_empty() && !lines.ends_with('\n') {
        text.push('\n');
    }
}

/// Writes `text` to `gateway.toml` in `dir`; returns the file's path.
pub(crate) fn write_config(dir: &Path, text: impl Display) -> PathBuf {
    let path = dir.join("gateway.toml");
    std::fs::write(&path, text.to_string()).expect("write the config");
    path
}

/// `gateway.toml` holding `text` in a new temporary directory, deleted when the returned
/// `TempDir` is dropped.
pub(crate) fn config_file(text: impl Display) -> (TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_config(dir.path(), text);
    (dir, path)
}
