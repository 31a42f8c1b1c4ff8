//! When to order: a certificate is renewed at two thirds of its lifetime, or earlier inside
//! the renewal window its CA suggests (ARI, RFC 9773); failed attempts back off. Pure
//! functions of the times they are given (Unix seconds), so that tests need no clock.

use std::time::Duration;

/// The first retry after a failed attempt.
pub(crate) const FIRST_RETRY: Duration = Duration::from_secs(60);
/// Retries never wait longer than this, unless the CA asks for more.
pub(crate) const LONGEST_RETRY: Duration = Duration::from_secs(3600);

/// When a certificate valid from `not_before` to `not_after` is renewed without ARI.
pub(crate) fn two_thirds(not_before: i64, not_after: i64) -> i64 {
    not_before + (not_after - not_before).max(0) * 2 / 3
}

/// When to renew inside the CA's suggested window `[start, end]`: at `random` (0 to 1) of
/// the way through it, as RFC 9773 §4.2 asks (so that a CA's many clients spread out), or
/// now when the window has passed.
pub(crate) fn within_window(start: i64, end: i64, now: i64, random: f64) -> i64 {
    if end <= now {
        return now;
    }
    let start = start.max(now);
    start + ((end - start) as f64 * random.clamp(0.0, 1.0)) as i64
}

/// How long to wait after the `failures`-th failed attempt in a row (1 for the first):
/// [`FIRST_RETRY`], doubling up to [`LONGEST_RETRY`]; longer when the CA's `Retry-After`
/// says so.
pub(crate) fn retry_delay(failures: u32, retry_after: Option<Duration>) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    let backoff = FIRST_RETRY.saturating_mul(1 << doublings).min(LONGEST_RETRY);
    retry_after.map_or(backoff, |asked| asked.max(backoff))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_comes_at_two_thirds_of_the_lifetime() {
        // Let's Encrypt's 90 days: renewed on day 60.
        let day = 86_400;
        assert_eq!(two_thirds(1_000, 1_000 + 90 * day), 1_000 + 60 * day);
        assert_eq!(two_thirds(0, 30), 20);
        assert_eq!(two_thirds(10, 5), 10, "a backwards validity renews at once");
    }

    #[test]
    fn a_suggested_window_is_used_at_a_random_point() {
        assert_eq!(within_window(100, 200, 50, 0.0), 100);
        assert_eq!(within_window(100, 200, 50, 0.5), 150);
        assert_eq!(within_window(100, 200, 50, 1.0), 200);
        // Inside the window: from now on.
        assert_eq!(within_window(100, 200, 150, 0.5), 175);
        // Past it: now.
        assert_eq!(within_window(100, 200, 250, 0.5), 250);
    }

    #[test]
    fn failures_back_off_from_a_minute_to_an_hour() {
        let minutes = |n: u64| Duration::from_secs(60 * n);
        let delays: Vec<Duration> = (1..=8).map(|n| retry_delay(n, None)).collect();
        assert_eq!(
            delays,
            [
                minutes(1),
                minutes(2),
                minutes(4),
                minutes(8),
                minutes(16),
                minutes(32),
                minutes(60),
                minutes(60)
            ]
        );
        assert_eq!(retry_delay(1000, None), minutes(60));
        // The CA's Retry-After wins when longer, even past the hour.
        assert_eq!(retry_delay(1, Some(minutes(5))), minutes(5));
        assert_eq!(retry_delay(1, Some(minutes(300))), minutes(300));
        assert_eq!(retry_delay(3, Some(Duration::from_secs(1))), minutes(4));
    }
}
