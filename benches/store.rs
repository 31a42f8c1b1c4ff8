//! Rate-limit store throughput: in-process decisions on 1 and 2 threads, and Redis
//! decisions with 64 concurrent callers against a private `redis-server`.
//!
//! `cargo bench --bench store`

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use floodgate::limit::clock::MonotonicClock;
use floodgate::limit::key::{encode_tuple, store_key};
use floodgate::limit::memory::MemoryStore;
use floodgate::limit::redis::RedisStore;
use floodgate::limit::redis::RedisTarget;
use floodgate::limit::{Algorithm, LimitCheck};

#[allow(dead_code)] // the bench uses only part of the test helper
#[path = "../tests/common/redis_server.rs"]
mod redis_server;
use redis_server::RedisServer;

/// A check that never rejects, for one of 1024 clients.
fn check(client: usize) -> LimitCheck {
    let ip = format!("10.0.{}.{}", client / 256, client % 256);
    let algorithm = Algorithm::TokenBucket {
        rate: 1e9,
        per: 1_000_000,
        burst: 1_000_000_000,
    };
    LimitCheck {
        key: store_key("bench", &encode_tuple([ip.as_bytes()]), "per_ip", &algorithm),
        algorithm,
        lockout: None,
        cost: 1,
        keep_below: 0,
        shadow: false,
    }
}

fn memory(c: &mut Criterion) {
    let store = Arc::new(MemoryStore::new(
        Arc::new(MonotonicClock::default()),
        100_000,
        prometheus_client::metrics::counter::Counter::default(),
    ));
    let checks: Arc<Vec<LimitCheck>> = Arc::new((0..1024).map(check).collect());
    let mut group = c.benchmark_group("memory_store");
    group.bench_function("decide_1_thread", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % checks.len();
            store.decide(std::slice::from_ref(&checks[i]))
        })
    });
    group.bench_function("decide_2_threads", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            let workers: Vec<_> = (0..2)
                .map(|t| {
                    let (store, checks) = (store.clone(), checks.clone());
                    std::thread::spawn(move || {
                        for i in 0..iters / 2 {
                            let check = &checks[(i as usize * 2 + t) % checks.len()];
                            std::hint::black_box(store.decide(std::slice::from_ref(check)));
                        }
                    })
                })
                .collect();
            workers.into_iter().for_each(|w| w.join().unwrap());
            start.elapsed()
        })
    });
    group.finish();
}

fn redis(c: &mut Criterion) {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let store = runtime
        .block_on(RedisStore::connect(
            &RedisTarget::Url(server.url()),
            Duration::from_secs(1),
        ))
        .unwrap();
    let checks: Arc<Vec<LimitCheck>> = Arc::new((0..1024).map(check).collect());
    let mut group = c.benchmark_group("redis_store");
    group.bench_function("decide_64_concurrent", |b| {
        b.to_async(&runtime).iter_custom(|iters| {
            let (store, checks) = (store.clone(), checks.clone());
            async move {
                let start = Instant::now();
                let callers: Vec<_> = (0..64u64)
                    .map(|caller| {
                        let (store, checks) = (store.clone(), checks.clone());
                        tokio::spawn(async move {
                            for i in (caller..iters).step_by(64) {
                                let check = &checks[i as usize % checks.len()];
                                store.decide(std::slice::from_ref(check)).await.unwrap();
                            }
                        })
                    })
                    .collect();
                for caller in callers {
                    caller.await.unwrap();
                }
                start.elapsed()
            }
        })
    });
    group.finish();
    drop(server);
}

criterion_group!(benches, memory, redis);
criterion_main!(benches);
