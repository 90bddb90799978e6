//! oncegate in-process: the engine's own API, no network.

use oncegate_core::{Outcome, ReserveReply, Tenant};
use oncegate_engine::{CommitRequest, Engine, ReserveRequest};

use super::{Reserved, Target};
use crate::Work;

/// The embedded engine.
#[derive(Clone)]
pub struct Embedded {
    /// The engine; the caller shuts it down after the run.
    pub engine: Engine,
}

impl Target for Embedded {
    fn name(&self) -> &'static str {
        "oncegate-embedded"
    }

    async fn reserve(&self, _worker: usize, key: &str, _token: u64, work: &Work) -> anyhow::Result<Reserved> {
        let request = ReserveRequest {
            namespace: "bench".into(),
            key: key.into(),
            ttl_ms: work.ttl_ms,
            lease_ms: work.lease_ms,
            ..Default::default()
        };
        Ok(match self.engine.reserve(&Tenant::default_tenant(), request).await?.reply {
            ReserveReply::Granted { token, .. } => Reserved::Granted(token),
            ReserveReply::Completed { .. } => Reserved::Replayed,
            _ => Reserved::Busy,
        })
    }

    async fn commit(
        &self,
        _worker: usize,
        key: &str,
        token: u64,
        response: &[u8],
        _work: &Work,
    ) -> anyhow::Result<()> {
        let request = CommitRequest {
            namespace: "bench".into(),
            key: key.into(),
            token,
            outcome: Outcome::Succeeded,
            response: response.to_vec(),
        };
        self.engine.commit(&Tenant::default_tenant(), request).await?;
        Ok(())
    }

    async fn batches(&self) -> Option<(u64, u64)> {
        Some(self.engine.stats().iter().fold((0, 0), |(b, c), s| (b + s.batches, c + s.commands)))
    }
}
