//! Writes a small data directory with this version's schema into
//! `tests/fixtures/schema-vN/`, for the test that every later version opens it and reads
//! it as it was written (`tests/fixtures.rs`). Run it once per schema version:
//!
//! `cargo run -p oncegate-engine --example write_fixture`

use std::sync::Arc;

use oncegate_core::{Outcome, ReserveReply, Tenant};
use oncegate_engine::{
    CommitRequest, Engine, EngineConfig, Faults, KeyRequest, ManualClock, ReserveRequest, StoreConfig,
};

/// The fixture's clock: the reading test uses the same one, so nothing has expired.
const T0: u64 = 1_700_000_000_000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let version = std::env::args().nth(1).unwrap_or_else(|| "3".to_owned());
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/schema-v{version}"));
    if dir.exists() {
        return Err(format!("{} exists; a fixture is written once", dir.display()).into());
    }
    // The fixtures are SQLite files of each schema version.
    let store = StoreConfig::default();
    let config = EngineConfig { data_dir: dir.clone(), shards: 2, store, ..EngineConfig::default() };
    let engine = Engine::open_with(config, Arc::new(ManualClock::new(T0)), Faults::default())?;
    let tenant = Tenant::new("acme")?;
    let reserve = |key: &str| ReserveRequest {
        namespace: "live".into(),
        key: key.into(),
        fingerprint: b"fp".to_vec(),
        lease_ms: 600_000,
        ..ReserveRequest::default()
    };
    let token = |reply: ReserveReply| match reply {
        ReserveReply::Granted { token, .. } => token,
        other => panic!("{other:?}"),
    };
    let key =
        |name: &str, token| KeyRequest { namespace: "live".into(), key: name.into(), token, lease_ms: 0 };
    let pending = token(engine.reserve_blocking(&tenant, reserve("pending"))?.reply);
    engine.heartbeat_blocking(&tenant, key("pending", pending))?;
    let done = token(engine.reserve_blocking(&tenant, reserve("done"))?.reply);
    let commit = CommitRequest {
        namespace: "live".into(),
        key: "done".into(),
        token: done,
        outcome: Outcome::Succeeded,
        response: b"answer".to_vec(),
    };
    engine.commit_blocking(&tenant, commit)?;
    let failed = token(engine.reserve_blocking(&tenant, reserve("failed"))?.reply);
    let commit = CommitRequest {
        namespace: "live".into(),
        key: "failed".into(),
        token: failed,
        outcome: Outcome::Failed,
        response: b"declined".to_vec(),
    };
    engine.commit_blocking(&tenant, commit)?;
    let released = token(engine.reserve_blocking(&tenant, reserve("released"))?.reply);
    engine.release_blocking(&tenant, key("released", released))?;
    engine.shutdown();
    // The lock file is per process; it has no place in a fixture.
    std::fs::remove_file(dir.join(oncegate_engine::testing::manifest::LOCK_FILE))?;
    println!(
        "wrote {} (tokens: pending {pending}, done {done}, failed {failed}, released {released})",
        dir.display()
    );
    Ok(())
}
