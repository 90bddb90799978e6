//! A full disk is an answer, not a crash. On a simulated disk given a size, a write that
//! does not fit (SQLite's `SQLITE_FULL` at `COMMIT`, `ENOSPC` for the engine's own files)
//! is refused with `resource_exhausted` naming the disk, while reads and replays of
//! completed keys go on and the shard keeps serving; writes resume once the disk has
//! room. A first open that finds the disk full fails naming the file and `ENOSPC`.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::reserve;
use oncegate_core::{Code, ReserveReply, State, Tenant};
use oncegate_engine::{
    Engine, EngineConfig, Error, Faults, KeyRequest, ManualClock, OpenError, ReserveRequest, ShardState,
};
use oncegate_simdisk::disk::Disk;

const BACKOFF_MS: u64 = 50;

fn config() -> EngineConfig {
    EngineConfig {
        data_dir: PathBuf::from("/data"),
        shards: 1,
        reopen_backoff_ms_min: BACKOFF_MS,
        reopen_backoff_ms_max: 4 * BACKOFF_MS,
        ..EngineConfig::default()
    }
}

fn open(disk: &Disk, clock: &ManualClock) -> Result<Engine, OpenError> {
    Engine::open_on(config(), Arc::new(clock.clone()), Faults::default(), Arc::new(disk.boot()))
}

/// Commits `key` under `token` with a 4 KiB response, so that the disk fills in few keys.
fn commit(engine: &Engine, key: &str, token: u64) -> Result<u64, Error> {
    common::commit(engine, key, token, 4 << 10)
}

fn get(engine: &Engine, key: &str) -> Result<State, Error> {
    let request = KeyRequest { namespace: "live".into(), key: key.into(), token: 0, lease_ms: 0 };
    engine.get_blocking(&Tenant::default_tenant(), request).map(|view| view.state)
}

/// Whether `error` is the refusal of a full disk, naming the shard's file.
fn is_disk_full(error: &Error) -> bool {
    matches!(error, Error::DiskFull { shard: 0, path } if path == "/data/shard-0000.sqlite")
        && error.code() == Code::ResourceExhausted
}

/// The shard's storage failures so far: each write found the disk full once more.
fn failures(engine: &Engine) -> u64 {
    engine.stats()[0].failures
}

/// Completes `done`, leaves `held` granted, then fills the disk: gives it a size just
/// above what its files hold and completes keys until one is refused. Returns the keys
/// completed.
fn fill(disk: &Disk, engine: &Engine) -> Vec<String> {
    let mut completed = Vec::new();
    for key in ["done", "held"] {
        let Ok(ReserveReply::Granted { token, .. }) = reserve(engine, key) else {
            panic!("{key} is granted")
        };
        if key == "done" {
            commit(engine, key, token).expect("committed");
            completed.push(key.to_owned());
        }
    }
    disk.set_capacity(Some(disk.used_bytes() + (64 << 10)));
    for i in 0.. {
        let key = format!("fill-{i}");
        let granted = match reserve(engine, &key) {
            Ok(ReserveReply::Granted { token, .. }) => token,
            Err(error) if is_disk_full(&error) => return completed,
            other => panic!("{key}: {other:?}"),
        };
        match commit(engine, &key, granted) {
            Ok(_) => completed.push(key),
            Err(error) if is_disk_full(&error) => return completed,
            Err(error) => panic!("{key}: {error}"),
        }
        assert!(i < 1_000, "64 KiB of room took more than 1,000 keys");
    }
    unreachable!("the loop returns")
}

#[test]
fn a_full_disk_refuses_writes_and_serves_reads_and_replays_until_it_has_room() {
    let disk = Disk::new();
    let clock = ManualClock::new(1_700_000_000_000);
    let engine = open(&disk, &clock).expect("opens");
    let completed = fill(&disk, &engine);
    assert!(completed.len() > 1, "the disk took some keys before it filled: {completed:?}");

    // Writes are refused alone, naming the disk; the shard serves on.
    let refused = reserve(&engine, "new").unwrap_err();
    assert!(is_disk_full(&refused), "{refused}");
    assert_eq!(engine.shard_states(), [ShardState::Serving]);
    let last_error = engine.stats()[0].last_error.clone().unwrap_or_default();
    assert!(last_error.contains("is full"), "{last_error}");
    // Reads and replays of completed keys go on, in the same batches as refused writes.
    for key in &completed {
        assert_eq!(get(&engine, key).unwrap(), State::Completed, "{key}");
        let replay = reserve(&engine, key);
        assert!(matches!(replay, Ok(ReserveReply::Completed { .. })), "{key}: {replay:?}");
    }
    assert!(matches!(reserve(&engine, "held"), Ok(ReserveReply::InProgress { .. })));
    assert_eq!(get(&engine, "held").unwrap(), State::Pending);

    // Room again: after the pause the next write is tried, and goes through.
    disk.set_capacity(None);
    assert!(is_disk_full(&reserve(&engine, "new").unwrap_err()), "refused until the pause is over");
    clock.advance(BACKOFF_MS);
    assert!(matches!(reserve(&engine, "new"), Ok(ReserveReply::Granted { .. })));
    for key in &completed {
        assert!(matches!(reserve(&engine, key), Ok(ReserveReply::Completed { .. })), "{key}");
    }
    engine.shutdown();
}

/// A try while the disk is still full refuses again, with a longer pause.
#[test]
fn writes_tried_again_on_a_disk_still_full_are_refused_again() {
    let disk = Disk::new();
    let clock = ManualClock::new(1_700_000_000_000);
    let engine = open(&disk, &clock).expect("opens");
    fill(&disk, &engine);
    let found = failures(&engine);
    assert!(is_disk_full(&reserve(&engine, "paused").unwrap_err()));
    assert_eq!(failures(&engine), found, "refused without a try during the pause");
    clock.advance(BACKOFF_MS);
    assert!(is_disk_full(&reserve(&engine, "tried").unwrap_err()));
    assert_eq!(failures(&engine), found + 1, "the try after the pause finds the disk full");
    clock.advance(BACKOFF_MS);
    assert!(is_disk_full(&reserve(&engine, "doubled").unwrap_err()));
    assert_eq!(failures(&engine), found + 1, "no try yet: the pause doubled");
    clock.advance(BACKOFF_MS);
    assert!(is_disk_full(&reserve(&engine, "tried-again").unwrap_err()));
    assert_eq!(failures(&engine), found + 2, "tried after the doubled pause");
    assert_eq!(get(&engine, "done").unwrap(), State::Completed);
    disk.set_capacity(None);
    clock.advance(4 * BACKOFF_MS);
    assert!(matches!(reserve(&engine, "room"), Ok(ReserveReply::Granted { .. })));
    engine.shutdown();
}

/// A process that starts on a full disk fails its open with the file it could not write
/// and `ENOSPC`, and serves every key once the disk has room.
#[test]
fn a_first_open_on_a_full_disk_fails_naming_the_file() {
    let disk = Disk::new();
    let clock = ManualClock::new(1_700_000_000_000);
    let engine = open(&disk, &clock).expect("opens");
    let completed = fill(&disk, &engine);
    drop(engine);
    disk.set_capacity(Some(disk.used_bytes()));
    let refused = open(&disk, &clock).expect_err("a full disk fails the open");
    assert!(matches!(refused, OpenError::DiskFull { shard: 0, .. }), "{refused:?}");
    let said = refused.to_string();
    assert!(said.contains("/data/shard-0000") && said.contains("ENOSPC"), "{said}");
    disk.set_capacity(None);
    let engine = open(&disk, &clock).expect("opens once the disk has room");
    for key in &completed {
        assert!(matches!(reserve(&engine, key), Ok(ReserveReply::Completed { .. })), "{key}");
    }
    assert!(matches!(reserve(&engine, "held"), Ok(ReserveReply::InProgress { .. })));
    engine.shutdown();
}

/// Records that come due for reclaim while the disk is full wait for the next try of
/// writes (reclaim deletes, and deletes write): the shard goes on serving its mailbox
/// instead of running its due alarm again and again.
#[test]
fn records_due_for_reclaim_on_a_full_disk_wait_and_the_shard_serves_on() {
    let disk = Disk::new();
    let clock = ManualClock::new(1_700_000_000_000);
    // A pause longer than the wait for reclaim, so that no write is tried meanwhile.
    let config = EngineConfig { reopen_backoff_ms_min: 10_000, reopen_backoff_ms_max: 10_000, ..config() };
    let engine = Engine::open_on(config, Arc::new(clock.clone()), Faults::default(), Arc::new(disk.boot()))
        .expect("opens");
    let request = ReserveRequest {
        namespace: "live".into(),
        key: "short".into(),
        lease_ms: 1_000,
        ttl_ms: 1_000,
        ..Default::default()
    };
    let Ok(ReserveReply::Granted { token, .. }) =
        engine.reserve_blocking(&Tenant::default_tenant(), request).map(|r| r.reply)
    else {
        panic!("granted")
    };
    commit(&engine, "short", token).expect("committed");
    fill(&disk, &engine);
    // Past the short record's reclaim, but not past the pause before writes are tried.
    clock.advance(5_000);
    for _ in 0..3 {
        assert!(matches!(reserve(&engine, "done"), Ok(ReserveReply::Completed { .. })));
    }
    disk.set_capacity(None);
    clock.advance(10_000);
    assert!(matches!(reserve(&engine, "room"), Ok(ReserveReply::Granted { .. })));
    engine.run_alarms();
    assert_eq!(get(&engine, "short").unwrap(), State::Free, "reclaimed once writes resumed");
    engine.shutdown();
}
