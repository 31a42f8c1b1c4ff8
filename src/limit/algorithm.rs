//! The four algorithms as pure functions of (stored state, parameters, cost, now).
//!
//! This is the reference the stores implement: the in-process store calls these functions
//! directly; the Redis Lua scripts mirror them line for line. Time is in microseconds of
//! the store's one clock. Evaluation never mutates: it returns the state to store if the
//! whole request is admitted, so that a request rejected by any of its limits consumes
//! nothing from the others.

use std::time::Duration;

/// What a limit admits, with durations already in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Algorithm {
    /// At most `limit` per `window`, the window starting at the key's first request.
    FixedWindow { limit: u64, window: u64 },
    /// About `limit` per rolling `window` (current count + previous count, weighted).
    SlidingWindow { limit: u64, window: u64 },
    /// A burst of `burst`, then `rate` per `per`.
    TokenBucket { rate: f64, per: u64, burst: u64 },
    /// `rate` per `per`, evenly spaced; up to `burst` requests wait their turn.
    LeakyBucket { rate: f64, per: u64, burst: u64 },
}

impl Algorithm {
    /// Requests of cost 1 a fresh key admits at once: a window's limit, a bucket's burst
    /// (for a leaky bucket, the request served now besides the `burst` that wait).
    pub fn capacity(&self) -> u64 {
        match *self {
            Algorithm::FixedWindow { limit, .. } | Algorithm::SlidingWindow { limit, .. } => limit,
            Algorithm::TokenBucket { burst, .. } => burst,
            Algorithm::LeakyBucket { burst, .. } => burst + 1,
        }
    }
}

/// Stored state of one key, one variant per algorithm.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum State {
    Fixed {
        count: u64,
        window_end: u64,
    },
    Sliding {
        window_index: u64,
        current: u64,
        previous: u64,
    },
    Bucket {
        tokens: f64,
        updated: u64,
    },
    /// Theoretical arrival time, and the emission interval it was computed with.
    Gcra {
        tat: u64,
        step: f64,
    },
}

/// The verdict of one limit for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evaluation {
    pub admitted: bool,
    /// How long an admitted request waits for its turn (leaky bucket only).
    pub delay: u64,
    /// Requests (of cost 1) still admissible after this one if it is admitted...
    pub remaining_after: u64,
    /// ...and if it is not (nothing consumed).
    pub remaining_before: u64,
    /// Time until the limit is fully reset (window end, bucket full, queue empty).
    pub reset: u64,
    /// Time until a rejected request of this cost could be admitted; 0 when admitted.
    pub retry_after: u64,
    /// The state to store when the request is admitted, and how long to keep it.
    pub new_state: State,
    pub ttl: u64,
}

/// Evaluates `algorithm` for a request of `cost` at `now` against `stored` (ignored when
/// it belongs to another algorithm, as after an edit of the limit).
pub fn evaluate(algorithm: &Algorithm, stored: Option<State>, cost: u64, now: u64) -> Evaluation {
    match *algorithm {
        Algorithm::FixedWindow { limit, window } => fixed_window(limit, window, stored, cost, now),
        Algorithm::SlidingWindow { limit, window } => sliding_window(limit, window, stored, cost, now),
        Algorithm::TokenBucket { rate, per, burst } => token_bucket(rate, per, burst, stored, cost, now),
        Algorithm::LeakyBucket { rate, per, burst } => leaky_bucket(rate, per, burst, stored, cost, now),
    }
}

fn fixed_window(limit: u64, window: u64, stored: Option<State>, cost: u64, now: u64) -> Evaluation {
    let (count, window_end) = match stored {
        Some(State::Fixed { count, window_end }) if window_end > now => (count, window_end),
        _ => (0, now + window),
    };
    let reset = window_end - now;
    let admitted = count + cost <= limit;
    let after = if admitted { count + cost } else { count };
    Evaluation {
        admitted,
        delay: 0,
        remaining_after: limit.saturating_sub(after),
        remaining_before: limit.saturating_sub(count),
        reset,
        retry_after: if admitted { 0 } else { reset },
        new_state: State::Fixed {
            count: after,
            window_end,
        },
        ttl: reset,
    }
}

fn sliding_window(limit: u64, window: u64, stored: Option<State>, cost: u64, now: u64) -> Evaluation {
    let index = now / window;
    let into = now % window;
    let (current, previous) = match stored {
        Some(State::Sliding {
            window_index,
            current,
            previous,
        }) if window_index == index => (current, previous),
        Some(State::Sliding {
            window_index,
            current,
            ..
        }) if window_index + 1 == index => (0, current),
        _ => (0, 0),
    };
    let weight = (window - into) as f64 / window as f64;
    let estimate = previous as f64 * weight + current as f64;
    let admitted = estimate + cost as f64 <= limit as f64;
    let free = |used: f64| floor_count(limit as f64 - used);
    let retry_after = if admitted {
        0
    } else if current + cost > limit || previous == 0 {
        // Only the next window can fit it: there, this window's count is the weighted one.
        let until_next = window - into;
        if current == 0 || cost > limit {
            until_next
        } else {
            let fraction = 1.0 - (limit - cost) as f64 / current as f64;
            until_next + ceil_count(window as f64 * fraction)
        }
    } else {
        // Wait until the previous window's weight has dropped enough.
        let needed = window as f64 - window as f64 * (limit - current - cost) as f64 / previous as f64;
        ceil_count(needed).saturating_sub(into).max(1)
    };
    let after = if admitted { current + cost } else { current };
    Evaluation {
        admitted,
        delay: 0,
        remaining_after: free(previous as f64 * weight + after as f64),
        remaining_before: free(estimate),
        reset: window - into,
        retry_after,
        new_state: State::Sliding {
            window_index: index,
            current: after,
            previous,
        },
        ttl: 2 * window - into,
    }
}

/// `x` rounded down, as a count: `x.floor() as u64` (negatives and NaN 0, past `u64::MAX`
/// that), without the call to `floor` that x86-64's baseline instruction set makes of
/// `f64::floor`; a float's conversion to an integer truncates, which for what the
/// conversion keeps (zero and up) is the floor.
fn floor_count(x: f64) -> u64 {
    x as u64
}

/// `x` rounded up, as a count: `x.ceil() as u64`, without the call to `ceil`.
fn ceil_count(x: f64) -> u64 {
    let down = x as u64;
    if (down as f64) < x {
        down.saturating_add(1)
    } else {
        down
    }
}

/// Microseconds per token (or, for a leaky bucket, per turn).
pub fn interval(rate: f64, per: u64) -> f64 {
    per as f64 / rate
}

fn token_bucket(rate: f64, per: u64, burst: u64, stored: Option<State>, cost: u64, now: u64) -> Evaluation {
    let step = interval(rate, per);
    let capacity = burst as f64;
    let tokens = match stored {
        Some(State::Bucket { tokens, updated }) => {
            (tokens + now.saturating_sub(updated) as f64 / step).min(capacity)
        }
        _ => capacity,
    };
    let admitted = tokens >= cost as f64;
    let left = if admitted { tokens - cost as f64 } else { tokens };
    let until_full = ceil_count((capacity - left) * step);
    Evaluation {
        admitted,
        delay: 0,
        remaining_after: floor_count(left),
        remaining_before: floor_count(tokens),
        reset: until_full,
        retry_after: if admitted {
            0
        } else {
            ceil_count((cost as f64 - tokens) * step).max(1)
        },
        new_state: State::Bucket {
            tokens: left,
            updated: now,
        },
        ttl: until_full.max(1),
    }
}

fn leaky_bucket(rate: f64, per: u64, burst: u64, stored: Option<State>, cost: u64, now: u64) -> Evaluation {
    let step = interval(rate, per);
    let depth = burst as f64 * step;
    let tat = match stored {
        Some(State::Gcra {
            tat,
            step: stored_step,
        }) if stored_step == step => tat.max(now) as f64,
        // The rate or depth was edited: keep the queue, but no longer than the new depth
        // allows, so that the edit itself causes no denial.
        Some(State::Gcra { tat, .. }) => (tat.max(now) as f64).min(now as f64 + depth),
        _ => now as f64,
    };
    let delay = tat - now as f64;
    let wait_for_last = delay + cost.saturating_sub(1) as f64 * step;
    let admitted = wait_for_last <= depth;
    let queue_room = |queued: f64| (((depth - queued) / step).floor() + 1.0).max(0.0) as u64;
    let new_tat = if admitted { tat + cost as f64 * step } else { tat };
    Evaluation {
        admitted,
        delay: if admitted { delay.round() as u64 } else { 0 },
        remaining_after: queue_room(new_tat - now as f64),
        remaining_before: queue_room(delay),
        reset: ceil_count(new_tat - now as f64),
        retry_after: if admitted {
            0
        } else {
            ceil_count(wait_for_last - depth).max(1)
        },
        new_state: State::Gcra {
            tat: new_tat.round() as u64,
            step,
        },
        ttl: ceil_count(new_tat - now as f64).max(1),
    }
}

/// The state after giving back what an admitted request of `cost` consumed (a leaky-bucket
/// request that leaves before its turn; on Redis Cluster, a limit admitted in one slot
/// when another slot refused), and how long to keep it. `None`: nothing to give back.
/// The expiry of a window is kept; a bucket's refill time is recomputed.
pub fn refund(
    algorithm: &Algorithm,
    stored: Option<(State, u64)>,
    cost: u64,
    now: u64,
) -> Option<(State, u64)> {
    let (state, ttl) = stored?;
    match (*algorithm, state) {
        (Algorithm::FixedWindow { .. }, State::Fixed { count, window_end }) if count > 0 => Some((
            State::Fixed {
                count: count - cost.min(count),
                window_end,
            },
            ttl,
        )),
        (
            Algorithm::SlidingWindow { window, .. },
            State::Sliding {
                window_index,
                current,
                previous,
            },
        ) if window_index == now / window => Some((
            State::Sliding {
                window_index,
                current: current.saturating_sub(cost),
                previous,
            },
            ttl,
        )),
        (Algorithm::TokenBucket { burst, .. }, State::Bucket { tokens, updated }) => Some((
            State::Bucket {
                tokens: (tokens + cost as f64).min(burst as f64),
                updated,
            },
            ttl,
        )),
        (Algorithm::LeakyBucket { rate, per, .. }, State::Gcra { tat, step }) => {
            let slot = cost as f64 * interval(rate, per);
            let tat = (tat as f64 - slot).max(now as f64).round() as u64;
            Some((State::Gcra { tat, step }, (tat - now).max(1)))
        }
        _ => None,
    }
}

/// Microseconds in `duration`, saturating.
pub fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests;
