//! Configuration errors that name the place in the file a user has to fix.
//!
//! Every error carries the file, the `line:column` of the offending value (1-based, as
//! editors count), the dotted key path (`routes[2].upstream`) and what was expected.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// One problem in a configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// `line:column` of the problem, when it has a place in the file.
    pub position: Option<(usize, usize)>,
    /// The dotted key path, e.g. `routes[0].upstream`; empty for file-level problems.
    pub key: String,
    /// What is wrong and what was expected.
    pub message: String,
}

/// All problems found in one configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors {
    pub file: PathBuf,
    pub errors: Vec<ConfigError>,
}

impl ConfigErrors {
    pub(crate) fn single(file: &Path, key: &str, message: impl Into<String>) -> Self {
        ConfigErrors {
            file: file.to_path_buf(),
            errors: vec![ConfigError {
                position: None,
                key: key.to_owned(),
                message: message.into(),
            }],
        }
    }
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, error) in self.errors.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{}", self.file.display())?;
            if let Some((line, column)) = error.position {
                write!(f, ":{line}:{column}")?;
            }
            if error.key.is_empty() {
                write!(f, ": {}", error.message)?;
            } else {
                write!(f, ": {}: {}", error.key, error.message)?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// Collects errors while a file is validated, turning byte spans into `line:column`.
pub(crate) struct ErrorSink<'a> {
    text: &'a str,
    errors: Vec<ConfigError>,
}

impl<'a> ErrorSink<'a> {
    pub(crate) fn new(text: &'a str) -> Self {
        ErrorSink {
            text,
            errors: Vec::new(),
        }
    }

    /// Records a problem at `span` (a byte range of the file) under `key`.
    pub(crate) fn push(
        &mut self,
        span: Option<Range<usize>>,
        key: impl Into<String>,
        message: impl Into<String>,
    ) {
        self.errors.push(ConfigError {
            position: span.map(|span| line_column(self.text, span.start)),
            key: key.into(),
            message: message.into(),
        });
    }

    /// Whether a problem was recorded in table `table` (`limits.NAME`): a name that
    /// refers to it then adds no error of its own.
    pub(crate) fn reported_in(&self, table: &str) -> bool {
        self.errors.iter().any(|error| {
            error
                .key
                .strip_prefix(table)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
        })
    }

    /// Two keys that exclude each other were both given: the error is at `key`, given
    /// at `span`.
    pub(crate) fn both(&mut self, span: Range<usize>, key: impl Into<String>, first: &str, second: &str) {
        self.push(
            Some(span),
            key,
            format!("expected either `{first}` or `{second}`, not both"),
        );
    }

    /// `Ok` when nothing was recorded, otherwise every recorded error.
    pub(crate) fn finish(self, file: &Path) -> Result<(), ConfigErrors> {
        if self.errors.is_empty() {
            Ok(())
        } else {
            Err(self.into_errors(file))
        }
    }

    /// The recorded errors in file order (those without a position first).
    pub(crate) fn into_errors(mut self, file: &Path) -> ConfigErrors {
        self.errors.sort_by_key(|e| e.position);
        ConfigErrors {
            file: file.to_path_buf(),
            errors: self.errors,
        }
    }
}

/// The 1-based `line:column` of byte `offset` in `text`; columns count characters.
pub(crate) fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_column_is_one_based_and_counts_characters() {
        let text = "a = 1\nbé = \"x\"\n";
        assert_eq!(line_column(text, 0), (1, 1));
        assert_eq!(line_column(text, 6), (2, 1));
        // "bé = " is 6 bytes but 5 characters.
        assert_eq!(line_column(text, 12), (2, 6));
    }

    #[test]
    fn display_names_file_position_key_and_message() {
        let errors = ConfigErrors {
            file: PathBuf::from("gateway.toml"),
            errors: vec![
                ConfigError {
                    position: Some((3, 7)),
                    key: "routes[0].upstream".into(),
                    message: "unknown upstream \"x\"".into(),
                },
                ConfigError {
                    position: None,
                    key: String::new(),
                    message: "cannot read".into(),
                },
            ],
        };
        assert_eq!(
            errors.to_string(),
            "gateway.toml:3:7: routes[0].upstream: unknown upstream \"x\"\ngateway.toml: cannot read"
        );
    }
}
