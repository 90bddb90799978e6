//! What must survive a reopen: records, the token counter, the clock high-water mark,
//! and the restart grace that keeps downtime from ending leases.

mod common;

use common::*;
use oncegate_core::{Code, ReserveReply, State};
use oncegate_engine::{Durability, EngineConfig, Faults, ManualClock, ShardState, StoreConfig, StoreKind};

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

/// A data directory written by one of the engine's own stores is refused under the
/// other: opened as configured, its records would be invisible and every key granted
/// again.
#[test]
fn a_data_directory_of_the_other_store_is_refused() {
    use oncegate_engine::{OpenError, StoreConfig, StoreKind};
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    let t = tenant();
    for (wrote, configured) in [(StoreKind::Sqlite, StoreKind::Log), (StoreKind::Log, StoreKind::Sqlite)] {
        let dir = tempfile::tempdir().unwrap();
        let store =
            |kind| StoreConfig { kind: Some(kind), log_segment_bytes: 1 << 20, ..StoreConfig::default() };
        let engine = open(EngineConfig { store: store(wrote), ..config(dir.path()) }, &clock, &faults);
        granted(&engine.reserve_blocking(&t, reserve("k")).unwrap().reply);
        drop(engine);
        let opened = oncegate_engine::Engine::open_with(
            EngineConfig { store: store(configured), ..config(dir.path()) },
            std::sync::Arc::new(clock.clone()),
            faults.clone(),
        );
        assert!(matches!(opened, Err(OpenError::OtherStore { .. })), "{wrote:?} opened as {configured:?}");
    }
}

/// With no store kind configured, a data directory keeps the store that wrote it (so its
/// records are found again and no key is granted twice), and a new one gets the log.
#[test]
fn an_unset_store_kind_keeps_the_directory_s_own_store() {
    use oncegate_engine::{StoreConfig, StoreKind};
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    let t = tenant();
    for wrote in [Some(StoreKind::Sqlite), Some(StoreKind::Log), None] {
        let dir = tempfile::tempdir().unwrap();
        let store = |kind| StoreConfig { kind, log_segment_bytes: 1 << 20, ..StoreConfig::default() };
        let engine = open(EngineConfig { store: store(wrote), ..config(dir.path()) }, &clock, &faults);
        let token = granted(&engine.reserve_blocking(&t, reserve("k")).unwrap().reply);
        let settled = engine.config().store.kind;
        assert_eq!(settled, Some(wrote.unwrap_or(StoreKind::Log)), "a new directory under {wrote:?}");
        drop(engine);
        let engine = open(EngineConfig { store: store(None), ..config(dir.path()) }, &clock, &faults);
        assert_eq!(engine.config().store.kind, settled, "reopened with no kind configured");
        let view = engine.get_blocking(&t, key("k", 0)).unwrap();
        assert_eq!((view.state, view.token), (State::Pending, token), "written under {wrote:?}");
    }
}

/// A PostgreSQL node's data directory (its records are in the database; the directory
/// holds the node's name) is refused under the engine's own stores, configured or by an
/// unset kind: opened as a new log, every key in the table would be granted again.
#[test]
fn a_postgresql_node_s_directory_is_refused_under_an_own_store() {
    use oncegate_engine::{OpenError, StoreConfig, StoreKind};
    let clock = ManualClock::new(T0);
    for kind in [None, Some(StoreKind::Log), Some(StoreKind::Sqlite)] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(oncegate_engine::manifest::NODE_FILE), "node-1\n").unwrap();
        let store = StoreConfig { kind, ..StoreConfig::default() };
        let opened = oncegate_engine::Engine::open_with(
            EngineConfig { store, ..config(dir.path()) },
            std::sync::Arc::new(clock.clone()),
            Faults::default(),
        );
        assert!(matches!(opened, Err(OpenError::OtherStore { found: "postgres", .. })), "{kind:?}");
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["oncegate.lock", "oncegate.node"], "nothing created under {kind:?}");
    }
}

/// A directory holding shards of both own stores is refused whatever the kind: an unset
/// kind would pick one by the order of the directory's names and hide the other's records.
#[test]
fn a_directory_with_shards_of_both_stores_is_refused() {
    use oncegate_engine::{OpenError, StoreConfig, StoreKind};
    let clock = ManualClock::new(T0);
    let dir = tempfile::tempdir().unwrap();
    let log =
        StoreConfig { kind: Some(StoreKind::Log), log_segment_bytes: 1 << 20, ..StoreConfig::default() };
    drop(open(EngineConfig { store: log, ..config(dir.path()) }, &clock, &Faults::default()));
    std::fs::write(dir.path().join("shard-0009.sqlite"), b"").unwrap();
    for kind in [None, Some(StoreKind::Log), Some(StoreKind::Sqlite)] {
        let store = StoreConfig { kind, log_segment_bytes: 1 << 20, ..StoreConfig::default() };
        let opened = oncegate_engine::Engine::open_with(
            EngineConfig { store, ..config(dir.path()) },
            std::sync::Arc::new(clock.clone()),
            Faults::default(),
        );
        assert!(matches!(opened, Err(OpenError::BothStores { .. })), "{kind:?}");
    }
}

/// The log's size rules apply to a kind left unset only once it settles on the log: an
/// existing SQLite directory whose file limit is below two log segments still opens, and
/// a new directory with the same settings is refused naming the field.
#[test]
fn an_unset_kind_is_checked_by_the_store_it_settles_on() {
    use oncegate_engine::{OpenError, StoreConfig, StoreKind};
    let clock = ManualClock::new(T0);
    let small = |dir: &std::path::Path, kind| EngineConfig {
        store: StoreConfig { kind, ..StoreConfig::default() },
        shard_file_bytes_max: 64 << 20,
        ..config(dir)
    };
    let dir = tempfile::tempdir().unwrap();
    drop(open(small(dir.path(), Some(StoreKind::Sqlite)), &clock, &Faults::default()));
    let engine = open(small(dir.path(), None), &clock, &Faults::default());
    assert_eq!(engine.config().store.kind, Some(StoreKind::Sqlite));
    drop(engine);
    let new = tempfile::tempdir().unwrap();
    let opened = oncegate_engine::Engine::open_with(
        small(new.path(), None),
        std::sync::Arc::new(clock),
        Faults::default(),
    );
    match opened {
        Err(OpenError::Config(problems)) => {
            assert!(problems.iter().any(|p| p.to_string().contains("shard_file_bytes_max")), "{problems:?}")
        }
        other => panic!("a new log with room for one segment opened: {:?}", other.err()),
    }
}

/// A log that its requests filled to its limit still reopens after a restart. The restart
/// grace rewrites every lease that was live at the stop, and written as a request's it
/// could not use the log's last segment (kept for writes that only move live records),
/// so the open failed as full, and failed again at every retry: the shard never served.
#[test]
fn a_log_its_requests_filled_reopens_with_its_leases_extended() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let segment_bytes = 512 << 10;
    let config = EngineConfig {
        shards: 1,
        shard_file_bytes_max: 3 * segment_bytes,
        durability: Durability::Normal,
        lease_restart_grace_ms: 2_000,
        store: StoreConfig {
            kind: Some(StoreKind::Log),
            log_segment_bytes: segment_bytes,
            ..StoreConfig::default()
        },
        ..config(dir.path())
    };
    let engine = open(config.clone(), &clock, &Faults::default());
    // Completed records fill the log; one key a round stays held.
    let t = tenant();
    let full = |error: &oncegate_engine::Error| error.code() == Code::ResourceExhausted;
    let mut held = None;
    'fill: for round in 0.. {
        let names: Vec<String> = (0..256).map(|i| format!("k{round}-{i}")).collect();
        let grants = block_on(async {
            let mut calls = tokio::task::JoinSet::new();
            for name in &names {
                let reserved = engine.reserve(&t, reserve_for(name, 600_000, 0, 0));
                let name = name.clone();
                calls.spawn(async move { (name, reserved.await) });
            }
            calls.join_all().await
        });
        for (i, (name, granted_or_not)) in grants.into_iter().enumerate() {
            let token = match granted_or_not {
                Ok(reserved) => granted(&reserved.reply),
                Err(error) if full(&error) => break 'fill,
                Err(error) => panic!("{error}"),
            };
            if i == 0 {
                held = Some(name);
                continue;
            }
            match engine.commit_blocking(&t, commit(&name, token, b"done")) {
                Ok(_) => {}
                Err(error) if full(&error) => break 'fill,
                Err(error) => panic!("{error}"),
            }
        }
    }
    drop(engine);
    clock.advance(5_000);
    let engine = open(config, &clock, &Faults::default());
    assert_eq!(engine.shard_states(), [ShardState::Serving], "{:?}", engine.stats());
    let view = engine.get_blocking(&t, key(&held.unwrap(), 0)).unwrap();
    assert_eq!((view.state, view.lease_until_ms), (State::Pending, T0 + 5_000 + 600_000));
}
