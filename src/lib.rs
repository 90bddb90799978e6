//! oncegate: an idempotency gate that answers, durably and at most once per key, "may
//! this attempt proceed?".
//!
//! This root package re-exports the embedded API. So far that is the pure core: the
//! validated request types, the limits and the decision function.

pub use oncegate_core as core;
