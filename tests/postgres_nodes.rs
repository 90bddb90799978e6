//! Two `oncegate serve` nodes on one PostgreSQL database, as an operator runs them: keys
//! are served by either node, and a node killed with SIGKILL under load loses nothing it
//! acknowledged while the other keeps serving every key.

mod common;
#[path = "../crates/oncegate-engine/tests/common/pg.rs"]
mod pg;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use common::Server;
use oncegate_proto::v1 as pb;
use oncegate_proto::v1::gate_client::GateClient;
use pb::reserve_response::Outcome as O;

const CLIENTS_PER_NODE: usize = 8;

/// Acknowledged commits: key to (token, response).
type Acked = Arc<Mutex<BTreeMap<String, (u64, Vec<u8>)>>>;

fn node(dir: &std::path::Path, url: &str) -> Server {
    Server::start(dir, &["--store", "postgres", "--postgres-url", url, "--shards", "2"])
}

/// Reserves fresh keys and commits each with its name until stopped or the node is gone;
/// every commit the node acknowledges is recorded, and `progress` hears of it.
async fn load(
    addr: String,
    client: usize,
    stop: Arc<AtomicBool>,
    acked: Acked,
    progress: tokio::sync::mpsc::UnboundedSender<()>,
) {
    let Ok(mut gate) = GateClient::connect(addr.clone()).await else { return };
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let key = format!("{addr}-{client}-{n}");
        let reserve = pb::ReserveRequest {
            namespace: "live".into(),
            key: key.clone(),
            ttl_ms: 3_600_000,
            lease_ms: 60_000,
            ..Default::default()
        };
        let Ok(reply) = gate.reserve(reserve).await else { return };
        let Some(O::Granted(granted)) = reply.into_inner().outcome else { panic!("a fresh key is granted") };
        let commit = pb::CommitRequest {
            namespace: "live".into(),
            key: key.clone(),
            token: granted.token,
            outcome: pb::Outcome::Succeeded.into(),
            response: key.clone().into_bytes(),
        };
        if gate.commit(commit).await.is_err() {
            return;
        }
        acked.lock().unwrap().insert(key.clone(), (granted.token, key.into_bytes()));
        let _ = progress.send(());
    }
}

#[test]
fn a_node_killed_under_load_loses_nothing_and_the_other_serves_every_key() {
    let Some(cluster) = pg::shared() else { return };
    let url = cluster.database("nodes");
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = (node(dir_a.path(), &url), node(dir_b.path(), &url));
    let (addr_a, addr_b) = (a.addr.clone(), b.addr.clone());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, mut progress) = tokio::sync::mpsc::unbounded_channel();
    let mut clients = Vec::new();
    for client in 0..CLIENTS_PER_NODE {
        for addr in [&addr_a, &addr_b] {
            let task = load(addr.clone(), client, Arc::clone(&stop), Arc::clone(&acked), tx.clone());
            clients.push(runtime.spawn(task));
        }
    }
    // Kill A once both nodes have acknowledged a few hundred commits between them.
    runtime.block_on(async {
        for _ in 0..300 {
            progress.recv().await.unwrap();
        }
    });
    a.kill();
    let at_kill = acked.lock().unwrap().len();
    // B goes on: another hundred commits after A died. Counted in the map, not in messages:
    // messages of commits acknowledged before the kill may still be queued.
    runtime.block_on(async {
        while acked.lock().unwrap().len() < at_kill + 100 {
            progress.recv().await.unwrap();
        }
    });
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        runtime.block_on(client).unwrap();
    }
    let acked = acked.lock().unwrap().clone();
    assert!(acked.len() >= at_kill + 100);
    let from_a = acked.keys().filter(|k| k.starts_with(&addr_a)).count();
    assert!(from_a > 0, "A acknowledged commits before it was killed");
    // Every commit either node acknowledged is on B, exactly as acknowledged.
    runtime.block_on(async {
        let mut gate = GateClient::connect(addr_b.clone()).await.unwrap();
        for (key, (token, response)) in &acked {
            let request = pb::GetRequest { namespace: "live".into(), key: key.clone() };
            let view = gate.get(request).await.unwrap().into_inner();
            assert_eq!(view.state(), pb::State::Completed, "{key}");
            assert_eq!((&view.token, &view.response), (token, response), "{key}");
        }
    });
    assert!(b.terminate(), "B shuts down cleanly");
}
