//! The plain HTTP listener of the metrics port and the Idempotency-Key proxy: hyper-util's
//! server with its timer, so that every wait on a client is timed. At most
//! `connections_max` connections are open (one more is closed as soon as it is accepted);
//! each must send its first request head within its deadline (and, over HTTP/1.1, every
//! later head within the same time once it starts), and is closed once it has carried no
//! request for its idle timeout ([`crate::activity`]). On shutdown the listener stops
//! accepting, and the connections get `grace` to finish their requests.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower::ServiceExt;

use crate::activity::{CountedBody, Limits, Timed};

/// A plain HTTP listener's limits.
#[derive(Clone, Copy, Debug)]
pub struct HttpLimits {
    /// Connections open at once, and the setting that names it.
    pub connections_max: (usize, &'static str),
    /// Each connection's deadlines; the request head's is also HTTP/1.1's header read
    /// timeout for every later request.
    pub deadlines: Limits,
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
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.deadlines.request_head.within);
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) if crate::per_connection(&error) => continue,
                Err(error) => {
                    tracing::warn!(%error, "accepting a connection failed; retrying");
                    tokio::time::sleep(crate::ACCEPT_RETRY).await;
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
        let timed = Timed::new(stream, limits.deadlines);
        let activity = Arc::clone(timed.activity());
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
        let connection = builder.serve_connection(TokioIo::new(timed), service).into_owned();
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
