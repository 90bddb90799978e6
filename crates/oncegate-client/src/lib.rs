//! The oncegate client: the [`Gate`] calls over gRPC ([`Client`]), and [`GateExt::once`],
//! the reserve, work, heartbeat, commit-or-release protocol done right on any `Gate`, the
//! embedded engine's included.
//!
//! ```
//! use oncegate_client::{GateExt, OnceOptions, Ran, WorkError};
//! use oncegate_core::Tenant;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let config = oncegate_engine::EngineConfig { data_dir: dir.path().to_owned(), ..Default::default() };
//! // In process; `Client::builder("https://gate.internal:50051").token(..).connect()` is
//! // the same `Gate` over the network.
//! let engine = oncegate_engine::Engine::open(config)?;
//! let gate = engine.gate(Tenant::default_tenant());
//! let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
//! runtime.block_on(async {
//!     let first = gate
//!         .once("live", "order-42", OnceOptions::default(), |lease| async move {
//!             // The side effect, fenced by `lease.token`; its response is stored.
//!             Ok::<_, WorkError<String>>(format!("filled with token {}", lease.token).into_bytes())
//!         })
//!         .await?;
//!     assert!(matches!(first, Ran::Now(_)));
//!     // A retry of the same key replays the stored response; the work does not run.
//!     let retry = gate
//!         .once("live", "order-42", OnceOptions::default(), |_| async {
//!             Ok::<Vec<u8>, WorkError<String>>(unreachable!("a completed key never runs its work again"))
//!         })
//!         .await?;
//!     assert!(matches!(retry, Ran::Replayed { .. }));
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
pub use client::{Client, ClientBuilder, ClientError, Refusal, Transport};
pub use once::{GateExt, Lease, OnCancel, OnceError, OnceOptions, Ran, WorkError, once};
pub use oncegate_core::gate::{
    CommitRequest, Gate, GateError, KeyRequest, Renewed, ReserveRequest, Reserved,
};
pub use retry::RetryPolicy;
