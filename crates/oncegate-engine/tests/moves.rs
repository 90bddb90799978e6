//! Adding shards to a running engine (`Engine::add_shards`): slots move one at a time
//! while the engine serves, every key answers as before, a race on a key whose slot is
//! moving grants once, a parked waiter follows its key, tokens of moved keys keep
//! increasing, and a move stopped dead at any step restarts into a correct directory.

mod common;

use std::time::Duration;

use common::*;
use oncegate_core::route::slot_of;
use oncegate_core::{ReserveReply, State};
use oncegate_engine::testing::slots::SlotMove;
use oncegate_engine::{Engine, EngineConfig, Faults, ManualClock};

const KEYS: usize = 90;

fn two_shards(dir: &std::path::Path) -> EngineConfig {
    EngineConfig { shards: 2, slot_moves_per_second_max: 0, ..config(dir) }
}

fn add_four(engine: &Engine) -> oncegate_engine::reshard::Resharded {
    engine.add_shards(4, &mut |_, _| {}).expect("shards added")
}

/// A key whose slot is `slot` (found by trying names).
fn key_in_slot(engine: &Engine, slot: u32) -> String {
    (0..)
        .map(|i| format!("slot{slot}-{i}"))
        .find(|name| slot_of(&engine.scope(&tenant(), "live", name).unwrap()) == slot)
        .expect("some name hashes to every slot")
}

/// Waits until each shard stores exactly the keys the map gives it: the sources have
/// deleted the copies of the slots that left them.
fn wait_for_drops(engine: &Engine, written: &Written) {
    let mut expected = vec![0u64; engine.stats().len()];
    for name in written.keys() {
        expected[engine.shard_of(&engine.scope(&tenant(), "live", name).unwrap()) as usize] += 1;
    }
    for (shard, keys) in expected.into_iter().enumerate() {
        let settled = engine.wait_stats(shard as u32, Duration::from_secs(60), |s| {
            s.records_pending + s.records_completed == keys
        });
        assert!(settled, "shard {shard} should store {keys} records: {:?}", engine.stats()[shard]);
    }
}

/// Every key answers as written, none is stored twice, and the slots are spread evenly.
fn check_spread(engine: &Engine, written: &Written) {
    check_keys(engine, written);
    wait_for_drops(engine, written);
    let slots: Vec<u32> = engine.stats().iter().map(|s| s.slots).collect();
    assert_eq!(slots, vec![4_096; 4]);
}

on_own_stores! {
fn adding_shards_online_keeps_every_key_and_spreads_the_slots() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let engine = open(two_shards(dir.path()), &clock, &Faults::default());
    let written = fill_keys(&engine, KEYS);
    let mut seen = Vec::new();
    let added = engine.add_shards(4, &mut |moved, total| seen.push((moved, total))).expect("added");
    assert_eq!((added.shards_before, added.shards_after, added.slots_moved), (2, 4, 8_192));
    assert_eq!(seen.first(), Some(&(0, 8_192)));
    assert_eq!(seen.last(), Some(&(8_192, 8_192)));
    assert!(added.records_moved > 0 && added.records_moved < KEYS as u64, "{added:?}");
    assert_eq!(engine.slot_moving(), None);
    check_spread(&engine, &written);
    assert_eq!(engine.add_shards(4, &mut |_, _| {}).expect("nothing left").slots_moved, 0);
    engine.shutdown();
    drop(engine);
    // The configuration still says 2: the directory opens with the 4 it has now.
    let engine = open(two_shards(dir.path()), &clock, &Faults::default());
    assert_eq!(engine.stats().len(), 4);
    check_spread(&engine, &written);
}
}

/// A new 2-shard engine on a manual clock, with its directory and fault seam.
fn two_shard_engine() -> (tempfile::TempDir, ManualClock, Faults, Engine) {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    let engine = open(two_shards(dir.path()), &clock, &faults);
    (dir, clock, faults, engine)
}

/// Reserves `name` (slot 0 moves first) and releases it: no row keeps its token.
fn grant_and_release(engine: &Engine, name: &str) -> u64 {
    let token = granted(&engine.reserve_blocking(&tenant(), reserve(name)).unwrap().reply);
    engine.release_blocking(&tenant(), key(name, token)).unwrap();
    token
}

/// Waits (without sleeping) until the mover has marked `slot` moving.
fn wait_until_moving(engine: &Engine, slot: u32) -> SlotMove {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(moving) = engine.slot_moving().filter(|m| m.slots.contains(slot)) {
            return moving;
        }
        assert!(std::time::Instant::now() < deadline, "slot {slot} never started moving");
        std::thread::yield_now();
    }
}

on_own_stores! {
/// 64 reserves of one key race while its slot moves: half reach the source before the
/// hand-over, half are held and released to the destination. Exactly one is granted, and
/// its holder commits on the new shard.
fn a_64_way_race_on_a_key_whose_slot_is_moving_grants_once() {
    let (_dir, _clock, faults, engine) = two_shard_engine();
    let name = key_in_slot(&engine, 0);
    let other = key_in_slot(&engine, 2);
    // A read of another key of shard 0 holds its thread at the gate, so the first half of
    // the race queues in its mailbox ahead of the hand-over.
    faults.close_gate();
    let holding = engine.get(&tenant(), key(&other, 0));
    faults.wait_held(1);
    let mut racers: Vec<_> = (0..32).map(|_| engine.reserve(&tenant(), reserve(&name))).collect();
    let mover = {
        let engine = engine.clone();
        std::thread::spawn(move || engine.add_shards(4, &mut |_, _| {}))
    };
    let moving = wait_until_moving(&engine, 0);
    assert_eq!((moving.from, moving.to), (0, 2));
    racers.extend((0..32).map(|_| engine.reserve(&tenant(), reserve(&name))));
    faults.open_gate();
    let replies: Vec<ReserveReply> = block_on(async {
        let _ = holding.await;
        let mut replies = Vec::new();
        for racer in racers {
            replies.push(racer.await.expect("answered").reply);
        }
        replies
    });
    let grants: Vec<u64> = replies
        .iter()
        .filter_map(|r| match r {
            ReserveReply::Granted { token, .. } => Some(*token),
            _ => None,
        })
        .collect();
    assert_eq!(grants.len(), 1, "exactly one grant: {replies:?}");
    assert!(
        replies.iter().all(|r| matches!(r, ReserveReply::Granted { .. } | ReserveReply::InProgress { .. }))
    );
    mover.join().unwrap().expect("shards added");
    let scope = engine.scope(&tenant(), "live", &name).unwrap();
    assert_eq!(engine.shard_of(&scope), 2);
    engine.commit_blocking(&tenant(), commit(&name, grants[0], b"once")).expect("the holder commits");
    let view = engine.get_blocking(&tenant(), key(&name, 0)).unwrap();
    assert_eq!((view.state, view.token), (State::Completed, grants[0]));
}
}

on_own_stores! {
/// A reserve parked behind a holder when its slot moves follows the key: the holder's
/// commit on the new shard answers it with the replay.
fn a_waiter_parked_on_a_moving_slot_gets_its_answer() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let engine = open(two_shards(dir.path()), &clock, &Faults::default());
    let name = key_in_slot(&engine, 1);
    let token =
        granted(&engine.reserve_blocking(&tenant(), reserve_for(&name, 600_000, 0, 0)).unwrap().reply);
    let waiter = engine.reserve(&tenant(), reserve_for(&name, 600_000, 0, 10_000));
    assert!(engine.wait_stats(1, Duration::from_secs(10), |s| s.waiters == 1), "the reserve parks");
    add_four(&engine);
    let destination = engine.shard_of(&engine.scope(&tenant(), "live", &name).unwrap());
    assert_ne!(destination, 1, "slot 1 moved");
    // The parked reserve reaches its new shard behind the move's end, on its mailbox.
    let moved = engine.wait_stats(destination, Duration::from_secs(10), |s| s.waiters == 1);
    assert!(moved, "the waiter moved with its key");
    assert_eq!(engine.stats()[1].waiters, 0);
    engine.commit_blocking(&tenant(), commit(&name, token, b"done")).unwrap();
    match block_on(waiter).expect("answered").reply {
        ReserveReply::Completed { token: replayed, response, .. } => {
            assert_eq!((replayed, response.as_slice()), (token, &b"done"[..]));
        }
        other => panic!("expected the replay, got {other:?}"),
    }
}
}

on_own_stores! {
/// A waiter that moved with its slot is dropped at once when its caller goes, as on the
/// shard it parked on: the caller's nudge went to that shard only, and the moved waiter
/// stayed parked and counted until its deadline (never granted).
fn a_moved_waiter_whose_caller_goes_is_dropped_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let engine = open(two_shards(dir.path()), &clock, &Faults::default());
    let name = key_in_slot(&engine, 1);
    granted(&engine.reserve_blocking(&tenant(), reserve_for(&name, 600_000, 0, 0)).unwrap().reply);
    let waiter = engine.reserve(&tenant(), reserve_for(&name, 600_000, 0, 20_000));
    assert!(engine.wait_stats(1, Duration::from_secs(10), |s| s.waiters == 1), "the reserve parks");
    add_four(&engine);
    let destination = engine.shard_of(&engine.scope(&tenant(), "live", &name).unwrap());
    assert!(engine.wait_stats(destination, Duration::from_secs(10), |s| s.waiters == 1), "it moved");
    drop(waiter);
    let dropped = engine.wait_stats(destination, Duration::from_secs(10), |s| s.waiters == 0);
    assert!(dropped, "the moved waiter is dropped with its caller: {:?}", engine.stats()[destination as usize]);
}
}

on_own_stores! {
/// An add-shards stopped dead after each durable step of its first two moves (the slot
/// handed over, copied, the map flipped), as a crash there would leave the files: the
/// directory reopens with every key answered as before, a released key of a moving slot
/// is granted above its last token, and running add-shards again finishes the spread.
fn a_move_stopped_dead_at_any_step_reopens_with_every_key_as_before() {
    for steps in 1..=6 {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let faults = Faults::default();
        let engine = open(two_shards(dir.path()), &clock, &faults);
        let written = fill_keys(&engine, KEYS);
        let released = [key_in_slot(&engine, 0), key_in_slot(&engine, 1)];
        let last = released.each_ref().map(|name| grant_and_release(&engine, name));
        faults.stop_moves_after(steps);
        let stopped = engine.add_shards(4, &mut |_, _| {}).expect_err("stopped");
        assert!(stopped.to_string().contains("injected"), "{stopped}");
        if engine.slot_moving().is_some() {
            // Left mid-move (as a crash would): no second add may take the slot over.
            let again = engine.add_shards(4, &mut |_, _| {}).expect_err("refused until a restart");
            assert!(again.to_string().contains("restart the server"), "{again}");
        }
        engine.shutdown();
        drop(engine);
        let engine = open(two_shards(dir.path()), &clock, &Faults::default());
        check_keys(&engine, &written);
        for (name, last) in released.iter().zip(last) {
            let next = granted(&engine.reserve_blocking(&tenant(), reserve(name)).unwrap().reply);
            assert!(next > last, "step {steps}: {name} granted {next} after {last}");
        }
        if steps == 6 {
            let mut written = written;
            for name in &released {
                let view = engine.get_blocking(&tenant(), key(name, 0)).unwrap();
                engine.commit_blocking(&tenant(), commit(name, view.token, name.as_bytes())).unwrap();
                written.insert(name.clone(), (view.token, true));
            }
            add_four(&engine);
            check_spread(&engine, &written);
        }
    }
}
}

on_own_stores! {
/// A move stopped dead after the destination's copy, before the map flip: the reserve
/// that waited on the moving key is never granted by the destination (which the map does
/// not name), even once the holder's lease has run out there. The next reserve, on the
/// source, is granted above the holder's token.
fn a_waiter_of_a_move_stopped_before_its_flip_is_never_granted_by_the_destination() {
    let (dir, clock, faults, engine) = two_shard_engine();
    let name = key_in_slot(&engine, 0);
    let holder = granted(&engine.reserve_blocking(&tenant(), reserve_for(&name, 1_000, 0, 0)).unwrap().reply);
    let waiter = engine.reserve(&tenant(), reserve_for(&name, 60_000, 0, 10_000));
    assert!(engine.wait_stats(0, Duration::from_secs(10), |s| s.waiters == 1), "the reserve parks");
    faults.stop_moves_after(2);
    engine.add_shards(4, &mut |_, _| {}).expect_err("stopped after the copy");
    clock.advance(2_000);
    engine.run_alarms();
    let answer = block_on(waiter);
    assert!(
        !matches!(&answer, Ok(r) if matches!(r.reply, ReserveReply::Granted { .. })),
        "granted by a shard the map does not name: {answer:?}"
    );
    engine.shutdown();
    drop(engine);
    let engine = open(two_shards(dir.path()), &clock, &Faults::default());
    let next = granted(&engine.reserve_blocking(&tenant(), reserve(&name)).unwrap().reply);
    assert!(next > holder);
}
}

on_own_stores! {
/// A move that fails after the hand-over (stopped there) gives the slot back to its
/// source with its parked reserve, which the holder's commit then answers.
fn a_waiter_of_a_move_that_fails_goes_back_to_its_source() {
    let (_dir, _clock, faults, engine) = two_shard_engine();
    let name = key_in_slot(&engine, 0);
    let token =
        granted(&engine.reserve_blocking(&tenant(), reserve_for(&name, 600_000, 0, 0)).unwrap().reply);
    let waiter = engine.reserve(&tenant(), reserve_for(&name, 600_000, 0, 10_000));
    assert!(engine.wait_stats(0, Duration::from_secs(10), |s| s.waiters == 1), "the reserve parks");
    faults.stop_moves_after(1);
    engine.add_shards(4, &mut |_, _| {}).expect_err("stopped after the hand-over");
    assert_eq!(engine.slot_moving(), None, "the move was undone");
    assert_eq!(engine.shard_of(&engine.scope(&tenant(), "live", &name).unwrap()), 0);
    assert!(engine.wait_stats(0, Duration::from_secs(10), |s| s.waiters == 1), "back on its source");
    engine.commit_blocking(&tenant(), commit(&name, token, b"done")).unwrap();
    match block_on(waiter).expect("answered").reply {
        ReserveReply::Completed { token: replayed, .. } => assert_eq!(replayed, token),
        other => panic!("expected the replay, got {other:?}"),
    }
    add_four(&engine);
}
}

/// The operating system's files, except that the next `failing` renames onto the slot
/// map file fail (before renaming): a map flip, and then its undo, that cannot be written.
#[derive(Debug, Default)]
struct MapWritesFail {
    failing: std::sync::atomic::AtomicU32,
}

impl MapWritesFail {
    fn fail(&self, n: u32) {
        self.failing.store(n, std::sync::atomic::Ordering::SeqCst);
    }
}

impl oncegate_engine::files::Files for MapWritesFail {
    fn create_dir_all(&self, dir: &std::path::Path) -> std::io::Result<()> {
        oncegate_engine::files::OsFiles.create_dir_all(dir)
    }
    fn read(&self, path: &std::path::Path) -> std::io::Result<Vec<u8>> {
        oncegate_engine::files::OsFiles.read(path)
    }
    fn write_new(&self, path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
        oncegate_engine::files::OsFiles.write_new(path, bytes)
    }
    fn create(&self, path: &std::path::Path) -> std::io::Result<bool> {
        oncegate_engine::files::OsFiles.create(path)
    }
    fn sync_file(&self, path: &std::path::Path) -> std::io::Result<()> {
        oncegate_engine::files::OsFiles.sync_file(path)
    }
    fn rename(&self, from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
        let is_map = to.file_name().is_some_and(|name| name == oncegate_engine::testing::slots::SLOTS_FILE);
        let failing = &self.failing;
        let fail = is_map
            && failing
                .fetch_update(std::sync::atomic::Ordering::SeqCst, std::sync::atomic::Ordering::SeqCst, |n| {
                    n.checked_sub(1)
                })
                .is_ok();
        if fail {
            return Err(std::io::Error::other("injected: the slot map cannot be renamed"));
        }
        oncegate_engine::files::OsFiles.rename(from, to)
    }
    fn remove(&self, path: &std::path::Path) -> std::io::Result<()> {
        oncegate_engine::files::OsFiles.remove(path)
    }
    fn sync_dir(&self, dir: &std::path::Path) -> std::io::Result<()> {
        oncegate_engine::files::OsFiles.sync_dir(dir)
    }
    fn list(&self, dir: &std::path::Path) -> std::io::Result<Vec<String>> {
        oncegate_engine::files::OsFiles.list(dir)
    }
    fn lock(&self, path: &std::path::Path) -> std::io::Result<Option<oncegate_engine::files::LockGuard>> {
        oncegate_engine::files::OsFiles.lock(path)
    }
    fn drop_cached(&self, path: &std::path::Path) -> std::io::Result<()> {
        oncegate_engine::files::OsFiles.drop_cached(path)
    }
    fn restrict(&self, path: &std::path::Path) -> std::io::Result<()> {
        oncegate_engine::files::OsFiles.restrict(path)
    }
}

fn open_on(dir: &std::path::Path, clock: &ManualClock, files: &std::sync::Arc<MapWritesFail>) -> Engine {
    let files: std::sync::Arc<dyn oncegate_engine::files::Files> = files.clone();
    Engine::open_on(two_shards(dir), std::sync::Arc::new(clock.clone()), Faults::default(), files)
        .expect("engine opens")
}

on_own_stores! {
/// A flip that fails after the destination's copy is undone: the slot stays on its
/// source with its parked reserve, the destination drops its copies, and the next add
/// moves the slot again over those copies without storing any key twice.
fn a_failed_flip_is_undone_and_the_next_add_moves_the_slot_again() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let files = std::sync::Arc::new(MapWritesFail::default());
    let engine = open_on(dir.path(), &clock, &files);
    let mut written = fill_keys(&engine, KEYS);
    let name = key_in_slot(&engine, 0);
    let token =
        granted(&engine.reserve_blocking(&tenant(), reserve_for(&name, 600_000, 0, 0)).unwrap().reply);
    let waiter = engine.reserve(&tenant(), reserve_for(&name, 600_000, 0, 10_000));
    assert!(engine.wait_stats(0, Duration::from_secs(10), |s| s.waiters == 1), "the reserve parks");
    files.fail(1);
    let failed = engine.add_shards(4, &mut |_, _| {}).expect_err("the flip fails");
    assert!(failed.to_string().contains("cannot be renamed"), "{failed}");
    assert_eq!(engine.slot_moving(), None, "undone");
    assert_eq!(engine.shard_of(&engine.scope(&tenant(), "live", &name).unwrap()), 0);
    assert!(engine.wait_stats(0, Duration::from_secs(10), |s| s.waiters == 1), "back on its source");
    add_four(&engine);
    engine.commit_blocking(&tenant(), commit(&name, token, name.as_bytes())).unwrap();
    assert!(matches!(block_on(waiter).expect("answered").reply, ReserveReply::Completed { .. }));
    written.insert(name, (token, true));
    check_spread(&engine, &written);
}
}

on_own_stores! {
/// A flip that fails and whose undo fails too leaves the slot answering `unavailable`
/// (neither shard may decide it) and refuses further adds until a restart, which reads
/// the map from disk and answers every key as before.
fn a_flip_that_cannot_be_undone_stops_the_slot_until_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let files = std::sync::Arc::new(MapWritesFail::default());
    let engine = open_on(dir.path(), &clock, &files);
    let written = fill_keys(&engine, KEYS);
    let name = key_in_slot(&engine, 0);
    files.fail(2);
    engine.add_shards(4, &mut |_, _| {}).expect_err("the flip fails");
    let refused = engine.get_blocking(&tenant(), key(&name, 0)).expect_err("the slot is stopped");
    assert!(matches!(refused, oncegate_engine::Error::Unavailable { .. }), "{refused:?}");
    let again = engine.add_shards(4, &mut |_, _| {}).expect_err("refused until a restart");
    assert!(again.to_string().contains("restart the server"), "{again}");
    engine.shutdown();
    drop(engine);
    let engine = open(two_shards(dir.path()), &clock, &Faults::default());
    check_keys(&engine, &written);
    add_four(&engine);
    check_spread(&engine, &written);
}
}

/// A 2-shard directory whose key `name` (slot 0, committed) was copied to shard 2 by a
/// move stopped before its flip, as a crash there would leave it; the engine is closed.
fn a_copy_left_by_a_stopped_move() -> (tempfile::TempDir, ManualClock, Faults, String) {
    let (dir, clock, faults, engine) = two_shard_engine();
    let name = key_in_slot(&engine, 0);
    let token = granted(&engine.reserve_blocking(&tenant(), reserve(&name)).unwrap().reply);
    engine.commit_blocking(&tenant(), commit(&name, token, b"old")).unwrap();
    faults.stop_moves_after(2);
    engine.add_shards(4, &mut |_, _| {}).expect_err("stopped after the copy");
    engine.shutdown();
    drop(engine);
    (dir, clock, faults, name)
}

on_own_stores! {
/// A copy left on the destination by a move stopped before its flip, in a process whose
/// destination first opens while the move runs again (its earlier open failed): the
/// copy is stale (the key was purged at its source meanwhile) and the move replaces it,
/// so the purged key does not come back.
fn a_stale_copy_kept_by_an_open_during_the_move_is_replaced() {
    let (dir, clock, faults, name) = a_copy_left_by_a_stopped_move();
    // Every shard fails its first open in the next process (before it looks at its rows);
    // all but shard 2, slot 0's destination, are reopened at once.
    faults.fail_opens(4);
    let engine = open(two_shards(dir.path()), &clock, &faults);
    for shard in [0, 1, 3] {
        assert!(engine.reopen_shard(shard).unwrap(), "shard {shard} opens");
    }
    assert_ne!(engine.shard_states()[2], oncegate_engine::ShardState::Serving);
    let scope = engine.scope(&tenant(), "live", &name).unwrap();
    block_on(engine.purge(scope)).expect("purged at its source");
    // Shard 0 is held at the gate while the move of slot 0 waits for its hand-over; shard
    // 2 opens now, as the move's destination.
    faults.close_gate();
    let holding = engine.get(&tenant(), key(&key_in_slot(&engine, 2), 0));
    faults.wait_held(1);
    let mover = {
        let engine = engine.clone();
        std::thread::spawn(move || engine.add_shards(4, &mut |_, _| {}))
    };
    wait_until_moving(&engine, 0);
    assert!(engine.reopen_shard(2).unwrap(), "shard 2 opens");
    faults.open_gate();
    let _ = block_on(holding);
    mover.join().unwrap().expect("shards added");
    let view = engine.get_blocking(&tenant(), key(&name, 0)).unwrap();
    assert_eq!(view.state, oncegate_core::State::Free, "the purged key stays purged: {view:?}");
}
}

on_own_stores! {
/// A slot whose records do not fit in the destination's file fails its move alone: the
/// destination keeps serving, the slot stays on its source, and every key answers.
fn a_slot_that_does_not_fit_its_destination_stays_on_its_source() {
    let (_dir, _clock, faults, engine) = two_shard_engine();
    let name = key_in_slot(&engine, 0);
    let token = granted(&engine.reserve_blocking(&tenant(), reserve(&name)).unwrap().reply);
    // Far more than the new shards' files may hold (the limit applies to files opened
    // from now on: the new shards').
    engine.commit_blocking(&tenant(), commit(&name, token, &vec![7u8; 60_000])).unwrap();
    faults.limit_pages(16);
    let failed = engine.add_shards(4, &mut |_, _| {}).expect_err("slot 0 does not fit");
    assert!(failed.to_string().contains("shard_file_bytes_max"), "{failed}");
    assert_eq!(engine.shard_states()[2], oncegate_engine::ShardState::Serving, "the destination serves on");
    assert_eq!(engine.slot_moving(), None);
    assert_eq!(engine.shard_of(&engine.scope(&tenant(), "live", &name).unwrap()), 0);
    let view = engine.get_blocking(&tenant(), key(&name, 0)).unwrap();
    assert_eq!(
        (view.state, view.token, view.response.len()),
        (oncegate_core::State::Completed, token, 60_000)
    );
}
}

on_own_stores! {
/// A copy left on the destination by a move stopped before its flip is deleted when the
/// destination next opens (the map does not give it the slot): after its key is purged
/// at the source and the slot moves there for good, the purged key does not come back,
/// not even after another restart.
fn a_copy_left_by_a_move_cut_short_never_comes_back() {
    let (dir, clock, _faults, name) = a_copy_left_by_a_stopped_move();
    let engine = open(two_shards(dir.path()), &clock, &Faults::default());
    let scope = engine.scope(&tenant(), "live", &name).unwrap();
    block_on(engine.purge(scope)).expect("purged at its source");
    add_four(&engine);
    let view = engine.get_blocking(&tenant(), key(&name, 0)).unwrap();
    assert_eq!(view.state, State::Free, "the purged key stays purged: {view:?}");
    engine.shutdown();
    drop(engine);
    let engine = open(two_shards(dir.path()), &clock, &Faults::default());
    let view = engine.get_blocking(&tenant(), key(&name, 0)).unwrap();
    assert_eq!(view.state, State::Free, "the purged key stays purged after a restart: {view:?}");
}
}

/// A key on `shard` (found by trying names with `prefix`).
fn key_on_shard(engine: &Engine, shard: u32, prefix: &str) -> String {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|name| engine.shard_of(&engine.scope(&tenant(), "live", name).unwrap()) == shard)
        .expect("some name routes to every shard")
}

/// Two shards whose persisted marks are 100 s apart, opened after the wall clock was
/// stepped back 100 s while the engine was stopped: shard 0 failed 100 s after its open
/// (so its mark is its open's, as after a crash), shard 1 recorded its clean stop.
/// Returns the engine, the clock and the directory.
fn shards_with_marks_apart() -> (Engine, ManualClock, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    let engine = open(two_shards(dir.path()), &clock, &faults);
    clock.advance(100_000);
    faults.fail_commits(1);
    let on_zero = key_on_shard(&engine, 0, "before");
    engine.reserve_blocking(&tenant(), reserve(&on_zero)).expect_err("shard 0 fails");
    engine.shutdown();
    drop(engine);
    clock.step(-100_000);
    let engine = open(two_shards(dir.path()), &clock, &Faults::default());
    (engine, clock, dir)
}

fn lease_until_ms(reply: &ReserveReply) -> u64 {
    match reply {
        ReserveReply::Granted { lease_until_ms, .. } => *lease_until_ms,
        other => panic!("expected a grant, got {other:?}"),
    }
}

on_own_stores! {
/// Shards opened together keep one time, whatever marks they persisted: each used to lift
/// only itself to its own mark, and two shards then ran 100 s apart for the whole process.
fn shards_opened_together_keep_one_time_after_a_step_back_while_stopped() {
    let (engine, _clock, _dir) = shards_with_marks_apart();
    let t = tenant();
    let zero = engine.reserve_blocking(&t, reserve(&key_on_shard(&engine, 0, "after"))).unwrap().reply;
    let one = engine.reserve_blocking(&t, reserve(&key_on_shard(&engine, 1, "after"))).unwrap().reply;
    assert_eq!(lease_until_ms(&zero), lease_until_ms(&one), "leases granted together end together");
}
}

on_own_stores! {
/// A slot moved from a shard whose time was ahead lifted the destination's clock by the
/// gap, and every lease the destination already held lost that much: here all of it,
/// and a second caller was granted a key whose holder was inside its lease. No time
/// passes in this test, so every lease granted in it must still be held at its end.
fn a_move_never_shortens_the_destination_s_leases() {
    let (engine, _clock, _dir) = shards_with_marks_apart();
    let t = tenant();
    let mut held = Vec::new();
    engine
        .add_shards(3, &mut |moved, _| {
            // After the first move, and again later, a key on the new shard 2 is granted
            // while slots from both old shards go on moving into it.
            if moved == 1 || moved == 4_000 {
                let name = key_on_shard(&engine, 2, &format!("new-{moved}"));
                granted(&engine.reserve_blocking(&t, reserve(&name)).unwrap().reply);
                held.push(name);
            }
        })
        .expect("shards added");
    assert_eq!(held.len(), 2);
    for name in &held {
        let again = engine.reserve_blocking(&t, reserve(name)).unwrap().reply;
        assert!(matches!(again, ReserveReply::InProgress { .. }), "{name} is still held: {again:?}");
    }
}
}
