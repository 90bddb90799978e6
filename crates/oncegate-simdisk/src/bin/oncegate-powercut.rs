//! Runs the power-loss harness for as many cuts as asked and prints what it checked.
//!
//! `cargo run --release -p oncegate-simdisk --bin oncegate-powercut -- --cuts 100000`

use clap::Parser;
use oncegate_engine::Durability;
use oncegate_simdisk::harness::{Plan, run};

/// Cuts the power under the embedded engine, again and again, and checks every
/// acknowledged call after each restart.
#[derive(Parser)]
#[command(name = "oncegate-powercut")]
struct Args {
    /// Power cuts to make.
    #[arg(long, default_value_t = 1_000)]
    cuts: u64,
    /// Every how many cuts one is torn (0: none).
    #[arg(long, default_value_t = 2)]
    torn_every: u64,
    /// Client threads.
    #[arg(long, default_value_t = 6)]
    clients: usize,
    /// Keys each client works on at a time.
    #[arg(long, default_value_t = 12)]
    keys_per_client: usize,
    /// Shards.
    #[arg(long, default_value_t = 3)]
    shards: u32,
    /// SQLite's page cache per shard, in pages (0: the configuration's); a few pages make
    /// batches spill it.
    #[arg(long, default_value_t = 0)]
    cache_pages: u64,
    /// Committed responses padded to this many bytes.
    #[arg(long, default_value_t = 0)]
    response_bytes: usize,
    /// The most acknowledged calls between two cuts.
    #[arg(long, default_value_t = 240)]
    calls_per_cut_max: u64,
    /// Run with `durability = "normal"` (the harness should report losses).
    #[arg(long)]
    normal: bool,
    /// Switch on the deliberate ack-before-commit bug (the harness should report losses).
    #[arg(long)]
    ack_before_commit: bool,
    /// The most keys a client ever works on (then it grants, heartbeats and releases
    /// only); unbounded when absent.
    #[arg(long)]
    client_keys_max: Option<u64>,
    /// The seed of every random choice.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Cuts per progress line.
    #[arg(long, default_value_t = 1_000)]
    report_every: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let started = std::time::Instant::now();
    let mut total = oncegate_simdisk::harness::Report::default();
    let mut done = 0;
    // Runs in chunks on fresh disks, so that progress shows and memory stays flat.
    while done < args.cuts {
        let cuts = args.report_every.min(args.cuts - done);
        let plan = Plan {
            cuts,
            torn_every: args.torn_every,
            clients: args.clients,
            keys_per_client: args.keys_per_client,
            shards: args.shards,
            cache_pages: args.cache_pages,
            response_bytes: args.response_bytes,
            calls_per_cut_max: args.calls_per_cut_max,
            durability: if args.normal { Durability::Normal } else { Durability::Full },
            ack_before_commit: args.ack_before_commit,
            client_keys_max: args.client_keys_max.unwrap_or(u64::MAX),
            seed: args.seed.wrapping_add(done),
            ..Plan::default()
        };
        let report = run(&plan);
        done += cuts;
        total.absorb(report);
        println!("{total}, {:.1} s", started.elapsed().as_secs_f64());
        if !total.violations.is_empty() {
            break;
        }
    }
    for violation in total.violations.iter().take(20) {
        println!("violation: {violation}");
    }
    if total.violations.is_empty() { Ok(()) } else { anyhow::bail!("{} violations", total.violations.len()) }
}
