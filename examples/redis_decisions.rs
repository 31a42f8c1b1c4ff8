//! Redis decisions at saturation: many concurrent requests through one `RedisStore` (with
//! group commit) against one Redis, and what they cost Redis.
//!
//! ```sh
//! cargo run --release --example redis_decisions -- redis://127.0.0.1:6390 [callers] [seconds] [clients] [rate per_s burst]
//! ```
//!
//! Each caller decides one token bucket for one of `clients` client keys (default 10000,
//! like `redis-benchmark -r 10000`; 1 for a single busy client), as fast as it can, for
//! `seconds`. The bucket defaults to `../shared/bench/anchors.sh`'s policy for redis-cell
//! (`CL.THROTTLE key 999 1000 60 1`: 1000 tokens per 60 s, 1000 deep); `1000000000 1
//! 1000000000` never refuses and its state expires a microsecond after each write. It
//! resets Redis's statistics first and prints decisions per second, decisions per script
//! call, and Redis's time per decision: inside the script (`INFO commandstats`
//! usec_per_call ÷ decisions per call) and in all (`INFO cpu`). Pin it apart from Redis
//! (`taskset`) to measure the two sides separately.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use floodgate::limit::key::{encode_tuple, store_key};
use floodgate::limit::redis::RedisStore;
use floodgate::limit::redis::RedisTarget;
use floodgate::limit::{Algorithm, LimitCheck};

fn check(client: usize, algorithm: Algorithm) -> LimitCheck {
    let ip = format!("10.{}.{}.{}", client >> 16 & 255, client >> 8 & 255, client & 255);
    LimitCheck {
        key: store_key("bench", &encode_tuple([ip.as_bytes()]), "per_ip", &algorithm),
        algorithm,
        lockout: None,
        cost: 1,
        keep_below: 0,
        shadow: false,
    }
}

/// The value of `name:value` in an `INFO` reply.
fn info_value<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

/// `field` of a `name:field=value,...` line (`INFO commandstats`).
fn info_stat(info: &str, name: &str, field: &str) -> f64 {
    info_value(info, name)
        .and_then(|fields| {
            fields
                .split(',')
                .find_map(|f| f.strip_prefix(field)?.strip_prefix('='))
        })
        .and_then(|value| value.parse().ok())
        .unwrap_or(0.0)
}

/// Redis's CPU time so far (`INFO cpu`), in seconds.
fn redis_cpu(info: &str) -> f64 {
    ["used_cpu_sys", "used_cpu_user"]
        .iter()
        .filter_map(|name| info_value(info, name)?.parse::<f64>().ok())
        .sum()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let url = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| "redis://127.0.0.1:6390".into());
    let callers: usize = args.get(2).map_or(Ok(256), |a| a.parse())?;
    let seconds: u64 = args.get(3).map_or(Ok(5), |a| a.parse())?;
    let clients: usize = args.get(4).map_or(Ok(10_000), |a| a.parse())?;
    let rate: f64 = args.get(5).map_or(Ok(1000.0), |a| a.parse())?;
    let per_seconds: u64 = args.get(6).map_or(Ok(60), |a| a.parse())?;
    let burst: u64 = args.get(7).map_or(Ok(1000), |a| a.parse())?;
    let algorithm = Algorithm::TokenBucket {
        rate,
        per: per_seconds * 1_000_000,
        burst,
    };

    let store = RedisStore::connect(&RedisTarget::Url(url.clone()), Duration::from_secs(2)).await?;
    let checks: Arc<Vec<LimitCheck>> =
        Arc::new((0..clients).map(|client| check(client, algorithm)).collect());
    let admin = redis::Client::open(url.as_str())?;
    let mut admin = admin.get_multiplexed_async_connection().await?;
    // Warm up (and load the script), then measure from clean statistics.
    store.decide(&checks[..1]).await?;
    let cpu_before: String = redis::cmd("INFO").arg("cpu").query_async(&mut admin).await?;
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut admin)
        .await?;

    let done = Arc::new(AtomicBool::new(false));
    let decided = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..callers)
        .map(|caller| {
            let (store, checks, done, decided) =
                (store.clone(), checks.clone(), done.clone(), decided.clone());
            tokio::spawn(async move {
                let mut i = caller;
                while !done.load(Ordering::Relaxed) {
                    let check = &checks[i % checks.len()];
                    store.decide(std::slice::from_ref(check)).await.expect("decides");
                    decided.fetch_add(1, Ordering::Relaxed);
                    i += callers;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    done.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let decisions = decided.load(Ordering::Relaxed) as f64;

    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut admin)
        .await?;
    let cpu_after: String = redis::cmd("INFO").arg("cpu").query_async(&mut admin).await?;
    let calls = info_stat(&stats, "cmdstat_evalsha", "calls");
    let usec_per_call = info_stat(&stats, "cmdstat_evalsha", "usec_per_call");
    let redis_cpu_us = (redis_cpu(&cpu_after) - redis_cpu(&cpu_before)) * 1e6;
    let per_call = decisions / calls.max(1.0);
    println!(
        "callers={callers} clients={clients} seconds={elapsed:.1} decisions/s={:.0} decisions/call={per_call:.1} \
         redis usec/call={usec_per_call:.2} redis usec/decision in script={:.3} redis cpu us/decision={:.3}",
        decisions / elapsed,
        usec_per_call / per_call,
        redis_cpu_us / decisions,
    );
    Ok(())
}
