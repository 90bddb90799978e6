//! The gRPC port's accept loop: Nagle off, at most `server.connections_max` open
//! connections and `server.connections_per_peer_max` from one address, a deadline for a
//! connection's first bytes, and accept errors that never stall the server.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::ServerConfig;

/// After an accept error that is not about one connection (out of file descriptors,
/// out of memory), the loop pauses this long instead of spinning on the same error.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// An accepted connection, holding its slots until it closes.
pub(crate) struct Connection {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
    _peer: PeerSlot,
}

/// The connection limits and what is held of them.
struct Slots {
    total: Arc<Semaphore>,
    connections_max: usize,
    per_peer: Arc<Mutex<HashMap<IpAddr, usize>>>,
    per_peer_max: usize,
    first_bytes: Duration,
}

/// One of a peer address's connection slots; dropping it gives the slot back.
struct PeerSlot {
    peer: IpAddr,
    counts: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(count) = counts.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.peer);
            }
        }
    }
}

impl Slots {
    /// Both slots of a new connection from `peer`, or why it is refused.
    fn take(&self, peer: IpAddr) -> Result<(OwnedSemaphorePermit, PeerSlot), &'static str> {
        let total = Arc::clone(&self.total).try_acquire_owned().map_err(|_| "server.connections_max")?;
        let mut counts = self.per_peer.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = counts.entry(peer).or_insert(0);
        if *count >= self.per_peer_max {
            return Err("server.connections_per_peer_max");
        }
        *count += 1;
        Ok((total, PeerSlot { peer, counts: Arc::clone(&self.per_peer) }))
    }
}

/// The accepted connections. tonic's own loop skips a failed accept without a pause
/// and logs it only at trace level, so running out of file descriptors would spin a
/// core in silence; this loop logs such errors, pauses and goes on, and yields none.
pub(crate) fn incoming(
    listener: TcpListener,
    server: &ServerConfig,
) -> ReceiverStream<io::Result<Connection>> {
    let slots = Slots {
        total: Arc::new(Semaphore::new(server.connections_max)),
        connections_max: server.connections_max,
        per_peer: Arc::default(),
        per_peer_max: server.connections_per_peer_max,
        first_bytes: Duration::from_millis(server.handshake_timeout_ms),
    };
    let (accepted, incoming) = mpsc::channel(16);
    tokio::spawn(accept_loop(listener, slots, accepted));
    ReceiverStream::new(incoming)
}

async fn accept_loop(listener: TcpListener, slots: Slots, accepted: mpsc::Sender<io::Result<Connection>>) {
    loop {
        let next = tokio::select! {
            next = listener.accept() => next,
            // The server stopped: stop accepting and close the listener.
            () = accepted.closed() => return,
        };
        let (stream, peer) = match next {
            Ok(accepted) => accepted,
            Err(error) if per_connection(&error) => continue,
            Err(error) => {
                tracing::warn!(%error, "accepting a connection failed; retrying");
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        let (slot, peer_slot) = match slots.take(peer.ip()) {
            Ok(slots) => slots,
            Err(limit) => {
                // Closing at once tells the client to go elsewhere; leaving it in the
                // backlog would let it wait for a handshake that never comes.
                metrics::counter!("oncegate_connections_refused_total", "limit" => limit).increment(1);
                tracing::debug!(%peer, limit, connections_max = slots.connections_max, "connection refused");
                continue;
            }
        };
        // Without this, small replies wait for the peer's delayed ACK (about 40 ms).
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "setting TCP_NODELAY failed");
        }
        let connection = Connection { stream, _slot: slot, _peer: peer_slot };
        tokio::spawn(first_bytes(connection, slots.first_bytes, accepted.clone()));
    }
}

/// Hands the connection on once it has sent something; a socket that stays silent past
/// the deadline is closed, so silent sockets cannot hold connection slots. (tonic's TLS
/// handshake then runs under the same deadline.)
async fn first_bytes(
    connection: Connection,
    deadline: Duration,
    accepted: mpsc::Sender<io::Result<Connection>>,
) {
    // `peek` waits for a byte and leaves it for the protocol (`readable` may wake
    // without data); end of stream passes too, and the server sees the close at once.
    let mut byte = [0u8; 1];
    match tokio::time::timeout(deadline, connection.stream.peek(&mut byte)).await {
        Ok(Ok(_)) => {
            let _ = accepted.send(Ok(connection)).await;
        }
        Ok(Err(_)) | Err(_) => {
            metrics::counter!("oncegate_connections_refused_total", "limit" => "server.handshake_timeout_ms")
                .increment(1);
        }
    }
}

/// Errors that concern only the connection being accepted.
fn per_connection(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::Interrupted
    )
}

impl Connected for Connection {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Connection {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
