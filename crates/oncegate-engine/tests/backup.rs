//! The online backup (`Engine::backup`): a copy taken under load from 16 writers, after
//! which the original restarts several times and keeps granting. A server started on the
//! copy replays every commit acknowledged before the backup began, grants no completed
//! key again, and grants only tokens above every token the original granted; every shard
//! file of the copy passes SQLite's `integrity_check`.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use oncegate_core::ReserveReply;
use oncegate_engine::{BackupError, Engine, EngineConfig, Faults, ManualClock, ResizeError};

/// Keys completed so far, with their tokens.
type Completed = Arc<Mutex<HashMap<String, u64>>>;

/// Runs `writers` threads granting and committing fresh keys until `stop`; records each
/// acknowledged commit, and returns the highest token granted.
fn write_until(engine: &Engine, writers: usize, stop: &AtomicBool, completed: &Completed) -> u64 {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..writers)
            .map(|w| {
                s.spawn(move || {
                    let mut highest = 0;
                    for i in 0.. {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let name = format!("w{w}-{i}");
                        let reply = engine.reserve_blocking(&tenant(), reserve(&name)).unwrap().reply;
                        let token = granted(&reply);
                        highest = highest.max(token);
                        engine.commit_blocking(&tenant(), commit(&name, token, b"done")).unwrap();
                        completed.lock().unwrap().insert(name, token);
                    }
                    highest
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).max().unwrap_or(0)
    })
}

#[test]
fn a_backup_under_load_restores_every_acknowledged_commit_with_tokens_above_the_original() {
    let clock = ManualClock::new(oncegate_engine::testing::token::FLOOR_ORIGIN_MS + 400 * 86_400_000);
    let faults = Faults::default();
    let dir = tempfile::tempdir().unwrap();
    let (original, copy) = (dir.path().join("original"), dir.path().join("copy"));
    let config = |data: &std::path::Path| EngineConfig { shards: 2, ..config(data) };
    let engine = open(config(&original), &clock, &faults);
    let completed: Completed = Arc::default();
    let stop = AtomicBool::new(false);
    let (before_backup, mut highest, backed_up) = std::thread::scope(|s| {
        let writers = s.spawn(|| write_until(&engine, 16, &stop, &completed));
        // Some commits are acknowledged before the backup begins.
        while completed.lock().unwrap().len() < 200 {
            std::thread::yield_now();
        }
        let before: HashMap<String, u64> = completed.lock().unwrap().clone();
        let mut seen = Vec::new();
        let backed_up = engine.backup(&copy, &mut |done, total| seen.push((done, total))).unwrap();
        assert_eq!(seen.last(), Some(&(2, 2)), "{seen:?}");
        stop.store(true, Ordering::Relaxed);
        (before, writers.join().unwrap(), backed_up)
    });
    assert_eq!(backed_up.shards, 2);
    assert!(backed_up.bytes > 0);
    drop(engine);

    // The original goes on: several restarts, each granting more.
    for restart in 0..4 {
        clock.advance(1);
        let engine = open(config(&original), &clock, &faults);
        for i in 0..20 {
            let name = format!("after-{restart}-{i}");
            highest =
                highest.max(granted(&engine.reserve_blocking(&tenant(), reserve(&name)).unwrap().reply));
        }
        drop(engine);
    }

    for shard in 0..2 {
        let file = oncegate_engine::testing::manifest::shard_file(&copy, shard);
        let check: String = rusqlite::Connection::open(&file)
            .unwrap()
            .query_row("PRAGMA integrity_check", [], |row| row.get(0))
            .unwrap();
        assert_eq!(check, "ok", "{}", file.display());
    }
    clock.advance(1);
    let restored = open(config(&copy), &clock, &faults);
    for (name, token) in &before_backup {
        match restored.reserve_blocking(&tenant(), reserve(name)).unwrap().reply {
            ReserveReply::Completed { token: stored, response, .. } => {
                assert_eq!((stored, response.as_slice()), (*token, &b"done"[..]), "{name}")
            }
            other => panic!("{name}, acknowledged before the backup, is not completed: {other:?}"),
        }
    }
    for i in 0..20 {
        let token =
            granted(&restored.reserve_blocking(&tenant(), reserve(&format!("after-3-{i}"))).unwrap().reply);
        assert!(token > highest, "the copy's token {token}, the original's highest {highest}");
    }
}

#[test]
fn a_backup_goes_to_a_new_directory_only() {
    let clock = ManualClock::new(T0);
    let dir = tempfile::tempdir().unwrap();
    let engine = open(config(&dir.path().join("data")), &clock, &Faults::default());
    let taken = dir.path().join("taken");
    std::fs::create_dir(&taken).unwrap();
    std::fs::write(taken.join("something"), b"x").unwrap();
    let refused = engine.backup(&taken, &mut |_, _| {}).unwrap_err();
    assert!(matches!(refused, BackupError::NotEmpty { .. }), "{refused:?}");
    assert!(refused.to_string().contains("not empty"), "{refused}");
}

/// A backup and an add-shards exclude each other: the slot map must not change while the
/// shards are copied. Each is asked for from inside the other's progress, while it runs.
#[test]
fn a_backup_and_an_add_shards_refuse_each_other() {
    let clock = ManualClock::new(T0);
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig { slot_moves_per_second_max: 0, ..config(&dir.path().join("data")) };
    let faults = Faults::default();
    let engine = open(config, &clock, &faults);
    let mut refused = None;
    engine
        .backup(&dir.path().join("copy"), &mut |copied, _| {
            if copied == 1 {
                refused = Some(engine.add_shards(4, &mut |_, _| {}));
            }
        })
        .unwrap();
    assert!(matches!(refused, Some(Err(ResizeError::Busy { .. }))), "{refused:?}");
    // The mover stops after a few slots (as a crash would): the add's end does not matter.
    faults.stop_moves_after(20);
    let mut refused = None;
    let _ = engine.add_shards(3, &mut |moved, _| {
        if moved == 1 {
            refused = Some(engine.backup(&dir.path().join("copy-2"), &mut |_, _| {}));
        }
    });
    assert!(matches!(refused, Some(Err(BackupError::Busy { .. }))), "{refused:?}");
}
