//! Scenario tests on a fake clock, and properties: for any arrival sequence, what each
//! algorithm admits stays within its bound.

use proptest::prelude::*;

use super::*;

const MS: u64 = 1_000;
const S: u64 = 1_000_000;

/// Runs `arrivals` (time, cost) through one key, storing state only when admitted;
/// returns each evaluation.
fn run(algorithm: Algorithm, arrivals: &[(u64, u64)]) -> Vec<Evaluation> {
    let mut state: Option<(State, u64)> = None;
    arrivals
        .iter()
        .map(|&(now, cost)| {
            let live = state.filter(|&(_, expires)| expires > now).map(|(s, _)| s);
            let evaluation = evaluate(&algorithm, live, cost, now);
            if evaluation.admitted {
                state = Some((evaluation.new_state, now + evaluation.ttl));
            }
            evaluation
        })
        .collect()
}

fn admitted(evaluations: &[Evaluation]) -> usize {
    evaluations.iter().filter(|e| e.admitted).count()
}

#[test]
fn fixed_window_counts_from_the_first_request_and_resets() {
    let algorithm = Algorithm::FixedWindow { limit: 3, window: S };
    let at = |t| (t, 1);
    let evals = run(
        algorithm,
        &[
            at(100 * MS),
            at(200 * MS),
            at(300 * MS),
            at(900 * MS),
            at(1_100 * MS),
        ],
    );
    assert_eq!(
        evals.iter().map(|e| e.admitted).collect::<Vec<_>>(),
        [true, true, true, false, true]
    );
    assert_eq!(evals[2].remaining_after, 0);
    // The window began at 100 ms: the rejection at 900 ms may retry in 200 ms.
    assert_eq!(evals[3].retry_after, 200 * MS);
    assert_eq!(evals[4].remaining_after, 2);
}

#[test]
fn sliding_window_admits_no_double_burst_across_a_boundary() {
    let algorithm = Algorithm::SlidingWindow { limit: 10, window: S };
    let mut arrivals: Vec<(u64, u64)> = (0..10).map(|i| (900 * MS + i, 1)).collect();
    arrivals.extend((0..10).map(|i| (S + 100 * MS + i, 1)));
    let evals = run(algorithm, &arrivals);
    assert_eq!(admitted(&evals[..10]), 10);
    // 100 ms into the next window, the previous 10 still weigh 9: one more fits.
    assert_eq!(admitted(&evals[10..]), 1);
    let rejected = &evals[12];
    assert!(!rejected.admitted);
    assert!(
        rejected.retry_after > 0 && rejected.retry_after <= 900 * MS,
        "{rejected:?}"
    );
}

#[test]
fn token_bucket_bursts_then_refills_at_rate() {
    let algorithm = Algorithm::TokenBucket {
        rate: 10.0,
        per: S,
        burst: 5,
    };
    let mut arrivals: Vec<(u64, u64)> = (0..7).map(|i| (i, 1)).collect();
    arrivals.push((100 * MS + 6, 1));
    arrivals.push((100 * MS + 7, 1));
    let evals = run(algorithm, &arrivals);
    assert_eq!(admitted(&evals[..7]), 5);
    // Five microseconds of refill were earned meanwhile (floating point: ±1 µs).
    assert!(evals[5].retry_after.abs_diff(100 * MS - 5) <= 1, "{:?}", evals[5]);
    assert!(evals[7].admitted);
    assert!(!evals[8].admitted);
}

#[test]
fn token_bucket_keeps_fractional_tokens_and_clamps_a_lowered_burst() {
    let algorithm = Algorithm::TokenBucket {
        rate: 1.0,
        per: S,
        burst: 1,
    };
    let evals = run(algorithm, &[(0, 1), (S / 2, 1), (S, 1)]);
    assert_eq!(
        evals.iter().map(|e| e.admitted).collect::<Vec<_>>(),
        [true, false, true]
    );
    let stored = State::Bucket {
        tokens: 50.0,
        updated: 0,
    };
    let lowered = Algorithm::TokenBucket {
        rate: 1.0,
        per: S,
        burst: 2,
    };
    let e = evaluate(&lowered, Some(stored), 1, 10);
    assert_eq!(e.remaining_after, 1);
}

#[test]
fn leaky_bucket_delays_evenly_and_bounds_the_queue() {
    let algorithm = Algorithm::LeakyBucket {
        rate: 10.0,
        per: S,
        burst: 3,
    };
    let evals = run(algorithm, &[(0, 1), (0, 1), (0, 1), (0, 1), (0, 1)]);
    let delays: Vec<_> = evals.iter().filter(|e| e.admitted).map(|e| e.delay).collect();
    assert_eq!(delays, [0, 100 * MS, 200 * MS, 300 * MS]);
    assert!(!evals[4].admitted);
    assert_eq!(evals[4].retry_after, 100 * MS);
}

#[test]
fn leaky_bucket_clamps_a_queue_left_by_a_faster_rate() {
    let slow = Algorithm::LeakyBucket {
        rate: 1.0,
        per: S,
        burst: 2,
    };
    // A tat far in the future, as left by a much larger burst before an edit.
    let e = evaluate(
        &slow,
        Some(State::Gcra {
            tat: 100 * S,
            step: 1_000.0,
        }),
        1,
        0,
    );
    assert!(e.admitted);
    assert_eq!(e.delay, 2 * S);
}

#[test]
fn cost_above_one_consumes_that_much() {
    let algorithm = Algorithm::FixedWindow { limit: 10, window: S };
    let evals = run(algorithm, &[(0, 4), (1, 4), (2, 4), (3, 2)]);
    assert_eq!(
        evals.iter().map(|e| e.admitted).collect::<Vec<_>>(),
        [true, true, false, true]
    );
    assert_eq!(evals[3].remaining_after, 0);
}

fn arrivals() -> impl Strategy<Value = Vec<(u64, u64)>> {
    proptest::collection::vec((0..300 * MS, 1..4u64), 1..200).prop_map(|gaps| {
        let mut now = 0;
        gaps.into_iter()
            .map(|(gap, cost)| {
                now += gap;
                (now, cost)
            })
            .collect()
    })
}

/// Admitted cost inside [from, to].
fn admitted_cost(arrivals: &[(u64, u64)], evals: &[Evaluation], from: u64, to: u64) -> u64 {
    arrivals
        .iter()
        .zip(evals)
        .filter(|((t, _), e)| e.admitted && *t >= from && *t <= to)
        .map(|((_, c), _)| c)
        .sum()
}

proptest! {
    #[test]
    fn fixed_window_never_exceeds_twice_the_limit_in_any_window(seq in arrivals()) {
        let (limit, window) = (5, S);
        let evals = run(Algorithm::FixedWindow { limit, window }, &seq);
        for &(start, _) in &seq {
            prop_assert!(admitted_cost(&seq, &evals, start, start + window - 1) <= 2 * limit);
        }
        prop_assert!(admitted_cost(&seq, &evals, seq[0].0, seq[0].0 + window - 1) <= limit);
    }

    #[test]
    fn sliding_window_never_exceeds_twice_the_limit_in_any_window(seq in arrivals()) {
        let (limit, window) = (5, S);
        let evals = run(Algorithm::SlidingWindow { limit, window }, &seq);
        for &(start, _) in &seq {
            prop_assert!(admitted_cost(&seq, &evals, start, start + window - 1) <= 2 * limit);
            let aligned = start / window * window;
            prop_assert!(admitted_cost(&seq, &evals, aligned, aligned + window - 1) <= limit);
        }
    }

    #[test]
    fn token_bucket_admits_at_most_burst_plus_rate(seq in arrivals()) {
        let (rate, per, burst) = (4.0, S, 6);
        let evals = run(Algorithm::TokenBucket { rate, per, burst }, &seq);
        for &(from, _) in &seq {
            for &(to, _) in seq.iter().filter(|(t, _)| *t >= from) {
                let refill = ((to - from) as f64 * rate / per as f64).floor() as u64;
                prop_assert!(admitted_cost(&seq, &evals, from, to) <= burst + refill);
            }
        }
    }

    #[test]
    fn leaky_bucket_spaces_requests_and_bounds_the_queue(seq in arrivals()) {
        let (rate, per, burst) = (4.0, S, 3);
        let step = per / 4;
        let evals = run(Algorithm::LeakyBucket { rate, per, burst }, &seq);
        let mut last_release: Option<(u64, u64)> = None;
        for ((now, cost), e) in seq.iter().zip(&evals) {
            if !e.admitted {
                continue;
            }
            prop_assert!(e.delay <= burst * step);
            let release = now + e.delay;
            if let Some((previous, previous_cost)) = last_release {
                prop_assert!(release + 1 >= previous + previous_cost * step, "{release} after {previous}");
            }
            last_release = Some((release, *cost));
        }
    }
}

#[test]
fn counts_round_as_floor_and_ceil_do_at_the_edges() {
    let edges = [
        0.0,
        -0.0,
        0.5,
        -0.5,
        1.0,
        1.0 - f64::EPSILON,
        1.0 + f64::EPSILON,
        2f64.powi(53),
        2f64.powi(53) - 0.5,
        2f64.powi(64),
        2f64.powi(64) - 2048.0,
        1e300,
        f64::MAX,
        f64::MIN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        f64::MIN_POSITIVE,
    ];
    for x in edges {
        assert_eq!(floor_count(x), x.floor() as u64, "floor of {x}");
        assert_eq!(ceil_count(x), x.ceil() as u64, "ceil of {x}");
    }
}

proptest! {
    #[test]
    fn counts_round_as_floor_and_ceil_do(bits in any::<u64>(), small in -1e7f64..1e7) {
        for x in [f64::from_bits(bits), small] {
            prop_assert_eq!(floor_count(x), x.floor() as u64);
            prop_assert_eq!(ceil_count(x), x.ceil() as u64);
        }
    }
}
