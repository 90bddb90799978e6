//! oncegate: an idempotency gate that answers, durably and at most once per key, "may
//! this attempt proceed?".
//!
//! This crate is the embedded API: open an [`Engine`] on a data directory and call it
//! in-process, with the same behaviour the gRPC server gives over the network. It pulls
//! in no gRPC, HTTP, command line or PostgreSQL client; the `postgres` feature adds the
//! shared PostgreSQL store and `remote` the gRPC [`client::Client`]
//! (`oncegate = { path = "…/crates/oncegate", features = ["remote"] }`).
//!
//! ```no_run
//! use oncegate::{Engine, EngineConfig, ReserveRequest, core::{ReserveReply, Tenant}};
//!
//! let engine = Engine::open(EngineConfig { data_dir: "data".into(), ..EngineConfig::default() })?;
//! let request = ReserveRequest { namespace: "live".into(), key: "order-42".into(), ..Default::default() };
//! match engine.reserve_blocking(&Tenant::default_tenant(), request)?.reply {
//!     ReserveReply::Granted { token, .. } => { /* do the work, then commit with `token` */ }
//!     ReserveReply::Completed { response, .. } => { /* answer with the stored response */ }
//!     ReserveReply::InProgress { retry_after_ms, .. } => { /* ask the client to retry later */ }
//!     ReserveReply::Mismatch { .. } => { /* same key, different payload: refuse */ }
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub use oncegate_client as client;
pub use oncegate_core as core;
pub use oncegate_engine::reshard::{Pauses, Resharded};
pub use oncegate_engine::{
    BackedUp, BackupError, Clock, CommitRequest, Durability, Engine, EngineConfig, Error, KeyRequest,
    ManualClock, OpenError, PgClock, PostgresUrl, Renewed, ReserveRequest, Reserved, ResizeError, ShardState,
    ShardStats, StoreConfig, StoreKind, SystemClock, TenantGate,
};

/// The README's examples compile as doc tests, so they cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;
