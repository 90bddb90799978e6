//! Load generation for oncegate and the stores teams usually hand-roll an idempotency
//! gate on, doing the same durable work on each: reserve a key (insert-if-absent with a
//! lease and a ttl), then commit a response, with a share of duplicate reserves that must
//! be answered with the stored response.
//!
//! Targets (`targets/`): oncegate over gRPC, oncegate embedded, Redis (`SET NX PX`, a Lua
//! script that commits only for the holder's token, `appendfsync always`), PostgreSQL
//! (`INSERT ... ON CONFLICT DO NOTHING`, an `UPDATE` fenced by token, synchronous commit).
//! The runner (`runner.rs`) measures pairs/s and latencies, and `cost.rs` what the server
//! spent on them (CPU per pair, shard CPU per command, disk bytes per pair).

pub mod child;
pub mod cost;
pub mod layouts;
pub mod plot;
pub mod preload;
pub mod raw_sqlite;
pub mod report;
pub mod runner;
pub mod targets;

pub use child::{ChildMode, serve_child, start_child};
pub use cost::rss_bytes;
pub use report::{Ratio, Report, markdown, medians, ratios};
pub use runner::{Load, Work, run};
