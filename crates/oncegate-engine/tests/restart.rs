//! What must survive a reopen: records, the token counter, the clock high-water mark,
//! and the restart grace that keeps downtime from ending leases.

mod common;

use common::*;
use oncegate_core::{ReserveReply, State};
use oncegate_engine::{EngineConfig, Faults, ManualClock, PostgresConfig, StoreConfig, StoreKind};

#[test]
fn restart_grace_extends_leases_that_were_live_at_the_stop() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    let config = EngineConfig { lease_restart_grace_ms: 2_000, ..config(dir.path()) };
    let t = tenant();
    let engine = open(config.clone(), &clock, &faults);
    let live = granted(&engine.reserve_blocking(&t, reserve_for("live", 1_000, 60_000, 0)).unwrap().reply);
    let gone = granted(&engine.reserve_blocking(&t, reserve_for("gone", 100, 60_000, 0)).unwrap().reply);
    clock.advance(500);
    // "gone" ran out before the stop; the shards observe T0 + 500 on this read.
    assert_eq!(engine.get_blocking(&t, key("gone", 0)).unwrap().state, State::Abandoned);
    assert_eq!(engine.get_blocking(&t, key("live", 0)).unwrap().state, State::Pending);
    drop(engine);

    // Down for 5 s, far longer than the 1 s lease.
    clock.advance(5_000);
    let engine = open(config, &clock, &faults);
    let view = engine.get_blocking(&t, key("live", 0)).unwrap();
    assert_eq!((view.state, view.token, view.lease_until_ms), (State::Pending, live, T0 + 5_500 + 2_000));
    let view = engine.get_blocking(&t, key("gone", 0)).unwrap();
    assert_eq!((view.state, view.token), (State::Abandoned, gone), "a lease over before the stop stays over");
    // The holder can still heartbeat and commit.
    engine.heartbeat_blocking(&t, key("live", live)).unwrap();
    engine.commit_blocking(&t, commit("live", live, b"ok")).unwrap();
}

#[test]
fn a_clock_stepped_back_across_a_restart_resurrects_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    let t = tenant();
    let engine = open(config(dir.path()), &clock, &faults);
    let token = granted(&engine.reserve_blocking(&t, reserve_for("k", 1_000, 2_000, 0)).unwrap().reply);
    engine.commit_blocking(&t, commit("k", token, b"r")).unwrap();
    clock.advance(3_600_000);
    assert_eq!(engine.get_blocking(&t, key("k", 0)).unwrap().state, State::Free);
    drop(engine);

    // The wall clock steps back one hour, to before the record expired.
    clock.step(-3_600_000);
    let engine = open(config(dir.path()), &clock, &faults);
    assert_eq!(engine.get_blocking(&t, key("k", 0)).unwrap().state, State::Free, "expired stays expired");
    let again = granted(&engine.reserve_blocking(&t, reserve("k")).unwrap().reply);
    assert!(again > token, "the token counter survived: {again} > {token}");
}

#[test]
fn a_clock_stepped_back_while_running_never_lengthens_a_lease() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let engine = open(EngineConfig { shards: 1, ..config(dir.path()) }, &clock, &Faults::default());
    let t = tenant();
    granted(&engine.reserve_blocking(&t, reserve_for("k", 1_000, 60_000, 0)).unwrap().reply);
    clock.advance(1_000);
    assert_eq!(engine.get_blocking(&t, key("k", 0)).unwrap().state, State::Abandoned);
    clock.step(-1_000);
    assert_eq!(
        engine.get_blocking(&t, key("k", 0)).unwrap().state,
        State::Abandoned,
        "time does not run back"
    );
    let r = engine.reserve_blocking(&t, reserve("k")).unwrap().reply;
    assert!(matches!(r, ReserveReply::Granted { attempt: 2, .. }), "{r:?}");
}

#[test]
fn files_an_older_version_left_readable_by_others_are_made_owner_only_at_open() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let (clock, faults, t) = (ManualClock::new(T0), Faults::default(), tenant());
    let config = EngineConfig { shards: 1, ..config(dir.path()) };
    let engine = open(config.clone(), &clock, &faults);
    granted(&engine.reserve_blocking(&t, reserve_for("k", 1_000, 60_000, 0)).unwrap().reply);
    drop(engine);
    // A clean close removes the WAL; an older version's crash would have left one.
    std::fs::write(dir.path().join("shard-0000.sqlite-wal"), "").unwrap();
    let names = ["oncegate.manifest.toml", "oncegate.lock", "shard-0000.sqlite", "shard-0000.sqlite-wal"];
    let mode = |name: &str| std::fs::metadata(dir.path().join(name)).unwrap().permissions().mode() & 0o777;
    for name in names {
        std::fs::set_permissions(dir.path().join(name), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    // A temporary file a crash left behind, as loose as an older version made it.
    std::fs::write(dir.path().join("shard-0000.epoch.tmp"), "7\n").unwrap();
    std::fs::set_permissions(dir.path().join("shard-0000.epoch.tmp"), std::fs::Permissions::from_mode(0o644))
        .unwrap();

    let engine = open(config, &clock, &faults);
    assert_eq!(engine.get_blocking(&t, key("k", 0)).unwrap().state, State::Pending);
    for name in names.into_iter().chain(["shard-0000.epoch"]) {
        assert_eq!(mode(name), 0o600, "{name}");
    }
}

/// A SQLite data directory is refused under PostgreSQL: opened so, its records would be
/// invisible and every key granted again.
#[test]
fn a_data_directory_of_the_other_store_is_refused() {
    use oncegate_engine::{LayoutError, OpenError, StoreConfig};
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    let dir = tempfile::tempdir().unwrap();
    let engine = open(config(dir.path()), &clock, &faults);
    granted(&engine.reserve_blocking(&tenant(), reserve("k")).unwrap().reply);
    drop(engine);
    let postgres = StoreConfig::Postgres(PostgresConfig {
        postgres_url: "postgres://db/x".into(),
        ..PostgresConfig::default()
    });
    let opened = oncegate_engine::Engine::open_with(
        EngineConfig { store: postgres, ..config(dir.path()) },
        std::sync::Arc::new(clock.clone()),
        faults,
    );
    assert!(
        matches!(opened, Err(OpenError::Layout(LayoutError::OtherStore { found: "sqlite", .. }))),
        "{:?}",
        opened.err()
    );
}

/// With no store configured, a data directory is SQLite's, and reopens as such.
#[test]
fn the_default_store_is_sqlite() {
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    let t = tenant();
    let dir = tempfile::tempdir().unwrap();
    let engine = open(config(dir.path()), &clock, &faults);
    let token = granted(&engine.reserve_blocking(&t, reserve("k")).unwrap().reply);
    assert_eq!(engine.config().store.kind(), StoreKind::Sqlite);
    assert!(dir.path().join("shard-0000.sqlite").exists(), "a SQLite file per shard");
    drop(engine);
    let engine = open(config(dir.path()), &clock, &faults);
    let view = engine.get_blocking(&t, key("k", 0)).unwrap();
    assert_eq!((view.state, view.token), (State::Pending, token));
}

/// A PostgreSQL node's data directory (its records are in the database; the directory
/// holds the node's name) is refused under SQLite: opened as a new SQLite directory,
/// every key in the table would be granted again.
#[test]
fn a_postgresql_node_s_directory_is_refused_under_an_own_store() {
    use oncegate_engine::{LayoutError, OpenError, StoreConfig};
    let clock = ManualClock::new(T0);
    {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(oncegate_engine::testing::manifest::NODE_FILE), "node-1\n").unwrap();
        let store = StoreConfig::default();
        let opened = oncegate_engine::Engine::open_with(
            EngineConfig { store, ..config(dir.path()) },
            std::sync::Arc::new(clock.clone()),
            Faults::default(),
        );
        assert!(
            matches!(opened, Err(OpenError::Layout(LayoutError::OtherStore { found: "postgres", .. }))),
            "{:?}",
            opened.as_ref().err()
        );
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["oncegate.lock", "oncegate.node"], "nothing created");
    }
}

/// A data directory holding a shard of the log store that earlier versions wrote is
/// refused at open, whatever the kind, with one sentence saying what it is and what this
/// version reads: opened as SQLite, its records would be invisible and every key granted
/// again.
#[test]
fn a_directory_of_the_log_store_is_refused_with_one_sentence() {
    use oncegate_engine::{LayoutError, OpenError};
    let clock = ManualClock::new(T0);
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("shard-0000.log")).unwrap();
    std::fs::write(dir.path().join("shard-0000.log").join("00000001.seg"), b"").unwrap();
    {
        let store = StoreConfig::default();
        let opened = oncegate_engine::Engine::open_with(
            EngineConfig { store, ..config(dir.path()) },
            std::sync::Arc::new(clock.clone()),
            Faults::default(),
        );
        let error = opened.expect_err("refused");
        assert!(matches!(error, OpenError::Layout(LayoutError::LogStore { .. })), "{error:?}");
        let said = error.to_string();
        assert!(
            said.contains("shard-0000.log")
                && said.contains("log store")
                && said.contains("only SQLite and PostgreSQL"),
            "{said}"
        );
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(
            !names.iter().any(|n| n.to_string_lossy().ends_with(".sqlite")),
            "nothing created: {names:?}"
        );
    }
}

/// Copies every file of a stopped data directory, as a file-level backup does.
fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// A copy of a data directory (shard files and epoch files alike) restored after the
/// original went on granting through several restarts grants tokens above every token
/// the original ever granted: every epoch is at least the wall clock's floor (ms since
/// 2025), which the original's epochs never ran ahead of (each restart here takes 1 ms;
/// a real open fsyncs its epoch file). Before the floor, the copy reopened at the epoch
/// after its own epoch file's, which the original had used after the copy was taken.
#[test]
fn a_restored_copy_grants_above_every_token_the_original_granted() {
    let clock = ManualClock::new(oncegate_engine::testing::token::FLOOR_ORIGIN_MS + 400 * 86_400_000);
    let faults = Faults::default();
    let t = tenant();
    let dir = tempfile::tempdir().unwrap();
    let (original, copy) = (dir.path().join("original"), dir.path().join("copy"));
    let engine = open(config(&original), &clock, &faults);
    let written = fill_keys(&engine, 30);
    drop(engine);
    copy_dir(&original, &copy);
    let mut highest = written.values().map(|(token, _)| *token).max().unwrap();
    for restart in 0..5 {
        clock.advance(1);
        let engine = open(config(&original), &clock, &faults);
        for i in 0..10 {
            let token = granted(
                &engine.reserve_blocking(&t, reserve(&format!("after-{restart}-{i}"))).unwrap().reply,
            );
            highest = highest.max(token);
        }
        drop(engine);
    }
    clock.advance(1);
    let engine = open(config(&copy), &clock, &faults);
    check_keys(&engine, &written);
    for i in 0..10 {
        // The same keys the original granted after the copy: a restored gateway may see
        // retries of them.
        let token = granted(&engine.reserve_blocking(&t, reserve(&format!("after-4-{i}"))).unwrap().reply);
        assert!(token > highest, "token {token} of the copy, the original's highest {highest}");
    }
}
