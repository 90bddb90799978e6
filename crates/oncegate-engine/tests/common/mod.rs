//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use oncegate_core::{Outcome, ReserveReply, Tenant};
use oncegate_engine::{CommitRequest, Engine, EngineConfig, Faults, KeyRequest, ManualClock, ReserveRequest};

/// A fixed start time, so that test failures print readable numbers.
pub const T0: u64 = 1_700_000_000_000;

pub fn tenant() -> Tenant {
    Tenant::default_tenant()
}

pub fn config(dir: &Path) -> EngineConfig {
    EngineConfig {
        data_dir: dir.to_owned(),
        // Long backoff: tests reopen shards explicitly unless they test the backoff.
        reopen_backoff_ms_min: 60_000,
        reopen_backoff_ms_max: 60_000,
        ..EngineConfig::default()
    }
}

pub fn open(config: EngineConfig, clock: &ManualClock, faults: &Faults) -> Engine {
    Engine::open_with(config, Arc::new(clock.clone()), faults.clone()).expect("engine opens")
}

pub fn reserve(key: &str) -> ReserveRequest {
    ReserveRequest { namespace: "live".into(), key: key.into(), ..ReserveRequest::default() }
}

pub fn reserve_for(key: &str, lease_ms: u64, ttl_ms: u64, wait_ms: u64) -> ReserveRequest {
    ReserveRequest { lease_ms, ttl_ms, wait_ms, ..reserve(key) }
}

pub fn commit(key: &str, token: u64, response: &[u8]) -> CommitRequest {
    CommitRequest {
        namespace: "live".into(),
        key: key.into(),
        token,
        outcome: Outcome::Succeeded,
        response: response.to_vec(),
    }
}

pub fn key(key: &str, token: u64) -> KeyRequest {
    KeyRequest { namespace: "live".into(), key: key.into(), token, lease_ms: 0 }
}

/// Drives a future to completion on a small runtime of its own.
pub fn block_on<F: Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(future)
}

/// The token of a grant; anything else fails the test.
pub fn granted(reply: &ReserveReply) -> u64 {
    match reply {
        ReserveReply::Granted { token, .. } => *token,
        other => panic!("expected a grant, got {other:?}"),
    }
}
