//! `oncegate-bench`: the same durable reserve+commit work against oncegate (over gRPC and
//! embedded), Redis and PostgreSQL, in one run, with the ratios oncegate / peer.
//!
//! ```sh
//! crates/oncegate-bench/scripts/peers.sh start     # Redis and PostgreSQL on loopback
//! cargo run --release -p oncegate-bench --bin oncegate-bench -- \
//!     --targets grpc,embedded,redis,postgres --in-flight 1,16,64,256 --seconds 10
//! crates/oncegate-bench/scripts/peers.sh stop
//! ```

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use oncegate_bench::{ChildMode, Load, Report, Target, Work, markdown};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    mode: Option<ChildMode>,
    /// Targets, in the order they run: grpc, embedded, redis, postgres.
    #[arg(long, value_delimiter = ',', default_value = "grpc,embedded")]
    targets: Vec<String>,
    /// Requests in flight; each value is a separate run of every target.
    #[arg(long, value_delimiter = ',', default_value = "64")]
    in_flight: Vec<usize>,
    /// Measured seconds per run.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Seconds of warm-up before measuring.
    #[arg(long, default_value_t = 1.0)]
    warm_up_s: f64,
    /// Bytes of each committed response.
    #[arg(long, default_value_t = 256)]
    response_bytes: usize,
    /// Share of reserves that repeat a committed key.
    #[arg(long, default_value_t = 0.1)]
    duplicates: f64,
    /// A running oncegate server; without it the tool starts one (a child process).
    #[arg(long)]
    addr: Option<String>,
    /// gRPC connections.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Shards of the oncegate the tool starts (and of the embedded target).
    #[arg(long, default_value_t = 2)]
    shards: u32,
    /// Redis URL.
    #[arg(long, default_value = "redis://127.0.0.1:6390")]
    redis: String,
    /// PostgreSQL connection string.
    #[arg(long, default_value = "host=127.0.0.1 port=5440 user=postgres dbname=postgres")]
    postgres: String,
    /// Where data directories go (a real disk, for the figures to mean anything).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Completed records to load into the server's store before measuring (for the
    /// preloaded-store figure; the gRPC target only).
    #[arg(long, default_value_t = 0)]
    preload: u64,
    /// Writes the reports as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also measure the raw SQLite group-commit ceiling with this many keys per
    /// transaction (match it to the embedded target's mean batch; 0 skips it).
    #[arg(long, default_value_t = 0)]
    raw_batch: usize,
    /// Draws throughput and p99 against in-flight requests into this SVG.
    #[arg(long)]
    plot: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(ChildMode::Serve { data_dir, shards }) = cli.mode {
        return oncegate_bench::serve_child(data_dir, shards);
    }
    let base = cli.dir.clone().unwrap_or_else(std::env::temp_dir);
    let scratch = tempfile::tempdir_in(base)?;
    let mut server = None;
    let work =
        Work { response_bytes: cli.response_bytes, duplicate_share: cli.duplicates, ..Work::default() };
    let server_dir = scratch.path().join("server");
    if cli.preload > 0 {
        // Before any runtime exists here: the preload runs one of its own.
        let took = oncegate_bench::preload(&server_dir, cli.shards, cli.preload, 512)?;
        eprintln!("preloaded {} records in {:.0} s", cli.preload, took.as_secs_f64());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut reports: Vec<Report> = Vec::new();
    for &in_flight in &cli.in_flight {
        for name in &cli.targets {
            let target = runtime.block_on(async {
                anyhow::Ok(match name.as_str() {
                    "grpc" => {
                        let addr = match (&cli.addr, &server) {
                            (Some(addr), _) => addr.clone(),
                            (None, Some((_, addr))) => String::clone(addr),
                            (None, None) => {
                                let started = oncegate_bench::start_child(&server_dir, cli.shards)?;
                                let addr = started.1.clone();
                                server = Some(started);
                                addr
                            }
                        };
                        Target::grpc(&addr, cli.connections).await?
                    }
                    "embedded" => {
                        let dir = scratch.path().join(format!("embedded-{in_flight}"));
                        let config = oncegate_engine::EngineConfig {
                            data_dir: dir,
                            shards: cli.shards,
                            ..Default::default()
                        };
                        Target::Embedded(oncegate_engine::Engine::open(config)?)
                    }
                    "redis" => Target::redis(&cli.redis).await?,
                    "postgres" => Target::postgres(&cli.postgres, in_flight.min(64)).await?,
                    other => anyhow::bail!("unknown target {other}; use grpc, embedded, redis or postgres"),
                })
            })?;
            let bar = ProgressBar::new((cli.seconds.ceil()) as u64);
            bar.set_style(
                ProgressStyle::with_template("{prefix:>28} [{bar:30}] {msg}")?.progress_chars("=> "),
            );
            bar.set_prefix(format!("{name} x{in_flight}"));
            let load = Load {
                in_flight,
                duration: Duration::from_secs_f64(cli.seconds),
                warm_up: Duration::from_secs_f64(cli.warm_up_s),
            };
            let shown = bar.clone();
            let report =
                runtime.block_on(oncegate_bench::run(target.clone(), work.clone(), load, move |done| {
                    shown.inc(1);
                    shown.set_message(format!("{done} pairs"));
                }));
            bar.finish_and_clear();
            if let Target::Embedded(engine) = &target {
                engine.shutdown();
            }
            eprintln!(
                "{name} x{in_flight}: {:.0} pairs/s, p99 {:.2} ms",
                report.pairs_per_s,
                report.p99_us as f64 / 1000.0
            );
            if let (Target::Grpc(_), Some((child, _))) = (&target, &server) {
                println!(
                    "server RSS after {name} x{in_flight}: {:.1} MiB",
                    oncegate_bench::rss_bytes(child.id()) as f64 / 1048576.0
                );
            }
            reports.push(report);
        }
    }
    if cli.raw_batch > 0 {
        let dir = scratch.path().join("raw");
        std::fs::create_dir_all(&dir)?;
        let pairs = oncegate_bench::raw_sqlite_ceiling(
            &dir,
            cli.shards,
            cli.raw_batch,
            Duration::from_secs_f64(cli.seconds),
            &work,
        )?;
        println!(
            "raw SQLite ceiling, {} files, {} keys per transaction: {pairs:.0} pairs/s",
            cli.shards, cli.raw_batch
        );
        for r in reports.iter().filter(|r| r.target == "oncegate-embedded") {
            println!(
                "oncegate-embedded at {} in flight (mean batch {:.1}) / raw SQLite ceiling: {:.2}",
                r.in_flight,
                r.batch_len_mean.unwrap_or(0.0),
                r.pairs_per_s / pairs
            );
        }
    }
    if let Some((mut child, _)) = server {
        let _ = child.kill();
        let _ = child.wait();
    }
    println!("{}", markdown(&reports));
    // Ratios of each oncegate target to each peer, at each in-flight count.
    for &in_flight in &cli.in_flight {
        let at: Vec<&Report> = reports.iter().filter(|r| r.in_flight == in_flight).collect();
        for ours in at.iter().filter(|r| r.target.starts_with("oncegate")) {
            for peer in at.iter().filter(|r| !r.target.starts_with("oncegate")) {
                println!(
                    "{} / {} at {in_flight} in flight: {:.2}x",
                    ours.target,
                    peer.target,
                    ours.pairs_per_s / peer.pairs_per_s.max(1e-9)
                );
            }
        }
    }
    if let Some(path) = cli.json {
        std::fs::write(path, serde_json::to_string_pretty(&reports)?)?;
    }
    if let Some(path) = cli.plot {
        oncegate_bench::plot::plot(&reports, &path)?;
        eprintln!("plot written to {}", path.display());
    }
    Ok(())
}
