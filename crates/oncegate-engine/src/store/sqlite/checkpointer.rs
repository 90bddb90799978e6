//! A shard file's checkpointer: a thread with its own connection to the file that copies
//! the WAL into the database file, so that the shard's traffic never stops for it.
//!
//! By default SQLite checkpoints on the committing connection, inside the commit that
//! crosses `wal_autocheckpoint`: the shard thread then copies thousands of pages and syncs
//! the file while its mailbox fills, which was most of the tail at 64 in flight (p99.9
//! ~23 ms against p99 ~3 ms, docs/benchmarks.md). Here the shard's connection carries a
//! WAL hook instead, which notes the WAL's length after each commit; past
//! `wal_checkpoint_pages` the shard pokes this thread, which runs a `PASSIVE` checkpoint:
//! it copies the frames no reader still needs, never waits for the writer, and syncs the
//! WAL before and the database file after (the connection's `synchronous` is the
//! shard's).
//!
//! The writer restarts the WAL from its beginning only when a transaction of its begins
//! with every frame copied, and the shard commits while the thread copies: left alone, the
//! thread would chase the frames committed during its last run, run after run, each with
//! its two syncs, and the WAL would not restart (measured: thousands of runs in 8 s, 10%
//! fewer pairs/s). So after each run the thread leaves the tail (those few frames) to the
//! shard, which copies them on its own connection before its next write; that write then
//! restarts the WAL. The shard's pause is the tail's, a fraction of a millisecond.
//!
//! Durability does not depend on this thread: a checkpoint syncs the WAL before it copies
//! anything, and copies only committed frames (with `durability = "full"` each commit had
//! synced them already). Neither connection waits long for the other's locks (rusqlite's
//! default busy timeout, 5 s, bounds it): a `PASSIVE` checkpoint never takes the writer's
//! lock nor waits for one. If the thread falls behind (the WAL at four
//! times the interval), the shard checkpoints on its own connection before its next
//! batch, as SQLite would have, so the WAL stays bounded whatever the thread does.

use std::cell::Cell;
use std::ffi::c_int;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use rusqlite::hooks::Wal;
use rusqlite::{Connection, OpenFlags};

use super::StoreError;

/// How far past the interval the WAL may grow before the shard checkpoints itself.
const BEHIND_FACTOR: u64 = 4;

thread_local! {
    /// The WAL's length in pages after the last commit on this thread's shard connection
    /// (the hook runs inside `COMMIT`, on the committing thread).
    static WAL_PAGES: Cell<u64> = const { Cell::new(0) };
}

fn on_commit(_wal: &Wal, pages: c_int) -> rusqlite::Result<()> {
    WAL_PAGES.set(u64::try_from(pages).unwrap_or(0));
    Ok(())
}

/// The thread and what the shard tells it.
pub(crate) struct Checkpointer {
    /// Dropped to stop the thread.
    poke: Option<Sender<()>>,
    /// Set when the shard closes the file: the thread runs no further checkpoint.
    stopping: Arc<AtomicBool>,
    /// Cuts a running checkpoint short when the shard closes the file.
    interrupt: rusqlite::InterruptHandle,
    thread: Option<JoinHandle<()>>,
    interval_pages: u64,
    /// Whether the last commit left the WAL past [`BEHIND_FACTOR`] times the interval.
    behind: Cell<bool>,
    /// Set by the thread after each run: the frames committed during it are left for the
    /// shard to copy before its next write, which then restarts the WAL.
    tail_due: Arc<AtomicBool>,
    /// Checkpoints run, the thread's and the shard's own.
    runs: Arc<AtomicU64>,
    /// An I/O error of the thread's checkpoint (its syncs may have failed), for the
    /// shard to halt on before its next write.
    failed_sync: Arc<Mutex<Option<rusqlite::Error>>>,
}

impl Checkpointer {
    /// Hooks `shard`'s commits (which also turns its own automatic checkpoints off) and
    /// starts the thread on a second connection to the file at `path`.
    pub fn start(
        shard: &Connection,
        path: &Path,
        vfs: &str,
        synchronous: &str,
        interval_pages: u64,
        runs: Arc<AtomicU64>,
    ) -> Result<Checkpointer, StoreError> {
        let conn = Connection::open_with_flags_and_vfs(path, OpenFlags::default(), vfs)?;
        conn.pragma_update(None, "synchronous", synchronous)?;
        // A checkpoint copies frames through its own buffer; the cache only holds the
        // schema.
        conn.pragma_update(None, "cache_size", -256)?;
        shard.wal_hook(Some(on_commit));
        let interrupt = conn.get_interrupt_handle();
        let (poke, pokes) = crossbeam_channel::bounded(1);
        let counted = Arc::clone(&runs);
        let tail_due = Arc::new(AtomicBool::new(false));
        let due = Arc::clone(&tail_due);
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = Arc::clone(&stopping);
        let failed_sync = Arc::new(Mutex::new(None));
        let failed = Arc::clone(&failed_sync);
        let thread = std::thread::Builder::new()
            .name("oncegate-ckpt".to_owned())
            .spawn(move || {
                let signals =
                    Signals { runs: &counted, tail_due: &due, stopping: &stop, failed_sync: &failed };
                run(&conn, &pokes, &signals)
            })
            .map_err(|source| StoreError::Io { path: path.to_owned(), source })?;
        Ok(Checkpointer {
            poke: Some(poke),
            stopping,
            interrupt,
            thread: Some(thread),
            interval_pages: interval_pages.max(1),
            behind: Cell::new(false),
            tail_due,
            runs,
            failed_sync,
        })
    }

    /// The I/O error of a checkpoint of the thread's, once: the shard halts on it.
    pub fn take_failed_sync(&self) -> Option<rusqlite::Error> {
        self.failed_sync.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()
    }

    /// After a commit on the shard's connection: wakes the thread once the WAL passed
    /// the interval, unless the thread has just run and left the tail to the shard (the
    /// WAL keeps its length until the shard's next write restarts it).
    pub fn committed(&self) {
        let pages = WAL_PAGES.take();
        self.behind.set(pages >= self.interval_pages.saturating_mul(BEHIND_FACTOR));
        if pages >= self.interval_pages
            && !self.tail_due.load(Ordering::Relaxed)
            && let Some(poke) = &self.poke
        {
            let _ = poke.try_send(());
        }
    }

    /// Whether the shard must checkpoint on its own connection before its next write:
    /// the thread left it a tail, or is behind.
    pub fn shard_must_checkpoint(&self) -> bool {
        self.tail_due.swap(false, Ordering::Relaxed) || self.behind.get()
    }

    /// Counts a checkpoint the shard ran on its own connection.
    pub fn count(&self) {
        self.runs.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Checkpointer {
    /// Stops the thread and waits for it, so that no checkpoint runs on a file the shard
    /// has closed (the shard's connection, closed after, is then the file's last). A
    /// checkpoint under way is interrupted rather than awaited, and none starts after
    /// (a poke may still be queued). The frames it did not copy stay in the WAL: the
    /// shard's connection copies them as it closes, as SQLite does for its last
    /// connection, so the close still costs what is left to copy; what the interrupt saves
    /// is the thread's own run starting over. (An interrupt that lands just before the
    /// thread's statement starts is lost, and that run completes: one run at most.)
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.poke = None;
        self.interrupt.interrupt();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What the thread shares with the shard.
struct Signals<'a> {
    runs: &'a AtomicU64,
    tail_due: &'a AtomicBool,
    stopping: &'a AtomicBool,
    failed_sync: &'a Mutex<Option<rusqlite::Error>>,
}

/// Checkpoints once per poke until the shard drops its end or stops it.
fn run(conn: &Connection, pokes: &Receiver<()>, signals: &Signals<'_>) {
    let Signals { runs, tail_due, stopping, failed_sync } = *signals;
    while pokes.recv().is_ok() && !stopping.load(Ordering::SeqCst) {
        match checkpoint(conn) {
            Ok(copied) => {
                // Pokes from the commits during this run would only chase their frames:
                // those are the tail, the shard's to copy.
                while pokes.try_recv().is_ok() {}
                if copied {
                    runs.fetch_add(1, Ordering::Relaxed);
                }
                tail_due.store(true, Ordering::Relaxed);
            }
            // An interrupt means the shard is closing the file.
            Err(StoreError::Sqlite(error))
                if error.sqlite_error_code() == Some(rusqlite::ErrorCode::OperationInterrupted) =>
            {
                break;
            }
            // Its syncs may have failed (with `durability = "normal"` a checkpoint's WAL
            // sync is the only one its frames get): the shard halts, and this thread
            // runs no more.
            Err(StoreError::Sqlite(error))
                if error.sqlite_error_code() == Some(rusqlite::ErrorCode::SystemIoFailure) =>
            {
                tracing::error!(%error, "a background checkpoint failed with an I/O error");
                *failed_sync.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(error);
                break;
            }
            // The frames stay in the WAL, durable; the next poke tries again, and the
            // shard checkpoints itself if this keeps failing.
            Err(error) => tracing::warn!(%error, "a background checkpoint failed"),
        }
    }
}

/// Runs a `PASSIVE` checkpoint on `conn`; returns false if the other connection's
/// checkpoint was running (SQLite's busy flag), which then copied nothing.
pub(crate) fn checkpoint(conn: &Connection) -> Result<bool, StoreError> {
    let busy: i64 = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| row.get(0))?;
    Ok(busy == 0)
}
