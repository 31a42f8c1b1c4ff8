//! A route's site (`root`, `index`, and for a FastCGI upstream `php_root` and
//! `split_path`, docs/configuration.md#routesroot): validated at load, the root opened
//! once.

use std::path::Path;

use toml::Spanned;

use super::error::ErrorSink;
use super::file::RouteFile;
use super::parse_spanned;
use crate::files::Root;

/// A route's site files, and how PHP-FPM sees them when it runs the scripts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Site {
    pub root: Root,
    /// The file a directory is answered with (and, for PHP, the front controller).
    pub index: String,
    /// With a FastCGI upstream.
    pub php: Option<Php>,
}

/// How PHP-FPM sees a site.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Php {
    /// The root as PHP-FPM sees it (`SCRIPT_FILENAME` starts with it).
    pub root: String,
    /// Where a script's name ends in a path (`.php`).
    pub split_path: String,
}

/// What a route with a site does besides serving files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Beside {
    /// Nothing: a route with `root` alone.
    Nothing,
    /// Forwards what is not a file to an HTTP upstream.
    Http,
    /// Runs scripts through a FastCGI upstream.
    FastCgi,
}

/// The site of route `key` (`None` inside `Some` when it has none). A relative `root` is
/// from `base`, the configuration's directory.
pub(super) fn site(
    key: &str,
    raw: &RouteFile,
    beside: Beside,
    base: &Path,
    sink: &mut ErrorSink,
) -> Option<Option<Site>> {
    let php_keys = [("php_root", &raw.php_root), ("split_path", &raw.split_path)];
    let Some(root) = &raw.root else {
        if beside == Beside::FastCgi {
            sink.push(
                Some(raw.name.span()),
                format!("{key}.root"),
                "a route to a fastcgi:// upstream needs root, the site's directory",
            );
            return None;
        }
        for (what, value) in php_keys.into_iter().chain([("index", &raw.index)]) {
            if let Some(value) = value {
                sink.push(
                    Some(value.span()),
                    format!("{key}.{what}"),
                    format!("{what} applies only with root"),
                );
                return None;
            }
        }
        return Some(None);
    };
    if beside != Beside::FastCgi {
        for (what, value) in php_keys {
            if let Some(value) = value {
                sink.push(
                    Some(value.span()),
                    format!("{key}.{what}"),
                    format!("{what} applies only with a fastcgi:// upstream"),
                );
                return None;
            }
        }
    }
    let root = parse_spanned(root, format!("{key}.root"), sink, |text| {
        Root::new(&base.join(text))
    })?;
    let text = |value: &Option<Spanned<String>>, what: &str, default: &str, sink: &mut ErrorSink| match value
    {
        None => Some(default.to_owned()),
        Some(value) => parse_spanned(value, format!("{key}.{what}"), sink, |text| {
            if text.is_empty() || text.contains(['/', '\\', '\0']) {
                Err(format!("expected a file name, got {text:?}"))
            } else {
                Ok(text.to_owned())
            }
        }),
    };
    let default_index = if beside == Beside::FastCgi {
        "index.php"
    } else {
        "index.html"
    };
    let index = text(&raw.index, "index", default_index, sink);
    let php = match beside {
        Beside::FastCgi => {
            let split_path = text(&raw.split_path, "split_path", ".php", sink);
            let php_root = match &raw.php_root {
                None => Some(root.path().display().to_string()),
                Some(value) => parse_spanned(value, format!("{key}.php_root"), sink, |text| {
                    if text.starts_with('/') {
                        Ok(text.trim_end_matches('/').to_owned())
                    } else {
                        Err(format!("expected an absolute path, got {text:?}"))
                    }
                }),
            };
            Some(Php {
                root: php_root?,
                split_path: split_path?,
            })
        }
        Beside::Http | Beside::Nothing => None,
    };
    Some(Some(Site {
        root,
        index: index?,
        php,
    }))
}
