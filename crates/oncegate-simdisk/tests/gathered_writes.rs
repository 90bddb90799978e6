//! A shard writes each commit's WAL frames with one write (the engine's
//! `store/sqlite/gather.rs`), synced or not: SQLite alone writes two a frame.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use oncegate_core::ReserveReply;
use oncegate_engine::{Durability, Engine, EngineConfig, Faults, ManualClock};
use oncegate_simdisk::disk::{Disk, DiskStats};

const CALLS: u64 = 20;

/// The disk's counts over `CALLS` reserves of new keys, one batch each, on an engine
/// with `durability`.
fn reserve_new_keys(durability: Durability) -> (DiskStats, DiskStats) {
    let disk = Disk::new();
    let config =
        EngineConfig { data_dir: PathBuf::from("/data"), shards: 1, durability, ..EngineConfig::default() };
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let engine =
        Engine::open_on(config, clock, Faults::default(), Arc::new(disk.boot())).expect("the engine opens");
    let reserve = |key: &str| match common::reserve(&engine, key) {
        Ok(ReserveReply::Granted { .. }) => {}
        other => panic!("a new key is granted: {other:?}"),
    };
    reserve("warm-up");
    let before = disk.stats();
    for call in 0..CALLS {
        reserve(&format!("key-{call}"));
    }
    (before, disk.stats())
}

#[test]
fn a_synced_commit_writes_its_wal_frames_at_once() {
    let (before, after) = reserve_new_keys(Durability::Full);
    assert_eq!(after.file_syncs - before.file_syncs, CALLS, "one commit, synced, a call");
    assert_eq!(after.writes - before.writes, CALLS, "one write a commit");
}

#[test]
fn a_commit_without_a_sync_writes_its_wal_frames_at_once_too() {
    let (before, after) = reserve_new_keys(Durability::Normal);
    assert_eq!(after.file_syncs - before.file_syncs, 0, "no commit syncs");
    assert_eq!(after.writes - before.writes, CALLS, "one write a commit, before the commit returns");
}
