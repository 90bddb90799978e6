//! The gRPC port's accept loop: Nagle off, at most `server.connections_max` open
//! connections and `server.connections_per_peer_max` from one peer (an IPv4 address or an
//! IPv6 /64 network), and accept errors that never stall the server. Each connection has
//! deadlines of its own: its first request head (TLS handshake and HTTP/2 preface
//! included) within `server.handshake_timeout_ms`, when it carries no request
//! `server.idle_timeout_ms` until it is closed, and `server.send_timeout_ms` for a peer
//! that stopped reading an answer (`activity.rs`). The dispatcher ([`crate::dispatch`]) tells a
//! connection's [`Activity`] when a request starts and when its response ends.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

use crate::ServerConfig;
use oncegate_listen::activity::{Activity, Limits, Timed};

/// The most bytes a connection gathers before writing them (`Connection::poll_flush`);
/// a larger write goes to the socket at once.
const GATHERED_BYTES_MAX: usize = 64 * 1024;
/// What an emptied buffer keeps of its capacity: a burst of answers at 64 calls in flight
/// takes about 20 KiB, and thousands of idle connections should not hold 64 KiB each.
const GATHERED_CAPACITY_KEPT_BYTES: usize = 16 * 1024;

/// An accepted connection, holding its slots until it closes.
///
/// It gathers what the protocol writes and writes it at a flush, one scheduler turn late:
/// each call's answer is its own task, and the connection's task, woken by each in turn,
/// would otherwise write every answer alone (tokio runs the task a task woke next), one
/// `writev` and one loopback delivery per call, most of a unary call's kernel time. The
/// first flush of a gathering wakes its own task and returns pending, which tokio takes
/// as a yield (to the back of the worker's queue), so the other answers already ready
/// join it; the next flush writes them all.
pub(crate) struct Connection {
    /// The socket, whose reads and writes fail once a deadline passed (the protocol then
    /// closes the connection).
    stream: Timed<TcpStream>,
    /// Bytes taken from the protocol and not yet written to the socket.
    gathered: Vec<u8>,
    /// Whether this gathering's flush has yielded once.
    yielded: bool,
    _slot: OwnedSemaphorePermit,
    _peer: PeerSlot,
}

/// What tonic puts in each request's extensions: the connection's [`Activity`].
#[derive(Clone, Debug)]
pub(crate) struct ConnectionInfo {
    pub activity: Arc<Activity>,
}

/// The connection limits and what is held of them.
struct Slots {
    total: Arc<Semaphore>,
    connections_max: usize,
    per_peer: Arc<Mutex<HashMap<IpAddr, usize>>>,
    per_peer_max: usize,
    deadlines: Limits,
}

/// One of a peer's connection slots; dropping it gives the slot back.
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

/// The peer a connection counts against: its IPv4 address, or its IPv6 address's /64
/// network, which one host commonly holds whole (counted by address, a host with a /64
/// would have no per-peer limit at all).
fn peer_of(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V4(_) => address,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from_bits(v6.to_bits() & !u128::from(u64::MAX))),
        },
    }
}

impl Slots {
    /// Both slots of a new connection from `address`, or why it is refused.
    fn take(&self, address: IpAddr) -> Result<(OwnedSemaphorePermit, PeerSlot), &'static str> {
        let peer = peer_of(address);
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
        deadlines: server.connection_deadlines(),
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
            Err(error) if oncegate_listen::per_connection(&error) => continue,
            Err(error) => {
                tracing::warn!(%error, "accepting a connection failed; retrying");
                tokio::time::sleep(oncegate_listen::ACCEPT_RETRY).await;
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
        let connection = Connection::new(stream, (slot, peer_slot), &slots);
        if accepted.send(Ok(connection)).await.is_err() {
            return;
        }
    }
}

impl Connected for Connection {
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> ConnectionInfo {
        ConnectionInfo { activity: Arc::clone(self.stream.activity()) }
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

impl Connection {
    fn new(stream: TcpStream, (slot, peer): (OwnedSemaphorePermit, PeerSlot), slots: &Slots) -> Connection {
        Connection {
            stream: Timed::new(stream, slots.deadlines),
            gathered: Vec::new(),
            yielded: false,
            _slot: slot,
            _peer: peer,
        }
    }

    /// Writes what is gathered, as far as the socket takes it.
    fn poll_write_gathered(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.gathered.is_empty() {
            let written = std::task::ready!(Pin::new(&mut self.stream).poll_write(cx, &self.gathered))?;
            if written == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.gathered.drain(..written);
        }
        self.gathered.shrink_to(GATHERED_CAPACITY_KEPT_BYTES);
        Poll::Ready(Ok(()))
    }
}

impl Drop for Connection {
    /// What a protocol wrote last and never flushed goes out if the socket takes it now:
    /// rustls writes the alert of a failed handshake without flushing it, and tonic then
    /// drops the connection, so a client refused for its certificate would otherwise see
    /// only the close.
    fn drop(&mut self) {
        let mut gathered = &self.gathered[..];
        while let Ok(written @ 1..) = self.stream.get_ref().try_write(gathered) {
            gathered = &gathered[written..];
        }
    }
}

impl AsyncWrite for Connection {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.gathered.len() + buf.len() > GATHERED_BYTES_MAX {
            std::task::ready!(self.poll_write_gathered(cx))?;
            if buf.len() > GATHERED_BYTES_MAX {
                return Pin::new(&mut self.stream).poll_write(cx, buf);
            }
        }
        self.gathered.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let len: usize = bufs.iter().map(|buf| buf.len()).sum();
        if self.gathered.len() + len > GATHERED_BYTES_MAX {
            std::task::ready!(self.poll_write_gathered(cx))?;
            if len > GATHERED_BYTES_MAX {
                return Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
            }
        }
        for buf in bufs {
            self.gathered.extend_from_slice(buf);
        }
        Poll::Ready(Ok(len))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.gathered.is_empty() && !self.yielded {
            self.yielded = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        std::task::ready!(self.poll_write_gathered(cx))?;
        self.yielded = false;
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.poll_write_gathered(cx))?;
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Slots for `connections_max` connections, one a peer, with a minute for a request
    /// head and no other deadline.
    fn slots(connections_max: usize) -> Slots {
        Slots {
            total: Arc::new(Semaphore::new(connections_max)),
            connections_max,
            per_peer: Arc::default(),
            per_peer_max: 1,
            deadlines: Limits {
                request_head: oncegate_listen::activity::Timeout {
                    within: std::time::Duration::from_secs(60),
                    setting: "test",
                },
                idle: None,
                send: None,
            },
        }
    }

    /// A connection to a listener of the test's own, and the listener's end of it.
    async fn pair() -> (Connection, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (peer, _) = listener.accept().await.unwrap();
        let slots = slots(1);
        let taken = slots.take(stream.peer_addr().unwrap().ip()).unwrap();
        (Connection::new(stream, taken, &slots), peer)
    }

    /// Addresses of one IPv6 /64 network share their peer's slots; an IPv4 address counts
    /// alone, and as itself when mapped into IPv6. (Counted by address, a host holding a
    /// /64 had no per-peer limit.)
    #[test]
    fn addresses_of_one_ipv6_network_share_their_slots() {
        let slots = slots(8);
        let ip = |text: &str| text.parse::<IpAddr>().unwrap();
        let first = slots.take(ip("2001:db8:1:2::1")).unwrap();
        assert_eq!(slots.take(ip("2001:db8:1:2::ffff:1")).err(), Some("server.connections_per_peer_max"));
        let other_network = slots.take(ip("2001:db8:1:3::1")).unwrap();
        let v4 = slots.take(ip("192.0.2.7")).unwrap();
        assert_eq!(slots.take(ip("::ffff:192.0.2.7")).err(), Some("server.connections_per_peer_max"));
        drop(first);
        assert!(slots.take(ip("2001:db8:1:2::2")).is_ok(), "the network's slot came back");
        drop((other_network, v4));
    }

    /// The first flush of a gathering yields (pending, its task woken, nothing written);
    /// the next writes everything, in order.
    #[tokio::test]
    async fn a_flush_yields_once_then_writes_what_was_gathered() {
        let (mut connection, mut peer) = pair().await;
        connection.write_all(b"one ").await.unwrap();
        let woken = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let waker = {
            struct Flag(Arc<std::sync::atomic::AtomicBool>);
            impl std::task::Wake for Flag {
                fn wake(self: Arc<Self>) {
                    self.0.store(true, std::sync::atomic::Ordering::SeqCst);
                }
            }
            std::task::Waker::from(Arc::new(Flag(Arc::clone(&woken))))
        };
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut connection).poll_flush(&mut cx).is_pending(), "the first flush yields");
        assert!(woken.load(std::sync::atomic::Ordering::SeqCst), "and wakes its task to come back");
        let mut byte = [0u8; 1];
        let nothing = peer.try_read(&mut byte);
        assert!(matches!(&nothing, Err(e) if e.kind() == io::ErrorKind::WouldBlock), "written: {nothing:?}");
        let parts = [io::IoSlice::new(b"tw"), io::IoSlice::new(b"o")];
        let taken = std::future::poll_fn(|cx| Pin::new(&mut connection).poll_write_vectored(cx, &parts));
        assert_eq!(taken.await.unwrap(), 3, "a vectored write is taken whole");
        connection.flush().await.unwrap();
        let mut got = [0u8; 7];
        peer.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"one two");
    }

    /// Writes past the gathering's limit go out after what was gathered before them, and
    /// a shutdown writes what is still gathered: every byte arrives, in order.
    #[tokio::test]
    async fn large_writes_and_shutdown_keep_every_byte_in_order() {
        let (mut connection, mut peer) = pair().await;
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            peer.read_to_end(&mut got).await.unwrap();
            got
        });
        let large: Vec<u8> = (0..3 * GATHERED_BYTES_MAX).map(|n| (n % 251) as u8).collect();
        let mut sent = Vec::new();
        for part in [&b"small"[..], &large, b"tail", &large[..GATHERED_BYTES_MAX - 1], b"end"] {
            connection.write_all(part).await.unwrap();
            sent.extend_from_slice(part);
        }
        connection.shutdown().await.unwrap();
        drop(connection);
        assert_eq!(reader.await.unwrap(), sent);
    }

    /// A connection dropped with bytes gathered and never flushed (a failed TLS
    /// handshake's alert) still sends them when the socket takes them.
    #[tokio::test]
    async fn a_dropped_connection_sends_what_it_gathered() {
        let (mut connection, mut peer) = pair().await;
        connection.write_all(b"alert").await.unwrap();
        drop(connection);
        let mut got = Vec::new();
        peer.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"alert");
    }
}
