//! Log setup: `FLOODGATE_LOG` is a tracing filter (default `info`), `FLOODGATE_LOG_FORMAT`
//! is `text` (default) or `json`. Logs go to standard output, as containers expect.

use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber from the environment.
pub fn init() -> Result<(), String> {
    let filter = match std::env::var("FLOODGATE_LOG") {
        Ok(spec) => EnvFilter::try_new(&spec)
            .map_err(|e| format!("FLOODGATE_LOG={spec:?} is not a valid filter: {e}"))?,
        Err(_) => EnvFilter::new("info"),
    };
    let format = std::env::var("FLOODGATE_LOG_FORMAT").unwrap_or_else(|_| "text".to_owned());
    // Colour only for a terminal: escape codes in a file, pipe or log collector would split
    // `key=value` pairs and break grep and parsers.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stdout().is_terminal());
    match format.as_str() {
        "text" => builder.init(),
        "json" => builder.json().flatten_event(true).init(),
        other => {
            return Err(format!(
                "FLOODGATE_LOG_FORMAT={other:?}: expected \"text\" or \"json\""
            ));
        }
    }
    Ok(())
}
