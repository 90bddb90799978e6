//! Linearizability of single-key histories: concurrent clients hammer a few hot keys
//! through the engine (batching, two shards, real SQLite), every call is recorded with
//! its invocation and response points, and each key's history is checked against the
//! contract's sequential model (the core's `decide`) with a Wing–Gong search: some total
//! order that respects real time must explain every answer.
//!
//! The clock is held still, so the sequential model needs no timestamps; tokens are
//! checked abstractly (a grant must carry a token above every earlier one of the key).

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use common::*;
use oncegate_core::{Change, Command, Commit, Outcome, Record, Reply, Reserve, ReserveReply, Tenant, decide};
use oncegate_engine::{CommitRequest, Engine, EngineConfig, Error, Faults, KeyRequest, ManualClock};

const CLIENTS: usize = 6;
const KEYS: usize = 3;
const OPS_PER_CLIENT: usize = 40;
const ROUNDS: usize = 5;
const LEASE_MS: u64 = 60_000;
const TTL_MS: u64 = 600_000;

#[derive(Clone, Debug)]
struct Call {
    command: Command,
    answer: Result<Reply, oncegate_core::Error>,
    invoked: u64,
    returned: u64,
}

/// The model state: the record and the greatest token granted so far.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Model {
    record: Option<Record>,
    token_max: u64,
}

/// Applies one call to the model if the call's answer is what the model would give.
fn step(model: &Model, call: &Call) -> Option<Model> {
    let next_token = match &call.answer {
        Ok(Reply::Reserve(ReserveReply::Granted { token, .. })) if *token > model.token_max => *token,
        Ok(Reply::Reserve(ReserveReply::Granted { .. })) => return None,
        _ => model.token_max + 1,
    };
    let decision = decide(model.record.as_ref(), &call.command, T0, next_token);
    if decision.reply != call.answer {
        return None;
    }
    let token_max = if decision.consumes_token() { next_token } else { model.token_max };
    let record = match decision.change {
        Change::Keep => model.record.clone(),
        Change::Put(record) => Some(record),
        Change::Delete => None,
    };
    Some(Model { record, token_max })
}

/// Wing–Gong: is there a linearization of `calls` from `model`?
fn linearizable(calls: &[Call]) -> bool {
    assert!(calls.len() <= 128, "the search keeps its frontier in a u128");
    fn search(calls: &[Call], done: u128, model: &Model, seen: &mut HashSet<(u128, String)>) -> bool {
        if done.count_ones() as usize == calls.len() {
            return true;
        }
        if !seen.insert((done, format!("{model:?}"))) {
            return false;
        }
        // A call may go next only if no pending call returned before it was invoked.
        let pending = || calls.iter().enumerate().filter(|(i, _)| done & (1 << i) == 0);
        let first_return = pending().map(|(_, c)| c.returned).min().expect("calls remain");
        for (i, call) in pending() {
            if call.invoked > first_return {
                continue;
            }
            if let Some(next) = step(model, call)
                && search(calls, done | (1 << i), &next, seen)
            {
                return true;
            }
        }
        false
    }
    search(calls, 0, &Model { record: None, token_max: 0 }, &mut HashSet::new())
}

fn run_round(round: usize) -> BTreeMap<String, Vec<Call>> {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let engine: Engine = open(EngineConfig { shards: 2, ..config(dir.path()) }, &clock, &Faults::default());
    run_calls(&[engine], round)
}

/// Each client calls one of `engines` (nodes of one store, or the one engine) and records
/// its history.
fn run_calls(engines: &[Engine], round: usize) -> BTreeMap<String, Vec<Call>> {
    let tick = Arc::new(AtomicU64::new(0));
    let histories: Vec<Vec<(String, Call)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..CLIENTS)
            .map(|client| {
                let (engine, tick) = (&engines[client % engines.len()], &tick);
                s.spawn(move || client_history(engine, tick, round, client))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut by_key: BTreeMap<String, Vec<Call>> = BTreeMap::new();
    for (key, call) in histories.into_iter().flatten() {
        by_key.entry(key).or_default().push(call);
    }
    by_key
}

/// One client's random calls, each with its key and its invocation and response ticks.
fn client_history(engine: &Engine, tick: &AtomicU64, round: usize, client: usize) -> Vec<(String, Call)> {
    let t = tenant();
    let mut seed = (round * 7919 + client * 104_729 + 1) as u64;
    let mut random = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut mine: BTreeMap<String, u64> = BTreeMap::new();
    let mut out = Vec::new();
    for _ in 0..OPS_PER_CLIENT {
        let key = format!("hot-{}", random(KEYS as u64));
        let token = match random(4) {
            0 => 1 + random(12),
            _ => *mine.get(&key).unwrap_or(&1),
        };
        let fingerprint = if random(6) == 0 { b"B".to_vec() } else { Vec::new() };
        let kind = random(10);
        let invoked = tick.fetch_add(1, Ordering::SeqCst);
        let (command, answer) = send(engine, &t, &key, kind, token, fingerprint, &mut random);
        let returned = tick.fetch_add(1, Ordering::SeqCst);
        if let Ok(Reply::Reserve(ReserveReply::Granted { token, .. })) = &answer {
            mine.insert(key.clone(), *token);
        }
        let answer = answer.map_err(|e| match e {
            Error::Refused(refusal) => refusal,
            other => panic!("no storage or load error is expected here: {other}"),
        });
        out.push((key, Call { command, answer, invoked, returned }));
    }
    out
}

/// Sends the command of the drawn `kind` to `engine`, and gives it with the engine's answer.
fn send(
    engine: &Engine,
    t: &Tenant,
    key: &str,
    kind: u64,
    token: u64,
    fingerprint: Vec<u8>,
    random: &mut impl FnMut(u64) -> u64,
) -> (Command, Result<Reply, Error>) {
    match kind {
        0..=3 => {
            let request = oncegate_engine::ReserveRequest {
                fingerprint: fingerprint.clone(),
                ..reserve_for(key, LEASE_MS, TTL_MS, 0)
            };
            let command = Command::Reserve(Reserve {
                ttl_ms: TTL_MS,
                lease_ms: LEASE_MS,
                fingerprint: oncegate_core::Fingerprint::from_stored(fingerprint),
                wait_ms: 0,
            });
            let answer = engine.reserve_blocking(t, request).map(|r| Reply::Reserve(r.reply));
            (command, answer)
        }
        4..=5 => {
            let outcome = if random(5) == 0 { Outcome::Failed } else { Outcome::Succeeded };
            let request = CommitRequest { outcome, ..commit(key, token, b"result") };
            let command = Command::Commit(Commit { token, outcome, response: b"result".to_vec() });
            let answer = engine.commit_blocking(t, request).map(|e| Reply::Commit { expires_at_ms: e });
            (command, answer)
        }
        6 => (
            Command::Release { token },
            engine.release_blocking(t, key_req(key, token, 0)).map(|()| Reply::Release),
        ),
        7 => (
            Command::Heartbeat { token, lease_ms: LEASE_MS },
            engine.heartbeat_blocking(t, key_req(key, token, LEASE_MS)).map(|r| Reply::Heartbeat {
                lease_until_ms: r.lease_until_ms,
                expires_at_ms: r.expires_at_ms,
            }),
        ),
        _ => (Command::Get, engine.get_blocking(t, key_req(key, 0, 0)).map(Reply::Get)),
    }
}

fn key_req(key: &str, token: u64, lease_ms: u64) -> KeyRequest {
    KeyRequest { lease_ms, ..common::key(key, token) }
}

on_each_store! {
    fn concurrent_single_key_histories_are_linearizable() {
        for round in 0..ROUNDS {
            for (key, calls) in run_round(round) {
                assert!(linearizable(&calls), "round {round}, {key}: no linearization explains {calls:#?}");
            }
        }
    }
}

/// The checker itself must be able to say no: two overlapping-free grants of one key
/// with no release between them have no linearization.
#[test]
fn the_checker_rejects_a_double_grant() {
    let reserve = Command::Reserve(Reserve {
        ttl_ms: TTL_MS,
        lease_ms: LEASE_MS,
        fingerprint: oncegate_core::Fingerprint::NONE,
        wait_ms: 0,
    });
    let granted = |token| {
        Ok(Reply::Reserve(ReserveReply::Granted {
            token,
            attempt: 1,
            lease_until_ms: T0 + LEASE_MS,
            lease_ms: LEASE_MS,
            expires_at_ms: T0 + TTL_MS,
            previous: oncegate_core::Previous::None,
        }))
    };
    let first = Call { command: reserve.clone(), answer: granted(1), invoked: 0, returned: 1 };
    let second = Call { command: reserve.clone(), answer: granted(2), invoked: 2, returned: 3 };
    assert!(!linearizable(&[first.clone(), second.clone()]));
    // With a release in between it is fine.
    let release =
        Call { command: Command::Release { token: 1 }, answer: Ok(Reply::Release), invoked: 1, returned: 2 };
    assert!(linearizable(&[first.clone(), release, second]));
    // A grant followed by an in-progress answer that returned first is not.
    let in_progress = Call {
        command: reserve,
        answer: Ok(Reply::Reserve(ReserveReply::InProgress {
            attempt: 1,
            lease_until_ms: T0 + LEASE_MS,
            retry_after_ms: 1_000,
        })),
        invoked: 0,
        returned: 0,
    };
    let later_first = Call { invoked: 1, returned: 2, ..first };
    assert!(!linearizable(&[in_progress, later_first]));
}

/// The same histories with the clients split over two nodes of one PostgreSQL database:
/// what one node answers, the other must not contradict.
#[test]
fn histories_split_over_two_nodes_of_one_database_are_linearizable() {
    common::with_backend(common::Backend::Postgres, || {
        for round in 0..ROUNDS {
            let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
            let clock = ManualClock::new(T0);
            let node_a = EngineConfig { shards: 2, ..config(a.path()) };
            let node_b = EngineConfig { data_dir: b.path().to_owned(), ..node_a.clone() };
            let engines =
                [open(node_a, &clock, &Faults::default()), open(node_b, &clock, &Faults::default())];
            for (key, calls) in run_calls(&engines, round) {
                assert!(linearizable(&calls), "round {round}, {key}: no linearization explains {calls:#?}");
            }
        }
    });
}
