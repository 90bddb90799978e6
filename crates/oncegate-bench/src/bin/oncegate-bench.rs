//! `oncegate-bench`: the same durable reserve+commit work against oncegate (over gRPC and
//! embedded), Redis and PostgreSQL, in one run, with the ratios oncegate / peer and what
//! each server spent per pair (CPU, disk bytes).
//!
//! ```sh
//! crates/oncegate-bench/scripts/peers.sh start     # Redis and PostgreSQL on loopback
//! cargo run --release -p oncegate-bench --bin oncegate-bench -- \
//!     --targets grpc,embedded,redis,postgres --in-flight 1,16,64,256 --seconds 10 \
//!     --redis-pid "$(cat /tmp/oncegate-peers/redis.pid)" --postgres-pid "$(head -1 /tmp/oncegate-peers/pg/postmaster.pid)"
//! crates/oncegate-bench/scripts/peers.sh stop
//! ```

/// The allocator of the `oncegate` binary, so the embedded target and the child server
/// it starts measure what production runs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::process::Child;
use std::time::Duration;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use oncegate_bench::cost::Probe;
use oncegate_bench::targets::{Embedded, Floor, Grpc, Kind, Postgres, Redis, Session, Target};
use oncegate_bench::{ChildMode, Load, Report, Work, markdown, medians, ratios};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    mode: Option<ChildMode>,
    /// Targets, in the order they run.
    #[arg(long, value_delimiter = ',', default_value = "grpc,embedded")]
    targets: Vec<Kind>,
    /// Requests in flight; each value is a separate run of every target.
    #[arg(long, value_delimiter = ',', default_value = "64")]
    in_flight: Vec<usize>,
    /// Rounds: every target runs once per round, in turn with the others, and the tool
    /// prints each run, the medians, and each ratio to a peer as the median of the
    /// rounds' ratios (a machine shared with others drifts between runs).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=100))]
    rounds: u16,
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
    /// Where the oncegate the tool starts (and the embedded target) keeps its records:
    /// `sqlite` (the default) or `postgres` (the database of `--postgres`).
    #[arg(long, default_value = "sqlite", value_parser = clap::value_parser!(oncegate_engine::StoreKind))]
    store: oncegate_engine::StoreKind,
    /// oncegate servers the tool starts (on `--store postgres`, several nodes of one
    /// database); the gRPC targets spread their connections over them.
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    /// Shards of the oncegate the tool starts (and of the embedded target).
    #[arg(long, default_value_t = 2)]
    shards: u32,
    /// Redis URL.
    #[arg(long, default_value = "redis://127.0.0.1:6390")]
    redis: String,
    /// The Redis server's process, to report its CPU and disk per pair.
    #[arg(long)]
    redis_pid: Option<u32>,
    /// PostgreSQL connection string.
    #[arg(long, default_value = "host=127.0.0.1 port=5440 user=postgres dbname=postgres")]
    postgres: String,
    /// The PostgreSQL postmaster's process (its backends are counted with it).
    #[arg(long)]
    postgres_pid: Option<u32>,
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
    /// Also measure the raw SQLite group-commit ceiling with this many commands per
    /// commit (match it to the embedded target's mean batch; 0 skips it).
    #[arg(long, default_value_t = 0)]
    raw_batch: usize,
    /// Draws throughput and p99 against in-flight requests into this SVG.
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// The tool's state across runs: the server it started, if any.
struct Bench {
    cli: Cli,
    runtime: tokio::runtime::Runtime,
    scratch: tempfile::TempDir,
    servers: Vec<(Child, String)>,
    work: Work,
}

impl Cli {
    /// The store of the oncegate the tool runs (and preloads).
    fn store_config(&self) -> oncegate_engine::StoreConfig {
        match self.store {
            oncegate_engine::StoreKind::Postgres => {
                oncegate_engine::StoreConfig::postgres(self.postgres.as_str())
            }
            kind => oncegate_engine::StoreConfig::of_kind(kind),
        }
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(mode) = cli.mode {
        return oncegate_bench::serve_child(mode);
    }
    let scratch = tempfile::tempdir_in(cli.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    if cli.preload > 0 {
        // Before any runtime exists here: the preload runs one of its own.
        let took = oncegate_bench::preload::preload(
            &scratch.path().join("server"),
            cli.shards,
            cli.store_config(),
            cli.preload,
            512,
        )?;
        eprintln!("preloaded {} records in {:.0} s", cli.preload, took.as_secs_f64());
    }
    let work =
        Work { response_bytes: cli.response_bytes, duplicate_share: cli.duplicates, ..Work::default() };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut bench = Bench { cli, runtime, scratch, servers: Vec::new(), work };
    let mut reports = Vec::new();
    for in_flight in bench.cli.in_flight.clone() {
        for round in 0..usize::from(bench.cli.rounds) {
            for kind in bench.cli.targets.clone() {
                let report = Report { round, ..bench.measure(kind, in_flight)? };
                eprintln!(
                    "{} x{in_flight}: {:.0} pairs/s, p99 {:.2} ms",
                    report.target,
                    report.pairs_per_s,
                    report.p99_us as f64 / 1000.0
                );
                reports.push(report);
            }
        }
    }
    for (mut child, _) in bench.servers.drain(..) {
        let _ = child.kill();
        let _ = child.wait();
    }
    // After the servers are gone: it counts the device's bytes.
    bench.raw_ceiling(&reports)?;
    print_results(&bench.cli, &reports)
}

impl Bench {
    /// One run of one target at one in-flight count.
    fn measure(&mut self, kind: Kind, in_flight: usize) -> anyhow::Result<Report> {
        match kind {
            Kind::Grpc => {
                let (addrs, pid) = self.server_addrs()?;
                let target = self.runtime.block_on(Grpc::connect(&addrs, self.cli.connections))?;
                let probe = pid.map(Probe::of);
                let report = self.run(target, in_flight, probe);
                if let Some(pid) = pid {
                    println!(
                        "server RSS after grpc x{in_flight}: {:.1} MiB",
                        oncegate_bench::rss_bytes(pid) as f64 / 1048576.0
                    );
                }
                Ok(report)
            }
            Kind::GrpcSession => {
                let (addrs, pid) = self.server_addrs()?;
                let target = self.runtime.block_on(Session::connect(&addrs, self.cli.connections))?;
                let probe = pid.map(Probe::of);
                Ok(self.run(target, in_flight, probe))
            }
            Kind::GrpcFloor => {
                let (addrs, pid) = self.server_addrs()?;
                let target = self.runtime.block_on(Floor::connect(&addrs, self.cli.connections))?;
                let probe = pid.map(Probe::of);
                Ok(self.run(target, in_flight, probe))
            }
            Kind::Embedded => {
                let data_dir = self.scratch.path().join(format!("embedded-{in_flight}"));
                let config = oncegate_engine::EngineConfig {
                    data_dir,
                    shards: self.cli.shards,
                    store: self.store(),
                    ..Default::default()
                };
                let target = Embedded { engine: oncegate_engine::Engine::open(config)? };
                let report = self.run(target.clone(), in_flight, Some(Probe::this_process()));
                target.engine.shutdown();
                Ok(report)
            }
            Kind::Redis => {
                let target = self.runtime.block_on(Redis::connect(&self.cli.redis))?;
                let probe = self.cli.redis_pid.map(Probe::of);
                Ok(self.run(target, in_flight, probe))
            }
            Kind::Postgres => {
                let target =
                    self.runtime.block_on(Postgres::connect(&self.cli.postgres, in_flight.min(64)))?;
                let probe = self.cli.postgres_pid.map(|pid| Probe { with_children: true, ..Probe::of(pid) });
                Ok(self.run(target, in_flight, probe))
            }
        }
    }

    /// The store of the oncegate the tool runs.
    fn store(&self) -> oncegate_engine::StoreConfig {
        self.cli.store_config()
    }

    /// The addresses of the gRPC servers (the given one, or `--nodes` children started
    /// once), and the server's process when the tool started exactly one (with several,
    /// one process's CPU is not the cost of a pair).
    fn server_addrs(&mut self) -> anyhow::Result<(Vec<String>, Option<u32>)> {
        if let Some(addr) = &self.cli.addr {
            return Ok((vec![addr.clone()], None));
        }
        if self.servers.is_empty() {
            // Until the child prints its address it is opening the store: with a preload,
            // that is the recovery time (integrity check, and the scan that rebuilds the
            // index and the reclaim schedule).
            let started = std::time::Instant::now();
            for node in 0..self.cli.nodes.max(1) {
                let dir = self.scratch.path().join(if node == 0 {
                    "server".to_owned()
                } else {
                    format!("server-{node}")
                });
                let (shards, store) = (self.cli.shards, self.cli.store);
                self.servers.push(oncegate_bench::start_child(&dir, shards, store, &self.cli.postgres)?);
            }
            eprintln!("the server opened its store in {:.1} s", started.elapsed().as_secs_f64());
        }
        let addrs = self.servers.iter().map(|(_, addr)| addr.clone()).collect();
        let pid = (self.servers.len() == 1).then(|| self.servers[0].0.id());
        Ok((addrs, pid))
    }

    fn run<T: Target + Clone>(&self, target: T, in_flight: usize, probe: Option<Probe>) -> Report {
        let probe = probe.map(|p| p.on_device_of(self.scratch.path()));
        let bar = ProgressBar::new(self.cli.seconds.ceil() as u64);
        if let Ok(style) = ProgressStyle::with_template("{prefix:>28} [{bar:30}] {msg}") {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(format!("{} x{in_flight}", target.name()));
        let load = Load {
            in_flight,
            duration: Duration::from_secs_f64(self.cli.seconds),
            warm_up: Duration::from_secs_f64(self.cli.warm_up_s),
        };
        let shown = bar.clone();
        let report =
            self.runtime.block_on(oncegate_bench::run(target, self.work.clone(), load, probe, move |done| {
                shown.inc(1);
                shown.set_message(format!("{done} pairs"));
            }));
        bar.finish_and_clear();
        report
    }

    fn raw_ceiling(&self, reports: &[Report]) -> anyhow::Result<()> {
        if self.cli.raw_batch == 0 {
            return Ok(());
        }
        let dir = self.scratch.path().join("raw");
        std::fs::create_dir_all(&dir)?;
        let seconds = Duration::from_secs_f64(self.cli.seconds);
        let ceiling = oncegate_bench::raw_sqlite::raw_sqlite_ceiling(
            &dir,
            self.cli.shards,
            self.cli.raw_batch,
            seconds,
            &self.work,
        )?;
        println!(
            "raw SQLite ceiling, {} files, {} commands per commit: {:.0} pairs/s, {:.1} µs of CPU per command \
             (checkpoints aside), {:.0} device bytes per pair",
            self.cli.shards,
            self.cli.raw_batch,
            ceiling.pairs_per_s,
            ceiling.cpu_us_per_command,
            ceiling.device_bytes_per_pair
        );
        for r in reports.iter().filter(|r| r.target == "oncegate-embedded") {
            let batch = r.batch_len_mean.unwrap_or(0.0);
            println!(
                "oncegate-embedded at {} in flight (mean batch {batch:.1}) / raw SQLite ceiling: {:.2}",
                r.in_flight,
                r.pairs_per_s / ceiling.pairs_per_s
            );
        }
        Ok(())
    }
}

/// The table, the ratios of each oncegate target to each peer, and the JSON and plot.
fn print_results(cli: &Cli, reports: &[Report]) -> anyhow::Result<()> {
    println!("{}", markdown(reports));
    if cli.rounds > 1 {
        println!("Medians over {} rounds:\n\n{}", cli.rounds, markdown(&medians(reports)));
    }
    for ratio in ratios(reports) {
        println!("{}", ratio.line());
    }
    if let Some(path) = &cli.json {
        std::fs::write(path, serde_json::to_string_pretty(reports)?)?;
    }
    if let Some(path) = &cli.plot {
        oncegate_bench::plot::plot(reports, path)?;
        eprintln!("plot written to {}", path.display());
    }
    Ok(())
}
