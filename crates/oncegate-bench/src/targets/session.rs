//! oncegate over gRPC, every call multiplexed over `Session` streams (one per
//! connection): the pipelining a gateway gets from one stream, measured through the Rust
//! client's own stream driver (`oncegate_client`, `Transport::Session`), without retries.

use oncegate_client::{Client, CommitRequest, Gate, RetryPolicy, Transport};
use oncegate_core::gate::ReserveRequest;
use oncegate_proto::v1 as pb;

use super::grpc::{commit_request, reserve_request, reserved};
use super::{Reserved, Target};
use crate::Work;

/// One client, and so one stream, per connection.
#[derive(Clone)]
pub struct Session {
    clients: Vec<Client>,
    stats: super::ServerStats,
}

impl Session {
    /// Opens one client (one HTTP/2 connection, one `Session` stream) per connection,
    /// going round `addrs` (several nodes on one database).
    pub async fn connect(addrs: &[String], connections: usize) -> anyhow::Result<Session> {
        let mut clients = Vec::new();
        for n in 0..connections.max(addrs.len()) {
            let builder = Client::builder(addrs[n % addrs.len()].clone());
            clients.push(builder.transport(Transport::Session).retry(RetryPolicy::NONE).connect().await?);
        }
        Ok(Session { clients, stats: super::ServerStats::connect(addrs).await? })
    }

    fn client(&self, worker: usize) -> &Client {
        &self.clients[worker % self.clients.len()]
    }
}

impl Target for Session {
    fn name(&self) -> &'static str {
        "oncegate-session"
    }

    async fn reserve(&self, worker: usize, key: &str, _token: u64, work: &Work) -> anyhow::Result<Reserved> {
        let request = ReserveRequest::from(reserve_request(key, work));
        let answer = self.client(worker).reserve(request).await?;
        Ok(reserved(pb::ReserveResponse::from(answer)))
    }

    async fn commit(
        &self,
        worker: usize,
        key: &str,
        token: u64,
        response: &[u8],
        _work: &Work,
    ) -> anyhow::Result<()> {
        let request = CommitRequest::try_from(commit_request(key, token, response))?;
        self.client(worker).commit(request).await?;
        Ok(())
    }

    async fn batches(&self) -> Option<(u64, u64)> {
        self.stats.batches().await
    }
}
