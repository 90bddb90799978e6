//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

pub mod pg;

use std::cell::Cell;
use std::collections::HashMap;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use oncegate_core::{Outcome, ReserveReply, State, Tenant};
use oncegate_engine::{
    CommitRequest, Engine, EngineConfig, Faults, KeyRequest, ManualClock, PgClock, PostgresConfig,
    ReserveRequest, StoreConfig,
};

/// A fixed start time, so that test failures print readable numbers.
pub const T0: u64 = 1_700_000_000_000;

pub fn tenant() -> Tenant {
    Tenant::default_tenant()
}

/// The store the running test uses (see [`on_each_store!`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

thread_local! {
    static BACKEND: Cell<Backend> = const { Cell::new(Backend::Sqlite) };
}

/// Runs `test` with [`config`] giving engines on `backend`; a PostgreSQL run where
/// PostgreSQL is not installed is skipped (or fails, under `ONCEGATE_REQUIRE_POSTGRES=1`).
pub fn with_backend(backend: Backend, test: impl FnOnce()) {
    if backend == Backend::Postgres && pg::shared().is_none() {
        return;
    }
    BACKEND.with(|b| b.set(backend));
    test();
}

/// The store config of the running test's backend for a data directory: a database of
/// its own on the shared cluster, deciding by the engine's (manual) clock.
pub fn store_for(dir: &Path) -> StoreConfig {
    match BACKEND.with(Cell::get) {
        Backend::Sqlite => StoreConfig::default(),
        Backend::Postgres => StoreConfig::Postgres(PostgresConfig {
            postgres_url: pg::database_for(dir).expect("the cluster was started by with_backend").into(),
            postgres_clock: PgClock::Engine,
            ..PostgresConfig::default()
        }),
    }
}

/// Generates, for each test function, a module with a test per listed store (`[sqlite:
/// Sqlite, postgres: Postgres]`: the test's name, then its [`Backend`]), each running the
/// same body against that store.
#[macro_export]
macro_rules! on_stores {
    ($stores:tt $($(#[doc = $doc:expr])* fn $name:ident() $body:block)*) => {$(
        $crate::on_stores!(@one $stores $(#[doc = $doc])* fn $name() $body);
    )*};
    (@one [$($test:ident: $backend:ident),*] $(#[doc = $doc:expr])* fn $name:ident() $body:block) => {
        $(#[doc = $doc])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            fn body() $body
            $(
                #[test]
                fn $test() {
                    $crate::common::with_backend($crate::common::Backend::$backend, body)
                }
            )*
        }
    };
}

/// [`on_stores!`] on every store: `sqlite` and `postgres`.
#[macro_export]
macro_rules! on_each_store {
    ($($tests:tt)*) => {
        $crate::on_stores!([sqlite: Sqlite, postgres: Postgres] $($tests)*);
    };
}

/// [`on_stores!`] on the store a node owns alone, `sqlite` (slot moves and restarts are
/// its; PostgreSQL's shards share one table).
#[macro_export]
macro_rules! on_own_stores {
    ($($tests:tt)*) => {
        $crate::on_stores!([sqlite: Sqlite] $($tests)*);
    };
}

pub fn config(dir: &Path) -> EngineConfig {
    EngineConfig {
        data_dir: dir.to_owned(),
        store: store_for(dir),
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

/// Polls a future once, without waiting: `None` while it is still pending.
pub fn poll_once<F: Future>(future: F) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    match future.as_mut().poll(&mut context) {
        std::task::Poll::Ready(output) => Some(output),
        std::task::Poll::Pending => None,
    }
}

/// The token of a grant; anything else fails the test.
pub fn granted(reply: &ReserveReply) -> u64 {
    match reply {
        ReserveReply::Granted { token, .. } => *token,
        other => panic!("expected a grant, got {other:?}"),
    }
}

/// What a test wrote: each key's token, and whether it was committed.
pub type Written = HashMap<String, (u64, bool)>;

/// Writes `keys` keys: every third stays pending (its holder keeps a long lease), the
/// rest are committed with their name as the response.
pub fn fill_keys(engine: &Engine, keys: usize) -> Written {
    let mut written = Written::new();
    for i in 0..keys {
        let name = format!("k{i}");
        let token =
            granted(&engine.reserve_blocking(&tenant(), reserve_for(&name, 600_000, 0, 0)).unwrap().reply);
        let committed = i % 3 != 0;
        if committed {
            engine.commit_blocking(&tenant(), commit(&name, token, name.as_bytes())).unwrap();
        }
        written.insert(name, (token, committed));
    }
    written
}

/// Every key reads as written, on the shard the map now gives it.
pub fn check_keys(engine: &Engine, written: &Written) {
    for (name, (token, committed)) in written {
        let view = engine.get_blocking(&tenant(), key(name, 0)).unwrap();
        let state = if *committed { State::Completed } else { State::Pending };
        assert_eq!((view.state, view.token), (state, *token), "{name}");
        if *committed {
            assert_eq!(view.response, name.as_bytes());
        }
    }
}

/// Records stored over all shards (expired ones not yet reclaimed included).
pub fn stored(engine: &Engine) -> u64 {
    engine.stats().iter().map(|s| s.records_pending + s.records_completed).sum()
}
