//! Embedded-mode throughput: durable reserve+commit pairs per second with 1 and 2
//! shards, many requests in flight, `synchronous=FULL`.
//!
//! `cargo bench -p oncegate-engine --bench embedded` prints, for each shard count, the
//! figures of every run and their median, and the mean batch length (commands per
//! fsync). Environment: `BENCH_SECONDS` (per run, default 3), `BENCH_RUNS` (default 3),
//! `BENCH_IN_FLIGHT` (default 256), `BENCH_DIR` (where the data directories go; default
//! the system temp dir, which must be a real disk for the figures to mean anything).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use oncegate_core::{Outcome, ReserveReply, Tenant};
use oncegate_engine::{CommitRequest, Engine, EngineConfig, ReserveRequest};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

struct Run {
    pairs_per_s: f64,
    batch_len_mean: f64,
}

fn run(shards: u32, seconds: u64, in_flight: u64) -> Run {
    let base = std::env::var_os("BENCH_DIR").map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(base).expect("temp dir");
    let config = EngineConfig { data_dir: dir.path().to_owned(), shards, ..EngineConfig::default() };
    let engine = Engine::open(config).expect("open");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
    let pairs = Arc::new(AtomicU64::new(0));
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let tenant = Tenant::default_tenant();
    let warm_up = Duration::from_millis(500);
    let elapsed = runtime.block_on(async {
        let mut tasks = Vec::new();
        for worker in 0..in_flight {
            let (engine, tenant, pairs, measuring, stop) =
                (engine.clone(), tenant.clone(), pairs.clone(), measuring.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("w{worker}-{i}");
                    i += 1;
                    let reserve =
                        ReserveRequest { namespace: "bench".into(), key: key.clone(), ..Default::default() };
                    let token = match engine.reserve(&tenant, reserve).await.expect("reserve").reply {
                        ReserveReply::Granted { token, .. } => token,
                        other => panic!("fresh keys are granted: {other:?}"),
                    };
                    let commit = CommitRequest {
                        namespace: "bench".into(),
                        key,
                        token,
                        outcome: Outcome::Succeeded,
                        response: vec![b'r'; 256],
                    };
                    engine.commit(&tenant, commit).await.expect("commit");
                    if measuring.load(Ordering::Relaxed) {
                        pairs.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
        tokio::time::sleep(warm_up).await;
        let batches_before: (u64, u64) = totals(&engine);
        measuring.store(true, Ordering::Relaxed);
        let start = Instant::now();
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        measuring.store(false, Ordering::Relaxed);
        let elapsed = start.elapsed();
        let batches_after = totals(&engine);
        stop.store(true, Ordering::Relaxed);
        for task in tasks {
            task.await.expect("worker");
        }
        (elapsed, batches_after.0 - batches_before.0, batches_after.1 - batches_before.1)
    });
    let (elapsed, batches, commands) = elapsed;
    engine.shutdown();
    Run {
        pairs_per_s: pairs.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64(),
        batch_len_mean: commands as f64 / batches.max(1) as f64,
    }
}

fn totals(engine: &Engine) -> (u64, u64) {
    engine.stats().iter().fold((0, 0), |(b, c), s| (b + s.batches, c + s.commands))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` would pass nothing useful.
    let seconds = env_or("BENCH_SECONDS", 3);
    let runs = env_or("BENCH_RUNS", 3).max(1);
    let in_flight = env_or("BENCH_IN_FLIGHT", 256);
    println!(
        "embedded durable reserve+commit, {in_flight} in flight, {runs} runs of {seconds} s, synchronous=FULL"
    );
    let mut medians = Vec::new();
    for shards in [1u32, 2] {
        let results: Vec<Run> = (0..runs).map(|_| run(shards, seconds, in_flight)).collect();
        let pairs = median(results.iter().map(|r| r.pairs_per_s).collect());
        let batch = median(results.iter().map(|r| r.batch_len_mean).collect());
        let each: Vec<String> = results.iter().map(|r| format!("{:.0}", r.pairs_per_s)).collect();
        println!(
            "shards={shards}: median {pairs:.0} pairs/s = {:.0} durable ops/s, mean batch {batch:.1} commands (runs: {})",
            pairs * 2.0,
            each.join(", ")
        );
        medians.push(pairs);
    }
    println!("2 shards / 1 shard: {:.2}x", medians[1] / medians[0]);
}
