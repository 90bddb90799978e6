//! `oncegate admin add-shards --to N`: asks a running server to add shards and spread the
//! slots over them (`Admin.AddShards`), shows the moves on a progress bar, and prints a
//! JSON summary (`oncegate_engine`'s `engine/resize.rs` does the work and says why each step is safe).

use oncegate_proto::v1 as pb;
use serde_json::{Value, json};

use crate::client::{AdminTarget, Answer, admin, admin_request, follow};

/// Flags of `oncegate admin add-shards`.
#[derive(clap::Args)]
pub struct AddShardsArgs {
    #[command(flatten)]
    target: AdminTarget,
    /// The shard count to reach; shards are only ever added. The same count again
    /// resumes an add that was interrupted.
    #[arg(long)]
    to: u32,
}

pub async fn run(args: AddShardsArgs) -> Answer {
    let request = admin_request(&args.target, pb::AddShardsRequest { shards_total: args.to })?;
    let mut stream = match admin(&args.target).await?.add_shards(request).await {
        Ok(response) => response.into_inner(),
        Err(status) => return Ok(Err(oncegate_client::Refusal::of_status(status))),
    };
    let template = "moving slots [{bar:40}] {pos}/{len} ({per_sec}, {eta})";
    let at = |p: &pb::AddShardsProgress| (p.done, u64::from(p.slots_moved), u64::from(p.slots_total));
    let last = follow(&mut stream, template, "the shards were added", at).await?;
    Ok(last.map(|done| summary(&done, args.to)))
}

fn summary(done: &pb::AddShardsProgress, to: u32) -> Value {
    json!({
        "shards_before": done.shards_before,
        "shards_after": to,
        "slots_moved": done.slots_moved,
        "records_moved": done.records_moved,
        "slot_map_version": done.slot_map_version,
        "slot_pause_ms": { "p50": done.pause_ms_p50, "p99": done.pause_ms_p99, "max": done.pause_ms_max },
    })
}
