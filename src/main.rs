//! The `floodgate` command: parse the CLI, load and validate the configuration, set up
//! logging and the runtime, then serve until SIGTERM/SIGINT; or `check` a file, or
//! `healthcheck` a running gateway.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use std::sync::Arc;

use floodgate::config::Environment;
use floodgate::reload::{self, Reloader};
use floodgate::{Config, Gateway, healthcheck, logging};

/// mimalloc instead of glibc's malloc: allocation and freeing were about a sixth of the
/// gateway's user CPU per request under glibc (docs/performance.md, "Choices measured").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "floodgate", version, about = "A rate-limiting HTTP reverse proxy")]
struct Cli {
    /// The configuration file.
    #[arg(
        long,
        short,
        global = true,
        env = "FLOODGATE_CONFIG",
        default_value = "gateway.toml"
    )]
    config: PathBuf,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate the configuration file, print a summary, and exit 0 (valid) or 1.
    Check,
    /// Ask the running gateway for GET /healthz: exit 0 on 200, else 1.
    ///
    /// For container health checks. The address is the file's server.admin_listen (only that
    /// key is read); a wildcard address (0.0.0.0, [::]) is probed on loopback.
    Healthcheck {
        /// Give up after this long (connect, send, answer).
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Check) => check(&cli.config),
        Some(Command::Healthcheck { timeout }) => healthcheck(&cli.config, timeout),
        None => run(&cli.config),
    }
}

/// Loads `path` with what `FLOODGATE_ADMIN_TOKEN` and `FLOODGATE_REDIS_URL` add.
fn load(path: &Path) -> Result<Config, floodgate::ConfigErrors> {
    Config::load_in(path, &Environment::of_process())
}

fn check(path: &Path) -> ExitCode {
    match load(path) {
        Ok(config) => {
            let store = match &config.redis {
                Some(redis) => format!("redis {}", redis.target.describe()),
                None => "in-process store".to_owned(),
            };
            println!(
                "{}: ok: {} route(s), {} upstream(s), {} limit(s) ({store}); listen {}, admin {}",
                path.display(),
                config.routes.len(),
                config.upstreams.len(),
                config.limits.len(),
                config.server.listen,
                config.server.admin_listen,
            );
            if let Some(tls) = &config.server.tls {
                println!(
                    "{}: https on {}: {} certificate(s)",
                    path.display(),
                    tls.listen,
                    tls.certificates.len()
                );
                if let Some(acme) = &tls.acme {
                    println!(
                        "{}: ACME: one certificate for {} from {}",
                        path.display(),
                        acme.domains.join(", "),
                        acme.directory
                    );
                }
            }
            for warning in config.warnings() {
                println!("{}: warning: {warning}", path.display());
            }
            ExitCode::SUCCESS
        }
        Err(errors) => {
            eprintln!("{errors}");
            ExitCode::FAILURE
        }
    }
}

fn healthcheck(path: &Path, timeout: Duration) -> ExitCode {
    let outcome = healthcheck::admin_listen(path).and_then(|listen| {
        let addr = healthcheck::probe_address(listen);
        healthcheck::probe(addr, timeout).map(|()| addr)
    });
    match outcome {
        Ok(addr) => {
            println!("healthy: GET http://{addr}/healthz answered 200");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("unhealthy: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(path: &Path) -> ExitCode {
    let config = match load(path) {
        Ok(config) => config,
        Err(errors) => {
            eprintln!("{errors}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(message) = logging::init() {
        eprintln!("floodgate: {message}");
        return ExitCode::FAILURE;
    }
    let code = match serve(config, path.to_path_buf()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("floodgate: {e:#}");
            ExitCode::FAILURE
        }
    };
    logging::flush();
    code
}

fn serve(config: Config, path: PathBuf) -> anyhow::Result<()> {
    // This thread accepts connections and runs what is not a client's (admin, health
    // checks, the Redis connection, reloads); with more than one worker, the workers'
    // threads serve the connections (floodgate::server).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async {
        if let Some((before, after)) = floodgate::server::raise_open_file_limit() {
            let after = after.map_or_else(|| "unlimited".to_owned(), |after| after.to_string());
            tracing::info!(
                before,
                after,
                "raised the soft limit on open files to the hard one"
            );
        }
        let config_path = config.path.clone();
        for warning in config.warnings() {
            tracing::warn!("{warning}");
        }
        let gateway = Gateway::bind(config).await?;
        let workers = gateway.workers();
        tracing::info!(
            https = ?gateway.tls_addr(),
            listen = %gateway.local_addr(),
            admin = %gateway.admin_addr(),
            workers,
            version = env!("CARGO_PKG_VERSION"),
            "floodgate listening"
        );
        if in_container() && gateway.admin_addr().ip().is_loopback() {
            tracing::warn!(
                admin = %gateway.admin_addr(),
                "server.admin_listen is a loopback address inside a container: /metrics and \
                 /readyz are unreachable through published ports (bind 0.0.0.0:9901)"
            );
        }
        let reloader = Arc::new(Reloader::new(
            gateway.shared().clone(),
            Box::new(move || load(&path)),
        ));
        let _watcher = reload::watch_file(reloader.clone(), &config_path);
        tokio::spawn(reload_on_sighup(reloader));
        tokio::spawn(logging::flush_periodically());
        gateway.serve(shutdown_signal()).await;
        Ok(())
    })
}

/// Reloads the configuration on every SIGHUP.
async fn reload_on_sighup(reloader: Arc<Reloader>) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangups = match signal(SignalKind::hangup()) {
        Ok(signal) => signal,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGHUP; reload by editing the file");
            return;
        }
    };
    while hangups.recv().await.is_some() {
        let reloader = reloader.clone();
        let _ = tokio::task::spawn_blocking(move || reloader.reload("SIGHUP")).await;
    }
}

/// Completes on the first SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = match signal(SignalKind::terminate()) {
        Ok(signal) => signal,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM; stopping on SIGINT only");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = terminate.recv() => tracing::info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
    }
}

/// Whether this process runs in a container (Docker, Podman), going by the marker files
/// their runtimes create.
fn in_container() -> bool {
    ["/.dockerenv", "/run/.containerenv"]
        .iter()
        .any(|marker| std::path::Path::new(marker).exists())
}
