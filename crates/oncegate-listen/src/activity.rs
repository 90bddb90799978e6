//! What a connection may hold of a listener's connection slots: a deadline for its first
//! request head and an idle timeout, read from the connection's [`Activity`] (the
//! requests the service has open on it). The gRPC port's connection and the plain HTTP
//! listener ([`crate::serve`]) check their [`Deadlines`] on every read: the protocol
//! always has a read pending, so the timer is registered there, and a read past a
//! deadline fails, which makes the protocol close the connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use http_body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// What the protocol does on one connection: whether a request head arrived, how many
/// requests are open (a response whose body has not ended), and since when none is.
#[derive(Debug)]
pub struct Activity {
    started: AtomicBool,
    open: AtomicUsize,
    /// When `open` last fell to 0 (or the connection was accepted), in ms after `origin`.
    idle_since_ms: AtomicU64,
    origin: Instant,
}

/// One open request on a connection; dropping it (its response ended) may start the
/// connection's idle time.
pub struct Open(Arc<Activity>);

impl Activity {
    fn new() -> Arc<Activity> {
        Arc::new(Activity {
            started: AtomicBool::new(false),
            open: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
            origin: Instant::now(),
        })
    }

    /// A request's head arrived: it is open until the returned guard drops.
    pub fn open(self: &Arc<Self>) -> Open {
        self.started.store(true, Ordering::Release);
        self.open.fetch_add(1, Ordering::AcqRel);
        Open(Arc::clone(self))
    }

    fn idle_since(&self) -> Instant {
        self.origin + Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire))
    }
}

impl Drop for Open {
    /// The time is set before the count falls, so a deadline that finds no request open
    /// never reads an idle time older than the last request's end.
    fn drop(&mut self) {
        let activity = &self.0;
        let now = activity.origin.elapsed().as_millis() as u64;
        activity.idle_since_ms.fetch_max(now, Ordering::AcqRel);
        activity.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A limit in time and the setting that names it.
#[derive(Clone, Copy, Debug)]
pub struct Timeout {
    /// How long.
    pub within: Duration,
    /// The setting that says so (`server.idle_timeout_ms`).
    pub setting: &'static str,
}

impl Timeout {
    /// `setting`'s `ms`; none when `ms` is 0 (which the settings use for "off").
    pub fn ms(ms: u64, setting: &'static str) -> Option<Timeout> {
        (ms > 0).then(|| Timeout { within: Duration::from_millis(ms), setting })
    }
}

/// A connection's deadlines.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// From accept to the first complete request head (a TLS handshake and HTTP/2's
    /// preface included).
    pub request_head: Timeout,
    /// Without an open request; `None` keeps idle connections.
    pub idle: Option<Timeout>,
}

/// Why a connection was closed at a deadline (the read that found it fails with it).
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs, reason = "the messages say what each is")]
pub enum Passed {
    #[error("no complete request head within {ms} ms ({setting})")]
    RequestHead { ms: u128, setting: &'static str },
    #[error("no request for {ms} ms ({setting})")]
    Idle { ms: u128, setting: &'static str },
}

/// A connection's next deadline, and what it reads to move it.
pub struct Deadlines {
    activity: Arc<Activity>,
    limits: Limits,
    /// None once only an idle timeout of none is left.
    timer: Option<Pin<Box<Sleep>>>,
}

impl Deadlines {
    /// Deadlines from now (the connection was just accepted).
    pub fn new(limits: Limits) -> Deadlines {
        let timer = Some(Box::pin(tokio::time::sleep(limits.request_head.within)));
        Deadlines { activity: Activity::new(), limits, timer }
    }

    /// What the service tells the deadlines: the requests it has open.
    pub fn activity(&self) -> &Arc<Activity> {
        &self.activity
    }

    /// Ready with the error that closes the connection once a deadline has passed;
    /// pending otherwise (the timer then registered with `cx`). Closes are counted in
    /// `oncegate_connections_closed_total{limit}`.
    pub fn poll_passed(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        while self.timer.as_mut().is_some_and(|timer| timer.as_mut().poll(cx).is_ready()) {
            if let Some(passed) = self.rearm() {
                let limit = match passed {
                    Passed::RequestHead { setting, .. } | Passed::Idle { setting, .. } => setting,
                };
                metrics::counter!("oncegate_connections_closed_total", "limit" => limit).increment(1);
                return Poll::Ready(io::Error::new(io::ErrorKind::TimedOut, passed));
            }
        }
        Poll::Pending
    }

    /// At the timer: the limit that closes the connection, or none, the timer moved to
    /// the next time it could (or gone, without an idle timeout). No request head yet:
    /// the first request's deadline passed. Otherwise the connection is closed once it
    /// has carried no request for the idle timeout; while a request is open, it is looked
    /// at again an idle timeout later.
    fn rearm(&mut self) -> Option<Passed> {
        let activity = &self.activity;
        if !activity.started.load(Ordering::Acquire) {
            let Timeout { within, setting } = self.limits.request_head;
            return Some(Passed::RequestHead { ms: within.as_millis(), setting });
        }
        let Some(Timeout { within: idle, setting }) = self.limits.idle else {
            self.timer = None;
            return None;
        };
        let now = Instant::now();
        let next = if activity.open.load(Ordering::Acquire) > 0 {
            now + idle
        } else {
            let until = activity.idle_since() + idle;
            if until <= now {
                return Some(Passed::Idle { ms: idle.as_millis(), setting });
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
pub struct CountedBody<B> {
    body: B,
    _open: Open,
}

impl<B> CountedBody<B> {
    /// `body`, its request `open` until it is dropped.
    pub fn new(body: B, open: Open) -> CountedBody<B> {
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

/// A connection whose reads fail once one of its [`Deadlines`] passed.
pub struct Timed<S> {
    stream: S,
    deadlines: Deadlines,
}

impl<S> Timed<S> {
    /// `stream`, just accepted, under `limits`.
    pub fn new(stream: S, limits: Limits) -> Timed<S> {
        Timed { stream, deadlines: Deadlines::new(limits) }
    }

    /// What the service tells the deadlines.
    pub fn activity(&self) -> &Arc<Activity> {
        self.deadlines.activity()
    }

    /// The stream itself.
    pub fn get_ref(&self) -> &S {
        &self.stream
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Timed<S> {
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

impl<S: AsyncWrite + Unpin> AsyncWrite for Timed<S> {
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
