//! The integration tests, one module per feature (`tests/<feature>.rs`), built as one
//! binary: each test binary links the whole gateway and its dependencies again, so one
//! binary instead of forty is most of what building the tests costs (`cargo test
//! --test integration <feature>::` runs one feature's tests).

mod common;

mod access_lists;
mod acme;
mod admin_limits;
mod cli;
mod compression;
mod concurrency;
mod connections;
mod count_failures;
mod dockerfile;
mod e2e_php_go;
mod files;
mod forwarding_headers;
mod healthcheck;
mod held_slots;
mod key_spray;
mod leaky_bucket;
mod monitoring;
mod overrides;
mod own_answers;
mod php_fpm;
mod process;
mod protocols;
mod ratelimit;
mod ratelimit_keys;
mod ratelimit_redis;
mod redis_cluster;
mod redis_connection;
mod redis_failure;
mod redis_sentinel;
mod reload;
mod request_errors;
mod request_tracing;
mod routing;
mod shaping;
mod store_conformance;
mod streaming;
mod tls;
mod upstream_pool;
mod upstream_responses;
mod upstream_servers;
