//! The floor under a unary call: the gRPC health check on the same server, over the same
//! client stack and connections as the unary target, with no storage behind it. A pair
//! is two checks, so its rate is what two unary calls can reach on this machine before
//! any of oncegate's work, and its CPU per pair is the front's fixed cost. It is not
//! quite the same call without the storage, and the differences pull both ways: the
//! check goes through the port's router (it is not a `Gate` call) and a floor pair is
//! always two calls, but its messages are empty and it has no tenant to authenticate.
//! Its name does not start with "oncegate", so the tool prints oncegate's targets'
//! ratios to it as to any peer.

use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use super::{Reserved, Target};
use crate::Work;

/// Connected health clients.
#[derive(Clone)]
pub struct Floor {
    clients: Vec<HealthClient<Channel>>,
}

impl Floor {
    /// Connects to `addrs` with `connections` HTTP/2 connections, as [`super::Grpc`] does.
    pub async fn connect(addrs: &[String], connections: usize) -> anyhow::Result<Floor> {
        let clients = super::channels(addrs, connections).await?.into_iter().map(HealthClient::new).collect();
        Ok(Floor { clients })
    }

    /// One check of the server's overall health, as each half of a pair.
    async fn check(&self, worker: usize) -> anyhow::Result<()> {
        let mut client = self.clients[worker % self.clients.len()].clone();
        client.check(HealthCheckRequest { service: String::new() }).await?;
        Ok(())
    }
}

impl Target for Floor {
    fn name(&self) -> &'static str {
        "grpc-floor"
    }

    async fn reserve(&self, worker: usize, _key: &str, token: u64, _work: &Work) -> anyhow::Result<Reserved> {
        self.check(worker).await?;
        Ok(Reserved::Granted(token))
    }

    async fn commit(
        &self,
        worker: usize,
        _key: &str,
        _token: u64,
        _response: &[u8],
        _work: &Work,
    ) -> anyhow::Result<()> {
        self.check(worker).await
    }
}
