//! The holes issue 10 closed, one test each: every one of these failed before the fix.
//! Gone waiters, the clock frame on reopen and for derived keys, a lost manifest, the
//! token floor across a restored file, reads without writes, the integrity check at
//! process start only, and a panicking shard thread.

mod common;

use std::time::Duration;

use common::*;
use oncegate_core::{Code, Previous, ReserveReply, State};
use oncegate_engine::{
    EngineConfig, Faults, LayoutError, ManualClock, OpenError, ReserveRequest, ShardState,
};

const WAIT: Duration = Duration::from_secs(10);

fn fingerprinted(key: &str, fingerprint: &[u8], wait_ms: u64) -> ReserveRequest {
    ReserveRequest { fingerprint: fingerprint.to_vec(), ..reserve_for(key, 0, 0, wait_ms) }
}

on_each_store! {
    fn a_waiter_whose_caller_has_gone_is_dropped_at_once_and_never_granted() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let engine = open(EngineConfig { shards: 1, ..config(dir.path()) }, &clock, &Faults::default());
        let t = tenant();
        let a = granted(&engine.reserve_blocking(&t, reserve("k")).unwrap().reply);
        // B waits 20 s for a 10 min lease, but its caller gives up long before.
        let b = engine.reserve(&t, reserve_for("k", 600_000, 0, 20_000));
        assert!(engine.wait_stats(0, WAIT, |s| s.waiters == 1), "B is parked");
        drop(b);
        assert!(engine.wait_stats(0, WAIT, |s| s.waiters == 0), "B is dropped before its own deadline");
        engine.release_blocking(&t, key("k", a)).unwrap();
        let c = engine.reserve_blocking(&t, reserve("k")).unwrap().reply;
        assert!(
            matches!(c, ReserveReply::Granted { previous: Previous::None, .. }),
            "the dead B was not granted: {c:?}"
        );
    }
}

on_each_store! {
    fn gone_waiters_stop_counting_against_the_waiter_limits() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let config = EngineConfig { shards: 1, waiters_per_key_max: 1, ..config(dir.path()) };
        let engine = open(config, &clock, &Faults::default());
        let t = tenant();
        let a = granted(&engine.reserve_blocking(&t, reserve("k")).unwrap().reply);
        let b = engine.reserve(&t, reserve_for("k", 0, 0, 20_000));
        assert!(engine.wait_stats(0, WAIT, |s| s.waiters == 1));
        drop(b);
        // C may park at once, whether or not the shard has swept B yet.
        let c = engine.reserve(&t, reserve_for("k", 0, 0, 20_000));
        engine.release_blocking(&t, key("k", a)).unwrap();
        assert!(matches!(block_on(c).unwrap().reply, ReserveReply::Granted { .. }));
    }
}

on_each_store! {
    fn timed_out_waiters_are_each_decided_on_their_own() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let engine = open(EngineConfig { shards: 1, ..config(dir.path()) }, &clock, &Faults::default());
        let t = tenant();
        let a = granted(&engine.reserve_blocking(&t, fingerprinted("k", b"X", 0)).unwrap().reply);
        let b = engine.reserve(&t, fingerprinted("k", b"", 20_000));
        let d = engine.reserve(&t, fingerprinted("k", b"", 20_000));
        let c = engine.reserve(&t, fingerprinted("k", b"X", 1_000));
        assert!(engine.wait_stats(0, WAIT, |s| s.waiters == 3));
        // B takes the key without a fingerprint; D waits behind it; C's payload no longer
        // matches the key, so C is due `mismatch`, never `in progress`.
        engine.release_blocking(&t, key("k", a)).unwrap();
        clock.advance(1_001);
        engine.run_alarms();
        assert!(matches!(block_on(b).unwrap().reply, ReserveReply::Granted { .. }));
        let c = block_on(c).unwrap().reply;
        assert!(matches!(c, ReserveReply::Mismatch { .. }), "{c:?}");
        clock.advance(20_000);
        engine.run_alarms();
        assert!(matches!(block_on(d).unwrap().reply, ReserveReply::InProgress { .. }));
    }
}

on_each_store! {
    fn a_wall_clock_step_then_an_in_process_reopen_expires_nothing_early() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let engine = open(config(dir.path()), &clock, &Faults::default());
        let t = tenant();
        let token = granted(&engine.reserve_blocking(&t, reserve_for("k", 0, 60_000, 0)).unwrap().reply);
        engine.commit_blocking(&t, commit("k", token, b"first")).unwrap();
        clock.step(3_600_000);
        let shard = engine.shard_of(&engine.scope(&t, "live", "k").unwrap());
        assert!(engine.reopen_shard(shard).unwrap());
        clock.advance(2_000);
        let retry = engine.reserve_blocking(&t, reserve_for("k", 0, 60_000, 0)).unwrap().reply;
        assert!(matches!(retry, ReserveReply::Completed { .. }), "a retry 2 s after the commit: {retry:?}");
        clock.advance(58_000);
        engine.run_alarms();
        assert_eq!(engine.get_blocking(&t, key("k", 0)).unwrap().state, State::Free, "the ttl runs in real time");
    }
}

#[test]
fn derived_keys_never_use_a_time_below_the_high_water_mark() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let derived = || ReserveRequest {
        namespace: "live".into(),
        key_parts: vec!["order".into(), "8812".into()],
        bucket_ms: 3_600_000,
        ..ReserveRequest::default()
    };
    let engine = open(config(dir.path()), &clock, &Faults::default());
    let t = tenant();
    let first = engine.reserve_blocking(&t, derived()).unwrap();
    engine.commit_blocking(&t, commit(first.key.as_str(), granted(&first.reply), b"done")).unwrap();
    drop(engine);
    // Restarted with the wall clock an hour behind: the same request is the same key.
    clock.step(-3_600_000);
    let engine = open(config(dir.path()), &clock, &Faults::default());
    let again = engine.reserve_blocking(&t, derived()).unwrap();
    assert_eq!(again.key, first.key);
    assert!(matches!(again.reply, ReserveReply::Completed { .. }), "{:?}", again.reply);
}

#[test]
fn a_data_directory_without_its_manifest_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    drop(open(config(dir.path()), &clock, &Faults::default()));
    std::fs::remove_file(dir.path().join(oncegate_engine::testing::manifest::MANIFEST_FILE)).unwrap();
    for shards in [2, 3] {
        let refused = oncegate_engine::Engine::open_with(
            EngineConfig { shards, ..config(dir.path()) },
            std::sync::Arc::new(clock.clone()),
            Faults::default(),
        )
        .expect_err("refused");
        assert!(
            matches!(refused, OpenError::Layout(LayoutError::ManifestMissing { shard_files: 2, .. })),
            "{refused:?}"
        );
        assert!(refused.to_string().contains("Restore the manifest"), "{refused}");
    }
}

#[test]
fn tokens_stay_above_every_token_issued_before_a_file_restore() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let config = EngineConfig { shards: 1, ..config(dir.path()) };
    let shard_file = oncegate_engine::testing::manifest::shard_file(dir.path(), 0);
    drop(open(config.clone(), &clock, &Faults::default()));
    let backup = std::fs::read(&shard_file).unwrap();

    let engine = open(config.clone(), &clock, &Faults::default());
    let t = tenant();
    let mut issued = Vec::new();
    for _ in 0..3 {
        let token = granted(&engine.reserve_blocking(&t, reserve("k")).unwrap().reply);
        engine.release_blocking(&t, key("k", token)).unwrap();
        issued.push(token);
    }
    assert!(issued.windows(2).all(|w| w[0] < w[1]));
    drop(engine);

    // The operator restores the shard file from the older copy.
    for suffix in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", shard_file.display()));
    }
    std::fs::write(&shard_file, &backup).unwrap();
    let engine = open(config.clone(), &clock, &Faults::default());
    let after_restore = granted(&engine.reserve_blocking(&t, reserve("k")).unwrap().reply);
    assert!(after_restore > *issued.last().unwrap(), "{after_restore} after {issued:?}");

    // An in-process reopen raises the floor again.
    assert!(engine.reopen_shard(0).unwrap());
    let after_reopen = granted(&engine.reserve_blocking(&t, reserve("other")).unwrap().reply);
    assert!(after_reopen > after_restore);
    assert_eq!(oncegate_engine::testing::token::epoch_of(after_reopen), 3, "new, restart, reopen");
}

on_each_store! {
    fn reads_take_no_write_transaction_and_no_fsync() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let faults = Faults::default();
        let engine = open(EngineConfig { shards: 1, ..config(dir.path()) }, &clock, &faults);
        let t = tenant();
        let token = granted(&engine.reserve_blocking(&t, reserve("k")).unwrap().reply);
        let commits = engine.stats()[0].commits;
        faults.fail_commits(1);
        for _ in 0..3 {
            assert_eq!(engine.get_blocking(&t, key("k", 0)).unwrap().token, token);
            let scope = engine.scope(&t, "live", "k").unwrap();
            assert_eq!(block_on(engine.inspect(scope)).unwrap().1, State::Pending);
        }
        assert_eq!(engine.stats()[0].commits, commits, "no read committed anything");
        // The armed commit failure is still there for the next write.
        assert_eq!(engine.heartbeat_blocking(&t, key("k", token)).unwrap_err().code(), Code::Unavailable);
    }
}

#[test]
fn the_integrity_check_runs_at_process_start_only() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    faults.fail_integrity_checks(1);
    let engine = open(EngineConfig { shards: 1, ..config(dir.path()) }, &clock, &faults);
    assert_eq!(engine.shard_states(), [ShardState::Failed], "checked at process start");
    assert!(engine.reopen_shard(0).unwrap(), "the failed first open is retried with its check");
    faults.fail_integrity_checks(1);
    assert!(engine.reopen_shard(0).unwrap(), "an in-process reopen does not re-read the whole file");
}

on_each_store! {
    fn a_panicking_shard_is_reported_never_silently_dead() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let faults = Faults::default();
        let engine = open(config(dir.path()), &clock, &faults);
        let t = tenant();
        faults.panic_next_batch();
        assert_eq!(engine.reserve_blocking(&t, reserve("k")).unwrap_err().code(), Code::Unavailable);
        let shard = engine.shard_of(&engine.scope(&t, "live", "k").unwrap());
        assert!(engine.wait_shard_state(shard, ShardState::Panicked, WAIT));
        let last_error = engine.stats()[shard as usize].last_error.clone().unwrap_or_default();
        assert!(last_error.contains("panicked"), "{last_error}");
        assert_eq!(engine.reserve_blocking(&t, reserve("k")).unwrap_err().code(), Code::Unavailable);
        let other = (0..)
            .map(|i| format!("o{i}"))
            .find(|k| engine.shard_of(&engine.scope(&t, "live", k).unwrap()) != shard);
        let other = other.unwrap();
        assert!(matches!(
            engine.reserve_blocking(&t, reserve(&other)).unwrap().reply,
            ReserveReply::Granted { .. }
        ));
    }
}

#[test]
fn derived_keys_are_refused_until_every_shard_has_opened_once() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    faults.fail_opens(1);
    let engine = open(EngineConfig { shards: 1, ..config(dir.path()) }, &clock, &faults);
    let derived = ReserveRequest {
        namespace: "live".into(),
        key_parts: vec!["order".into(), "1".into()],
        bucket_ms: 60_000,
        ..ReserveRequest::default()
    };
    let t = tenant();
    let refused = engine.reserve_blocking(&t, derived.clone()).unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "the shard's clock mark is unknown: {refused}");
    assert!(engine.reopen_shard(0).unwrap());
    assert!(matches!(engine.reserve_blocking(&t, derived).unwrap().reply, ReserveReply::Granted { .. }));
}

/// A row whose stored hash no longer matches its key would be invisible to that key (the
/// index is built from the hash), which would then be granted again: the first open of
/// the process checks every row and refuses the file.
#[test]
fn a_row_whose_hash_does_not_match_its_key_fails_the_shard_at_process_start() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let config = EngineConfig { shards: 1, ..config(dir.path()) };
    let engine = open(config.clone(), &clock, &Faults::default());
    let token = granted(&engine.reserve_blocking(&tenant(), reserve("k")).unwrap().reply);
    engine.commit_blocking(&tenant(), commit("k", token, b"done")).unwrap();
    drop(engine);
    let shard_file = oncegate_engine::testing::manifest::shard_file(dir.path(), 0);
    let conn = rusqlite::Connection::open(&shard_file).unwrap();
    conn.execute("UPDATE records SET hash = hash + 1", []).unwrap();
    drop(conn);
    let engine = open(config, &clock, &Faults::default());
    let stats = &engine.stats()[0];
    assert_eq!(stats.state, oncegate_engine::ShardState::Failed, "{stats:?}");
    assert!(stats.last_error.as_deref().unwrap_or("").contains("stored hash"), "{stats:?}");
    assert!(!stats.last_error.as_deref().unwrap_or("").contains("\"k\""), "the key is not named");
    assert_eq!(
        engine.get_blocking(&tenant(), key("k", 0)).unwrap_err().code(),
        oncegate_core::Code::Unavailable
    );
}
