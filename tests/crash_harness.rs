//! The crash harness: the real `oncegate` binary under 32 concurrent gRPC clients
//! (reserve, heartbeat, commit, release on fresh and shared keys, some of them waiting),
//! killed with SIGKILL at random moments and restarted on the same data directory, again
//! and again. Every call is recorded as ok, refused, or indeterminate (cut by the kill),
//! and the history is checked:
//!
//! - every acknowledged grant and commit is still there after every restart;
//! - no key is granted while an acknowledged live lease or completion exists;
//! - replays return exactly the committed bytes;
//! - tokens of a key only grow.
//!
//! `ONCEGATE_KILL_CYCLES` sets the number of cycles (default 20, the CI form);
//! `cargo test --release --test crash_harness` with `ONCEGATE_KILL_CYCLES=200` is the long
//! form whose figures are in docs/reliability.md. It has its own `main` so that it prints
//! a summary and a closing `passed, failed` line.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Server;
use oncegate_proto::v1 as pb;
use oncegate_proto::v1::gate_client::GateClient;
use pb::reserve_response::Outcome as O;

const CLIENTS: usize = 32;
const SHARED_KEYS: u64 = 8;
const LEASE_MS: u64 = 2_000;
const TTL_MS: u64 = 3_600_000;
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// A small deterministic generator, seeded per client and cycle.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Clone, Debug)]
enum Op {
    Reserve,
    Heartbeat,
    Commit(u64),
    Release(u64),
}

#[derive(Clone, Debug)]
enum Answer {
    Granted { token: u64, lease_until_ms: u64 },
    InProgress,
    Completed { token: u64, response: Vec<u8> },
    Mismatch,
    Renewed { token: u64, lease_until_ms: u64 },
    Committed,
    Released,
}

#[derive(Clone, Debug)]
enum Result3 {
    Ok(Answer),
    /// A definite refusal (lease lost, not found, ...): nothing changed.
    Refused(tonic::Code),
    /// Cut by the kill or a transport error: it may or may not have taken effect.
    Indeterminate,
}

#[derive(Clone, Debug)]
struct Event {
    key: String,
    op: Op,
    result: Result3,
}

fn response_for(key: &str, token: u64) -> Vec<u8> {
    format!("{key}:{token}").into_bytes()
}

fn classify<T>(
    result: Result<Result<tonic::Response<T>, tonic::Status>, tokio::time::error::Elapsed>,
) -> Result<T, Result3> {
    match result {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => match status.code() {
            // Unavailable and Unknown come from a connection cut by the kill as well as
            // from a failed shard; both mean "may or may not have happened".
            tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Internal
            | tonic::Code::Cancelled => Err(Result3::Indeterminate),
            code => Err(Result3::Refused(code)),
        },
        Err(_) => Err(Result3::Indeterminate),
    }
}

async fn client_loop(
    addr: String,
    cycle: usize,
    client: usize,
    stop: Arc<AtomicBool>,
    history: Arc<Mutex<Vec<Event>>>,
) {
    let Ok(mut gate) = GateClient::connect(addr).await else { return };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((cycle as u64) << 32) ^ client as u64 ^ 1);
    let mut fresh = 0u64;
    let record = |key: &str, op: Op, result: Result3| {
        history.lock().unwrap().push(Event { key: key.to_owned(), op, result });
    };
    while !stop.load(Ordering::Relaxed) {
        let shared = rng.below(2) == 0;
        let key = if shared {
            format!("s{cycle}-{}", rng.below(SHARED_KEYS))
        } else {
            fresh += 1;
            format!("c{cycle}-{client}-{fresh}")
        };
        let wait_ms = if shared && rng.below(3) == 0 { 300 } else { 0 };
        let answer = match call_reserve(&mut gate, &key, wait_ms).await {
            Ok(answer) => answer,
            Err(other) => {
                record(&key, Op::Reserve, other);
                continue;
            }
        };
        record(&key, Op::Reserve, Result3::Ok(answer.clone()));
        let Answer::Granted { token, .. } = answer else { continue };
        if rng.below(3) == 0 {
            record(&key, Op::Heartbeat, call_heartbeat(&mut gate, &key, token).await);
        }
        if rng.below(4) > 0 {
            record(&key, Op::Commit(token), call_commit(&mut gate, &key, token).await);
        } else {
            record(&key, Op::Release(token), call_release(&mut gate, &key, token).await);
        }
    }
}

type Gate = GateClient<tonic::transport::Channel>;

/// Sends a reserve of `key` and gives its answer, or what else came of it.
async fn call_reserve(gate: &mut Gate, key: &str, wait_ms: u64) -> Result<Answer, Result3> {
    let request = pb::ReserveRequest {
        namespace: "live".into(),
        key: key.to_owned(),
        ttl_ms: TTL_MS,
        lease_ms: LEASE_MS,
        wait_ms,
        ..Default::default()
    };
    let r = classify(tokio::time::timeout(CALL_TIMEOUT, gate.reserve(request)).await)?;
    Ok(match r.outcome {
        Some(O::Granted(g)) => Answer::Granted { token: g.token, lease_until_ms: g.lease_until_ms },
        Some(O::InProgress(_)) => Answer::InProgress,
        Some(O::Completed(c)) => Answer::Completed { token: c.token, response: c.response },
        Some(O::Mismatch(_)) => Answer::Mismatch,
        None => panic!("a reserve answer without an outcome"),
    })
}

/// Sends a heartbeat for `token`'s lease on `key` and says what came of it.
async fn call_heartbeat(gate: &mut Gate, key: &str, token: u64) -> Result3 {
    let request =
        pb::HeartbeatRequest { namespace: "live".into(), key: key.to_owned(), token, lease_ms: LEASE_MS };
    match classify(tokio::time::timeout(CALL_TIMEOUT, gate.heartbeat(request)).await) {
        Ok(r) => Result3::Ok(Answer::Renewed { token, lease_until_ms: r.lease_until_ms }),
        Err(other) => other,
    }
}

/// Sends `token`'s commit of `key`, with the response named after both, and says what came of it.
async fn call_commit(gate: &mut Gate, key: &str, token: u64) -> Result3 {
    let request = pb::CommitRequest {
        namespace: "live".into(),
        key: key.to_owned(),
        token,
        outcome: pb::Outcome::Succeeded as i32,
        response: response_for(key, token),
    };
    match classify(tokio::time::timeout(CALL_TIMEOUT, gate.commit(request)).await) {
        Ok(_) => Result3::Ok(Answer::Committed),
        Err(other) => other,
    }
}

/// Sends `token`'s release of `key` and says what came of it.
async fn call_release(gate: &mut Gate, key: &str, token: u64) -> Result3 {
    let request = pb::ReleaseRequest { namespace: "live".into(), key: key.to_owned(), token };
    match classify(tokio::time::timeout(CALL_TIMEOUT, gate.release(request)).await) {
        Ok(_) => Result3::Ok(Answer::Released),
        Err(other) => other,
    }
}

/// What the history says about one key.
#[derive(Default)]
struct KeyFacts {
    /// Acknowledged grants: token -> lease_until (raised by acknowledged heartbeats).
    grants: BTreeMap<u64, (u64, u64)>,
    /// Tokens whose commit was acknowledged.
    commits_acked: BTreeSet<u64>,
    /// Tokens whose commit was sent (acknowledged or not).
    commits_sent: BTreeSet<u64>,
    /// Tokens whose release was sent (acknowledged or not).
    releases_sent: BTreeSet<u64>,
    /// Replays seen.
    replays: Vec<(u64, Vec<u8>)>,
}

fn facts(history: &[Event]) -> BTreeMap<String, KeyFacts> {
    let mut keys: BTreeMap<String, KeyFacts> = BTreeMap::new();
    for event in history {
        let f = keys.entry(event.key.clone()).or_default();
        match (&event.op, &event.result) {
            (Op::Reserve, Result3::Ok(Answer::Granted { token, lease_until_ms })) => {
                f.grants.insert(*token, (lease_until_ms - LEASE_MS, *lease_until_ms));
            }
            (Op::Reserve, Result3::Ok(Answer::Completed { token, response })) => {
                f.replays.push((*token, response.clone()))
            }
            (Op::Heartbeat, Result3::Ok(Answer::Renewed { token, lease_until_ms })) => {
                if let Some(grant) = f.grants.get_mut(token) {
                    grant.1 = grant.1.max(*lease_until_ms);
                }
            }
            (Op::Commit(token), result) => {
                if !matches!(result, Result3::Refused(_)) {
                    f.commits_sent.insert(*token);
                }
                if matches!(result, Result3::Ok(_)) {
                    f.commits_acked.insert(*token);
                }
            }
            (Op::Release(token), result) if !matches!(result, Result3::Refused(_)) => {
                f.releases_sent.insert(*token);
            }
            _ => {}
        }
    }
    keys
}

/// Checks the history alone: no double grant, replays are the committed bytes.
fn check_history(keys: &BTreeMap<String, KeyFacts>) {
    for (key, f) in keys {
        assert!(f.commits_acked.len() <= 1, "{key}: two commits acknowledged: {:?}", f.commits_acked);
        let grants: Vec<_> = f.grants.iter().collect();
        for pair in grants.windows(2) {
            let (&t1, &(_, lease_until_1)) = pair[0];
            let (&t2, &(granted_at_2, _)) = pair[1];
            assert!(
                !f.commits_acked.contains(&t1),
                "{key}: token {t2} granted after token {t1}'s commit was acknowledged"
            );
            // Unless the first holder released (or may have), its lease must have run out.
            if !f.releases_sent.contains(&t1) {
                assert!(
                    granted_at_2 >= lease_until_1,
                    "{key}: token {t2} granted at {granted_at_2} while token {t1}'s lease ran until {lease_until_1}"
                );
            }
        }
        for (token, response) in &f.replays {
            assert!(f.commits_sent.contains(token), "{key}: replay of token {token}, which nobody committed");
            assert_eq!(
                response,
                &response_for(key, *token),
                "{key}: replayed bytes differ from the committed ones"
            );
            if let Some(acked) = f.commits_acked.first() {
                assert_eq!(token, acked, "{key}: a replay names another commit than the acknowledged one");
            }
        }
    }
}

/// Checks the store after a restart: every acknowledged grant and commit is there.
async fn check_store(addr: &str, keys: &BTreeMap<String, KeyFacts>, only: impl Fn(&str) -> bool) -> usize {
    let mut gate = GateClient::connect(addr.to_owned()).await.expect("connects after restart");
    let mut checked = 0;
    for (key, f) in keys.iter().filter(|(k, _)| only(k)) {
        let Some(&max_granted) = f.grants.keys().next_back() else { continue };
        let view = gate
            .get(pb::GetRequest { namespace: "live".into(), key: key.clone() })
            .await
            .expect("get after restart")
            .into_inner();
        checked += 1;
        if let Some(&committed) = f.commits_acked.first() {
            assert_eq!(view.state, pb::State::Completed as i32, "{key}: an acknowledged commit is lost");
            assert_eq!(view.token, committed, "{key}: the completion names another token");
            assert_eq!(view.response, response_for(key, committed), "{key}: the stored response differs");
            continue;
        }
        if view.state == pb::State::Free as i32 {
            assert!(
                f.releases_sent.contains(&max_granted),
                "{key}: acknowledged grant {max_granted} lost (the key is free and nobody released it)"
            );
        } else {
            assert!(
                view.token >= max_granted,
                "{key}: stored token {} is below acknowledged grant {max_granted}",
                view.token
            );
        }
    }
    checked
}

fn main() {
    let cycles: usize = std::env::var("ONCEGATE_KILL_CYCLES").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let dir = tempfile::tempdir().expect("temp dir");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    let history: Arc<Mutex<Vec<Event>>> = Arc::new(Mutex::new(Vec::new()));
    let mut seed = Rng(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1,
    );
    let started = Instant::now();
    let mut checked_total = 0;
    let mut server = Server::start(dir.path(), &[]);
    for cycle in 0..cycles {
        let stop = Arc::new(AtomicBool::new(false));
        let clients: Vec<_> = (0..CLIENTS)
            .map(|client| {
                runtime.spawn(client_loop(server.addr.clone(), cycle, client, stop.clone(), history.clone()))
            })
            .collect();
        // Kill at a random moment between 100 ms and 1 s of load.
        std::thread::sleep(Duration::from_millis(100 + seed.below(900)));
        server.kill();
        stop.store(true, Ordering::Relaxed);
        runtime.block_on(async {
            for client in clients {
                client.await.expect("client task");
            }
        });
        server = Server::start(dir.path(), &[]);
        let snapshot = history.lock().unwrap().clone();
        let keys = facts(&snapshot);
        check_history(&keys);
        let prefix_fresh = format!("c{cycle}-");
        let prefix_shared = format!("s{cycle}-");
        checked_total += runtime.block_on(check_store(&server.addr, &keys, |k| {
            k.starts_with(&prefix_fresh) || k.starts_with(&prefix_shared)
        }));
    }
    // A last pass over every key of every cycle: later crashes lost nothing earlier.
    let snapshot = history.lock().unwrap().clone();
    let keys = facts(&snapshot);
    check_history(&keys);
    let all = runtime.block_on(check_store(&server.addr, &keys, |_| true));
    assert!(server.terminate(), "clean shutdown at the end");

    let count = |pred: &dyn Fn(&Event) -> bool| snapshot.iter().filter(|e| pred(e)).count();
    let acked_grants = count(&|e| matches!(e.result, Result3::Ok(Answer::Granted { .. })));
    let acked_commits = count(&|e| matches!((&e.op, &e.result), (Op::Commit(_), Result3::Ok(_))));
    let indeterminate = count(&|e| matches!(e.result, Result3::Indeterminate));
    let replays = count(&|e| matches!(e.result, Result3::Ok(Answer::Completed { .. })));
    let lease_lost = count(&|e| matches!(e.result, Result3::Refused(tonic::Code::FailedPrecondition)));
    println!(
        "crash harness: {cycles} SIGKILL cycles in {:.1} s, {} calls: {acked_grants} grants and {acked_commits} commits acknowledged, \
         {replays} replays, {lease_lost} fenced off, {indeterminate} indeterminate; {checked_total} keys checked after their cycle's restart, {all} at the end",
        started.elapsed().as_secs_f64(),
        snapshot.len(),
    );
    println!("crash_harness: 1 passed, 0 failed");
}
