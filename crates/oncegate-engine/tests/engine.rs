//! The shard engine against real SQLite files: the contract end to end, routing, the
//! manifest, mailbox bounds, waiters, expiry and reclaim with an injected clock.

mod common;

use std::time::Duration;

use common::*;
use oncegate_core::{Code, Previous, ReserveReply, State};
use oncegate_engine::{
    Engine, EngineConfig, Error, Faults, LayoutError, ManualClock, OpenError, ReserveRequest, ShardState,
};

on_each_store! {
    fn double_fill_is_answered_with_the_first_response() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let engine = open(config(dir.path()), &clock, &Faults::default());
        let t = tenant();

        let first = engine.reserve_blocking(&t, reserve("fill-1")).unwrap();
        let token = granted(&first.reply);
        let dup = engine.reserve_blocking(&t, reserve("fill-1")).unwrap();
        assert!(matches!(dup.reply, ReserveReply::InProgress { attempt: 1, .. }), "{dup:?}");

        clock.advance(500);
        engine.commit_blocking(&t, commit("fill-1", token, b"order A-77")).unwrap();
        let retry = engine.reserve_blocking(&t, reserve("fill-1")).unwrap();
        match retry.reply {
            ReserveReply::Completed { token: t2, response, completed_at_ms, .. } => {
                assert_eq!((t2, response.as_slice(), completed_at_ms), (token, &b"order A-77"[..], T0 + 500));
            }
            other => panic!("expected a replay, got {other:?}"),
        }
        // A retried commit is acknowledged; release of a completed key is refused.
        engine.commit_blocking(&t, commit("fill-1", token, b"order A-77")).unwrap();
        let err = engine.release_blocking(&t, key("fill-1", token)).unwrap_err();
        assert_eq!(err.code(), Code::AlreadyCompleted);
    }
}

on_each_store! {
    fn async_api_works_from_a_runtime() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let engine = open(config(dir.path()), &clock, &Faults::default());
        let t = tenant();
        block_on(async {
            let r = engine.reserve(&t, reserve("a")).await.unwrap();
            let token = granted(&r.reply);
            let renewed = engine.heartbeat(&t, key("a", token)).await.unwrap();
            assert_eq!(renewed.lease_until_ms, T0 + 30_000);
            let view = engine.get(&t, key("a", 0)).await.unwrap();
            assert_eq!((view.state, view.token), (State::Pending, token));
            engine.release(&t, key("a", token)).await.unwrap();
            assert_eq!(engine.get(&t, key("a", 0)).await.unwrap().state, State::Free);
            let err = engine.commit(&t, commit("a", token, b"")).await.unwrap_err();
            assert_eq!(err.code(), Code::NotFound);
        });
    }
}

on_each_store! {
    fn tokens_increase_across_release_and_tenants_are_apart() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let engine = open(config(dir.path()), &clock, &Faults::default());
        let (a, b) = (oncegate_core::Tenant::new("acme").unwrap(), oncegate_core::Tenant::new("globex").unwrap());
        let t1 = granted(&engine.reserve_blocking(&a, reserve("k")).unwrap().reply);
        // Another tenant's identical key is a different record: granted, not in progress.
        granted(&engine.reserve_blocking(&b, reserve("k")).unwrap().reply);
        engine.release_blocking(&a, key("k", t1)).unwrap();
        let t2 = granted(&engine.reserve_blocking(&a, reserve("k")).unwrap().reply);
        assert!(t2 > t1, "a token after release is greater: {t2} > {t1}");
        let err = engine.commit_blocking(&a, commit("k", t1, b"")).unwrap_err();
        assert_eq!(err.code(), Code::LeaseLost);
    }
}

#[test]
fn invalid_requests_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(config(dir.path()), &ManualClock::new(T0), &Faults::default());
    let t = tenant();
    let cases: Vec<(ReserveRequest, &str)> = vec![
        (reserve(&"k".repeat(513)), "key is 513 bytes; the limit is 512"),
        (ReserveRequest { namespace: "li ve".into(), ..reserve("k") }, "namespace has ' '"),
        (reserve(""), "key is empty"),
        (ReserveRequest { key_parts: vec!["a".into()], bucket_ms: 60_000, ..reserve("k") }, "not both"),
        (ReserveRequest { ttl_ms: 10, ..reserve("k") }, "ttl_ms is 10 ms"),
        (ReserveRequest { lease_ms: 3_600_001, ..reserve("k") }, "lease_ms is 3600001 ms"),
        (
            ReserveRequest { fingerprint: vec![0; 65], ..reserve("k") },
            "fingerprint is 65 bytes; the limit is 64",
        ),
        (ReserveRequest { wait_ms: 30_001, ..reserve("k") }, "wait_ms is 30001 ms"),
        (ReserveRequest { bucket_ms: 5, ..reserve("k") }, "bucket_ms: only applies with key_parts"),
    ];
    for (request, message) in cases {
        let err = engine.reserve_blocking(&t, request).unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.to_string().contains(message), "'{err}' should contain '{message}'");
    }
    let err = engine.commit_blocking(&t, commit("k", 0, b"")).unwrap_err();
    assert_eq!(err.to_string(), "token must not be zero");
    let err = engine.commit_blocking(&t, commit("k", 1, &vec![0; 64 * 1024 + 1])).unwrap_err();
    assert_eq!(err.to_string(), "response is 65537 bytes; the limit is 65536");
}

#[test]
fn derived_keys_collide_within_a_bucket() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let engine = open(config(dir.path()), &clock, &Faults::default());
    let t = tenant();
    let parts = |bucket_ms| ReserveRequest {
        namespace: "live".into(),
        key_parts: ["trade", "binance", "BTCUSDT", "buy", "0.5"].map(String::from).to_vec(),
        bucket_ms,
        ..ReserveRequest::default()
    };
    let first = engine.reserve_blocking(&t, parts(60_000)).unwrap();
    assert_eq!(first.key.as_str(), format!("trade:binance:BTCUSDT:buy:0.5::{}", T0 / 60_000));
    granted(&first.reply);
    let dup = engine.reserve_blocking(&t, parts(60_000)).unwrap();
    assert!(matches!(dup.reply, ReserveReply::InProgress { .. }));
    clock.advance(60_000);
    let later = engine.reserve_blocking(&t, parts(60_000)).unwrap();
    assert_ne!(later.key, first.key);
    granted(&later.reply);
}

on_each_store! {
    fn expiry_abandonment_and_reclaim_follow_the_injected_clock() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let engine = open(config(dir.path()), &clock, &Faults::default());
        let t = tenant();
        let first = granted(&engine.reserve_blocking(&t, reserve_for("job", 1_000, 10_000, 0)).unwrap().reply);

        clock.advance(999);
        assert_eq!(engine.get_blocking(&t, key("job", 0)).unwrap().state, State::Pending);
        clock.advance(1);
        assert_eq!(engine.get_blocking(&t, key("job", 0)).unwrap().state, State::Abandoned);

        let again = engine.reserve_blocking(&t, reserve_for("job", 1_000, 10_000, 0)).unwrap();
        match again.reply {
            ReserveReply::Granted { token, attempt, previous, .. } => {
                assert!(token > first);
                assert_eq!((attempt, previous), (2, Previous::Abandoned));
                engine.commit_blocking(&t, commit("job", token, b"done")).unwrap();
            }
            other => panic!("expected a re-grant, got {other:?}"),
        }
        // Committed at T0 + 1000 with ttl 10 s: kept until T0 + 11_000 exactly.
        clock.advance(9_999);
        engine.run_alarms();
        assert_eq!(engine.stats().iter().map(|s| s.reclaimed).sum::<u64>(), 0);
        assert_eq!(engine.get_blocking(&t, key("job", 0)).unwrap().state, State::Completed);
        clock.advance(1);
        assert_eq!(engine.get_blocking(&t, key("job", 0)).unwrap().state, State::Free, "free before reclaim");
        engine.run_alarms();
        assert_eq!(engine.stats().iter().map(|s| s.reclaimed).sum::<u64>(), 1);
    }
}

on_each_store! {
    fn a_live_lease_is_never_reclaimed_even_past_ttl() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let engine = open(config(dir.path()), &clock, &Faults::default());
        let t = tenant();
        let token = granted(&engine.reserve_blocking(&t, reserve_for("long", 5_000, 1_000, 0)).unwrap().reply);
        for _ in 0..8 {
            clock.advance(3_000);
            engine
                .heartbeat_blocking(&t, oncegate_engine::KeyRequest { lease_ms: 5_000, ..key("long", token) })
                .unwrap();
            engine.run_alarms();
            assert_eq!(engine.get_blocking(&t, key("long", 0)).unwrap().state, State::Pending);
        }
        assert_eq!(engine.stats().iter().map(|s| s.reclaimed).sum::<u64>(), 0);
        engine.commit_blocking(&t, commit("long", token, b"late but fine")).unwrap();
    }
}

on_each_store! {
    fn reclaim_is_bounded_per_alarm_tick() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let config = EngineConfig { shards: 1, reclaim_batch_max: 10, ..config(dir.path()) };
        let engine = open(config, &clock, &Faults::default());
        let t = tenant();
        for i in 0..35 {
            let token =
                granted(&engine.reserve_blocking(&t, reserve_for(&format!("k{i}"), 0, 1_000, 0)).unwrap().reply);
            engine.commit_blocking(&t, commit(&format!("k{i}"), token, b"x")).unwrap();
        }
        clock.advance(1_000);
        let alarms_before = engine.stats()[0].alarms;
        // Each call runs at least one tick; the shard may run more on its own, since a full
        // chunk means more is due. Either way no tick may take more than 10.
        for _ in 0..35 {
            engine.run_alarms();
            if engine.stats()[0].reclaimed == 35 {
                break;
            }
        }
        let stats = &engine.stats()[0];
        assert_eq!(stats.reclaimed, 35);
        assert!(
            stats.alarms - alarms_before >= 4,
            "35 records at 10 per tick need at least 4 ticks, took {}",
            stats.alarms - alarms_before
        );
    }
}

#[test]
fn keys_spread_over_shards_by_the_documented_hash() {
    let dir = tempfile::tempdir().unwrap();
    let engine =
        open(EngineConfig { shards: 4, ..config(dir.path()) }, &ManualClock::new(T0), &Faults::default());
    let t = tenant();
    for i in 0..400 {
        granted(&engine.reserve_blocking(&t, reserve(&format!("key-{i}"))).unwrap().reply);
    }
    for stats in engine.stats() {
        assert!(stats.commands > 50, "shard {} got only {} of 400 keys", stats.shard, stats.commands);
    }
    for shard in 0..4 {
        assert!(dir.path().join(format!("shard-{shard:04}.sqlite")).exists());
    }
}

#[test]
fn a_directory_keeps_its_shard_count_and_is_locked() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let engine = open(EngineConfig { shards: 3, ..config(dir.path()) }, &clock, &Faults::default());
    let second = Engine::open(EngineConfig { shards: 3, ..config(dir.path()) });
    assert!(
        matches!(second, Err(OpenError::Layout(LayoutError::Locked { .. }))),
        "a second owner is refused"
    );
    engine.shutdown();
    drop(engine);
    let err = Engine::open(EngineConfig { shards: 4, ..config(dir.path()) }).expect_err("refused");
    let message = err.to_string();
    assert!(message.contains("has 3 shards") && message.contains("asks for 4"), "{message}");
    assert!(message.contains("oncegate admin add-shards --to 4"), "{message}");
    let fewer =
        Engine::open(EngineConfig { shards: 2, ..config(dir.path()) }).expect("fewer configured opens");
    assert_eq!(fewer.stats().len(), 3, "a directory that grew keeps all of its shards");
    fewer.shutdown();
    drop(fewer);
    Engine::open(EngineConfig { shards: 3, ..config(dir.path()) }).expect("the same count opens");
}

#[test]
fn configuration_problems_are_reported_together() {
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig { shards: 0, batch_len_max: 0, mailbox_depth_max: 0, ..config(dir.path()) };
    let message = Engine::open(config).expect_err("refused").to_string();
    for field in ["shards is 0", "batch_len_max is 0", "mailbox_depth_max is 0"] {
        assert!(message.contains(field), "'{message}' should name {field}");
    }
}

#[test]
fn a_full_mailbox_answers_resource_exhausted_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    let config = EngineConfig { shards: 1, mailbox_depth_max: 2, ..config(dir.path()) };
    let engine = open(config, &clock, &faults);
    let t = tenant();
    faults.close_gate();
    let held = engine.reserve(&t, reserve("a"));
    faults.wait_held(1);
    // The shard holds "a" at the gate; the mailbox takes two more, then refuses.
    let queued = [engine.reserve(&t, reserve("b")), engine.reserve(&t, reserve("c"))];
    let err = block_on(engine.reserve(&t, reserve("d"))).unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert_eq!(err.to_string(), "shard 0 mailbox is full; mailbox_depth_max is 2");
    assert_eq!(engine.stats()[0].mailbox_depth, 2);
    faults.open_gate();
    granted(&block_on(held).unwrap().reply);
    for q in queued {
        granted(&block_on(q).unwrap().reply);
    }
}

on_each_store! {
    fn sixty_four_threads_race_and_exactly_one_is_granted() {
        let dir = tempfile::tempdir().unwrap();
        let engine = Engine::open(config(dir.path())).unwrap();
        let t = tenant();
        for round in 0..25 {
            let key_name = format!("race-{round}");
            let barrier = std::sync::Barrier::new(64);
            let grants: usize = std::thread::scope(|s| {
                let handles: Vec<_> = (0..64)
                    .map(|_| {
                        s.spawn(|| {
                            barrier.wait();
                            let reply = engine.reserve_blocking(&t, reserve(&key_name)).unwrap().reply;
                            matches!(reply, ReserveReply::Granted { .. }) as usize
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).sum()
            });
            assert_eq!(grants, 1, "round {round}: exactly one of 64 racers is granted");
        }
    }
}

on_each_store! {
    fn wait_ends_in_a_replay_when_the_key_completes() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let engine = open(config(dir.path()), &clock, &Faults::default());
        let t = tenant();
        let token = granted(&engine.reserve_blocking(&t, reserve("w")).unwrap().reply);
        let waiters: Vec<_> = (0..3).map(|_| engine.reserve(&t, reserve_for("w", 0, 0, 5_000))).collect();
        // The mailbox is first in, first out: once this read returns, all three are parked.
        engine.get_blocking(&t, key("w", 0)).unwrap();
        assert_eq!(engine.stats().iter().map(|s| s.waiters).sum::<u64>(), 3);
        engine.commit_blocking(&t, commit("w", token, b"the one result")).unwrap();
        for w in waiters {
            match block_on(w).unwrap().reply {
                ReserveReply::Completed { response, .. } => assert_eq!(response, b"the one result"),
                other => panic!("expected a replay, got {other:?}"),
            }
        }
    }
}

on_each_store! {
    fn wait_ends_in_one_grant_on_release_and_in_progress_when_it_runs_out() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let engine = open(config(dir.path()), &clock, &Faults::default());
        let t = tenant();
        let token = granted(&engine.reserve_blocking(&t, reserve("w")).unwrap().reply);
        let first = engine.reserve(&t, reserve_for("w", 0, 0, 5_000));
        let second = engine.reserve(&t, reserve_for("w", 0, 0, 5_000));
        engine.release_blocking(&t, key("w", token)).unwrap();
        let got = block_on(first).unwrap().reply;
        assert!(matches!(got, ReserveReply::Granted { attempt: 1, previous: Previous::None, .. }), "{got:?}");
        // The second waiter now waits on the first one's lease, until its own wait runs out.
        assert_eq!(engine.stats().iter().map(|s| s.waiters).sum::<u64>(), 1);
        clock.advance(5_000);
        engine.run_alarms();
        let got = block_on(second).unwrap().reply;
        assert!(matches!(got, ReserveReply::InProgress { .. }), "{got:?}");
    }
}

on_each_store! {
    fn wait_ends_in_a_grant_with_previous_abandoned_when_the_lease_runs_out() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let engine = open(config(dir.path()), &clock, &Faults::default());
        let t = tenant();
        granted(&engine.reserve_blocking(&t, reserve_for("w", 1_000, 0, 0)).unwrap().reply);
        let waiter = engine.reserve(&t, reserve_for("w", 0, 0, 10_000));
        let other = engine.reserve(&t, reserve_for("w", 0, 0, 10_000));
        engine.get_blocking(&t, key("w", 0)).unwrap();
        clock.advance(1_000);
        engine.run_alarms();
        let got = block_on(waiter).unwrap().reply;
        assert!(
            matches!(got, ReserveReply::Granted { attempt: 2, previous: Previous::Abandoned, .. }),
            "{got:?}"
        );
        // Only one waiter is granted; the other keeps waiting behind the new holder.
        assert_eq!(engine.stats().iter().map(|s| s.waiters).sum::<u64>(), 1);
        engine.shutdown();
        assert!(
            matches!(block_on(other).unwrap().reply, ReserveReply::InProgress { .. }),
            "shutdown answers waiters"
        );
    }
}

on_each_store! {
    fn waiters_are_bounded_per_key() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let config = EngineConfig { waiters_per_key_max: 2, ..config(dir.path()) };
        let engine = open(config, &clock, &Faults::default());
        let t = tenant();
        granted(&engine.reserve_blocking(&t, reserve("w")).unwrap().reply);
        let _parked = [
            engine.reserve(&t, reserve_for("w", 0, 0, 5_000)),
            engine.reserve(&t, reserve_for("w", 0, 0, 5_000)),
        ];
        let err = engine.reserve_blocking(&t, reserve_for("w", 0, 0, 5_000)).unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted);
        assert!(err.to_string().contains("waiters_per_key_max is 2"), "{err}");
    }
}

#[test]
fn shutdown_serves_the_calls_a_shard_had_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    let one_shard = EngineConfig { shards: 1, batch_len_max: 1, ..config(dir.path()) };
    let engine = open(one_shard.clone(), &clock, &faults);
    let t = tenant();
    faults.close_gate();
    let held = engine.reserve(&t, reserve("held"));
    faults.wait_held(1);
    // One call at the gate, one in the mailbox: both were accepted before the shutdown.
    let queued = engine.reserve(&t, reserve("queued"));
    assert_eq!(engine.stats()[0].mailbox_depth, 1);
    std::thread::scope(|s| {
        s.spawn(|| engine.shutdown());
        // A refusal means every shard has been told to stop (the engine tells them first),
        // so the shard meets the stop before the mailbox once the gate opens.
        while !matches!(poll_once(engine.reserve(&t, reserve("late"))), Some(Err(Error::Unavailable { .. })))
        {
            std::thread::yield_now();
        }
        faults.open_gate();
    });
    // Shutdown has returned: every call it accepted has its answer.
    for call in [held, queued] {
        let answer = poll_once(call).expect("answered before shutdown returned");
        granted(&answer.unwrap().reply);
    }
    drop(engine);
    let engine = open(one_shard, &clock, &Faults::default());
    assert_eq!(engine.get_blocking(&t, key("queued", 0)).unwrap().state, State::Pending);
}

on_each_store! {
    fn shutdown_refuses_new_calls_and_keeps_what_was_acknowledged() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let engine = open(config(dir.path()), &clock, &Faults::default());
        let t = tenant();
        let token = granted(&engine.reserve_blocking(&t, reserve("kept")).unwrap().reply);
        engine.commit_blocking(&t, commit("kept", token, b"r")).unwrap();
        engine.shutdown();
        assert!(engine.shard_states().iter().all(|s| *s == ShardState::Stopped));
        let err = engine.reserve_blocking(&t, reserve("new")).unwrap_err();
        assert!(matches!(err, Error::Unavailable { .. }), "{err}");
        drop(engine);
        let engine = open(config(dir.path()), &clock, &Faults::default());
        assert_eq!(engine.get_blocking(&t, key("kept", 0)).unwrap().response, b"r");
    }
}

on_each_store! {
    fn stats_report_batches() {
        let dir = tempfile::tempdir().unwrap();
        let engine = Engine::open(EngineConfig { shards: 1, ..config(dir.path()) }).unwrap();
        let t = tenant();
        block_on(async {
            let calls: Vec<_> = (0..200).map(|i| engine.reserve(&t, reserve(&format!("s{i}")))).collect();
            for call in calls {
                granted(&call.await.unwrap().reply);
            }
        });
        let stats = &engine.stats()[0];
        assert_eq!(stats.commands, 200);
        assert!(stats.batches >= 1 && stats.batches <= 200);
        assert!((stats.batch_len_mean - 200.0 / stats.batches as f64).abs() < 1e-9);
        assert_eq!(stats.state, ShardState::Serving);
        assert!(engine.wait_shard_state(0, ShardState::Serving, Duration::from_millis(1)));
    }
}

on_each_store! {
    fn inspect_shows_the_history_of_a_record() {
        use oncegate_core::Transition;
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(T0);
        let engine = open(config(dir.path()), &clock, &Faults::default());
        let t = tenant();
        let first = granted(&engine.reserve_blocking(&t, reserve_for("h", 1_000, 60_000, 0)).unwrap().reply);
        clock.advance(500);
        engine
            .heartbeat_blocking(&t, oncegate_engine::KeyRequest { lease_ms: 1_000, ..key("h", first) })
            .unwrap();
        clock.advance(1_000);
        let second = granted(&engine.reserve_blocking(&t, reserve_for("h", 1_000, 60_000, 0)).unwrap().reply);
        clock.advance(10);
        engine.commit_blocking(&t, commit("h", second, b"done")).unwrap();

        let scope = engine.scope(&t, "live", "h").unwrap();
        let (_, state, record) = block_on(engine.inspect(scope)).unwrap();
        assert_eq!(state, State::Completed);
        let history: Vec<(Transition, u64, u64)> =
            record.unwrap().history.iter().map(|e| (e.transition, e.at_ms, e.token)).collect();
        assert_eq!(
            history,
            [
                (Transition::Granted, T0, first),
                (Transition::Heartbeat, T0 + 500, first),
                (Transition::Abandoned, T0 + 1_500, first),
                (Transition::Regranted, T0 + 1_500, second),
                (Transition::Committed, T0 + 1_510, second),
            ]
        );
        // The history survives a restart with the record.
        drop(engine);
        let engine = open(config(dir.path()), &clock, &Faults::default());
        let (_, _, record) = block_on(engine.inspect(engine.scope(&t, "live", "h").unwrap())).unwrap();
        assert_eq!(record.unwrap().history.len(), 5);
    }
}

#[test]
fn a_version_one_store_is_upgraded_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let t = tenant();
    let engine = open(EngineConfig { shards: 1, ..config(dir.path()) }, &clock, &Faults::default());
    let token = granted(&engine.reserve_blocking(&t, reserve("old")).unwrap().reply);
    engine.commit_blocking(&t, commit("old", token, b"kept")).unwrap();
    drop(engine);
    // Turn the file back into the first schema: no history column, user_version 1.
    let conn = rusqlite::Connection::open(dir.path().join("shard-0000.sqlite")).unwrap();
    conn.execute_batch("ALTER TABLE records DROP COLUMN history; PRAGMA user_version = 1;").unwrap();
    drop(conn);
    let engine = open(EngineConfig { shards: 1, ..config(dir.path()) }, &clock, &Faults::default());
    let view = engine.get_blocking(&t, key("old", 0)).unwrap();
    assert_eq!((view.state, view.response.as_slice()), (State::Completed, &b"kept"[..]));
    let (_, _, record) = block_on(engine.inspect(engine.scope(&t, "live", "old").unwrap())).unwrap();
    assert!(record.unwrap().history.is_empty(), "records from version 1 have no history");
    let next = granted(&engine.reserve_blocking(&t, reserve("new")).unwrap().reply);
    engine.commit_blocking(&t, commit("new", next, b"x")).unwrap();
}

on_each_store! {
    fn a_tenant_at_its_records_quota_is_refused_new_keys_only() {
        use oncegate_core::Tenant;
        let dir = tempfile::tempdir().unwrap();
        let (clock, faults) = (ManualClock::new(T0), Faults::default());
        let config = EngineConfig { shards: 1, ..config(dir.path()) };
        let (acme, globex) = (Tenant::new("acme").unwrap(), Tenant::new("globex").unwrap());
        let quota = || std::collections::HashMap::from([(acme.clone(), 2)]);
        let engine = open(config.clone(), &clock, &faults);
        engine.set_records_per_shard_max(quota());
        let a1 = granted(&engine.reserve_blocking(&acme, reserve_for("a1", 1_000, 10_000, 0)).unwrap().reply);
        granted(&engine.reserve_blocking(&acme, reserve_for("a2", 1_000, 60_000, 0)).unwrap().reply);
        let refused = engine.reserve_blocking(&acme, reserve("a3")).unwrap_err();
        assert!(
            matches!(
                &refused,
                Error::ResourceExhausted { limit_name: "tenants[].records_per_shard_max", limit: 2, .. }
            ),
            "{refused:?}"
        );
        // What the tenant has is served as before; another tenant is not affected.
        assert!(matches!(
            engine.reserve_blocking(&acme, reserve("a1")).unwrap().reply,
            ReserveReply::InProgress { .. }
        ));
        engine.commit_blocking(&acme, commit("a1", a1, b"done")).unwrap();
        assert!(matches!(
            engine.reserve_blocking(&acme, reserve("a1")).unwrap().reply,
            ReserveReply::Completed { .. }
        ));
        granted(&engine.reserve_blocking(&globex, reserve("a3")).unwrap().reply);

        // The count survives a restart.
        drop(engine);
        let engine = open(config, &clock, &faults);
        engine.set_records_per_shard_max(quota());
        assert!(engine.reserve_blocking(&acme, reserve("a3")).is_err(), "still at the quota after a restart");
        // Reclaiming the expired record makes room.
        clock.advance(20_000);
        engine.run_alarms();
        assert_eq!(engine.stats()[0].reclaimed, 1, "a1 expired and was reclaimed");
        granted(&engine.reserve_blocking(&acme, reserve("a3")).unwrap().reply);
        assert!(engine.reserve_blocking(&acme, reserve("a4")).is_err(), "at the quota again");
    }
}

/// A new data directory of the default store and shard count takes at most 1 MiB on disk
/// until records arrive (the log store it replaced preallocated 129 MiB), counted both as
/// the files' lengths and as the blocks the file system gave them.
#[test]
fn an_empty_data_directory_takes_at_most_one_mib() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig { data_dir: dir.path().join("data"), ..EngineConfig::default() };
    let engine = Engine::open(config.clone()).expect("opens");
    assert_eq!(engine.stats().len(), oncegate_engine::SHARDS_DEFAULT as usize);
    let measure = || {
        let (mut bytes, mut allocated) = (0, 0);
        for entry in std::fs::read_dir(&config.data_dir).unwrap() {
            let meta = entry.unwrap().metadata().unwrap();
            assert!(meta.is_file(), "only files in a SQLite data directory");
            bytes += meta.len();
            allocated += meta.blocks() * 512;
        }
        (bytes, allocated)
    };
    let open = measure();
    engine.shutdown();
    drop(engine);
    let closed = measure();
    for (when, (bytes, allocated)) in [("open", open), ("closed", closed)] {
        assert!(bytes <= 1 << 20 && allocated <= 1 << 20, "{when}: {bytes} bytes, {allocated} allocated");
    }
}
