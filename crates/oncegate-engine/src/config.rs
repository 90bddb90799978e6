//! The engine's typed configuration, with every default in one place.

use std::path::PathBuf;

use oncegate_core::{Limits, Problem, Problems, Unit};
use serde::{Deserialize, Serialize};

/// How hard a commit waits for the disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Durability {
    /// `synchronous=FULL`: every acknowledged change survives a crash of the process, the
    /// operating system or the power.
    #[default]
    Full,
    /// `synchronous=NORMAL`: survives a crash of the process; the last commits before a
    /// power loss or kernel crash may be lost, and with them grants that were answered.
    Normal,
}

/// Which store keeps the records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// One SQLite file per shard in the data directory (the default).
    #[default]
    Sqlite,
    /// One table in a PostgreSQL database, shared by every node pointed at it.
    Postgres,
}

impl StoreKind {
    /// The name configuration and flags use.
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Sqlite => "sqlite",
            StoreKind::Postgres => "postgres",
        }
    }
}

/// A store kind that is neither `sqlite` nor `postgres`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown store kind {0:?}; sqlite or postgres")]
pub struct UnknownStoreKind(pub String);

impl std::str::FromStr for StoreKind {
    type Err = UnknownStoreKind;

    fn from_str(name: &str) -> Result<StoreKind, UnknownStoreKind> {
        match name {
            "sqlite" => Ok(StoreKind::Sqlite),
            "postgres" => Ok(StoreKind::Postgres),
            other => Err(UnknownStoreKind(other.to_owned())),
        }
    }
}

/// Whose clock the PostgreSQL store decides by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PgClock {
    /// The database server's clock, read in each transaction: every node agrees (the
    /// default, and the only sound choice for several nodes).
    #[default]
    Database,
    /// The engine's injected clock (tests drive time with a manual clock this way).
    Engine,
}

/// A PostgreSQL connection string (URL or `key=value` form). It may hold a password, so
/// `{:?}` and [`PostgresUrl::redacted`] show where the database is and never the secret.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PostgresUrl(String);

impl PostgresUrl {
    /// The connection string itself, for the driver only.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether the driver reads it as a connection string.
    #[cfg(feature = "postgres")]
    fn parses(&self) -> bool {
        self.0.parse::<tokio_postgres::Config>().is_ok()
    }

    /// Without the driver nothing parses.
    #[cfg(not(feature = "postgres"))]
    fn parses(&self) -> bool {
        false
    }

    /// Whether none was given.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Where the database is (hosts, ports, database, user), never the password: for logs
    /// and errors.
    #[cfg(not(feature = "postgres"))]
    pub fn redacted(&self) -> String {
        "(a postgres_url, hidden: this build has no PostgreSQL store)".to_owned()
    }

    /// Where the database is (hosts, ports, database, user), never the password: for logs
    /// and errors.
    #[cfg(feature = "postgres")]
    pub fn redacted(&self) -> String {
        let Ok(config) = self.0.parse::<tokio_postgres::Config>() else {
            return "(a postgres_url that does not parse)".to_owned();
        };
        let hosts: Vec<String> = config
            .get_hosts()
            .iter()
            .map(|host| match host {
                tokio_postgres::config::Host::Tcp(name) => name.clone(),
                tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
            })
            .collect();
        let ports: Vec<String> = config.get_ports().iter().map(u16::to_string).collect();
        format!(
            "host={} port={} dbname={} user={}",
            hosts.join(","),
            ports.join(","),
            config.get_dbname().unwrap_or("(default)"),
            config.get_user().unwrap_or("(default)")
        )
    }
}

impl std::fmt::Debug for PostgresUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl From<String> for PostgresUrl {
    fn from(url: String) -> PostgresUrl {
        PostgresUrl(url)
    }
}

impl From<&str> for PostgresUrl {
    fn from(url: &str) -> PostgresUrl {
        PostgresUrl(url.to_owned())
    }
}

/// Where the records live (`[store]` in the server's file), tagged by `kind`: each kind
/// has its own settings and nothing else.
///
/// In a file it is one flat section: `kind` (SQLite when absent) and the keys of that
/// kind. A key of the other kind is refused, unless it holds its default (files made
/// from the sample of earlier versions list every key).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "StoreSection", into = "StoreSection")]
pub enum StoreConfig {
    /// One SQLite file per shard in the data directory (the default).
    Sqlite(SqliteConfig),
    /// One table in a PostgreSQL database, shared by every node pointed at it.
    Postgres(PostgresConfig),
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig::Sqlite(SqliteConfig::default())
    }
}

/// `[store]` as written: `kind` and every key of either kind, each optional.
#[derive(Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct StoreSection {
    #[serde(skip_serializing_if = "Option::is_none")]
    kind: Option<StoreKind>,
    #[serde(skip_serializing_if = "Option::is_none")]
    shard_file_bytes_max: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    page_cache_bytes_max: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    wal_checkpoint_pages: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    postgres_url: Option<PostgresUrl>,
    #[serde(skip_serializing_if = "Option::is_none")]
    postgres_pool_size: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    postgres_tls_ca_path: Option<std::path::PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    postgres_statement_timeout_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    postgres_count_timeout_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    postgres_waiters_poll_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    postgres_clock: Option<PgClock>,
    #[serde(skip_serializing_if = "Option::is_none")]
    postgres_schema: Option<String>,
}

/// A `[store]` key of the other kind than the section's, with a value of its own.
#[derive(Debug, thiserror::Error)]
#[error("store.{key} applies to kind = \"{applies_to}\", and this store's kind is \"{kind}\"")]
pub struct OtherKindsKey {
    key: &'static str,
    applies_to: &'static str,
    kind: &'static str,
}

impl TryFrom<StoreSection> for StoreConfig {
    type Error = OtherKindsKey;

    fn try_from(section: StoreSection) -> Result<StoreConfig, OtherKindsKey> {
        let kind = section.kind.unwrap_or_default();
        let other = match kind {
            StoreKind::Sqlite => section.first_changed_postgres().map(|key| (key, StoreKind::Postgres)),
            StoreKind::Postgres => section.first_changed_sqlite().map(|key| (key, StoreKind::Sqlite)),
        };
        if let Some((key, applies_to)) = other {
            return Err(OtherKindsKey { key, applies_to: applies_to.name(), kind: kind.name() });
        }
        Ok(match kind {
            StoreKind::Sqlite => StoreConfig::Sqlite(SqliteConfig::from_section(&section)),
            StoreKind::Postgres => StoreConfig::Postgres(PostgresConfig::from_section(section)),
        })
    }
}

/// The name of `key` when `found` holds a value other than `default`.
fn changed<T: PartialEq>(key: &'static str, found: &Option<T>, default: &T) -> Option<&'static str> {
    found.as_ref().is_some_and(|found| found != default).then_some(key)
}

impl StoreSection {
    /// The first of SQLite's keys set to other than its default.
    fn first_changed_sqlite(&self) -> Option<&'static str> {
        let d = SqliteConfig::default();
        changed("shard_file_bytes_max", &self.shard_file_bytes_max, &d.shard_file_bytes_max)
            .or_else(|| changed("page_cache_bytes_max", &self.page_cache_bytes_max, &d.page_cache_bytes_max))
            .or_else(|| changed("wal_checkpoint_pages", &self.wal_checkpoint_pages, &d.wal_checkpoint_pages))
    }

    /// The first of PostgreSQL's keys set to other than its default.
    fn first_changed_postgres(&self) -> Option<&'static str> {
        let d = PostgresConfig::default();
        changed("postgres_url", &self.postgres_url, &d.postgres_url)
            .or_else(|| changed("postgres_pool_size", &self.postgres_pool_size, &d.postgres_pool_size))
            .or_else(|| self.postgres_tls_ca_path.is_some().then_some("postgres_tls_ca_path"))
            .or_else(|| {
                changed(
                    "postgres_statement_timeout_ms",
                    &self.postgres_statement_timeout_ms,
                    &d.postgres_statement_timeout_ms,
                )
            })
            .or_else(|| {
                changed(
                    "postgres_count_timeout_ms",
                    &self.postgres_count_timeout_ms,
                    &d.postgres_count_timeout_ms,
                )
            })
            .or_else(|| {
                changed(
                    "postgres_waiters_poll_ms",
                    &self.postgres_waiters_poll_ms,
                    &d.postgres_waiters_poll_ms,
                )
            })
            .or_else(|| changed("postgres_clock", &self.postgres_clock, &d.postgres_clock))
            .or_else(|| changed("postgres_schema", &self.postgres_schema, &d.postgres_schema))
    }
}

impl From<StoreConfig> for StoreSection {
    fn from(config: StoreConfig) -> StoreSection {
        let kind = Some(config.kind());
        match config {
            StoreConfig::Sqlite(sqlite) => StoreSection {
                kind,
                shard_file_bytes_max: Some(sqlite.shard_file_bytes_max),
                page_cache_bytes_max: Some(sqlite.page_cache_bytes_max),
                wal_checkpoint_pages: Some(sqlite.wal_checkpoint_pages),
                ..StoreSection::default()
            },
            StoreConfig::Postgres(pg) => StoreSection {
                kind,
                postgres_url: Some(pg.postgres_url),
                postgres_pool_size: Some(pg.postgres_pool_size),
                postgres_tls_ca_path: pg.postgres_tls_ca_path,
                postgres_statement_timeout_ms: Some(pg.postgres_statement_timeout_ms),
                postgres_count_timeout_ms: Some(pg.postgres_count_timeout_ms),
                postgres_waiters_poll_ms: Some(pg.postgres_waiters_poll_ms),
                postgres_clock: Some(pg.postgres_clock),
                postgres_schema: Some(pg.postgres_schema),
                ..StoreSection::default()
            },
        }
    }
}

/// The shard files' settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SqliteConfig {
    /// The largest a shard file may grow, in bytes; a write that would pass it is refused
    /// alone with `resource_exhausted`.
    pub shard_file_bytes_max: u64,
    /// SQLite's page cache per shard, in bytes. Small on purpose: after a B-tree split
    /// that reuses free pages, SQLite scans the whole cache at the commit (see
    /// docs/storage.md), and the shard's index keeps lookups off the cache anyway.
    pub page_cache_bytes_max: u64,
    /// WAL pages that trigger a checkpoint into the shard file (2 KiB each in files made
    /// since schema 5, 4 KiB in older ones). Larger means fewer copies of hot pages and a
    /// larger WAL file between checkpoints.
    pub wal_checkpoint_pages: u64,
}

impl Default for SqliteConfig {
    fn default() -> Self {
        SqliteConfig {
            shard_file_bytes_max: 64 << 30,
            page_cache_bytes_max: 4 << 20,
            wal_checkpoint_pages: 16_384,
        }
    }
}

/// The PostgreSQL store's settings (their names keep the `postgres_` of the flat
/// `[store]` section they are written in).
#[derive(Clone, PartialEq, Eq)]
pub struct PostgresConfig {
    /// The connection string (URL or `key=value` form); `sslmode=require` asks for TLS.
    /// Never logged with its password.
    pub postgres_url: PostgresUrl,
    /// Connections to PostgreSQL at most; each shard holds one.
    pub postgres_pool_size: usize,
    /// More roots (PEM) to check the database's certificate against, beside the
    /// system's: a private CA, or a cloud provider's bundle.
    pub postgres_tls_ca_path: Option<std::path::PathBuf>,
    /// The longest a PostgreSQL statement (or a connect) may take before the shard
    /// fails, answers `unavailable` and reconnects.
    pub postgres_statement_timeout_ms: u64,
    /// The longest the count of a shard's records may take when the node starts (one
    /// pass over the table; it grows with the table, so it has its own bound).
    pub postgres_count_timeout_ms: u64,
    /// How often a parked reserve's key is read again while another node may hold it.
    pub postgres_waiters_poll_ms: u64,
    /// Whose clock decides: the database's (default) or the engine's.
    pub postgres_clock: PgClock,
    /// The schema that holds oncegate's tables, set as each connection's `search_path`:
    /// every node on one database must use the same tables, whatever its role's own
    /// `search_path` would choose (`"$user", public` picks a schema named after the role).
    pub postgres_schema: String,
}

impl Default for PostgresConfig {
    fn default() -> Self {
        PostgresConfig {
            postgres_url: PostgresUrl::default(),
            postgres_pool_size: 16,
            postgres_tls_ca_path: None,
            postgres_statement_timeout_ms: 10_000,
            postgres_count_timeout_ms: 600_000,
            postgres_waiters_poll_ms: 50,
            postgres_clock: PgClock::Database,
            postgres_schema: "public".to_owned(),
        }
    }
}

/// The password stays out of every `{:?}` (configurations are logged at start).
impl std::fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("postgres_url", &self.postgres_url)
            .field("postgres_pool_size", &self.postgres_pool_size)
            .field("postgres_tls_ca_path", &self.postgres_tls_ca_path)
            .field("postgres_statement_timeout_ms", &self.postgres_statement_timeout_ms)
            .field("postgres_count_timeout_ms", &self.postgres_count_timeout_ms)
            .field("postgres_waiters_poll_ms", &self.postgres_waiters_poll_ms)
            .field("postgres_clock", &self.postgres_clock)
            .field("postgres_schema", &self.postgres_schema)
            .finish()
    }
}

/// The longest name PostgreSQL keeps whole (`NAMEDATALEN` less one), in bytes.
const POSTGRES_NAME_BYTES_MAX: usize = 63;

/// The shard count used when a new data directory is created and none is configured.
pub const SHARDS_DEFAULT: u32 = 2;
/// The most shards one data directory may have.
pub const SHARDS_MAX: u32 = 1024;

/// Everything the engine needs to open a data directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Where the manifest and the shard files live (with PostgreSQL: the node's name and
    /// its lock).
    pub data_dir: PathBuf,
    /// Where the records live. Not read from the `[engine]` section: the server's file has
    /// a `[store]` section of its own.
    #[serde(skip)]
    pub store: StoreConfig,
    /// How many shards (threads and SQLite files) a new directory gets. An existing
    /// directory keeps its own count (its manifest), which only grows: online with
    /// `oncegate admin add-shards`, offline with `oncegate reshard`; asking for more than
    /// it has is refused with how to add them.
    pub shards: u32,
    /// How hard a commit waits for the disk.
    pub durability: Durability,
    /// Limits on request fields.
    pub limits: Limits,
    /// Requests a shard's mailbox holds before it answers `resource_exhausted`.
    pub mailbox_depth_max: usize,
    /// Commands a shard applies in one transaction (one fsync).
    pub batch_len_max: usize,
    /// Expired records a shard deletes per alarm tick.
    pub reclaim_batch_max: usize,
    /// How finely the reclaim schedule keeps deadlines: a record is reclaimed at the end
    /// of the window of this width in which it expires (its state turns free at its own
    /// deadline regardless). Wider windows hold fewer entries in memory.
    pub reclaim_granularity_ms: u64,
    /// After a restart, every lease that was live at the stop runs at least this long.
    pub lease_restart_grace_ms: u64,
    /// Parked reserves (with `wait_ms > 0`) per key.
    pub waiters_per_key_max: usize,
    /// Parked reserves per shard.
    pub waiters_per_shard_max: usize,
    /// The first pause before a failed shard tries to reopen, or a shard whose disk was
    /// full tries writes again; doubles per failure.
    pub reopen_backoff_ms_min: u64,
    /// The longest pause between reopen attempts (or write attempts on a full disk).
    pub reopen_backoff_ms_max: u64,
    /// Slots an online add-shards moves per second at most (each move pauses its slot's
    /// requests for about three fsyncs); 0 moves as fast as the disk allows.
    pub slot_moves_per_second_max: u32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            data_dir: PathBuf::from("data"),
            store: StoreConfig::default(),
            shards: SHARDS_DEFAULT,
            durability: Durability::Full,
            limits: Limits::default(),
            mailbox_depth_max: 4_096,
            batch_len_max: 256,
            reclaim_batch_max: 512,
            reclaim_granularity_ms: 1_000,
            lease_restart_grace_ms: 30_000,
            waiters_per_key_max: 64,
            waiters_per_shard_max: 4_096,
            reopen_backoff_ms_min: 50,
            reopen_backoff_ms_max: 2_000,
            slot_moves_per_second_max: 200,
        }
    }
}

/// Hard bounds on the engine settings, so a typo cannot ask for a billion threads.
const MAILBOX_DEPTH_CEILING: usize = 1 << 20;
const BATCH_LEN_CEILING: usize = 16_384;
const RECLAIM_BATCH_CEILING: usize = 65_536;
const RECLAIM_GRANULARITY_MS_CEILING: u64 = 60_000;
const WAITERS_PER_SHARD_CEILING: usize = 1 << 20;
const REOPEN_BACKOFF_MS_CEILING: u64 = 60_000;
const LEASE_RESTART_GRACE_MS_CEILING: u64 = 3_600_000;

impl EngineConfig {
    /// Checks every setting and returns every problem, each naming the setting, its value
    /// and the bound it breaks.
    pub fn check(&self) -> Result<(), Vec<Problem>> {
        let mut problems = Problems::default();
        if let Err(limits) = self.limits.check() {
            limits.into_iter().for_each(|p| problems.push(p));
        }
        let count = |n: usize| n as u64;
        problems.within("shards", u64::from(self.shards), 1, u64::from(SHARDS_MAX), Unit::Count);
        problems.within(
            "mailbox_depth_max",
            count(self.mailbox_depth_max),
            1,
            count(MAILBOX_DEPTH_CEILING),
            Unit::Count,
        );
        problems.within("batch_len_max", count(self.batch_len_max), 1, count(BATCH_LEN_CEILING), Unit::Count);
        problems.within(
            "reclaim_batch_max",
            count(self.reclaim_batch_max),
            1,
            count(RECLAIM_BATCH_CEILING),
            Unit::Count,
        );
        problems.within(
            "reclaim_granularity_ms",
            self.reclaim_granularity_ms,
            1,
            RECLAIM_GRANULARITY_MS_CEILING,
            Unit::Ms,
        );
        problems.within(
            "lease_restart_grace_ms",
            self.lease_restart_grace_ms,
            0,
            LEASE_RESTART_GRACE_MS_CEILING,
            Unit::Ms,
        );
        let shard_waiters = count(self.waiters_per_shard_max);
        problems.within(
            "waiters_per_shard_max",
            shard_waiters,
            0,
            count(WAITERS_PER_SHARD_CEILING),
            Unit::Count,
        );
        problems.within(
            "waiters_per_key_max",
            count(self.waiters_per_key_max),
            0,
            shard_waiters,
            Unit::Count,
        );
        problems.within(
            "reopen_backoff_ms_min",
            self.reopen_backoff_ms_min,
            1,
            REOPEN_BACKOFF_MS_CEILING,
            Unit::Ms,
        );
        let backoff_min = self.reopen_backoff_ms_min;
        problems.within(
            "reopen_backoff_ms_max",
            self.reopen_backoff_ms_max,
            backoff_min,
            REOPEN_BACKOFF_MS_CEILING,
            Unit::Ms,
        );
        self.check_files(&mut problems);
        if let Err(store) = self.store.check(self.shards) {
            problems.extend_under("store", store);
        }
        problems.into_result()
    }

    /// The pace of slot moves.
    fn check_files(&self, problems: &mut Problems) {
        problems.within(
            "slot_moves_per_second_max",
            u64::from(self.slot_moves_per_second_max),
            0,
            100_000,
            Unit::Count,
        );
    }
}

impl StoreConfig {
    /// The store's kind.
    pub fn kind(&self) -> StoreKind {
        match self {
            StoreConfig::Sqlite(_) => StoreKind::Sqlite,
            StoreConfig::Postgres(_) => StoreKind::Postgres,
        }
    }

    /// A store of `kind` with its defaults.
    pub fn of_kind(kind: StoreKind) -> StoreConfig {
        match kind {
            StoreKind::Sqlite => StoreConfig::Sqlite(SqliteConfig::default()),
            StoreKind::Postgres => StoreConfig::Postgres(PostgresConfig::default()),
        }
    }

    /// The PostgreSQL store at `url`, its other settings at their defaults.
    pub fn postgres(url: impl Into<PostgresUrl>) -> StoreConfig {
        StoreConfig::Postgres(PostgresConfig { postgres_url: url.into(), ..PostgresConfig::default() })
    }

    /// The shard files' settings: the configured ones, or the defaults for a store that
    /// has no files (which never reads them).
    pub fn sqlite(&self) -> SqliteConfig {
        match self {
            StoreConfig::Sqlite(sqlite) => *sqlite,
            StoreConfig::Postgres(_) => SqliteConfig::default(),
        }
    }

    /// Checks the store's settings for an engine of `shards` shards; problems name the
    /// fields relative to the section (`postgres_url`).
    pub fn check(&self, shards: u32) -> Result<(), Vec<Problem>> {
        match self {
            StoreConfig::Sqlite(sqlite) => sqlite.check(),
            StoreConfig::Postgres(postgres) => postgres.check(shards),
        }
    }
}

impl SqliteConfig {
    fn from_section(section: &StoreSection) -> SqliteConfig {
        let default = SqliteConfig::default();
        SqliteConfig {
            shard_file_bytes_max: section.shard_file_bytes_max.unwrap_or(default.shard_file_bytes_max),
            page_cache_bytes_max: section.page_cache_bytes_max.unwrap_or(default.page_cache_bytes_max),
            wal_checkpoint_pages: section.wal_checkpoint_pages.unwrap_or(default.wal_checkpoint_pages),
        }
    }

    fn check(&self) -> Result<(), Vec<Problem>> {
        let mut problems = Problems::default();
        problems.within("shard_file_bytes_max", self.shard_file_bytes_max, 1 << 20, u64::MAX, Unit::Bytes);
        problems.within("page_cache_bytes_max", self.page_cache_bytes_max, 1 << 20, 16 << 30, Unit::Bytes);
        problems.within("wal_checkpoint_pages", self.wal_checkpoint_pages, 100, 1 << 20, Unit::Count);
        problems.into_result()
    }
}

impl PostgresConfig {
    fn from_section(section: StoreSection) -> PostgresConfig {
        let default = PostgresConfig::default();
        PostgresConfig {
            postgres_url: section.postgres_url.unwrap_or(default.postgres_url),
            postgres_pool_size: section.postgres_pool_size.unwrap_or(default.postgres_pool_size),
            postgres_tls_ca_path: section.postgres_tls_ca_path,
            postgres_statement_timeout_ms: section
                .postgres_statement_timeout_ms
                .unwrap_or(default.postgres_statement_timeout_ms),
            postgres_count_timeout_ms: section
                .postgres_count_timeout_ms
                .unwrap_or(default.postgres_count_timeout_ms),
            postgres_waiters_poll_ms: section
                .postgres_waiters_poll_ms
                .unwrap_or(default.postgres_waiters_poll_ms),
            postgres_clock: section.postgres_clock.unwrap_or(default.postgres_clock),
            postgres_schema: section.postgres_schema.unwrap_or(default.postgres_schema),
        }
    }

    fn check(&self, shards: u32) -> Result<(), Vec<Problem>> {
        let mut problems = Problems::default();
        if cfg!(not(feature = "postgres")) {
            problems.push(Problem::new("kind", "is postgres, which this build was made without"));
        } else if self.postgres_url.is_empty() {
            problems.push(Problem::new(
                "postgres_url",
                "is empty; kind = \"postgres\" needs a connection string",
            ));
        } else if !self.postgres_url.parses() {
            problems.push(Problem::new("postgres_url", "does not parse as a PostgreSQL connection string"));
        }
        problems.within_because(
            "postgres_pool_size",
            self.postgres_pool_size as u64,
            u64::from(shards),
            10_000,
            Unit::Count,
            " (the shard count: each shard holds one connection)",
        );
        problems.within(
            "postgres_statement_timeout_ms",
            self.postgres_statement_timeout_ms,
            100,
            600_000,
            Unit::Ms,
        );
        problems.within(
            "postgres_count_timeout_ms",
            self.postgres_count_timeout_ms,
            100,
            86_400_000,
            Unit::Ms,
        );
        problems.within("postgres_waiters_poll_ms", self.postgres_waiters_poll_ms, 1, 60_000, Unit::Ms);
        let schema_bytes = self.postgres_schema.len();
        if schema_bytes == 0 || schema_bytes > POSTGRES_NAME_BYTES_MAX {
            let detail =
                format!("is {schema_bytes} bytes; a PostgreSQL name is 1 to {POSTGRES_NAME_BYTES_MAX}");
            problems.push(Problem::new("postgres_schema", detail));
        }
        problems.into_result()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Configurations are logged at start and errors carry where the database is: the
    /// password appears in neither, in either form of connection string.
    #[test]
    fn the_password_never_leaves_the_connection_string() {
        for url in [
            "postgres://gate:s3cret-pw@db.internal:6543/oncegate?sslmode=require",
            "host=db.internal port=6543 user=gate password=s3cret-pw dbname=oncegate",
        ] {
            let shown = PostgresUrl::from(url).redacted();
            assert_eq!(shown, "host=db.internal port=6543 dbname=oncegate user=gate");
            let config = StoreConfig::postgres(url);
            let debug = format!("{config:?}");
            assert!(!debug.contains("s3cret-pw") && debug.contains("db.internal"), "{debug}");
        }
        assert_eq!(
            PostgresUrl::from("postgres://gate:s3cret-pw@[::1").redacted(),
            "(a postgres_url that does not parse)"
        );
    }
}
