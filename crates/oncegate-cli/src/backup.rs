//! `oncegate admin backup --to DIR`: asks a running server for a consistent copy of its
//! data directory (`Admin.Backup`), written on the server's machine while it serves,
//! shows the shards copied on a progress bar, and prints a JSON summary. Restoring is
//! starting a server on the copy (`oncegate_engine`'s `backup.rs` says why it is safe).

use oncegate_proto::v1 as pb;
use serde_json::{Value, json};

use crate::client::{AdminTarget, Answer, admin, admin_request, follow};

/// Flags of `oncegate admin backup`.
#[derive(clap::Args)]
pub struct BackupArgs {
    #[command(flatten)]
    target: AdminTarget,
    /// The directory to write, on the server's machine: new, or empty.
    #[arg(long)]
    to: String,
}

pub async fn run(args: BackupArgs) -> Answer {
    let request = admin_request(&args.target, pb::BackupRequest { to: args.to.clone() })?;
    let mut stream = match admin(&args.target).await?.backup(request).await {
        Ok(response) => response.into_inner(),
        Err(status) => return Ok(Err(oncegate_client::Refusal::of_status(status))),
    };
    let template = "copying shards [{bar:40}] {pos}/{len} ({eta})";
    let at = |p: &pb::BackupProgress| (p.done, u64::from(p.shards_copied), u64::from(p.shards_total));
    let last = follow(&mut stream, template, "the backup was written", at).await?;
    Ok(last.map(|done| summary(&done, &args.to)))
}

fn summary(done: &pb::BackupProgress, to: &str) -> Value {
    json!({ "to": to, "shards": done.shards_copied, "bytes": done.bytes })
}
