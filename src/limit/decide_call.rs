//! The calling convention of `scripts/decide.lua`: a batch of requests becomes one
//! `EVALSHA` in which every distinct key and every distinct limit spec is sent once, and
//! each check is two or three small indexes; the reply is split back per request.
//!
//! Sending each key once matters as much on the Redis side as on ours: the script reads
//! and writes each distinct key once per call, so a batch full of one busy client costs
//! about what one request does.

use std::collections::HashMap;
use std::time::Duration;

use redis::Cmd;

use super::{Algorithm, LimitCheck, LimitDecision, Outcome};

/// Values the script returns per check.
const FIELDS_PER_CHECK: usize = 5;

/// A limit as the script sees it: everything about a check but its keys.
#[derive(Clone, Copy, PartialEq)]
struct Spec {
    algorithm: u8,
    a: f64,
    b: u64,
    c: u64,
    cost: u64,
    lockout: u64,
    shadow: bool,
}

/// The scripts' encoding of an algorithm: its code and three parameters.
pub(crate) fn parameters(algorithm: &Algorithm) -> (u8, f64, u64, u64) {
    match *algorithm {
        Algorithm::FixedWindow { limit, window } => (1, limit as f64, window, 0),
        Algorithm::SlidingWindow { limit, window } => (2, limit as f64, window, 0),
        Algorithm::TokenBucket { rate, per, burst } => (3, rate, per, burst),
        Algorithm::LeakyBucket { rate, per, burst } => (4, rate, per, burst),
    }
}

impl Spec {
    fn of(check: &LimitCheck) -> Spec {
        let (algorithm, a, b, c) = parameters(&check.algorithm);
        Spec {
            algorithm,
            a,
            b,
            c,
            cost: check.cost,
            lockout: check.lockout.as_ref().map_or(0, |(_, micros)| *micros),
            shadow: check.shadow,
        }
    }
}

/// Numbers each distinct string in first-seen order, from 1 (Lua's first index).
#[derive(Default)]
struct Interner<'a> {
    index: HashMap<&'a str, usize>,
    order: Vec<&'a str>,
}

impl<'a> Interner<'a> {
    fn intern(&mut self, key: &'a str) -> usize {
        *self.index.entry(key).or_insert_with(|| {
            self.order.push(key);
            self.order.len()
        })
    }
}

/// The script call deciding `requests` (each request's checks, in order).
pub(crate) fn command(script_hash: &str, requests: &[&[LimitCheck]]) -> Cmd {
    let mut counters = Interner::default();
    let mut locks = Interner::default();
    let mut specs: Vec<Spec> = Vec::new();
    // Per check: spec, counter key and lock key (0: none; numbered after the counters).
    let mut checks: Vec<(usize, usize, usize)> = Vec::new();
    for check in requests.iter().flat_map(|checks| checks.iter()) {
        let spec = Spec::of(check);
        let spec_index = match specs.iter().position(|known| *known == spec) {
            Some(i) => i + 1,
            None => {
                specs.push(spec);
                specs.len()
            }
        };
        let lock = check.lockout.as_ref().map_or(0, |(key, _)| locks.intern(key));
        checks.push((spec_index, counters.intern(&check.key), lock));
    }

    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script_hash).arg(counters.order.len() + locks.order.len());
    for key in counters.order.iter().chain(&locks.order) {
        cmd.arg(*key);
    }
    cmd.arg(counters.order.len()).arg(specs.len());
    for spec in &specs {
        cmd.arg(spec.algorithm)
            .arg(spec.a)
            .arg(spec.b)
            .arg(spec.c)
            .arg(spec.cost)
            .arg(spec.lockout)
            .arg(u8::from(spec.shadow));
    }
    cmd.arg(requests.len());
    let mut checks = checks.into_iter();
    for request in requests {
        cmd.arg(request.len());
        for (spec, counter, lock) in checks.by_ref().take(request.len()) {
            cmd.arg(spec).arg(counter);
            if lock > 0 {
                cmd.arg(counters.order.len() + lock);
            }
        }
    }
    cmd
}

/// Splits the script's reply into each request's decisions; `None` when the reply does
/// not have the shape the requests call for.
pub(crate) fn decisions(requests: &[&[LimitCheck]], values: &[i64]) -> Option<Vec<Vec<LimitDecision>>> {
    let total: usize = requests.iter().map(|checks| checks.len()).sum();
    if values.len() != total * FIELDS_PER_CHECK {
        return None;
    }
    let mut decisions = values.chunks_exact(FIELDS_PER_CHECK).map(decision);
    Some(
        requests
            .iter()
            .map(|checks| decisions.by_ref().take(checks.len()).collect())
            .collect(),
    )
}

fn decision(fields: &[i64]) -> LimitDecision {
    let micros = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
    let outcome = match fields[0] {
        0 => Outcome::Allowed,
        1 => Outcome::Delayed(micros(fields[4])),
        3 => Outcome::Locked,
        _ => Outcome::Rejected,
    };
    LimitDecision {
        outcome,
        remaining: u64::try_from(fields[1]).unwrap_or(0),
        reset: micros(fields[2]),
        retry_after: micros(fields[3]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(key: &str, lock: Option<&str>, cost: u64) -> LimitCheck {
        LimitCheck {
            key: key.to_owned(),
            algorithm: Algorithm::TokenBucket {
                rate: 10.0,
                per: 1_000_000,
                burst: 20,
            },
            lockout: lock.map(|lock| (lock.to_owned(), 5_000_000)),
            cost,
            shadow: false,
        }
    }

    /// The command's arguments as text.
    fn args(cmd: &Cmd) -> Vec<String> {
        cmd.args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                _ => "<not a plain argument>".to_owned(),
            })
            .collect()
    }

    #[test]
    fn each_key_and_spec_is_sent_once() {
        let a = [check("k:a", Some("k:a:lock"), 1)];
        let b = [check("k:b", None, 1), check("k:a", Some("k:a:lock"), 2)];
        let again = [check("k:b", None, 1)];
        let cmd = command("sha", &[&a, &b, &again]);
        let expected = [
            "EVALSHA", "sha", "3", "k:a", "k:b", "k:a:lock", // two counters, then the lock
            "2",        // counter keys
            "3",        // specs: with lock-out cost 1, without lock-out, with lock-out cost 2
            "3", "10.0", "1000000", "20", "1", "5000000", "0", //
            "3", "10.0", "1000000", "20", "1", "0", "0", //
            "3", "10.0", "1000000", "20", "2", "5000000", "0", //
            "3", // requests
            "1", "1", "1", "3", // one check: spec 1, key 1, lock key 3
            "2", "2", "2", "3", "1", "3", // spec 2 key 2; spec 3 key 1 lock 3
            "1", "2", "2", // spec 2 key 2
        ];
        assert_eq!(args(&cmd), expected);
    }

    #[test]
    fn replies_are_split_per_request() {
        let a = [check("a", None, 1)];
        let b = [check("b", None, 1), check("c", None, 1)];
        let values = [0, 9, 100, 0, 0, 2, 0, 100, 50, 0, 1, 3, 40, 0, 40];
        let split = decisions(&[&a, &b], &values).unwrap();
        assert_eq!(split.len(), 2);
        assert_eq!(split[0][0].outcome, Outcome::Allowed);
        assert_eq!(split[0][0].remaining, 9);
        assert_eq!(split[1][0].outcome, Outcome::Rejected);
        assert_eq!(split[1][0].retry_after, Duration::from_micros(50));
        assert_eq!(split[1][1].outcome, Outcome::Delayed(Duration::from_micros(40)));
        assert!(decisions(&[&a, &b], &values[..10]).is_none());
    }
}
