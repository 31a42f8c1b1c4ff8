//! How many connections to upstream servers may be open at once, process-wide: one per
//! client connection (`server.max_connections`), fewer when the open-file limit is short
//! (`server::upstream_connections`). A client connection over HTTP/1.1 uses
//! one at a time; one over HTTP/2 may carry a hundred requests at once, each wanting a
//! connection of its own, and without a bound a few such clients take every descriptor
//! the process has (it can then accept no connection, open no file). A connection holds
//! its place while it is open, idle ones included; one that finds no place free first
//! closes a connection idle to another server, and otherwise waits within its connect
//! timeout for a place, or for a connection to its server that another request is done
//! with: while only requests for that server wait, such a connection goes to them rather
//! than closing (a gateway saturated by one server's requests reuses its connections
//! instead of opening one per request); while requests for other servers wait too, it
//! closes, and its place goes to the first request in line, whatever its server.
//!
//! Health checks open their connections outside the count: a flood of requests must not
//! make a healthy server look down.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::logging::LogThrottle;

/// A pool of idle connections that can give one up for a connection elsewhere.
pub(super) trait CloseIdle: Send + Sync {
    /// Closes one of the pool's idle connections (the longest idle of a thread's); false
    /// when none is idle.
    fn close_idle(&self) -> bool;

    /// Whether one of the pool's connections is idle.
    fn has_idle(&self) -> bool;
}

/// A server's requests waiting for a place: a connection to that server done with its
/// request goes to them rather than closing.
#[derive(Default)]
pub(super) struct Returns {
    waiting: AtomicUsize,
    returned: Notify,
}

impl Returns {
    /// Tells the first waiting request that a connection to its server is idle.
    pub(super) fn hand_over(&self) {
        self.returned.notify_one();
    }
}

/// What a request with no idle connection to its server gets.
pub(super) enum Opening {
    /// A place to open a connection in.
    Place(Place),
    /// Word that a connection to its server came back idle meanwhile (another request
    /// may take it first).
    Returned,
}

/// The places for connections to upstream servers.
pub(crate) struct ConnectionPlaces {
    places: Arc<Semaphore>,
    /// The idle connections of every server, which a connection with no place free may
    /// close.
    idle: Mutex<Vec<Weak<dyn CloseIdle>>>,
    /// Connections waiting for a place: while one does, a connection done with its
    /// request closes instead of waiting idle.
    waiting: AtomicUsize,
    /// Saying that places ran out.
    warned: LogThrottle,
}

/// A connection's place, given back when the connection closes. The places themselves
/// rather than a permit of theirs: it is part of every connection, which moves with each
/// request, and a permit is twice its size.
pub(crate) struct Place(Option<Arc<Semaphore>>);

impl Place {
    /// For a connection not counted (a health check's).
    pub(super) fn uncounted() -> Place {
        Place(None)
    }

    fn of(permit: OwnedSemaphorePermit) -> Place {
        let places = permit.semaphore().clone();
        permit.forget();
        Place(Some(places))
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Some(places) = &self.0 {
            places.add_permits(1);
        }
    }
}

impl ConnectionPlaces {
    /// Places for `count` connections.
    pub(crate) fn new(count: usize) -> Arc<ConnectionPlaces> {
        Arc::new(ConnectionPlaces {
            places: Arc::new(Semaphore::new(count.clamp(1, Semaphore::MAX_PERMITS))),
            idle: Mutex::default(),
            waiting: AtomicUsize::new(0),
            warned: LogThrottle::default(),
        })
    }

    /// Lets a connection with no place free close one of `pool`'s idle connections.
    pub(super) fn share_idle(&self, pool: Weak<dyn CloseIdle>) {
        let mut pools = self.lock_idle();
        pools.retain(|pool| pool.strong_count() > 0);
        pools.push(pool);
    }

    /// A place for a new connection to the server of `returns` and `own` (its idle
    /// connections): a free one, or one a connection idle to another server gives up, or
    /// else the first given back before `until` (`None` past it), unless a connection to
    /// that server is idle or comes back idle first.
    pub(super) async fn take(
        &self,
        until: Instant,
        returns: &Returns,
        own: &dyn CloseIdle,
    ) -> Option<Opening> {
        if let Some(place) = self.free() {
            return Some(Opening::Place(place));
        }
        // Counted and listening first: a connection to this server that becomes idle from
        // here on wakes this request (a notification that finds nobody listening is kept
        // for one request only), and one to another server closes for it.
        let _waiting = (Waiting::on(&self.waiting), Waiting::on(&returns.waiting));
        let returned = returns.returned.notified();
        tokio::pin!(returned);
        returned.as_mut().enable();
        if own.has_idle() {
            return Some(Opening::Returned);
        }
        while self.close_an_idle_connection(own) {
            if let Some(place) = self.free() {
                return Some(Opening::Place(place));
            }
        }
        let acquired = tokio::time::timeout_at(until, self.places.clone().acquire_owned());
        let place = tokio::select! {
            biased;
            () = &mut returned => return Some(Opening::Returned),
            acquired = acquired => acquired
                .ok()
                .map(|place| Place::of(place.expect("the places are never closed"))),
        };
        if place.is_none() && self.warned.ready() {
            tracing::warn!(
                "every place for a connection to an upstream server is taken (one per server.max_connections, fewer under a short open-file limit): requests that need a new one get 503 (logged once a minute at most)"
            );
        }
        place.map(Opening::Place)
    }

    /// Whether a new connection waits for a place: then one done with its request is
    /// closed rather than kept idle, unless it [goes to one](Self::hands_over).
    pub(super) fn wanted(&self) -> bool {
        self.waiting.load(Ordering::SeqCst) > 0
    }

    /// Whether a connection to the server of `returns` done with its request goes to a
    /// request waiting for a place: when every request waiting is for that server (with
    /// others waiting too it closes, so that a flood of requests for one server cannot
    /// keep the places from the others).
    pub(super) fn hands_over(&self, returns: &Returns) -> bool {
        let for_server = returns.waiting.load(Ordering::SeqCst);
        for_server > 0 && for_server >= self.waiting.load(Ordering::SeqCst)
    }

    fn free(&self) -> Option<Place> {
        let place = self.places.clone().try_acquire_owned().ok()?;
        Some(Place::of(place))
    }

    /// Closes a connection idle to a server other than `own`'s; false when none is idle.
    fn close_an_idle_connection(&self, own: &dyn CloseIdle) -> bool {
        let own = std::ptr::from_ref(own).cast::<()>();
        let pools: Vec<_> = self.lock_idle().iter().filter_map(Weak::upgrade).collect();
        pools
            .iter()
            .filter(|pool| !std::ptr::eq(Arc::as_ptr(pool).cast::<()>(), own))
            .any(|pool| pool.close_idle())
    }

    fn lock_idle(&self) -> std::sync::MutexGuard<'_, Vec<Weak<dyn CloseIdle>>> {
        self.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    #[cfg(test)]
    pub(crate) fn free_places(&self) -> usize {
        self.places.available_permits()
    }
}

/// One connection counted as waiting for a place while this lives (its request may be
/// dropped while it waits).
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn on(waiting: &'a AtomicUsize) -> Self {
        waiting.fetch_add(1, Ordering::SeqCst);
        Waiting(waiting)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A pool with no idle connection.
    struct NoIdle;

    impl CloseIdle for NoIdle {
        fn close_idle(&self) -> bool {
            false
        }

        fn has_idle(&self) -> bool {
            false
        }
    }

    /// A place among `places` before `until`, for a server no connection comes back to.
    async fn take(places: &ConnectionPlaces, until: Instant) -> Option<Place> {
        match places.take(until, &Returns::default(), &NoIdle).await? {
            Opening::Place(place) => Some(place),
            Opening::Returned => unreachable!("nothing is handed over"),
        }
    }

    /// A pool with `idle` connections, each holding a place.
    struct Idle(Mutex<Vec<Place>>, AtomicUsize);

    impl CloseIdle for Idle {
        fn has_idle(&self) -> bool {
            !self.0.lock().unwrap().is_empty()
        }

        fn close_idle(&self) -> bool {
            let closed = self.0.lock().unwrap().pop().is_some();
            if closed {
                self.1.fetch_add(1, Ordering::Relaxed);
            }
            closed
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_takes_an_idle_ones_place_else_waits_until_its_deadline() {
        let places = ConnectionPlaces::new(2);
        let soon = || Instant::now() + Duration::from_secs(1);
        let idle = Arc::new(Idle(Mutex::new(vec![]), AtomicUsize::new(0)));
        places.share_idle(Arc::downgrade(&idle) as Weak<dyn CloseIdle>);
        let first = take(&places, soon()).await.expect("a free place");
        let kept_idle = take(&places, soon()).await.expect("a free place");
        idle.0.lock().unwrap().push(kept_idle);
        assert_eq!(places.free_places(), 0);

        // None free: the idle connection is closed for it.
        let second = take(&places, soon()).await.expect("the idle connection's place");
        assert_eq!(idle.1.load(Ordering::Relaxed), 1);

        // None free, none idle: waits until its deadline, then has none.
        let started = Instant::now();
        assert!(take(&places, soon()).await.is_none());
        assert_eq!(started.elapsed(), Duration::from_secs(1));

        // A place given back while one waits is the waiter's; meanwhile connections done
        // with their requests are told to close rather than wait idle.
        assert!(!places.wanted());
        let waiting = tokio::spawn({
            let places = places.clone();
            async move {
                take(&places, Instant::now() + Duration::from_secs(5))
                    .await
                    .is_some()
            }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(places.wanted());
        drop(first);
        assert!(waiting.await.unwrap());
        assert!(!places.wanted());
        drop(second);
        assert_eq!(
            places.free_places(),
            2,
            "every place back once its connection closed"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_given_back_to_the_same_server_goes_to_its_waiting_request() {
        let places = ConnectionPlaces::new(1);
        let held = take(&places, Instant::now()).await.expect("a free place");
        let returns = Arc::new(Returns::default());
        let wait_for = |returns: Arc<Returns>| {
            let places = places.clone();
            tokio::spawn(async move {
                let until = Instant::now() + Duration::from_secs(5);
                matches!(
                    places.take(until, &returns, &NoIdle).await,
                    Some(Opening::Returned)
                )
            })
        };
        assert!(!places.hands_over(&returns));
        let waiting = wait_for(returns.clone());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(places.hands_over(&returns) && places.wanted());
        returns.hand_over();
        assert!(
            waiting.await.unwrap(),
            "told of the connection, not given a place"
        );
        assert!(!places.hands_over(&returns) && !places.wanted());

        // With a request for another server waiting too, a connection is not handed
        // over: it closes, and its place goes to the first in line.
        let waiting = wait_for(returns.clone());
        tokio::time::sleep(Duration::from_millis(10)).await;
        let other = wait_for(Arc::new(Returns::default()));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!places.hands_over(&returns) && places.wanted());
        drop(held);
        assert!(!waiting.await.unwrap(), "the first in line got the place");
        other.abort();
    }
}
