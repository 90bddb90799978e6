//! `once`: the protocol every user of a gate needs, written once.
//!
//! Reserve the key. On a grant, run the work while a heartbeat keeps the lease (every
//! third of it); commit the work's response as succeeded, or a failure the work marks as
//! final as failed; release the key when the work fails in a way worth retrying, panics
//! or is cancelled, so that the next attempt may run. A completed key replays what the
//! first attempt stored. A lease that cannot be kept (lost to another attempt, or not
//! renewed before it ran out) cancels the work with `lease_lost`: the attempt is fenced
//! off, and its side effects must be checked by the caller.

use std::future::Future;
use std::time::Duration;

use oncegate_core::gate::{CommitRequest, Gate, GateError, KeyRequest, ReserveRequest};
use oncegate_core::{Code, Outcome, Previous, ReserveReply};
use tokio::time::Instant;

/// How `once` reserves.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OnceOptions {
    /// How long the record is remembered; 0 selects the server's default.
    pub ttl_ms: u64,
    /// The lease the work runs under, renewed by heartbeats; 0 selects the default
    /// (30 s).
    pub lease_ms: u64,
    /// How long to wait when another attempt holds the key; 0 answers at once with
    /// [`Ran::InProgress`].
    pub wait_ms: u64,
    /// The request's fingerprint (`Fingerprint::of_json`), or empty.
    pub fingerprint: Vec<u8>,
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
    /// Another attempt holds the key (after waiting `wait_ms`, if asked to).
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
}

/// Why `once` did not run the work to a committed end.
#[derive(Debug, thiserror::Error)]
pub enum OnceError<G: std::error::Error, E: std::fmt::Debug> {
    /// A call to the gate failed (after its retries).
    #[error("gate: {0}")]
    Gate(#[source] G),
    /// The work failed in a way worth retrying; the key was released.
    #[error("the work failed and the key was released: {0:?}")]
    Retryable(E),
    /// The work failed for good; the failure was committed.
    #[error("the work failed for good (committed as failed): {0:?}")]
    Failed(E),
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

/// The default lease, when the options leave it to the server (its default is 30 s).
const LEASE_DEFAULT: Duration = Duration::from_secs(30);

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
        once(
            self.clone(),
            ReserveRequest {
                namespace: namespace.to_owned(),
                key: key.to_owned(),
                ttl_ms: options.ttl_ms,
                lease_ms: options.lease_ms,
                wait_ms: options.wait_ms,
                fingerprint: options.fingerprint,
                ..ReserveRequest::default()
            },
            work,
        )
    }
}

impl<G: Gate + Clone + 'static> GateExt for G {}

/// [`GateExt::once`] for any reserve request (derived keys included).
pub async fn once<G, F, Fut, E>(
    gate: G,
    request: ReserveRequest,
    work: F,
) -> Result<Ran, OnceError<G::Error, E>>
where
    G: Gate + Clone + 'static,
    F: FnOnce(Lease) -> Fut + Send,
    Fut: Future<Output = Result<Vec<u8>, WorkError<E>>> + Send,
    E: std::fmt::Debug + Send,
{
    let lease_ms = request.lease_ms;
    let namespace = request.namespace.clone();
    let reserved = gate.reserve(request).await.map_err(OnceError::Gate)?;
    let lease = match reserved.reply {
        ReserveReply::Granted { token, attempt, previous, .. } => {
            Lease { key: reserved.key.as_str().to_owned(), token, attempt, previous }
        }
        ReserveReply::InProgress { retry_after_ms, .. } => return Ok(Ran::InProgress { retry_after_ms }),
        ReserveReply::Completed { outcome, response, .. } => return Ok(Ran::Replayed { outcome, response }),
        ReserveReply::Mismatch { expires_at_ms } => return Err(OnceError::Mismatch { expires_at_ms }),
    };
    let held = Held {
        gate: gate.clone(),
        key: Some(KeyRequest { namespace, key: lease.key.clone(), token: lease.token, lease_ms }),
    };
    let lease_for = if lease_ms == 0 { LEASE_DEFAULT } else { Duration::from_millis(lease_ms) };
    held.run(lease, lease_for, work).await
}

/// A granted key until it is committed or released: dropped holding it (the work
/// panicked, or the caller dropped the future), it releases the key in the background.
struct Held<G: Gate + Clone + 'static> {
    gate: G,
    /// `Some` while the key is held.
    key: Option<KeyRequest>,
}

impl<G: Gate + Clone + 'static> Drop for Held<G> {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else { return };
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

impl<G: Gate + Clone + 'static> Held<G> {
    fn key(&self) -> KeyRequest {
        self.key.clone().expect("held until committed or released")
    }

    async fn run<F, Fut, E>(
        mut self,
        lease: Lease,
        lease_for: Duration,
        work: F,
    ) -> Result<Ran, OnceError<G::Error, E>>
    where
        F: FnOnce(Lease) -> Fut + Send,
        Fut: Future<Output = Result<Vec<u8>, WorkError<E>>> + Send,
        E: std::fmt::Debug + Send,
    {
        let token = lease.token;
        let finished = self.keep_lease(lease_for, work(lease)).await;
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
            Err(WorkError::Retryable(error)) => {
                self.gate.release(key).await.map_err(OnceError::Gate)?;
                Err(OnceError::Retryable(error))
            }
        }
    }

    /// Runs `work` while heartbeating every third of the lease; `None` when the lease
    /// was lost (refused by the gate, or not renewed before it ran out), which cancels
    /// the work.
    async fn keep_lease<T>(&self, lease_for: Duration, work: impl Future<Output = T>) -> Option<T> {
        let every = (lease_for / 3).max(Duration::from_millis(1));
        let mut valid_until = Instant::now() + lease_for;
        let mut next = Instant::now() + every;
        tokio::pin!(work);
        loop {
            tokio::select! {
                done = &mut work => return Some(done),
                () = tokio::time::sleep_until(next.min(valid_until)) => {}
            }
            if Instant::now() >= valid_until {
                return None;
            }
            let sent = Instant::now();
            match self.gate.heartbeat(self.key()).await {
                Ok(_) => valid_until = sent + lease_for,
                Err(error)
                    if matches!(error.code(), Code::LeaseLost | Code::NotFound | Code::AlreadyCompleted) =>
                {
                    return None;
                }
                // Not renewed this time (the gate's own retries ran out): the lease still
                // runs until `valid_until`, and the next beat tries again.
                Err(error) => {
                    tracing::warn!(%error, "heartbeat failed; the lease runs on until it is renewed or ends")
                }
            }
            next = Instant::now() + every;
        }
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
    match gate.commit(request).await {
        Ok(_) => Ok(()),
        Err(error) if error.code() == Code::LeaseLost => Err(OnceError::LeaseLost { token }),
        Err(error) => Err(OnceError::Gate(error)),
    }
}
