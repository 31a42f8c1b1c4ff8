//! Hot reload (SPEC §7): on SIGHUP or a change of the file, parse and validate the new
//! configuration, then swap it in atomically. Requests in flight finish under the state
//! they started with; an invalid file changes nothing live and is logged with its
//! positions and counted.
//!
//! The file is watched through its directory, so editors that write a new file and rename
//! it over the old one (and Kubernetes ConfigMap symlink swaps) are seen; bursts of events
//! are debounced, and a reload whose file content did not change is skipped.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use notify::{RecursiveMode, Watcher};

use crate::config::{Config, ConfigErrors};
use crate::service::Shared;
use crate::state::GatewayState;

/// How long to wait for more file events before reloading.
const DEBOUNCE: Duration = Duration::from_millis(200);

/// Loads the configuration (from the file, with environment overrides applied).
pub type Loader = Box<dyn Fn() -> Result<Config, ConfigErrors> + Send + Sync>;

/// Reloads one gateway's configuration.
pub struct Reloader {
    shared: Arc<Shared>,
    load: Loader,
    /// Serializes reloads, so two triggers never race their swaps.
    lock: Mutex<()>,
}

impl Reloader {
    pub fn new(shared: Arc<Shared>, load: Loader) -> Self {
        Reloader {
            shared,
            load,
            lock: Mutex::new(()),
        }
    }

    /// Loads, validates and swaps in the configuration; returns whether it was applied.
    pub fn reload(&self, trigger: &str) -> bool {
        let _serialized = self.lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let config = match (self.load)() {
            Ok(config) => config,
            Err(errors) => {
                for line in errors.to_string().lines() {
                    tracing::error!(
                        trigger,
                        "reload refused, keeping the running configuration: {line}"
                    );
                }
                self.shared.metrics.record_reload(false);
                return false;
            }
        };
        let current = self.shared.state.load_full();
        let (old, new) = (&current.config.server, &config.server);
        if old.listen != new.listen || old.admin_listen != new.admin_listen || old.workers != new.workers {
            tracing::warn!(
                trigger,
                "server.listen, server.admin_listen and server.workers changes take effect only after a restart"
            );
        }
        match GatewayState::rebuild(config, &current) {
            Ok(state) => {
                let routes = state.config.routes.len();
                let limits = state.config.limits.len();
                self.shared.state.store(Arc::new(state));
                self.shared.metrics.record_reload(true);
                tracing::info!(trigger, routes, limits, "configuration reloaded");
                true
            }
            Err(error) => {
                tracing::error!(trigger, %error, "reload refused, keeping the running configuration");
                self.shared.metrics.record_reload(false);
                false
            }
        }
    }
}

/// Watches `path` and reloads when its content changes, until the returned watcher is
/// dropped. Must be called inside the runtime.
pub fn watch_file(reloader: Arc<Reloader>, path: &Path) -> notify::Result<notify::RecommendedWatcher> {
    let path = path.to_path_buf();
    let directory = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path.file_name().map(|n| n.to_os_string());
    let (events, mut changes) = tokio::sync::mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        let touches_file = event.paths.iter().any(|p| {
            let name = p.file_name();
            name == file_name.as_deref() || name.is_some_and(|n| n.to_string_lossy().starts_with(".."))
        });
        if touches_file && !event.kind.is_access() {
            let _ = events.send(());
        }
    })?;
    watcher.watch(&directory, RecursiveMode::NonRecursive)?;
    let mut last = std::fs::read(&path).ok();
    tokio::spawn(async move {
        while changes.recv().await.is_some() {
            tokio::time::sleep(DEBOUNCE).await;
            while changes.try_recv().is_ok() {}
            let content = std::fs::read(&path).ok();
            if content.is_some() && content != last {
                last = content;
                let reloader = reloader.clone();
                let _ = tokio::task::spawn_blocking(move || reloader.reload("file change")).await;
            }
        }
    });
    Ok(watcher)
}
