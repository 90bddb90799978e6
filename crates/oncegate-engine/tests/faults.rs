//! Fail-closed behaviour: storage errors, injected and real, answer `unavailable` for the
//! batch and the shard, never acknowledge an uncommitted write, and recover on a clean
//! reopen while other shards keep serving.

mod common;

use std::time::Duration;

use common::*;
use oncegate_core::{Code, Key, Namespace, ReserveReply, Scope, State};
use oncegate_engine::{Engine, EngineConfig, Error, Faults, ManualClock, ShardState};

/// Finds a key that routes to `shard` of `shards`.
fn key_on(engine: &Engine, shard: u32, prefix: &str) -> String {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|k| {
            let scope = Scope {
                tenant: tenant(),
                namespace: Namespace::new("live").unwrap(),
                key: Key::from_stored(k.clone()),
            };
            engine.shard_of(&scope) == shard
        })
        .unwrap()
}

on_each_store! {
    fn an_injected_commit_failure_fails_the_batch_and_the_shard_only() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let faults = Faults::default();
        let engine = open(config(dir.path()), &clock, &faults);
        let t = tenant();
        let (on0, on1) = (key_on(&engine, 0, "a"), key_on(&engine, 1, "b"));

        faults.fail_commits(1);
        let err = engine.reserve_blocking(&t, reserve(&on0)).unwrap_err();
        assert_eq!(err.code(), Code::Unavailable, "{err}");
        assert_eq!(engine.shard_states(), [ShardState::Failed, ShardState::Serving]);
        assert!(engine.stats()[0].last_error.as_deref().unwrap().contains("injected fault: commit"));

        // The failed shard refuses at once; the other keeps serving.
        assert_eq!(engine.get_blocking(&t, key(&on0, 0)).unwrap_err().code(), Code::Unavailable);
        assert!(matches!(
            engine.reserve_blocking(&t, reserve(&on1)).unwrap().reply,
            ReserveReply::Granted { .. }
        ));

        assert!(engine.reopen_shard(0).unwrap());
        // The refused grant was never durable: the key is free, and can be granted now.
        assert_eq!(engine.get_blocking(&t, key(&on0, 0)).unwrap().state, State::Free);
        assert!(matches!(
            engine.reserve_blocking(&t, reserve(&on0)).unwrap().reply,
            ReserveReply::Granted { .. }
        ));
    }
}

on_each_store! {
    fn every_request_of_a_failed_batch_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let faults = Faults::default();
        let engine = open(EngineConfig { shards: 1, ..config(dir.path()) }, &clock, &faults);
        let t = tenant();
        faults.close_gate();
        let first = engine.reserve(&t, reserve("held"));
        faults.wait_held(1);
        let batch: Vec<_> = (0..20).map(|i| engine.reserve(&t, reserve(&format!("k{i}")))).collect();
        faults.fail_commits(1);
        faults.open_gate();
        let mut refused = 0;
        for call in std::iter::once(first).chain(batch) {
            match block_on(call) {
                Err(e) => {
                    assert_eq!(e.code(), Code::Unavailable);
                    refused += 1;
                }
                Ok(r) => panic!("nothing may be acknowledged from a failed batch: {r:?}"),
            }
        }
        assert_eq!(refused, 21);
        assert!(engine.reopen_shard(0).unwrap());
        for i in 0..20 {
            assert_eq!(engine.get_blocking(&t, key(&format!("k{i}"), 0)).unwrap().state, State::Free);
        }
    }
}

on_each_store! {
    fn parked_waiters_hear_unavailable_when_the_shard_fails() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let faults = Faults::default();
        let engine = open(EngineConfig { shards: 1, ..config(dir.path()) }, &clock, &faults);
        let t = tenant();
        assert!(matches!(engine.reserve_blocking(&t, reserve("w")).unwrap().reply, ReserveReply::Granted { .. }));
        let waiter = engine.reserve(&t, reserve_for("w", 0, 0, 10_000));
        assert!(engine.wait_stats(0, Duration::from_secs(10), |s| s.waiters == 1), "parked");
        faults.fail_commits(1);
        assert_eq!(engine.reserve_blocking(&t, reserve("other")).unwrap_err().code(), Code::Unavailable);
        assert_eq!(block_on(waiter).unwrap_err().code(), Code::Unavailable);
    }
}

on_each_store! {
    fn reopen_retries_until_the_file_opens_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let faults = Faults::default();
        let engine = open(EngineConfig { shards: 1, ..config(dir.path()) }, &clock, &faults);
        faults.fail_commits(1);
        faults.fail_opens(2);
        assert_eq!(engine.reserve_blocking(&tenant(), reserve("k")).unwrap_err().code(), Code::Unavailable);
        assert!(!engine.reopen_shard(0).unwrap());
        assert!(!engine.reopen_shard(0).unwrap());
        assert_eq!(engine.stats()[0].state, ShardState::Failed);
        assert!(engine.reopen_shard(0).unwrap());
        assert_eq!(engine.stats()[0].failures, 3);
    }
}

on_each_store! {
    fn a_failed_shard_reopens_by_itself_with_backoff() {
        let dir = tempfile::tempdir().unwrap();
        let faults = Faults::default();
        let config = EngineConfig {
            shards: 1,
            reopen_backoff_ms_min: 10,
            reopen_backoff_ms_max: 100,
            ..config(dir.path())
        };
        let engine =
            Engine::open_with(config, std::sync::Arc::new(oncegate_engine::SystemClock), faults.clone()).unwrap();
        faults.fail_opens(3);
        faults.fail_commits(1);
        assert_eq!(engine.reserve_blocking(&tenant(), reserve("k")).unwrap_err().code(), Code::Unavailable);
        assert!(engine.wait_shard_state(0, ShardState::Serving, Duration::from_secs(10)), "recovered");
        assert_eq!(engine.stats()[0].failures, 4, "one batch failure and three failed reopens");
        assert!(matches!(
            engine.reserve_blocking(&tenant(), reserve("k")).unwrap().reply,
            ReserveReply::Granted { .. }
        ));
    }
}

/// Fills a one-shard engine limited to `pages` SQLite pages with completed keys until a
/// write is refused; returns the keys acknowledged and the refusal.
fn fill(engine: &Engine, response: &[u8]) -> (Vec<String>, Error) {
    let t = tenant();
    let mut acknowledged = Vec::new();
    loop {
        let name = format!("big-{}", acknowledged.len());
        let token = match engine.reserve_blocking(&t, reserve(&name)) {
            Ok(r) => granted(&r.reply),
            Err(e) => return (acknowledged, e),
        };
        match engine.commit_blocking(&t, commit(&name, token, response)) {
            Ok(_) => acknowledged.push(name),
            Err(e) => return (acknowledged, e),
        }
        assert!(acknowledged.len() < 1_000, "the page limit never bit");
    }
}

/// The statement journal that keeps a full file's refusal to one request is switched on
/// only near the limit (it costs CPU on every write): a file that starts far from its
/// limit must have it by the time it fills.
#[test]
fn a_file_filling_up_from_far_below_its_limit_still_refuses_only_the_write_that_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    // A batch here can take at most (4 commands) x (2 KiB response and the rest: about 10
    // pages), so the journal comes on in the last ~40 of the 600 pages.
    faults.limit_pages(600);
    let mut config =
        EngineConfig { shards: 1, batch_len_max: 4, waiters_per_shard_max: 0, ..config(dir.path()) };
    config.limits.response_bytes_max = 2048;
    config.limits.key_bytes_max = 64;
    config.waiters_per_key_max = 0;
    let engine = open(config, &clock, &faults);
    let (acknowledged, refusal) = fill(&engine, &[5u8; 2048]);
    assert_eq!(refusal.code(), Code::ResourceExhausted, "{refusal}");
    assert!(acknowledged.len() > 100, "the file started far from its limit: {}", acknowledged.len());
    let stats = &engine.stats()[0];
    assert_eq!((stats.state, stats.failures), (ShardState::Serving, 0), "a full file is not a failed shard");
    for name in &acknowledged {
        assert_eq!(engine.get_blocking(&tenant(), key(name, 0)).unwrap().state, State::Completed, "{name}");
    }
}

#[test]
fn a_full_shard_file_refuses_only_the_write_that_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    // 48 pages: SQLite itself reports the database full (SQLITE_FULL).
    faults.limit_pages(48);
    let engine = open(EngineConfig { shards: 1, ..config(dir.path()) }, &clock, &faults);
    let t = tenant();
    // Two holders granted before the file fills up.
    let a = granted(&engine.reserve_blocking(&t, reserve_for("holder-a", 600_000, 0, 0)).unwrap().reply);
    let b = granted(&engine.reserve_blocking(&t, reserve_for("holder-b", 600_000, 0, 0)).unwrap().reply);
    let response = vec![7u8; 16 * 1024];
    let (acknowledged, refusal) = fill(&engine, &response);
    assert_eq!(refusal.code(), Code::ResourceExhausted, "{refusal}");
    assert!(refusal.to_string().contains("shard_file_bytes_max"), "{refusal}");
    assert_eq!(engine.stats()[0].state, ShardState::Serving, "a full file is not a failed shard");
    assert_eq!(engine.stats()[0].failures, 0);
    assert!(!acknowledged.is_empty());

    // One batch: a commit too big to fit, then a heartbeat, a small commit, a release and
    // a read. The gate holds the shard on a first request so the rest queue together.
    faults.close_gate();
    let first = engine.get(&t, key("holder-a", 0));
    faults.wait_held(1);
    let too_big = engine.commit(&t, commit("holder-a", a, &response));
    let renewed = engine.heartbeat(&t, key("holder-a", a));
    let small = engine.commit(&t, commit("holder-b", b, b"ok"));
    let released = engine.release(&t, key(&acknowledged[0], 1));
    let read = engine.get(&t, key(&acknowledged[1], 0));
    faults.open_gate();
    block_on(first).unwrap();
    assert_eq!(block_on(too_big).unwrap_err().code(), Code::ResourceExhausted);
    block_on(renewed).unwrap();
    block_on(small).unwrap();
    assert_eq!(block_on(released).unwrap_err().code(), Code::AlreadyCompleted, "answered from the store");
    assert_eq!(block_on(read).unwrap().response.len(), response.len());
    assert_eq!(engine.stats()[0].state, ShardState::Serving);
    assert_eq!(engine.get_blocking(&t, key("holder-a", 0)).unwrap().state, State::Pending);
    assert_eq!(engine.get_blocking(&t, key("holder-b", 0)).unwrap().response, b"ok");
    engine.release_blocking(&t, key("holder-a", a)).unwrap();

    // After a clean reopen every acknowledged record is still there.
    faults.limit_pages(0);
    assert!(engine.reopen_shard(0).unwrap());
    for name in &acknowledged {
        let view = engine.get_blocking(&t, key(name, 0)).unwrap();
        assert_eq!((view.state, view.response.len()), (State::Completed, response.len()), "{name}");
    }
    assert_eq!(engine.get_blocking(&t, key("holder-b", 0)).unwrap().response, b"ok");
}

#[test]
fn a_corrupt_shard_file_at_start_fails_that_shard_only() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    drop(open(config(dir.path()), &clock, &faults));
    let bad = dir.path().join("shard-0001.sqlite");
    for suffix in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(dir.path().join(format!("shard-0001.sqlite{suffix}")));
    }
    std::fs::write(&bad, vec![0x5a; 8192]).unwrap();

    let engine = open(config(dir.path()), &clock, &faults);
    assert_eq!(engine.shard_states(), [ShardState::Serving, ShardState::Failed]);
    let t = tenant();
    let (on0, on1) = (key_on(&engine, 0, "a"), key_on(&engine, 1, "b"));
    assert!(matches!(
        engine.reserve_blocking(&t, reserve(&on0)).unwrap().reply,
        ReserveReply::Granted { .. }
    ));
    assert_eq!(engine.reserve_blocking(&t, reserve(&on1)).unwrap_err().code(), Code::Unavailable);
    assert!(engine.stats()[1].last_error.is_some());

    // The operator restores the file (here: removes the damaged one); the shard reopens.
    std::fs::remove_file(&bad).unwrap();
    assert!(engine.reopen_shard(1).unwrap());
    assert!(matches!(
        engine.reserve_blocking(&t, reserve(&on1)).unwrap().reply,
        ReserveReply::Granted { .. }
    ));
}

#[test]
fn an_unopenable_shard_file_at_start_fails_that_shard_until_it_is_fixed() {
    // Root ignores file permissions, so the unwritable file is a directory in its place:
    // SQLite cannot open it, whoever runs the test.
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    drop(open(config(dir.path()), &clock, &Faults::default()));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(dir.path().join(format!("shard-0000.sqlite{suffix}")));
    }
    std::fs::create_dir_all(dir.path().join("shard-0000.sqlite")).unwrap();
    let engine = open(config(dir.path()), &clock, &Faults::default());
    assert_eq!(engine.shard_states(), [ShardState::Failed, ShardState::Serving]);
    let t = tenant();
    let on0 = key_on(&engine, 0, "a");
    assert_eq!(engine.reserve_blocking(&t, reserve(&on0)).unwrap_err().code(), Code::Unavailable);
    std::fs::remove_dir(dir.path().join("shard-0000.sqlite")).unwrap();
    assert!(engine.reopen_shard(0).unwrap());
    assert!(matches!(
        engine.reserve_blocking(&t, reserve(&on0)).unwrap().reply,
        ReserveReply::Granted { .. }
    ));
}
