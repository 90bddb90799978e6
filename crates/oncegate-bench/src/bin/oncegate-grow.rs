//! `oncegate-grow`: what adding shards online costs the traffic. An embedded engine on a
//! preloaded store serves reserve+commit pairs at 2 shards, then while
//! `Engine::add_shards` moves slots to the new shards, then after; each phase is
//! reported like a bench run (pairs/s, latencies, CPU and disk per pair), with the add's
//! own figures: how long it took and how long each moved slot's requests were held.

use std::time::{Duration, Instant};

use clap::Parser;
use oncegate_bench::Work;
use oncegate_bench::cost::Probe;
use oncegate_bench::report::{Report, markdown};
use oncegate_bench::runner::{self, Load};
use oncegate_bench::targets::Embedded;

/// Flags of `oncegate-grow`.
#[derive(Parser)]
#[command(name = "oncegate-grow", about)]
struct Cli {
    /// Completed records in the store before the run.
    #[arg(long, default_value_t = 1_000_000)]
    preload: u64,
    /// Shards the store starts with.
    #[arg(long, default_value_t = 2)]
    shards: u32,
    /// Shards to add up to.
    #[arg(long, default_value_t = 4)]
    to: u32,
    /// Pairs in flight.
    #[arg(long, default_value_t = 64)]
    in_flight: usize,
    /// Measured seconds of the phases before and after the add, and the longest of the
    /// phase during it (which ends earlier when the add does).
    #[arg(long, default_value_t = 20.0)]
    phase_s: f64,
    /// `engine.slot_moves_per_second_max` for the add.
    #[arg(long, default_value_t = 200)]
    slot_moves_per_second_max: u32,
    /// `store.page_cache_bytes_max`: SQLite's page cache per shard.
    #[arg(long, default_value_t = oncegate_engine::SqliteConfig::default().page_cache_bytes_max)]
    page_cache_bytes_max: u64,
    /// Where the scratch store goes (a temporary directory under it).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let scratch = tempfile::tempdir_in(cli.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    let data_dir = scratch.path().join("store");
    if cli.preload > 0 {
        let store = oncegate_engine::StoreConfig::default();
        let took = oncegate_bench::preload::preload(&data_dir, cli.shards, store, cli.preload, 512)?;
        eprintln!("preloaded {} records in {:.0} s", cli.preload, took.as_secs_f64());
    }
    let config = oncegate_engine::EngineConfig {
        data_dir,
        shards: cli.shards,
        slot_moves_per_second_max: cli.slot_moves_per_second_max,
        store: oncegate_engine::StoreConfig::Sqlite(oncegate_engine::SqliteConfig {
            page_cache_bytes_max: cli.page_cache_bytes_max,
            ..Default::default()
        }),
        ..Default::default()
    };
    let engine = oncegate_engine::Engine::open(config)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let phase = Duration::from_secs_f64(cli.phase_s);
    let measure = |name: String, duration: Duration| {
        let load = Load { in_flight: cli.in_flight, duration, warm_up: Duration::from_secs(1) };
        let target = Embedded { engine: engine.clone() };
        let mut report =
            runtime.block_on(runner::run(target, Work::default(), load, Some(Probe::this_process()), |_| {}));
        report.target = name;
        eprintln!(
            "{}: {:.0} pairs/s, p99 {:.2} ms",
            report.target,
            report.pairs_per_s,
            report.p99_us as f64 / 1e3
        );
        report
    };
    let mut reports: Vec<Report> = vec![measure(format!("before: {} shards", cli.shards), phase)];
    let started = Instant::now();
    let adding = {
        let engine = engine.clone();
        let to = cli.to;
        std::thread::spawn(move || engine.add_shards(to, &mut |_, _| {}))
    };
    // The phase during the add: its length is the add's expected time (the move rate
    // bounds it), capped at the phase length, less the runner's warm-up.
    let moves =
        oncegate_engine::testing::slots::SlotMap::even(cli.shards).moves_to_spread(cli.to).len() as f64;
    let expected = match cli.slot_moves_per_second_max {
        0 => phase,
        rate => Duration::from_secs_f64(moves / f64::from(rate)),
    };
    let during = expected.min(phase).saturating_sub(Duration::from_secs(2)).max(Duration::from_secs(1));
    reports.push(measure(format!("during add-shards to {}", cli.to), during));
    let done = adding.join().map_err(|_| anyhow::anyhow!("the add panicked"))??;
    let took = started.elapsed();
    reports.push(measure(format!("after: {} shards", cli.to), phase));
    engine.shutdown();
    println!("{}", markdown(&reports));
    let pauses = done.pauses.unwrap_or_default();
    println!(
        "add-shards {} -> {}: {} slots, {} records moved in {:.1} s; moved slot held p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        done.shards_before,
        done.shards_after,
        done.slots_moved,
        done.records_moved,
        took.as_secs_f64(),
        pauses.p50_ms,
        pauses.p99_ms,
        pauses.max_ms
    );
    Ok(())
}
