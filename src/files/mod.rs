//! A route's site files (`root`, docs/configuration.md#routesroot): which file a request
//! path names, under the rules that keep everything else out of reach.
//!
//! A path with a segment starting with `.` (outside `/.well-known/`) names nothing, nor
//! does a path whose real location, symlinks resolved, is outside the root: both are
//! answered as absent, before anything else looks at the disk.

use std::path::{Path, PathBuf};

pub(crate) mod choice;
pub(crate) mod serve;

/// A site's root directory, resolved once at load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Root {
    /// The directory, symlinks resolved.
    real: PathBuf,
}

/// What a request path names under a root.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Found {
    /// A regular file: its real path.
    File(PathBuf),
    /// A directory: its real path.
    Directory(PathBuf),
    /// Nothing there.
    Nothing,
    /// A hidden path, or one that leads outside the root: never served, never tried
    /// further.
    Forbidden,
}

impl Root {
    /// `directory` as a root: it must exist and be a directory.
    pub fn new(directory: &Path) -> Result<Root, String> {
        let real = directory
            .canonicalize()
            .map_err(|error| format!("cannot open {}: {error}", directory.display()))?;
        if !real.is_dir() {
            return Err(format!("{} is not a directory", directory.display()));
        }
        Ok(Root { real })
    }

    /// The directory, symlinks resolved.
    pub fn path(&self) -> &Path {
        &self.real
    }

    /// What the decoded request `path` names under the root: a file, a directory,
    /// nothing, or something forbidden (hidden, or outside the root once symlinks are
    /// resolved).
    pub(crate) fn find(&self, path: &str) -> Found {
        if hidden(path) {
            return Found::Forbidden;
        }
        let relative = path.trim_start_matches('/');
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
        match real.metadata() {
            Ok(metadata) if metadata.is_file() => Found::File(real),
            Ok(metadata) if metadata.is_dir() => Found::Directory(real),
            _ => Found::Nothing,
        }
    }
}

/// Whether `path` has a segment starting with `.`, other than under `/.well-known/`.
pub(crate) fn hidden(path: &str) -> bool {
    let rest = path.strip_prefix("/.well-known/").unwrap_or(path);
    rest.split('/').any(|segment| segment.starts_with('.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_segments_name_nothing_except_well_known() {
        assert!(hidden("/.env"));
        assert!(hidden("/app/.git/config"));
        assert!(hidden("/.well-known/../.env"));
        assert!(!hidden("/.well-known/acme-challenge/x"));
        assert!(!hidden("/index.php"));
        assert!(!hidden("/"));
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
        let root = Root::new(site.path()).unwrap();
        let real = site.path().canonicalize().unwrap();
        assert_eq!(root.find("/index.php"), Found::File(real.join("index.php")));
        assert_eq!(root.find("/blog"), Found::Directory(real.join("blog")));
        assert_eq!(root.find("/"), Found::Directory(real.clone()));
        assert_eq!(root.find("/link"), Found::Forbidden);
        assert_eq!(root.find("/.env"), Found::Forbidden);
        assert_eq!(root.find("/missing"), Found::Nothing);
        assert!(Root::new(&site.path().join("index.php")).is_err());
        assert!(Root::new(&site.path().join("none")).is_err());
    }
}
