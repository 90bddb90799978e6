//! The raw SQLite group-commit ceiling: what SQLite alone does with the engine's settings
//! and batch sizes, with no channels, decisions or network.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::Work;

/// The raw SQLite group-commit ceiling: `shards` threads, each with its own WAL file set up
/// by the engine's own settings (`oncegate_engine::testing::configure_sqlite`), each committing batches of `batch` fresh keys (insert-if-absent with a
/// response-less pending row) and then a second transaction completing them (the
/// response written), as fast as it can: no channels, no decisions, no network. Returns
/// completed pairs per second.
pub fn raw_sqlite_ceiling(
    dir: &std::path::Path,
    shards: u32,
    batch: usize,
    duration: Duration,
    work: &Work,
) -> anyhow::Result<f64> {
    let settings = oncegate_engine::EngineConfig::default();
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for shard in 0..shards {
        let path = dir.join(format!("raw-{shard}.sqlite"));
        let (stop, done, work) = (stop.clone(), done.clone(), work.clone());
        let settings = settings.clone();
        threads.push(std::thread::spawn(move || -> anyhow::Result<()> {
            let flags = rusqlite::OpenFlags::default();
            let mut conn = rusqlite::Connection::open_with_flags_and_vfs(&path, flags, "unix-excl")?;
            // Exactly the engine's settings and VFS: the ceiling is of the same SQLite.
            oncegate_engine::testing::configure_sqlite(&conn, &settings)?;
            conn.execute_batch(
                "CREATE TABLE IF NOT EXISTS records (key TEXT PRIMARY KEY, token INTEGER NOT NULL,
                 expires_at_ms INTEGER NOT NULL, response BLOB) WITHOUT ROWID",
            )?;
            let response = vec![b'r'; work.response_bytes];
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let keys: Vec<String> = (0..batch).map(|i| format!("{shard}-{n}-{i}")).collect();
                n += 1;
                let tx = conn.transaction()?;
                {
                    let mut insert = tx.prepare_cached(
                        "INSERT INTO records (key, token, expires_at_ms) VALUES (?1, ?2, ?3) ON CONFLICT DO NOTHING",
                    )?;
                    for (i, key) in keys.iter().enumerate() {
                        insert.execute(rusqlite::params![key, i as i64, work.ttl_ms as i64])?;
                    }
                }
                tx.commit()?;
                let tx = conn.transaction()?;
                {
                    let mut complete =
                        tx.prepare_cached("UPDATE records SET response = ?2 WHERE key = ?1 AND response IS NULL")?;
                    for key in &keys {
                        complete.execute(rusqlite::params![key, response])?;
                    }
                }
                tx.commit()?;
                done.fetch_add(batch as u64, Ordering::Relaxed);
            }
            Ok(())
        }));
    }
    std::thread::sleep(Duration::from_millis(500));
    let before = done.load(Ordering::Relaxed);
    let started = Instant::now();
    std::thread::sleep(duration);
    let pairs = done.load(Ordering::Relaxed) - before;
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread.join().map_err(|_| anyhow::anyhow!("a raw SQLite thread panicked"))??;
    }
    Ok(pairs as f64 / elapsed.as_secs_f64())
}
