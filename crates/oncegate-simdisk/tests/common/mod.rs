//! Calls the simulated-disk tests make, each one request on the `live` namespace.
#![allow(dead_code)]

use oncegate_core::{Outcome, ReserveReply, Tenant};
use oncegate_engine::{CommitRequest, Engine, Error, ReserveRequest};

/// Reserves `key` with a lease of ten minutes.
pub fn reserve(engine: &Engine, key: &str) -> Result<ReserveReply, Error> {
    let request =
        ReserveRequest { namespace: "live".into(), key: key.into(), lease_ms: 600_000, ..Default::default() };
    engine.reserve_blocking(&Tenant::default_tenant(), request).map(|reserved| reserved.reply)
}

/// Commits `key` under `token` with a response of `response_bytes` (large responses span
/// many sectors of the simulated disk, or fill it sooner).
pub fn commit(engine: &Engine, key: &str, token: u64, response_bytes: usize) -> Result<u64, Error> {
    let request = CommitRequest {
        namespace: "live".into(),
        key: key.into(),
        token,
        outcome: Outcome::Succeeded,
        response: vec![7; response_bytes],
    };
    engine.commit_blocking(&Tenant::default_tenant(), request)
}
