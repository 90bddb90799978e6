//! The calls every oncegate offers, embedded or remote: the [`Gate`] trait and its
//! request and reply types. The engine implements it in process, the client crate over
//! the network; code written against `Gate` (the client's `once`, the proxy) runs on
//! either, and an application moves between one binary and a shared server by changing
//! one constructor.
//!
//! The trait is `async` without naming a runtime: its futures are plain `Send` futures.

use std::future::Future;

use crate::{Code, Key, Outcome, ReserveReply, View};

/// A reserve as a caller sends it, before validation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReserveRequest {
    /// The namespace, such as `live` or `test`.
    pub namespace: String,
    /// The idempotency key; leave empty to derive one from `key_parts`.
    pub key: String,
    /// Parts of a derived key (with `bucket_ms`), used when `key` is empty.
    pub key_parts: Vec<String>,
    /// The bucket width of a derived key.
    pub bucket_ms: u64,
    /// With `key_parts`: a reserve this long after a bucket boundary is answered from the
    /// previous bucket's key while that key holds a live record (a retry that
    /// crossed the boundary), and reserves the current bucket's key otherwise.
    pub bucket_grace_ms: u64,
    /// How long the record is remembered; 0 selects the default.
    pub ttl_ms: u64,
    /// How long the holder may work before it must heartbeat; 0 selects the default.
    pub lease_ms: u64,
    /// A hash of the request payload, or empty.
    pub fingerprint: Vec<u8>,
    /// How long to wait when the key is in progress; 0 answers at once.
    pub wait_ms: u64,
}

/// The answer to a reserve, with the key that was used (derived when parts were sent).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reserved {
    /// The key the record lives under.
    pub key: Key,
    /// Granted, in progress, completed or mismatch.
    pub reply: ReserveReply,
}

/// A commit as a caller sends it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommitRequest {
    /// The namespace.
    pub namespace: String,
    /// The key (as returned by the reserve, for derived keys).
    pub key: String,
    /// The fencing token of the grant.
    pub token: u64,
    /// How the attempt ended.
    pub outcome: Outcome,
    /// Bytes to replay to later reserves.
    pub response: Vec<u8>,
}

/// Release, heartbeat and get name a key and, except for get, a token.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyRequest {
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
    /// The fencing token of the grant (ignored by get).
    pub token: u64,
    /// The new lease for a heartbeat; 0 selects the default (ignored otherwise).
    pub lease_ms: u64,
}

/// A heartbeat's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Renewed {
    /// The new lease deadline.
    pub lease_until_ms: u64,
    /// The record's expiry.
    pub expires_at_ms: u64,
}

/// An error any [`Gate`] gives: it says its contract [`Code`], so that callers decide
/// what to do (retry, give up, report) without knowing which gate answered.
pub trait GateError: std::error::Error + Send + Sync + 'static {
    /// The contract's code for this error.
    fn code(&self) -> Code;
}

/// The calls of the contract (docs/semantics.md). Each answer is computed by the core's
/// `decide`; implementations differ only in where the store is.
pub trait Gate: Send + Sync {
    /// What this gate's calls fail with.
    type Error: GateError;

    /// May this attempt proceed? Granted, in progress, completed (with the stored
    /// response) or mismatch; waits up to `wait_ms` while the key is in progress.
    fn reserve(&self, request: ReserveRequest) -> impl Future<Output = Result<Reserved, Self::Error>> + Send;

    /// Stores the attempt's outcome and response; returns the record's expiry.
    fn commit(&self, request: CommitRequest) -> impl Future<Output = Result<u64, Self::Error>> + Send;

    /// Gives the key up, so that the next attempt may proceed.
    fn release(&self, request: KeyRequest) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Extends the holder's lease by `lease_ms` (or the default) from now.
    fn heartbeat(&self, request: KeyRequest) -> impl Future<Output = Result<Renewed, Self::Error>> + Send;

    /// The key's state, without changing it.
    fn get(&self, request: KeyRequest) -> impl Future<Output = Result<View, Self::Error>> + Send;
}

/// What a reserve replied, for callers that only need to know whether they hold the key.
impl Reserved {
    /// The token, when the reserve granted the key.
    pub fn granted_token(&self) -> Option<u64> {
        match self.reply {
            ReserveReply::Granted { token, .. } => Some(token),
            _ => None,
        }
    }
}

/// A gate behind a pointer is the same gate: shared by reference counting, or borrowed.
macro_rules! same_gate {
    ($($pointer:ty),*) => {$(
        impl<G: Gate> Gate for $pointer {
            type Error = G::Error;

            fn reserve(&self, request: ReserveRequest) -> impl Future<Output = Result<Reserved, Self::Error>> + Send {
                (**self).reserve(request)
            }
            fn commit(&self, request: CommitRequest) -> impl Future<Output = Result<u64, Self::Error>> + Send {
                (**self).commit(request)
            }
            fn release(&self, request: KeyRequest) -> impl Future<Output = Result<(), Self::Error>> + Send {
                (**self).release(request)
            }
            fn heartbeat(&self, request: KeyRequest) -> impl Future<Output = Result<Renewed, Self::Error>> + Send {
                (**self).heartbeat(request)
            }
            fn get(&self, request: KeyRequest) -> impl Future<Output = Result<View, Self::Error>> + Send {
                (**self).get(request)
            }
        }
    )*};
}

same_gate!(std::sync::Arc<G>, &G);

/// A boxed future, as [`DynGate`] returns.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The object-safe form of [`Gate`], which every gate has: for choosing the embedded
/// engine or a remote server at run time behind one type. `Arc<dyn DynGate>` is itself a
/// [`Gate`] (with [`AnyGateError`]), so `once` and everything written against `Gate`
/// take it.
pub trait DynGate: Send + Sync {
    /// [`Gate::reserve`], boxed.
    fn reserve_boxed(&self, request: ReserveRequest) -> BoxFuture<'_, Result<Reserved, AnyGateError>>;
    /// [`Gate::commit`], boxed.
    fn commit_boxed(&self, request: CommitRequest) -> BoxFuture<'_, Result<u64, AnyGateError>>;
    /// [`Gate::release`], boxed.
    fn release_boxed(&self, request: KeyRequest) -> BoxFuture<'_, Result<(), AnyGateError>>;
    /// [`Gate::heartbeat`], boxed.
    fn heartbeat_boxed(&self, request: KeyRequest) -> BoxFuture<'_, Result<Renewed, AnyGateError>>;
    /// [`Gate::get`], boxed.
    fn get_boxed(&self, request: KeyRequest) -> BoxFuture<'_, Result<View, AnyGateError>>;
}

impl<G: Gate> DynGate for G {
    fn reserve_boxed(&self, request: ReserveRequest) -> BoxFuture<'_, Result<Reserved, AnyGateError>> {
        Box::pin(async move { self.reserve(request).await.map_err(AnyGateError::new) })
    }
    fn commit_boxed(&self, request: CommitRequest) -> BoxFuture<'_, Result<u64, AnyGateError>> {
        Box::pin(async move { self.commit(request).await.map_err(AnyGateError::new) })
    }
    fn release_boxed(&self, request: KeyRequest) -> BoxFuture<'_, Result<(), AnyGateError>> {
        Box::pin(async move { self.release(request).await.map_err(AnyGateError::new) })
    }
    fn heartbeat_boxed(&self, request: KeyRequest) -> BoxFuture<'_, Result<Renewed, AnyGateError>> {
        Box::pin(async move { self.heartbeat(request).await.map_err(AnyGateError::new) })
    }
    fn get_boxed(&self, request: KeyRequest) -> BoxFuture<'_, Result<View, AnyGateError>> {
        Box::pin(async move { self.get(request).await.map_err(AnyGateError::new) })
    }
}

/// Each call goes to the boxed gate (`(**self)`: on the `Arc` itself, the blanket
/// `DynGate` would call back here).
impl Gate for std::sync::Arc<dyn DynGate> {
    type Error = AnyGateError;

    fn reserve(&self, request: ReserveRequest) -> impl Future<Output = Result<Reserved, Self::Error>> + Send {
        (**self).reserve_boxed(request)
    }
    fn commit(&self, request: CommitRequest) -> impl Future<Output = Result<u64, Self::Error>> + Send {
        (**self).commit_boxed(request)
    }
    fn release(&self, request: KeyRequest) -> impl Future<Output = Result<(), Self::Error>> + Send {
        (**self).release_boxed(request)
    }
    fn heartbeat(&self, request: KeyRequest) -> impl Future<Output = Result<Renewed, Self::Error>> + Send {
        (**self).heartbeat_boxed(request)
    }
    fn get(&self, request: KeyRequest) -> impl Future<Output = Result<View, Self::Error>> + Send {
        (**self).get_boxed(request)
    }
}

/// Any gate's error, boxed, with its code: what a [`DynGate`] fails with.
#[derive(Debug)]
pub struct AnyGateError {
    code: Code,
    source: Box<dyn std::error::Error + Send + Sync>,
}

impl AnyGateError {
    /// Boxes `error`, keeping its code.
    pub fn new<E: GateError>(error: E) -> AnyGateError {
        AnyGateError { code: error.code(), source: Box::new(error) }
    }

    /// The gate's own error, for `downcast_ref` (a remote client's refusal says its
    /// field and limit there).
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.source
    }
}

impl std::fmt::Display for AnyGateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.source.fmt(f)
    }
}

impl std::error::Error for AnyGateError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.source()
    }
}

impl GateError for AnyGateError {
    fn code(&self) -> Code {
        self.code
    }
}
