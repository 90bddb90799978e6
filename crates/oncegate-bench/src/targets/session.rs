//! oncegate over gRPC, every call multiplexed over `Session` streams (one per
//! connection): the pipelining a gateway or the Rust client gets from one stream.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context;
use oncegate_proto::v1 as pb;
use oncegate_proto::v1::gate_client::GateClient;
use pb::session_request::Call;
use pb::session_response::Result as Out;
use tokio::sync::{mpsc, oneshot};
use tonic::transport::Channel;

use super::grpc::{commit_request, reserve_request, reserved};
use super::{Reserved, Target};
use crate::Work;

/// A call waiting for its answer.
type Waiting = (pb::SessionRequest, oneshot::Sender<Out>);

/// One stream per connection, each driven by a task that matches answers to callers.
#[derive(Clone)]
pub struct Session {
    streams: Vec<mpsc::Sender<Waiting>>,
    ids: Arc<AtomicU64>,
}

impl Session {
    /// Opens one `Session` stream on each of `connections` HTTP/2 connections to `addr`.
    pub async fn connect(addrs: &[String], connections: usize) -> anyhow::Result<Session> {
        let mut streams = Vec::new();
        for n in 0..connections.max(addrs.len()) {
            // Connections go round the servers (several nodes on one database).
            let channel = Channel::from_shared(addrs[n % addrs.len()].clone())?.connect().await?;
            streams.push(open(GateClient::new(channel)).await?);
        }
        Ok(Session { streams, ids: Arc::new(AtomicU64::new(1)) })
    }

    async fn call(&self, worker: usize, call: Call) -> anyhow::Result<Out> {
        let id = self.ids.fetch_add(1, Ordering::Relaxed);
        let (answer, answered) = oneshot::channel();
        let stream = &self.streams[worker % self.streams.len()];
        stream
            .send((pb::SessionRequest { id, call: Some(call) }, answer))
            .await
            .context("the stream ended")?;
        match answered.await.context("the stream ended")? {
            Out::Refusal(refusal) => anyhow::bail!("refused: {} ({})", refusal.message, refusal.code),
            out => Ok(out),
        }
    }
}

/// Starts a stream and the task that sends its calls and routes its answers by id.
async fn open(mut client: GateClient<Channel>) -> anyhow::Result<mpsc::Sender<Waiting>> {
    let (calls, mut queued) = mpsc::channel::<Waiting>(1024);
    let (requests, outgoing) = mpsc::channel(1024);
    let mut answers =
        client.session(tokio_stream::wrappers::ReceiverStream::new(outgoing)).await?.into_inner();
    tokio::spawn(async move {
        let mut waiting: HashMap<u64, oneshot::Sender<Out>> = HashMap::new();
        loop {
            tokio::select! {
                call = queued.recv() => {
                    let Some((request, answer)) = call else { return };
                    waiting.insert(request.id, answer);
                    if requests.send(request).await.is_err() {
                        return;
                    }
                }
                answer = answers.message() => {
                    let Ok(Some(answer)) = answer else { return };
                    if let (Some(caller), Some(result)) = (waiting.remove(&answer.id), answer.result) {
                        let _ = caller.send(result);
                    }
                }
            }
        }
    });
    Ok(calls)
}

impl Target for Session {
    fn name(&self) -> &'static str {
        "oncegate-session"
    }

    async fn reserve(&self, worker: usize, key: &str, _token: u64, work: &Work) -> anyhow::Result<Reserved> {
        let Out::Reserve(reply) = self.call(worker, Call::Reserve(reserve_request(key, work))).await? else {
            anyhow::bail!("a reserve answered with another call's reply")
        };
        Ok(reserved(reply))
    }

    async fn commit(
        &self,
        worker: usize,
        key: &str,
        token: u64,
        response: &[u8],
        _work: &Work,
    ) -> anyhow::Result<()> {
        self.call(worker, Call::Commit(commit_request(key, token, response))).await?;
        Ok(())
    }
}
