//! The gRPC port's accept loop: Nagle off, at most `server.connections_max` open
//! connections, and accept errors that never stop the server.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// After an accept error that is not about one connection (out of file descriptors,
/// out of memory), the loop pauses this long instead of spinning on the same error.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// An accepted connection, holding one of the server's connection slots until it closes.
pub(crate) struct Connection {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
}

/// The accepted connections. tonic stops serving on the first error its incoming stream
/// yields (other than a few per-connection kinds), so running out of file descriptors
/// would end the server; this loop logs such errors, pauses and goes on, and yields none.
pub(crate) fn incoming(
    listener: TcpListener,
    connections_max: usize,
) -> ReceiverStream<io::Result<Connection>> {
    let (accepted, incoming) = mpsc::channel(16);
    tokio::spawn(accept_loop(listener, Arc::new(Semaphore::new(connections_max)), connections_max, accepted));
    ReceiverStream::new(incoming)
}

async fn accept_loop(
    listener: TcpListener,
    slots: Arc<Semaphore>,
    connections_max: usize,
    accepted: mpsc::Sender<io::Result<Connection>>,
) {
    loop {
        let next = tokio::select! {
            next = listener.accept() => next,
            // The server stopped: stop accepting and close the listener.
            () = accepted.closed() => return,
        };
        let stream = match next {
            Ok((stream, _)) => stream,
            Err(error) if per_connection(&error) => continue,
            Err(error) => {
                tracing::warn!(%error, "accepting a connection failed; retrying");
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            // Closing at once tells the client to go elsewhere; leaving it in the
            // backlog would let it wait for a handshake that never comes.
            metrics::counter!("oncegate_connections_refused_total").increment(1);
            tracing::debug!(connections_max, "connection refused: server.connections_max reached");
            continue;
        };
        // Without this, small replies wait for the peer's delayed ACK (about 40 ms).
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "setting TCP_NODELAY failed");
        }
        if accepted.send(Ok(Connection { stream, _slot: slot })).await.is_err() {
            return;
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
