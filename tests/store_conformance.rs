//! One conformance suite, run against both stores through the gateway's own
//! [`LimitStore`]: the in-process store and Redis (a private `redis-server` per test).
//! Windows are short and tolerances honest; Redis's clock is its `TIME`, the memory
//! store's a monotonic clock. The tests of Redis's script alone ask [`RedisStore`].

use std::sync::Arc;
use std::time::Duration;

use crate::common::redis_server::RedisServer;
use floodgate::limit::key::{MAX_KEY_LEN, encode_tuple, lock_key, store_key};
use floodgate::limit::redis::RedisStore;
use floodgate::limit::redis::RedisTarget;
use floodgate::limit::store::{LimitStore, OnError, RedisSeries, StoreAnswer};
use floodgate::limit::{Algorithm, LimitCheck, LimitDecision, Lockout, Outcome, Peeked};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

const MS: u64 = 1_000;

/// A [`LimitStore`] whose every operation must succeed: a failure fails the test.
struct Store(LimitStore);

impl Store {
    async fn decide(&self, checks: &[LimitCheck]) -> Vec<LimitDecision> {
        match self.0.decide(checks, OnError::Deny).await {
            StoreAnswer::Decided(decisions) => decisions.into_vec(),
            StoreAnswer::Failed(fallback) => panic!("the store failed: {fallback:?}"),
        }
    }

    async fn refund(&self, check: &LimitCheck) {
        self.0.refund(check).await.expect("the store refunds");
    }

    async fn peek(&self, check: &LimitCheck) -> Peeked {
        self.0.peek(check).await.expect("the store reads")
    }

    async fn clear(&self, check: &LimitCheck) {
        self.0.clear(check).await.expect("the store clears");
    }

    async fn lock(&self, check: &LimitCheck) {
        assert!(check.lockout.is_some(), "a check with a lock-out");
        self.0.lock(check, OnError::Deny).await.expect("the store locks");
    }

    async fn one(&self, check: &LimitCheck) -> LimitDecision {
        self.decide(std::slice::from_ref(check)).await[0]
    }
}

fn memory() -> Store {
    Store(LimitStore::memory(Counter::default()))
}

/// The store on a private Redis, connected.
async fn redis() -> (Store, RedisServer) {
    let server = tokio::task::spawn_blocking(RedisServer::start).await.unwrap();
    let store = LimitStore::redis(
        &RedisTarget::Url(server.url()),
        Duration::from_secs(2),
        "fg",
        RedisSeries::default(),
    )
    .expect("a Redis store");
    assert!(store.wait_ready(Duration::from_secs(10)).await, "connected");
    (Store(store), server)
}

/// Redis's store alone (no heartbeat, no breaker), for the tests of what its script does
/// and writes.
async fn redis_alone() -> (RedisStore, RedisServer) {
    let server = tokio::task::spawn_blocking(RedisServer::start).await.unwrap();
    let store = RedisStore::connect(&RedisTarget::Url(server.url()), Duration::from_secs(2))
        .await
        .expect("connect");
    (store, server)
}

fn check(name: &str, algorithm: Algorithm) -> LimitCheck {
    let tuple = encode_tuple([b"198.51.100.7".as_slice()]);
    LimitCheck {
        key: store_key("fg", &tuple, name, &algorithm),
        algorithm,
        lockout: None,
        cost: 1,
        keep_below: 0,
        shadow: false,
    }
}

fn fixed(limit: u64, window_ms: u64) -> Algorithm {
    Algorithm::FixedWindow {
        limit,
        window: window_ms * MS,
    }
}

fn sliding(limit: u64, window_ms: u64) -> Algorithm {
    Algorithm::SlidingWindow {
        limit,
        window: window_ms * MS,
    }
}

fn bucket(rate: f64, per_ms: u64, burst: u64) -> Algorithm {
    Algorithm::TokenBucket {
        rate,
        per: per_ms * MS,
        burst,
    }
}

async fn admitted_count(store: &Store, check: &LimitCheck, attempts: usize) -> usize {
    let mut admitted = 0;
    for _ in 0..attempts {
        if store.one(check).await.outcome.admits() {
            admitted += 1;
        }
    }
    admitted
}

/// Sends `attempts` concurrent requests, each with all of `checks`, and returns their
/// decisions (with the Redis store, the requests share script calls).
async fn concurrent_decisions(
    store: &Arc<Store>,
    checks: &[LimitCheck],
    attempts: usize,
) -> Vec<Vec<LimitDecision>> {
    let tasks: Vec<_> = (0..attempts)
        .map(|_| {
            let (store, checks) = (store.clone(), checks.to_vec());
            tokio::spawn(async move { store.decide(&checks).await })
        })
        .collect();
    let mut decisions = Vec::new();
    for task in tasks {
        decisions.push(task.await.unwrap());
    }
    decisions
}

/// The outcomes of [`concurrent_decisions`].
async fn concurrent_outcomes(
    store: &Arc<Store>,
    checks: &[LimitCheck],
    attempts: usize,
) -> Vec<Vec<Outcome>> {
    let decisions = concurrent_decisions(store, checks, attempts).await;
    decisions
        .iter()
        .map(|request| request.iter().map(|d| d.outcome).collect())
        .collect()
}

fn admitted(outcomes: &[Vec<Outcome>]) -> usize {
    outcomes
        .iter()
        .filter(|request| request.iter().all(|o| o.admits()))
        .count()
}

/// Every algorithm admits exactly its capacity out of 200 simultaneous requests.
async fn exact_count_under_concurrency(store: Store) {
    let store = Arc::new(store);
    let minute = 60_000 * MS;
    let limits = [
        (check("conc-fw", fixed(50, 60_000)), 50),
        (check("conc-sw", sliding(50, 60_000)), 50),
        (check("conc-tb", bucket(1.0, 60_000, 50)), 50),
        // A leaky bucket admits the request at the head and `burst` waiting behind it.
        (
            check(
                "conc-lb",
                Algorithm::LeakyBucket {
                    rate: 1.0,
                    per: minute,
                    burst: 50,
                },
            ),
            51,
        ),
    ];
    for (limit, capacity) in limits {
        let outcomes = concurrent_outcomes(&store, std::slice::from_ref(&limit), 200).await;
        assert_eq!(admitted(&outcomes), capacity, "{}", limit.key);
    }
}

/// Simultaneous requests on one key (with Redis, runs of them in one script call) are
/// decided one after another: each admitted request sees what the one before it left, so
/// their remaining counts are every count from the capacity down, once each; and a fixed
/// window that already existed counts every admission of the burst.
async fn simultaneous_requests_on_one_key_are_decided_in_turn(store: Store) {
    let store = Arc::new(store);
    let window = check("turn-fw", fixed(100, 60_000));
    assert_eq!(store.one(&window).await.remaining, 99);
    let limits: [(LimitCheck, u64); 3] = [
        (window, 99),
        (check("turn-sw", sliding(50, 60_000)), 50),
        (check("turn-tb", bucket(1.0, 60_000, 50)), 50),
    ];
    for (limit, capacity) in limits {
        let decided = concurrent_decisions(&store, std::slice::from_ref(&limit), 120).await;
        let mut remaining: Vec<u64> = decided
            .iter()
            .map(|request| request[0])
            .filter(|d| d.outcome.admits())
            .map(|d| d.remaining)
            .collect();
        remaining.sort_unstable();
        let every_count: Vec<u64> = (capacity.saturating_sub(120)..capacity).collect();
        assert_eq!(remaining, every_count, "{}", limit.key);
        let refused = decided.iter().filter(|request| !request[0].outcome.admits());
        assert!(
            refused.clone().all(|request| request[0].remaining == 0),
            "{}",
            limit.key
        );
        assert_eq!(
            refused.count(),
            120usize.saturating_sub(capacity as usize),
            "{}",
            limit.key
        );
    }
    // The window held 1 before the burst and 99 more after it: full.
    assert_eq!(
        store.one(&check("turn-fw", fixed(100, 60_000))).await.outcome,
        Outcome::Rejected
    );
    assert_eq!(
        store.one(&check("turn-fw", fixed(101, 60_000))).await.remaining,
        0
    );
}

/// Under concurrency, a request that one limit refuses consumes nothing from the others,
/// a refusal starts the lock-out, and later requests in the same burst see the lock.
async fn all_or_nothing_and_lockout_under_concurrency(store: Store) {
    let store = Arc::new(store);
    let wide = check("conc-wide", fixed(1_000, 60_000));
    let mut narrow = check("conc-narrow", fixed(30, 60_000));
    let tuple = encode_tuple([b"198.51.100.7".as_slice()]);
    narrow.lockout = Some(Lockout::on_refusal(
        lock_key("fg", &tuple, "conc-narrow"),
        60_000 * MS,
    ));
    let outcomes = concurrent_outcomes(&store, &[wide.clone(), narrow], 200).await;
    assert_eq!(admitted(&outcomes), 30);
    let locked = outcomes
        .iter()
        .filter(|request| request[1] == Outcome::Locked)
        .count();
    assert!(locked >= 100, "{locked} of 170 refusals saw the lock");
    // The wide limit gave only the 30 admitted requests.
    assert_eq!(store.one(&wide).await.remaining, 1_000 - 31);
}

/// Busy clients and clients seen once, decided together (with Redis, in shared script
/// calls, where a key used once is written at once and a repeated one at the end): each
/// key's count is exact, and what a single request consumed is there for the next.
async fn busy_and_one_off_clients_in_one_burst(store: Store) {
    let store = Arc::new(store);
    let client = |i: usize, algorithm: Algorithm| {
        let tuple = encode_tuple([format!("203.0.113.{i}").as_bytes()]);
        LimitCheck {
            key: store_key("fg", &tuple, "mixed", &algorithm),
            algorithm,
            lockout: None,
            cost: 1,
            keep_below: 0,
            shadow: false,
        }
    };
    let bucket = bucket(1.0, 60_000, 1);
    let busy: Vec<LimitCheck> = (0..10).map(|i| client(i, fixed(5, 60_000))).collect();
    let one_off: Vec<LimitCheck> = (100..140).map(|i| client(i, bucket)).collect();
    let mut tasks = Vec::new();
    for round in 0..8 {
        for check in busy.iter().chain(if round == 0 { &one_off[..] } else { &[] }) {
            let (store, check) = (store.clone(), check.clone());
            tasks.push(tokio::spawn(async move {
                (check.key.clone(), store.one(&check).await.outcome)
            }));
        }
    }
    let mut admitted_per_key = std::collections::HashMap::new();
    for task in tasks {
        let (key, outcome) = task.await.unwrap();
        *admitted_per_key.entry(key).or_insert(0) += usize::from(outcome.admits());
    }
    for check in &busy {
        assert_eq!(admitted_per_key[&check.key], 5, "{}", check.key);
    }
    for check in &one_off {
        assert_eq!(admitted_per_key[&check.key], 1, "{}", check.key);
        assert_eq!(store.one(check).await.outcome, Outcome::Rejected, "{}", check.key);
    }
}

/// A bucket as deep as the configuration allows (2^63 - 1 tokens, beyond a double's exact
/// integers): its state is written and read back without overflowing, so it keeps
/// admitting. (Its `remaining` is past what Redis's Lua replies carry: not asserted.)
async fn a_bucket_as_deep_as_the_configuration_allows(store: Store) {
    let limit = check("deep", bucket(1.0, 1_000, i64::MAX as u64));
    assert_eq!(admitted_count(&store, &limit, 3).await, 3);
}

async fn fixed_window_resets(store: Store) {
    let limit = check("fw", fixed(2, 300));
    let started = std::time::Instant::now();
    assert_eq!(admitted_count(&store, &limit, 3).await, 2);
    let rejected = store.one(&limit).await;
    assert_eq!(rejected.outcome, Outcome::Rejected);
    assert!(rejected.retry_after <= Duration::from_millis(300), "{rejected:?}");
    // The window began with the first call: what is left of it, and no less.
    let elapsed = started.elapsed();
    assert!(
        rejected.retry_after + elapsed + Duration::from_millis(1) >= Duration::from_millis(300),
        "{rejected:?} after {elapsed:?}"
    );
    tokio::time::sleep(rejected.retry_after + Duration::from_millis(30)).await;
    let fresh = store.one(&limit).await;
    assert_eq!((fresh.outcome, fresh.remaining), (Outcome::Allowed, 1));
}

async fn token_bucket_burst_then_rate(store: Store) {
    // One token a second: the calls take a small part of one, even on a loaded machine.
    let limit = check("tb", bucket(1.0, 1_000, 5));
    assert_eq!(admitted_count(&store, &limit, 8).await, 5);
    let rejected = store.one(&limit).await;
    assert_eq!(rejected.outcome, Outcome::Rejected);
    assert!(rejected.retry_after <= Duration::from_secs(1), "{rejected:?}");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(admitted_count(&store, &limit, 3).await, 1);
}

async fn leaky_bucket_spaces_and_bounds_the_queue(store: Store) {
    let limit = check(
        "lb",
        Algorithm::LeakyBucket {
            rate: 20.0,
            per: 1_000 * MS,
            burst: 3,
        },
    );
    // Request i waits 50 ms × i less the time that passed since the first was decided,
    // which lies between zero and what has passed here since the first call started: the
    // bounds hold however slow the machine is.
    let first_sent = std::time::Instant::now();
    let mut delays = Vec::new();
    let mut elapsed = Vec::new();
    for _ in 0..5 {
        delays.push(store.one(&limit).await.outcome);
        elapsed.push(first_sent.elapsed());
    }
    assert_eq!(delays[0], Outcome::Allowed);
    for (i, outcome) in delays.iter().enumerate().take(4).skip(1) {
        let Outcome::Delayed(delay) = *outcome else {
            panic!("request {i} should wait: {delays:?}")
        };
        let full = Duration::from_millis(50 * i as u64);
        let slack = Duration::from_millis(1);
        assert!(
            delay <= full + slack && delay + elapsed[i] + slack >= full,
            "request {i} waits {delay:?}, expected {full:?} less at most {:?}: {delays:?}",
            elapsed[i]
        );
    }
    // The fifth would wait 200 ms less the time passed, beyond the 150 ms queue while
    // under 50 ms have passed (always, but on a machine stalled for that long).
    if elapsed[4] < Duration::from_millis(50) {
        assert_eq!(delays[4], Outcome::Rejected, "{delays:?}");
    }
}

async fn sliding_window_admits_no_double_burst(store: Store) {
    let limit = check("sw", sliding(10, 1_000));
    assert_eq!(admitted_count(&store, &limit, 10).await, 10);
    // Whether or not a window boundary falls here, the previous window still weighs in.
    assert!(admitted_count(&store, &limit, 10).await <= 1);
}

async fn lockout_outlives_the_window(store: Store) {
    let mut limit = check("lo", fixed(1, 200));
    let tuple = encode_tuple([b"198.51.100.7".as_slice()]);
    limit.lockout = Some(Lockout::on_refusal(lock_key("fg", &tuple, "lo"), 700 * MS));
    assert!(store.one(&limit).await.outcome.admits());
    let first = store.one(&limit).await;
    assert_eq!(first.outcome, Outcome::Rejected);
    assert!(first.retry_after >= Duration::from_millis(690), "{first:?}");
    assert!(
        first.reset >= Duration::from_millis(690),
        "the lock decides the reset: {first:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let locked = store.one(&limit).await;
    assert_eq!(locked.outcome, Outcome::Locked);
    assert!(locked.retry_after <= Duration::from_millis(400), "{locked:?}");
    tokio::time::sleep(locked.retry_after + Duration::from_millis(30)).await;
    assert!(store.one(&limit).await.outcome.admits());
}

/// A failure-counting limit's lock-out: its refusal (of attempts that may still turn out
/// to be successes) starts no lock, but a lock started by a counted failure refuses.
async fn a_lockout_not_started_by_refusal_still_refuses_while_it_runs(store: Store) {
    let mut limit = check("fail", fixed(1, 60_000));
    let tuple = encode_tuple([b"198.51.100.7".as_slice()]);
    limit.lockout = Some(Lockout {
        key: lock_key("fg", &tuple, "fail"),
        micros: 60_000 * MS,
        starts_on_refusal: false,
    });
    assert!(store.one(&limit).await.outcome.admits());
    let refused = store.one(&limit).await;
    assert_eq!(refused.outcome, Outcome::Rejected, "{refused:?}");
    assert!(
        refused.retry_after <= Duration::from_secs(60),
        "the window decides, no lock: {refused:?}"
    );
    assert_eq!(store.peek(&limit).await.lock_left, None, "no lock started");
    // The attempt in flight was a success: its unit comes back, and the key has room.
    store.refund(&limit).await;
    assert!(store.one(&limit).await.outcome.admits());
    // A failure took the last of the room: the lock starts, and refuses from then on.
    store.lock(&limit).await;
    store.refund(&limit).await;
    let locked = store.one(&limit).await;
    assert_eq!(locked.outcome, Outcome::Locked, "{locked:?}");
    assert!(locked.retry_after > Duration::from_secs(59), "{locked:?}");
}

async fn cost_above_one(store: Store) {
    let mut limit = check("cost", fixed(10, 60_000));
    limit.cost = 4;
    assert!(store.one(&limit).await.outcome.admits());
    assert!(store.one(&limit).await.outcome.admits());
    let refused = store.one(&limit).await;
    assert_eq!((refused.outcome, refused.remaining), (Outcome::Rejected, 2));
    limit.cost = 2;
    let last = store.one(&limit).await;
    assert_eq!((last.outcome, last.remaining), (Outcome::Allowed, 0));
}

async fn all_or_nothing_across_limits(store: Store) {
    let wide = check("wide", fixed(10, 60_000));
    let narrow = check("narrow", fixed(1, 60_000));
    let both = [wide.clone(), narrow];
    assert!(store.decide(&both).await.iter().all(|d| d.outcome.admits()));
    for _ in 0..5 {
        let refused = store.decide(&both).await;
        assert_eq!(refused[0].outcome, Outcome::Allowed);
        assert_eq!(refused[1].outcome, Outcome::Rejected);
    }
    // Five refusals consumed nothing from `wide`.
    assert_eq!(store.one(&wide).await.remaining, 8);
}

async fn a_shadow_limit_never_refuses(store: Store) {
    let enforced = check("enforced", fixed(10, 60_000));
    let mut shadow = check("shadow", fixed(1, 60_000));
    shadow.shadow = true;
    let both = [enforced.clone(), shadow];
    for i in 0..3 {
        let decided = store.decide(&both).await;
        assert_eq!(decided[0].outcome, Outcome::Allowed, "request {i}");
        let expected = if i == 0 {
            Outcome::Allowed
        } else {
            Outcome::Rejected
        };
        assert_eq!(decided[1].outcome, expected, "request {i}");
    }
    // The shadow rejections did not stop the enforced limit from counting.
    assert_eq!(store.one(&enforced).await.remaining, 6);
}

async fn a_leaky_bucket_slot_can_be_given_back(store: Store) {
    let limit = check(
        "refund",
        Algorithm::LeakyBucket {
            rate: 10.0,
            per: 1_000 * MS,
            burst: 5,
        },
    );
    assert_eq!(store.one(&limit).await.outcome, Outcome::Allowed);
    assert!(matches!(store.one(&limit).await.outcome, Outcome::Delayed(_)));
    store.refund(&limit).await;
    // The slot given back is taken by the next request: ~100 ms again, not ~200 ms.
    let Outcome::Delayed(delay) = store.one(&limit).await.outcome else {
        panic!("held")
    };
    assert!(delay <= Duration::from_millis(105), "{delay:?}");
}

async fn tokens_and_window_counts_can_be_given_back(store: Store) {
    let tokens = check("refund-tokens", bucket(1.0, 3_600_000, 3));
    assert_eq!(admitted_count(&store, &tokens, 2).await, 2);
    store.refund(&tokens).await;
    // One of the two tokens came back: two admitted, not one.
    assert_eq!(admitted_count(&store, &tokens, 3).await, 2);
    let window = check("refund-window", sliding(3, 3_600_000));
    assert_eq!(admitted_count(&store, &window, 3).await, 3);
    store.refund(&window).await;
    assert_eq!(admitted_count(&store, &window, 2).await, 1);
}

async fn an_edited_limit_applies_at_once(store: Store) {
    let small = check("edit", fixed(2, 60_000));
    assert_eq!(admitted_count(&store, &small, 3).await, 2);
    let larger = check("edit", fixed(5, 60_000));
    assert_eq!(admitted_count(&store, &larger, 5).await, 3);
    let leaky = |rate| {
        check(
            "edit-bucket",
            Algorithm::LeakyBucket {
                rate,
                per: 1_000 * MS,
                burst: 2,
            },
        )
    };
    assert_eq!(admitted_count(&store, &leaky(1000.0), 3).await, 3);
    // A much slower rate: the queue left behind is clamped, not a spurious denial.
    assert!(store.one(&leaky(1.0)).await.outcome.admits());
    // Another algorithm under the same limit name starts afresh (no WRONGTYPE in Redis).
    let as_token_bucket = check("edit", bucket(1.0, 1_000, 2));
    assert_eq!(admitted_count(&store, &as_token_bucket, 3).await, 2);
}

/// Reading a key's state consumes nothing, and tells what the next request would get,
/// for every algorithm; clearing a key makes it fresh and lifts its lock.
async fn a_key_is_read_without_consuming_and_cleared(store: Store) {
    for (i, algorithm) in [
        fixed(3, 60_000),
        sliding(3, 60_000),
        bucket(1.0, 60_000, 3),
        Algorithm::LeakyBucket {
            rate: 1.0,
            per: 60_000 * MS,
            burst: 2,
        },
    ]
    .into_iter()
    .enumerate()
    {
        // One limit name per algorithm: each starts fresh.
        let name = format!("peek-{i}");
        let mut limit = check(&name, algorithm);
        let tuple = encode_tuple([b"198.51.100.7".as_slice()]);
        limit.lockout = Some(Lockout::on_refusal(lock_key("fg", &tuple, &name), 3_600_000 * MS));
        let fresh = store.peek(&limit).await.key_state(&algorithm);
        assert_eq!(fresh.remaining, algorithm.capacity(), "{algorithm:?}");
        assert_eq!(
            store.peek(&limit).await.key_state(&algorithm).remaining,
            algorithm.capacity()
        );
        let decided = store.one(&limit).await;
        assert!(decided.outcome.admits(), "{algorithm:?}");
        let read = store.peek(&limit).await.key_state(&algorithm);
        assert_eq!(
            read.remaining, decided.remaining,
            "{algorithm:?}: the read disagrees with the decision"
        );
        assert_eq!(read.locked, Duration::ZERO);
        // A lock shows, and clearing lifts it and the count.
        store.lock(&limit).await;
        let locked = store.peek(&limit).await.key_state(&algorithm);
        assert!(
            locked.locked > Duration::from_secs(3590),
            "{algorithm:?}: {locked:?}"
        );
        assert_eq!(locked.remaining, 0);
        assert_eq!(store.one(&limit).await.outcome, Outcome::Locked);
        store.clear(&limit).await;
        let cleared = store.peek(&limit).await.key_state(&algorithm);
        assert_eq!(
            (cleared.remaining, cleared.locked),
            (algorithm.capacity(), Duration::ZERO)
        );
        assert!(store.one(&limit).await.outcome.admits());
    }
}

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod memory_store {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name(super::memory()).await;
                }
            )*
        }
        mod redis_store {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let (store, _server) = super::redis().await;
                    super::$name(store).await;
                }
            )*
        }
    };
}

conformance!(
    exact_count_under_concurrency,
    simultaneous_requests_on_one_key_are_decided_in_turn,
    busy_and_one_off_clients_in_one_burst,
    a_bucket_as_deep_as_the_configuration_allows,
    all_or_nothing_and_lockout_under_concurrency,
    fixed_window_resets,
    token_bucket_burst_then_rate,
    leaky_bucket_spaces_and_bounds_the_queue,
    sliding_window_admits_no_double_burst,
    lockout_outlives_the_window,
    a_lockout_not_started_by_refusal_still_refuses_while_it_runs,
    cost_above_one,
    all_or_nothing_across_limits,
    a_shadow_limit_never_refuses,
    a_leaky_bucket_slot_can_be_given_back,
    tokens_and_window_counts_can_be_given_back,
    an_edited_limit_applies_at_once,
    a_key_is_read_without_consuming_and_cleared,
);

/// Redis `TIME` in microseconds.
fn redis_now(server: &RedisServer) -> u64 {
    let time = server.cli(&["time"]);
    let mut parts = time.lines().map(|line| line.trim().parse::<u64>().unwrap());
    parts.next().unwrap() * 1_000_000 + parts.next().unwrap()
}

/// The numbers of a packed state (':' and then little-endian doubles), as stored in Redis.
async fn packed_state(server: &RedisServer, key: &str) -> Vec<f64> {
    let client = redis::Client::open(server.url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let bytes: Vec<u8> = redis::cmd("GET")
        .arg(key)
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(bytes.first(), Some(&b':'), "{bytes:?}");
    bytes[1..]
        .chunks(8)
        .map(|double| f64::from_le_bytes(double.try_into().unwrap()))
        .collect()
}

/// A stored value in no form this version writes (here the text states of unreleased
/// builds: "tokens:updated", "index:current:previous", "tat:step") reads as no state: the
/// key starts afresh, its decisions do not fail, and it is written back packed; a refund
/// has nothing to give back to it.
#[tokio::test]
async fn a_state_in_no_known_form_starts_the_key_afresh() {
    let (store, server) = redis().await;
    let server = &server;
    let hour = 3_600_000 * MS;
    let now = redis_now(server);

    let tokens = check("text-bucket", bucket(1.0, 3_600_000, 10));
    let text = format!("3:{now}");
    server.cli(&["set", &tokens.key, &text, "px", "60000"]);
    store.refund(&tokens).await;
    assert_eq!(server.cli(&["get", &tokens.key]).trim(), text);
    // A full bucket of 10, not the 3 the text says.
    assert_eq!(admitted_count(&store, &tokens, 4).await, 4);
    let state = packed_state(server, &tokens.key).await;
    assert_eq!(state.len(), 2, "tokens and updated");
    assert!((state[0] - 6.0).abs() < 0.001, "left {state:?}");

    let window = check("text-window", sliding(5, 3_600_000));
    let index = now / hour;
    server.cli(&["set", &window.key, &format!("{index}:3:0"), "px", "60000"]);
    // All five of the window, not the two the text leaves.
    assert_eq!(admitted_count(&store, &window, 6).await, 5);
    assert_eq!(packed_state(server, &window.key).await, [index as f64, 5.0, 0.0]);

    let queue = check(
        "text-queue",
        Algorithm::LeakyBucket {
            rate: 1.0,
            per: hour,
            burst: 1,
        },
    );
    let step = hour as f64;
    server.cli(&[
        "set",
        &queue.key,
        &format!("{}:{step}", now + hour),
        "px",
        "60000",
    ]);
    // An empty queue: the first request goes at once (the text says one already waits).
    assert_eq!(store.one(&queue).await.outcome, Outcome::Allowed);
    assert_eq!(packed_state(server, &queue.key).await.len(), 2, "tat and step");
}

/// Times longer than the script's reply carries exactly (it caps them at 2^50 µs, about 35
/// years, so that 4 × reset + outcome stays exact in a double) still come back with the
/// right outcome, and the capped time: a century-long lock-out's refusal and lock (a
/// request with a lock-out), and a queue whose turn is a century away (a one-check request).
#[tokio::test]
async fn a_century_long_lockout_is_still_a_lockout() {
    let (store, _server) = redis().await;
    let century = 100 * 365 * 86_400_000 * MS;
    let mut limit = check("century", fixed(1, 60_000));
    let tuple = encode_tuple([b"198.51.100.7".as_slice()]);
    limit.lockout = Some(Lockout::on_refusal(lock_key("fg", &tuple, "century"), century));
    assert!(store.one(&limit).await.outcome.admits());
    let longest = Duration::from_micros(1 << 50);
    let refused = store.one(&limit).await;
    assert_eq!(
        (refused.outcome, refused.retry_after, refused.reset),
        (Outcome::Rejected, longest, longest)
    );
    let locked = store.one(&limit).await;
    assert_eq!(
        (locked.outcome, locked.retry_after, locked.reset),
        (Outcome::Locked, longest, longest)
    );

    let queue = check(
        "century-queue",
        Algorithm::LeakyBucket {
            rate: 1.0,
            per: century,
            burst: 1,
        },
    );
    assert_eq!(store.one(&queue).await.outcome, Outcome::Allowed);
    let held = store.one(&queue).await;
    assert_eq!((held.outcome, held.reset), (Outcome::Delayed(longest), longest));
}

/// A token bucket's or a fixed window's run (consecutive requests of one client, answered
/// by the script as a whole and worked out by the gateway) is decided to the bit as the
/// same requests are one by one: in one call, so at one Redis time, the run's key and two
/// keys whose requests alternate (each decided on its own) start from the same state (for
/// the bucket, the same fractional tokens) and must get the same six decisions: outcome,
/// remaining, reset and retry time.
#[tokio::test]
async fn a_token_bucket_run_is_decided_as_its_requests_one_by_one() {
    let decided = run_and_alone(bucket(3.0, 7_000, 7)).await;
    let remaining: Vec<u64> = decided.iter().map(|d| d.remaining).collect();
    assert_eq!(remaining, [3, 1, 1, 1, 1, 1]);
    // A fraction of a token short: the retry time is under the 2.33 s a token takes.
    let retry = decided[2].retry_after;
    assert!(
        retry > Duration::ZERO && retry < Duration::from_millis(2_334),
        "{retry:?}"
    );
}

#[tokio::test]
async fn a_fixed_window_run_is_decided_as_its_requests_one_by_one() {
    let decided = run_and_alone(fixed(7, 60_000)).await;
    let remaining: Vec<u64> = decided.iter().map(|d| d.remaining).collect();
    assert_eq!(remaining, [3, 1, 1, 1, 1, 1]);
    let refused = decided[2];
    assert_eq!(refused.retry_after, refused.reset);
    assert!(refused.reset > Duration::from_secs(59), "{refused:?}");
}

/// Six requests of cost 2 on `algorithm`, after one that leaves it 5 (tokens or room): as
/// a run on one key, and alternating on two others, all in one script call. Returns the
/// run's decisions, having checked that both other keys got the same decisions and were
/// left the same stored state and expiry, and that the run admitted two and refused four.
async fn run_and_alone(algorithm: Algorithm) -> Vec<LimitDecision> {
    let (redis, server) = redis_alone().await;
    let limit = |name: &str| LimitCheck {
        cost: 2,
        keep_below: 0,
        ..check(name, algorithm)
    };
    let [run, a, b] = ["run", "alone-a", "alone-b"].map(limit);
    // On this current-thread runtime, every request joins the group-commit queue before its
    // dispatcher runs: one script call, and the requests in it in this order.
    let one_call = async |requests: Vec<&LimitCheck>| {
        let calls = server.command_calls("evalsha");
        let decided = futures_util::future::join_all(
            requests
                .into_iter()
                .map(|check| redis.decide(std::slice::from_ref(check))),
        )
        .await;
        assert_eq!(server.command_calls("evalsha"), calls + 1, "one script call");
        decided
            .into_iter()
            .map(|decisions| decisions.expect("redis decides")[0])
            .collect::<Vec<_>>()
    };
    // The first call loads the script (a refused EVALSHA, then a second one).
    redis
        .decide(&[check("load-script", fixed(1, 60_000))])
        .await
        .expect("redis decides");
    // The same state for all three: 5 left (for the bucket, a fraction more by the next call).
    one_call(vec![&run, &a, &b]).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    let mut requests = vec![&run; 6];
    for _ in 0..6 {
        requests.extend([&a, &b]);
    }
    let decided = one_call(requests).await;
    let (run_decided, alone) = decided.split_at(6);
    // A fixed window's end is read as PTTL, which Redis 7.0 counts on its running clock,
    // not the script's `TIME`: keys read in one call a millisecond boundary apart see ends
    // 1 ms apart. The reference keys' reset may differ by that much; nothing else may.
    let window_end_read_late = |decided: &LimitDecision| {
        let mut decided = *decided;
        if matches!(algorithm, Algorithm::FixedWindow { .. })
            && decided.reset + Duration::from_millis(1) == run_decided[0].reset
        {
            decided.reset += Duration::from_millis(1);
            if decided.outcome == Outcome::Rejected {
                decided.retry_after += Duration::from_millis(1);
            }
        }
        decided
    };
    let alone_a: Vec<LimitDecision> = alone.iter().step_by(2).map(window_end_read_late).collect();
    let alone_b: Vec<LimitDecision> = alone
        .iter()
        .skip(1)
        .step_by(2)
        .map(window_end_read_late)
        .collect();
    assert_eq!(run_decided, alone_a);
    assert_eq!(run_decided, alone_b);
    let outcomes: Vec<Outcome> = run_decided.iter().map(|d| d.outcome).collect();
    assert_eq!(
        outcomes,
        [Outcome::Allowed, Outcome::Allowed]
            .into_iter()
            .chain([Outcome::Rejected; 4])
            .collect::<Vec<_>>()
    );
    // And the run left the state and expiry the requests one by one did.
    let stored =
        |check: &LimitCheck| ["get", "pexpiretime"].map(|command| server.cli(&[command, check.key.as_str()]));
    assert_eq!(stored(&run), stored(&a));
    assert_eq!(stored(&run), stored(&b));
    run_decided.to_vec()
}

/// Calls of more keys than one `MGET` (1,000) or one `MSET` (500 pairs) carries: requests
/// of 64 limits each, sent together, are decided and every key is written. On this
/// current-thread runtime every request joins the group-commit queue before its dispatcher
/// runs: one script call of 3,840 keys, however slowly the machine runs the tasks.
#[tokio::test]
async fn a_call_of_thousands_of_keys_reads_and_writes_them_all() {
    let (store, server) = redis_alone().await;
    let bucket = bucket(1.0, 3_600_000, 1);
    let requests: Vec<Vec<LimitCheck>> = (0..60)
        .map(|request| {
            (0..64)
                .map(|limit| check(&format!("wide{request}-{limit}"), bucket))
                .collect()
        })
        .collect();
    let decide_all = |expected: Outcome| {
        let tasks: Vec<_> = requests
            .iter()
            .map(|checks| {
                let (store, checks) = (store.clone(), checks.clone());
                tokio::spawn(async move { store.decide(&checks).await.expect("redis decides") })
            })
            .collect();
        async move {
            for task in tasks {
                let decisions = task.await.unwrap();
                assert_eq!(decisions.len(), 64);
                assert!(decisions.iter().all(|d| d.outcome == expected), "{decisions:?}");
            }
        }
    };
    decide_all(Outcome::Allowed).await;
    // The call spanned several MGETs and MSETs (commands a script runs are counted; so are
    // the store's heartbeat scripts).
    let [mget, mset, evalsha] = ["mget", "mset", "evalsha"].map(|command| server.command_calls(command));
    assert!(mget > evalsha, "{mget} MGET, {evalsha} EVALSHA");
    assert!(mset > evalsha, "{mset} MSET, {evalsha} EVALSHA");
    // Every key was written: each bucket's one token is gone.
    decide_all(Outcome::Rejected).await;
}

#[tokio::test]
async fn every_redis_key_has_a_ttl_and_fits_200_bytes() {
    let (store, server) = redis_alone().await;
    let long_client = "x".repeat(5_000);
    let tuple = encode_tuple([long_client.as_bytes(), b"GET"]);
    let algorithms = [
        fixed(1, 60_000),
        sliding(1, 60_000),
        bucket(1.0, 60_000, 1),
        Algorithm::LeakyBucket {
            rate: 1.0,
            per: 60_000 * MS,
            burst: 1,
        },
    ];
    for (i, algorithm) in algorithms.into_iter().enumerate() {
        let name = format!("limit{i}");
        let limit = LimitCheck {
            key: store_key("fg", &tuple, &name, &algorithm),
            algorithm,
            lockout: Some(Lockout::on_refusal(lock_key("fg", &tuple, &name), 60_000 * MS)),
            cost: 1,
            keep_below: 0,
            shadow: false,
        };
        for _ in 0..3 {
            store
                .decide(std::slice::from_ref(&limit))
                .await
                .expect("redis decides");
        }
    }
    let keys: Vec<String> = server.cli(&["--scan"]).lines().map(str::to_owned).collect();
    assert_eq!(keys.len(), 8, "{keys:?}");
    for key in keys {
        assert!(key.len() <= MAX_KEY_LEN, "{key}");
        let ttl: i64 = server.cli(&["pttl", &key]).trim().parse().unwrap();
        assert!(ttl > 0, "{key} has no TTL ({ttl})");
    }
}

/// Every store operation, under each `on_error`, with Redis gone: each failure is
/// counted in `floodgate_store_errors_total`, and becomes what the policy makes of that
/// operation (docs/operations.md#when-redis-fails) — the same for all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_fails_by_the_one_rule_under_each_policy() {
    use floodgate::limit::store::{Fallback, Unit};

    let mut server = tokio::task::spawn_blocking(RedisServer::start).await.unwrap();
    let errors = Counter::default();
    let breaker_open = Gauge::default();
    let store = LimitStore::redis(
        &RedisTarget::Url(server.url()),
        Duration::from_millis(100),
        "fg",
        RedisSeries {
            errors: errors.clone(),
            breaker_open: breaker_open.clone(),
            ..RedisSeries::default()
        },
    )
    .expect("a Redis store");
    assert!(store.wait_ready(Duration::from_secs(2)).await);
    assert_eq!(breaker_open.get(), 0);
    let lease = store
        .acquire("fg:leased", 1, Duration::from_secs(30), OnError::Allow)
        .await
        .expect("Redis answers")
        .expect("a slot is free");
    tokio::task::block_in_place(|| server.kill());
    // A lease given back with Redis gone: lost (it expires), and counted.
    let before = errors.get();
    drop(lease);
    wait_for_more(&errors, before, "a released lease").await;

    let mut limit = check("ops", fixed(2, 60_000));
    let tuple = encode_tuple([b"198.51.100.7".as_slice()]);
    limit.lockout = Some(Lockout::on_refusal(lock_key("fg", &tuple, "ops"), 60_000 * MS));
    for on_error in [OnError::Allow, OnError::Deny, OnError::Local] {
        let failed = |before: u64| {
            let errors = errors.clone();
            move |what: &str| assert!(errors.get() > before, "{on_error:?} {what}: not counted")
        };
        // The request path's questions: admitted, refused, or asked of the fallback.
        let before = errors.get();
        match (
            store.decide(std::slice::from_ref(&limit), on_error).await,
            on_error,
        ) {
            (StoreAnswer::Failed(Fallback::Admit), OnError::Allow) => {}
            (StoreAnswer::Failed(Fallback::Refuse), OnError::Deny) => {}
            (StoreAnswer::Failed(Fallback::Local(decisions)), OnError::Local) => {
                assert!(decisions[0].outcome.admits(), "{decisions:?}");
            }
            (answer, _) => panic!("{on_error:?} decide: {answer:?}"),
        }
        failed(before)("decide");
        let before = errors.get();
        let slot = store
            .acquire("fg:slots", 1, Duration::from_secs(30), on_error)
            .await;
        match (&slot, on_error) {
            (Ok(Some(_)), OnError::Allow | OnError::Local) | (Err(()), OnError::Deny) => {}
            (other, _) => panic!("{on_error:?} acquire: {:?}", other.as_ref().map(Option::is_some)),
        }
        failed(before)("acquire");
        if on_error == OnError::Local {
            // The fallback's slots are its own: the second of a limit of one is refused.
            let second = store
                .acquire("fg:slots", 1, Duration::from_secs(30), on_error)
                .await;
            assert!(
                matches!(second, Ok(None)),
                "local acquire: the fallback counts slots"
            );
        }
        drop(slot);
        // What changes a decided request's state: lost, but for a lock-out under `local`,
        // which the fallback starts.
        let before = errors.get();
        assert!(store.refund(&limit).await.is_err(), "{on_error:?} refund");
        failed(before)("refund");
        let before = errors.get();
        let locked = store.lock(&limit, on_error).await;
        failed(before)("lock");
        if on_error == OnError::Local {
            assert!(locked.is_ok(), "local lock: started in the fallback");
            match store.decide(std::slice::from_ref(&limit), on_error).await {
                StoreAnswer::Failed(Fallback::Local(decisions)) => {
                    assert_eq!(decisions[0].outcome, Outcome::Locked, "{decisions:?}")
                }
                answer => panic!("local decide after the lock: {answer:?}"),
            }
        } else {
            assert!(locked.is_err(), "{on_error:?} lock: lost");
        }
        // A unit taken in Redis and dropped unanswered goes back in the background: lost,
        // and counted.
        let before = errors.get();
        drop(Unit::taken(limit.clone(), &store, on_error, false, 1));
        wait_for_more(&errors, before, "a dropped unit's refund").await;
        // The limit-state API's reads and reset answer the failure (503).
        let before = errors.get();
        assert!(store.peek(&limit).await.is_err(), "{on_error:?} peek");
        assert!(store.in_flight("fg:slots").await.is_err(), "{on_error:?} count");
        assert!(store.clear(&limit).await.is_err(), "{on_error:?} clear");
        assert_eq!(errors.get(), before + 3, "{on_error:?} peek, count, clear");
    }
    // Failures in a row opened the breaker: floodgate_store_breaker_open says so.
    assert_eq!(breaker_open.get(), 1);
}

/// Waits until `errors` counts more than `before` (a failure in a background task).
async fn wait_for_more(errors: &Counter, before: u64, what: &str) {
    tokio::time::timeout(Duration::from_secs(2), async {
        while errors.get() == before {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: the failure was not counted"));
}
