//! `once`: the protocol every user of a gate needs, written once.
//!
//! Reserve the key. On a grant, run the work while a heartbeat keeps the lease (every
//! third of it, concurrently with the work); commit the work's response as succeeded, or a
//! failure the work marks as final as failed; release the key when the work fails in a
//! way worth retrying, so that the next attempt may run. A completed key replays what the
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
use oncegate_core::{Code, Outcome, Previous, ReserveReply};
use tokio::time::Instant;

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

/// How `once` reserves.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OnceOptions {
    /// How long the record is remembered; 0 selects the server's default.
    pub ttl_ms: u64,
    /// The lease the work runs under, renewed by heartbeats; 0 means 30 s (the contract's
    /// default, sent explicitly: the client's heartbeats must know the lease).
    pub lease_ms: u64,
    /// How long to wait when another attempt holds the key; 0 answers at once with
    /// [`Ran::InProgress`].
    pub wait_ms: u64,
    /// The request's fingerprint (`Fingerprint::of_json`), or empty: without one, a
    /// different payload under the same key is not noticed.
    pub fingerprint: Vec<u8>,
    /// What a cancelled or panicking work does with its key.
    pub on_cancel: OnCancel,
}

/// The lease a work runs under.
#[derive(Clone, Debug, PartialEq, Eq)]
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
}

/// What happened to the key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ran {
    /// The work ran now and its response was committed.
    Now(Vec<u8>),
    /// An earlier attempt completed the key; this is what it stored.
    Replayed {
        /// How it ended.
        outcome: Outcome,
        /// Its response.
        response: Vec<u8>,
    },
    /// Another attempt holds the key (after waiting `wait_ms`, if asked to). This can be
    /// this caller's own earlier reserve whose grant was lost on the way back (a network
    /// failure, retried): the key then frees when that grant's lease ends, and the next
    /// grant says the previous attempt was abandoned.
    InProgress {
        /// When to look again.
        retry_after_ms: u64,
    },
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

/// Why `once` did not run the work to a committed end.
#[derive(Debug, thiserror::Error)]
pub enum OnceError<G: std::error::Error, E: std::fmt::Debug> {
    /// A call to the gate failed (after its retries) before the work ran: nothing ran.
    #[error("gate: {0}")]
    Gate(#[source] G),
    /// The work failed in a way worth retrying; the key was released (or, if the release
    /// could not be confirmed, frees when its lease ends).
    #[error("the work failed and the key was released: {0:?}")]
    Retryable(E),
    /// The work failed for good; the failure was committed.
    #[error("the work failed for good (committed as failed): {0:?}")]
    Failed(E),
    /// The work could not tell whether its side effect happened; the key is held until
    /// its lease ends (see [`WorkError::Unknown`]).
    #[error("the work's outcome is unknown; the key frees when its lease ends: {0:?}")]
    Unknown(E),
    /// The work ran, but its commit could not be confirmed: the gate failed after its
    /// retries (the key stays held until its lease ends, and the next attempt is granted
    /// as `abandoned` and must check whether this one's side effect happened), or the
    /// record was gone (`not_found`: its ttl ran out before the commit, so the key is
    /// free already and the next attempt is granted with no warning; give keys a ttl that
    /// outlasts the work and its commit).
    #[error("the work ran (token {token}) but its commit could not be confirmed: {error}")]
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

/// The lease sent when the options leave it at 0: the contract's default.
const LEASE_DEFAULT_MS: u64 = 30_000;

/// `once` on every gate that can be cloned into a background release.
pub trait GateExt: Gate + Clone + 'static {
    /// Runs `work` at most once for `namespace`/`key` (see the module's documentation).
    fn once<F, Fut, E>(
        &self,
        namespace: &str,
        key: &str,
        options: OnceOptions,
        work: F,
    ) -> impl Future<Output = Result<Ran, OnceError<Self::Error, E>>> + Send
    where
        F: FnOnce(Lease) -> Fut + Send,
        Fut: Future<Output = Result<Vec<u8>, WorkError<E>>> + Send,
        E: std::fmt::Debug + Send,
    {
        let request = ReserveRequest {
            namespace: namespace.to_owned(),
            key: key.to_owned(),
            ttl_ms: options.ttl_ms,
            lease_ms: options.lease_ms,
            wait_ms: options.wait_ms,
            fingerprint: options.fingerprint,
            ..ReserveRequest::default()
        };
        once(self.clone(), request, options.on_cancel, work)
    }
}

impl<G: Gate + Clone + 'static> GateExt for G {}

/// [`GateExt::once`] for any reserve request (derived keys included).
pub async fn once<G, F, Fut, E>(
    gate: G,
    mut request: ReserveRequest,
    on_cancel: OnCancel,
    work: F,
) -> Result<Ran, OnceError<G::Error, E>>
where
    G: Gate + Clone + 'static,
    F: FnOnce(Lease) -> Fut + Send,
    Fut: Future<Output = Result<Vec<u8>, WorkError<E>>> + Send,
    E: std::fmt::Debug + Send,
{
    if request.lease_ms == 0 {
        request.lease_ms = LEASE_DEFAULT_MS;
    }
    let lease_for = Duration::from_millis(request.lease_ms);
    let namespace = request.namespace.clone();
    // The lease is counted from before the reserve was sent: the server started it when
    // it decided, which may be long before the answer arrives (a wait, an fsync).
    let sent = Instant::now();
    let reserved = gate.reserve(request.clone()).await.map_err(OnceError::Gate)?;
    let lease = match reserved.reply {
        ReserveReply::Granted { token, attempt, previous, .. } => {
            Lease { key: reserved.key.as_str().to_owned(), token, attempt, previous }
        }
        ReserveReply::InProgress { retry_after_ms, .. } => return Ok(Ran::InProgress { retry_after_ms }),
        ReserveReply::Completed { outcome, response, .. } => return Ok(Ran::Replayed { outcome, response }),
        ReserveReply::Mismatch { expires_at_ms } => return Err(OnceError::Mismatch { expires_at_ms }),
    };
    let key =
        KeyRequest { namespace, key: lease.key.clone(), token: lease.token, lease_ms: request.lease_ms };
    let held = Held { gate, key: Some(key), on_cancel };
    held.run(lease, sent + lease_for, lease_for, work).await
}

/// A granted key while its work runs: dropped then (the work panicked, or the caller
/// dropped the future), it gives the key back as `on_cancel` says.
struct Held<G: Gate + Clone + 'static> {
    gate: G,
    /// `Some` while the work runs.
    key: Option<KeyRequest>,
    on_cancel: OnCancel,
}

impl<G: Gate + Clone + 'static> Drop for Held<G> {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else { return };
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
        valid_until: Instant,
        lease_for: Duration,
        work: F,
    ) -> Result<Ran, OnceError<G::Error, E>>
    where
        F: FnOnce(Lease) -> Fut + Send,
        Fut: Future<Output = Result<Vec<u8>, WorkError<E>>> + Send,
        E: std::fmt::Debug + Send,
    {
        let token = lease.token;
        let finished = self.keep_lease(valid_until, lease_for, work(lease)).await;
        // The work has run (or was cancelled by a lost lease): from here a drop must not
        // release the key, or the next attempt could repeat what this one did.
        let key = self.key.take().expect("held until the work ends");
        let Some(finished) = finished else {
            return Err(OnceError::LeaseLost { token });
        };
        match finished {
            Ok(response) => commit(&self.gate, key, Outcome::Succeeded, response.clone())
                .await
                .map(|()| Ran::Now(response)),
            Err(WorkError::Final { error, response }) => {
                commit(&self.gate, key, Outcome::Failed, response).await.and(Err(OnceError::Failed(error)))
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
        mut valid_until: Instant,
        lease_for: Duration,
        work: impl Future<Output = T>,
    ) -> Option<T> {
        let every = (lease_for / 3).max(Duration::from_millis(1));
        let mut next = valid_until.checked_sub(lease_for - every).unwrap_or_else(Instant::now);
        // A grant that came after its lease would have ended by this client's count (a
        // reserve that waited as long as its lease, or retried) is renewed before the work
        // starts: given up without a try, its key would stay held for nothing.
        if Instant::now() >= valid_until {
            let sent = Instant::now();
            self.gate.heartbeat(self.key()).await.ok()?;
            valid_until = sent + lease_for;
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

/// Commits the work's end. A commit that fails (after the gate's retries) leaves the key
/// held until its lease ends: the work ran, so the key must not be freed for another run;
/// the next attempt finds it abandoned and can check the first one's effects.
async fn commit<G: Gate, E: std::fmt::Debug>(
    gate: &G,
    key: KeyRequest,
    outcome: Outcome,
    response: Vec<u8>,
) -> Result<(), OnceError<G::Error, E>> {
    let token = key.token;
    let request = CommitRequest { namespace: key.namespace, key: key.key, token, outcome, response };
    let response = request.response.clone();
    match gate.commit(request).await {
        Ok(_) => Ok(()),
        Err(error) if matches!(error.code(), Code::LeaseLost | Code::Conflict) => {
            Err(OnceError::LeaseLost { token })
        }
        Err(error) => Err(OnceError::Unconfirmed { token, response, error }),
    }
}
