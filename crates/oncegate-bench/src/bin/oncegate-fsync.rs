//! `oncegate-fsync`: how many `fdatasync`s per second the disk completes for one writer,
//! and for several side by side, and the CPU each write and its sync take. Each shard
//! syncs its own WAL, one batch per sync, so with a fixed number of requests in flight a
//! second shard can raise pairs/s only as far as the disk completes syncs in parallel,
//! and every batch pays the sync's CPU however few commands it carries
//! (docs/benchmarks.md). Each writer overwrites small blocks of a zero-filled file of its
//! own and syncs after each write, as a shard does with a batch.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use oncegate_bench::cost::this_thread_cpu;

/// Flags of `oncegate-fsync`.
#[derive(Parser)]
#[command(name = "oncegate-fsync", about)]
struct Cli {
    /// Writer counts, each a separate run.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    writers: Vec<usize>,
    /// Seconds per run.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Bytes each write carries before its sync.
    #[arg(long, default_value_t = 4096)]
    write_bytes: usize,
    /// Where the scratch files go (a temporary directory under it).
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// The size of each writer's file; writes wrap around in it.
const FILE_BYTES: u64 = 8 << 20;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    anyhow::ensure!(
        cli.write_bytes > 0 && cli.write_bytes as u64 <= FILE_BYTES,
        "--write-bytes is 1 to {FILE_BYTES}"
    );
    let scratch = tempfile::tempdir_in(cli.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    println!("| writers | fdatasync/s | per writer | against the first row | CPU µs per write and sync |");
    println!("| --- | --- | --- | --- | --- |");
    let mut first = None;
    for (i, &writers) in cli.writers.iter().enumerate() {
        let run_dir = scratch.path().join(format!("run-{i}"));
        std::fs::create_dir(&run_dir)?;
        let (total, cpu_us) = run(&run_dir, writers, &cli)?;
        std::fs::remove_dir_all(&run_dir)?;
        let base = *first.get_or_insert(total);
        println!(
            "| {writers} | {total:.0} | {:.0} | {:.2}x | {cpu_us:.1} |",
            total / writers.max(1) as f64,
            total / base
        );
    }
    Ok(())
}

/// Syncs per second of `writers` threads together, and the writers' CPU microseconds per
/// write and its sync.
fn run(dir: &Path, writers: usize, cli: &Cli) -> anyhow::Result<(f64, f64)> {
    let files =
        (0..writers).map(|i| zero_filled(&dir.join(format!("writer-{i}")))).collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(cli.seconds);
    let counts = std::thread::scope(|scope| {
        let threads: Vec<_> = files
            .iter()
            .map(|file| scope.spawn(move || write_and_sync(file, cli.write_bytes, deadline)))
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a writer thread panicked"))
            .collect::<Result<Vec<(u64, Duration)>, _>>()
    })?;
    let syncs: u64 = counts.iter().map(|(syncs, _)| syncs).sum();
    let cpu: Duration = counts.iter().map(|(_, cpu)| *cpu).sum();
    Ok((syncs as f64 / started.elapsed().as_secs_f64(), cpu.as_secs_f64() * 1e6 / syncs.max(1) as f64))
}

/// A file of `FILE_BYTES` zeros, synced: later syncs carry data only, as a WAL's
/// reused frames do.
fn zero_filled(path: &Path) -> std::io::Result<std::fs::File> {
    let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(path)?;
    file.write_all_at(&vec![0; FILE_BYTES as usize], 0)?;
    file.sync_all()?;
    Ok(file)
}

/// Writes and syncs until `deadline`: the syncs, and the thread's CPU meanwhile.
fn write_and_sync(
    file: &std::fs::File,
    write_bytes: usize,
    deadline: Instant,
) -> std::io::Result<(u64, Duration)> {
    let block = vec![0x5a; write_bytes];
    let (mut offset, mut syncs) = (0, 0);
    let cpu = this_thread_cpu();
    while Instant::now() < deadline {
        file.write_all_at(&block, offset)?;
        file.sync_data()?;
        syncs += 1;
        offset += write_bytes as u64;
        if offset + write_bytes as u64 > FILE_BYTES {
            // Back to the start, so that every write keeps its place in the pages.
            offset = 0;
        }
    }
    Ok((syncs, this_thread_cpu().saturating_sub(cpu)))
}
