//! The `oncegate.v1.Admin` service: inspect a key, list shard statistics, force-release
//! a pending key, purge a record, reopen a shard, add shards online. Every change is
//! logged with its reason.

use oncegate_core::{Invalid, Tenant, Transition};
use oncegate_engine::Engine;
use oncegate_proto::v1 as pb;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// Progress messages an `AddShards` stream queues for a slow reader before it drops some.
const PROGRESS_QUEUE_LEN: usize = 64;

use crate::auth::AdminAuth;
use oncegate_proto::convert::state_to_wire;

use crate::gate::key_digest;
use crate::status::{Refusal, invalid, status};

/// The two ways an operator removes a key's record.
#[derive(Clone, Copy, Debug)]
enum Removal {
    /// Frees a pending or abandoned key.
    ForceRelease,
    /// Deletes a record in any state.
    Purge,
}

impl Removal {
    fn as_str(self) -> &'static str {
        match self {
            Removal::ForceRelease => "force_release",
            Removal::Purge => "purge",
        }
    }
}

/// The operator's service over an engine.
pub struct AdminService {
    engine: Engine,
    auth: AdminAuth,
}

impl AdminService {
    /// A service over `engine`, checking calls with `auth`.
    pub fn new(engine: Engine, auth: AdminAuth) -> AdminService {
        AdminService { engine, auth }
    }

    /// Force-release or purge: the same checks, the engine call, and the log line.
    async fn remove(
        &self,
        request: Request<pb::AdminKeyRequest>,
        removal: Removal,
    ) -> Result<Response<pb::AdminKeyResponse>, Status> {
        self.auth.check(request.metadata())?;
        let r = request.into_inner();
        let why = reason(&r)?;
        let scope = self.scope(&r.tenant, &r.namespace, &r.key)?;
        let removed = match removal {
            Removal::ForceRelease => self.engine.force_release(scope).await,
            Removal::Purge => self.engine.purge(scope).await,
        };
        let action = removal.as_str();
        let (previous, token) = removed.map_err(status)?;
        tracing::warn!(
            action, who = "admin", reason = %why, tenant = %r.tenant, namespace = %r.namespace,
            key = %key_digest(&r.key), token, previous = ?previous, "operator removed a key's record"
        );
        Ok(Response::new(pb::AdminKeyResponse { previous: state_to_wire(previous), token }))
    }

    fn scope(&self, tenant: &str, namespace: &str, key: &str) -> Result<oncegate_core::Scope, Status> {
        let tenant = Tenant::new(tenant).map_err(invalid)?;
        self.engine.scope(&tenant, namespace, key).map_err(status)
    }
}

fn reason(request: &pb::AdminKeyRequest) -> Result<String, Status> {
    let reason = request.reason.trim();
    if reason.is_empty() {
        return Err(invalid(Invalid::Empty { field: "reason" }));
    }
    if reason.len() > 1024 {
        return Err(invalid(Invalid::TooLong { field: "reason", len: reason.len(), max: 1024 }));
    }
    Ok(reason.to_owned())
}

#[tonic::async_trait]
impl pb::admin_server::Admin for AdminService {
    async fn inspect(
        &self,
        request: Request<pb::InspectRequest>,
    ) -> Result<Response<pb::InspectResponse>, Status> {
        self.auth.check(request.metadata())?;
        let r = request.into_inner();
        let scope = self.scope(&r.tenant, &r.namespace, &r.key)?;
        let (shard, state, record) = self.engine.inspect(scope).await.map_err(status)?;
        let Some(record) = record else {
            return Ok(Response::new(pb::InspectResponse {
                shard,
                state: pb::State::Free as i32,
                ..Default::default()
            }));
        };
        let completion = record.completion.as_ref();
        Ok(Response::new(pb::InspectResponse {
            shard,
            state: state_to_wire(state),
            token: record.token,
            attempt: record.attempt,
            lease_until_ms: record.lease_until_ms,
            expires_at_ms: record.expires_at_ms,
            ttl_ms: record.ttl_ms,
            fingerprint: record.fingerprint.as_bytes().to_vec(),
            outcome: completion.map_or(pb::Outcome::Unspecified as i32, |c| match c.outcome {
                oncegate_core::Outcome::Succeeded => pb::Outcome::Succeeded as i32,
                oncegate_core::Outcome::Failed => pb::Outcome::Failed as i32,
            }),
            response: completion.map(|c| c.response.clone()).unwrap_or_default(),
            completed_at_ms: completion.map_or(0, |c| c.completed_at_ms),
            history: record
                .history
                .iter()
                .map(|e| pb::HistoryEvent {
                    kind: match e.transition {
                        Transition::Granted => pb::TransitionKind::TransitionGranted,
                        Transition::Heartbeat => pb::TransitionKind::TransitionHeartbeat,
                        Transition::Abandoned => pb::TransitionKind::TransitionAbandoned,
                        Transition::Regranted => pb::TransitionKind::TransitionRegranted,
                        Transition::Committed => pb::TransitionKind::TransitionCommitted,
                    } as i32,
                    at_ms: e.at_ms,
                    token: e.token,
                })
                .collect(),
        }))
    }

    async fn shard_stats(
        &self,
        request: Request<pb::ShardStatsRequest>,
    ) -> Result<Response<pb::ShardStatsResponse>, Status> {
        self.auth.check(request.metadata())?;
        let shards = self
            .engine
            .stats()
            .into_iter()
            .map(|s| pb::ShardStats {
                shard: s.shard,
                slots: s.slots,
                state: s.state.as_str().to_owned(),
                mailbox_depth: s.mailbox_depth as u64,
                batches: s.batches,
                commands: s.commands,
                batch_len_mean: s.batch_len_mean,
                commits: s.commits,
                failures: s.failures,
                reclaimed: s.reclaimed,
                waiters: s.waiters,
                records_pending: s.records_pending,
                records_completed: s.records_completed,
                last_error: s.last_error.unwrap_or_default(),
            })
            .collect();
        // A serving engine moves one slot at a time (groups are the offline reshard's).
        let moving = self.engine.slot_moving().map(|m| pb::SlotMove {
            slot: m.slots.iter().next().unwrap_or_default(),
            from_shard: m.from,
            to_shard: m.to,
        });
        Ok(Response::new(pb::ShardStatsResponse { shards, moving }))
    }

    async fn force_release(
        &self,
        request: Request<pb::AdminKeyRequest>,
    ) -> Result<Response<pb::AdminKeyResponse>, Status> {
        self.remove(request, Removal::ForceRelease).await
    }

    async fn purge(
        &self,
        request: Request<pb::AdminKeyRequest>,
    ) -> Result<Response<pb::AdminKeyResponse>, Status> {
        self.remove(request, Removal::Purge).await
    }

    async fn reopen_shard(
        &self,
        request: Request<pb::ReopenShardRequest>,
    ) -> Result<Response<pb::ReopenShardResponse>, Status> {
        self.auth.check(request.metadata())?;
        let shard = request.into_inner().shard;
        let shards = self.engine.stats().len() as u32;
        if shard >= shards {
            return Err(invalid(Invalid::OutOfRange {
                field: "shard",
                value: u64::from(shard),
                min: 0,
                max: u64::from(shards - 1),
                unit: oncegate_core::Unit::Count,
            }));
        }
        let engine = self.engine.clone();
        let serving = tokio::task::spawn_blocking(move || engine.reopen_shard(shard))
            .await
            .map_err(|e| status(oncegate_engine::Error::Unavailable { shard, reason: e.to_string() }))?
            .map_err(status)?;
        tracing::warn!(action = "reopen_shard", who = "admin", shard, serving, "operator reopened a shard");
        Ok(Response::new(pb::ReopenShardResponse { serving }))
    }

    type AddShardsStream = Progress<pb::AddShardsProgress>;

    async fn add_shards(
        &self,
        request: Request<pb::AddShardsRequest>,
    ) -> Result<Response<Self::AddShardsStream>, Status> {
        self.auth.check(request.metadata())?;
        let to = request.into_inner().shards_total;
        let engine = self.engine.clone();
        tracing::warn!(action = "add_shards", who = "admin", to, "operator started adding shards");
        // The moves block on shard replies and fsyncs; they go on if the caller goes away
        // (a half-spread map is correct, only uneven).
        let unanswered = || Refusal::Ended { what: "the add" }.to_status();
        stream_blocking(unanswered, move |tx| {
            engine
                .add_shards(to, &mut |moved, total| {
                    // Progress is advisory: a slow reader loses some, never slows a move.
                    let _ = tx.try_send(Ok(pb::AddShardsProgress {
                        slots_moved: moved,
                        slots_total: total,
                        ..Default::default()
                    }));
                })
                .map(|done| {
                    tracing::warn!(
                        action = "add_shards", who = "admin", to, slots_moved = done.slots_moved,
                        records_moved = done.records_moved, "shards added"
                    );
                    pb::AddShardsProgress {
                        slots_moved: done.slots_moved,
                        slots_total: done.slots_moved,
                        done: true,
                        records_moved: done.records_moved,
                        shards_before: done.shards_before,
                        slot_map_version: done.map_version,
                        pause_ms_p50: done.pauses.map_or(0.0, |p| p.p50_ms),
                        pause_ms_p99: done.pauses.map_or(0.0, |p| p.p99_ms),
                        pause_ms_max: done.pauses.map_or(0.0, |p| p.max_ms),
                    }
                })
                .map_err(|error| {
                    tracing::error!(action = "add_shards", who = "admin", to, %error, "adding shards stopped");
                    Refusal::AddShards(error).to_status()
                })
        })
        .await
    }

    type BackupStream = Progress<pb::BackupProgress>;

    async fn backup(
        &self,
        request: Request<pb::BackupRequest>,
    ) -> Result<Response<Self::BackupStream>, Status> {
        self.auth.check(request.metadata())?;
        let to = std::path::PathBuf::from(request.into_inner().to);
        let engine = self.engine.clone();
        tracing::warn!(action = "backup", who = "admin", to = %to.display(), "operator started a backup");
        // The copies read whole files and sync them; a backup the caller leaves goes on to
        // its end (the directory is complete or it is an error).
        let unanswered = || Refusal::Ended { what: "the backup" }.to_status();
        stream_blocking(unanswered, move |tx| {
            engine
                .backup(&to, &mut |copied, total| {
                    // Progress is advisory: a slow reader loses some, never slows the copy.
                    let _ = tx.try_send(Ok(pb::BackupProgress {
                        shards_copied: copied,
                        shards_total: total,
                        ..Default::default()
                    }));
                })
                .map(|done| {
                    tracing::warn!(action = "backup", who = "admin", to = %done.to.display(), shards = done.shards, bytes = done.bytes, "backup written");
                    pb::BackupProgress { shards_copied: done.shards, shards_total: done.shards, done: true, bytes: done.bytes }
                })
                .map_err(|error| {
                    tracing::error!(action = "backup", who = "admin", %error, "the backup stopped");
                    Refusal::Backup(error).to_status()
                })
        })
        .await
    }
}

/// A streamed answer of progress messages.
type Progress<T> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

/// Runs `work` off the async workers (it blocks on shard replies and fsyncs) and streams
/// the progress it sends, then its last message. The first message comes once the
/// request is checked: a refusal then is the call's status rather than the stream's end;
/// `unanswered` is the status when the work ended without a word.
async fn stream_blocking<T: Send + 'static>(
    unanswered: impl FnOnce() -> Status,
    work: impl FnOnce(&tokio::sync::mpsc::Sender<Result<T, Status>>) -> Result<T, Status> + Send + 'static,
) -> Result<Response<Progress<T>>, Status> {
    let (tx, mut rx) = tokio::sync::mpsc::channel(PROGRESS_QUEUE_LEN);
    tokio::task::spawn_blocking(move || {
        let last = work(&tx);
        let _ = tx.blocking_send(last);
    });
    let first = match rx.recv().await {
        Some(Ok(first)) => first,
        Some(Err(status)) => return Err(status),
        None => return Err(unanswered()),
    };
    let stream = tokio_stream::StreamExt::chain(tokio_stream::once(Ok(first)), ReceiverStream::new(rx));
    Ok(Response::new(Box::pin(stream)))
}
