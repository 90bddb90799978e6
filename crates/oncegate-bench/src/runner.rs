//! The load runner: a fixed number of requests in flight, warm-up excluded from the
//! figures, latencies in an HDR histogram, and the server's cost read around the
//! measured window.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::cost::Probe;
use crate::report::Report;
use crate::targets::{Reserved, Target};

/// The work every target does, in the same shape.
#[derive(Clone, Debug)]
pub struct Work {
    /// Bytes of the committed response.
    pub response_bytes: usize,
    /// Share of reserves that repeat an already committed key, 0.0 to 1.0.
    pub duplicate_share: f64,
    /// The lease of a reserve.
    pub lease_ms: u64,
    /// The ttl of a record.
    pub ttl_ms: u64,
}

impl Default for Work {
    fn default() -> Self {
        Work { response_bytes: 256, duplicate_share: 0.1, lease_ms: 30_000, ttl_ms: 3_600_000 }
    }
}

/// How a run is shaped.
#[derive(Clone, Debug)]
pub struct Load {
    /// Requests in flight (workers, each with one pair outstanding).
    pub in_flight: usize,
    /// Measured time.
    pub duration: Duration,
    /// Time before measuring starts.
    pub warm_up: Duration,
}

/// Counters the workers share.
#[derive(Default)]
struct Shared {
    done: AtomicU64,
    errors: AtomicU64,
    replays: AtomicU64,
    measuring: AtomicBool,
    stop: AtomicBool,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds")
}

/// Runs `load` against `target` and reports; `probe` is the server process whose cost
/// is read around the measured window. `progress` is called about once a second with
/// the pairs done so far.
pub async fn run<T: Target + Clone>(
    target: T,
    work: Work,
    load: Load,
    probe: Option<Probe>,
    progress: impl Fn(u64) + Send + 'static,
) -> Report {
    let shared = Arc::new(Shared::default());
    let run_id =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let workers: Vec<_> = (0..load.in_flight)
        .map(|worker| {
            tokio::spawn(work_loop(target.clone(), work.clone(), Arc::clone(&shared), worker, run_id))
        })
        .collect();
    // The tool's own process is the load generator, unless it is the server too.
    let own = std::process::id();
    let load_probe = if probe.is_some_and(|p| p.pid == own) { None } else { Some(Probe::of(own)) };
    tokio::time::sleep(load.warm_up).await;
    let load_before = load_probe.map(|p| p.sample());
    let (batches_before, cost_before) = (target.batches().await, probe.map(|p| p.sample()));
    shared.measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    while started.elapsed() < load.duration {
        tokio::time::sleep(Duration::from_secs(1).min(load.duration.saturating_sub(started.elapsed()))).await;
        progress(shared.done.load(Ordering::Relaxed));
    }
    shared.measuring.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed();
    let (batches_after, cost_after) = (target.batches().await, probe.map(|p| p.sample()));
    let load_after = load_probe.map(|p| p.sample());
    shared.stop.store(true, Ordering::Relaxed);
    let mut latencies = histogram();
    for worker in workers {
        if let Ok(local) = worker.await {
            latencies.add(&local).expect("same bounds");
        }
    }
    let (done, replays) = (shared.done.load(Ordering::Relaxed), shared.replays.load(Ordering::Relaxed));
    // A pair is two commands, a replay one; the engine counts its own where it can.
    let (batch_len_mean, commands) = match (batches_before, batches_after) {
        (Some((b0, c0)), Some((b1, c1))) if b1 > b0 => (Some((c1 - c0) as f64 / (b1 - b0) as f64), c1 - c0),
        _ => (None, (2 * done).saturating_sub(replays)),
    };
    let cost = cost_before.zip(cost_after).map(|(before, after)| before.cost_to(&after, done, commands));
    let load_cpu_us_per_pair = load_before
        .zip(load_after)
        .map(|(before, after)| before.cost_to(&after, done, commands).cpu_us_per_pair);
    Report {
        target: target.name().to_owned(),
        round: 0,
        in_flight: load.in_flight,
        pairs_per_s: done as f64 / elapsed.as_secs_f64(),
        p50_us: latencies.value_at_quantile(0.5),
        p99_us: latencies.value_at_quantile(0.99),
        p999_us: latencies.value_at_quantile(0.999),
        errors: shared.errors.load(Ordering::Relaxed),
        replays,
        batch_len_mean,
        cost,
        load_cpu_us_per_pair,
    }
}

/// One worker: a pair at a time (reserve, then commit on a grant), a share of them
/// duplicates of its last committed key, until told to stop. Returns its latencies.
async fn work_loop<T: Target>(
    target: T,
    work: Work,
    shared: Arc<Shared>,
    worker: usize,
    run_id: u128,
) -> Histogram<u64> {
    let response = vec![b'r'; work.response_bytes];
    let mut latencies = histogram();
    let mut last_committed: Option<String> = None;
    let mut i = 0u64;
    while !shared.stop.load(Ordering::Relaxed) {
        i += 1;
        // A cheap, deterministic draw per iteration.
        let draw = (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 11) as f64 / (1u64 << 53) as f64;
        let duplicate = last_committed.is_some() && draw <= work.duplicate_share;
        let key = match (&last_committed, duplicate) {
            (Some(k), true) => k.clone(),
            _ => format!("{run_id}-{worker}-{i}"),
        };
        let token = (worker as u64) << 40 | i;
        let started = Instant::now();
        let result = async {
            match target.reserve(worker, &key, token, &work).await? {
                Reserved::Granted(token) => {
                    target.commit(worker, &key, token, &response, &work).await?;
                    anyhow::Ok(false)
                }
                Reserved::Replayed => anyhow::Ok(true),
                Reserved::Busy => anyhow::Ok(false),
            }
        }
        .await;
        let measured = shared.measuring.load(Ordering::Relaxed);
        match result {
            Ok(replayed) => {
                if !duplicate {
                    last_committed = Some(key);
                }
                if measured {
                    shared.done.fetch_add(1, Ordering::Relaxed);
                    shared.replays.fetch_add(u64::from(replayed), Ordering::Relaxed);
                    let _ = latencies.record(started.elapsed().as_micros().max(1) as u64);
                }
            }
            Err(_) if measured => {
                shared.errors.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {}
        }
    }
    latencies
}
