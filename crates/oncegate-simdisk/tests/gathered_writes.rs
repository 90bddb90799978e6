//! A shard writes each commit's WAL frames with one write (the engine's
//! `store/sqlite/gather.rs`), synced or not: SQLite alone writes two a frame.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use oncegate_core::ReserveReply;
use oncegate_engine::{Durability, Engine, EngineConfig, Faults, ManualClock};
use oncegate_simdisk::disk::Disk;

const CALLS: u64 = 20;
/// A response of several pages: its commit writes several WAL frames (2 KiB pages).
const RESPONSE_BYTES: usize = 8 << 10;

/// What the disk counted over `CALLS` commits of held keys, each its own batch, each
/// with a response of `RESPONSE_BYTES`, on an engine with `durability`: (syncs, writes,
/// bytes written). The keys are reserved before, and the engine's open is done, so that
/// only the commits are counted; no checkpoint runs among them (the interval is 16,384
/// pages).
fn commit_held_keys(durability: Durability) -> (u64, u64, u64) {
    let disk = Disk::new();
    let config =
        EngineConfig { data_dir: PathBuf::from("/data"), shards: 1, durability, ..EngineConfig::default() };
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let engine =
        Engine::open_on(config, clock, Faults::default(), Arc::new(disk.boot())).expect("the engine opens");
    let tokens: Vec<u64> = (0..CALLS)
        .map(|call| match common::reserve(&engine, &format!("key-{call}")) {
            Ok(ReserveReply::Granted { token, .. }) => token,
            other => panic!("a new key is granted: {other:?}"),
        })
        .collect();
    let before = disk.stats();
    for (call, token) in tokens.into_iter().enumerate() {
        common::commit(&engine, &format!("key-{call}"), token, RESPONSE_BYTES)
            .expect("the commit is acknowledged");
    }
    let after = disk.stats();
    (
        after.file_syncs - before.file_syncs,
        after.writes - before.writes,
        after.bytes_written - before.bytes_written,
    )
}

#[test]
fn each_synced_commit_is_one_write_of_all_its_frames() {
    let (syncs, writes, bytes) = commit_held_keys(Durability::Full);
    assert_eq!(syncs, CALLS, "every commit syncs its WAL");
    assert_eq!(writes, CALLS, "one write a commit");
    assert!(bytes >= CALLS * RESPONSE_BYTES as u64, "each write carries the commit's frames: {bytes} bytes");
}

#[test]
fn each_commit_without_a_sync_is_one_write_of_all_its_frames_too() {
    let (syncs, writes, bytes) = commit_held_keys(Durability::Normal);
    assert_eq!(syncs, 0, "no commit syncs");
    assert_eq!(writes, CALLS, "one write a commit, before the commit returns");
    assert!(bytes >= CALLS * RESPONSE_BYTES as u64, "each write carries the commit's frames: {bytes} bytes");
}
