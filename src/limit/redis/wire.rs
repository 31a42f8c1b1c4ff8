//! The calling convention of `scripts/decide.lua`: a batch of requests becomes one
//! `EVALSHA` in which every distinct key is sent once, as a key, and everything else is one
//! binary argument: the key counts, each distinct limit spec once (its numbers as doubles),
//! and the plan, the requests as two-byte numbers. The reply is split back per request.
//!
//! Sending each key once matters as much on the Redis side as on ours: the script reads
//! and writes each distinct key once per call, so a batch full of one busy client costs
//! about what one request does. One binary argument matters because Redis turns every
//! argument into a string object and then a Lua string, and the script would parse each
//! back into a number with strtod: as decimal arguments, that parsing was a large part
//! of what a call cost Redis.

use std::collections::HashMap;
use std::time::Duration;

use redis::Cmd;

use crate::limit::algorithm::interval;
use crate::limit::{
    Algorithm, Decisions, LimitCheck, LimitDecision, MAX_LIMITS_PER_ROUTE, MAX_TIME_MICROS, Outcome,
};

/// The largest number the plan can carry (two bytes): key indexes, spec indexes and
/// checks per request. The gateway stays far below it: a batch is at most
/// [`super::batch::MAX_BATCH`] requests of at most [`MAX_LIMITS_PER_ROUTE`] checks,
/// each with at most two keys.
pub(crate) const PLAN_MAX: usize = u16::MAX as usize;

const _: () = assert!(2 * super::batch::MAX_BATCH * MAX_LIMITS_PER_ROUTE <= PLAN_MAX);

/// A batch too large for one script call: some number in it exceeds [`PLAN_MAX`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Oversized(pub usize);

/// A limit as the script sees it: everything about a check but its keys.
#[derive(Clone, Copy, PartialEq)]
struct Spec {
    algorithm: u8,
    a: f64,
    b: u64,
    c: u64,
    cost: u64,
    /// The lock-out's length in µs (0: none), negative when a refusal does not start it.
    lockout: f64,
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

/// Appends `n` (at most [`PLAN_MAX`]) as the script's two-byte number.
fn put_number(call: &mut Vec<u8>, n: usize) {
    call.extend_from_slice(&(n as u16).to_be_bytes());
}

impl Spec {
    /// Bytes a spec takes in the call: the algorithm, five doubles, the shadow flag.
    const BYTES: usize = 1 + 5 * 8 + 1;

    /// Appends the spec as the script reads it. Its numbers become doubles, as the script
    /// would make them anyway: exact up to 2^53.
    fn put(&self, call: &mut Vec<u8>) {
        call.push(self.algorithm);
        for number in [
            self.a,
            self.b as f64,
            self.c as f64,
            self.cost as f64,
            self.lockout,
        ] {
            call.extend_from_slice(&number.to_be_bytes());
        }
        call.push(u8::from(self.shadow));
    }

    fn of(check: &LimitCheck) -> Spec {
        let (algorithm, a, b, c) = parameters(&check.algorithm);
        Spec {
            algorithm,
            a,
            b,
            c,
            cost: check.cost,
            lockout: check.lockout.as_ref().map_or(0.0, |lockout| {
                let micros = lockout.micros as f64;
                if lockout.starts_on_refusal {
                    micros
                } else {
                    -micros
                }
            }),
            shadow: check.shadow,
        }
    }
}

/// Numbers each distinct key in first-seen order and counts its uses.
#[derive(Default)]
struct Interner<'a> {
    index: HashMap<&'a str, usize>,
    /// Per key, in first-seen order: the key and how many checks use it.
    order: Vec<(&'a str, usize)>,
    /// The key interned last and its position: a busy client's requests come in runs, and
    /// comparing with the last key is cheaper than hashing.
    last: Option<(&'a str, usize)>,
}

impl<'a> Interner<'a> {
    fn with_capacity(keys: usize) -> Self {
        Interner {
            index: HashMap::with_capacity(keys),
            order: Vec::with_capacity(keys),
            last: None,
        }
    }

    /// The key's position in first-seen order (from 0).
    fn intern(&mut self, key: &'a str) -> usize {
        let position = match self.last {
            Some((last, position)) if last == key => position,
            _ => *self.index.entry(key).or_insert_with(|| {
                self.order.push((key, 0));
                self.order.len() - 1
            }),
        };
        self.last = Some((key, position));
        self.order[position].1 += 1;
        position
    }
}

/// Whether `next` continues a run that `first` began: both are one check of the same spec
/// on the same counter, without a lock-out. The script decides a run with the counter's
/// state in locals, and answers a token bucket's run in two numbers.
fn continues_run(first: &[LimitCheck], next: &[LimitCheck]) -> bool {
    match (first, next) {
        ([first], [next]) => {
            first.lockout.is_none()
                && next.lockout.is_none()
                && first.key == next.key
                && Spec::of(first) == Spec::of(next)
        }
        _ => false,
    }
}

/// The script call deciding `requests` (each request's checks, in order).
///
/// Counter keys are numbered from 1 (Lua's first index), those used by exactly one check
/// first: the script writes those at once instead of keeping their state for later
/// checks. Lock keys are numbered after the counters. Consecutive requests that are each
/// one check of the same spec and counter, without a lock-out, go as one run (a busy
/// client's requests arrive together): the script decides them in order, keeping the
/// counter's state in locals.
pub(crate) fn command(script_hash: &str, requests: &[&[LimitCheck]]) -> Result<Cmd, Oversized> {
    let total: usize = requests.iter().map(|checks| checks.len()).sum();
    let mut counters = Interner::with_capacity(total);
    let mut locks = Interner::default();
    let mut specs: Vec<Spec> = Vec::new();
    // Per check: spec (from 1), counter and lock (positions in first-seen order).
    let mut checks: Vec<(usize, usize, Option<usize>)> = Vec::with_capacity(total);
    for check in requests.iter().flat_map(|checks| checks.iter()) {
        let spec = Spec::of(check);
        let spec_index = match specs.iter().position(|known| *known == spec) {
            Some(i) => i + 1,
            None => {
                specs.push(spec);
                specs.len()
            }
        };
        let lock = check.lockout.as_ref().map(|lockout| locks.intern(&lockout.key));
        checks.push((spec_index, counters.intern(&check.key), lock));
    }

    // Key numbers: single-use counters first, then the others, then the locks.
    let mut number = vec![0; counters.order.len()];
    let mut keys = Vec::with_capacity(counters.order.len() + locks.order.len());
    let mut n_single = 0;
    for single in [true, false] {
        for (position, (key, uses)) in counters.order.iter().enumerate() {
            if (*uses == 1) == single {
                keys.push(*key);
                number[position] = keys.len();
            }
        }
        if single {
            n_single = keys.len();
        }
    }
    let n_counters = keys.len();
    keys.extend(locks.order.iter().map(|(key, _)| *key));
    let largest_request = requests.iter().map(|checks| checks.len()).max().unwrap_or(0);
    let largest = keys.len().max(specs.len()).max(largest_request);
    if largest > PLAN_MAX {
        return Err(Oversized(largest));
    }

    // The call: three counts, the specs, then the plan.
    let mut call =
        Vec::with_capacity(6 + Spec::BYTES * specs.len() + 2 * (requests.len() + 3 * checks.len()));
    for count in [n_counters, n_single, specs.len()] {
        put_number(&mut call, count);
    }
    for spec in &specs {
        spec.put(&mut call);
    }
    let mut checks = checks.into_iter();
    let mut requests = requests.iter().peekable();
    while let Some(request) = requests.next() {
        // A request of no checks has nothing to decide (and the plan no way to say so).
        if request.is_empty() {
            continue;
        }
        let first = checks.next().expect("one entry per check of the requests");
        let mut run = 1;
        while requests.peek().is_some_and(|next| continues_run(request, next)) {
            requests.next();
            checks.next();
            run += 1;
        }
        put_number(&mut call, if run > 1 { 0 } else { request.len() });
        for (spec, counter, lock) in std::iter::once(first).chain(checks.by_ref().take(request.len() - 1)) {
            put_number(&mut call, spec);
            put_number(&mut call, number[counter]);
            if let Some(lock) = lock {
                put_number(&mut call, n_counters + lock + 1);
            }
        }
        if run > 1 {
            put_number(&mut call, run);
        }
    }

    let data = "EVALSHA".len()
        + script_hash.len()
        + 5 // the key count's digits: at most PLAN_MAX, 65,535
        + keys.iter().map(|key| key.len()).sum::<usize>()
        + call.len();
    let mut cmd = Cmd::with_capacity(4 + keys.len(), data);
    cmd.arg("EVALSHA").arg(script_hash).arg(keys.len());
    for key in &keys {
        cmd.arg(*key);
    }
    cmd.arg(call);
    Ok(cmd)
}

/// Splits the script's reply into each request's decisions; `None` when the reply does
/// not have the shape the requests call for.
///
/// The reply is little-endian doubles, per check: remaining, 4 × reset + outcome, and,
/// unless the check was allowed, the time: the delay of a delayed request, the retry time
/// of a refused one. Every number is a whole count or microseconds but remaining, a token
/// count, which is truncated to whole tokens. A token bucket's or a fixed window's run is
/// answered as a whole ([`WholeRun`]): what its first request sees (the tokens, or the room
/// in the window), how many of its requests were admitted, and a window's reset.
pub(crate) fn decisions(requests: &[&[LimitCheck]], reply: &[u8]) -> Option<Vec<Decisions>> {
    if !reply.len().is_multiple_of(8) {
        return None;
    }
    let mut numbers = reply
        .chunks_exact(8)
        .map(|bytes| f64::from_le_bytes(bytes.try_into().expect("eight bytes")));
    let mut decided = Vec::with_capacity(requests.len());
    let mut rest = requests;
    while let [first, ..] = rest {
        let run = 1 + rest[1..]
            .iter()
            .take_while(|next| continues_run(first, next))
            .count();
        if let ([check], true) = (*first, run > 1)
            && let Some(whole_run) = WholeRun::of(check)
        {
            let before = numbers.next()?;
            let admitted = numbers.next()? as usize;
            if admitted > run {
                return None;
            }
            let one = |decision| Decisions::from_elem(decision, 1);
            match whole_run {
                WholeRun::Bucket(bucket) => decided.extend(bucket.decisions(before, admitted, run).map(one)),
                WholeRun::Window { cost } => {
                    let reset = Duration::from_micros(numbers.next()? as u64);
                    let room = before as u64;
                    decided.extend(window_run(room, cost, reset, admitted, run).map(one));
                }
            }
        } else {
            for checks in &rest[..run] {
                let mut decisions = Decisions::with_capacity(checks.len());
                for _ in 0..checks.len() {
                    decisions.push(next_decision(&mut numbers)?);
                }
                decided.push(decisions);
            }
        }
        rest = &rest[run..];
    }
    numbers.next().is_none().then_some(decided)
}

/// One check's decision as the script answers it: remaining, 4 × reset + outcome, and the
/// time unless it was allowed.
fn next_decision(numbers: &mut impl Iterator<Item = f64>) -> Option<LimitDecision> {
    // `as` saturates: a negative or NaN number would read as 0, never wrap.
    let mut values = numbers.map(|number| number as u64);
    let remaining = values.next()?;
    let packed = values.next()?;
    let reset = Duration::from_micros(packed >> 2);
    let (outcome, retry_after) = match packed & 3 {
        0 => (Outcome::Allowed, Duration::ZERO),
        1 => (
            Outcome::Delayed(Duration::from_micros(values.next()?)),
            Duration::ZERO,
        ),
        2 => (Outcome::Rejected, Duration::from_micros(values.next()?)),
        _ => (Outcome::Locked, Duration::from_micros(values.next()?)),
    };
    Some(LimitDecision {
        outcome,
        remaining,
        reset,
        retry_after,
    })
}

/// The runs the script answers as a whole, in a few numbers, instead of per request.
enum WholeRun {
    Bucket(BucketRun),
    Window { cost: u64 },
}

impl WholeRun {
    fn of(check: &LimitCheck) -> Option<WholeRun> {
        match check.algorithm {
            Algorithm::TokenBucket { rate, per, burst } => Some(WholeRun::Bucket(BucketRun {
                step: interval(rate, per),
                burst: burst as f64,
                cost: check.cost as f64,
            })),
            Algorithm::FixedWindow { .. } => Some(WholeRun::Window { cost: check.cost }),
            Algorithm::SlidingWindow { .. } | Algorithm::LeakyBucket { .. } => None,
        }
    }
}

/// A fixed window's run as the script answers it: the room the window had for the first
/// request, how many were admitted and the window's reset. The first `admitted` each take
/// `cost` of the room, the rest are refused until the reset; all is whole numbers.
fn window_run(
    room: u64,
    cost: u64,
    reset: Duration,
    admitted: usize,
    run: usize,
) -> impl Iterator<Item = LimitDecision> {
    (0..run).map(move |i| {
        let taken = cost.saturating_mul((i + 1).min(admitted) as u64);
        let refused = i >= admitted;
        LimitDecision {
            outcome: if refused {
                Outcome::Rejected
            } else {
                Outcome::Allowed
            },
            remaining: room.saturating_sub(taken),
            reset,
            retry_after: if refused { reset } else { Duration::ZERO },
        }
    })
}

/// A token bucket's run as the script answers it. The requests of a run see one time, so
/// the first `admitted` take `cost` each from the tokens the one before left, and the rest
/// are refused with the tokens the last admission left. Each decision's numbers are those
/// the script's `token_bucket` would give, computed with the same double operations in the
/// same order, so they are the same to the bit.
struct BucketRun {
    /// Microseconds per token, as the script divides them (`per / rate`).
    step: f64,
    burst: f64,
    cost: f64,
}

impl BucketRun {
    fn decisions(&self, tokens: f64, admitted: usize, run: usize) -> impl Iterator<Item = LimitDecision> {
        let micros = |time: f64| Duration::from_micros(time.min(MAX_TIME_MICROS as f64) as u64);
        let mut left = tokens;
        (0..run).map(move |i| {
            if i < admitted {
                left -= self.cost;
            }
            let reset = micros(((self.burst - left) * self.step).ceil());
            if i < admitted {
                LimitDecision {
                    outcome: Outcome::Allowed,
                    remaining: left as u64,
                    reset,
                    retry_after: Duration::ZERO,
                }
            } else {
                LimitDecision {
                    outcome: Outcome::Rejected,
                    remaining: left as u64,
                    reset,
                    retry_after: micros(((self.cost - left) * self.step).ceil().max(1.0)),
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Lockout;

    fn check(key: &str, lock: Option<&str>, cost: u64) -> LimitCheck {
        LimitCheck {
            key: key.to_owned(),
            algorithm: Algorithm::TokenBucket {
                rate: 10.0,
                per: 1_000_000,
                burst: 20,
            },
            lockout: lock.map(|lock| Lockout {
                key: lock.to_owned(),
                micros: 5_000_000,
                starts_on_refusal: true,
            }),
            cost,
            keep_below: 0,
            shadow: false,
        }
    }

    /// Reads the call argument back: its key counts, specs and plan.
    struct Call {
        counts: [u16; 3],
        /// Per spec: algorithm, a, b, c, cost, lock-out, shadow.
        specs: Vec<(u8, [f64; 5], u8)>,
        plan: Vec<u16>,
    }

    impl Call {
        fn read(bytes: &[u8]) -> Call {
            let number = |at: usize| u16::from_be_bytes([bytes[at], bytes[at + 1]]);
            let counts = [number(0), number(2), number(4)];
            let mut at = 6;
            let specs = (0..counts[2])
                .map(|_| {
                    let double = |i: usize| {
                        let start = at + 1 + 8 * i;
                        f64::from_be_bytes(bytes[start..start + 8].try_into().unwrap())
                    };
                    let spec = (bytes[at], [0, 1, 2, 3, 4].map(double), bytes[at + 41]);
                    at += Spec::BYTES;
                    spec
                })
                .collect();
            let plan = (at..bytes.len()).step_by(2).map(number).collect();
            Call { counts, specs, plan }
        }
    }

    /// The command's arguments: the text ones, and the call.
    fn args(cmd: &Cmd) -> (Vec<String>, Call) {
        let mut args: Vec<Vec<u8>> = cmd
            .args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => bytes.to_vec(),
                _ => b"<not a plain argument>".to_vec(),
            })
            .collect();
        let call = Call::read(&args.pop().unwrap_or_default());
        let text = args
            .iter()
            .map(|arg| String::from_utf8_lossy(arg).into_owned())
            .collect();
        (text, call)
    }

    #[test]
    fn each_key_and_spec_is_sent_once_and_single_use_keys_come_first() {
        let a = [check("k:a", Some("k:a:lock"), 1)];
        let b = [check("k:b", None, 1), check("k:a", Some("k:a:lock"), 2)];
        let c = [check("k:c", None, 1)];
        let again = [check("k:b", None, 1)];
        let cmd = command("sha", &[&a, &b, &c, &again]).unwrap();
        let (text, call) = args(&cmd);
        let expected = [
            "EVALSHA", "sha", "4", // keys:
            "k:c", "k:a", "k:b",      // k:c is used once; k:a and k:b twice
            "k:a:lock", // the locks after the counters
        ];
        assert_eq!(text, expected);
        // 3 counter keys, of which 1 single-use (the first), and 3 specs
        assert_eq!(call.counts, [3, 1, 3]);
        assert_eq!(
            call.specs,
            [
                (3, [10.0, 1e6, 20.0, 1.0, 5e6], 0), // with lock-out, cost 1
                (3, [10.0, 1e6, 20.0, 1.0, 0.0], 0), // without lock-out
                (3, [10.0, 1e6, 20.0, 2.0, 5e6], 0), // with lock-out, cost 2
            ]
        );
        let expected_plan = [
            1, 1, 2, 4, // one check: spec 1, key 2 (k:a), lock key 4
            2, 2, 3, 3, 2, 4, // spec 2 key 3 (k:b); spec 3 key 2 lock 4
            1, 2, 1, // spec 2 key 1 (k:c)
            1, 2, 3, // spec 2 key 3 (k:b)
        ];
        assert_eq!(call.plan, expected_plan);
    }

    #[test]
    fn a_run_of_one_key_is_numbered_once_and_counted_per_use() {
        let x = [check("k:x", None, 1)];
        let y = [check("k:y", None, 1)];
        let cmd = command("sha", &[&x, &x, &y, &x]).unwrap();
        let (text, call) = args(&cmd);
        assert_eq!(text, ["EVALSHA", "sha", "2", "k:y", "k:x"]);
        // k:y used once comes first; k:x, used three times, after it
        assert_eq!(call.counts, [2, 1, 1]);
        assert_eq!(
            call.plan,
            [
                0, 1, 2, 2, // a run: spec 1, key 2 (k:x), two requests
                1, 1, 1, // k:y
                1, 1, 2, // k:x
            ]
        );
    }

    #[test]
    fn only_one_check_requests_alike_but_for_the_request_go_as_a_run() {
        let x = [check("k:x", None, 1)];
        let x_costly = [check("k:x", None, 2)];
        let x_locked = [check("k:x", Some("k:x:lock"), 1)];
        let x_and_y = [check("k:x", None, 1), check("k:y", None, 1)];
        let requests: [&[LimitCheck]; 9] = [&x, &x, &x_costly, &x_locked, &x_locked, &x, &x, &x_and_y, &x];
        let (text, call) = args(&command("sha", &requests).unwrap());
        assert_eq!(text, ["EVALSHA", "sha", "3", "k:y", "k:x", "k:x:lock"]);
        assert_eq!(
            call.plan,
            [
                0, 1, 2, 2, // a run of two: spec 1 (cost 1), key 2 (k:x)
                1, 2, 2, // spec 2 (cost 2)
                1, 3, 2, 3, // spec 3, with its lock (key 3): never a run
                1, 3, 2, 3, //
                0, 1, 2, 2, // a run of two again
                2, 1, 2, 1, 1, // two checks: k:x, k:y
                1, 1, 2, // alone
            ]
        );
    }

    #[test]
    fn a_batch_beyond_two_byte_numbers_is_refused_not_truncated() {
        let keys: Vec<String> = (0..=PLAN_MAX).map(|i| format!("k:{i}")).collect();
        let checks: Vec<LimitCheck> = keys.iter().map(|key| check(key, None, 1)).collect();
        let requests: Vec<&[LimitCheck]> = checks.chunks(1).collect();
        assert_eq!(command("sha", &requests).err(), Some(Oversized(PLAN_MAX + 1)));
        assert!(command("sha", &requests[..PLAN_MAX]).is_ok());
    }

    /// The script's reply: `values` as little-endian doubles.
    fn reply(values: &[f64]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn replies_are_split_per_request() {
        let a = [check("a", None, 1)];
        let b = [check("b", None, 1), check("c", None, 1)];
        // remaining, 4 × reset + outcome, and the time unless allowed
        let values = [
            9.75,
            100.0 * 4.0,
            0.0,
            100.0 * 4.0 + 2.0,
            50.0,
            3.0,
            40.0 * 4.0 + 1.0,
            40.0,
        ];
        let split = decisions(&[&a, &b], &reply(&values)).unwrap();
        assert_eq!(split.len(), 2);
        assert_eq!(split[0][0].outcome, Outcome::Allowed);
        assert_eq!(split[0][0].remaining, 9);
        assert_eq!(split[0][0].reset, Duration::from_micros(100));
        assert_eq!(split[1][0].outcome, Outcome::Rejected);
        assert_eq!(split[1][0].retry_after, Duration::from_micros(50));
        assert_eq!(split[1][0].reset, Duration::from_micros(100));
        assert_eq!(split[1][1].outcome, Outcome::Delayed(Duration::from_micros(40)));
        assert_eq!(split[1][1].retry_after, Duration::ZERO);
        assert_eq!(split[1][1].reset, Duration::from_micros(40));
        // A number short, one too many, or a broken number: not this batch's reply.
        assert!(decisions(&[&a, &b], &reply(&values[..7])).is_none());
        assert!(decisions(&[&a, &b], &reply(&[values.as_slice(), &[0.0]].concat())).is_none());
        assert!(decisions(&[&a], &reply(&values)).is_none());
        assert!(decisions(&[&a, &b], &reply(&values)[1..]).is_none());
    }

    /// Each request's first decision: outcome, remaining, reset, retry time.
    fn first_checks(split: &[Decisions]) -> Vec<(Outcome, u64, Duration, Duration)> {
        split
            .iter()
            .map(|d| (d[0].outcome, d[0].remaining, d[0].reset, d[0].retry_after))
            .collect()
    }

    #[test]
    fn a_token_bucket_run_is_answered_in_two_numbers() {
        // 10 tokens a second (100 ms each), 20 deep, 2 a request.
        let x = [check("x", None, 2)];
        let y = [check("y", None, 1)];
        // The run of three: 5.5 tokens before it, two admitted; then y on its own.
        let values = [5.5, 2.0, 7.0, 130_000.0 * 4.0];
        let split = decisions(&[&x, &x, &x, &y], &reply(&values)).unwrap();
        let ms = Duration::from_millis;
        assert_eq!(
            first_checks(&split),
            [
                (Outcome::Allowed, 3, ms(1_650), Duration::ZERO),
                (Outcome::Allowed, 1, ms(1_850), Duration::ZERO),
                (Outcome::Rejected, 1, ms(1_850), ms(50)),
                (Outcome::Allowed, 7, ms(130), Duration::ZERO),
            ]
        );
        // More admitted than the run holds: not this batch's reply.
        assert!(decisions(&[&x, &x, &x, &y], &reply(&[5.5, 4.0, 7.0, 0.0])).is_none());
        // A sliding window's run is answered per request.
        let mut sliding = check("s", None, 1);
        sliding.algorithm = Algorithm::SlidingWindow {
            limit: 10,
            window: 1_000_000,
        };
        let s = [sliding];
        let split = decisions(&[&s, &s], &reply(&[9.0, 4e6, 8.0, 4e6])).unwrap();
        assert_eq!((split[0][0].remaining, split[1][0].remaining), (9, 8));
    }

    #[test]
    fn a_fixed_window_run_is_answered_in_three_numbers() {
        let mut window = check("w", None, 3);
        window.algorithm = Algorithm::FixedWindow {
            limit: 10,
            window: 60_000_000,
        };
        let w = [window];
        // Room for 7 before the run of four: two admitted (3 each), then refused for 40 s.
        let split = decisions(&[&w, &w, &w, &w], &reply(&[7.0, 2.0, 40e6])).unwrap();
        let reset = Duration::from_secs(40);
        assert_eq!(
            first_checks(&split),
            [
                (Outcome::Allowed, 4, reset, Duration::ZERO),
                (Outcome::Allowed, 1, reset, Duration::ZERO),
                (Outcome::Rejected, 1, reset, reset),
                (Outcome::Rejected, 1, reset, reset),
            ]
        );
        // The reset missing: not this batch's reply.
        assert!(decisions(&[&w, &w, &w, &w], &reply(&[7.0, 2.0])).is_none());
    }

    #[test]
    fn a_locked_check_and_the_longest_reset_decode_exactly() {
        let a = [check("a", Some("l"), 1)];
        let longest = MAX_TIME_MICROS as f64;
        let split = decisions(&[&a], &reply(&[0.0, longest * 4.0 + 3.0, 7.0])).unwrap();
        assert_eq!(split[0][0].outcome, Outcome::Locked);
        assert_eq!(split[0][0].reset, Duration::from_micros(MAX_TIME_MICROS));
        assert_eq!(split[0][0].retry_after, Duration::from_micros(7));
    }
}
