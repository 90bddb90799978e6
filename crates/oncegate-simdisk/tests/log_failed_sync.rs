//! A commit on the log whose `fdatasync` fails as Linux fails a writeback (`EIO`, and the
//! frame left readable in the page cache but marked clean, so the disk may never get it),
//! on a disk that then fails the zeros meant to take the frame back. The shard's reopen in
//! the same process must not take that frame for the log's: commits chained onto it would
//! be acknowledged, and after a power cut the log would end where the lost frame was, with
//! their frames past that end (refused as damage, the shard down until repaired by hand).
//! Nor must the next process's open, which knows nothing of the zeros the last one owed.
//!
//! The error does not say whether the frame reached the device. When it did, the commit
//! (answered `unavailable`) may come back, which the contract allows: the shard's reopen
//! takes it back with the zeros it owes, and the next process, which owes none, reads it
//! whole. Either way the log opens, and every acknowledged commit survives a cut. A
//! device may also keep the frame in its volatile cache only, read back until a cut
//! loses it: the reopen must not build on it (the last case). Every open drops the
//! segments' clean cached pages first, and that is what the cases with the frame lost
//! rest on now, the reopen's included.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use oncegate_core::{Outcome, ReserveReply, Tenant};
use oncegate_engine::{
    CommitRequest, Engine, EngineConfig, Error, Faults, ManualClock, ReserveRequest, StoreConfig, StoreKind,
};
use oncegate_simdisk::disk::{Cut, Disk, Writeback};
use rand::SeedableRng;

fn open(disk: &Disk) -> Result<Engine, oncegate_engine::OpenError> {
    // Small segments: the log's spares are zero-filled in memory.
    let store =
        StoreConfig { kind: Some(StoreKind::Log), log_segment_bytes: 320 << 10, ..StoreConfig::default() };
    // A failed shard waits for the test to reopen it: reopened by its own backoff before
    // the process ends, it would pay the zeros it owes, and the second case below would
    // pass without the open's drop of the page cache.
    let config = EngineConfig {
        data_dir: PathBuf::from("/data"),
        shards: 1,
        store,
        reopen_backoff_ms_min: 60_000,
        reopen_backoff_ms_max: 60_000,
        ..EngineConfig::default()
    };
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    Engine::open_on(config, clock, Faults::default(), Arc::new(disk.boot()))
}

fn reserve(engine: &Engine, key: &str) -> Result<ReserveReply, Error> {
    let request =
        ReserveRequest { namespace: "live".into(), key: key.into(), lease_ms: 600_000, ..Default::default() };
    engine.reserve_blocking(&Tenant::default_tenant(), request).map(|reserved| reserved.reply)
}

/// Fails a commit of key `a` (granted first) as the module says: the head segment's sync
/// fails, and so does the write of the zeros after it. The commit stores an 8 KiB
/// response, so that its frame spans several sectors: a frame within one sector would
/// reach the disk anyway with the next frame's write to that sector (as a page does on
/// Linux), and nothing would be lost.
fn fail_a_commit(disk: &Disk, engine: &Engine, writeback: Writeback) {
    let Ok(ReserveReply::Granted { token, .. }) = reserve(engine, "a") else {
        panic!("a fresh key is granted")
    };
    disk.fail_next_sync_of(Path::new("/data/shard-0000.log/00000001.seg"), 1, writeback)
        .expect("the head segment");
    let commit = CommitRequest {
        namespace: "live".into(),
        key: "a".into(),
        token,
        outcome: Outcome::Succeeded,
        response: vec![7; 8 << 10],
    };
    let failed = engine.commit_blocking(&Tenant::default_tenant(), commit);
    assert!(
        matches!(failed, Err(Error::Unavailable { .. })),
        "the failed commit is not acknowledged: {failed:?}"
    );
}

/// What `a`'s failed commit left: taken back (its grant alone), or come back whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FailedCommit {
    TakenBack,
    CameBack,
}

/// Acknowledges a reserve of `c`, cuts the power, and checks that the log opens after it
/// with `c`'s grant, and `a` as its failed commit left it.
fn acknowledged_commits_survive_a_cut(disk: &Disk, engine: Engine, a: FailedCommit) {
    assert!(
        matches!(reserve(&engine, "c"), Ok(ReserveReply::Granted { .. })),
        "acknowledged after the failure"
    );
    disk.cut();
    drop(engine);
    disk.restart(Cut::Plain, &mut rand::rngs::StdRng::seed_from_u64(1));
    let engine = open(disk).expect("the log opens after the cut with every acknowledged commit");
    let again = reserve(&engine, "c");
    assert!(matches!(again, Ok(ReserveReply::InProgress { .. })), "c is held by its grant: {again:?}");
    let again = reserve(&engine, "a");
    match a {
        FailedCommit::TakenBack => {
            assert!(matches!(again, Ok(ReserveReply::InProgress { .. })), "a is held by its grant: {again:?}")
        }
        FailedCommit::CameBack => {
            assert!(matches!(again, Ok(ReserveReply::Completed { .. })), "a's commit came back: {again:?}")
        }
    }
    engine.shutdown();
}

/// Who opens the log next after the failed commit.
#[derive(Clone, Copy, Debug)]
enum Next {
    /// The shard's reopen in the same process, which pays the zeros it owes.
    Reopen,
    /// The next process, which knows nothing of them.
    Process,
}

/// Fails `a`'s commit with its frame where `writeback` leaves it (lost, on the device, or
/// in the device's cache only), opens the log as `next` does, and checks what came of the
/// commit and that acknowledged commits survive a cut.
fn fail_then_open(writeback: Writeback, next: Next, a: FailedCommit) {
    let disk = Disk::new();
    let engine = open(&disk).expect("a new log opens");
    fail_a_commit(&disk, &engine, writeback);
    let engine = match next {
        Next::Reopen => {
            assert!(engine.reopen_shard(0), "the shard reopens once the disk works again");
            engine
        }
        Next::Process => {
            drop(engine);
            open(&disk).expect("the next process opens the log")
        }
    };
    acknowledged_commits_survive_a_cut(&disk, engine, a);
}

#[test]
fn a_commit_taken_back_after_a_failed_sync_is_not_built_on_when_its_zeros_fail_too() {
    fail_then_open(Writeback::Lost, Next::Reopen, FailedCommit::TakenBack);
}

/// The process ends before its shard reopens, and the zeros it owed go with it; the page
/// cache, the disk's and not the process's, still holds the lost frame, marked clean.
#[test]
fn the_next_process_does_not_build_on_a_commit_whose_sync_and_zeros_failed() {
    fail_then_open(Writeback::Lost, Next::Process, FailedCommit::TakenBack);
}

/// The frame reached the device despite the error: the reopen's zeros, owed since their
/// write failed, take it back there too. The contract would allow the commit back (the
/// next case keeps it); the owed zeros give the process that saw the failure one outcome,
/// and without them the reopen answers `a` as committed.
#[test]
fn a_commit_whose_failed_sync_reached_the_disk_is_taken_back_by_the_reopen() {
    fail_then_open(Writeback::Reached, Next::Reopen, FailedCommit::TakenBack);
}

/// The process ends before its shard reopens, owing the zeros; the next one finds the
/// frame whole on the device and keeps the commit, which the contract allows of a call
/// answered `unavailable`, and builds on it: the log opens after a cut with both.
#[test]
fn the_next_process_keeps_a_commit_whose_failed_sync_reached_the_disk() {
    fail_then_open(Writeback::Reached, Next::Process, FailedCommit::CameBack);
}

/// The device keeps the frame in its volatile cache only: every read returns it, the
/// page cache dropped or not, and a cut loses it. This is the frame the owed zeros are
/// for: read by the reopen, `c`'s commit would chain onto it, and after the cut the log
/// would end where the frame was, with `c`'s frame past that end. The next process
/// cannot tell such a frame from a durable one, since nothing it can read or sync shows
/// the difference, so that case has no test: the zeros are owed only to this process.
#[test]
fn a_commit_whose_failed_sync_left_it_in_the_devices_cache_is_taken_back_by_the_reopen() {
    fail_then_open(Writeback::Cached, Next::Reopen, FailedCommit::TakenBack);
}
