//! Hot reload (docs/operations.md#reload): on SIGHUP or a change of the file, parse and validate the new
//! configuration, then swap it in atomically. Requests in flight finish under the state
//! they started with; an invalid file changes nothing live and is logged with its
//! positions and counted.
//!
//! The file is polled, so editors that write a new file and rename it over the old one
//! (and Kubernetes ConfigMap symlink swaps) are seen; bursts of writes are debounced, and a
//! change is reloaded only when the content differs from what the last reload read,
//! whatever triggered that one (a SIGHUP sent right after an edit reloads it once). After
//! a refused reload, saving the file again retries it even unchanged: what made it invalid
//! may have been fixed outside it (a certificate file it names created since).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
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
    /// The configuration file, once [`watch_file`] watches it.
    watched: OnceLock<PathBuf>,
    /// Serializes reloads, so two triggers never race their swaps; holds what the last
    /// reload read.
    last_read: Mutex<LastRead>,
}

/// The watched files as the last reload read them, and whether it was refused.
#[derive(Default)]
struct LastRead {
    /// Each file's contents (`None`: it could not be read).
    contents: Vec<Option<Vec<u8>>>,
    fingerprints: Vec<Option<Fingerprint>>,
    refused: bool,
}

impl LastRead {
    fn of(files: &[PathBuf]) -> LastRead {
        LastRead {
            contents: files.iter().map(|file| std::fs::read(file).ok()).collect(),
            fingerprints: fingerprints(files),
            refused: false,
        }
    }

    /// Whether `now` asks for a reload after this one: other contents, or the files
    /// written again since a refused reload.
    fn outdated_by(&self, now: &LastRead) -> bool {
        now.contents != self.contents || (self.refused && now.fingerprints != self.fingerprints)
    }

    /// Records how the reload that read `before` ended; when it applied a configuration
    /// that names other files (`after`), what they hold now, so that the watcher does not
    /// take the files it starts watching for a change.
    fn settle(&mut self, applied: bool, before: &[PathBuf], after: &[PathBuf]) {
        if applied && before != after {
            *self = LastRead::of(after);
        }
        self.refused = !applied;
    }
}

impl Reloader {
    pub fn new(shared: Arc<Instance>, load: Loader) -> Self {
        Reloader {
            shared,
            load,
            watched: OnceLock::new(),
            last_read: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LastRead> {
        self.last_read
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The watched configuration file and the certificate and key files the running
    /// configuration names; none before [`watch_file`].
    fn watched_files(&self) -> Vec<PathBuf> {
        let Some(config) = self.watched.get() else {
            return Vec::new();
        };
        let mut files = vec![config.clone()];
        files.extend(self.shared.state.load().config.tls_files());
        files
    }

    /// Loads, validates and swaps in the configuration; returns whether it was applied.
    pub fn reload(&self, trigger: &str) -> bool {
        let mut last_read = self.lock();
        // Read before loading: an edit made after is then seen as a change.
        let files = self.watched_files();
        *last_read = LastRead::of(&files);
        let applied = self.load_and_swap(trigger);
        last_read.settle(applied, &files, &self.watched_files());
        applied
    }

    /// Reloads when the watched files hold other than what the last reload read (and
    /// the configuration file is there: not caught between an editor's write and rename).
    fn reload_if_changed(&self, trigger: &str) -> bool {
        let mut last_read = self.lock();
        let files = self.watched_files();
        let now = LastRead::of(&files);
        if now.contents.first().is_some_and(Option::is_none) || !last_read.outdated_by(&now) {
            return false;
        }
        *last_read = now;
        let applied = self.load_and_swap(trigger);
        last_read.settle(applied, &files, &self.watched_files());
        applied
    }

    /// The reload itself, run under the lock of [`Self::lock`].
    fn load_and_swap(&self, trigger: &str) -> bool {
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
        let tls_listen = |server: &crate::config::ServerConfig| server.tls.as_ref().map(|tls| tls.listen);
        if old.listen != new.listen
            || old.admin_listen != new.admin_listen
            || old.workers != new.workers
            || tls_listen(old) != tls_listen(new)
        {
            tracing::warn!(
                trigger,
                "server.listen, server.admin_listen, server.workers and server.tls.listen changes take effect only after a restart"
            );
        }
        for warning in config.warnings() {
            tracing::warn!(trigger, "{warning}");
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

/// Watches `path`, and the certificate and key files the running configuration names,
/// and reloads when the content of any of them changes, until the returned handle is
/// dropped. Must be called inside the runtime.
///
/// The files are polled (their metadata once per [`POLL_EVERY`], following symlinks)
/// rather than watched with inotify: a directory watch wakes a thread for every write to
/// any file beside the config (such as a log file), and a file watch is lost when an
/// editor renames a new file over the old one. A change is reloaded once the files have
/// stopped changing for [`DEBOUNCE`], so a file caught half-written is not reported as
/// invalid.
pub fn watch_file(reloader: Arc<Reloader>, path: &Path) -> WatchHandle {
    // Taken now, not in the task: a change made right after this call must be seen.
    let _ = reloader.watched.set(path.to_path_buf());
    let mut seen = fingerprints(&reloader.watched_files());
    *reloader.lock() = LastRead::of(&reloader.watched_files());
    let task = tokio::spawn(async move {
        loop {
            tokio::time::sleep(POLL_EVERY).await;
            let watched = reloader.watched_files();
            let now = fingerprints(&watched);
            if now == seen {
                continue;
            }
            // Wait until the files stop changing.
            let mut settled = now;
            loop {
                tokio::time::sleep(DEBOUNCE).await;
                let again = fingerprints(&watched);
                if again == settled {
                    break;
                }
                settled = again;
            }
            seen = settled;
            let reloading = reloader.clone();
            let reloaded =
                tokio::task::spawn_blocking(move || reloading.reload_if_changed("file change")).await;
            if reloaded.unwrap_or(false) {
                // A reload may name other certificate files.
                seen = fingerprints(&reloader.watched_files());
            }
        }
    });
    WatchHandle(task)
}

fn fingerprints(files: &[PathBuf]) -> Vec<Option<Fingerprint>> {
    files.iter().map(|file| fingerprint(file)).collect()
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
type Fingerprint = (std::time::SystemTime, u64, u64);

fn fingerprint(path: &Path) -> Option<Fingerprint> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::metadata(path).ok()?;
    Some((metadata.modified().ok()?, metadata.len(), metadata.ino()))
}
