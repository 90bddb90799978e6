//! Wall-clock steps of one hour, back and forward, while running and across a restart:
//! no lease ends early, no record comes back, no key is granted twice.

mod common;

use common::*;
use oncegate_core::{Code, Previous, ReserveReply, State};
use oncegate_engine::{Engine, EngineConfig, Faults, ManualClock};

const HOUR_MS: i64 = 3_600_000;
const LEASE_MS: u64 = 10_000;
const TTL_MS: u64 = 60_000;

/// One holder with a 10 s lease on "held", one completed record on "done".
fn scene(engine: &Engine) -> u64 {
    let t = tenant();
    let holder =
        granted(&engine.reserve_blocking(&t, reserve_for("held", LEASE_MS, TTL_MS, 0)).unwrap().reply);
    let done = granted(&engine.reserve_blocking(&t, reserve_for("done", LEASE_MS, TTL_MS, 0)).unwrap().reply);
    engine.commit_blocking(&t, commit("done", done, b"first")).unwrap();
    holder
}

/// The lease runs its full length in real time, then ends; only then may another attempt
/// be granted, and the old holder is fenced off.
fn lease_runs_its_full_length(
    engine: &Engine,
    clock: &ManualClock,
    holder: u64,
    elapsed_ms: u64,
    previous: Previous,
) {
    let t = tenant();
    clock.advance(LEASE_MS - elapsed_ms - 1);
    engine.run_alarms();
    let view = engine.get_blocking(&t, key("held", 0)).unwrap();
    assert_eq!((view.state, view.token), (State::Pending, holder), "1 ms before its end the lease is live");
    let dup = engine.reserve_blocking(&t, reserve_for("held", LEASE_MS, TTL_MS, 0)).unwrap().reply;
    assert!(
        matches!(dup, ReserveReply::InProgress { .. }),
        "no second grant while the lease is live: {dup:?}"
    );
    clock.advance(1);
    let next = engine.reserve_blocking(&t, reserve_for("held", LEASE_MS, TTL_MS, 0)).unwrap().reply;
    assert!(matches!(next, ReserveReply::Granted { previous: p, .. } if p == previous), "{next:?}");
    let late = engine.commit_blocking(&t, commit("held", holder, b"late")).unwrap_err();
    assert_eq!(late.code(), Code::LeaseLost, "the first holder is fenced off");
}

fn replay_is_kept(engine: &Engine) {
    let reply = engine.reserve_blocking(&tenant(), reserve_for("done", LEASE_MS, TTL_MS, 0)).unwrap().reply;
    assert!(matches!(reply, ReserveReply::Completed { .. }), "the completion is still replayed: {reply:?}");
}

#[test]
fn a_forward_step_while_running_ends_no_lease_early() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let engine = open(config(dir.path()), &clock, &Faults::default());
    let holder = scene(&engine);
    clock.step(HOUR_MS);
    engine.run_alarms();
    replay_is_kept(&engine);
    lease_runs_its_full_length(&engine, &clock, holder, 0, Previous::Abandoned);
}

#[test]
fn a_backward_step_while_running_lengthens_no_lease_and_resurrects_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let engine = open(config(dir.path()), &clock, &Faults::default());
    let t = tenant();
    let holder = scene(&engine);
    let gone = granted(&engine.reserve_blocking(&t, reserve_for("gone", 1_000, 1_000, 0)).unwrap().reply);
    engine.commit_blocking(&t, commit("gone", gone, b"x")).unwrap();
    clock.advance(1_000);
    assert_eq!(engine.get_blocking(&t, key("gone", 0)).unwrap().state, State::Free);
    clock.step(-HOUR_MS);
    engine.run_alarms();
    assert_eq!(engine.get_blocking(&t, key("gone", 0)).unwrap().state, State::Free, "no resurrection");
    // The lease still ends after exactly its length: a step back does not freeze time.
    lease_runs_its_full_length(&engine, &clock, holder, 1_000, Previous::Abandoned);
    replay_is_kept(&engine);
}

#[test]
fn a_forward_step_during_a_restart_ends_no_lease_early() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let config = EngineConfig { lease_restart_grace_ms: 1_000, ..config(dir.path()) };
    let engine = open(config.clone(), &clock, &Faults::default());
    let holder = scene(&engine);
    clock.advance(2_000);
    engine.get_blocking(&tenant(), key("held", 0)).unwrap();
    drop(engine);
    clock.step(HOUR_MS);
    let engine = open(config, &clock, &Faults::default());
    // The holder had 8 s left at the stop; it has 8 s from the reopen. The hour also
    // passed the record's ttl, so once the lease ends the key is simply free.
    lease_runs_its_full_length(&engine, &clock, holder, 2_000, Previous::None);
}

#[test]
fn a_backward_step_during_a_restart_resurrects_nothing_and_grants_once() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let engine = open(config(dir.path()), &clock, &Faults::default());
    let t = tenant();
    let holder = scene(&engine);
    let gone = granted(&engine.reserve_blocking(&t, reserve_for("gone", 1_000, 1_000, 0)).unwrap().reply);
    engine.commit_blocking(&t, commit("gone", gone, b"x")).unwrap();
    clock.advance(1_000);
    engine.get_blocking(&t, key("gone", 0)).unwrap();
    drop(engine);
    clock.step(-HOUR_MS);
    let engine = open(config(dir.path()), &clock, &Faults::default());
    assert_eq!(engine.get_blocking(&t, key("gone", 0)).unwrap().state, State::Free, "no resurrection");
    replay_is_kept(&engine);
    let view = engine.get_blocking(&t, key("held", 0)).unwrap();
    assert_eq!((view.state, view.token), (State::Pending, holder));
    let dup = engine.reserve_blocking(&t, reserve_for("held", LEASE_MS, TTL_MS, 0)).unwrap().reply;
    assert!(matches!(dup, ReserveReply::InProgress { .. }), "{dup:?}");
}
