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

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::logging::LogThrottle;

/// A pool of idle connections that can give one up for a connection elsewhere.
pub(super) trait CloseIdle: Send + Sync {
    /// Closes one of the pool's idle connections (the longest idle of a thread's); false
    /// when none is idle.
    fn close_idle(&self) -> bool;
}

/// The places for connections to upstream servers.
pub(crate) struct ConnectionPlaces {
    places: Arc<Semaphore>,
    /// The idle connections of every server, which a request for another server with no
    /// place free may close.
    idle: Mutex<Vec<Weak<dyn CloseIdle>>>,
    /// Requests waiting for a place: while one does, a connection done with its request
    /// goes to one for its server or closes, instead of waiting idle.
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

    /// A free place, if there is one.
    pub(super) fn free(&self) -> Option<Place> {
        let place = self.places.clone().try_acquire_owned().ok()?;
        Some(Place::of(place))
    }

    /// Counts a request as waiting for a place until [`stopped_waiting`](Self::stopped_waiting):
    /// meanwhile a connection done with its request closes rather than wait idle, unless
    /// it goes to a request for its own server. `idle::Returns` keeps the count for the
    /// requests in its queues, whose futures may be dropped at any point.
    pub(super) fn began_waiting(&self) {
        self.waiting.fetch_add(1, Ordering::SeqCst);
    }

    /// Counts a request out of those waiting for a place.
    pub(super) fn stopped_waiting(&self) {
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }

    /// Requests waiting for a place.
    pub(super) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// The first place given back before `until` (`None` past it).
    pub(super) async fn given_back(&self, until: Instant) -> Option<Place> {
        let acquired = tokio::time::timeout_at(until, self.places.clone().acquire_owned()).await;
        acquired
            .ok()
            .map(|place| Place::of(place.expect("the places are never closed")))
    }

    /// Says (once a minute at most) that a request found no place in time.
    pub(super) fn ran_out(&self) {
        if self.warned.ready() {
            tracing::warn!(
                "every place for a connection to an upstream server is taken (one per server.max_connections, fewer under a short open-file limit): requests that need a new one get 503 (logged once a minute at most)"
            );
        }
    }

    /// Whether a new connection waits for a place: then one done with its request is
    /// closed rather than kept idle, unless it goes to a request for its own server.
    pub(super) fn wanted(&self) -> bool {
        self.waiting() > 0
    }

    /// Closes a connection idle to a server other than `own`'s; false when none is idle.
    pub(super) fn close_an_idle_connection(&self, own: &dyn CloseIdle) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A place among `places` before `until`, as a request for a new connection takes
    /// one (`idle::IdlePool::connect`, less the connections handed over): a free one, or
    /// one an idle connection gives up, or the first given back.
    async fn take(places: &ConnectionPlaces, until: Instant, own: &dyn CloseIdle) -> Option<Place> {
        if let Some(place) = places.free() {
            return Some(place);
        }
        places.began_waiting();
        let mut place = None;
        while place.is_none() && places.close_an_idle_connection(own) {
            place = places.free();
        }
        if place.is_none() {
            place = places.given_back(until).await;
        }
        places.stopped_waiting();
        place
    }

    /// A pool with `idle` connections, each holding a place.
    #[derive(Default)]
    struct Idle(Mutex<Vec<Place>>, AtomicUsize);

    impl CloseIdle for Idle {
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
        let idle = Arc::new(Idle::default());
        places.share_idle(Arc::downgrade(&idle) as Weak<dyn CloseIdle>);
        // The pool of the server the requests below want a connection to.
        let own = Idle::default();
        let first = take(&places, soon(), &own).await.expect("a free place");
        let kept_idle = take(&places, soon(), &own).await.expect("a free place");
        idle.0.lock().unwrap().push(kept_idle);
        assert_eq!(places.free_places(), 0);

        // None free: the idle connection is closed for it.
        let second = take(&places, soon(), &own)
            .await
            .expect("the idle connection's place");
        assert_eq!(idle.1.load(Ordering::Relaxed), 1);

        // None free, none idle: waits until its deadline, then has none.
        let started = Instant::now();
        assert!(take(&places, soon(), &own).await.is_none());
        assert_eq!(started.elapsed(), Duration::from_secs(1));

        // A request does not close a connection idle to its own server for a place.
        idle.0.lock().unwrap().push(second);
        assert!(take(&places, soon(), &*idle).await.is_none());
        assert_eq!(idle.1.load(Ordering::Relaxed), 1);
        let second = idle.0.lock().unwrap().pop().expect("still idle");

        // A place given back while one waits is the waiter's; meanwhile connections done
        // with their requests are told to close rather than wait idle.
        assert!(!places.wanted());
        let waiting = tokio::spawn({
            let places = places.clone();
            async move {
                let own = Idle::default();
                take(&places, Instant::now() + Duration::from_secs(5), &own)
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
}
