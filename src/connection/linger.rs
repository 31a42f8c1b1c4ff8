//! Lingering close (RFC 9112 §9.6). A connection floodgate closes while its client is
//! still sending (an upload answered before it was read: a route that never reads it, a
//! `413`, a refusal, a server's early answer) has bytes nobody read, and closing a socket
//! with unread bytes makes the kernel reset the connection: the reset drops whatever of
//! the answer was not yet sent, and a client that sends before it reads never sees its
//! answer. So such a connection is ended from floodgate's side first (its answer, then
//! FIN) and kept reading, what arrives discarded, until the client closes or for
//! [`LINGER`] at most, as nginx's `lingering_close` does.

use std::os::fd::OwnedFd;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a closed connection's client may go on sending before it is reset.
const LINGER: Duration = Duration::from_secs(5);

/// Ends floodgate's side of `socket` (a duplicate of a dropped connection's, which shares
/// its non-blocking mode), then reads and discards until the client closes, fails, or
/// [`LINGER`] has passed.
pub(super) async fn drain(socket: OwnedFd) {
    let Ok(mut stream) = TcpStream::from_std(std::net::TcpStream::from(socket)) else {
        return;
    };
    let _ = stream.shutdown().await;
    let mut scratch = [0u8; 8192];
    let _ = tokio::time::timeout(LINGER, async {
        while let Ok(1..) = stream.read(&mut scratch).await {}
    })
    .await;
}
