//! The pure core of oncegate: validated types with named limits, the stored record, and
//! the one decision function that computes every answer.
//!
//! Nothing here performs I/O, spawns threads, reads a clock or knows about SQLite,
//! tokio or gRPC. The engine feeds it `now` (through [`ClockGuard`]) and fencing tokens,
//! and makes its decisions durable. See `docs/semantics.md` for the contract.

mod clock;
mod decide;
mod error;
pub mod fingerprint;
pub mod gate;
mod limits;
mod problem;
mod record;
pub mod route;

pub use clock::ClockGuard;
pub use decide::{
    Change, Command, Commit, Decision, Previous, RETRY_AFTER_MS_MAX, Reply, Reserve, ReserveReply, View,
    answers_from_earlier_bucket, decide,
};
pub use error::{Code, Error, Invalid};
pub use limits::*;
pub use problem::{Problem, Problems, Unit};
pub use record::{Completion, Event, HISTORY_LEN_MAX, Outcome, Record, State, Transition};
