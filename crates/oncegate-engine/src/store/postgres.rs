//! The PostgreSQL store: one table shared by every shard of every oncegate node pointed at
//! the database, so that nodes scale out on a database the operator already replicates.
//!
//! Nothing a node keeps in memory is the truth here; each transaction makes its own:
//!
//! - **Locks.** A write transaction first takes a transaction-scoped advisory lock on the
//!   routing hash of every key it decides, in ascending order in one statement, then reads
//!   those keys' rows `FOR UPDATE`. Two batches that share a key run one after the other,
//!   and since every batch takes all its locks in one sorted statement before anything
//!   else, no two batches wait on each other in a cycle. A key without a row is locked
//!   too (the advisory lock does not need the row), so two nodes inserting the same key
//!   cannot both decide it is free. Reclaim takes rows `FOR UPDATE SKIP LOCKED`: it never
//!   waits and never deletes a row a batch is deciding.
//! - **Time.** Read after the locks, in the transaction: the database server's clock
//!   (`clock_timestamp()`), never below the greatest high-water mark any shard of any node
//!   has persisted (table `oncegate_clock`, one row per node and shard, written by every
//!   write transaction). A key's decisions therefore see a time that never goes back, and
//!   nodes with skewed clocks agree on every lease and ttl.
//! - **Tokens.** Drawn from the sequence `oncegate_tokens`, which steps by
//!   [`TOKEN_BLOCK`]: a transaction draws a block after its locks are held and hands out
//!   tokens from it in order. Any later draw, by any node, returns a block above the
//!   whole of this one, and a key's next transaction draws only after this one
//!   committed, so each key's tokens strictly increase across nodes and across the
//!   expiry of its record.
//! - **Writes** are buffered and sent at commit in one statement per kind (an upsert of
//!   every changed record, a delete of every deleted one), so a batch costs a handful of
//!   round trips and one WAL flush, whatever its size.
//!
//! Lock waits happen only in the lock statement, so deadlocks and serialization failures
//! (which `READ COMMITTED` with this order should never raise) are retried there, inside
//! the node, and never reach a caller.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod};
use oncegate_core::route::{self, Routing};
use oncegate_core::{Completion, Fingerprint, Outcome, Record, Scope};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Row, Statement};

use super::{Meta, StoreError, decode_history, encode_history, stored_scope, stored_tenant};
use crate::config::{Durability, PgClock, StoreConfig};
use crate::faults::Faults;
use crate::placement::slots;
use crate::quota::Tally;

/// How every node routes keys to its shards. Rows are found by key, so routing only
/// spreads the work; derived keys go by their base, so a reserve decides both buckets of
/// a bucket grace in one batch (every node the same, since the slot column follows it).
pub(crate) const ROUTING: Routing = Routing::BucketBase;

/// `oncegate_schema.derived_keys` of a database whose derived keys end `::bucket`.
const DERIVED_BUCKET_BASE: &str = "bucket-base";
/// `oncegate_schema.derived_keys` of a database made at schema version 1 (`:bucket`).
const DERIVED_WHOLE_KEY: &str = "whole-key";

/// The derived keys' format a database records.
async fn derived_format(client: &Object) -> Result<Routing, StoreError> {
    let row = client
        .query_one("SELECT derived_keys FROM oncegate_schema WHERE id = 0", &[])
        .await
        .map_err(StoreError::Postgres)?;
    match row.get::<_, &str>(0) {
        DERIVED_BUCKET_BASE => Ok(Routing::BucketBase),
        DERIVED_WHOLE_KEY => Ok(Routing::WholeKey),
        other => Err(StoreError::Corrupt(format!("oncegate_schema.derived_keys is {other:?}"))),
    }
}

/// The schema version this code reads and writes (table `oncegate_schema`). Version 2
/// records the derived keys' format (`derived_keys`): `bucket-base` for databases made
/// since (`base::bucket`), `whole-key` for those made at version 1, which keep `base:bucket`
/// so that a retry finds the key its first attempt stored under an older node.
pub const SCHEMA_VERSION: i64 = 2;

/// How far apart consecutive draws of the token sequence are: the tokens one transaction
/// may hand out before it draws again.
pub const TOKEN_BLOCK: u64 = 1024;

/// Taken (transaction-scoped) while the schema is created or upgraded, so that nodes
/// starting together do it once. An arbitrary constant: `oncegate` in ASCII.
const SCHEMA_LOCK: i64 = 0x6f6e_6365_6761_7465;

/// How much faster than the node's own monotonic clock the database's clock may advance
/// between two of the node's transactions, in thousandths: a forward step of the
/// database server's clock (an NTP step, a fail-over to a host whose clock runs ahead)
/// is absorbed at this rate instead of ageing every lease at once, the way a shard file's
/// frame never lets a wall-clock step reach a decision. 1% covers any clock discipline's
/// slewing. A shard's reopen keeps its pace (see `Postgres::paces`); only the first
/// transaction of a lane in a process takes the database's time as it is.
const CLOCK_SLEW_PER_MILLE: u64 = 10;

/// Lock attempts of one transaction before a deadlock or serialization failure is given
/// up as a storage failure.
const LOCK_ATTEMPTS_MAX: u32 = 16;

/// Version 1: the records, the per-lane clock marks, the token sequence.
const SCHEMA_1: &str = "
CREATE TABLE oncegate_records (
    tenant          text     NOT NULL,
    namespace       text     NOT NULL,
    key             text     NOT NULL,
    hash            bigint   NOT NULL,
    slot            integer  NOT NULL,
    token           bigint   NOT NULL,
    attempt         integer  NOT NULL,
    lease_until_ms  bigint   NOT NULL,
    expires_at_ms   bigint   NOT NULL,
    ttl_ms          bigint   NOT NULL,
    reclaim_at_ms   bigint   NOT NULL,
    fingerprint     bytea    NOT NULL,
    outcome         smallint,
    response        bytea,
    completed_at_ms bigint,
    history         bytea    NOT NULL,
    PRIMARY KEY (tenant, namespace, key)
);
CREATE INDEX oncegate_records_by_reclaim ON oncegate_records (reclaim_at_ms);
CREATE TABLE oncegate_clock (
    lane          text   PRIMARY KEY,
    high_water_ms bigint NOT NULL
);
CREATE SEQUENCE oncegate_tokens INCREMENT BY 1024 MINVALUE 1 START WITH 1 CACHE 1;
";

/// The database's time (held to `$4`, see [`CLOCK_SLEW_PER_MILLE`]), never below any
/// lane's mark; a write transaction also raises its lane's mark to it and draws the first
/// token block.
/// Both also return the database's clock as it is (`raw`), which [`Store::begin`] holds
/// to the cap again once the statements are back: the cap sent with them was reckoned
/// before they waited for the locks.
const CLOCK_WRITE: &str = "
WITH d AS (SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS raw),
t AS (
    SELECT greatest(CASE WHEN $2 THEN least(d.raw, $4) ELSE $3 END,
        (SELECT coalesce(max(high_water_ms), 0) FROM oncegate_clock)) AS ms
    FROM d)
INSERT INTO oncegate_clock (lane, high_water_ms) SELECT $1, ms FROM t
ON CONFLICT (lane) DO UPDATE SET high_water_ms = greatest(oncegate_clock.high_water_ms, excluded.high_water_ms)
RETURNING high_water_ms, (SELECT raw FROM d), nextval('oncegate_tokens')";
const CLOCK_READ: &str = "
WITH d AS (SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS raw)
SELECT greatest(CASE WHEN $1 THEN least(d.raw, $3) ELSE $2 END,
    (SELECT coalesce(max(high_water_ms), 0) FROM oncegate_clock)), d.raw
FROM d";

/// Raises a lane's mark to a transaction's time when that time came out above the mark
/// its clock statement wrote (see [`CLOCK_WRITE`]); sent with the commit.
const RAISE_MARK: &str =
    "UPDATE oncegate_clock SET high_water_ms = greatest(high_water_ms, $2) WHERE lane = $1";

/// The rows of the batch's keys, by the primary key (the only index a write must keep
/// besides the reclaim deadline's).
const SELECT_ROWS: &str = "
SELECT tenant, namespace, key, token, attempt, lease_until_ms, expires_at_ms, ttl_ms,
    fingerprint, outcome, response, completed_at_ms, history
FROM oncegate_records WHERE (tenant, namespace, key) IN
    (SELECT * FROM unnest($1::text[], $2::text[], $3::text[]))";

const UPSERT: &str = "
INSERT INTO oncegate_records (tenant, namespace, key, hash, slot, token, attempt, lease_until_ms,
    expires_at_ms, ttl_ms, reclaim_at_ms, fingerprint, outcome, response, completed_at_ms, history)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::integer[], $6::bigint[],
    $7::integer[], $8::bigint[], $9::bigint[], $10::bigint[], $11::bigint[], $12::bytea[],
    $13::smallint[], $14::bytea[], $15::bigint[], $16::bytea[])
ON CONFLICT (tenant, namespace, key) DO UPDATE SET
    slot = excluded.slot, token = excluded.token, attempt = excluded.attempt, lease_until_ms = excluded.lease_until_ms,
    expires_at_ms = excluded.expires_at_ms, ttl_ms = excluded.ttl_ms, reclaim_at_ms = excluded.reclaim_at_ms,
    fingerprint = excluded.fingerprint, outcome = excluded.outcome, response = excluded.response,
    completed_at_ms = excluded.completed_at_ms, history = excluded.history";
const DELETE: &str = "
DELETE FROM oncegate_records WHERE (tenant, namespace, key) IN
    (SELECT * FROM unnest($1::text[], $2::text[], $3::text[]))";
/// Rows another transaction holds are skipped, and so are the keys this one locked (it may
/// have decided them already).
const RECLAIM: &str = "
DELETE FROM oncegate_records WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM oncegate_records
    WHERE reclaim_at_ms <= $1 AND slot = ANY($2) AND NOT (hash = ANY($3))
    ORDER BY reclaim_at_ms LIMIT $4 FOR UPDATE SKIP LOCKED))
RETURNING tenant, outcome IS NULL";

/// What every shard of an engine on PostgreSQL shares: the runtime its connections run
/// on, the pool, and the node's name in the clock table.
pub(crate) struct Postgres {
    /// `Some` until dropped: shut down in the background, so that an engine dropped
    /// inside an async runtime does not block it.
    runtime: Option<tokio::runtime::Runtime>,
    pool: Pool,
    /// The node's name; each shard's clock mark is the row `{node}/{shard}`.
    node: String,
    config: StoreConfig,
    /// The engine's `durability`: under `full`, each session commits with at least
    /// `synchronous_commit = on` ([`session_synchronous_commit`]).
    durability: Durability,
    /// Where the database is, without the password, for logs.
    pub display: String,
    /// Each lane's last `(time, monotonic reading)` ([`Store::last_now`]), kept here
    /// when its store is dropped, so that the shard's next store (a reopen after a
    /// failure, such as the fail-over that a clock running ahead comes with) holds the
    /// database's clock to the node's pace from its first transaction.
    paces: std::sync::Mutex<std::collections::HashMap<String, (u64, u64)>>,
    /// The engine's clock, whose monotonic readings pace the database's (a node's
    /// transactions may see the database's clock run ahead of them by
    /// [`CLOCK_SLEW_PER_MILLE`] only).
    clock: Arc<dyn crate::clock::Clock>,
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl std::fmt::Debug for Postgres {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Postgres").field("database", &self.display).field("node", &self.node).finish()
    }
}

/// `Some` for an error worth trying again: the lock statement lost a deadlock or a
/// serialization check.
fn retryable(error: &tokio_postgres::Error) -> bool {
    matches!(error.code(), Some(c) if *c == SqlState::T_R_DEADLOCK_DETECTED || *c == SqlState::T_R_SERIALIZATION_FAILURE)
}

/// The server's message and code when there is one, else the driver's words; the
/// connection string appears in neither.
pub(crate) fn describe(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => error.to_string(),
    }
}

/// A step of setting the store up failed.
fn setup(what: &str, source: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::PostgresSetup { what: what.to_owned(), source: Box::new(source) }
}

/// PostgreSQL integers are signed; times and counters stay far below `i64::MAX`, and
/// clamping keeps the ordering if one ever did not.
fn to_sql(value: u64) -> i64 {
    value.min(i64::MAX as u64) as i64
}

fn from_sql(value: i64) -> u64 {
    value.max(0) as u64
}

/// TLS to the database when the URL asks for it (`sslmode=prefer` or `require`). The
/// certificate is always checked (stricter than libpq's `require`), against the system's
/// roots and those in `ca_path`.
fn tls(ca_path: Option<&std::path::Path>) -> Result<tokio_postgres_rustls::MakeRustlsConnect, StoreError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    if let Some(path) = ca_path {
        let unreadable = |source: Box<dyn std::error::Error + Send + Sync>| StoreError::PostgresSetup {
            what: format!("postgres_tls_ca_path {}", path.display()),
            source,
        };
        let certs = CertificateDer::pem_file_iter(path).map_err(|e| unreadable(e.into()))?;
        for cert in certs {
            roots.add(cert.map_err(|e| unreadable(e.into()))?).map_err(|e| unreadable(e.into()))?;
        }
    }
    let config =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| setup("tls", e))?
            .with_root_certificates(roots)
            .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

impl Postgres {
    /// The lanes' paces (a poisoned lock still holds whole entries: each is one insert).
    fn paces(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, (u64, u64)>> {
        self.paces.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A connection ready for a shard: the session's timeouts set (the server gives up a
    /// statement, a lock wait included, and an idle open transaction after the time the
    /// node waits for an answer, so a node that gave up leaves no lock behind), its
    /// `search_path` set to `postgres_schema` (nodes whose roles would choose different
    /// schemas would each grant every key in tables of their own), refused when
    /// read-only (a standby), the schema created or checked, the statements prepared. A connection that fails any step is closed, never handed back to the
    /// pool.
    fn connect(&self, report: bool) -> Result<(Object, Statements), StoreError> {
        let client = self.run(async { self.pool.get().await.map_err(|e| setup("connect", e)) })?;
        let timeout_ms = self.config.postgres_statement_timeout_ms;
        let schema = &self.config.postgres_schema;
        let ready = self.run(async {
            let limit = format!("{timeout_ms}ms");
            let inherited: String = client
                .query_one(
                    "SELECT set_config('statement_timeout', $1, false), \
                     set_config('idle_in_transaction_session_timeout', $1, false), \
                     set_config('search_path', quote_ident($2), false), \
                     current_setting('synchronous_commit')",
                    &[&limit, schema],
                )
                .await
                .map_err(StoreError::Postgres)?
                .get(3);
            check_schema_named(&client, schema).await?;
            if let Some(setting) = session_synchronous_commit(self.durability, &inherited) {
                client
                    .query("SELECT set_config('synchronous_commit', $1, false)", &[&setting])
                    .await
                    .map_err(StoreError::Postgres)?;
            }
            let read_only: String = client
                .query_one("SHOW transaction_read_only", &[])
                .await
                .map_err(StoreError::Postgres)?
                .get(0);
            if read_only == "on" {
                return Err(StoreError::PostgresRefused(
                    "the database is read-only (a standby?); oncegate needs the primary".to_owned(),
                ));
            }
            migrate(&client, schema).await?;
            check_sequence(&client).await?;
            if report {
                report_durability(&client, &self.display, &inherited).await?;
            }
            Statements::prepare(&client).await
        });
        match ready {
            Ok(statements) => Ok((client, statements)),
            Err(error) => {
                drop(Object::take(client));
                Err(error)
            }
        }
    }

    /// Builds the pool (connections are made when shards open, so an unreachable
    /// database fails the shards, which retry, rather than the engine's start).
    pub fn new(
        config: &StoreConfig,
        durability: Durability,
        node: String,
        clock: Arc<dyn crate::clock::Clock>,
    ) -> Result<Postgres, StoreError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("oncegate-postgres")
            .enable_all()
            .build()
            .map_err(|e| setup("runtime", e))?;
        let mut pg: tokio_postgres::Config =
            config.postgres_url.expose().parse().map_err(|e| setup("postgres_url", e))?;
        pg.connect_timeout(Duration::from_millis(config.postgres_statement_timeout_ms));
        pg.application_name("oncegate");
        let manager = Manager::from_config(
            pg,
            tls(config.postgres_tls_ca_path.as_deref())?,
            ManagerConfig { recycling_method: RecyclingMethod::Fast },
        );
        let pool = Pool::builder(manager)
            .max_size(config.postgres_pool_size)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .create_timeout(Some(Duration::from_millis(config.postgres_statement_timeout_ms)))
            .wait_timeout(Some(Duration::from_millis(config.postgres_statement_timeout_ms)))
            .build()
            .map_err(|e| setup("pool", e))?;
        Ok(Postgres {
            runtime: Some(runtime),
            pool,
            node,
            display: config.postgres_url.redacted(),
            config: config.clone(),
            durability,
            paces: std::sync::Mutex::default(),
            clock,
        })
    }

    /// Runs `future` on the store's runtime from a shard's thread, bounded by
    /// `postgres_statement_timeout_ms`: a database that stops answering fails the shard
    /// instead of hanging it.
    fn run<T>(&self, future: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        self.run_bounded(future)?
    }

    /// [`Postgres::run`] for a future with an error of its own.
    fn run_bounded<T>(&self, future: impl Future<Output = T>) -> Result<T, StoreError> {
        self.run_within("postgres_statement_timeout_ms", self.config.postgres_statement_timeout_ms, future)
    }

    /// Runs `future` bounded by the limit `field` (`limit_ms`).
    fn run_within<T>(
        &self,
        field: &'static str,
        limit_ms: u64,
        future: impl Future<Output = T>,
    ) -> Result<T, StoreError> {
        let limit = Duration::from_millis(limit_ms);
        let runtime = self.runtime.as_ref().expect("the runtime lives as long as the store");
        runtime
            .block_on(async { tokio::time::timeout(limit, future).await })
            .map_err(|_| StoreError::PostgresTimeout { field, limit_ms })
    }
}

/// What kind of open a shard's is.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Opening {
    /// The shard's first open in this process.
    pub first: bool,
    /// Whether to count the shard's records (at the first open and an operator's reopen).
    pub count: bool,
}

/// One shard's connection to the shared table.
pub(crate) struct Store {
    pg: Arc<Postgres>,
    /// `None` after a failure: the connection is then dropped, not returned to the pool.
    client: Option<Object>,
    /// The connection's prepared statements.
    statements: Option<Statements>,
    /// This shard's row in `oncegate_clock`.
    lane: String,
    /// The slots this shard reclaims (every node's shards together own every slot).
    owned: Vec<i32>,
    tally: Option<Tally>,
    next_reclaim_ms: Cell<Option<u64>>,
    /// How long after a reclaim the next one looks (`reclaim_granularity_ms`).
    reclaim_every_ms: u64,
    faults: Faults,
    /// The time of this shard's last transaction and the node's monotonic reading when
    /// its statements came back: the next one's time may run ahead of the node's clock
    /// only by [`CLOCK_SLEW_PER_MILLE`].
    last_now: Option<(u64, u64)>,
}

impl Drop for Store {
    fn drop(&mut self) {
        // A connection whose transaction may still be open (a failure mid-batch) is
        // closed rather than handed to the next shard that asks the pool.
        if let Some(client) = self.client.take() {
            drop(Object::take(client));
        }
        if let Some(last_now) = self.last_now {
            self.pg.paces().insert(std::mem::take(&mut self.lane), last_now);
        }
    }
}

impl Store {
    /// Connects, creates or checks the schema, refuses a read-only database, and, when
    /// `opening.count` (the node's start, an operator's reopen), counts the records of
    /// the shard's slots. Returns the greatest persisted clock mark and the derived keys'
    /// format the database records.
    ///
    /// The count is one pass over the table, so it runs under its own bound
    /// (`postgres_count_timeout_ms`, the statement timeout lifted for it), and a shard
    /// that reconnects after the database came back keeps the counts it had, rather than
    /// every shard of every node scanning the table at once on a freshly promoted
    /// primary; a table too large to count within a statement's timeout no longer keeps a
    /// node from ever opening.
    pub fn open(
        pg: &Arc<Postgres>,
        shard: u32,
        owned: &slots::Owned,
        faults: &Faults,
        opening: Opening,
        reclaim_every_ms: u64,
    ) -> Result<(Store, Meta, Routing), StoreError> {
        if faults.open_should_fail() {
            return Err(StoreError::Injected("open"));
        }
        let owned: Vec<i32> = (0..route::SLOT_COUNT).filter(|s| owned.owns(*s)).map(|s| s as i32).collect();
        let (mut client, statements) = pg.connect(opening.first && shard == 0)?;
        let tally = if opening.count {
            let counted = pg.run_within(
                "postgres_count_timeout_ms",
                pg.config.postgres_count_timeout_ms,
                count(&mut client, &owned, pg.config.postgres_count_timeout_ms),
            );
            match counted.and_then(|c| c) {
                Ok(tally) => Some(tally),
                Err(error) => {
                    drop(Object::take(client));
                    return Err(error);
                }
            }
        } else {
            None
        };
        let counted = pg.run(async {
            let mark: i64 = client
                .query_one("SELECT coalesce(max(high_water_ms), 0) FROM oncegate_clock", &[])
                .await
                .map_err(StoreError::Postgres)?
                .get(0);
            Ok((mark, derived_format(&client).await?))
        });
        let (mark, format) = match counted {
            Ok(counted) => counted,
            Err(error) => {
                drop(Object::take(client));
                return Err(error);
            }
        };
        let lane = format!("{}/{shard}", pg.node);
        // Only a process's first store of a lane takes the database's time as it is.
        let last_now = pg.paces().get(&lane).copied();
        let store = Store {
            pg: Arc::clone(pg),
            client: Some(client),
            statements: Some(statements),
            lane,
            owned,
            tally,
            next_reclaim_ms: Cell::new(None),
            reclaim_every_ms,
            faults: faults.clone(),
            last_now,
        };
        Ok((store, Meta { next_token: 1, high_water_ms: from_sql(mark) }, format))
    }

    /// Replaces a connection the server closed (a restart, a fail-over) before it is
    /// used, so the first batch after the database is back does not fail on it.
    fn reconnect(&mut self) -> Result<(), StoreError> {
        if let Some(closed) = self.client.take() {
            drop(Object::take(closed));
        }
        let (client, statements) = self.pg.connect(false)?;
        self.client = Some(client);
        self.statements = Some(statements);
        Ok(())
    }

    fn statements(&self) -> &Statements {
        self.statements.as_ref().expect("prepared with the connection")
    }

    fn client(&self) -> &Object {
        self.client.as_ref().expect("a store keeps its connection until dropped")
    }

    /// The records of the shard's slots as counted by this open; `None` when it did not
    /// count (a reconnect: the shard keeps its own counts).
    pub fn take_count(&mut self) -> Option<Tally> {
        self.tally.take()
    }

    pub fn next_reclaim_ms(&self) -> Option<u64> {
        self.next_reclaim_ms.get()
    }

    pub fn waiters_poll_ms(&self) -> u64 {
        self.pg.config.postgres_waiters_poll_ms
    }

    /// Begins a transaction deciding `keys`: with `write`, locks them (retrying a lost
    /// deadlock), reads the time and raises this lane's mark, and draws the first token
    /// block; reads their rows (locked when writing).
    pub fn begin(&mut self, keys: &[&Scope], local_now_ms: u64, write: bool) -> Result<Txn<'_>, StoreError> {
        let mut hashes: Vec<i64> = keys.iter().map(|s| route::scope_hash(s) as i64).collect();
        hashes.sort_unstable();
        hashes.dedup();
        let scopes = ScopeColumns::of(keys);
        if self.client().is_closed() {
            self.reconnect()?;
        }
        let database_clock = self.pg.config.postgres_clock == PgClock::Database;
        let cap_at = |monotonic_ms: u64| {
            self.last_now.map_or(u64::MAX, |(store_ms, last_ms)| {
                let elapsed = monotonic_ms.saturating_sub(last_ms);
                store_ms.saturating_add(elapsed + elapsed * CLOCK_SLEW_PER_MILLE / 1000)
            })
        };
        let clock = Clock {
            database: database_clock,
            local_ms: local_now_ms,
            cap_ms: cap_at(self.pg.clock.monotonic_ms()),
        };
        let mut attempt = 0;
        let (times, tokens, rows) = loop {
            attempt += 1;
            let result = self.pg.run_bounded(self.start(&hashes, &scopes, clock, write))?;
            match result {
                Ok(started) => break started,
                Err(Retry::Again(error)) if attempt < LOCK_ATTEMPTS_MAX => {
                    tracing::debug!(%error, attempt, "lock lost a deadlock or serialization check; trying again");
                }
                Err(Retry::Again(error)) => return Err(StoreError::Postgres(error)),
                Err(Retry::Fail(error)) => return Err(error),
            }
        };
        // The time the locks took is time the node saw pass too: the database's clock
        // held to the cap reckoned now, not to the one sent before the wait, which would
        // date the batch's decisions (and shorten its leases) by the wait.
        let back_ms = self.pg.clock.monotonic_ms();
        let now_ms = if database_clock {
            times.marked_ms.max(times.raw_ms.min(cap_at(back_ms)))
        } else {
            times.marked_ms
        };
        self.last_now = Some((now_ms, back_ms));
        Ok(Txn {
            store: self,
            now_ms,
            write,
            raise_mark: (write && now_ms > times.marked_ms).then_some(now_ms),
            locked: hashes,
            rows: RefCell::new(rows),
            changes: RefCell::new(HashMap::new()),
            tokens: Cell::new(tokens),
            open: Cell::new(write),
        })
    }

    /// One attempt at [`Store::begin`]'s statements, sent together (pipelined): the
    /// server runs them in order, so the rows and then the clock are read after the
    /// locks are held, and the batch pays one round trip for all of them.
    async fn start(
        &self,
        hashes: &[i64],
        scopes: &ScopeColumns,
        clock: Clock,
        write: bool,
    ) -> Result<(Times, (u64, u64), HashMap<Scope, Option<Record>>), Retry> {
        let (client, s) = (self.client(), self.statements());
        let fail = |e: tokio_postgres::Error| {
            if retryable(&e) { Retry::Again(e) } else { Retry::Fail(StoreError::Postgres(e)) }
        };
        let (local, cap) = (to_sql(clock.local_ms), to_sql(clock.cap_ms));
        let keys: [&(dyn ToSql + Sync); 1] = [&hashes];
        let rows: [&(dyn ToSql + Sync); 3] = [&scopes.tenant, &scopes.namespace, &scopes.key];
        let clock_write: [&(dyn ToSql + Sync); 4] = [&self.lane, &clock.database, &local, &cap];
        let clock_read: [&(dyn ToSql + Sync); 3] = [&clock.database, &local, &cap];
        let started = if write {
            // The clock (and the first token block) after the rows: a reclaim elsewhere
            // that held one of them has committed by then, and its time is in the marks.
            tokio::try_join!(
                client.execute(&s.begin, &[]),
                client.execute(&s.lock, &keys),
                client.query(&s.select_write, &rows),
                client.query_one(&s.clock_write, &clock_write),
            )
            .map(|(_, _, rows, clock)| (clock, rows))
        } else {
            // Reads need no transaction: no lock, nothing to roll back. The time after the
            // rows, so that it is not below the time of any decision they show.
            tokio::try_join!(
                client.query(&s.select_read, &rows),
                client.query_one(&s.clock_read, &clock_read)
            )
            .map(|(rows, clock)| (clock, rows))
        };
        let (clock, found) = match started {
            Ok(started) => started,
            Err(error) => {
                if write {
                    let _ = client.execute(&s.rollback, &[]).await;
                }
                return Err(fail(error));
            }
        };
        let times = Times { marked_ms: from_sql(clock.get(0)), raw_ms: from_sql(clock.get(1)) };
        let tokens = if write {
            let first = from_sql(clock.get(2));
            (first, first + TOKEN_BLOCK)
        } else {
            (0, 0)
        };
        let mut rows = HashMap::with_capacity(hashes.len());
        for row in &found {
            match read_row(row) {
                Ok((scope, record)) => rows.insert(scope, Some(record)),
                Err(error) => {
                    if write {
                        let _ = client.execute(&s.rollback, &[]).await;
                    }
                    return Err(Retry::Fail(error));
                }
            };
        }
        Ok((times, tokens, rows))
    }
}

/// Every statement a shard runs, prepared once per connection.
struct Statements {
    begin: Statement,
    commit: Statement,
    rollback: Statement,
    lock: Statement,
    clock_write: Statement,
    clock_read: Statement,
    raise_mark: Statement,
    select_write: Statement,
    select_read: Statement,
    upsert: Statement,
    delete: Statement,
    reclaim: Statement,
    nextval: Statement,
}

impl Statements {
    async fn prepare(client: &Object) -> Result<Statements, StoreError> {
        let prepare = |sql: String| async move { client.prepare(&sql).await.map_err(StoreError::Postgres) };
        Ok(Statements {
            // Read committed, whatever the database's default: the time and the rows are
            // read after the locks are held, and must see what the lock's last holder
            // committed (a repeatable-read snapshot taken before the wait would not).
            begin: prepare("BEGIN ISOLATION LEVEL READ COMMITTED".to_owned()).await?,
            commit: prepare("COMMIT".to_owned()).await?,
            rollback: prepare("ROLLBACK".to_owned()).await?,
            lock: prepare("SELECT pg_advisory_xact_lock(h) FROM unnest($1::bigint[]) AS h".to_owned())
                .await?,
            clock_write: prepare(CLOCK_WRITE.to_owned()).await?,
            clock_read: prepare(CLOCK_READ.to_owned()).await?,
            raise_mark: prepare(RAISE_MARK.to_owned()).await?,
            select_write: prepare(format!("{SELECT_ROWS} FOR UPDATE OF oncegate_records")).await?,
            select_read: prepare(SELECT_ROWS.to_owned()).await?,
            upsert: prepare(UPSERT.to_owned()).await?,
            delete: prepare(DELETE.to_owned()).await?,
            reclaim: prepare(RECLAIM.to_owned()).await?,
            nextval: prepare("SELECT nextval('oncegate_tokens')".to_owned()).await?,
        })
    }
}

/// The batch's scopes as three columns, each scope once, for the row lookup.
#[derive(Default)]
struct ScopeColumns {
    tenant: Vec<String>,
    namespace: Vec<String>,
    key: Vec<String>,
}

impl ScopeColumns {
    fn of(scopes: &[&Scope]) -> ScopeColumns {
        let mut unique: Vec<&Scope> = scopes.to_vec();
        unique.sort_unstable();
        unique.dedup();
        let mut columns = ScopeColumns::default();
        for scope in unique {
            columns.tenant.push(scope.tenant.as_str().to_owned());
            columns.namespace.push(scope.namespace.as_str().to_owned());
            columns.key.push(scope.key.as_str().to_owned());
        }
        columns
    }
}

/// What a transaction's clock statement is given: whose clock, the shard's own reading,
/// and the most the database's may say.
#[derive(Clone, Copy)]
struct Clock {
    database: bool,
    local_ms: u64,
    cap_ms: u64,
}

/// What a transaction's clock statement read: the time it decided at (and, writing,
/// marked), and the database's clock as it was.
struct Times {
    marked_ms: u64,
    raw_ms: u64,
}

/// An attempt that lost a lock to a deadlock may run again; anything else fails.
enum Retry {
    Again(tokio_postgres::Error),
    Fail(StoreError),
}

/// The `synchronous_commit` a session sets for itself, given the one it `inherited` (the
/// database's, its role's or the connection string's). Under `full` an answer leaves once
/// `COMMIT` returned, which must mean the commit is flushed on the primary: every setting
/// but `off` gives that (the standbys' part stays the operator's, and a stronger setting
/// is kept), so `off` is raised to `on`, and any other is set as the session's own, so that
/// a reload of the server's configuration to `off` later cannot reach an open session.
/// Under `normal` the inherited setting stands: the operator chose to trade a crash's last
/// commits for speed.
fn session_synchronous_commit(durability: Durability, inherited: &str) -> Option<&str> {
    match durability {
        Durability::Full if inherited == "off" => Some("on"),
        Durability::Full => Some(inherited),
        Durability::Normal => None,
    }
}

/// Logs what the database's settings make of an acknowledgement, read from the session
/// (after [`session_synchronous_commit`]; `inherited` is the setting before it): lost
/// at a crash when commits are not flushed, and lost at a fail-over when standbys stream
/// asynchronously (a promoted one lacks the last commits: their keys would be granted
/// again).
async fn report_durability(client: &Object, shown: &str, inherited: &str) -> Result<(), StoreError> {
    let row = client
        .query_one(
            "SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names'), \
             (SELECT count(*) FROM pg_stat_replication)",
            &[],
        )
        .await
        .map_err(StoreError::Postgres)?;
    let (sync, standby_names, standbys): (String, String, i64) = (row.get(0), row.get(1), row.get(2));
    if sync != inherited {
        tracing::info!(database = %shown, inherited_synchronous_commit = %inherited, synchronous_commit = %sync, "the session would not have flushed its commits; oncegate's sessions do (durability = \"full\")");
    }
    if sync == "off" {
        tracing::warn!(database = %shown, synchronous_commit = %sync, "acknowledged decisions may be lost if the database crashes or fails over (durability = \"normal\" leaves the database's synchronous_commit as it is)");
    } else if standbys > 0 && (standby_names.is_empty() || sync == "local") {
        tracing::warn!(
            database = %shown,
            standbys,
            synchronous_commit = %sync,
            "standbys replicate asynchronously: a fail-over to one may lose acknowledged decisions; name them in synchronous_standby_names (and set synchronous_commit = on or remote_apply)"
        );
    } else {
        tracing::info!(database = %shown, synchronous_commit = %sync, synchronous_standby_names = %standby_names, standbys, "the database's durability");
    }
    Ok(())
}

/// Refuses a `postgres_schema` the connection cannot use: `current_schema()` skips a
/// schema in the `search_path` that does not exist.
async fn check_schema_named(client: &Object, schema: &str) -> Result<(), StoreError> {
    let current: Option<String> =
        client.query_one("SELECT current_schema()", &[]).await.map_err(StoreError::Postgres)?.get(0);
    if current.as_deref() == Some(schema) {
        return Ok(());
    }
    Err(StoreError::PostgresRefused(format!(
        "postgres_schema {schema:?} does not exist in the database; create it (CREATE SCHEMA) or name one that does"
    )))
}

/// Refuses to create oncegate's tables in `schema` while another schema of the database
/// holds them: a node whose `postgres_schema` (or, before it existed, whose role's
/// `search_path`) named another schema would start on empty tables and grant every key
/// again.
async fn refuse_tables_elsewhere(client: &Object, schema: &str) -> Result<(), StoreError> {
    let elsewhere: String = client
        .query_one(
            "SELECT coalesce(string_agg(schemaname, ', ' ORDER BY schemaname), '') FROM pg_tables \
             WHERE tablename = 'oncegate_schema' AND schemaname <> current_schema()",
            &[],
        )
        .await
        .map_err(StoreError::Postgres)?
        .get(0);
    if elsewhere.is_empty() {
        return Ok(());
    }
    Err(StoreError::PostgresRefused(format!(
        "oncegate's tables are in schema {elsewhere}, not in postgres_schema {schema:?}: name that schema in \
         postgres_schema (tables made here would be empty, and every key granted again)"
    )))
}

/// Creates the schema, or checks that it is one this binary reads, under a lock so that
/// nodes starting together do it once.
async fn migrate(client: &Object, schema: &str) -> Result<(), StoreError> {
    let version: Option<i64> = current_version(client).await?;
    if version == Some(SCHEMA_VERSION) {
        return Ok(());
    }
    client.batch_execute("BEGIN").await.map_err(StoreError::Postgres)?;
    let done = async {
        client.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK]).await.map_err(StoreError::Postgres)?;
        match current_version(client).await? {
            None => {
                refuse_tables_elsewhere(client, schema).await?;
                client.batch_execute(SCHEMA_1).await.map_err(StoreError::Postgres)?;
                client
                    .batch_execute(
                        "CREATE TABLE oncegate_schema (id integer PRIMARY KEY CHECK (id = 0), version bigint NOT NULL, \
                         derived_keys text NOT NULL);",
                    )
                    .await
                    .map_err(StoreError::Postgres)?;
                client
                    .execute(
                        "INSERT INTO oncegate_schema (id, version, derived_keys) VALUES (0, $1, $2)",
                        &[&SCHEMA_VERSION, &DERIVED_BUCKET_BASE],
                    )
                    .await
                    .map_err(StoreError::Postgres)?;
                tracing::info!(version = SCHEMA_VERSION, "created the oncegate schema");
                Ok(())
            }
            Some(1) => {
                // Made before derived keys routed by their base: they keep their format.
                client
                    .batch_execute(&format!(
                        "ALTER TABLE oncegate_schema ADD COLUMN derived_keys text NOT NULL DEFAULT '{DERIVED_WHOLE_KEY}'; \
                         UPDATE oncegate_schema SET version = {SCHEMA_VERSION} WHERE id = 0;"
                    ))
                    .await
                    .map_err(StoreError::Postgres)?;
                tracing::info!(from = 1, to = SCHEMA_VERSION, "upgraded the oncegate schema");
                Ok(())
            }
            Some(SCHEMA_VERSION) => Ok(()),
            Some(found) => Err(StoreError::Schema { found, supported: SCHEMA_VERSION }),
        }
    }
    .await;
    let end = if done.is_ok() { "COMMIT" } else { "ROLLBACK" };
    client.batch_execute(end).await.map_err(StoreError::Postgres)?;
    done
}

async fn current_version(client: &Object) -> Result<Option<i64>, StoreError> {
    // A catalog read through SQL takes the statement's snapshot; `to_regclass` would read
    // a cache that may not yet show a table another node created while we waited.
    let exists: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = current_schema() AND tablename = 'oncegate_schema')",
            &[],
        )
        .await
        .map_err(StoreError::Postgres)?
        .get(0);
    if !exists {
        return Ok(None);
    }
    let row = client
        .query_opt("SELECT version FROM oncegate_schema WHERE id = 0", &[])
        .await
        .map_err(StoreError::Postgres)?;
    let version = row.map(|r| r.get::<_, i64>(0));
    match version {
        Some(v) if v > SCHEMA_VERSION => Err(StoreError::Schema { found: v, supported: SCHEMA_VERSION }),
        other => Ok(other),
    }
}

/// Refuses a token sequence that would not keep a key's tokens increasing: a step other
/// than [`TOKEN_BLOCK`] (blocks would overlap), values cached per session (handed out
/// out of order across sessions), or cycling.
async fn check_sequence(client: &Object) -> Result<(), StoreError> {
    let row = client
        .query_opt(
            "SELECT increment_by, cache_size, cycle FROM pg_sequences \
             WHERE schemaname = current_schema() AND sequencename = 'oncegate_tokens'",
            &[],
        )
        .await
        .map_err(StoreError::Postgres)?
        .ok_or_else(|| StoreError::Corrupt("the token sequence oncegate_tokens is missing".to_owned()))?;
    let (increment, cache, cycle): (i64, i64, bool) = (row.get(0), row.get(1), row.get(2));
    if increment != TOKEN_BLOCK as i64 || cache != 1 || cycle {
        return Err(StoreError::Corrupt(format!(
            "the token sequence oncegate_tokens has INCREMENT BY {increment} CACHE {cache}{}; oncegate needs \
             INCREMENT BY {TOKEN_BLOCK} CACHE 1 NO CYCLE, or fencing tokens could go back",
            if cycle { " CYCLE" } else { "" }
        )));
    }
    Ok(())
}

/// The records of `owned` slots by state and tenant, in a transaction whose statement
/// timeout is `limit_ms` instead of the connection's; and, from the same pass, the check
/// that the token sequence is past every token they hold ([`sequence_past`]).
async fn count(client: &mut Object, owned: &[i32], limit_ms: u64) -> Result<Tally, StoreError> {
    let tx = client.transaction().await.map_err(StoreError::Postgres)?;
    tx.query_one("SELECT set_config('statement_timeout', $1, true)", &[&limit_ms.to_string()])
        .await
        .map_err(StoreError::Postgres)?;
    let rows = tx
        .query(
            "SELECT tenant, outcome IS NULL, count(*), max(token) FROM oncegate_records WHERE slot = ANY($1) \
             GROUP BY 1, 2",
            &[&owned],
        )
        .await
        .map_err(StoreError::Postgres)?;
    let sequence = tx
        .query_one("SELECT last_value, is_called FROM oncegate_tokens", &[])
        .await
        .map_err(StoreError::Postgres)?;
    tx.commit().await.map_err(StoreError::Postgres)?;
    let stored_max = rows.iter().map(|row| from_sql(row.get::<_, i64>(3))).max().unwrap_or(0);
    sequence_past(stored_max, sequence.get(0), sequence.get(1))?;
    let mut tally = Tally::default();
    for row in rows {
        let tenant = stored_tenant(row.get(0))?;
        let (pending, rows): (bool, i64) = (row.get(1), row.get(2));
        if pending {
            tally.pending += rows;
        } else {
            tally.completed += rows;
        }
        tally.add_tenant(&tenant, rows);
    }
    Ok(tally)
}

/// Refuses a sequence (at `last_value`, drawn from yet when `is_called`) whose next block
/// would not start above `stored_max`, the greatest stored token: a copy of the database
/// that did not carry the sequence (logical replication) would hand a stale holder's
/// token out again.
fn sequence_past(stored_max: u64, last_value: i64, is_called: bool) -> Result<(), StoreError> {
    let next = if is_called { from_sql(last_value) + TOKEN_BLOCK } else { from_sql(last_value) };
    if stored_max < next {
        return Ok(());
    }
    Err(StoreError::Corrupt(format!(
        "the token sequence is behind the stored tokens: oncegate_tokens would give {next} next, and a record \
         holds token {stored_max} (a copy of the database without its sequence?); set it past every token ever \
         issued, at least SELECT setval('oncegate_tokens', {stored_max})"
    )))
}

fn read_row(row: &Row) -> Result<(Scope, Record), StoreError> {
    let scope = stored_scope(row.get(0), row.get(1), row.get(2))?;
    let outcome: Option<i16> = row.get(9);
    let completion = match outcome {
        None => None,
        Some(n) => Some(Completion {
            outcome: u8::try_from(n)
                .ok()
                .and_then(Outcome::from_u8)
                .ok_or_else(|| StoreError::Corrupt(format!("outcome {n} is unknown")))?,
            response: row.get::<_, Option<Vec<u8>>>(10).unwrap_or_default(),
            completed_at_ms: from_sql(row.get::<_, Option<i64>>(11).unwrap_or(0)),
        }),
    };
    let record = Record {
        token: from_sql(row.get(3)),
        attempt: u32::try_from(row.get::<_, i32>(4)).unwrap_or(0),
        lease_until_ms: from_sql(row.get(5)),
        expires_at_ms: from_sql(row.get(6)),
        ttl_ms: from_sql(row.get(7)),
        fingerprint: Fingerprint::from_stored(row.get(8)),
        completion,
        history: decode_history(row.get::<_, &[u8]>(12)),
    };
    Ok((scope, record))
}

/// A batch's transaction on the shared table. Reads come from the rows fetched (and
/// locked) at begin; writes are kept and sent at commit. Dropped without a commit, it
/// rolls back.
pub(crate) struct Txn<'s> {
    store: &'s Store,
    now_ms: u64,
    write: bool,
    /// A time above the mark the clock statement wrote, to raise the lane's mark to
    /// at commit.
    raise_mark: Option<u64>,
    /// The hashes locked at begin.
    locked: Vec<i64>,
    /// Each locked key's record as this transaction sees it (`None`: no record).
    rows: RefCell<HashMap<Scope, Option<Record>>>,
    /// Each key this transaction changed, and its record after (`None`: deleted).
    changes: RefCell<HashMap<Scope, Option<Record>>>,
    /// The current token block: the next token to hand out and the end of the block.
    tokens: Cell<(u64, u64)>,
    /// Whether the transaction is still open (a rollback is due on drop).
    open: Cell<bool>,
}

impl Drop for Txn<'_> {
    fn drop(&mut self) {
        if self.open.get() {
            let (client, rollback) = (self.store.client(), &self.store.statements().rollback);
            let _ = self
                .store
                .pg
                .run(async { client.execute(rollback, &[]).await.map_err(StoreError::Postgres) });
        }
    }
}

impl Txn<'_> {
    pub fn now(&self) -> u64 {
        self.now_ms
    }

    fn failpoint(&self) -> Result<(), StoreError> {
        if self.store.faults.op_should_fail() {
            return Err(StoreError::Injected("store operation"));
        }
        Ok(())
    }

    /// The next token: from the current block, or from a new block drawn now (the keys
    /// are locked, so it is above every token their earlier holders got).
    pub fn next_token(&self, counter: u64) -> Result<u64, StoreError> {
        let (next, end) = self.tokens.get();
        let candidate = counter.max(next);
        if candidate < end {
            self.tokens.set((candidate, end));
            return Ok(candidate);
        }
        let (client, nextval) = (self.store.client(), &self.store.statements().nextval);
        let first: i64 = self
            .store
            .pg
            .run(async { Ok(client.query_one(nextval, &[]).await.map_err(StoreError::Postgres)?.get(0)) })?;
        let first = from_sql(first);
        self.tokens.set((first, first + TOKEN_BLOCK));
        Ok(first)
    }

    pub fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        self.failpoint()?;
        if let Some(changed) = self.changes.borrow().get(scope) {
            return Ok(changed.clone());
        }
        if let Some(row) = self.rows.borrow().get(scope) {
            return Ok(row.clone());
        }
        if self.locked.binary_search(&(route::scope_hash(scope) as i64)).is_ok() || !self.write {
            // Locked (or read) at begin and not found: the key has no record.
            return Ok(None);
        }
        Err(StoreError::PostgresRefused("a key was decided without being locked first (a bug)".to_owned()))
    }

    pub fn put(&self, scope: &Scope, record: &Record) -> Result<u64, StoreError> {
        self.failpoint()?;
        self.changes.borrow_mut().insert(scope.clone(), Some(record.clone()));
        Ok(record.reclaim_at_ms())
    }

    pub fn delete(&self, scope: &Scope) -> Result<(), StoreError> {
        self.failpoint()?;
        self.changes.borrow_mut().insert(scope.clone(), None);
        Ok(())
    }

    /// Deletes up to `limit` reclaimable records of this shard's slots that no other
    /// transaction holds and this one did not lock.
    pub fn reclaim(&self, now_ms: u64, limit: usize) -> Result<Tally, StoreError> {
        self.failpoint()?;
        let client = self.store.client();
        let limit_rows = limit as i64;
        let rows = self.store.pg.run(async {
            client
                .query(
                    &self.store.statements().reclaim,
                    &[&to_sql(now_ms), &self.store.owned, &self.locked, &limit_rows],
                )
                .await
                .map_err(StoreError::Postgres)
        })?;
        let mut removed = Tally::default();
        for row in &rows {
            removed.add_stored(&stored_tenant(row.get(0))?, row.get(1));
        }
        // Other nodes' records come due without this shard hearing of them: it looks
        // again after a reclaim window, or at once while a backlog remains.
        let next = if rows.len() >= limit { now_ms } else { now_ms + self.store.reclaim_every_ms };
        self.store.next_reclaim_ms.set(Some(next));
        Ok(removed)
    }

    pub fn finish_read(self) {
        drop(self);
    }

    /// Sends the buffered writes and commits; returns once PostgreSQL reports the commit
    /// (durable as its `synchronous_commit` says).
    pub fn commit(self, _meta: Meta) -> Result<(), StoreError> {
        self.failpoint()?;
        if self.store.faults.commit_should_fail() {
            return Err(StoreError::Injected("commit"));
        }
        let changes = std::mem::take(&mut *self.changes.borrow_mut());
        let mark = self.raise_mark.map(|ms| (self.store.lane.as_str(), to_sql(ms)));
        let result =
            self.store.pg.run(write_changes(self.store.client(), self.store.statements(), changes, mark));
        self.open.set(result.is_err());
        result
    }
}

/// The columns of the upsert, one array per column.
#[derive(Default)]
struct Upserts {
    tenant: Vec<String>,
    namespace: Vec<String>,
    key: Vec<String>,
    hash: Vec<i64>,
    slot: Vec<i32>,
    token: Vec<i64>,
    attempt: Vec<i32>,
    lease_until_ms: Vec<i64>,
    expires_at_ms: Vec<i64>,
    ttl_ms: Vec<i64>,
    reclaim_at_ms: Vec<i64>,
    fingerprint: Vec<Vec<u8>>,
    outcome: Vec<Option<i16>>,
    response: Vec<Option<Vec<u8>>>,
    completed_at_ms: Vec<Option<i64>>,
    history: Vec<Vec<u8>>,
}

impl Upserts {
    fn push(&mut self, scope: Scope, record: Record) {
        // The hash names the row's lock (the whole key's, on every node); the slot is the
        // routing's, which spreads reclaim over the shards.
        self.hash.push(route::scope_hash(&scope) as i64);
        self.slot.push(ROUTING.slot_of(&scope) as i32);
        self.reclaim_at_ms.push(to_sql(record.reclaim_at_ms()));
        self.tenant.push(scope.tenant.as_str().to_owned());
        self.namespace.push(scope.namespace.as_str().to_owned());
        self.key.push(scope.key.as_str().to_owned());
        self.token.push(to_sql(record.token));
        self.attempt.push(i32::try_from(record.attempt).unwrap_or(i32::MAX));
        self.lease_until_ms.push(to_sql(record.lease_until_ms));
        self.expires_at_ms.push(to_sql(record.expires_at_ms));
        self.ttl_ms.push(to_sql(record.ttl_ms));
        self.history.push(encode_history(&record.history));
        self.fingerprint.push(record.fingerprint.as_bytes().to_vec());
        let completion = record.completion;
        self.outcome.push(completion.as_ref().map(|c| i16::from(c.outcome.as_u8())));
        self.completed_at_ms.push(completion.as_ref().map(|c| to_sql(c.completed_at_ms)));
        self.response.push(completion.map(|c| c.response));
    }

    fn params(&self) -> [&(dyn ToSql + Sync); 16] {
        [
            &self.tenant,
            &self.namespace,
            &self.key,
            &self.hash,
            &self.slot,
            &self.token,
            &self.attempt,
            &self.lease_until_ms,
            &self.expires_at_ms,
            &self.ttl_ms,
            &self.reclaim_at_ms,
            &self.fingerprint,
            &self.outcome,
            &self.response,
            &self.completed_at_ms,
            &self.history,
        ]
    }
}

/// One delete for every deleted record, one upsert for every changed one, and the
/// commit, sent together (pipelined). A statement that fails aborts the transaction,
/// whose `COMMIT` then only rolls it back; its error is what this returns.
async fn write_changes(
    client: &Object,
    statements: &Statements,
    changes: HashMap<Scope, Option<Record>>,
    mark: Option<(&str, i64)>,
) -> Result<(), StoreError> {
    let mut upserts = Upserts::default();
    let mut deletes: [Vec<String>; 3] = Default::default();
    for (scope, record) in changes {
        match record {
            Some(record) => upserts.push(scope, record),
            None => {
                deletes[0].push(scope.tenant.as_str().to_owned());
                deletes[1].push(scope.namespace.as_str().to_owned());
                deletes[2].push(scope.key.as_str().to_owned());
            }
        }
    }
    let delete = async {
        if deletes[0].is_empty() {
            return Ok(0);
        }
        client.execute(&statements.delete, &[&deletes[0], &deletes[1], &deletes[2]]).await
    };
    let upsert = async {
        if upserts.tenant.is_empty() {
            return Ok(0);
        }
        client.execute(&statements.upsert, &upserts.params()).await
    };
    let raise = async {
        let Some((lane, ms)) = mark else { return Ok(0) };
        client.execute(&statements.raise_mark, &[&lane, &ms]).await
    };
    tokio::try_join!(raise, delete, upsert, client.execute(&statements.commit, &[]))
        .map_err(StoreError::Postgres)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under `durability = "full"` `off` is raised to `on`, and every other setting, which
    /// already flushes on the primary, is kept as the session's own (a reload to `off`
    /// cannot reach it then). Under `normal` the inherited setting stands.
    #[test]
    fn a_session_raises_synchronous_commit_from_off_and_pins_it_under_full_durability() {
        let cases = [
            (Durability::Full, "off", Some("on")),
            (Durability::Full, "local", Some("local")),
            (Durability::Full, "remote_write", Some("remote_write")),
            (Durability::Full, "on", Some("on")),
            (Durability::Full, "remote_apply", Some("remote_apply")),
            (Durability::Normal, "off", None),
            (Durability::Normal, "on", None),
        ];
        for (durability, database, raised) in cases {
            assert_eq!(
                session_synchronous_commit(durability, database),
                raised,
                "{durability:?}, {database}"
            );
        }
    }
}
