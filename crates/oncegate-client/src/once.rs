//! `once`: the protocol every user of a gate needs, written once.
//!
//! Reserve the key. On a grant, run the work while a heartbeat keeps the lease (every
//! third of it, concurrently with the work); commit the work's response as succeeded, or,
//! when the work fails for good ([`WorkError::Final`]), its failure as failed; release the
//! key when the work fails in a way worth retrying, so that the next attempt may run. A completed key replays what the
//! first attempt stored. A lease that cannot be kept (lost to another attempt, or not
//! renewed before it ran out by the client's own, conservative, clock) cancels the work
//! with `lease_lost`: the attempt is fenced off, and its side effects must be checked.
//!
//! A work that panics, or whose future is dropped (a timeout, a disconnected caller),
//! gives the key back as [`OnceOptions::on_cancel`] says: kept until its lease ends (the
//! default), so that the next attempt is told the previous one was abandoned
//! ([`Lease::previous`]) and can check for a side effect the cancelled one may have made;
//! or released at once, so the next attempt may proceed now and is not told. A future is
//! dropped at an await, which may be just after its side effect (a payment sent, its
//! answer not yet read), so releasing is right only for a work whose every await comes
//! before its side effect, or whose side effect is idempotent downstream with the
//! fencing token.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use oncegate_core::gate::{CommitRequest, Gate, GateError, KeyRequest, Renewed, ReserveRequest};
use oncegate_core::{Code, Fingerprint, Outcome, Previous, ReserveReply};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::retry::RetryPolicy;

/// What a cancelled or panicking work does with its key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnCancel {
    /// Release it at once: the next attempt may proceed now (and is not told).
    Release,
    /// Keep it until its lease ends: the next attempt is granted as `abandoned`. The
    /// default: a cancelled work may have made its side effect.
    #[default]
    KeepUntilLeaseEnds,
}

/// The key `once` runs under: the caller's own, or one the server derives from parts
/// and a time bucket ([`crate::keys::TradeKey`] makes one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OnceKey {
    /// An idempotency key the request carries.
    Key(String),
    /// `parts.join(":")` and the server's time bucket of width `bucket`; within `grace`
    /// after a boundary, a retry is answered from the bucket before.
    Derived {
        /// The parts, none empty, none holding `:`.
        parts: Vec<String>,
        /// The bucket's width.
        bucket: Duration,
        /// How long after a boundary the previous bucket still answers; zero for never.
        grace: Duration,
    },
}

impl From<&str> for OnceKey {
    fn from(key: &str) -> OnceKey {
        OnceKey::Key(key.to_owned())
    }
}

impl From<String> for OnceKey {
    fn from(key: String) -> OnceKey {
        OnceKey::Key(key)
    }
}

impl From<&String> for OnceKey {
    fn from(key: &String) -> OnceKey {
        OnceKey::Key(key.clone())
    }
}

/// How `once` reserves, waits, and commits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OnceOptions {
    /// How long the record is remembered; `None` takes the server's `ttl_ms_default`.
    pub ttl: Option<Duration>,
    /// The lease the work runs under, renewed by heartbeats every third of it; `None`
    /// takes the server's `lease_ms_default` (the grant says how long it is).
    pub lease: Option<Duration>,
    /// How long to wait while another attempt holds the key (the server waits, then
    /// this client polls as the server advises). An attempt still running at the end is
    /// [`OnceError::InProgress`]. Zero answers at once. Default 30 s.
    pub wait: Duration,
    /// The request's fingerprint ([`OnceOptions::fingerprint_json`]), or empty: without
    /// one, a different payload under the same key is not noticed.
    pub fingerprint: Vec<u8>,
    /// What a cancelled or panicking work does with its key.
    pub on_cancel: OnCancel,
    /// How long a commit is retried while the gate is unavailable or busy (a server restarting,
    /// a failover), with the same token: a commit repeated after its answer was lost is
    /// acknowledged again. Default 10 s.
    pub commit_retry_for: Duration,
}

impl Default for OnceOptions {
    fn default() -> Self {
        OnceOptions {
            ttl: None,
            lease: None,
            wait: Duration::from_secs(30),
            fingerprint: Vec::new(),
            on_cancel: OnCancel::default(),
            commit_retry_for: Duration::from_secs(10),
        }
    }
}

impl OnceOptions {
    /// These options with the canonical fingerprint of `payload` as JSON
    /// ([`Fingerprint::of_json`]: key order, whitespace and `1.0` against `1` do not
    /// change it). Fails only when `payload` cannot be JSON.
    pub fn fingerprint_json<T: serde::Serialize + ?Sized>(
        mut self,
        payload: &T,
    ) -> Result<OnceOptions, serde_json::Error> {
        self.fingerprint = Fingerprint::of_json(payload)?.into();
        Ok(self)
    }
}

/// The lease a work runs under.
#[derive(Clone, Debug)]
pub struct Lease {
    /// The key (the derived one, when the request had parts).
    pub key: String,
    /// The fencing token: pass it to whatever the work writes, so that a stale attempt's
    /// writes can be refused downstream.
    pub token: u64,
    /// 1 for a first attempt, one more after each abandoned one.
    pub attempt: u32,
    /// Whether an attempt before this one was abandoned (its side effects may be
    /// partial: check them).
    pub previous: Previous,
    /// Cancelled when this attempt no longer holds the key: the lease was lost (another
    /// attempt took it, or it was not renewed in time) or the caller dropped `once`. Work
    /// that left the future (`spawn_blocking`, a blocking SDK) should stop when it sees
    /// this.
    pub lost: CancellationToken,
    valid_until: watch::Receiver<Instant>,
}

impl Lease {
    /// Until when the lease holds by this client's (conservative) clock, as of the last
    /// renewal: work must be done, or stop, by then.
    pub fn valid_until(&self) -> Instant {
        *self.valid_until.borrow()
    }
}

/// What happened to the key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ran {
    /// The work ran now and its response was committed.
    Now(Vec<u8>),
    /// An earlier attempt completed the key; the work did not run. Its outcome is part
    /// of the type: a stored failure must not pass for a success.
    Replayed(Replay),
}

/// A completed key's stored end, by its outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Replay {
    /// The first attempt succeeded.
    Succeeded(Stored),
    /// The first attempt failed for good ([`WorkError::Final`]).
    Failed(Stored),
}

impl Ran {
    /// The response: the one just committed, or the one replayed (a stored failure's
    /// too: check [`Ran::is_failure`] before treating it as a success).
    pub fn response(&self) -> &[u8] {
        match self {
            Ran::Now(response) => response,
            Ran::Replayed(replay) => &replay.stored().response,
        }
    }

    /// Whether an earlier attempt answered (the work did not run now).
    pub fn is_replayed(&self) -> bool {
        matches!(self, Ran::Replayed(_))
    }

    /// Whether the answer is a stored failure ([`Replay::Failed`]).
    pub fn is_failure(&self) -> bool {
        matches!(self, Ran::Replayed(Replay::Failed(_)))
    }
}

impl Replay {
    /// What was stored, whatever the outcome.
    pub fn stored(&self) -> &Stored {
        match self {
            Replay::Succeeded(stored) | Replay::Failed(stored) => stored,
        }
    }
}

/// What a completed key holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The key that answered: under bucket grace, the previous bucket's.
    pub key: String,
    /// The token of the attempt that committed.
    pub token: u64,
    /// The response it stored.
    pub response: Vec<u8>,
    /// When it committed (the server's clock, ms since the Unix epoch).
    pub completed_at_ms: u64,
}

/// How a work failed.
#[derive(Debug)]
pub enum WorkError<E> {
    /// Worth another attempt: the key is released.
    Retryable(E),
    /// Final: committed as failed with `response`, which later attempts replay.
    Final {
        /// The error.
        error: E,
        /// What to store for later attempts.
        response: Vec<u8>,
    },
    /// The side effect may or may not have happened (a call that timed out after it was
    /// sent): neither committed nor released. The key stays held until its lease ends,
    /// and the next attempt is granted as `abandoned`, so that it checks before it acts.
    Unknown(E),
}

impl<E> WorkError<E> {
    /// Worth another attempt: the key is released.
    pub fn retryable(error: E) -> WorkError<E> {
        WorkError::Retryable(error)
    }

    /// Final, with nothing to replay but the failure itself (an empty response).
    pub fn final_(error: E) -> WorkError<E> {
        WorkError::Final { error, response: Vec::new() }
    }

    /// The side effect may have happened: the key is left to lapse.
    pub fn unknown(error: E) -> WorkError<E> {
        WorkError::Unknown(error)
    }
}

/// Any error, for a work that meets errors of several types and uses `?` on them
/// (`Result<Vec<u8>, WorkError<AnyError>>`). Note that `?` makes a failure
/// [`WorkError::Unknown`] (the key is held until its lease ends); a failure known to
/// come before any side effect says so: `.map_err(|e| WorkError::Retryable(AnyError::new(e)))?`.
#[derive(Debug)]
pub struct AnyError(Box<dyn std::error::Error + Send + Sync>);

impl AnyError {
    /// Boxes `error`.
    pub fn new(error: impl std::error::Error + Send + Sync + 'static) -> AnyError {
        AnyError(Box::new(error))
    }

    /// An error that is only a message.
    pub fn msg(message: impl Into<String>) -> AnyError {
        AnyError(message.into().into())
    }

    /// The boxed error, for `downcast_ref`.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl std::fmt::Display for AnyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for AnyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// `?` in a work makes any error [`WorkError::Unknown`], the safe default: the key is
/// not freed for another run that might repeat a side effect this one made. Say
/// otherwise with `.map_err(WorkError::retryable)?` (or `final_`).
impl<X: std::error::Error + Send + Sync + 'static> From<X> for WorkError<AnyError> {
    fn from(error: X) -> WorkError<AnyError> {
        WorkError::Unknown(AnyError(Box::new(error)))
    }
}

impl<E: std::error::Error + Send + Sync + 'static> WorkError<E> {
    /// This failure with its error boxed, for works that return `WorkError<AnyError>`.
    pub fn boxed(self) -> WorkError<AnyError> {
        let boxed = |error: E| AnyError(Box::new(error));
        match self {
            WorkError::Retryable(error) => WorkError::Retryable(boxed(error)),
            WorkError::Final { error, response } => WorkError::Final { error: boxed(error), response },
            WorkError::Unknown(error) => WorkError::Unknown(boxed(error)),
        }
    }
}

/// Why `once` did not run the work to a committed end.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OnceError<G, E> {
    /// A call to the gate failed (after its retries) before the work ran: nothing ran.
    #[error("gate: {0}")]
    Gate(#[source] G),
    /// Another attempt still held the key when [`OnceOptions::wait`] ran out: nothing
    /// ran here.
    #[error("in_progress: another attempt holds the key; look again in {retry_after_ms} ms")]
    InProgress {
        /// When to look again.
        retry_after_ms: u64,
    },
    /// The work failed in a way worth retrying; the key was released (or, if the release
    /// could not be confirmed, frees when its lease ends).
    #[error("the work failed and the key was released")]
    Retryable(#[source] E),
    /// The work failed for good; the failure was committed with `response`, which a
    /// retry gets as [`Replay::Failed`].
    #[error("the work failed for good (committed as failed)")]
    Failed {
        /// The work's error.
        #[source]
        error: E,
        /// What was stored.
        response: Vec<u8>,
    },
    /// The work could not tell whether its side effect happened; the key is held until
    /// its lease ends (see [`WorkError::Unknown`]).
    #[error("the work's outcome is unknown; the key frees when its lease ends")]
    Unknown(#[source] E),
    /// The work ran, but its commit could not be confirmed within
    /// [`OnceOptions::commit_retry_for`]: the key stays held until its lease ends, and
    /// the next attempt is granted as `abandoned` and must check whether this one's side
    /// effect happened; or the record was gone (`not_found`: its ttl ran out before the
    /// commit, so the key is free already and the next attempt is granted with no
    /// warning; give keys a ttl that outlasts the work and its commit).
    #[error("the work ran (token {token}) but its commit could not be confirmed")]
    Unconfirmed {
        /// The attempt's token.
        token: u64,
        /// What the work returned, which was not stored.
        response: Vec<u8>,
        /// Why.
        #[source]
        error: G,
    },
    /// The lease was lost while the work ran (another attempt took the key, or the lease
    /// ran out unrenewed): the work was cancelled, or its commit was fenced off.
    #[error("lease_lost: the attempt holding token {token} was fenced off")]
    LeaseLost {
        /// The fenced token.
        token: u64,
    },
    /// The key is held with another request's fingerprint.
    #[error("mismatch: the key was used with another payload (it expires at {expires_at_ms})")]
    Mismatch {
        /// When the key becomes free.
        expires_at_ms: u64,
    },
}

impl<G: GateError, E> OnceError<G, E> {
    /// A stable name for this end, for logs and metrics: the gate's code
    /// (`unavailable`, `invalid_argument`, ...) when it refused before the work ran, else
    /// `in_progress`, `mismatch`, `lease_lost`, `unconfirmed`, or the work's own
    /// `work_retryable`, `work_failed`, `work_unknown`.
    pub fn code(&self) -> &'static str {
        match self {
            OnceError::Gate(error) => error.code().as_str(),
            OnceError::InProgress { .. } => "in_progress",
            OnceError::Mismatch { .. } => "mismatch",
            OnceError::LeaseLost { .. } => "lease_lost",
            OnceError::Unconfirmed { .. } => "unconfirmed",
            OnceError::Retryable(_) => "work_retryable",
            OnceError::Failed { .. } => "work_failed",
            OnceError::Unknown(_) => "work_unknown",
        }
    }

    /// Whether calling `once` again may run the work: the key was released, is still
    /// in progress, or the gate could not be reached before anything ran. A failure that
    /// was committed, a mismatch, or an end that leaves the key to lapse (unknown,
    /// unconfirmed, lease lost) is not retryable now: the next attempt either replays
    /// or, after the lease, is told the previous one was abandoned.
    pub fn is_retryable(&self) -> bool {
        match self {
            OnceError::Gate(error) => RetryPolicy::retries(error.code()),
            OnceError::InProgress { .. } | OnceError::Retryable(_) => true,
            OnceError::Failed { .. }
            | OnceError::Unknown(_)
            | OnceError::Unconfirmed { .. }
            | OnceError::LeaseLost { .. }
            | OnceError::Mismatch { .. } => false,
        }
    }
}

/// The lease asked for when the grant does not say (a server older than `lease_ms` in
/// its grants, and options without one): the contract's default.
const LEASE_DEFAULT: Duration = Duration::from_secs(30);

/// The longest the server is asked to wait in one reserve, within its default
/// `wait_ms_max` (30 s); a longer [`OnceOptions::wait`] is several reserves, and a server
/// configured below it (the reserve refused) is polled instead.
const SERVER_WAIT_MAX: Duration = Duration::from_secs(5);

/// `once` on every gate that can be cloned into a background release.
pub trait GateExt: Gate + Clone + 'static {
    /// Runs `work` at most once for `key` in `namespace` (see the module's
    /// documentation): a key of the caller's (`"order-42"`), or one derived from parts
    /// ([`OnceKey::Derived`], [`crate::keys::TradeKey`]).
    fn once<F, Fut, E>(
        &self,
        namespace: &str,
        key: impl Into<OnceKey>,
        options: OnceOptions,
        work: F,
    ) -> impl Future<Output = Result<Ran, OnceError<Self::Error, E>>> + Send
    where
        F: FnOnce(Lease) -> Fut + Send,
        Fut: Future<Output = Result<Vec<u8>, WorkError<E>>> + Send,
        E: std::fmt::Debug + Send,
    {
        once(self.clone(), namespace, key.into(), options, work)
    }
}

impl<G: Gate + Clone + 'static> GateExt for G {}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// The reserve `once` sends for `key` (its wait is set per try).
fn reserve_request(namespace: &str, key: OnceKey, options: &OnceOptions) -> ReserveRequest {
    let mut request = ReserveRequest {
        namespace: namespace.to_owned(),
        ttl_ms: options.ttl.map_or(0, millis),
        lease_ms: options.lease.map_or(0, millis),
        fingerprint: options.fingerprint.clone(),
        ..ReserveRequest::default()
    };
    match key {
        OnceKey::Key(key) => request.key = key,
        OnceKey::Derived { parts, bucket, grace } => {
            request.key_parts = parts;
            request.bucket_ms = millis(bucket);
            request.bucket_grace_ms = millis(grace);
        }
    }
    request
}

/// [`GateExt::once`] as a function.
pub async fn once<G, F, Fut, E>(
    gate: G,
    namespace: &str,
    key: OnceKey,
    options: OnceOptions,
    work: F,
) -> Result<Ran, OnceError<G::Error, E>>
where
    G: Gate + Clone + 'static,
    F: FnOnce(Lease) -> Fut + Send,
    Fut: Future<Output = Result<Vec<u8>, WorkError<E>>> + Send,
    E: std::fmt::Debug + Send,
{
    let mut request = reserve_request(namespace, key, &options);
    let waited = Instant::now() + options.wait;
    // Whether the server is asked to wait: one whose `wait_ms_max` is below
    // `SERVER_WAIT_MAX` refuses the reserve, and is then polled instead.
    let mut server_waits = true;
    loop {
        let left = waited.saturating_duration_since(Instant::now());
        request.wait_ms = if server_waits { millis(left.min(SERVER_WAIT_MAX)) } else { 0 };
        // The lease is counted from before the reserve was sent: the server started it
        // when it decided, which may be long before the answer arrives (a wait, an fsync).
        let sent = Instant::now();
        let reserved = match gate.reserve(request.clone()).await {
            Ok(reserved) => reserved,
            Err(error) if error.code() == Code::InvalidArgument && request.wait_ms > 0 => {
                tracing::debug!(%error, "the server refused the wait; polling instead");
                server_waits = false;
                continue;
            }
            Err(error) => return Err(OnceError::Gate(error)),
        };
        let key = reserved.key.as_str().to_owned();
        match reserved.reply {
            ReserveReply::Granted { token, attempt, previous, lease_ms, .. } => {
                // A server older than `lease_ms` in grants, asked for its default, leaves
                // the lease's length unknown: it is renewed with a known one before the
                // work starts (counted as already over), never assumed.
                let (lease_for, valid_until) = match (lease_ms, options.lease) {
                    (0, None) => (LEASE_DEFAULT, sent),
                    (0, Some(asked)) => (asked, sent + asked),
                    (granted, _) => (Duration::from_millis(granted), sent + Duration::from_millis(granted)),
                };
                let (renewed, valid_until) = watch::channel(valid_until);
                let lost = CancellationToken::new();
                let lease =
                    Lease { key: key.clone(), token, attempt, previous, lost: lost.clone(), valid_until };
                let held =
                    KeyRequest { namespace: request.namespace, key, token, lease_ms: millis(lease_for) };
                let held = Held { gate, key: Some(held), on_cancel: options.on_cancel, lost };
                return held.run(lease, renewed, lease_for, options.commit_retry_for, work).await;
            }
            ReserveReply::Completed { token, outcome, response, completed_at_ms, .. } => {
                let stored = Stored { key, token, response, completed_at_ms };
                return Ok(Ran::Replayed(match outcome {
                    Outcome::Succeeded => Replay::Succeeded(stored),
                    Outcome::Failed => Replay::Failed(stored),
                }));
            }
            ReserveReply::Mismatch { expires_at_ms } => return Err(OnceError::Mismatch { expires_at_ms }),
            ReserveReply::InProgress { retry_after_ms, .. } => {
                let left = waited.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(OnceError::InProgress { retry_after_ms });
                }
                // Polling, as the server advised, within what is left of the wait.
                tokio::time::sleep(Duration::from_millis(retry_after_ms).min(left)).await;
            }
        }
    }
}

/// A granted key while its work runs: dropped then (the work panicked, or the caller
/// dropped the future), it gives the key back as `on_cancel` says.
struct Held<G: Gate + Clone + 'static> {
    gate: G,
    /// `Some` while the work runs.
    key: Option<KeyRequest>,
    on_cancel: OnCancel,
    /// The lease's [`Lease::lost`].
    lost: CancellationToken,
}

impl<G: Gate + Clone + 'static> Drop for Held<G> {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else { return };
        // The caller gave up (or the work panicked): whatever the key's fate, this
        // attempt no longer holds it, and work that left the future must hear so before
        // another attempt may run.
        self.lost.cancel();
        if self.on_cancel == OnCancel::KeepUntilLeaseEnds {
            return;
        }
        let gate = self.gate.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    if let Err(error) = gate.release(key).await {
                        tracing::warn!(%error, "could not release a key whose work was cancelled or panicked; it frees when its lease ends");
                    }
                });
            }
            Err(_) => tracing::warn!(
                "a key whose work was cancelled outside a runtime stays held until its lease ends"
            ),
        }
    }
}

/// A heartbeat in flight: when it was sent, and its answer.
type Beat<'a, E> = Pin<Box<dyn Future<Output = (Instant, Result<Renewed, E>)> + Send + 'a>>;

impl<G: Gate + Clone + 'static> Held<G> {
    async fn run<F, Fut, E>(
        mut self,
        lease: Lease,
        renewed: watch::Sender<Instant>,
        lease_for: Duration,
        commit_retry_for: Duration,
        work: F,
    ) -> Result<Ran, OnceError<G::Error, E>>
    where
        F: FnOnce(Lease) -> Fut + Send,
        Fut: Future<Output = Result<Vec<u8>, WorkError<E>>> + Send,
        E: std::fmt::Debug + Send,
    {
        let (token, lost) = (lease.token, lease.lost.clone());
        let finished = self.keep_lease(&renewed, lease_for, work(lease)).await;
        if finished.is_none() {
            lost.cancel();
        }
        // The work has run (or was cancelled by a lost lease): from here a drop must not
        // release the key, or the next attempt could repeat what this one did.
        let key = self.key.take().expect("held until the work ends");
        let Some(finished) = finished else {
            return Err(OnceError::LeaseLost { token });
        };
        match finished {
            Ok(response) => commit(&self.gate, key, Outcome::Succeeded, response.clone(), commit_retry_for)
                .await
                .map(|()| Ran::Now(response)),
            Err(WorkError::Final { error, response }) => {
                commit(&self.gate, key, Outcome::Failed, response.clone(), commit_retry_for)
                    .await
                    .and(Err(OnceError::Failed { error, response }))
            }
            Err(WorkError::Unknown(error)) => Err(OnceError::Unknown(error)),
            Err(WorkError::Retryable(error)) => {
                // A release that fails (or was already done by a lost answer's retry:
                // not found, lease lost) changes nothing for the caller: the key is no
                // longer this attempt's, or frees when its lease ends.
                if let Err(release) = self.gate.release(key).await {
                    tracing::debug!(%release, "the release after a retryable failure was not confirmed");
                }
                Err(OnceError::Retryable(error))
            }
        }
    }

    /// Runs `work` while heartbeating every third of the lease, the heartbeat alongside
    /// the work; `None` when the lease was lost (refused by the gate, or not renewed
    /// before `valid_until` by this client's clock), which cancels the work. The deadline
    /// is checked before the work is polled, so the work never runs past it.
    ///
    /// A beat is due a third of a lease after the lease was last counted from: the
    /// reserve's sending for the first, so that a grant that took two thirds of its lease
    /// to arrive (a wait, retries) is renewed at once instead of being cut at the end of
    /// the lease before any beat was tried. After a failed beat the next is tried within
    /// half of what is left, so the last stretch of a lease still gets its tries.
    async fn keep_lease<T>(
        &self,
        renewed: &watch::Sender<Instant>,
        lease_for: Duration,
        work: impl Future<Output = T>,
    ) -> Option<T> {
        let mut valid_until = *renewed.borrow();
        let every = (lease_for / 3).max(Duration::from_millis(1));
        let mut next = valid_until.checked_sub(lease_for - every).unwrap_or_else(Instant::now);
        // A grant that came after its lease would have ended by this client's count (a
        // reserve that waited as long as its lease, or retried) is renewed before the work
        // starts: given up without a try, its key would stay held for nothing.
        if Instant::now() >= valid_until {
            let sent = Instant::now();
            self.gate.heartbeat(self.key()).await.ok()?;
            valid_until = sent + lease_for;
            renewed.send_replace(valid_until);
            next = sent + every;
        }
        let mut beat: Option<Beat<'_, G::Error>> = None;
        tokio::pin!(work);
        loop {
            // The timer below fires only at its next tick, past the deadline: the work is
            // not polled once the lease is over by this client's clock.
            if Instant::now() >= valid_until {
                return None;
            }
            let wake = if beat.is_some() { valid_until } else { next.min(valid_until) };
            tokio::select! {
                biased;
                () = tokio::time::sleep_until(wake) => {
                    if Instant::now() >= valid_until {
                        return None;
                    }
                    let (gate, key, sent) = (&self.gate, self.key(), Instant::now());
                    beat = Some(Box::pin(async move { (sent, gate.heartbeat(key).await) }));
                }
                (sent, answer) = async { beat.as_mut().expect("polled only while in flight").await }, if beat.is_some() => {
                    beat = None;
                    match answer {
                        Ok(_) => {
                            valid_until = sent + lease_for;
                            renewed.send_replace(valid_until);
                            next = sent + every;
                        }
                        Err(error) if matches!(error.code(), Code::LeaseLost | Code::NotFound | Code::AlreadyCompleted) => {
                            return None;
                        }
                        // Not renewed this time (the gate's own retries ran out): the
                        // lease runs on until `valid_until`, and the next beat tries again.
                        Err(error) => {
                            tracing::warn!(%error, "heartbeat failed; the lease runs on until it is renewed or ends");
                            let now = Instant::now();
                            let left = valid_until.saturating_duration_since(now);
                            next = now + every.min(left / 2).max(Duration::from_millis(1));
                        }
                    }
                }
                done = &mut work => return Some(done),
            }
        }
    }

    fn key(&self) -> KeyRequest {
        self.key.clone().expect("held while the work runs")
    }
}

/// Commits the work's end, retried with the same token while the gate is unavailable or busy
/// (a restarting server; a commit repeated after its answer was lost is acknowledged
/// again) for up to `retry_for`. A commit that still fails leaves the key held until its
/// lease ends: the work ran, so the key must not be freed for another run; the next
/// attempt finds it abandoned and can check the first one's effects.
async fn commit<G: Gate, E: std::fmt::Debug>(
    gate: &G,
    key: KeyRequest,
    outcome: Outcome,
    response: Vec<u8>,
    retry_for: Duration,
) -> Result<(), OnceError<G::Error, E>> {
    let token = key.token;
    let request = CommitRequest { namespace: key.namespace, key: key.key, token, outcome, response };
    let until = Instant::now() + retry_for;
    let pauses = RetryPolicy { attempts_max: u32::MAX, ..RetryPolicy::default() };
    let mut tried = 0;
    loop {
        tried += 1;
        let error = match gate.commit(request.clone()).await {
            Ok(_) => return Ok(()),
            Err(error) => error,
        };
        match error.code() {
            Code::LeaseLost | Code::Conflict => return Err(OnceError::LeaseLost { token }),
            code if RetryPolicy::retries(code) && Instant::now() < until => {
                tracing::debug!(%error, tried, "commit not confirmed; trying again with the same token");
                let pause = pauses.pause(tried).min(until.saturating_duration_since(Instant::now()));
                tokio::time::sleep(pause).await;
            }
            _ => return Err(OnceError::Unconfirmed { token, response: request.response, error }),
        }
    }
}
