//! `once` through a server killed (`kill -9`) while its works finish: every commit is
//! retried with its token until the server is back, so no work that ran is left
//! unconfirmed (before, a commit gave up after the client's 5 tries in about 0.4 s,
//! and 4 to 14 of 16 came back unconfirmed).

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use common::Server;
use oncegate_client::{
    Client, ClientError, CommitRequest, Gate, GateExt, KeyRequest, OnceOptions, Ran, Renewed, ReserveRequest,
    Reserved, State, View, WorkError,
};

const WORKS: usize = 16;

/// The client, noting each key whose commit failed at least once (by key: tokens are
/// unique per key, and two shards may issue the same one).
#[derive(Clone)]
struct Noting {
    client: Client,
    failed: Arc<Mutex<HashSet<String>>>,
    changed: Arc<tokio::sync::Notify>,
}

impl Gate for Noting {
    type Error = ClientError;

    fn reserve(&self, r: ReserveRequest) -> impl Future<Output = Result<Reserved, ClientError>> + Send {
        self.client.reserve(r)
    }
    fn commit(&self, r: CommitRequest) -> impl Future<Output = Result<u64, ClientError>> + Send {
        let this = self.clone();
        async move {
            let key = r.key.clone();
            let committed = this.client.commit(r).await;
            if committed.is_err() {
                this.failed.lock().unwrap().insert(key);
                this.changed.notify_one();
            }
            committed
        }
    }
    fn release(&self, r: KeyRequest) -> impl Future<Output = Result<(), ClientError>> + Send {
        self.client.release(r)
    }
    fn heartbeat(&self, r: KeyRequest) -> impl Future<Output = Result<Renewed, ClientError>> + Send {
        self.client.heartbeat(r)
    }
    fn get(&self, r: KeyRequest) -> impl Future<Output = Result<View, ClientError>> + Send {
        self.client.get(r)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_ride_through_a_server_killed_while_works_finish() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let listen = server.addr.trim_start_matches("http://").to_owned();
    let client = Client::builder(server.addr.clone()).connect().await.unwrap();
    let gate = Noting { client, failed: Arc::default(), changed: Arc::default() };
    let started = Arc::new(tokio::sync::Barrier::new(WORKS + 1));
    let (finish, finishing) = tokio::sync::watch::channel(false);
    let works: Vec<_> = (0..WORKS)
        .map(|i| {
            let (gate, started, mut finishing) = (gate.clone(), Arc::clone(&started), finishing.clone());
            tokio::spawn(async move {
                gate.once("live", format!("order-{i}"), OnceOptions::default(), |lease| async move {
                    started.wait().await;
                    finishing.wait_for(|go| *go).await.expect("the test keeps the sender");
                    Ok::<_, WorkError<std::io::Error>>(format!("filled {}", lease.token).into_bytes())
                })
                .await
            })
        })
        .collect();
    started.wait().await;
    server.kill();
    finish.send(true).unwrap();
    // Every work has ended and its commit has failed at least once against the dead
    // server before it comes back.
    while gate.failed.lock().unwrap().len() < WORKS {
        gate.changed.notified().await;
    }
    let back = Server::start_at(dir.path(), &listen, &[]);
    for work in works {
        let ran = work.await.unwrap();
        assert!(matches!(ran, Ok(Ran::Now(_))), "every commit is confirmed: {ran:?}");
    }
    for i in 0..WORKS {
        let key = KeyRequest { namespace: "live".into(), key: format!("order-{i}"), ..Default::default() };
        assert_eq!(gate.get(key).await.unwrap().state, State::Completed, "order-{i}");
    }
    drop(gate);
    assert!(back.terminate(), "a clean stop");
}
