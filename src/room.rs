//! What requests may hold beyond their connections, process-wide: the files they keep
//! open (a body read whole into a temporary file, a file being served) and the memory of
//! bodies read whole. Each open file is a descriptor, as each client connection is:
//! without a bound, clients asking for many at once (a hundred HTTP/2 streams to a
//! connection, each a download its client does not read or an upload for PHP-FPM) take
//! every descriptor the process has, and it can no longer accept a connection. Bodies and
//! served files have places of their own, so that a flood of one leaves the other be; the
//! memory of bodies and of small files read whole (held until sent) is bounded together.

use std::sync::Arc;
use std::time::Duration;

use rustix::io::Errno;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::logging::LogThrottle;

/// The most memory bodies being read whole and files read whole keep at once (a thousand
/// of 64 KB).
const ALL_IN_MEMORY: usize = 1024 * 64 * 1024;

/// Places for open files, and bytes of memory for bodies read whole.
pub(crate) struct Room {
    /// Temporary files of bodies read whole.
    bodies: Arc<Semaphore>,
    /// Files being served.
    files: Arc<Semaphore>,
    memory: Arc<Semaphore>,
    /// Saying that places ran out.
    warned: LogThrottle,
}

impl Room {
    /// Room for a body's temporary file and for a served file per eight client
    /// connections of `connections` (`server.max_connections`, half the open-file limit
    /// by default: the two kinds together hold a quarter of it at most), and
    /// [`ALL_IN_MEMORY`] bytes.
    pub(crate) fn for_connections(connections: usize) -> Room {
        let places = Room::places_of_a_kind(connections);
        Room::new(places, places, ALL_IN_MEMORY)
    }

    /// The places of each kind (bodies, files) for `connections` client connections.
    pub(crate) fn places_of_a_kind(connections: usize) -> usize {
        (connections / 8).max(1)
    }

    pub(crate) fn new(bodies: usize, files: usize, memory: usize) -> Room {
        let places = |count: usize| Arc::new(Semaphore::new(count.min(Semaphore::MAX_PERMITS)));
        Room {
            bodies: places(bodies),
            files: places(files),
            memory: places(memory),
            warned: LogThrottle::default(),
        }
    }

    /// `bytes` more of memory, if the room has them.
    pub(crate) fn memory(&self, bytes: usize) -> Option<OwnedSemaphorePermit> {
        let bytes = u32::try_from(bytes).ok()?;
        self.memory.clone().try_acquire_many_owned(bytes).ok()
    }

    /// A place for a body's temporary file, waited for up to `wait` (none: only if one is
    /// free now).
    pub(crate) async fn body_place(&self, wait: Duration) -> Option<OwnedSemaphorePermit> {
        let place = match self.bodies.clone().try_acquire_owned() {
            Ok(place) => Some(place),
            Err(_) if wait.is_zero() => None,
            Err(_) => {
                let place = tokio::time::timeout(wait, self.bodies.clone().acquire_owned()).await;
                place.ok().map(|place| place.expect("the room is never closed"))
            }
        };
        self.warn_unless(place.is_some(), "request bodies read whole");
        place
    }

    /// Memory for `bytes` of a file read when it was opened, if the room has them.
    pub(crate) fn file_memory(&self, bytes: usize) -> Option<OwnedSemaphorePermit> {
        let memory = self.memory(bytes);
        self.warn_unless(
            memory.is_some(),
            "the memory of files read whole (64 MB, with bodies read whole)",
        );
        memory
    }

    /// A place for a file to be served, if one is free now.
    pub(crate) fn file_place(&self) -> Option<OwnedSemaphorePermit> {
        let place = self.files.clone().try_acquire_owned().ok();
        self.warn_unless(place.is_some(), "files being served");
        place
    }

    fn warn_unless(&self, found: bool, whose: &str) {
        if !found && self.warned.ready() {
            tracing::warn!(
                "every place for {whose} is taken (an eighth of server.max_connections): requests that need one get 503 (logged once a minute at most)"
            );
        }
    }

    #[cfg(test)]
    pub(crate) fn free(&self) -> (usize, usize, usize) {
        let free = |places: &Semaphore| places.available_permits();
        (free(&self.bodies), free(&self.files), free(&self.memory))
    }
}

/// Whether `error` says the process or the system is out of descriptors or memory.
pub(crate) fn exhausted(error: &std::io::Error) -> bool {
    error.raw_os_error().is_some_and(|code| {
        [Errno::MFILE, Errno::NFILE, Errno::NOMEM].contains(&Errno::from_raw_os_error(code))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_out_of_descriptors_or_memory_is_told_apart() {
        for code in [libc::EMFILE, libc::ENFILE, libc::ENOMEM] {
            assert!(exhausted(&std::io::Error::from_raw_os_error(code)), "{code}");
        }
        for code in [libc::ENOENT, libc::EACCES, libc::ELOOP] {
            assert!(!exhausted(&std::io::Error::from_raw_os_error(code)), "{code}");
        }
    }

    #[test]
    fn places_for_bodies_and_for_files_each_an_eighth_of_the_connections() {
        assert_eq!(Room::for_connections(16).free(), (2, 2, ALL_IN_MEMORY));
        assert_eq!(Room::for_connections(1).free(), (1, 1, ALL_IN_MEMORY));
        let most = Semaphore::MAX_PERMITS / 8;
        assert_eq!(
            Room::for_connections(Semaphore::MAX_PERMITS).free(),
            (most, most, ALL_IN_MEMORY)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn places_are_waited_for_and_come_back_when_dropped() {
        let room = Room::new(1, 1, 10);
        let body = room.body_place(Duration::ZERO).await.unwrap();
        let file = room.file_place().unwrap();
        assert!(room.file_place().is_none(), "a file has a place of its own kind");
        assert!(room.body_place(Duration::ZERO).await.is_none());
        let waited = tokio::time::Instant::now();
        assert!(room.body_place(Duration::from_secs(5)).await.is_none());
        assert_eq!(waited.elapsed(), Duration::from_secs(5));
        assert!(room.memory(11).is_none());
        let memory = room.memory(10).unwrap();
        drop((body, file, memory));
        assert_eq!(room.free(), (1, 1, 10));
        let waiting = tokio::spawn(async move {
            let held = room.body_place(Duration::ZERO).await.unwrap();
            let next = tokio::spawn(async move { room.body_place(Duration::from_secs(5)).await.is_some() });
            tokio::time::sleep(Duration::from_secs(1)).await;
            drop(held);
            next.await.unwrap()
        });
        assert!(
            waiting.await.unwrap(),
            "a place given back goes to the body waiting for one"
        );
    }
}
