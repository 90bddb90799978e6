//! The plain HTTP listeners (the metrics listener, the Idempotency-Key proxy): hyper-util's
//! server with its timer, so that every wait on a client is timed. At most
//! `connections_max` connections are open (one more is closed as soon as it is accepted);
//! each must send its first request head within its deadline (and, over HTTP/1.1, every
//! later head within the same time), and is closed once it has carried no request for
//! its idle timeout (`activity.rs`). On shutdown the listener stops accepting, and the
//! connections get `grace` to finish their requests.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tower::ServiceExt;

use crate::activity::{CountedBody, Deadlines, Limits};

/// After an accept error that is not about one connection (out of file descriptors),
/// the loop pauses this long instead of spinning on the same error.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// A plain HTTP listener's limits, each with the setting that names it.
#[derive(Clone, Copy, Debug)]
pub struct HttpLimits {
    /// Connections open at once.
    pub connections_max: (usize, &'static str),
    /// From accept to the first request head; over HTTP/1.1, also each later head once
    /// its first byte arrives.
    pub request_head: (Duration, &'static str),
    /// Without an open request; `None` keeps idle connections.
    pub idle: Option<(Duration, &'static str)>,
    /// After shutdown, how long open requests may still run.
    pub grace: Duration,
}

/// Serves `router` on `listener` within `limits` until `shutdown`, then for the grace.
pub async fn serve_router(
    listener: TcpListener,
    router: axum::Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.connections_max.0));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.request_head.0);
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) if crate::listen::per_connection(&error) => continue,
                Err(error) => {
                    tracing::warn!(%error, "accepting a connection failed; retrying");
                    tokio::time::sleep(ACCEPT_RETRY).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            let limit = limits.connections_max.1;
            metrics::counter!("oncegate_connections_refused_total", "limit" => limit).increment(1);
            continue;
        };
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "setting TCP_NODELAY failed");
        }
        let timed = Timed {
            stream,
            deadlines: Deadlines::new(Limits { first_request: limits.request_head, idle: limits.idle }),
        };
        let activity = Arc::clone(timed.deadlines.activity());
        let router = router.clone();
        let service = hyper::service::service_fn(move |request: axum::http::Request<Incoming>| {
            let open = activity.open();
            let answered = router.clone().oneshot(request);
            async move {
                let Ok(response) = answered.await;
                Ok::<_, std::convert::Infallible>(
                    response.map(|body| axum::body::Body::new(CountedBody::new(body, open))),
                )
            }
        });
        let connection = builder.serve_connection_with_upgrades(TokioIo::new(timed), service).into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            let _ = connection.await;
            drop(slot);
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(limits.grace, graceful.shutdown()).await;
    Ok(())
}

/// A connection whose reads fail once one of its deadlines passed.
struct Timed {
    stream: TcpStream,
    deadlines: Deadlines,
}

impl AsyncRead for Timed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Poll::Ready(passed) = self.deadlines.poll_passed(cx) {
            return Poll::Ready(Err(passed));
        }
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Timed {
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
