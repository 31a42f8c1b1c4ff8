//! Hot reload (docs/operations.md#reload): on SIGHUP or a change of the file, parse and validate the new
//! configuration, then swap it in atomically. Requests in flight finish under the state
//! they started with; an invalid file changes nothing live and is logged with its
//! positions and counted.
//!
//! The file is polled, so editors that write a new file and rename it over the old one
//! (and Kubernetes ConfigMap symlink swaps) are seen; bursts of writes are debounced, and a
//! reload whose file content did not change is skipped.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::{Config, ConfigErrors};
use crate::service::Instance;
use crate::service::state::GatewayState;

/// How long to wait for more file events before reloading.
const DEBOUNCE: Duration = Duration::from_millis(200);

/// Loads the configuration (from the file, with environment overrides applied).
pub type Loader = Box<dyn Fn() -> Result<Config, ConfigErrors> + Send + Sync>;

/// Reloads one gateway's configuration.
pub struct Reloader {
    shared: Arc<Instance>,
    load: Loader,
    /// Serializes reloads, so two triggers never race their swaps.
    lock: Mutex<()>,
}

impl Reloader {
    pub fn new(shared: Arc<Instance>, load: Loader) -> Self {
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
        match GatewayState::rebuild(config, &current, &self.shared.metrics) {
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

/// Watches `path` and reloads when its content changes, until the returned handle is
/// dropped. Must be called inside the runtime.
///
/// The file is polled (its metadata once per [`POLL_EVERY`], following symlinks) rather
/// than watched with inotify: a directory watch wakes a thread for every write to any file
/// beside the config (such as a log file), and a file watch is lost when an editor renames
/// a new file over the old one. A change is reloaded once the file has stopped changing
/// for [`DEBOUNCE`], so a file caught half-written is not reported as invalid.
pub fn watch_file(reloader: Arc<Reloader>, path: &Path) -> WatchHandle {
    let path = path.to_path_buf();
    // Taken now, not in the task: a change made right after this call must be seen.
    let mut seen = fingerprint(&path);
    let mut content = std::fs::read(&path).ok();
    let task = tokio::spawn(async move {
        loop {
            tokio::time::sleep(POLL_EVERY).await;
            let now = fingerprint(&path);
            if now == seen {
                continue;
            }
            // Wait until the file stops changing.
            let mut settled = now;
            loop {
                tokio::time::sleep(DEBOUNCE).await;
                let again = fingerprint(&path);
                if again == settled {
                    break;
                }
                settled = again;
            }
            seen = settled;
            let new_content = std::fs::read(&path).ok();
            if new_content.is_some() && new_content != content {
                content = new_content;
                let reloader = reloader.clone();
                let _ = tokio::task::spawn_blocking(move || reloader.reload("file change")).await;
            }
        }
    });
    WatchHandle(task)
}

/// How often the configuration file's metadata is looked at.
const POLL_EVERY: Duration = Duration::from_millis(500);

/// Stops watching when dropped.
pub struct WatchHandle(tokio::task::JoinHandle<()>);

impl Drop for WatchHandle {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What changes when a file is written or replaced: modification time, size, inode.
fn fingerprint(path: &Path) -> Option<(std::time::SystemTime, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::metadata(path).ok()?;
    Some((metadata.modified().ok()?, metadata.len(), metadata.ino()))
}
