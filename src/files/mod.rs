//! A route's site files (`root`, docs/configuration.md#routesroot): which file a request
//! path names, under the rules that keep everything else out of reach.
//!
//! A path with a segment starting with `.` (outside `/.well-known/`) names nothing, nor
//! does a path whose real location, symlinks resolved, is outside the root: both are
//! answered as absent, before anything else looks at the disk.

use std::fs::{File, Metadata};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

pub(crate) mod choice;
pub(crate) mod serve;

/// A site's root directory, resolved and opened once at load.
#[derive(Debug, Clone)]
pub struct Root {
    /// The directory, symlinks resolved.
    real: PathBuf,
    /// The directory itself, which lookups start from.
    directory: Arc<File>,
}

impl PartialEq for Root {
    fn eq(&self, other: &Root) -> bool {
        self.real == other.real
    }
}

impl Eq for Root {}

/// A file opened under a root, with what it is.
#[derive(Debug)]
pub(crate) struct Opened {
    pub(crate) file: File,
    pub(crate) metadata: Metadata,
}

impl PartialEq for Opened {
    fn eq(&self, other: &Opened) -> bool {
        (self.metadata.dev(), self.metadata.ino()) == (other.metadata.dev(), other.metadata.ino())
    }
}

impl Eq for Opened {}

/// What a request path names under a root.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Found {
    /// A regular file, open.
    File(Opened),
    /// A regular file looked up as a script ([`Root::find_script`]): floodgate names it to
    /// PHP-FPM and never reads it, so it is not opened for reading.
    Script,
    /// A directory.
    Directory,
    /// Nothing there.
    Nothing,
    /// A hidden path, or one that leads outside the root: never served, never tried
    /// further.
    Forbidden,
    /// Not looked at: the process or the system is out of descriptors or memory.
    Unavailable,
}

/// Whether the kernel refused `openat2` (before Linux 5.6, or a seccomp profile that does
/// not know it): lookups then resolve the path in user space.
static NO_OPENAT2: AtomicBool = AtomicBool::new(false);

impl Root {
    /// `directory` as a root: it must exist and be a directory.
    pub fn new(directory: &Path) -> Result<Root, String> {
        let real = directory
            .canonicalize()
            .map_err(|error| format!("cannot open {}: {error}", directory.display()))?;
        if !real.is_dir() {
            return Err(format!("{} is not a directory", directory.display()));
        }
        let opened =
            File::open(&real).map_err(|error| format!("cannot open {}: {error}", directory.display()))?;
        Ok(Root {
            real,
            directory: Arc::new(opened),
        })
    }

    /// The directory, symlinks resolved.
    pub fn path(&self) -> &Path {
        &self.real
    }

    /// What the decoded request `path` names under the root: a file (opened), a
    /// directory, nothing, or something forbidden (hidden, or outside the root once
    /// symlinks are resolved).
    ///
    /// The kernel resolves the path beneath the root in one `openat2` call
    /// (`RESOLVE_BENEATH`), refusing any step outside it; a refusal, which an absolute
    /// symlink also gets, is looked at again in user space, which alone tells a symlink
    /// that stays inside from one that leaves.
    pub(crate) fn find(&self, path: &str) -> Found {
        match beneath(path) {
            // Non-blocking: a FIFO must not hold the worker until a writer comes.
            Some(relative) => self.open(relative, OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY),
            None => Found::Forbidden,
        }
    }

    /// What the decoded request `path` names, as [`Root::find`] tells, for a script:
    /// [`Found::Script`] in place of an opened file.
    ///
    /// A name directly in the root has no directory to pass through on its way out, so
    /// one `fstatat` that does not follow a final symlink tells what it is (a third of
    /// the system time of opening, looking at and closing it); a symlink there, and any
    /// deeper path, is resolved as `find` resolves it, opened only as a location
    /// (`O_PATH`).
    pub(crate) fn find_script(&self, path: &str) -> Found {
        let Some(relative) = beneath(path) else {
            return Found::Forbidden;
        };
        if !relative.contains('/') {
            match rustix::fs::statat(self.directory.as_ref(), relative, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(stat) => match FileType::from_raw_mode(stat.st_mode) {
                    FileType::RegularFile => return Found::Script,
                    FileType::Directory => return Found::Directory,
                    // Resolved below: it may lead outside.
                    FileType::Symlink => {}
                    _ => return Found::Nothing,
                },
                Err(Errno::NOENT | Errno::ACCESS | Errno::NAMETOOLONG) => return Found::Nothing,
                Err(_) => {}
            }
        }
        match self.open(relative, OFlags::PATH) {
            Found::File(_) => Found::Script,
            other => other,
        }
    }

    /// What `relative` (from [`beneath`]) names, a file opened with `flags` (besides
    /// `O_CLOEXEC`).
    fn open(&self, relative: &str, flags: OFlags) -> Found {
        if !NO_OPENAT2.load(Ordering::Relaxed) {
            let opened = rustix::fs::openat2(
                self.directory.as_ref(),
                relative,
                flags | OFlags::CLOEXEC,
                Mode::empty(),
                ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
            );
            match opened {
                Ok(fd) => return Found::opened(File::from(fd)),
                Err(Errno::NOENT | Errno::NOTDIR | Errno::ACCESS | Errno::LOOP | Errno::NAMETOOLONG) => {
                    return Found::Nothing;
                }
                Err(Errno::MFILE | Errno::NFILE | Errno::NOMEM) => return Found::Unavailable,
                Err(Errno::NOSYS | Errno::PERM) => NO_OPENAT2.store(true, Ordering::Relaxed),
                // EXDEV (a step outside, or an absolute symlink), EAGAIN (a rename
                // meanwhile), anything else: resolved below.
                Err(_) => {}
            }
        }
        self.find_resolving(relative, flags)
    }

    /// [`Root::open`] resolving the path in user space, component by component.
    fn find_resolving(&self, relative: &str, flags: OFlags) -> Found {
        let candidate = self.real.join(relative);
        let Ok(real) = candidate.canonicalize() else {
            // Absent: forbidden all the same if the part that exists leads outside.
            let outside = candidate
                .ancestors()
                .skip(1)
                .find_map(|existing| existing.canonicalize().ok())
                .is_some_and(|real| !real.starts_with(&self.real));
            return if outside { Found::Forbidden } else { Found::Nothing };
        };
        if !real.starts_with(&self.real) {
            return Found::Forbidden;
        }
        use std::os::unix::fs::OpenOptionsExt as _;
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(flags.bits() as i32)
            .open(&real)
        {
            Ok(file) => Found::opened(file),
            Err(error) if crate::room::exhausted(&error) => Found::Unavailable,
            Err(_) => Found::Nothing,
        }
    }
}

impl Found {
    /// What an opened `file` is.
    fn opened(file: File) -> Found {
        match file.metadata() {
            Ok(metadata) if metadata.is_file() => Found::File(Opened { file, metadata }),
            Ok(metadata) if metadata.is_dir() => Found::Directory,
            _ => Found::Nothing,
        }
    }
}

/// `path` relative to the root (`.` for the root itself), unless it is [`hidden`].
fn beneath(path: &str) -> Option<&str> {
    if hidden(path) {
        return None;
    }
    let relative = path.trim_start_matches('/');
    Some(if relative.is_empty() { "." } else { relative })
}

/// Whether `path` has a segment starting with `.`, other than under `/.well-known/`.
pub(crate) fn hidden(path: &str) -> bool {
    let rest = path.strip_prefix("/.well-known/").unwrap_or(path);
    rest.starts_with('.') || rest.as_bytes().windows(2).any(|pair| pair == b"/.")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_is_nothing_and_does_not_block() {
        let site = tempfile::tempdir().unwrap();
        let fifo = site.path().join("pipe");
        assert!(
            std::process::Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .unwrap()
                .success()
        );
        let root = Root::new(site.path()).unwrap();
        assert_eq!(root.find("/pipe"), Found::Nothing);
        assert_eq!(
            root.find_resolving("pipe", OFlags::RDONLY | OFlags::NONBLOCK),
            Found::Nothing
        );
        assert_eq!(root.find_script("/pipe"), Found::Nothing);
    }

    #[test]
    fn hidden_segments_name_nothing_except_well_known() {
        assert!(hidden("/.env"));
        assert!(hidden("/app/.git/config"));
        assert!(hidden("/.well-known/../.env"));
        assert!(!hidden("/.well-known/acme-challenge/x"));
        assert!(!hidden("/index.php"));
        assert!(!hidden("/"));
        assert!(hidden(".env"));
        assert!(hidden("/a/."));
        assert!(!hidden("/a.b/c.d"));
    }

    #[test]
    fn files_directories_and_what_lies_outside() {
        let site = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(site.path().join("index.php"), "<?php").unwrap();
        std::fs::create_dir(site.path().join("blog")).unwrap();
        std::fs::write(outside.path().join("secret"), "s").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), site.path().join("link")).unwrap();
        std::fs::write(site.path().join(".env"), "KEY=1").unwrap();
        std::fs::create_dir(site.path().join("inner")).unwrap();
        std::os::unix::fs::symlink("../index.php", site.path().join("inner/up")).unwrap();
        std::os::unix::fs::symlink(site.path().join("index.php"), site.path().join("absolute")).unwrap();
        std::os::unix::fs::symlink("../../../../../../../../etc/passwd", site.path().join("climb")).unwrap();
        let root = Root::new(site.path()).unwrap();
        for find in [Root::find, |root: &Root, path: &str| {
            root.find_resolving(path.trim_start_matches('/'), OFlags::RDONLY)
        }] {
            let file = |path| match find(&root, path) {
                Found::File(opened) => opened.metadata.len(),
                other => panic!("{path}: {other:?}"),
            };
            assert_eq!(file("/index.php"), 5);
            // Symlinks that stay inside, relative or absolute, are followed.
            assert_eq!(file("/inner/up"), 5);
            assert_eq!(file("/absolute"), 5);
            assert_eq!(find(&root, "/blog"), Found::Directory);
            assert_eq!(find(&root, "/"), Found::Directory);
            assert_eq!(find(&root, "/link"), Found::Forbidden);
            assert_eq!(find(&root, "/climb"), Found::Forbidden);
            assert_eq!(find(&root, "/link/more"), Found::Forbidden);
            assert_eq!(find(&root, "/missing"), Found::Nothing);
            assert_eq!(find(&root, "/index.php/x"), Found::Nothing);
        }
        assert_eq!(root.find("/.env"), Found::Forbidden);
        // Looked up as scripts: the same answers, a file not opened.
        std::fs::write(site.path().join("blog/post.php"), "<?php").unwrap();
        for (path, found) in [
            ("/index.php", Found::Script),
            ("/blog/post.php", Found::Script),
            ("/inner/up", Found::Script),
            ("/absolute", Found::Script),
            ("/blog", Found::Directory),
            ("/", Found::Directory),
            ("/link", Found::Forbidden),
            ("/climb", Found::Forbidden),
            ("/link/more", Found::Forbidden),
            ("/missing", Found::Nothing),
            ("/index.php/x", Found::Nothing),
            ("/.env", Found::Forbidden),
        ] {
            assert_eq!(root.find_script(path), found, "{path}");
            // As the lookup goes where the kernel has no openat2 (hidden paths are
            // refused before it).
            if let Some(relative) = beneath(path) {
                let resolved = match root.find_resolving(relative, OFlags::PATH) {
                    Found::File(_) => Found::Script,
                    other => other,
                };
                assert_eq!(resolved, found, "{path} resolved in user space");
            }
        }
        assert!(Root::new(&site.path().join("index.php")).is_err());
        assert!(Root::new(&site.path().join("none")).is_err());
    }
}
