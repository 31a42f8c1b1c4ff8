//! What requests may hold beyond their connections, process-wide: the files they keep
//! open (a body read whole into a temporary file, a file being served) and the memory of
//! bodies read whole. Each open file is a descriptor, as each client connection is:
//! without a bound, clients asking for many at once (a hundred HTTP/2 streams to a
//! connection, each a download its client does not read or an upload for PHP-FPM) take
//! every descriptor the process has, and it can no longer accept a connection.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The most memory all bodies being read whole keep at once (a thousand full ones of
/// 64 KB).
const ALL_IN_MEMORY: usize = 1024 * 64 * 1024;

/// Places for open files, and bytes of memory for bodies read whole.
pub(crate) struct Room {
    files: Arc<Semaphore>,
    memory: Arc<Semaphore>,
}

impl Room {
    /// Room for an open file per four client connections of `connections`
    /// (`server.max_connections`, half the open-file limit by default), and
    /// [`ALL_IN_MEMORY`] bytes.
    pub(crate) fn for_connections(connections: usize) -> Room {
        Room::new((connections / 4).max(1), ALL_IN_MEMORY)
    }

    pub(crate) fn new(files: usize, memory: usize) -> Room {
        Room {
            files: Arc::new(Semaphore::new(files.min(Semaphore::MAX_PERMITS))),
            memory: Arc::new(Semaphore::new(memory)),
        }
    }

    /// `bytes` more of memory, if the room has them.
    pub(crate) fn memory(&self, bytes: usize) -> Option<OwnedSemaphorePermit> {
        let bytes = u32::try_from(bytes).ok()?;
        self.memory.clone().try_acquire_many_owned(bytes).ok()
    }

    /// An open file's place, if one is free now.
    pub(crate) fn file_now(&self) -> Option<OwnedSemaphorePermit> {
        self.files.clone().try_acquire_owned().ok()
    }

    /// An open file's place, waited for up to `wait`.
    pub(crate) async fn file(&self, wait: Duration) -> Option<OwnedSemaphorePermit> {
        let place = tokio::time::timeout(wait, self.files.clone().acquire_owned());
        place
            .await
            .ok()
            .map(|place| place.expect("the room is never closed"))
    }

    #[cfg(test)]
    pub(crate) fn free(&self) -> (usize, usize) {
        (self.files.available_permits(), self.memory.available_permits())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_place_for_every_four_connections() {
        assert_eq!(Room::for_connections(8).free(), (2, ALL_IN_MEMORY));
        assert_eq!(Room::for_connections(1).free().0, 1);
        assert_eq!(
            Room::for_connections(Semaphore::MAX_PERMITS).free().0,
            Semaphore::MAX_PERMITS / 4
        );
    }

    #[tokio::test]
    async fn places_come_back_when_dropped_and_are_waited_for() {
        let room = Room::new(1, 10);
        let place = room.file_now().unwrap();
        assert!(room.file_now().is_none());
        assert!(room.file(Duration::from_millis(10)).await.is_none());
        assert!(room.memory(11).is_none());
        let memory = room.memory(10).unwrap();
        drop((place, memory));
        assert_eq!(room.free(), (1, 10));
        assert!(
            room.file(Duration::ZERO).await.is_some(),
            "a free place is taken without waiting"
        );
    }
}
