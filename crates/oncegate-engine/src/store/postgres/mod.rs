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

mod schema;
mod txn;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod};
use oncegate_core::route::{self, Routing};
use oncegate_core::{Record, Scope};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

use super::{Meta, StoreError, decode_history, encode_history_into, stored_scope, stored_tenant};
use crate::config::{Durability, PgClock, PostgresConfig};
use crate::faults::Faults;
use crate::placement::{slots, token};
use crate::quota::Tally;

pub(crate) use schema::ROUTING;
use schema::*;
pub(crate) use txn::Txn;

/// What every shard of an engine on PostgreSQL shares: the runtime its connections run
/// on, the pool, and the node's name in the clock table.
pub(crate) struct Postgres {
    /// `Some` until dropped: shut down in the background, so that an engine dropped
    /// inside an async runtime does not block it.
    runtime: Option<tokio::runtime::Runtime>,
    pool: Pool,
    /// The node's name; each shard's clock mark is the row `{node}/{shard}`.
    node: String,
    config: PostgresConfig,
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
    /// [`CLOCK_SLEW_PER_MILLE`] only), and whose wall time floors the token sequence
    /// at every connection ([`raise_sequence`]).
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
            raise_sequence(&client, token::first_of(token::floor(self.clock.now_ms()))).await?;
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
        config: &PostgresConfig,
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
