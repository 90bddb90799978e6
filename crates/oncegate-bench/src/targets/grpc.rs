//! oncegate over gRPC, with a few HTTP/2 connections (one connection caps lower).

use oncegate_proto::v1 as pb;
use oncegate_proto::v1::gate_client::GateClient;
use tonic::transport::Channel;

use super::{Reserved, Target};
use crate::Work;

/// Connected gRPC clients.
#[derive(Clone)]
pub struct Grpc {
    clients: Vec<GateClient<Channel>>,
    stats: super::ServerStats,
}

impl Grpc {
    /// Connects to `addr` with `connections` HTTP/2 connections.
    pub async fn connect(addrs: &[String], connections: usize) -> anyhow::Result<Grpc> {
        let clients = super::channels(addrs, connections).await?.into_iter().map(GateClient::new).collect();
        Ok(Grpc { clients, stats: super::ServerStats::connect(addrs).await? })
    }

    fn client(&self, worker: usize) -> GateClient<Channel> {
        self.clients[worker % self.clients.len()].clone()
    }
}

impl Target for Grpc {
    fn name(&self) -> &'static str {
        "oncegate-grpc"
    }

    async fn reserve(&self, worker: usize, key: &str, _token: u64, work: &Work) -> anyhow::Result<Reserved> {
        Ok(reserved(self.client(worker).reserve(reserve_request(key, work)).await?.into_inner()))
    }

    async fn commit(
        &self,
        worker: usize,
        key: &str,
        token: u64,
        response: &[u8],
        _work: &Work,
    ) -> anyhow::Result<()> {
        self.client(worker).commit(commit_request(key, token, response)).await?;
        Ok(())
    }

    async fn batches(&self) -> Option<(u64, u64)> {
        self.stats.batches().await
    }
}

/// The bench's reserve, the same over unary calls and sessions.
pub(super) fn reserve_request(key: &str, work: &Work) -> pb::ReserveRequest {
    pb::ReserveRequest {
        namespace: "bench".into(),
        key: key.into(),
        ttl_ms: work.ttl_ms,
        lease_ms: work.lease_ms,
        ..Default::default()
    }
}

/// What a reserve's answer means to the load.
pub(super) fn reserved(reply: pb::ReserveResponse) -> Reserved {
    match reply.outcome {
        Some(pb::reserve_response::Outcome::Granted(g)) => Reserved::Granted(g.token),
        Some(pb::reserve_response::Outcome::Completed(_)) => Reserved::Replayed,
        _ => Reserved::Busy,
    }
}

/// The bench's commit of a response.
pub(super) fn commit_request(key: &str, token: u64, response: &[u8]) -> pb::CommitRequest {
    pb::CommitRequest {
        namespace: "bench".into(),
        key: key.into(),
        token,
        outcome: pb::Outcome::Succeeded as i32,
        response: response.to_vec(),
    }
}
