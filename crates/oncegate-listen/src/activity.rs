//! What a connection may hold of a listener's connection slots: a deadline for its first
//! request head, an idle timeout and a send timeout, read from the connection's
//! [`Activity`] (the requests the service has open on it, and whether their answers wait
//! for the peer). The gRPC port's connection and the plain HTTP listener
//! ([`crate::serve`]) check their [`Deadlines`] on every read and write: the protocol
//! always has a read pending or a write it waits to make, so the timer is registered
//! there, and an operation past a deadline fails, which makes the protocol close the
//! connection.

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
/// requests are open (a response whose body has not ended), since when none is, and
/// whether the peer takes the answers' data.
#[derive(Debug)]
pub struct Activity {
    started: AtomicBool,
    open: AtomicUsize,
    /// When `open` last fell to 0 (or the connection was accepted), in ms after `origin`.
    idle_since_ms: AtomicU64,
    /// What waits on the peer to take data: answers' bodies the protocol has not asked
    /// for a frame (a first one, or the next after one they handed it), and a write the
    /// socket did not take. The protocol asks a body once it has sent what it had
    /// (HTTP/1.1, into the socket) or once the stream has any room (HTTP/2's window), so
    /// nothing here waits on its own data (a body with nothing to send was asked, and
    /// answered pending). Over HTTP/2 the part of a frame past the window waits in the
    /// protocol's buffer, where it is not counted.
    waits: AtomicUsize,
    /// When the first of the current waits began, or the peer last took data (a body
    /// asked for a frame, a write taken), in ms after `origin`.
    moved_ms: AtomicU64,
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
            waits: AtomicUsize::new(0),
            moved_ms: AtomicU64::new(0),
            origin: Instant::now(),
        })
    }

    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    /// Something began to wait on the peer. The first wait, when nothing waited, starts
    /// the clock; another does not move it, or a peer that reads nothing could keep its
    /// connection by sending requests. The time is set before the count rises, so a
    /// deadline that finds a wait never reads a time older than its start.
    fn wait_begins(&self) {
        let mut waits = self.waits.load(Ordering::Acquire);
        loop {
            if waits == 0 {
                self.moved_ms.fetch_max(self.now_ms(), Ordering::AcqRel);
            }
            match self.waits.compare_exchange(waits, waits + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(now) => waits = now,
            }
        }
    }

    /// The peer took data: a waiting body was asked for a frame, a write was taken.
    fn peer_took(&self) {
        self.moved_ms.fetch_max(self.now_ms(), Ordering::AcqRel);
    }

    /// A wait on the peer ended, the peer having taken data (`took`), or its body or
    /// socket having been dropped, which is no sign of the peer reading (a peer that
    /// resets its streams must not keep its connection so).
    fn wait_ends(&self, took: bool) {
        if took {
            self.peer_took();
        }
        self.waits.fetch_sub(1, Ordering::AcqRel);
    }

    /// Since when the peer has taken nothing while something waits on it; `None` when
    /// nothing waits.
    fn waiting_since(&self) -> Option<Instant> {
        (self.waits.load(Ordering::Acquire) > 0)
            .then(|| self.origin + Duration::from_millis(self.moved_ms.load(Ordering::Acquire)))
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
        let now = activity.now_ms();
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
    /// While an answer waits for the peer to take its data (a peer that stopped
    /// reading); `None` waits for ever. Counted per connection: a frame asked for or a
    /// write taken restarts it.
    pub send: Option<Timeout>,
}

/// Why a connection was closed at a deadline (the read that found it fails with it).
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs, reason = "the messages say what each is")]
pub(crate) enum Passed {
    #[error("no complete request head within {ms} ms ({setting})")]
    RequestHead { ms: u128, setting: &'static str },
    #[error("no request for {ms} ms ({setting})")]
    Idle { ms: u128, setting: &'static str },
    #[error("the peer read none of an answer's waiting data for {ms} ms ({setting})")]
    Send { ms: u128, setting: &'static str },
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
                    Passed::RequestHead { setting, .. }
                    | Passed::Idle { setting, .. }
                    | Passed::Send { setting, .. } => setting,
                };
                metrics::counter!("oncegate_connections_closed_total", "limit" => limit).increment(1);
                return Poll::Ready(io::Error::new(io::ErrorKind::TimedOut, passed));
            }
        }
        Poll::Pending
    }

    /// At the timer: the limit that closes the connection, or none, the timer moved to
    /// the next time it could (or gone, with neither an idle nor a send timeout). No
    /// request head yet: the first request's deadline passed. An answer waiting on a peer
    /// that has taken nothing for the send timeout closes it, and so does carrying no
    /// request for the idle timeout; while a request is open, it is looked at again an
    /// idle or a send timeout later, whichever is sooner.
    fn rearm(&mut self) -> Option<Passed> {
        let activity = &self.activity;
        if !activity.started.load(Ordering::Acquire) {
            let Timeout { within, setting } = self.limits.request_head;
            return Some(Passed::RequestHead { ms: within.as_millis(), setting });
        }
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        if let Some(Timeout { within: send, setting }) = self.limits.send {
            let until = activity.waiting_since().map_or(now + send, |since| since + send);
            if until <= now {
                return Some(Passed::Send { ms: send.as_millis(), setting });
            }
            next = Some(until);
        }
        if let Some(Timeout { within: idle, setting }) = self.limits.idle {
            let until = if activity.open.load(Ordering::Acquire) > 0 {
                now + idle
            } else {
                let until = activity.idle_since() + idle;
                if until <= now {
                    return Some(Passed::Idle { ms: idle.as_millis(), setting });
                }
                until
            };
            next = Some(next.map_or(until, |sooner| sooner.min(until)));
        }
        match (next, self.timer.as_mut()) {
            (Some(next), Some(timer)) => timer.as_mut().reset(next),
            (None, _) => self.timer = None,
            (Some(_), None) => {}
        }
        None
    }
}

/// A response's body, holding its request open on its connection until it is dropped
/// (it ended, or the stream was reset), and telling the connection's send timeout while
/// it waits on the peer: from its making until its first frame is asked for, and from
/// each frame it hands out until the next is asked for.
pub struct CountedBody<B> {
    body: B,
    open: Open,
    /// Waiting for the protocol to ask for a frame.
    waits: bool,
}

impl<B> CountedBody<B> {
    /// `body`, its request `open` until it is dropped.
    pub fn new(body: B, open: Open) -> CountedBody<B> {
        open.0.wait_begins();
        CountedBody { body, open, waits: true }
    }
}

impl<B> Drop for CountedBody<B> {
    fn drop(&mut self) {
        if self.waits {
            self.open.0.wait_ends(false);
        }
    }
}

impl<B: http_body::Body<Data = Bytes> + Unpin> http_body::Body for CountedBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        if std::mem::take(&mut self.waits) {
            self.open.0.wait_ends(true);
        }
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &polled {
            self.waits = true;
            self.open.0.wait_begins();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A connection whose reads and writes fail once one of its [`Deadlines`] passed, and
/// whose writes the socket did not take wait on the peer.
pub struct Timed<S> {
    stream: S,
    deadlines: Deadlines,
    /// A write the socket did not take (the peer's window is full) waits on the peer.
    blocked: bool,
}

impl<S> Timed<S> {
    /// `stream`, just accepted, under `limits`.
    pub fn new(stream: S, limits: Limits) -> Timed<S> {
        Timed { stream, deadlines: Deadlines::new(limits), blocked: false }
    }

    /// Notes whether a write was taken: one left pending waits on the peer until one is,
    /// and one taken while something waits is the peer reading (the answers of unary
    /// calls, whose bodies are not counted, among them).
    fn wrote(&mut self, polled: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        let activity = &self.deadlines.activity;
        match (&polled, self.blocked) {
            (Poll::Pending, false) => {
                self.blocked = true;
                activity.wait_begins();
            }
            (Poll::Ready(_), true) => {
                self.blocked = false;
                activity.wait_ends(true);
            }
            (Poll::Ready(Ok(written)), false)
                if *written > 0 && activity.waits.load(Ordering::Acquire) > 0 =>
            {
                activity.peer_took();
            }
            _ => {}
        }
        polled
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

impl<S> Drop for Timed<S> {
    fn drop(&mut self) {
        if self.blocked {
            self.deadlines.activity.wait_ends(false);
        }
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

/// Writes check the deadlines too: a peer that stopped reading leaves the protocol
/// waiting to write, with no read of its own to make.
impl<S: AsyncWrite + Unpin> AsyncWrite for Timed<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if let Poll::Ready(passed) = self.deadlines.poll_passed(cx) {
            return Poll::Ready(Err(passed));
        }
        let polled = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.wrote(polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if let Poll::Ready(passed) = self.deadlines.poll_passed(cx) {
            return Poll::Ready(Err(passed));
        }
        let polled = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.wrote(polled)
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

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    fn limits(send: Duration) -> Limits {
        Limits {
            request_head: Timeout { within: send, setting: "test.request_head_ms" },
            idle: None,
            send: Some(Timeout { within: send, setting: "test.send_timeout_ms" }),
        }
    }

    /// A peer that reads nothing and sends a request more often than the send timeout is
    /// still closed at it: a new request's body starts no new wait's clock. (Each did, so
    /// such a peer kept its connection for ever.) Tokio's clock is paused: it moves only
    /// when every task waits.
    #[tokio::test(start_paused = true)]
    async fn new_requests_do_not_keep_a_peer_that_reads_nothing() {
        let (ours, _peer) = tokio::io::duplex(64);
        let second = Duration::from_secs(1);
        let mut timed = Timed::new(ours, limits(second));
        let activity = Arc::clone(timed.activity());
        let _unasked = CountedBody::new((), activity.open());
        let requests = tokio::spawn(async move {
            let mut bodies = Vec::new();
            loop {
                tokio::time::sleep(second / 4).await;
                bodies.push(CountedBody::new((), activity.open()));
            }
        });
        let read = tokio::time::timeout(Duration::from_secs(3_600), timed.read(&mut [0; 8])).await;
        let error = read.expect("the connection was closed within the hour").unwrap_err();
        assert!(error.to_string().contains("test.send_timeout_ms"), "{error}");
        requests.abort();
    }

    /// A write the peer does not take fails once it has waited the send timeout, naming
    /// the setting, with no answer's body waiting. (Only bodies waited: an answer handed
    /// whole to the protocol, or its last frame, held the connection until the idle
    /// timeout, and for ever without one.) Tokio's clock is paused: it moves only when
    /// every task waits.
    #[tokio::test(start_paused = true)]
    async fn a_write_the_peer_does_not_take_fails_at_the_send_timeout() {
        let (ours, _peer) = tokio::io::duplex(64);
        let mut timed = Timed::new(ours, limits(Duration::from_secs(1)));
        let _open = timed.activity().open();
        let written = tokio::time::timeout(Duration::from_secs(3_600), timed.write_all(&[0; 1024])).await;
        let error = written.expect("the write failed within the hour").unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(error.to_string().contains("test.send_timeout_ms"), "{error}");
    }
}
