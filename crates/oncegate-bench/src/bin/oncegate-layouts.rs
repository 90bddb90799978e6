//! `oncegate-layouts`: the shard file's record layouts side by side on SQLite alone
//! (the engine's settings), on a preloaded store: bytes written and CPU per
//! reserve+commit pair, the WAL and a final checkpoint counted.
//!
//! ```sh
//! cargo run --release -p oncegate-bench --bin oncegate-layouts -- --preload 200000 --pairs 40000 --dir /work
//! ```

use clap::Parser;
use oncegate_bench::layouts::{Layout, measure};

#[derive(Parser)]
struct Cli {
    /// Layouts, in the order they run.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "today,compact,append-indexed,append-in-memory,append-in-memory-full,append-split"
    )]
    layouts: Vec<Layout>,
    /// Completed records in the store before measuring.
    #[arg(long, default_value_t = 200_000)]
    preload: u64,
    /// Pairs measured.
    #[arg(long, default_value_t = 40_000)]
    pairs: u64,
    /// Keys per transaction.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Where the files go (a real disk, for the figures to mean anything).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Each transaction holds a batch's reserves and the previous batch's commits, as
    /// the engine's do at moderate load (otherwise a batch of reserves, then their commits).
    #[arg(long)]
    interleaved: bool,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let scratch = tempfile::tempdir_in(cli.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    println!(
        "| layout | pairs/s | CPU µs/pair | disk bytes/pair | device bytes/pair | file MiB |\n| --- | --- | --- | --- | --- | --- |"
    );
    let mut measured = Vec::new();
    for layout in cli.layouts {
        measured.push(measure(scratch.path(), layout, cli.preload, cli.pairs, cli.batch, cli.interleaved)?);
    }
    for m in measured {
        println!(
            "| {} | {:.0} | {:.1} | {:.0} | {:.0} | {:.1} |",
            m.layout,
            m.pairs_per_s,
            m.cpu_us_per_pair,
            m.disk_bytes_per_pair,
            m.device_bytes_per_pair,
            m.file_bytes as f64 / 1048576.0
        );
    }
    Ok(())
}
