//! The oncegate client: the [`Gate`] calls over gRPC ([`Client`]), and [`GateExt::once`],
//! the reserve, work, heartbeat, commit-or-release protocol done right on any `Gate`, the
//! embedded engine's included.
//!
//! ```
//! use oncegate_client::{AnyError, GateExt, OnceOptions, Ran, Replay, Tenant, WorkError};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let config = oncegate_engine::EngineConfig { data_dir: dir.path().to_owned(), ..Default::default() };
//! // In process; `Client::builder("https://gate.internal:50051").token(..).connect().await` is
//! // the same `Gate` over the network.
//! let engine = oncegate_engine::Engine::open(config)?;
//! let gate = engine.gate(Tenant::default_tenant());
//! let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
//! runtime.block_on(async {
//!     let first = gate
//!         .once("live", "order-42", OnceOptions::default(), |lease| async move {
//!             // The side effect, fenced by `lease.token`; its response is stored.
//!             Ok::<_, WorkError<AnyError>>(format!("filled with token {}", lease.token).into_bytes())
//!         })
//!         .await?;
//!     assert!(matches!(first, Ran::Now(_)));
//!     // A retry of the same key replays the stored response; the work does not run.
//!     let retry = gate
//!         .once("live", "order-42", OnceOptions::default(), |_| async {
//!             Ok::<Vec<u8>, WorkError<AnyError>>(unreachable!("a completed key never runs its work again"))
//!         })
//!         .await?;
//!     // A replay says how the first attempt ended: a stored failure is not a success.
//!     match retry {
//!         Ran::Replayed(Replay::Succeeded(stored)) => assert!(stored.response.starts_with(b"filled")),
//!         other => panic!("{other:?}"),
//!     }
//!     Ok::<_, Box<dyn std::error::Error>>(())
//! })?;
//! # engine.shutdown();
//! # Ok(())
//! # }
//! ```

//! The gRPC [`Client`] is the `remote` feature (on by default); without it the crate is
//! `once`, keys and retries over any `Gate`, with no network stack.

#[cfg(feature = "remote")]
mod client;
pub mod keys;
mod once;
mod retry;
#[cfg(feature = "remote")]
mod session;

#[cfg(feature = "remote")]
pub use client::{Client, ClientBuilder, ClientError, GrpcCode, Refusal, Transport};
pub use once::{
    AnyError, GateExt, Lease, OnCancel, OnceError, OnceKey, OnceOptions, Ran, Replay, Stored, WorkError, once,
};
pub use oncegate_core::gate::{
    AnyGateError, CommitRequest, DynGate, Gate, GateError, KeyRequest, Renewed, ReserveRequest, Reserved,
};
/// The contract's types that the calls take and return, so that this crate is the one
/// dependency a caller needs.
pub use oncegate_core::{Code, Fingerprint, Outcome, Previous, ReserveReply, State, Tenant, View};
pub use retry::RetryPolicy;
