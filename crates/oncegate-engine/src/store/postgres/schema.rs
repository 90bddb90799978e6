//! The shared table's schema and statements, its migrations and the checks a node runs
//! on a connection before it serves, and the reading of a row.

use deadpool_postgres::Object;
use oncegate_core::route::Routing;
use oncegate_core::{Completion, Fingerprint, Outcome, Record, Scope};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Row, Statement};

use super::{StoreError, decode_history, stored_scope, stored_tenant};
use crate::config::Durability;
use crate::quota::Tally;

/// How every node routes keys to its shards. Rows are found by key, so routing only
/// spreads the work; derived keys go by their base, so a reserve decides both buckets of
/// a bucket grace in one batch (every node the same, since the slot column follows it).
pub(crate) const ROUTING: Routing = Routing::BucketBase;

/// `oncegate_schema.derived_keys` of a database whose derived keys end `::bucket`.
pub(super) const DERIVED_BUCKET_BASE: &str = "bucket-base";
/// `oncegate_schema.derived_keys` of a database made at schema version 1 (`:bucket`).
pub(super) const DERIVED_WHOLE_KEY: &str = "whole-key";

/// The derived keys' format a database records.
pub(super) async fn derived_format(client: &Object) -> Result<Routing, StoreError> {
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
pub(super) const SCHEMA_LOCK: i64 = 0x6f6e_6365_6761_7465;

/// How much faster than the node's own monotonic clock the database's clock may advance
/// between two of the node's transactions, in thousandths: a forward step of the
/// database server's clock (an NTP step, a fail-over to a host whose clock runs ahead)
/// is absorbed at this rate instead of ageing every lease at once, the way a shard file's
/// frame never lets a wall-clock step reach a decision. 1% covers any clock discipline's
/// slewing. A shard's reopen keeps its pace (see `Postgres::paces`); only the first
/// transaction of a lane in a process takes the database's time as it is.
pub(super) const CLOCK_SLEW_PER_MILLE: u64 = 10;

/// Lock attempts of one transaction before a deadlock or serialization failure is given
/// up as a storage failure.
pub(super) const LOCK_ATTEMPTS_MAX: u32 = 16;

/// Version 1: the records, the per-lane clock marks, the token sequence.
pub(super) const SCHEMA_1: &str = "
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
pub(super) const CLOCK_WRITE: &str = "
WITH d AS (SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS raw),
t AS (
    SELECT greatest(CASE WHEN $2 THEN least(d.raw, $4) ELSE $3 END,
        (SELECT coalesce(max(high_water_ms), 0) FROM oncegate_clock)) AS ms
    FROM d)
INSERT INTO oncegate_clock (lane, high_water_ms) SELECT $1, ms FROM t
ON CONFLICT (lane) DO UPDATE SET high_water_ms = greatest(oncegate_clock.high_water_ms, excluded.high_water_ms)
RETURNING high_water_ms, (SELECT raw FROM d), nextval('oncegate_tokens')";
pub(super) const CLOCK_READ: &str = "
WITH d AS (SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS raw)
SELECT greatest(CASE WHEN $1 THEN least(d.raw, $3) ELSE $2 END,
    (SELECT coalesce(max(high_water_ms), 0) FROM oncegate_clock)), d.raw
FROM d";

/// Raises a lane's mark to a transaction's time when that time came out above the mark
/// its clock statement wrote (see [`CLOCK_WRITE`]); sent with the commit.
pub(super) const RAISE_MARK: &str =
    "UPDATE oncegate_clock SET high_water_ms = greatest(high_water_ms, $2) WHERE lane = $1";

/// The rows of the batch's keys, by the primary key (the only index a write must keep
/// besides the reclaim deadline's).
pub(super) const SELECT_ROWS: &str = "
SELECT tenant, namespace, key, token, attempt, lease_until_ms, expires_at_ms, ttl_ms,
    fingerprint, outcome, response, completed_at_ms, history
FROM oncegate_records WHERE (tenant, namespace, key) IN
    (SELECT * FROM unnest($1::text[], $2::text[], $3::text[]))";

pub(super) const UPSERT: &str = "
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
pub(super) const DELETE: &str = "
DELETE FROM oncegate_records WHERE (tenant, namespace, key) IN
    (SELECT * FROM unnest($1::text[], $2::text[], $3::text[]))";
/// Rows another transaction holds are skipped, and so are the keys this one locked (it may
/// have decided them already).
pub(super) const RECLAIM: &str = "
DELETE FROM oncegate_records WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM oncegate_records
    WHERE reclaim_at_ms <= $1 AND slot = ANY($2) AND NOT (hash = ANY($3))
    ORDER BY reclaim_at_ms LIMIT $4 FOR UPDATE SKIP LOCKED))
RETURNING tenant, outcome IS NULL";

/// Every statement a shard runs, prepared once per connection.
pub(super) struct Statements {
    pub(super) begin: Statement,
    pub(super) commit: Statement,
    pub(super) rollback: Statement,
    pub(super) lock: Statement,
    pub(super) clock_write: Statement,
    pub(super) clock_read: Statement,
    pub(super) raise_mark: Statement,
    pub(super) select_write: Statement,
    pub(super) select_read: Statement,
    pub(super) upsert: Statement,
    pub(super) delete: Statement,
    pub(super) reclaim: Statement,
    pub(super) nextval: Statement,
}

impl Statements {
    pub(super) async fn prepare(client: &Object) -> Result<Statements, StoreError> {
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
pub(super) struct ScopeColumns {
    pub(super) tenant: Vec<String>,
    pub(super) namespace: Vec<String>,
    pub(super) key: Vec<String>,
}

impl ScopeColumns {
    pub(super) fn of(scopes: &[&Scope]) -> ScopeColumns {
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

pub(super) use crate::store::{from_sql, to_sql};

/// The `synchronous_commit` a session sets for itself, given the one it `inherited` (the
/// database's, its role's or the connection string's). Under `full` an answer leaves once
/// `COMMIT` returned, which must mean the commit is flushed on the primary: every setting
/// but `off` gives that (the standbys' part stays the operator's, and a stronger setting
/// is kept), so `off` is raised to `on`, and any other is set as the session's own, so that
/// a reload of the server's configuration to `off` later cannot reach an open session.
/// Under `normal` the inherited setting stands: the operator chose to trade a crash's last
/// commits for speed.
pub(super) fn session_synchronous_commit(durability: Durability, inherited: &str) -> Option<&str> {
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
pub(super) async fn report_durability(
    client: &Object,
    shown: &str,
    inherited: &str,
) -> Result<(), StoreError> {
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
pub(super) async fn check_schema_named(client: &Object, schema: &str) -> Result<(), StoreError> {
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
pub(super) async fn refuse_tables_elsewhere(client: &Object, schema: &str) -> Result<(), StoreError> {
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
pub(super) async fn migrate(client: &Object, schema: &str) -> Result<(), StoreError> {
    let version: Option<i64> = current_version(client).await?;
    if version == Some(SCHEMA_VERSION) {
        return Ok(());
    }
    under_schema_lock(client, async {
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
    })
    .await
}

/// Runs `work` in a transaction holding the schema's advisory lock: committed when it
/// succeeds, rolled back when it fails.
async fn under_schema_lock<T>(
    client: &Object,
    work: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    client.batch_execute("BEGIN").await.map_err(StoreError::Postgres)?;
    let done = async {
        client
            .execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK])
            .await
            .map_err(StoreError::Postgres)?;
        work.await
    }
    .await;
    let end = if done.is_ok() { "COMMIT" } else { "ROLLBACK" };
    client.batch_execute(end).await.map_err(StoreError::Postgres)?;
    done
}

pub(super) async fn current_version(client: &Object) -> Result<Option<i64>, StoreError> {
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
pub(super) async fn check_sequence(client: &Object) -> Result<(), StoreError> {
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

/// How far below the clock floor the token sequence must be before a connection raises
/// it: 1,024 blocks, so that draws made by other nodes between the raise's read of
/// the sequence and its `setval` cannot reach the floor (which `setval` would then hand
/// out again). A sequence that close to the floor is as good as raised.
const RAISE_MARGIN: i64 = 1 << 20;

/// Raises the token sequence to `floor`, the first token of the node clock's epoch floor
/// (`placement/token.rs`), under the schema lock so that two nodes raising at once
/// cannot set it back. A database restored from a backup brings back an older
/// sequence; raised at every connection to a floor that advances 4,194,304 tokens a
/// millisecond, far faster than any node draws, its next token is above every token any
/// node issued before the restore (on clocks not ahead of this node's).
pub(super) async fn raise_sequence(client: &Object, floor: u64) -> Result<(), StoreError> {
    let floor =
        i64::try_from(floor).map_err(|_| StoreError::Corrupt(format!("token floor {floor} is past i64")))?;
    let raise = async {
        client
            .execute(
                "SELECT setval('oncegate_tokens', $1, false) FROM oncegate_tokens WHERE last_value < $1 - $2",
                &[&floor, &RAISE_MARGIN],
            )
            .await
            .map_err(StoreError::Postgres)
    };
    let raised = under_schema_lock(client, raise).await;
    match raised {
        Ok(0) => Ok(()),
        Ok(_) => {
            tracing::info!(floor, "raised the token sequence to the clock floor");
            Ok(())
        }
        // `setval` needs UPDATE on the sequence, which `nextval` does not: a role without
        // it serves as before, and a restore then needs the `setval` by hand.
        Err(StoreError::Postgres(error)) if error.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
            tracing::warn!(
                %error,
                floor,
                "cannot raise the token sequence to the clock floor (its role lacks UPDATE on oncegate_tokens): \
                 after restoring the database from a backup, run SELECT setval('oncegate_tokens', N) with N past \
                 every token issued before the restore"
            );
            Ok(())
        }
        Err(error) => Err(error),
    }
}

/// The records of `owned` slots by state and tenant, in a transaction whose statement
/// timeout is `limit_ms` instead of the connection's; and, from the same pass, the check
/// that the token sequence is past every token they hold ([`sequence_past`]).
pub(super) async fn count(client: &mut Object, owned: &[i32], limit_ms: u64) -> Result<Tally, StoreError> {
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
pub(super) fn sequence_past(stored_max: u64, last_value: i64, is_called: bool) -> Result<(), StoreError> {
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

pub(super) fn read_row(row: &Row) -> Result<(Scope, Record), StoreError> {
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
