//! `oncegate reshard`: adds shards to a stopped data directory, with a progress bar, and
//! prints a JSON summary (`oncegate_engine::reshard` does the work and says why each step
//! is safe).

use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};
use oncegate_engine::{EngineConfig, StoreConfig};
use oncegate_server::Config;

/// Flags of `oncegate reshard`.
#[derive(clap::Args)]
pub struct ReshardArgs {
    /// The stopped server's data directory (the running server holds its lock).
    #[arg(long)]
    data_dir: PathBuf,
    /// The shard count to reach; shards are only ever added.
    #[arg(long)]
    to: u32,
    /// The server's TOML configuration file, for its engine and SQLite settings
    /// (`store.shard_file_bytes_max`, the page cache). Only SQLite directories have
    /// slots to move, whatever the file's `store.kind`.
    #[arg(long, env = "ONCEGATE_CONFIG")]
    config: Option<PathBuf>,
}

pub fn run(args: ReshardArgs) -> anyhow::Result<()> {
    let file = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    let store = StoreConfig::Sqlite(file.store.sqlite());
    let config = EngineConfig { data_dir: args.data_dir, store, ..file.engine_config() };
    let bar = ProgressBar::new(0);
    if let Ok(style) = ProgressStyle::with_template("moving slots [{bar:40}] {pos}/{len}") {
        bar.set_style(style.progress_chars("=> "));
    }
    let done = oncegate_engine::reshard::add_shards(&config, args.to, &mut |moved, total| {
        bar.set_length(u64::from(total));
        bar.set_position(u64::from(moved));
    })?;
    bar.finish_and_clear();
    let summary = serde_json::json!({
        "shards_before": done.shards_before,
        "shards_after": done.shards_after,
        "slots_moved": done.slots_moved,
        "records_moved": done.records_moved,
        "slot_map_version": done.map_version,
    });
    println!("{summary}");
    Ok(())
}
