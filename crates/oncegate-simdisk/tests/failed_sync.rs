//! A commit whose sync of the shard's WAL fails as Linux fails a writeback: `EIO`
//! (SQLite's `SQLITE_IOERR_FSYNC`), with the frames it wrote either lost (left readable in
//! the page cache but marked clean, so no later sync writes them), kept only in the
//! device's volatile cache (read back until a cut loses them), or on the device after all.
//! The error does not say which.
//!
//! A reopen in the same process could read those frames back as committed, chain later
//! commits onto them and acknowledge them; after a power cut SQLite's WAL recovery stops
//! at the first frame that is gone, and every acknowledged commit after it is lost with
//! it. So a failed sync halts the shard: it answers `unavailable`, says a restart is
//! required, and refuses an operator's reopen. The next process drops the WAL's cached
//! pages before SQLite reads it. Each case checks that after a cut every acknowledged
//! call is found and no completed key is granted again.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::reserve;
use oncegate_core::ReserveReply;
use oncegate_engine::{Engine, EngineConfig, Error, Faults, ManualClock, ShardState};
use oncegate_simdisk::disk::{Cut, Disk, Writeback};
use rand::SeedableRng;

const DB: &str = "/data/shard-0000.sqlite";
const WAL: &str = "/data/shard-0000.sqlite-wal";

fn open(disk: &Disk) -> Engine {
    // The backoff is short, so that a shard which did reopen after the failure would do
    // so while the test runs.
    let config = EngineConfig {
        data_dir: PathBuf::from("/data"),
        shards: 1,
        reopen_backoff_ms_min: 1,
        reopen_backoff_ms_max: 1,
        ..EngineConfig::default()
    };
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    Engine::open_on(config, clock, Faults::default(), Arc::new(disk.boot())).expect("the engine opens")
}

/// Commits `key` under `token` with an 8 KiB response: its frames span many sectors, so
/// that a lost frame is not rewritten whole by the next commit's write to its sector.
fn commit(engine: &Engine, key: &str, token: u64) -> Result<u64, Error> {
    common::commit(engine, key, token, 8 << 10)
}

fn granted(reply: Result<ReserveReply, Error>) -> u64 {
    match reply {
        Ok(ReserveReply::Granted { token, .. }) => token,
        other => panic!("a fresh key is granted: {other:?}"),
    }
}

/// What was acknowledged: keys completed, keys granted and not completed, and keys
/// granted whose commit was answered `unavailable` (it may have been applied or not,
/// which the contract allows; never granted again).
#[derive(Default)]
struct Acknowledged {
    completed: Vec<String>,
    held: Vec<String>,
    commit_failed: Vec<String>,
}

impl Acknowledged {
    /// Grants and commits `key`, recording each acknowledgement.
    fn complete(&mut self, engine: &Engine, key: &str) {
        let token = granted(reserve(engine, key));
        self.held.push(key.to_owned());
        commit(engine, key, token).expect("acknowledged");
        self.held.retain(|k| k != key);
        self.completed.push(key.to_owned());
    }

    /// Every acknowledged call is found: a completed key replays, a held key is held.
    fn check(&self, engine: &Engine) {
        for key in &self.completed {
            let again = reserve(engine, key);
            assert!(matches!(again, Ok(ReserveReply::Completed { .. })), "{key} was completed: {again:?}");
        }
        for key in &self.held {
            let again = reserve(engine, key);
            assert!(matches!(again, Ok(ReserveReply::InProgress { .. })), "{key} is held: {again:?}");
        }
        for key in &self.commit_failed {
            let again = reserve(engine, key);
            assert!(
                matches!(again, Ok(ReserveReply::InProgress { .. } | ReserveReply::Completed { .. })),
                "{key} is held or completed: {again:?}"
            );
        }
    }
}

/// Acknowledges `before`, then fails the WAL's sync under `failed`'s commit with its
/// frames where `writeback` leaves them, and the shard file's next sync too (the disk
/// goes on failing: the checkpoint that closing the file tries fails, so the WAL stays
/// with the failed frames in it). Returns what was acknowledged (`failed`'s grant
/// included, its commit not).
fn fail_a_commit(disk: &Disk, engine: &Engine, writeback: Writeback) -> Acknowledged {
    let mut acknowledged = Acknowledged::default();
    acknowledged.complete(engine, "before");
    let token = granted(reserve(engine, "failed"));
    acknowledged.commit_failed.push("failed".to_owned());
    disk.fail_next_sync_of(Path::new(WAL), 0, writeback).expect("the shard's WAL exists");
    disk.fail_next_sync_of(Path::new(DB), 0, Writeback::Lost).expect("the shard file exists");
    let failed = commit(engine, "failed", token);
    assert!(matches!(failed, Err(Error::Unavailable { .. })), "not acknowledged: {failed:?}");
    acknowledged
}

/// Cuts the power, restarts the disk, and checks every acknowledged call on a new engine.
fn cut_and_check(disk: &Disk, engine: Engine, acknowledged: &Acknowledged) {
    disk.cut();
    drop(engine);
    disk.restart(Cut::Plain, &mut rand::rngs::StdRng::seed_from_u64(1));
    let engine = open(disk);
    assert_eq!(engine.shard_states(), [ShardState::Serving]);
    acknowledged.check(&engine);
    engine.shutdown();
}

/// The shard that saw the failed sync stays halted, however it is asked to serve again,
/// and nothing acknowledged is lost at the next cut.
fn the_shard_halts(writeback: Writeback) {
    let disk = Disk::new();
    let engine = open(&disk);
    let acknowledged = fail_a_commit(&disk, &engine, writeback);
    assert_eq!(engine.shard_states(), [ShardState::Halted], "{writeback:?}");
    let stats = &engine.stats()[0];
    let said = stats.last_error.as_deref().unwrap_or_default();
    assert!(said.contains("sync may have failed") && said.contains("restart required"), "{said}");
    // An operator's reopen is refused with the reason.
    let reopened = engine.reopen_shard(0);
    assert!(
        matches!(&reopened, Err(Error::Unavailable { reason, .. }) if reason.contains("restart required")),
        "{writeback:?}: {reopened:?}"
    );
    // Calls keep being refused with the reason, however long the backoff of a failed
    // shard would have been.
    for key in ["after-1", "after-2"] {
        let refused = reserve(&engine, key);
        assert!(
            matches!(&refused, Err(Error::Unavailable { reason, .. }) if reason.contains("restart required")),
            "{writeback:?}: {key}: {refused:?}"
        );
    }
    assert_eq!(engine.shard_states(), [ShardState::Halted], "{writeback:?}");
    cut_and_check(&disk, engine, &acknowledged);
}

#[test]
fn a_failed_sync_whose_frames_were_lost_halts_the_shard() {
    the_shard_halts(Writeback::Lost);
}

#[test]
fn a_failed_sync_whose_frames_stayed_in_the_devices_cache_halts_the_shard() {
    the_shard_halts(Writeback::Cached);
}

#[test]
fn a_failed_sync_whose_frames_reached_the_device_halts_the_shard() {
    the_shard_halts(Writeback::Reached);
}

/// The process that saw the failure ends (no cut), and the next one serves: its open
/// reads the WAL as the device holds it, not as the page cache still shows it, so the
/// commits it acknowledges survive a later cut.
#[test]
fn the_next_process_does_not_build_on_frames_a_failed_sync_lost() {
    let disk = Disk::new();
    let engine = open(&disk);
    let mut acknowledged = fail_a_commit(&disk, &engine, Writeback::Lost);
    drop(engine);
    let engine = open(&disk);
    assert_eq!(engine.shard_states(), [ShardState::Serving]);
    acknowledged.check(&engine);
    for key in ["next-1", "next-2", "next-3"] {
        acknowledged.complete(&engine, key);
    }
    cut_and_check(&disk, engine, &acknowledged);
}

/// With `durability = "normal"` a commit does not sync the WAL: a checkpoint's sync is the
/// only one its frames get. A background checkpoint whose sync of the WAL fails halts the
/// shard before its next write, as a failed commit does; before, the checkpointer only
/// logged it, and the shard went on building on frames the disk may have lost.
#[test]
fn a_background_checkpoint_whose_sync_fails_halts_the_shard() {
    let disk = Disk::new();
    let faults = Faults::default();
    faults.checkpoint_after_pages(8);
    let config = EngineConfig {
        data_dir: PathBuf::from("/data"),
        shards: 1,
        durability: oncegate_engine::Durability::Normal,
        ..EngineConfig::default()
    };
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let engine = Engine::open_on(config, clock, faults, Arc::new(disk.boot())).expect("opens");
    disk.fail_next_sync_of(Path::new(WAL), 0, Writeback::Lost).expect("the shard's WAL exists");
    // Writes go on until the checkpointer, poked past its interval, has failed and the
    // shard has heard of it at its next write.
    let halted = (0..10_000).find(|i| match reserve(&engine, &format!("k{i}")) {
        Ok(_) => false,
        Err(Error::Unavailable { reason, .. }) => reason.contains("restart required"),
        Err(error) => panic!("{error}"),
    });
    assert!(halted.is_some(), "10,000 writes and the shard never heard of the failed checkpoint");
    assert_eq!(engine.shard_states(), [ShardState::Halted]);
    let said = engine.stats()[0].last_error.clone().unwrap_or_default();
    assert!(said.contains("restart required"), "{said}");
}
