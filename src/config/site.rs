//! A route's site (`root`, `index`, and for a FastCGI upstream `php_root` and
//! `split_path`, docs/php-fpm.md#configuration): validated at load, the root opened once.

use std::path::Path;

use toml::Spanned;

use super::error::ErrorSink;
use super::file::RouteFile;
use super::parse_spanned;
use crate::files::Root;

/// A route's site files and how PHP-FPM sees them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Site {
    pub root: Root,
    /// The file a directory is answered with, and the front controller.
    pub index: String,
    /// The root as PHP-FPM sees it (`SCRIPT_FILENAME` starts with it).
    pub php_root: String,
    /// Where a script's name ends in a path (`.php`).
    pub split_path: String,
}

/// The site of route `key`, whose upstream speaks FastCGI when `fastcgi`; `None` inside
/// `Some` when the route has none. A relative `root` is from `base`, the configuration's
/// directory.
pub(super) fn site(
    key: &str,
    raw: &RouteFile,
    fastcgi: bool,
    base: &Path,
    sink: &mut ErrorSink,
) -> Option<Option<Site>> {
    let Some(root) = &raw.root else {
        if fastcgi {
            sink.push(
                Some(raw.name.span()),
                format!("{key}.root"),
                "a route to a fastcgi:// upstream needs root, the site's directory",
            );
            return None;
        }
        for (what, value) in [
            ("php_root", &raw.php_root),
            ("index", &raw.index),
            ("split_path", &raw.split_path),
        ] {
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
    if !fastcgi {
        sink.push(
            Some(root.span()),
            format!("{key}.root"),
            "root applies to a route with a fastcgi:// upstream (serving files without PHP is not built yet)",
        );
        return None;
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
    let index = text(&raw.index, "index", "index.php", sink);
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
    Some(Some(Site {
        root,
        index: index?,
        php_root: php_root?,
        split_path: split_path?,
    }))
}
