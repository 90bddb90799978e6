//! The stores under load, one module each behind [`Target`]: each does the same durable
//! work (reserve a key with a lease and a ttl; commit a response; answer a duplicate with
//! the stored response).

mod embedded;
mod floor;
mod grpc;
mod postgres;
mod redis;
mod session;

use std::future::Future;

pub use embedded::Embedded;
pub use floor::Floor;
pub use grpc::Grpc;
pub use postgres::Postgres;
pub use redis::Redis;
pub use session::Session;

use crate::Work;

/// `connections` gRPC channels, going round the servers in `addrs` (several nodes on one
/// database), for the targets that make their own clients of them.
async fn channels(addrs: &[String], connections: usize) -> anyhow::Result<Vec<tonic::transport::Channel>> {
    let mut channels = Vec::new();
    for n in 0..connections.max(addrs.len()) {
        channels
            .push(tonic::transport::Channel::from_shared(addrs[n % addrs.len()].clone())?.connect().await?);
    }
    Ok(channels)
}

/// What one reserve answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reserved {
    /// The caller may proceed with this token.
    Granted(u64),
    /// The key was completed: its response was replayed.
    Replayed,
    /// Another attempt holds the key.
    Busy,
}

/// A store under load.
pub trait Target: Send + Sync + 'static {
    /// The name in reports.
    fn name(&self) -> &'static str;

    /// Reserves `key`; `token` is the caller's, for stores that do not make their own.
    fn reserve(
        &self,
        worker: usize,
        key: &str,
        token: u64,
        work: &Work,
    ) -> impl Future<Output = anyhow::Result<Reserved>> + Send;

    /// Commits `response` for the holder of `token`.
    fn commit(
        &self,
        worker: usize,
        key: &str,
        token: u64,
        response: &[u8],
        work: &Work,
    ) -> impl Future<Output = anyhow::Result<()>> + Send;

    /// Transactions and the commands in them so far, where the target can tell.
    fn batches(&self) -> impl Future<Output = Option<(u64, u64)>> + Send {
        async { None }
    }
}

/// The shards' counters of oncegate servers, read over their Admin service: every node's
/// shards, summed. `None` where a server does not answer (an admin token the tool lacks).
#[derive(Clone)]
struct ServerStats {
    clients: Vec<oncegate_proto::v1::admin_client::AdminClient<tonic::transport::Channel>>,
}

impl ServerStats {
    async fn connect(addrs: &[String]) -> anyhow::Result<ServerStats> {
        let channels = channels(addrs, addrs.len()).await?;
        Ok(ServerStats {
            clients: channels.into_iter().map(oncegate_proto::v1::admin_client::AdminClient::new).collect(),
        })
    }

    /// Transactions and the commands in them, summed over every node's shards.
    async fn batches(&self) -> Option<(u64, u64)> {
        let mut sum = (0, 0);
        for client in &self.clients {
            let stats = client.clone().shard_stats(oncegate_proto::v1::ShardStatsRequest {}).await.ok()?;
            for shard in stats.into_inner().shards {
                sum = (sum.0 + shard.batches, sum.1 + shard.commands);
            }
        }
        Some(sum)
    }
}

/// The targets, as the command line names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// oncegate over gRPC, one unary call per request.
    Grpc,
    /// oncegate over gRPC, calls multiplexed over one `Session` stream per connection.
    GrpcSession,
    /// The floor under a unary call: two gRPC health checks per pair on the same server
    /// and connections, with no storage behind them.
    GrpcFloor,
    /// oncegate in-process.
    Embedded,
    /// Redis with `appendfsync always`.
    Redis,
    /// PostgreSQL with synchronous commit.
    Postgres,
}
