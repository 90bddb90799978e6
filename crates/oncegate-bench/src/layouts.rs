//! Record layouts for the shard file, measured on SQLite alone with the engine's settings:
//! the same reserve+commit pairs, in batches, on a store preloaded with completed
//! records, counting the bytes written (WAL and the final checkpoint included) and the
//! CPU time per pair. The engine's layout is one of them; the others are candidates for
//! the write-path work, each tried before the engine is changed.

use std::collections::HashMap;
use std::time::Instant;

use rusqlite::{Connection, Transaction, params};

use crate::cost::{TICKS_PER_S, this_process_write_bytes, this_thread_ticks};

/// A way to lay records out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Layout {
    /// Today's engine: keyed by the three text columns (`WITHOUT ROWID`), an index on
    /// the reclaim time, the history in the row.
    Today,
    /// One 64-bit hash of the scope as the integer key (the scope kept for collision
    /// checks), no history in the row; records still land on random pages.
    Compact,
    /// Rows appended in arrival order (rowid), found through an index on the hash.
    AppendIndexed,
    /// Rows appended in arrival order, found through an index kept in memory by the
    /// single writer (hash to rowid), rebuilt from the table at open.
    AppendInMemory,
    /// `AppendInMemory` with the full record the engine keeps (the scope as text, ttl,
    /// attempt, history) and the on-disk index on the reclaim time.
    AppendInMemoryFull,
    /// `AppendInMemoryFull` with the response and the history in a table of their own,
    /// keyed by the record's id and written at commit, so the hot row keeps its size.
    AppendSplit,
    /// The engine's schema 5: `AppendInMemoryFull` without the reclaim index, 2 KiB
    /// pages, and no `meta` write per transaction.
    Schema5,
    /// `Schema5` with pending records in a `pending` table of their own: a commit
    /// deletes the pending row and appends the completed record, at its final size, to
    /// `records`, so no row grows in place and the pending table stays a few hot pages.
    PendingSide,
    /// `Schema5` with the record as one BLOB (`id`, then the encoded record: the columns
    /// SQLite never indexes or compares folded into one bound value), each write
    /// encoding the whole record, as the engine would.
    OneBlob,
}

impl Layout {
    fn schema(self) -> &'static str {
        match self {
            Layout::Today => {
                "CREATE TABLE records (tenant TEXT NOT NULL, namespace TEXT NOT NULL, key TEXT NOT NULL,
                   token INTEGER NOT NULL, attempt INTEGER NOT NULL, lease_until_ms INTEGER NOT NULL,
                   expires_at_ms INTEGER NOT NULL, ttl_ms INTEGER NOT NULL, reclaim_at_ms INTEGER NOT NULL,
                   fingerprint BLOB NOT NULL, outcome INTEGER, response BLOB, completed_at_ms INTEGER, history BLOB,
                   PRIMARY KEY (tenant, namespace, key)) WITHOUT ROWID;
                 CREATE INDEX records_by_reclaim_at ON records (reclaim_at_ms);"
            }
            Layout::Compact => {
                "CREATE TABLE records (hash INTEGER PRIMARY KEY, scope BLOB NOT NULL, token INTEGER NOT NULL,
                   lease_until_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL, reclaim_at_ms INTEGER NOT NULL,
                   fingerprint BLOB NOT NULL, outcome INTEGER, response BLOB, completed_at_ms INTEGER);
                 CREATE INDEX records_by_reclaim_at ON records (reclaim_at_ms);"
            }
            Layout::AppendIndexed => {
                "CREATE TABLE records (id INTEGER PRIMARY KEY, hash INTEGER NOT NULL, scope BLOB NOT NULL,
                   token INTEGER NOT NULL, lease_until_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL,
                   fingerprint BLOB NOT NULL, outcome INTEGER, response BLOB, completed_at_ms INTEGER);
                 CREATE INDEX records_by_hash ON records (hash);"
            }
            Layout::AppendInMemory => {
                "CREATE TABLE records (id INTEGER PRIMARY KEY, hash INTEGER NOT NULL, scope BLOB NOT NULL,
                   token INTEGER NOT NULL, lease_until_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL,
                   fingerprint BLOB NOT NULL, outcome INTEGER, response BLOB, completed_at_ms INTEGER);"
            }
            Layout::AppendInMemoryFull => {
                "CREATE TABLE records (id INTEGER PRIMARY KEY, hash INTEGER NOT NULL, tenant TEXT NOT NULL,
                   namespace TEXT NOT NULL, key TEXT NOT NULL, token INTEGER NOT NULL, attempt INTEGER NOT NULL,
                   lease_until_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL, ttl_ms INTEGER NOT NULL,
                   reclaim_at_ms INTEGER NOT NULL, fingerprint BLOB NOT NULL, outcome INTEGER, response BLOB,
                   completed_at_ms INTEGER, history BLOB);
                 CREATE INDEX records_by_reclaim_at ON records (reclaim_at_ms);"
            }
            Layout::Schema5 | Layout::PendingSide => {
                "CREATE TABLE records (id INTEGER PRIMARY KEY, hash INTEGER NOT NULL, tenant TEXT NOT NULL,
                   namespace TEXT NOT NULL, key TEXT NOT NULL, token INTEGER NOT NULL, attempt INTEGER NOT NULL,
                   lease_until_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL, ttl_ms INTEGER NOT NULL,
                   reclaim_at_ms INTEGER NOT NULL, fingerprint BLOB NOT NULL, outcome INTEGER, response BLOB,
                   completed_at_ms INTEGER, history BLOB);
                 CREATE TABLE pending (id INTEGER PRIMARY KEY, hash INTEGER NOT NULL, tenant TEXT NOT NULL,
                   namespace TEXT NOT NULL, key TEXT NOT NULL, token INTEGER NOT NULL, attempt INTEGER NOT NULL,
                   lease_until_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL, ttl_ms INTEGER NOT NULL,
                   reclaim_at_ms INTEGER NOT NULL, fingerprint BLOB NOT NULL, history BLOB);"
            }
            Layout::OneBlob => "CREATE TABLE records (id INTEGER PRIMARY KEY, body BLOB NOT NULL);",
            Layout::AppendSplit => {
                "CREATE TABLE records (id INTEGER PRIMARY KEY, hash INTEGER NOT NULL, tenant TEXT NOT NULL,
                   namespace TEXT NOT NULL, key TEXT NOT NULL, token INTEGER NOT NULL, attempt INTEGER NOT NULL,
                   lease_until_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL, ttl_ms INTEGER NOT NULL,
                   reclaim_at_ms INTEGER NOT NULL, fingerprint BLOB NOT NULL, outcome INTEGER, completed_at_ms INTEGER);
                 CREATE TABLE completions (id INTEGER PRIMARY KEY, response BLOB, history BLOB);
                 CREATE INDEX records_by_reclaim_at ON records (reclaim_at_ms);"
            }
        }
    }
}

/// What one layout cost.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Measured {
    /// The layout.
    pub layout: String,
    /// Pairs per second on one thread.
    pub pairs_per_s: f64,
    /// CPU time of the writing thread per pair, in microseconds.
    pub cpu_us_per_pair: f64,
    /// Bytes written to storage per pair, WAL and a final checkpoint included, as the
    /// process's `write_bytes` counts them.
    pub disk_bytes_per_pair: f64,
    /// Bytes the block device under `dir` wrote per pair (the filesystem's journal
    /// included, and any other writer's: run on a quiet machine). `write_bytes` counts
    /// pages as they are dirtied, and overcounts files written in place; the device's own
    /// count is the arbiter there.
    pub device_bytes_per_pair: f64,
    /// The shard file's size after the run, in bytes.
    pub file_bytes: u64,
}

/// The single writer's memory beside an open transaction.
struct Memory<'a> {
    layout: Layout,
    index: &'a mut HashMap<u64, i64>,
    next_id: &'a mut i64,
}

/// A shard file under one layout, with its in-memory index where the layout has one.
struct Store {
    conn: Connection,
    layout: Layout,
    index: HashMap<u64, i64>,
    next_id: i64,
}

const RESPONSE_BYTES: usize = 256;
/// A two-event history (granted, committed), as the engine stores it.
const HISTORY: [u8; 34] = [7; 34];

/// Keys in no particular order, as clients' idempotency keys (UUIDs, order ids with a
/// random part) are: sequential keys would flatter any layout sorted by key.
fn key_of(i: u64) -> String {
    format!("order-{:016x}-{i}", xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes()))
}

fn hash_of(key: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key.as_bytes())
}

impl Store {
    fn open(path: &std::path::Path, layout: Layout) -> anyhow::Result<Store> {
        let conn = Connection::open(path)?;
        if layout.rows_carry_counters() {
            conn.pragma_update(None, "page_size", 2048)?;
        }
        oncegate_engine::testing::configure_sqlite(&conn, &oncegate_engine::EngineConfig::default())?;
        conn.execute_batch(layout.schema())?;
        conn.execute_batch(
            "CREATE TABLE meta (id INTEGER PRIMARY KEY, next_token INTEGER, high_water_ms INTEGER);
             INSERT INTO meta VALUES (0, 1, 0);",
        )?;
        Ok(Store { conn, layout, index: HashMap::new(), next_id: 1 })
    }

    /// A transaction, and the memory the writes keep in step with it.
    fn split(&mut self) -> rusqlite::Result<(Transaction<'_>, Memory<'_>)> {
        let Store { conn, layout, index, next_id } = self;
        Ok((conn.transaction()?, Memory { layout: *layout, index, next_id }))
    }

    /// Inserts a pending record for each key, and the meta row, in one transaction.
    fn reserve(&mut self, keys: &[String], now: i64) -> anyhow::Result<()> {
        let (tx, mut mem) = self.split()?;
        Store::reserve_in(&mut mem, &tx, keys, now)?;
        if !mem.layout.rows_carry_counters() {
            meta(&tx, now)?;
        }
        tx.commit()?;
        Ok(())
    }

    /// The engine's batches at moderate load: this batch's reserves and the commits of
    /// the keys reserved one batch earlier, in one transaction.
    fn interleaved(
        &mut self,
        reserve: &[String],
        commit: &[String],
        now: i64,
        response: &[u8],
    ) -> anyhow::Result<()> {
        let (tx, mut mem) = self.split()?;
        Store::reserve_in(&mut mem, &tx, reserve, now)?;
        Store::commit_in(&mut mem, &tx, commit, now, response)?;
        if !mem.layout.rows_carry_counters() {
            meta(&tx, now)?;
        }
        tx.commit()?;
        Ok(())
    }

    fn reserve_in(
        mem: &mut Memory<'_>,
        tx: &Transaction<'_>,
        keys: &[String],
        now: i64,
    ) -> anyhow::Result<()> {
        for key in keys {
            let hash = hash_of(key) as i64;
            match mem.layout {
                Layout::Today => {
                    tx.prepare_cached(
                        "INSERT INTO records (tenant, namespace, key, token, attempt, lease_until_ms, expires_at_ms,
                           ttl_ms, reclaim_at_ms, fingerprint, history)
                         VALUES ('default', 'bench', ?1, ?2, 1, ?3, ?4, 3600000, ?4, x'', ?5)",
                    )?
                    .execute(params![key, hash, now + 30_000, now + 3_600_000, &HISTORY[..17]])?;
                }
                Layout::Compact => {
                    tx.prepare_cached(
                        "INSERT INTO records (hash, scope, token, lease_until_ms, expires_at_ms, reclaim_at_ms, fingerprint)
                         VALUES (?1, ?2, ?1, ?3, ?4, ?4, x'')",
                    )?
                    .execute(params![hash, key.as_bytes(), now + 30_000, now + 3_600_000])?;
                }
                Layout::AppendIndexed | Layout::AppendInMemory => {
                    let id = *mem.next_id;
                    *mem.next_id += 1;
                    tx.prepare_cached(
                        "INSERT INTO records (id, hash, scope, token, lease_until_ms, expires_at_ms, fingerprint)
                         VALUES (?1, ?2, ?3, ?2, ?4, ?5, x'')",
                    )?
                    .execute(params![id, hash, key.as_bytes(), now + 30_000, now + 3_600_000])?;
                    if mem.layout == Layout::AppendInMemory {
                        mem.index.insert(hash as u64, id);
                    }
                }
                Layout::OneBlob => {
                    let mut body = Vec::with_capacity(128);
                    encode(&mut body, hash, key, now, None, &HISTORY[..17]);
                    tx.prepare_cached("INSERT INTO records (body) VALUES (?1)")?.execute(params![body])?;
                    mem.index.insert(hash as u64, tx.last_insert_rowid());
                }
                Layout::AppendSplit => {
                    let id = *mem.next_id;
                    *mem.next_id += 1;
                    tx.prepare_cached(
                        "INSERT INTO records (id, hash, tenant, namespace, key, token, attempt, lease_until_ms,
                           expires_at_ms, ttl_ms, reclaim_at_ms, fingerprint)
                         VALUES (?1, ?2, 'default', 'bench', ?3, ?2, 1, ?4, ?5, 3600000, ?5, x'')",
                    )?
                    .execute(params![id, hash, key, now + 30_000, now + 3_600_000])?;
                    mem.index.insert(hash as u64, id);
                }
                Layout::AppendInMemoryFull | Layout::Schema5 | Layout::PendingSide => {
                    let table = if mem.layout == Layout::PendingSide { "pending" } else { "records" };
                    tx.prepare_cached(&format!(
                        "INSERT INTO {table} (hash, tenant, namespace, key, token, attempt, lease_until_ms,
                           expires_at_ms, ttl_ms, reclaim_at_ms, fingerprint, history)
                         VALUES (?1, 'default', 'bench', ?2, ?1, 1, ?3, ?4, 3600000, ?4, x'', ?5)"
                    ))?
                    .execute(params![
                        hash,
                        key,
                        now + 30_000,
                        now + 3_600_000,
                        &HISTORY[..17]
                    ])?;
                    mem.index.insert(hash as u64, tx.last_insert_rowid());
                }
            }
        }
        Ok(())
    }

    /// Completes each key with its response, and the meta row, in one transaction.
    fn commit(&mut self, keys: &[String], now: i64, response: &[u8]) -> anyhow::Result<()> {
        let (tx, mut mem) = self.split()?;
        Store::commit_in(&mut mem, &tx, keys, now, response)?;
        if !mem.layout.rows_carry_counters() {
            meta(&tx, now)?;
        }
        tx.commit()?;
        Ok(())
    }

    fn commit_in(
        mem: &mut Memory<'_>,
        tx: &Transaction<'_>,
        keys: &[String],
        now: i64,
        response: &[u8],
    ) -> anyhow::Result<()> {
        for key in keys {
            let hash = hash_of(key) as i64;
            let sql = match mem.layout {
                Layout::Today => {
                    Store::commit_by_scope(tx, key, now, response)?;
                    continue;
                }
                Layout::Compact => {
                    "UPDATE records SET outcome = 1, response = ?2, completed_at_ms = ?3,
                       expires_at_ms = ?3 + 3600000, reclaim_at_ms = ?3 + 3600000 WHERE hash = ?1"
                }
                Layout::AppendIndexed => {
                    "UPDATE records SET outcome = 1, response = ?2, completed_at_ms = ?3,
                       expires_at_ms = ?3 + 3600000 WHERE hash = ?1"
                }
                Layout::AppendSplit => {
                    Store::commit_split(tx, mem.id_of(hash), now, response)?;
                    continue;
                }
                Layout::OneBlob => {
                    Store::commit_one_blob(tx, mem.id_of(hash), hash, key, now, response)?;
                    continue;
                }
                Layout::PendingSide => {
                    Store::commit_pending_side(mem, tx, hash, now, response)?;
                    continue;
                }
                Layout::AppendInMemoryFull | Layout::Schema5 => {
                    tx.prepare_cached(
                        "UPDATE records SET outcome = 1, response = ?2, completed_at_ms = ?3, history = ?4,
                           expires_at_ms = ?3 + 3600000, reclaim_at_ms = ?3 + 3600000 WHERE id = ?1",
                    )?
                    .execute(params![mem.id_of(hash), response, now, &HISTORY[..]])?;
                    continue;
                }
                Layout::AppendInMemory => {
                    tx.prepare_cached(
                        "UPDATE records SET outcome = 1, response = ?2, completed_at_ms = ?3,
                           expires_at_ms = ?3 + 3600000 WHERE id = ?1",
                    )?
                    .execute(params![mem.id_of(hash), response, now])?;
                    continue;
                }
            };
            tx.prepare_cached(sql)?.execute(params![hash, response, now])?;
        }
        Ok(())
    }

    /// `Today`'s commit: completes the record found by its three text columns.
    fn commit_by_scope(tx: &Transaction<'_>, key: &str, now: i64, response: &[u8]) -> anyhow::Result<()> {
        tx.prepare_cached(
            "UPDATE records SET outcome = 1, response = ?2, completed_at_ms = ?3, history = ?4,
               expires_at_ms = ?3 + 3600000, reclaim_at_ms = ?3 + 3600000
             WHERE tenant = 'default' AND namespace = 'bench' AND key = ?1",
        )?
        .execute(params![key, response, now, &HISTORY[..]])?;
        Ok(())
    }

    /// `AppendSplit`'s commit: completes record `id` in place and writes its response and
    /// history to the completions table.
    fn commit_split(tx: &Transaction<'_>, id: i64, now: i64, response: &[u8]) -> anyhow::Result<()> {
        tx.prepare_cached(
            "UPDATE records SET outcome = 1, completed_at_ms = ?2,
               expires_at_ms = ?2 + 3600000, reclaim_at_ms = ?2 + 3600000 WHERE id = ?1",
        )?
        .execute(params![id, now])?;
        tx.prepare_cached("INSERT INTO completions (id, response, history) VALUES (?1, ?2, ?3)")?
            .execute(params![id, response, &HISTORY[..]])?;
        Ok(())
    }

    /// `OneBlob`'s commit: encodes the whole completed record and overwrites record `id` with it.
    fn commit_one_blob(
        tx: &Transaction<'_>,
        id: i64,
        hash: i64,
        key: &str,
        now: i64,
        response: &[u8],
    ) -> anyhow::Result<()> {
        let mut body = Vec::with_capacity(512);
        encode(&mut body, hash, key, now, Some(response), &HISTORY[..]);
        tx.prepare_cached("UPDATE records SET body = ?2 WHERE id = ?1")?.execute(params![id, body])?;
        Ok(())
    }

    /// `PendingSide`'s commit: appends the completed record to `records`, points the
    /// in-memory index at it, and deletes the pending row.
    fn commit_pending_side(
        mem: &mut Memory<'_>,
        tx: &Transaction<'_>,
        hash: i64,
        now: i64,
        response: &[u8],
    ) -> anyhow::Result<()> {
        let id = mem.id_of(hash);
        tx.prepare_cached(
            "INSERT INTO records (hash, tenant, namespace, key, token, attempt, lease_until_ms,
               expires_at_ms, ttl_ms, reclaim_at_ms, fingerprint, outcome, response, completed_at_ms, history)
             SELECT hash, tenant, namespace, key, token, attempt, lease_until_ms, ?2 + 3600000, ttl_ms,
               ?2 + 3600000, fingerprint, 1, ?3, ?2, ?4 FROM pending WHERE id = ?1",
        )?
        .execute(params![id, now, response, &HISTORY[..]])?;
        mem.index.insert(hash as u64, tx.last_insert_rowid());
        tx.prepare_cached("DELETE FROM pending WHERE id = ?1")?.execute(params![id])?;
        Ok(())
    }
}

impl Memory<'_> {
    /// The id the in-memory index holds for `hash`, or 0 (no row) if none.
    fn id_of(&self, hash: i64) -> i64 {
        self.index.get(&(hash as u64)).copied().unwrap_or(0)
    }
}

impl Layout {
    /// Whether the rows carry the token counter and the time (schema 5), so no `meta`
    /// row is written per transaction.
    fn rows_carry_counters(self) -> bool {
        matches!(self, Layout::Schema5 | Layout::PendingSide | Layout::OneBlob)
    }
}

/// A record encoded as the one-BLOB layout stores it: each integer as a LEB128 varint,
/// each variable part behind its length (the fields of the engine's record, at their
/// sizes in this tool's load).
fn encode(out: &mut Vec<u8>, hash: i64, key: &str, now: i64, response: Option<&[u8]>, history: &[u8]) {
    fn varint(out: &mut Vec<u8>, mut value: u64) {
        while value >= 0x80 {
            out.push(value as u8 | 0x80);
            value >>= 7;
        }
        out.push(value as u8);
    }
    out.clear();
    out.extend_from_slice(&hash.to_le_bytes());
    for value in [hash, 1, now + 30_000, now + 3_600_000, 3_600_000, now + 3_600_000, now] {
        varint(out, value as u64);
    }
    for part in [&b"default"[..], b"bench", key.as_bytes(), b"", response.unwrap_or_default(), history] {
        varint(out, part.len() as u64);
        out.extend_from_slice(part);
    }
    out.push(u8::from(response.is_some()));
}

fn meta(tx: &Transaction<'_>, now: i64) -> rusqlite::Result<usize> {
    tx.prepare_cached("UPDATE meta SET next_token = next_token + 1, high_water_ms = ?1 WHERE id = 0")?
        .execute(params![now])
}

/// Preloads `preload` completed records, then measures `pairs` pairs in batches of
/// `batch` (a batch of reserves, then a batch of their commits; or, `interleaved`, each
/// transaction the reserves of a batch and the commits of the batch before, as the
/// engine's batches are at moderate load), ending with a checkpoint of the whole WAL into
/// the file, which is counted.
pub fn measure(
    dir: &std::path::Path,
    layout: Layout,
    preload: u64,
    pairs: u64,
    batch: usize,
    interleaved: bool,
) -> anyhow::Result<Measured> {
    let path = dir.join(format!("{layout:?}.sqlite"));
    let mut store = Store::open(&path, layout)?;
    let response = vec![b'r'; RESPONSE_BYTES];
    let mut n = 0u64;
    let run = |store: &mut Store, count: u64, n: &mut u64| -> anyhow::Result<()> {
        let mut done = 0;
        while done < count {
            let keys: Vec<String> = (0..batch as u64).map(|i| key_of(*n + i)).collect();
            *n += batch as u64;
            let now = 1_700_000_000_000 + *n as i64;
            store.reserve(&keys, now)?;
            store.commit(&keys, now, &response)?;
            done += batch as u64;
        }
        Ok(())
    };
    let run_interleaved = |store: &mut Store, count: u64, n: &mut u64| -> anyhow::Result<()> {
        let mut previous: Vec<String> = Vec::new();
        let mut done = 0;
        while done < count {
            let keys: Vec<String> = (0..batch as u64).map(|i| key_of(*n + i)).collect();
            *n += batch as u64;
            let now = 1_700_000_000_000 + *n as i64;
            store.interleaved(&keys, &previous, now, &response)?;
            previous = keys;
            done += batch as u64;
        }
        store.commit(&previous, 1_700_000_000_000 + *n as i64, &response)
    };
    run(&mut store, preload, &mut n)?;
    store.conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
    let device_bytes = device_written_bytes(dir);
    let (ticks, bytes, started) = (this_thread_ticks(), this_process_write_bytes(), Instant::now());
    if interleaved {
        run_interleaved(&mut store, pairs, &mut n)?;
    } else {
        run(&mut store, pairs, &mut n)?;
    }
    store.conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
    let (elapsed, ticks, bytes) =
        (started.elapsed(), this_thread_ticks() - ticks, this_process_write_bytes() - bytes);
    let device_bytes = device_written_bytes(dir) - device_bytes;
    drop(store);
    Ok(Measured {
        layout: format!("{layout:?}"),
        pairs_per_s: pairs as f64 / elapsed.as_secs_f64(),
        cpu_us_per_pair: ticks as f64 / TICKS_PER_S * 1e6 / pairs as f64,
        disk_bytes_per_pair: bytes as f64 / pairs as f64,
        device_bytes_per_pair: device_bytes as f64 / pairs as f64,
        file_bytes: std::fs::metadata(&path)?.len(),
    })
}

/// Bytes written by the block device holding `dir`, from its `stat` in sysfs (sectors of
/// 512 bytes, the seventh field); 0 where that cannot be read.
fn device_written_bytes(dir: &std::path::Path) -> u64 {
    match crate::cost::Probe::this_process().on_device_of(dir).device {
        Some((major, minor)) => crate::cost::device_written_bytes(major, minor),
        None => 0,
    }
}
