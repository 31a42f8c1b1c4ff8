//! Which file a request to a site comes to (docs/php-fpm.md#which-file-runs): the path
//! itself, or its directory's index; for a PHP site, as Caddy's `php_fastcgi` chooses,
//! also the front controller, and a script only if floodgate saw it exist, so that
//! `/uploads/x.jpg/y.php` never runs `x.jpg`.

use super::{Found, Opened, Root};

/// Which script runs a request, as the file choice found it under the site's root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Script {
    /// The script's path from the root (`/index.php`).
    pub(crate) name: String,
    /// What follows the script in the path (`/x` of `/index.php/x`), or empty.
    pub(crate) path_info: String,
}

/// What a request to a PHP site gets.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Choice {
    /// `308` to the directory's path with its trailing slash (this, a relative target).
    AddSlash(String),
    /// Run this script.
    Run(Script),
    /// Serve this file: its path from the root, and the file.
    Serve(String, Opened),
    /// No file: a `404`, or the upstream's to answer.
    Nothing,
    /// A hidden path, or one outside the root: `404`, nothing else tried.
    Hidden,
    /// A candidate could not be looked at for want of descriptors or memory: `503`.
    Unavailable,
}

/// The choice for the decoded `path` under `root`, with the directory index `index`;
/// for a PHP site, scripts named by `split_path` (`.php`) and `index` as the front
/// controller.
pub(crate) fn choose(root: &Root, path: &str, index: &str, split_path: Option<&str>) -> Choice {
    if super::hidden(path) {
        return Choice::Hidden;
    }
    let in_directory = || {
        if path.ends_with('/') {
            format!("{path}{index}")
        } else {
            format!("{path}/{index}")
        }
    };
    // The path itself is looked up once, whether as a directory or as the first candidate,
    // and so is its directory's index.
    let path_script = script_in(path, split_path);
    let found = look_up(root, path, path_script);
    let mut index_found = None;
    if !path.ends_with('/') && found == Found::Directory {
        let index_path = in_directory();
        match look_up(root, &index_path, script_in(&index_path, split_path)) {
            Found::File(_) | Found::Script => return Choice::AddSlash(format!("{path}/")),
            other => index_found = Some((index_path, other)),
        }
    }
    if let Some(choice) = attempt(root, path, path_script, Some(found)) {
        return choice;
    }
    let (index_path, index_found) = match index_found {
        Some((index_path, found)) => (index_path, Some(found)),
        None => (in_directory(), None),
    };
    let index_script = script_in(&index_path, split_path);
    if let Some(choice) = attempt(root, &index_path, index_script, index_found) {
        return choice;
    }
    if split_path.is_some() {
        let front = format!("/{index}");
        if let Some(choice) = attempt(root, &front, script_in(&front, split_path), None) {
            return choice;
        }
    }
    Choice::Nothing
}

/// What `candidate` comes to, if it is a script to run, a file to serve, or forbidden;
/// `script` is the script it names ([`script_in`]); `looked_up` is what the candidate's
/// own path was found to be, when it was looked up already.
fn attempt(
    root: &Root,
    candidate: &str,
    script: Option<(&str, &str)>,
    looked_up: Option<Found>,
) -> Option<Choice> {
    // A PHP script that is not run (no PHP, or another `split_path`) is never sent as its
    // source: it is no file to serve.
    if script.is_none() && split(candidate, ".php").is_some() {
        return None;
    }
    let name = script.map_or(candidate, |(name, _)| name);
    let found = match looked_up {
        Some(found) if name == candidate => found,
        _ => look_up(root, name, script),
    };
    match (found, script) {
        (Found::Forbidden, _) => Some(Choice::Hidden),
        (Found::Unavailable, _) => Some(Choice::Unavailable),
        (Found::Script | Found::File(_), Some((name, path_info))) => Some(Choice::Run(Script {
            name: name.to_owned(),
            path_info: path_info.to_owned(),
        })),
        (Found::File(opened), None) => Some(Choice::Serve(candidate.to_owned(), opened)),
        // A script never comes to be served: `look_up` was told it is one.
        (Found::Script | Found::Directory | Found::Nothing, _) => None,
    }
}

/// The script `candidate` names for `split_path` (`.php`), if any: its name and what
/// follows it.
fn script_in<'a>(candidate: &'a str, split_path: Option<&str>) -> Option<(&'a str, &'a str)> {
    split_path.and_then(|split_path| split(candidate, split_path))
}

/// What `path` names under `root`: looked up as a script when it is the name of the
/// `script` it names (then floodgate does not open it), else opened to be served.
fn look_up(root: &Root, path: &str, script: Option<(&str, &str)>) -> Found {
    if script.is_some_and(|(name, _)| name == path) {
        root.find_script(path)
    } else {
        root.find(path)
    }
}

/// `path` split after the first segment that ends with `split_path` (any case): the
/// script's name and what follows it.
fn split<'a>(path: &'a str, split_path: &str) -> Option<(&'a str, &'a str)> {
    let mut end = 0;
    // Split as bytes: `str::split` sets up a searcher each call, which costs more than
    // the few segments of a path.
    for segment in path.as_bytes().split(|&byte| byte == b'/') {
        end += segment.len();
        let ends_with = segment.len() >= split_path.len()
            && segment[segment.len() - split_path.len()..].eq_ignore_ascii_case(split_path.as_bytes());
        if ends_with && !segment.is_empty() {
            return Some(path.split_at(end));
        }
        end += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site() -> (tempfile::TempDir, Root) {
        let dir = tempfile::tempdir().unwrap();
        let make = |path: &str, content: &str| {
            let full = dir.path().join(path.trim_start_matches('/'));
            std::fs::create_dir_all(full.parent().unwrap()).unwrap();
            std::fs::write(full, content).unwrap();
        };
        make("/index.php", "<?php echo 'front';");
        make("/login.php", "<?php");
        make("/blog/index.php", "<?php");
        make("/docs/guide.html", "<p>");
        make("/uploads/x.jpg", "<?php system($_GET['c']);");
        make("/style.CSS", "body{}");
        std::fs::create_dir_all(dir.path().join("empty")).unwrap();
        let outside = dir
            .path()
            .parent()
            .unwrap()
            .join(format!("{}-outside", std::process::id()));
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, dir.path().join("escape")).unwrap();
        let root = Root::new(dir.path()).unwrap();
        (dir, root)
    }

    fn run(name: &str, path_info: &str) -> Choice {
        Choice::Run(Script {
            name: name.to_owned(),
            path_info: path_info.to_owned(),
        })
    }

    #[test]
    fn the_file_its_directory_index_or_the_front_controller() {
        let (_dir, root) = site();
        let choose = |path| choose(&root, path, "index.php", Some(".php"));
        assert_eq!(choose("/login.php"), run("/login.php", ""));
        assert_eq!(choose("/login.php/x/y"), run("/login.php", "/x/y"));
        // The file system tells names apart by case: no such script, the front controller.
        assert_eq!(choose("/LOGIN.PHP"), run("/index.php", ""));
        assert_eq!(choose("/blog/"), run("/blog/index.php", ""));
        assert_eq!(choose("/blog"), Choice::AddSlash("/blog/".into()));
        assert_eq!(choose("/"), run("/index.php", ""));
        assert_eq!(choose("/articles/42"), run("/index.php", ""));
        assert_eq!(choose("/empty"), run("/index.php", ""));
        assert!(matches!(choose("/docs/guide.html"), Choice::Serve(..)));
    }

    #[test]
    fn a_script_runs_only_if_it_exists_whatever_the_path_says() {
        let (_dir, root) = site();
        let choose = |path| choose(&root, path, "index.php", Some(".php"));
        // x.jpg/y.php does not exist: the front controller runs, never x.jpg.
        assert_eq!(choose("/uploads/x.jpg/y.php"), run("/index.php", ""));
        assert_eq!(choose("/uploads/x.jpg.php"), run("/index.php", ""));
        // The upload itself is a file, served, never run.
        assert!(matches!(choose("/uploads/x.jpg"), Choice::Serve(..)));
        assert_eq!(choose("/.env"), Choice::Hidden);
        // Hidden or outside the root: nothing, not even the front controller.
        assert_eq!(choose("/.git/config"), Choice::Hidden);
        assert_eq!(choose("/escape/x"), Choice::Hidden);
        assert_eq!(choose("/escape"), Choice::Hidden);
    }

    #[test]
    fn without_a_front_controller_a_missing_path_is_nothing() {
        let (_dir, root) = site();
        assert_eq!(
            choose(&root, "/missing", "app.php", Some(".php")),
            Choice::Nothing
        );
    }

    #[test]
    fn a_site_without_php_serves_files_and_never_a_script() {
        let (_dir, root) = site();
        let choose = |path| choose(&root, path, "index.php", None);
        assert_eq!(choose("/login.php"), Choice::Nothing);
        assert_eq!(choose("/LOGIN.PHP"), Choice::Nothing);
        assert!(matches!(choose("/docs/guide.html"), Choice::Serve(..)));
        assert_eq!(choose("/login.php/x"), Choice::Nothing);
        assert_eq!(choose("/articles/42"), Choice::Nothing);
        assert_eq!(choose("/.env"), Choice::Hidden);
    }

    #[test]
    fn another_split_path_still_never_serves_a_php_file() {
        let (_dir, root) = site();
        let choose = |path| choose(&root, path, "index.phtml", Some(".phtml"));
        // No `index.phtml`: no front controller either.
        assert_eq!(choose("/login.php"), Choice::Nothing);
        assert_eq!(choose("/LOGIN.PHP"), Choice::Nothing);
        assert_eq!(choose("/blog/"), Choice::Nothing);
        assert!(matches!(choose("/docs/guide.html"), Choice::Serve(..)));
    }

    #[test]
    fn the_split_is_at_the_end_of_a_segment_in_any_case() {
        assert_eq!(split("/a.php/b", ".php"), Some(("/a.php", "/b")));
        assert_eq!(split("/a.PHP", ".php"), Some(("/a.PHP", "")));
        assert_eq!(split("/a.phpx/b", ".php"), None);
        assert_eq!(split("/x.php.bak", ".php"), None);
        assert_eq!(split("/.php", ".php"), Some(("/.php", "")));
        assert_eq!(split("/dir/", ".php"), None);
        assert_eq!(split("/é/ü.php/ß", ".php"), Some(("/é/ü.php", "/ß")));
        assert_eq!(split("/ü.phpé", ".php"), None);
    }
}
