//! One server of an upstream: its connection pool, the requests in flight to it, and
//! whether it is in rotation.
//!
//! Two things take a server out. Passive health: `max_fails` failures within
//! `fail_timeout` take it out for `fail_timeout`; then one request at a time may try it,
//! and a success brings it back. Active health: two failed checks in a row take it out,
//! two good ones bring it back. The request path reads one atomic flag while nothing is
//! wrong, and takes the lock only for a server with a recent failure.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::metrics::DurationHistogram;
use prometheus_client::metrics::gauge::Gauge;

use super::fastcgi;
use super::pool::Pool;
use crate::metrics::ServerSeries;

/// How requests reach a server.
pub(super) enum Transport {
    /// HTTP/1.1, over TLS for an `https://` server.
    Http(Pool),
    FastCgi(fastcgi::Pool),
}

/// Checks in a row that change what active health says.
const CHECKS_TO_CHANGE: u8 = 2;

/// One server and its state.
pub(super) struct Server {
    /// `host:port` (or a unix socket's path): the metric label and the `Host` of active
    /// checks.
    pub(super) label: Arc<str>,
    pub(super) weight: u32,
    pub(super) transport: Transport,
    /// Requests in flight to the server (also its `floodgate_upstream_in_flight`).
    pub(super) in_flight: Gauge,
    /// `floodgate_upstream_duration_seconds` of the server.
    pub(super) duration: DurationHistogram,
    health: Health,
}

impl Server {
    pub(super) fn new(
        label: Arc<str>,
        weight: u32,
        transport: Transport,
        ServerSeries {
            up,
            in_flight,
            duration,
        }: ServerSeries,
        passive: Option<(u32, Duration)>,
    ) -> Self {
        up.set(1);
        Server {
            label,
            weight,
            transport,
            in_flight,
            duration,
            health: Health {
                troubled: AtomicBool::new(false),
                state: Mutex::new(HealthState::default()),
                up,
                passive,
            },
        }
    }

    /// Requests in flight now.
    pub(super) fn load(&self) -> u64 {
        u64::try_from(self.in_flight.get()).unwrap_or(0)
    }

    /// Whether nothing is wrong with the server: in rotation, no failure counted, no trial
    /// request out.
    pub(super) fn untroubled(&self) -> bool {
        !self.health.troubled.load(Ordering::Acquire)
    }

    /// Whether a request may be sent here now: in rotation, or out but due for its one
    /// trial request (which [`Server::claim`] then takes).
    pub(super) fn available(&self, now: Instant) -> bool {
        self.untroubled() || self.health.lock().available(now)
    }

    /// Whether the server is in rotation, its trial request aside.
    pub(super) fn in_rotation(&self) -> bool {
        self.untroubled() || self.health.lock().in_rotation()
    }

    /// Takes the server for a request: false when its one trial request was taken by
    /// another request since [`Server::available`] said yes.
    pub(super) fn claim(&self, now: Instant) -> bool {
        if self.untroubled() {
            return true;
        }
        let mut state = self.health.lock();
        if state.in_rotation() {
            return true;
        }
        if state.available(now) {
            state.trying = true;
            return true;
        }
        false
    }

    /// A request got its response head from the server.
    pub(super) fn succeeded(&self) {
        if self.health.troubled.load(Ordering::Acquire) {
            let mut state = self.health.lock();
            state.fails = 0;
            if state.trying {
                state.trying = false;
                state.down_until = None;
            }
            self.health.settle(&state);
        }
    }

    /// A request failed at the server (connect, reset, or no response head in time).
    pub(super) fn failed(&self, now: Instant) {
        let Some((max_fails, fail_timeout)) = self.health.passive else {
            return;
        };
        let mut state = self.health.lock();
        if state.trying {
            state.trying = false;
            state.down_until = Some(now + fail_timeout);
        } else {
            let window_over = state
                .first_fail
                .is_none_or(|first| now.duration_since(first) > fail_timeout);
            if window_over {
                state.fails = 0;
                state.first_fail = Some(now);
            }
            state.fails += 1;
            if state.fails >= max_fails {
                state.fails = 0;
                state.first_fail = None;
                state.down_until = Some(now + fail_timeout);
            }
        }
        self.health.settle(&state);
    }

    /// The result of one active check.
    pub(super) fn checked(&self, healthy: bool) {
        let mut state = self.health.lock();
        if healthy {
            state.checks_failed = 0;
            state.checks_passed = state.checks_passed.saturating_add(1);
            if state.checks_passed >= CHECKS_TO_CHANGE {
                state.checked_down = false;
            }
        } else {
            state.checks_passed = 0;
            state.checks_failed = state.checks_failed.saturating_add(1);
            if state.checks_failed >= CHECKS_TO_CHANGE {
                state.checked_down = true;
            }
        }
        self.health.settle(&state);
    }
}

/// Whether a server is in rotation.
struct Health {
    /// False while nothing is wrong: no failure counted, not out, not being tried.
    troubled: AtomicBool,
    state: Mutex<HealthState>,
    /// `floodgate_upstream_server_up`.
    up: Gauge,
    /// `max_fails` and `fail_timeout`; `None`: failures never take the server out.
    passive: Option<(u32, Duration)>,
}

impl Health {
    fn lock(&self) -> std::sync::MutexGuard<'_, HealthState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Publishes `state` to the request path's flag and the gauge.
    fn settle(&self, state: &HealthState) {
        let troubled = state.fails > 0 || state.down_until.is_some() || state.trying || state.checked_down;
        self.troubled.store(troubled, Ordering::Release);
        self.up
            .set(i64::from(!state.checked_down && state.down_until.is_none()));
    }
}

#[derive(Default)]
struct HealthState {
    /// Failures counted since `first_fail`.
    fails: u32,
    first_fail: Option<Instant>,
    /// Out of rotation until then (passive health); after it, one request may try.
    down_until: Option<Instant>,
    /// A trial request is on its way.
    trying: bool,
    checks_passed: u8,
    checks_failed: u8,
    /// Out of rotation by active checks.
    checked_down: bool,
}

impl HealthState {
    fn in_rotation(&self) -> bool {
        !self.checked_down && self.down_until.is_none()
    }

    fn available(&self, now: Instant) -> bool {
        if self.checked_down {
            return false;
        }
        match self.down_until {
            None => true,
            Some(until) => now >= until && !self.trying,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::places::ConnectionPlaces;

    fn server(passive: Option<(u32, Duration)>) -> Server {
        let pool = Pool::new(
            "127.0.0.1:9".into(),
            Duration::from_secs(1),
            None,
            &ConnectionPlaces::new(8),
        );
        Server::new(
            "127.0.0.1:9".into(),
            1,
            Transport::Http(pool),
            crate::metrics::Metrics::new().upstream_server(&"u".into(), &"127.0.0.1:9".into()),
            passive,
        )
    }

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn max_fails_within_fail_timeout_take_a_server_out_until_one_trial_succeeds() {
        let s = server(Some((2, 10 * SECOND)));
        let t0 = Instant::now();
        s.failed(t0);
        assert!(s.available(t0) && s.in_rotation(), "one failure of two");
        // The second failure comes after the window: counting starts again.
        s.failed(t0 + 11 * SECOND);
        assert!(s.in_rotation());
        s.failed(t0 + 12 * SECOND);
        let out = t0 + 12 * SECOND;
        assert!(!s.available(out) && !s.in_rotation());
        assert_eq!(s.health.up.get(), 0);
        // After fail_timeout, exactly one request may try it.
        let due = out + 10 * SECOND;
        assert!(s.available(due));
        assert!(s.claim(due));
        assert!(!s.available(due) && !s.claim(due), "one trial at a time");
        s.succeeded();
        assert!(s.in_rotation() && s.claim(due));
        assert_eq!(s.health.up.get(), 1);
        assert!(!s.health.troubled.load(Ordering::Acquire));
    }

    #[test]
    fn a_failed_trial_takes_the_server_out_again() {
        let s = server(Some((1, SECOND)));
        let t0 = Instant::now();
        s.failed(t0);
        assert!(s.claim(t0 + SECOND));
        s.failed(t0 + SECOND);
        assert!(!s.available(t0 + SECOND + SECOND / 2));
        assert!(s.available(t0 + 2 * SECOND));
    }

    #[test]
    fn without_passive_health_failures_change_nothing() {
        let s = server(None);
        let t0 = Instant::now();
        for _ in 0..10 {
            s.failed(t0);
        }
        assert!(s.in_rotation());
        assert!(!s.health.troubled.load(Ordering::Acquire));
    }

    #[test]
    fn two_checks_in_a_row_change_active_health() {
        let s = server(None);
        let now = Instant::now();
        s.checked(false);
        assert!(s.available(now), "one failed check");
        s.checked(true);
        s.checked(false);
        assert!(s.available(now), "not two in a row");
        s.checked(false);
        assert!(!s.available(now) && !s.claim(now));
        assert_eq!(s.health.up.get(), 0);
        s.checked(true);
        assert!(!s.available(now), "one good check");
        s.checked(true);
        assert!(s.available(now));
        assert_eq!(s.health.up.get(), 1);
    }
}
