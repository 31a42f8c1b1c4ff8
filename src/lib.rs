//! floodgate: a rate-limiting HTTP reverse proxy.
//!
//! ```text
//! gateway.toml ─► config (raw serde ─► validated Config) ─► service::state::GatewayState
//!                                                            (one ArcSwap; reload swaps it)
//!
//! client ─► server (accept, hand to a worker thread; HTTP/1.1 + h2c; connection: framing
//!                   guard, send timeout, idle watchdog)
//!        ─► service::handle
//!        ─► request_head::check ─► path::normalize_path ─► router::Router::lookup ─► client_ip
//!        ─► service::limits (request_key ─► limit::store: one decision, all or nothing)
//!        ─► respond, or upstream::Upstream (servers, balancing, health, retries, cap and
//!           queue; pooled keep-alive; headers rewritten by proxy)
//!        ─► service::response_body (streams, then access_log + metrics)
//! ```
//!
//! Dependencies point one way: `server` and `upstream` ─► `workers`, `server` ─► `service` ─► (`upstream`, `proxy`, `router`,
//! `limit`, `connection`, `config`), `config` ─► (`limit`, the leaves `path` and `host`), and `upstream` ─► `limit` (a
//! forwarded request's slots, held while the app works on it); `server`, `service` and
//! `proxy` ─► `room` (the files and memory requests hold, process-wide). With `[server.tls.acme]`,
//! `service` (http-01) and `tls` (tls-alpn-01, the served certificate) ─► `acme`, which
//! keeps its state through `limit::redis`'s connections and talks to the CA through
//! `outbound`. [`limit`] is the limiter core
//! (algorithms, decisions, key encoding, the in-process store) with the Redis store in
//! [`limit::redis`]; it knows nothing of HTTP or of the configuration file.
//!
//! `main.rs` is a thin CLI over [`Config`] and [`Gateway`]; everything else lives here so
//! that tests can run a gateway in-process on port 0. docs/design.md walks through it.

// A connection's future (hyper's HTTP/1 or HTTP/2 server over the connection layers) is
// nested deeper than the default limit lets the compiler prove it `Send`.
#![recursion_limit = "256"]

#[macro_use]
mod byte_set;

mod access_log;
mod acme;
mod admin;
mod civil_time;
mod client_ip;
mod compression;
pub mod config;
mod connection;
mod error;
pub mod files;
pub mod healthcheck;
pub mod host;
pub mod limit;
pub mod logging;
mod metrics;
mod outbound;
pub mod path;
mod proxy;
pub mod reload;
mod room;
pub mod router;
pub mod server;
pub mod service;
mod tls;
mod trace;
mod upstream;
mod workers;

pub use config::{Config, ConfigErrors};
pub use server::Gateway;
