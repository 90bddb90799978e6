//! Adding shards to a stopped directory (`reshard::add_shards`, the online mover in an
//! engine that serves nobody): every key answered as before on its new shard, holders
//! keep their leases and tokens, the next grant of a moved key is above every earlier
//! token, and a reshard cut short after any durable step leaves a directory that opens
//! correctly and finishes when run again.

mod common;

use std::sync::Arc;

use common::*;
use oncegate_core::ReserveReply;
use oncegate_engine::files::OsFiles;
use oncegate_engine::reshard::{Resharded, add_shards, add_shards_on};
use oncegate_engine::{Engine, EngineConfig, Faults, LayoutError, ManualClock, OpenError, ResizeError};

const KEYS: usize = 120;

fn fill(dir: &std::path::Path, clock: &ManualClock) -> Written {
    let engine = open(EngineConfig { shards: 2, ..config(dir) }, clock, &Faults::default());
    let written = fill_keys(&engine, KEYS);
    engine.shutdown();
    written
}

/// Every key reads as written, and each is stored once.
fn check(engine: &Engine, written: &Written) {
    check_keys(engine, written);
    assert_eq!(stored(engine), written.len() as u64, "no key lost, none stored twice");
}

fn open_four(dir: &std::path::Path, clock: &ManualClock) -> Engine {
    open(EngineConfig { shards: 4, ..config(dir) }, clock, &Faults::default())
}

/// The offline reshard of `dir` to `to` shards on the test's clock, stopped as `faults`
/// say.
fn reshard(
    dir: &std::path::Path,
    to: u32,
    clock: &ManualClock,
    faults: &Faults,
) -> Result<Resharded, ResizeError> {
    add_shards_on(&config(dir), to, Arc::new(clock.clone()), Arc::new(OsFiles), faults, &mut |_, _| {})
}

on_own_stores! {
/// A stopped directory gains shards offline.
fn adding_shards_spreads_the_slots_and_keeps_every_key_where_the_map_says() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let written = fill(dir.path(), &clock);
    let mut seen = Vec::new();
    let progress = &mut |moved, total| seen.push((moved, total));
    let (clock_arc, files) = (Arc::new(clock.clone()), Arc::new(OsFiles));
    let done = add_shards_on(&config(dir.path()), 4, clock_arc, files, &Faults::default(), progress).unwrap();
    assert_eq!((done.shards_before, done.shards_after, done.slots_moved), (2, 4, 8_192), "{done:?}");
    assert!(done.records_moved > 0 && done.records_moved < KEYS as u64, "{done:?}");
    assert_eq!(seen.last(), Some(&(8_192, 8_192)));
    let engine = open_four(dir.path(), &clock);
    assert_eq!(engine.stats().iter().map(|s| s.slots).collect::<Vec<_>>(), vec![4_096; 4]);
    check(&engine, &written);
    for (name, (token, committed)) in &written {
        if *committed {
            continue;
        }
        // The holder's token still commits on the key's new shard ...
        engine.commit_blocking(&tenant(), commit(name, *token, b"late")).unwrap();
        // ... and a new attempt after the key is gone gets a greater token.
        block_on(engine.purge(engine.scope(&tenant(), "live", name).unwrap())).unwrap();
        let next = granted(&engine.reserve_blocking(&tenant(), reserve(name)).unwrap().reply);
        assert!(next > *token, "{name}: {next} after {token}");
    }
    drop(engine);
    // Nothing left to do at the same count.
    let again = reshard(dir.path(), 4, &clock, &Faults::default()).unwrap();
    assert_eq!(again.slots_moved, 0);
}
}

#[test]
fn a_reshard_cut_after_any_step_opens_correctly_and_finishes_when_run_again() {
    // 2 to 4 shards is 32 moves of 256 slots, each three durable steps (handed over,
    // copied, the map flipped): cuts in the first moves, at each step, and in the last.
    for cut in [1, 2, 3, 4, 5, 6, 50, 94, 95, 96] {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let written = fill(dir.path(), &clock);
        let faults = Faults::default();
        faults.stop_moves_after(cut);
        let stopped = reshard(dir.path(), 4, &clock, &faults);
        assert!(stopped.is_err(), "cut {cut}: the injected stop");
        let engine = open_four(dir.path(), &clock);
        check(&engine, &written);
        drop(engine);
        let done: Resharded = reshard(dir.path(), 4, &clock, &Faults::default()).unwrap();
        // From the first flip of the map on, what moved stays moved.
        assert_eq!(done.slots_moved < 8_192, cut >= 3, "cut {cut}: resumed, not restarted: {done:?}");
        let engine = open_four(dir.path(), &clock);
        assert_eq!(engine.stats().iter().map(|s| s.slots).collect::<Vec<_>>(), vec![4_096; 4], "cut {cut}");
        check(&engine, &written);
        let fresh = engine.reserve_blocking(&tenant(), reserve("fresh")).unwrap().reply;
        assert!(matches!(fresh, ReserveReply::Granted { .. }));
    }
}

#[test]
fn more_shards_than_the_directory_has_are_refused_with_how_to_add_them() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    fill(dir.path(), &clock);
    let refused = Engine::open_with(
        EngineConfig { shards: 4, ..config(dir.path()) },
        Arc::new(clock.clone()),
        Faults::default(),
    )
    .expect_err("refused");
    assert!(
        matches!(refused, OpenError::Layout(LayoutError::ShardCount { found: 2, configured: 4, .. })),
        "{refused:?}"
    );
    assert!(refused.to_string().contains("oncegate reshard"), "{refused}");
    let fewer = reshard(dir.path(), 1, &clock, &Faults::default()).expect_err("refused");
    assert!(fewer.to_string().contains("never removed"), "{fewer}");
}

/// A reshard stopped after the manifest took the new count, a server run meanwhile whose
/// old shard's token epoch rose past the new shards' (reopens), and a key of a moving slot
/// granted and released there (so no row carries its token): when the reshard finishes,
/// the key's next grant on its new shard is still above its last token.
#[test]
fn a_moved_key_without_a_row_is_granted_above_its_last_token() {
    use oncegate_core::route::slot_of;
    use oncegate_engine::testing::slots::SlotMap;
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    fill(dir.path(), &clock);
    let faults = Faults::default();
    faults.stop_moves_after(1);
    assert!(reshard(dir.path(), 4, &clock, &faults).is_err());
    let moving: std::collections::HashSet<u32> = SlotMap::even(2)
        .moves_to_spread(4)
        .into_iter()
        .filter(|(_, from, _)| *from == 0)
        .map(|m| m.0)
        .collect();
    let engine = open_four(dir.path(), &clock);
    let name = (0..)
        .map(|i| format!("moving-{i}"))
        .find(|name| moving.contains(&slot_of(&engine.scope(&tenant(), "live", name).unwrap())))
        .unwrap();
    for _ in 0..3 {
        assert!(engine.reopen_shard(0).unwrap(), "the old shard reopens, raising its epoch");
    }
    let last = granted(&engine.reserve_blocking(&tenant(), reserve(&name)).unwrap().reply);
    engine.release_blocking(&tenant(), key(&name, last)).unwrap();
    drop(engine);
    reshard(dir.path(), 4, &clock, &Faults::default()).unwrap();
    let engine = open_four(dir.path(), &clock);
    let next = granted(&engine.reserve_blocking(&tenant(), reserve(&name)).unwrap().reply);
    assert!(next > last, "{name}: token {next} after {last}");
}

/// An offline reshard told the wrong store (PostgreSQL, on a SQLite directory) is refused
/// before it touches anything: the map would move slots whose records it cannot see.
#[test]
fn a_reshard_under_the_other_store_is_refused_before_anything_changes() {
    use oncegate_engine::{PostgresConfig, StoreConfig};
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let sqlite = EngineConfig { shards: 2, ..config(dir.path()) };
    let engine = open(sqlite.clone(), &clock, &Faults::default());
    let written = fill_keys(&engine, 30);
    engine.shutdown();
    drop(engine);
    let store = StoreConfig::Postgres(PostgresConfig {
        postgres_url: "postgres://db/x".into(),
        ..PostgresConfig::default()
    });
    let refused =
        add_shards(&EngineConfig { store, ..sqlite.clone() }, 4, &mut |_, _| {}).expect_err("refused");
    assert!(
        matches!(refused, ResizeError::Layout(LayoutError::OtherStore { found: "sqlite", .. })),
        "{refused:?}"
    );
    let engine = open(sqlite, &clock, &Faults::default());
    assert_eq!(engine.stats().len(), 2, "no shard was added");
    check(&engine, &written);
}

/// A reshard of a PostgreSQL node's directory says why there is nothing to move (its
/// shards share one table), rather than that the directory has no manifest or holds
/// another store's records, whichever kind the command was told.
#[test]
fn a_reshard_of_a_postgresql_node_s_directory_says_why_it_cannot_be() {
    use oncegate_engine::{PostgresConfig, StoreConfig};
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(oncegate_engine::testing::manifest::NODE_FILE), "node-1\n").unwrap();
    let store = StoreConfig::Postgres(PostgresConfig {
        postgres_url: "postgres://db/x".into(),
        ..PostgresConfig::default()
    });
    let refused =
        add_shards(&EngineConfig { store, ..config(dir.path()) }, 4, &mut |_, _| {}).expect_err("refused");
    assert!(matches!(refused, ResizeError::Unsupported { .. }), "{refused:?}");
    let sqlite = StoreConfig::default();
    let told_sqlite = add_shards(&EngineConfig { store: sqlite, ..config(dir.path()) }, 4, &mut |_, _| {})
        .expect_err("refused");
    assert!(matches!(told_sqlite, ResizeError::Unsupported { .. }), "{told_sqlite:?}");
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(!names.iter().any(|n| n.to_string_lossy().starts_with("shard-")), "no shard created: {names:?}");
}

/// `oncegate reshard` runs on a clock that stands at the directory's last mark: however
/// long it takes (here, the real clock is years past the test's), no lease ends and
/// nothing expires during it, and the marks stay as the stop left them, so the next start
/// gives leases their restart grace. It deletes the moved copies before it closes, so the
/// next open has none to delete.
#[test]
fn a_reshard_takes_no_time_from_leases_and_leaves_no_copies() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let written = fill(dir.path(), &clock);
    let done = add_shards(&config(dir.path()), 4, &mut |_, _| {}).unwrap();
    assert_eq!(done.slots_moved, 8_192);
    let rows: u64 = (0..4)
        .map(|shard| {
            let path = oncegate_engine::testing::manifest::shard_file(dir.path(), shard);
            let conn = rusqlite::Connection::open(path).unwrap();
            conn.query_row("SELECT count(*) FROM records", [], |row| row.get::<_, u64>(0)).unwrap()
        })
        .sum();
    assert_eq!(rows, written.len() as u64, "each key's one row, the moved copies deleted");
    let engine = open_four(dir.path(), &clock);
    check(&engine, &written);
}
