//! A client that controls a key part (a header, a query parameter, a cookie, an IPv6
//! address) and sprays distinct values at the in-process store, at the gateway's own size,
//! cannot make it forget an exhausted limit or a lock-out, its own or anyone's: the full
//! store gives up what is closest to a fresh key's state, and keeps no new key rather
//! than an exhausted one (counted).

use std::sync::Arc;

use floodgate::limit::clock::MonotonicClock;
use floodgate::limit::key::{encode_tuple, lock_key, store_key};
use floodgate::limit::memory::MAX_KEYS as MEMORY_STORE_MAX_KEYS;
use floodgate::limit::memory::MemoryStore;
use floodgate::limit::{Algorithm, LimitCheck, Lockout, Outcome};
use prometheus_client::metrics::counter::Counter;

const MINUTE: u64 = 60_000_000;

fn login(client_ip: &str) -> LimitCheck {
    let tuple = encode_tuple([client_ip.as_bytes()]);
    let algorithm = Algorithm::FixedWindow {
        limit: 5,
        window: 15 * MINUTE,
    };
    LimitCheck {
        key: store_key("floodgate", &tuple, "login", &algorithm),
        algorithm,
        lockout: Some(Lockout::on_refusal(
            lock_key("floodgate", &tuple, "login"),
            60 * MINUTE,
        )),
        cost: 1,
        keep_below: 0,
        shadow: false,
    }
}

fn api(api_key: &str) -> LimitCheck {
    let tuple = encode_tuple([api_key.as_bytes()]);
    // An hourly quota per API key: each sprayed key outlives the login counters.
    let algorithm = Algorithm::FixedWindow {
        limit: 1000,
        window: 60 * MINUTE,
    };
    LimitCheck {
        key: store_key("floodgate", &tuple, "api", &algorithm),
        algorithm,
        lockout: None,
        cost: 1,
        keep_below: 0,
        shadow: false,
    }
}

fn outcome(store: &MemoryStore, check: &LimitCheck) -> Outcome {
    store.decide(std::slice::from_ref(check))[0].outcome
}

#[test]
fn a_spray_of_keys_does_not_lift_an_exhausted_limit_or_a_lock_out() {
    let not_kept = Counter::default();
    let store = MemoryStore::new(
        Arc::new(MonotonicClock::default()),
        MEMORY_STORE_MAX_KEYS,
        not_kept.clone(),
    );
    // A brute-forced login: five tries, the sixth refused and locked out for an hour.
    let attacker = login("203.0.113.7");
    for _ in 0..5 {
        assert_eq!(outcome(&store, &attacker), Outcome::Allowed);
    }
    assert_eq!(outcome(&store, &attacker), Outcome::Rejected);
    // Another client whose login limit is spent but not locked yet.
    let neighbour = login("198.51.100.2");
    for _ in 0..5 {
        assert_eq!(outcome(&store, &neighbour), Outcome::Allowed);
    }

    // Two store-fulls of distinct X-Api-Key values, one request each.
    for i in 0..2 * MEMORY_STORE_MAX_KEYS {
        let decision = store.decide(&[api(&format!("spray-{i}"))])[0];
        assert_eq!(decision.outcome, Outcome::Allowed);
    }
    assert!(
        store.len() <= MEMORY_STORE_MAX_KEYS + 64,
        "bounded: {}",
        store.len()
    );

    assert_eq!(outcome(&store, &attacker), Outcome::Locked, "still locked out");
    assert_eq!(outcome(&store, &neighbour), Outcome::Rejected, "still exhausted");
    // Sprayed keys were fresh but for one request: forgetting them costs next to nothing,
    // so the store never had to refuse a new key.
    assert_eq!(not_kept.get(), 0);
}
