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
