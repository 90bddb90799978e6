//! Data directories written by earlier versions (`tests/fixtures/`, made by
//! `examples/write_fixture.rs` with that version's code) open, upgrade in place where the
//! schema changed, and read exactly as they were written.

use std::path::Path;
use std::sync::Arc;

use oncegate_core::{Outcome, ReserveReply, State, Tenant};
use oncegate_engine::{Engine, EngineConfig, Faults, KeyRequest, ManualClock, ReserveRequest};

/// The clock the fixtures were written at.
const WRITTEN_AT: u64 = 1_700_000_000_000;

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[test]
fn a_schema_v3_directory_opens_and_reads_as_written() {
    opens_and_reads_as_written("schema-v3");
}

/// Version 4 kept the reclaim schedule as an index in the file; version 5 drops it.
#[test]
fn a_schema_v4_directory_opens_and_reads_as_written() {
    opens_and_reads_as_written("schema-v4");
}

fn opens_and_reads_as_written(fixture: &str) {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(fixture);
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture, dir.path());
    let config = EngineConfig { data_dir: dir.path().to_owned(), shards: 2, ..EngineConfig::default() };
    let clock = ManualClock::new(WRITTEN_AT + 1_000);
    let engine = Engine::open_with(config, Arc::new(clock), Faults::default()).expect("the fixture opens");
    let tenant = Tenant::new("acme").unwrap();
    let get = |key: &str| {
        let request = KeyRequest { namespace: "live".into(), key: key.into(), token: 0, lease_ms: 0 };
        engine.get_blocking(&tenant, request).unwrap()
    };
    let pending = get("pending");
    assert_eq!((pending.state, pending.token, pending.attempt), (State::Pending, 1, 1));
    let done = get("done");
    assert_eq!((done.state, done.token, done.outcome), (State::Completed, 1, Some(Outcome::Succeeded)));
    assert_eq!(done.response, b"answer");
    let failed = get("failed");
    assert_eq!(
        (failed.state, failed.outcome, failed.response.as_slice()),
        (State::Completed, Some(Outcome::Failed), &b"declined"[..])
    );
    assert_eq!(get("released").state, State::Free);
    // The fingerprint was kept: the same key with another payload is a mismatch.
    let other = ReserveRequest {
        namespace: "live".into(),
        key: "done".into(),
        fingerprint: b"other".to_vec(),
        ..ReserveRequest::default()
    };
    assert!(matches!(engine.reserve_blocking(&tenant, other).unwrap().reply, ReserveReply::Mismatch { .. }));
    // New grants on either shard come after every stored token.
    let fresh =
        ReserveRequest { namespace: "live".into(), key: "released".into(), ..ReserveRequest::default() };
    let ReserveReply::Granted { token, .. } = engine.reserve_blocking(&tenant, fresh).unwrap().reply else {
        panic!()
    };
    assert!(token > 2, "token {token}");
    drop(engine);
    // The file is at the current schema, without the reclaim index of version 4.
    let conn = rusqlite::Connection::open(dir.path().join("shard-0000.sqlite")).unwrap();
    let version: i64 = conn.query_row("PRAGMA user_version", [], |row| row.get(0)).unwrap();
    let indexes: i64 = conn
        .query_row(
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND tbl_name = 'records'",
            [],
            |row| row.get(0),
        )
        .unwrap();
    assert_eq!((version, indexes), (6, 0));
}

#[test]
fn a_full_schema_v3_file_still_upgrades_and_opens() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/schema-v3");
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture, dir.path());
    // The files are at their size limit: the upgrade needs room for both tables for a
    // moment, so the limit applies only once the file is upgraded.
    let pages = std::fs::metadata(dir.path().join("shard-0000.sqlite")).unwrap().len() / 4096;
    let faults = Faults::default();
    faults.limit_pages(pages);
    let config = EngineConfig { data_dir: dir.path().to_owned(), shards: 2, ..EngineConfig::default() };
    let engine = Engine::open_with(config, Arc::new(ManualClock::new(WRITTEN_AT + 1_000)), faults)
        .expect("the fixture opens");
    assert!(
        engine.shard_states().iter().all(|s| *s == oncegate_engine::ShardState::Serving),
        "{:?}",
        engine.stats()
    );
    let request = KeyRequest { namespace: "live".into(), key: "done".into(), token: 0, lease_ms: 0 };
    let done = engine.get_blocking(&Tenant::new("acme").unwrap(), request).unwrap();
    assert_eq!((done.state, done.response.as_slice()), (State::Completed, &b"answer"[..]));
}
