//! Storage faults under load, through the real server: a failpoint fires at a random
//! store operation (read, write, counter update or commit) of a random shard while 16
//! clients run, and reopening keeps failing until the test clears the fault. Checked: no
//! acknowledgement without a durable write (and no durable write behind an
//! `UNAVAILABLE`), the failed shard answers `UNAVAILABLE` and health says so, the other
//! shard keeps serving, and the shard recovers within 5 s once the fault clears.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use oncegate_core::{Key, Namespace, Scope, Tenant};
use oncegate_engine::{Engine, EngineConfig, ShardState};
use oncegate_proto::v1 as pb;
use oncegate_proto::v1::gate_client::GateClient;
use oncegate_server::Config;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic::{Code, Streaming};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse, health_client::HealthClient};

mod common;

use common::{Running, start_in};

const ROUNDS: u64 = 8;
const CLIENTS: u64 = 16;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fate {
    /// The reserve was refused with UNAVAILABLE: nothing may be stored.
    Refused,
    /// Granted with this token, commit not acknowledged.
    Granted(u64),
    /// Granted and the commit acknowledged.
    Committed(u64),
}

/// What became of each key the clients tried, by key.
type Fates = Arc<Mutex<BTreeMap<String, Fate>>>;

fn reserve(key: &str) -> pb::ReserveRequest {
    pb::ReserveRequest { namespace: "live".into(), key: key.into(), ..Default::default() }
}

async fn client(
    channel: Channel,
    round: u64,
    id: u64,
    stop: Arc<AtomicBool>,
    fates: Fates,
    acks: Arc<AtomicU64>,
) {
    let mut gate = GateClient::new(channel);
    let mut i = 0;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let key = format!("r{round}-c{id}-{i}");
        let token = match gate.reserve(reserve(&key)).await {
            Ok(r) => match r.into_inner().outcome {
                Some(pb::reserve_response::Outcome::Granted(g)) => g.token,
                other => panic!("fresh keys are granted: {other:?}"),
            },
            Err(status) if status.code() == Code::Unavailable => {
                fates.lock().unwrap().insert(key, Fate::Refused);
                tokio::task::yield_now().await;
                continue;
            }
            Err(status) => panic!("unexpected refusal {status:?}"),
        };
        fates.lock().unwrap().insert(key.clone(), Fate::Granted(token));
        acks.fetch_add(1, Ordering::Relaxed);
        let commit = pb::CommitRequest {
            namespace: "live".into(),
            key: key.clone(),
            token,
            outcome: pb::Outcome::Succeeded as i32,
            response: key.clone().into_bytes(),
        };
        match gate.commit(commit).await {
            Ok(_) => {
                fates.lock().unwrap().insert(key, Fate::Committed(token));
                acks.fetch_add(1, Ordering::Relaxed);
            }
            Err(status) if status.code() == Code::Unavailable => {}
            Err(status) => panic!("unexpected refusal {status:?}"),
        }
    }
}

fn key_on(engine: &Engine, shard: u32, prefix: &str) -> String {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|k| {
            let scope = Scope {
                tenant: Tenant::default_tenant(),
                namespace: Namespace::new("live").unwrap(),
                key: Key::from_stored(k.clone()),
            };
            engine.shard_of(&scope) == shard
        })
        .unwrap()
}

/// The real server on two shards whose reopens back off 20 to 200 ms, health polled every 10 ms.
async fn start_two_shards() -> Running {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config {
        engine: EngineConfig {
            data_dir: dir.path().to_owned(),
            shards: 2,
            reopen_backoff_ms_min: 20,
            reopen_backoff_ms_max: 200,
            ..EngineConfig::default()
        },
        ..Config::default()
    };
    config.server.health_poll_ms = 10;
    start_in(config, Some(dir)).await
}

/// The clients of one round and what they share with the test.
struct Load {
    stop: Arc<AtomicBool>,
    acks: Arc<AtomicU64>,
    clients: Vec<JoinHandle<()>>,
}

/// Starts the round's 16 clients.
fn start_clients(channel: &Channel, round: u64, fates: &Fates) -> Load {
    let stop = Arc::new(AtomicBool::new(false));
    let acks = Arc::new(AtomicU64::new(0));
    let clients = (0..CLIENTS)
        .map(|id| tokio::spawn(client(channel.clone(), round, id, stop.clone(), fates.clone(), acks.clone())))
        .collect();
    Load { stop, acks, clients }
}

/// Stops the round's clients and waits for them: the round acknowledged something.
async fn stop_clients(load: Load, round: u64) {
    load.stop.store(true, Ordering::Relaxed);
    for c in load.clients {
        c.await.unwrap();
    }
    assert!(load.acks.load(Ordering::Relaxed) > 0, "round {round} acknowledged something");
}

/// Steps the xorshift `seed`: the failpoint fires after 1 to 400 store operations.
fn next_fault_after(seed: &mut u64) -> u32 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    1 + (*seed % 400) as u32
}

/// Waits until a shard has failed; which one.
async fn wait_for_a_failed_shard(engine: &Engine) -> u32 {
    let engine = engine.clone();
    tokio::task::spawn_blocking(move || {
        loop {
            for shard in 0..2 {
                if engine.wait_shard_state(shard, ShardState::Failed, Duration::from_millis(20)) {
                    return shard;
                }
            }
        }
    })
    .await
    .unwrap()
}

/// While `failed` is failed: its keys are refused and the other shard serves.
async fn the_failed_shard_refuses_and_the_other_serves(
    channel: &Channel,
    engine: &Engine,
    failed: u32,
    round: u64,
) {
    let serving = 1 - failed;
    let mut gate = GateClient::new(channel.clone());
    let refused =
        gate.reserve(reserve(&key_on(engine, failed, &format!("refused-{round}")))).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    let probe = key_on(engine, serving, &format!("served-{round}"));
    let served_meanwhile = gate.reserve(reserve(&probe)).await;
    assert!(served_meanwhile.is_ok(), "the other shard keeps serving: {served_meanwhile:?}");
}

/// Watches the health of the Gate service.
async fn watch_gate_health(channel: &Channel) -> Streaming<HealthCheckResponse> {
    let mut health = HealthClient::new(channel.clone());
    health.watch(HealthCheckRequest { service: "oncegate.v1.Gate".into() }).await.unwrap().into_inner()
}

/// Reads the health watch until it says `status`.
async fn wait_for_health(watch: &mut Streaming<HealthCheckResponse>, status: ServingStatus) {
    loop {
        if watch.message().await.unwrap().unwrap().status == status as i32 {
            break;
        }
    }
}

/// Asserts the shard `failed` serves again within 5 s of now; how long it took.
async fn recovers_within_5s(engine: &Engine, failed: u32, round: u64) -> Duration {
    let cleared = std::time::Instant::now();
    let recovered = {
        let engine = engine.clone();
        tokio::task::spawn_blocking(move || {
            engine.wait_shard_state(failed, ShardState::Serving, Duration::from_secs(5))
        })
        .await
        .unwrap()
    };
    assert!(recovered, "round {round}: shard {failed} did not recover within 5 s");
    cleared.elapsed()
}

/// One round under load: a random store fault, checked while failed, then cleared; the recovery time.
async fn fault_round(
    server: &Running,
    channel: &Channel,
    fates: &Fates,
    round: u64,
    seed: &mut u64,
) -> Duration {
    let (engine, faults) = (&server.engine, &server.faults);
    let load = start_clients(channel, round, fates);
    // Reopens fail until the fault clears; the failpoint fires at a random operation.
    faults.fail_opens(u32::MAX);
    faults.fail_op_after(next_fault_after(seed));
    let failed = wait_for_a_failed_shard(engine).await;

    // While failed: its keys are refused, the other shard serves, health says so.
    the_failed_shard_refuses_and_the_other_serves(channel, engine, failed, round).await;
    let mut watch = watch_gate_health(channel).await;
    wait_for_health(&mut watch, ServingStatus::NotServing).await;

    // The fault clears: the shard must serve again within 5 s.
    faults.fail_opens(0);
    let recovery = recovers_within_5s(engine, failed, round).await;
    wait_for_health(&mut watch, ServingStatus::Serving).await;
    drop(watch);
    stop_clients(load, round).await;
    recovery
}

/// Every acknowledgement is durable; nothing refused was stored. Counts refused, granted, committed.
async fn every_ack_is_durable(channel: &Channel, fates: &BTreeMap<String, Fate>) -> [usize; 3] {
    let mut gate = GateClient::new(channel.clone());
    let mut counts = [0usize; 3];
    for (key, fate) in fates {
        let view = gate
            .get(pb::GetRequest { namespace: "live".into(), key: key.clone() })
            .await
            .unwrap()
            .into_inner();
        match fate {
            Fate::Refused => {
                counts[0] += 1;
                assert_eq!(view.state, pb::State::Free as i32, "{key}: refused, yet stored");
            }
            Fate::Granted(token) => {
                counts[1] += 1;
                assert_eq!(view.token, *token, "{key}: acknowledged grant lost");
                assert_ne!(view.state, pb::State::Free as i32, "{key}: acknowledged grant lost");
            }
            Fate::Committed(token) => {
                counts[2] += 1;
                assert_eq!(
                    (view.state, view.token),
                    (pb::State::Completed as i32, *token),
                    "{key}: commit lost"
                );
                assert_eq!(view.response, key.as_bytes(), "{key}");
            }
        }
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_store_failures_under_load_fail_closed_and_recover() {
    let server = start_two_shards().await;
    let channel = server.channel().await;
    let fates: Fates = Arc::default();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut recoveries = Vec::new();
    for round in 0..ROUNDS {
        recoveries.push(fault_round(&server, &channel, &fates, round, &mut seed).await);
    }

    // Every acknowledgement is durable; nothing refused was stored.
    let fates = fates.lock().unwrap().clone();
    let counts = every_ack_is_durable(&channel, &fates).await;
    assert!(counts[0] > 0, "some reserves met the fault");
    println!(
        "faults under load: {ROUNDS} rounds, {} refused (none stored), {} grants and {} commits acknowledged (all stored), \
         recovery after clearing: max {:?}",
        counts[0],
        counts[1],
        counts[2],
        recoveries.iter().max().unwrap()
    );
    drop(channel);
    server.stop().await;
}
