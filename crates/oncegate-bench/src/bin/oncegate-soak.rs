//! `oncegate-soak`: steady load against a real server process for N minutes, with key
//! churn (short ttl, so records expire and are reclaimed all the time), duplicate
//! reserves, and a few SIGKILLs with restarts on the same data directory. Every sample
//! interval it prints the server's RSS, the shard files' and WALs' sizes, throughput and
//! p99 latency; at the end, RSS growth over the second half and the largest database.
//!
//! `cargo run --release -p oncegate-bench --bin oncegate-soak -- --minutes 10`
//!
//! The server is this same executable in its `serve` mode, so nothing else needs to be
//! built first.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use oncegate_bench::ChildMode;
use oncegate_proto::v1 as pb;
use oncegate_proto::v1::gate_client::GateClient;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    mode: Option<ChildMode>,
    /// How long to run.
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
    /// Concurrent clients.
    #[arg(long, default_value_t = 64)]
    clients: u64,
    /// SIGKILL-and-restart cycles, spread evenly over the first half of the run (the
    /// second half is one process, for the RSS trend).
    #[arg(long, default_value_t = 3)]
    kills: u32,
    /// Seconds between samples.
    #[arg(long, default_value_t = 30)]
    sample_s: u64,
    /// The ttl of every record: short, so the store churns.
    #[arg(long, default_value_t = 10_000)]
    ttl_ms: u64,
    /// Where the data directory goes (a fresh one under it).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Shards.
    #[arg(long, default_value_t = 2)]
    shards: u32,
}

struct Server {
    child: Child,
    addr: String,
}

fn start(data_dir: &Path, shards: u32) -> anyhow::Result<Server> {
    let (child, addr) =
        oncegate_bench::start_child(data_dir, shards, oncegate_engine::StoreKind::Sqlite, "")?;
    Ok(Server { child, addr })
}

fn rss_kib(pid: u32) -> u64 {
    oncegate_bench::rss_bytes(pid) / 1024
}

/// (database bytes, WAL bytes) of every shard file.
fn store_bytes(dir: &Path) -> (u64, u64) {
    let mut sizes = (0, 0);
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let len = entry.metadata().map(|m| m.len()).unwrap_or(0);
        if name.ends_with(".sqlite") {
            sizes.0 += len;
        } else if name.ends_with(".sqlite-wal") {
            sizes.1 += len;
        }
    }
    sizes
}

struct Shared {
    latencies: Mutex<Histogram<u64>>,
    ops: AtomicU64,
    errors: AtomicU64,
    stop: AtomicBool,
    addr: Mutex<String>,
}

async fn client(id: u64, ttl_ms: u64, shared: Arc<Shared>) {
    let mut i = 0u64;
    let mut recent: Vec<String> = Vec::new();
    while !shared.stop.load(Ordering::Relaxed) {
        let addr = shared.addr.lock().unwrap().clone();
        let Ok(mut gate) = GateClient::connect(addr.clone()).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        while !shared.stop.load(Ordering::Relaxed) && *shared.addr.lock().unwrap() == addr {
            i += 1;
            // One reserve in ten repeats a recent key: the duplicate a gateway exists to catch.
            let duplicate = i.is_multiple_of(10) && !recent.is_empty();
            let key = if duplicate {
                recent[(i as usize / 10) % recent.len()].clone()
            } else {
                format!("c{id}-{i}")
            };
            let request = pb::ReserveRequest {
                namespace: "soak".into(),
                key: key.clone(),
                ttl_ms,
                ..Default::default()
            };
            let started = Instant::now();
            let reply = gate.reserve(request).await;
            let token = match reply.map(|r| r.into_inner().outcome) {
                Ok(Some(pb::reserve_response::Outcome::Granted(g))) => Some(g.token),
                Ok(_) => None,
                Err(_) => {
                    shared.errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            };
            if let Some(token) = token {
                let commit = pb::CommitRequest {
                    namespace: "soak".into(),
                    key: key.clone(),
                    token,
                    outcome: pb::Outcome::Succeeded as i32,
                    response: vec![b'r'; 256],
                };
                if gate.commit(commit).await.is_err() {
                    shared.errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                recent.push(key);
                if recent.len() > 16 {
                    recent.remove(0);
                }
            }
            let micros = started.elapsed().as_micros() as u64;
            let _ = shared.latencies.lock().unwrap().record(micros.max(1));
            shared.ops.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(mode) = cli.mode {
        return oncegate_bench::serve_child(mode);
    }
    let base = cli.dir.clone().unwrap_or_else(std::env::temp_dir);
    let data_dir = base.join(format!("oncegate-soak-{}", std::process::id()));
    std::fs::create_dir_all(&data_dir)?;
    let total = Duration::from_secs_f64(cli.minutes * 60.0);
    let mut server = start(&data_dir, cli.shards)?;
    let shared = Arc::new(Shared {
        latencies: Mutex::new(Histogram::new_with_bounds(1, 60_000_000, 3)?),
        ops: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        addr: Mutex::new(server.addr.clone()),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let tasks: Vec<_> =
        (0..cli.clients).map(|id| runtime.spawn(client(id, cli.ttl_ms, shared.clone()))).collect();

    println!(
        "soak: {:.1} min, {} clients, ttl {} ms, {} kills, {} shards, data in {}",
        cli.minutes,
        cli.clients,
        cli.ttl_ms,
        cli.kills,
        cli.shards,
        data_dir.display()
    );
    println!("| t (s) | reserve+commit/s | p99 (ms) | errors | server RSS (MiB) | db (MiB) | wal (MiB) |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let started = Instant::now();
    let kill_every = (total / 2).div_f64(f64::from(cli.kills + 1));
    let mut kills_done = 0;
    let mut table = Table::new();
    while started.elapsed() < total {
        std::thread::sleep(Duration::from_secs(cli.sample_s).min(total.saturating_sub(started.elapsed())));
        if kills_done < cli.kills && started.elapsed() >= kill_every * (kills_done + 1) {
            server.child.kill()?;
            server.child.wait()?;
            server = start(&data_dir, cli.shards)?;
            *shared.addr.lock().unwrap() = server.addr.clone();
            kills_done += 1;
            println!(
                "| {:.0} | SIGKILL and restart {kills_done} | | | | | |",
                started.elapsed().as_secs_f64()
            );
        }
        table.row(started.elapsed().as_secs_f64(), &shared, server.child.id(), &data_dir);
    }
    shared.stop.store(true, Ordering::Relaxed);
    runtime.block_on(async {
        for task in tasks {
            let _ = task.await;
        }
    });
    server.child.kill()?;
    server.child.wait()?;
    let write_rate = shared.ops.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    table.summary(total.as_secs_f64(), cli.ttl_ms, write_rate);
    std::fs::remove_dir_all(&data_dir)?;
    Ok(())
}

/// The printed table: a row per sample, and what the samples add up to.
struct Table {
    /// (seconds since the start, server RSS in KiB, store bytes) per row.
    samples: Vec<(f64, u64, u64)>,
    db_max: u64,
    last_ops: u64,
    last: Instant,
}

impl Table {
    fn new() -> Table {
        Table { samples: Vec::new(), db_max: 0, last_ops: 0, last: Instant::now() }
    }

    /// Prints the rate, p99 and errors since the last row, and the server's size now.
    fn row(&mut self, t: f64, shared: &Shared, pid: u32, data_dir: &Path) {
        let ops = shared.ops.load(Ordering::Relaxed);
        let rate = (ops - self.last_ops) as f64 / self.last.elapsed().as_secs_f64();
        self.last_ops = ops;
        self.last = Instant::now();
        let p99 = {
            let mut h = shared.latencies.lock().unwrap();
            let p = h.value_at_quantile(0.99);
            h.reset();
            p
        };
        let rss = rss_kib(pid);
        let (db, wal) = store_bytes(data_dir);
        self.db_max = self.db_max.max(db);
        self.samples.push((t, rss, db));
        println!(
            "| {t:.0} | {rate:.0} | {:.1} | {} | {:.1} | {:.1} | {:.1} |",
            p99 as f64 / 1000.0,
            shared.errors.load(Ordering::Relaxed),
            rss as f64 / 1024.0,
            db as f64 / 1048576.0,
            wal as f64 / 1048576.0
        );
    }

    /// RSS growth over the second half (one process, past its warm-up) and the largest
    /// store against what the ttl bounds it to.
    fn summary(&self, total_s: f64, ttl_ms: u64, write_rate: f64) {
        let second: Vec<_> = self.samples.iter().filter(|s| s.0 >= total_s / 2.0).collect();
        if let (Some(first), Some(last)) = (second.first(), second.last()) {
            let growth = (last.1 as f64 - first.1 as f64) / first.1.max(1) as f64 * 100.0;
            println!(
                "RSS over the second half: {:.1} MiB -> {:.1} MiB ({growth:+.1}%)",
                first.1 as f64 / 1024.0,
                last.1 as f64 / 1024.0
            );
        }
        println!(
            "largest database: {:.1} MiB; live records bounded by ttl x write rate = {:.0} x {:.0}/s = {:.0}",
            self.db_max as f64 / 1048576.0,
            ttl_ms as f64 / 1000.0,
            write_rate,
            ttl_ms as f64 / 1000.0 * write_rate
        );
    }
}
