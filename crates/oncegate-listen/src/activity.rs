//! What a connection may hold of a listener's connection slots: a deadline for its first
//! request head and an idle timeout, read from the connection's [`Activity`] (the
//! requests the service has open on it). The gRPC port's `Connection` and the plain HTTP
//! listeners (`serve_http`) check their [`Deadlines`] on every read: the protocol always
//! has a read pending, so the timer is registered there, and a read past a deadline
//! fails, which makes the protocol close the connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use http_body::{Frame, SizeHint};
use tokio::time::{Instant, Sleep};

/// What the protocol does on one connection: whether a request head arrived, how many
/// requests are open (a response whose body has not ended), and since when none is.
#[derive(Debug)]
pub(crate) struct Activity {
    started: AtomicBool,
    open: AtomicUsize,
    /// When `open` last fell to 0 (or the connection was accepted), in ms after `origin`.
    idle_since_ms: AtomicU64,
    origin: Instant,
}

/// One open request on a connection; dropping it (its response ended) may start the
/// connection's idle time.
pub(crate) struct Open(Arc<Activity>);

impl Activity {
    pub(crate) fn new() -> Arc<Activity> {
        Arc::new(Activity {
            started: AtomicBool::new(false),
            open: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
            origin: Instant::now(),
        })
    }

    /// A request's head arrived: it is open until the returned guard drops.
    pub(crate) fn open(self: &Arc<Self>) -> Open {
        self.started.store(true, Ordering::Release);
        self.open.fetch_add(1, Ordering::AcqRel);
        Open(Arc::clone(self))
    }

    fn idle_since(&self) -> Instant {
        self.origin + Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire))
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        let activity = &self.0;
        if activity.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            let since = activity.origin.elapsed().as_millis() as u64;
            activity.idle_since_ms.store(since, Ordering::Release);
        }
    }
}

/// A connection's limits, each with the setting that names it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// From accept to the first request head.
    pub first_request: (Duration, &'static str),
    /// Without an open request; `None` keeps idle connections.
    pub idle: Option<(Duration, &'static str)>,
}

/// A connection's next deadline, and what it reads to move it.
pub(crate) struct Deadlines {
    activity: Arc<Activity>,
    limits: Limits,
    /// None once only an idle timeout of none is left.
    timer: Option<Pin<Box<Sleep>>>,
}

impl Deadlines {
    pub(crate) fn new(limits: Limits) -> Deadlines {
        let timer = Some(Box::pin(tokio::time::sleep(limits.first_request.0)));
        Deadlines { activity: Activity::new(), limits, timer }
    }

    pub(crate) fn activity(&self) -> &Arc<Activity> {
        &self.activity
    }

    /// Ready with the error that closes the connection once a deadline has passed;
    /// pending otherwise (the timer then registered with `cx`). Closes are counted in
    /// `oncegate_connections_closed_total{limit}`.
    pub(crate) fn poll_passed(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        while self.timer.as_mut().is_some_and(|timer| timer.as_mut().poll(cx).is_ready()) {
            if let Some(limit) = self.rearm() {
                metrics::counter!("oncegate_connections_closed_total", "limit" => limit).increment(1);
                return Poll::Ready(io::Error::new(io::ErrorKind::TimedOut, format!("{limit} passed")));
            }
        }
        Poll::Pending
    }

    /// At the timer: the limit that closes the connection, or none, the timer moved to
    /// the next time it could (or gone, without an idle timeout). No request head yet:
    /// the first request's deadline passed. Otherwise the connection is closed once it
    /// has carried no request for the idle timeout; while a request is open, it is looked
    /// at again an idle timeout later.
    fn rearm(&mut self) -> Option<&'static str> {
        let activity = &self.activity;
        if !activity.started.load(Ordering::Acquire) {
            return Some(self.limits.first_request.1);
        }
        let Some((idle, limit)) = self.limits.idle else {
            self.timer = None;
            return None;
        };
        let now = Instant::now();
        let next = if activity.open.load(Ordering::Acquire) > 0 {
            now + idle
        } else {
            let until = activity.idle_since() + idle;
            if until <= now {
                return Some(limit);
            }
            until
        };
        if let Some(timer) = self.timer.as_mut() {
            timer.as_mut().reset(next);
        }
        None
    }
}

/// A response's body, holding its request open on its connection until it is dropped
/// (it ended, or the stream was reset).
pub(crate) struct CountedBody<B> {
    body: B,
    _open: Open,
}

impl<B> CountedBody<B> {
    pub(crate) fn new(body: B, open: Open) -> CountedBody<B> {
        CountedBody { body, _open: open }
    }
}

impl<B: http_body::Body<Data = Bytes> + Unpin> http_body::Body for CountedBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
