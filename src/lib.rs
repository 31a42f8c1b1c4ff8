//! floodgate: a rate-limiting HTTP reverse proxy.
//!
//! ```text
//! gateway.toml ─► config (raw serde ─► validated Config) ─► state::GatewayState (ArcSwap)
//!
//! client ─► server (accept, framing guard, idle connections closed, HTTP/1.1 + h2c)
//!        ─► service::handle
//!        ─► request_head::check ─► path::normalize_path ─► router::Router::lookup ─► client_ip
//!        ─► respond, or proxy::UpstreamClient (pooled keep-alive, headers rewritten)
//!        ─► body::ResponseBody (streams, then access_log + metrics)
//! ```
//!
//! `main.rs` is a thin CLI over [`Config`] and [`Gateway`]; everything else lives here so
//! that tests can run a gateway in-process on port 0.

mod access_log;
mod admin;
#[allow(unsafe_code)] // a GlobalAlloc is unsafe by definition
pub mod allocator;
mod client_ip;
pub mod config;
mod connection;
mod error;
pub mod healthcheck;
pub mod limit;
pub mod logging;
mod metrics;
pub mod path;
mod proxy;
pub mod reload;
pub mod router;
pub mod server;
pub mod service;

pub use config::{Config, ConfigErrors};
pub use server::Gateway;
