//! The raw SQLite group-commit ceiling: what SQLite alone does with the engine's files,
//! rows and batch sizes, with no channels, decisions or network.

use std::cell::Cell;
use std::ffi::c_int;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use crate::Work;
use crate::cost::{Probe, this_thread_cpu};

/// What the raw ceiling measured.
#[derive(Clone, Copy, Debug)]
pub struct Ceiling {
    /// Completed pairs per second, over every file.
    pub pairs_per_s: f64,
    /// CPU of the writing threads per command (a pair is two), in microseconds, without
    /// the checkpoints: the figure to hold against the shard CPU per command, whose
    /// checkpoints run on a thread of their own (all but each one's tail).
    pub cpu_us_per_command: f64,
    /// Bytes the device wrote per pair, the checkpoints' included.
    pub device_bytes_per_pair: f64,
}

/// The phases the writing threads go through.
const WARMING: u8 = 0;
const MEASURING: u8 = 1;
const STOPPING: u8 = 2;

thread_local! {
    /// The WAL's length in pages after the last commit on this thread's connection.
    static WAL_PAGES: Cell<u64> = const { Cell::new(0) };
}

fn on_commit(_wal: &rusqlite::hooks::Wal, pages: c_int) -> rusqlite::Result<()> {
    WAL_PAGES.set(u64::try_from(pages).unwrap_or(0));
    Ok(())
}

/// What one writing thread counted while measuring.
#[derive(Default)]
struct Counted {
    cpu: Duration,
    pairs: u64,
}

/// The raw SQLite group-commit ceiling: `shards` threads, each with its own file opened
/// exactly as the engine opens a shard file, each committing batches of `batch` fresh
/// keys (a pending row appended, as the engine appends records and finds them through its
/// in-memory index) and then a second transaction completing them (the response written
/// into the row, found by its id), as fast as it can. The rows hold 6 of a record's 16
/// columns, and nothing is read before it is written. Each thread checkpoints its WAL
/// past the engine's interval and leaves that time out of its CPU (all of it: a shard
/// leaves out its checkpointer thread's, but copies each checkpoint's tail itself).
/// Measuring starts once every WAL has been checkpointed once.
pub fn raw_sqlite_ceiling(
    dir: &std::path::Path,
    shards: u32,
    batch: usize,
    duration: Duration,
    work: &Work,
) -> anyhow::Result<Ceiling> {
    let settings = oncegate_engine::EngineConfig::default();
    let phase = Arc::new(AtomicU8::new(WARMING));
    // Each thread says when its WAL has been through one checkpoint: from then on its
    // writes reuse the WAL's blocks, as a running shard's do (the first pass allocates
    // them, which costs more CPU and bytes a commit).
    let (warmed, warm) = std::sync::mpsc::channel::<()>();
    let mut threads = Vec::new();
    for shard in 0..shards {
        let path = dir.join(format!("raw-{shard}.sqlite"));
        let (phase, work, settings) = (phase.clone(), work.clone(), settings.clone());
        let warmed = warmed.clone();
        threads.push(
            std::thread::Builder::new()
                .name(format!("raw-sqlite-{shard}"))
                .spawn(move || write_until_stopped(&path, &settings, batch, &work, &phase, warmed))?,
        );
    }
    drop(warmed);
    // Every thread's, or fewer if one failed (its error comes with its join).
    for _ in 0..shards {
        if warm.recv().is_err() {
            break;
        }
    }
    let probe = Probe::this_process().on_device_of(dir);
    let before = probe.sample();
    let started = Instant::now();
    phase.store(MEASURING, Ordering::Relaxed);
    std::thread::sleep(duration);
    phase.store(STOPPING, Ordering::Relaxed);
    let elapsed = started.elapsed();
    let after = probe.sample();
    let mut total = Counted::default();
    for thread in threads {
        let counted = thread.join().map_err(|_| anyhow::anyhow!("a raw SQLite thread panicked"))??;
        total.cpu += counted.cpu;
        total.pairs += counted.pairs;
    }
    let pairs = total.pairs.max(1) as f64;
    Ok(Ceiling {
        pairs_per_s: total.pairs as f64 / elapsed.as_secs_f64(),
        cpu_us_per_command: total.cpu.as_secs_f64() * 1e6 / (2.0 * pairs),
        device_bytes_per_pair: after.device_bytes.saturating_sub(before.device_bytes) as f64 / pairs,
    })
}

/// One writing thread, on a file of its own at `path`, until the phase says stop: batches
/// of pairs, the WAL checkpointed past the interval (saying so on `warmed` the first
/// time), CPU and pairs counted while measuring, checkpoints left out.
fn write_until_stopped(
    path: &std::path::Path,
    settings: &oncegate_engine::EngineConfig,
    batch: usize,
    work: &Work,
    phase: &AtomicU8,
    warmed: std::sync::mpsc::Sender<()>,
) -> anyhow::Result<Counted> {
    let conn = oncegate_engine::testing::open_sqlite_like_shard(path, settings)?;
    let checkpoint_pages = settings.store.sqlite().wal_checkpoint_pages;
    let mut warmed = Some(warmed);
    // The hook replaces SQLite's own checkpoints on commit (a later `wal_autocheckpoint`
    // pragma would put them back).
    conn.wal_hook(Some(on_commit));
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS records (id INTEGER PRIMARY KEY, hash INTEGER NOT NULL,
         key TEXT NOT NULL, token INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL, response BLOB)",
    )?;
    let response = vec![b'r'; work.response_bytes];
    let mut counted = Counted::default();
    let mut n = 0u64;
    loop {
        let now = phase.load(Ordering::Relaxed);
        if now == STOPPING {
            return Ok(counted);
        }
        let started = this_thread_cpu();
        write_pairs(&conn, n, batch, work, &response)?;
        n += batch as u64;
        if now == MEASURING {
            counted.cpu += this_thread_cpu().saturating_sub(started);
            counted.pairs += batch as u64;
        }
        if WAL_PAGES.get() >= checkpoint_pages {
            conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))?;
            if let Some(warmed) = warmed.take() {
                let _ = warmed.send(());
            }
        }
    }
}

/// One batch, rows `first..first + batch`: appended pending in one transaction,
/// completed in a second.
fn write_pairs(
    conn: &rusqlite::Connection,
    first: u64,
    batch: usize,
    work: &Work,
    response: &[u8],
) -> rusqlite::Result<()> {
    let ids = (first..first + batch as u64).map(|id| id as i64 + 1);
    let tx = conn.unchecked_transaction()?;
    {
        let mut insert = tx.prepare_cached(
            "INSERT INTO records (id, hash, key, token, expires_at_ms) VALUES (?1, ?2, ?3, ?4, ?5)",
        )?;
        for id in ids.clone() {
            let key = format!("order-{id}");
            let hash = xxhash_rust::xxh3::xxh3_64(key.as_bytes()) as i64;
            insert.execute(rusqlite::params![id, hash, key, id, work.ttl_ms as i64])?;
        }
    }
    tx.commit()?;
    let tx = conn.unchecked_transaction()?;
    {
        let mut complete = tx.prepare_cached("UPDATE records SET response = ?2 WHERE id = ?1")?;
        for id in ids {
            complete.execute(rusqlite::params![id, response])?;
        }
    }
    tx.commit()
}
