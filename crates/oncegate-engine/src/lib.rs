//! The oncegate shard engine and its embedded API.
//!
//! Each key hashes (see `oncegate_core::route`) to one shard. A shard is an actor: one OS
//! thread that alone owns its store (one SQLite file in WAL mode, or one connection to
//! the PostgreSQL table every node shares; `store/`) and is fed through a bounded
//! crossbeam-channel mailbox. It applies a drained batch in one transaction and answers
//! only after the commit is durable. See `docs/ARCHITECTURE.md` for the protocol.
//!
//! The same [`Engine`] serves the gRPC front and in-process (embedded) callers: its
//! methods are `async` (usable from any runtime; the answer travels on a oneshot
//! channel) with `_blocking` twins for synchronous callers.

pub mod backup;
mod clock;
mod config;
mod error;
mod faults;
pub mod files;
mod gate;
mod grow;
mod index;
pub mod manifest;
mod quota;
pub mod reshard;
mod routes;
mod schedule;
mod shard;
pub mod slots;
mod store;
pub mod token;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread::JoinHandle;

use crossbeam_channel::{Sender, TrySendError};
use oncegate_core::{
    ClockGuard, Command, Commit, Key, Limits, Namespace, Record, Reply, Reserve, ReserveReply, Scope, State,
    Tenant, View, route,
};
use tokio::sync::oneshot;

pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{
    Durability, EngineConfig, PgClock, PostgresUrl, SHARDS_DEFAULT, SHARDS_MAX, StoreConfig, StoreKind,
};
pub use error::{Error, OpenError};
pub use faults::Faults;
pub use gate::TenantGate;
pub use shard::ShardState;
pub use store::StoreError;

/// Applies the settings of a shard file's connection to `conn` (WAL, `synchronous`, the
/// checkpoint interval, the page cache) from `config`: the benchmark's raw-SQLite ceiling
/// runs with exactly the engine's settings this way.
pub fn configure_sqlite(conn: &rusqlite::Connection, config: &EngineConfig) -> Result<(), StoreError> {
    store::configure(conn, config.durability, config.wal_checkpoint_pages, config.page_cache_bytes_max)
}

use shard::{Arrival, Control, Derive, FrameFloor, Mail, Marks, Parts, Request, Shard, Shared, Start};

pub use oncegate_core::gate::{CommitRequest, Gate, KeyRequest, Renewed, ReserveRequest, Reserved};

/// One shard's counters, as `Engine::stats` reports them.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardStats {
    /// The shard number.
    pub shard: u32,
    /// Slots the slot map gives this shard.
    pub slots: u32,
    /// Starting, serving, failed, stopped, panicked or halted.
    pub state: ShardState,
    /// Requests waiting in the mailbox now.
    pub mailbox_depth: usize,
    /// Batches applied (committed or failed).
    pub batches: u64,
    /// Commands in those batches.
    pub commands: u64,
    /// `commands / batches`: how much each fsync carried.
    pub batch_len_mean: f64,
    /// Transactions committed (batches and alarms).
    pub commits: u64,
    /// Storage failures since start.
    pub failures: u64,
    /// Expired records deleted by alarms.
    pub reclaimed: u64,
    /// Alarm ticks run (each reclaims at most `reclaim_batch_max` records).
    pub alarms: u64,
    /// WAL checkpoints of the shard file (none on PostgreSQL).
    pub checkpoints: u64,
    /// Reserves parked now.
    pub waiters: u64,
    /// Stored pending records (expired ones not yet reclaimed included).
    pub records_pending: u64,
    /// Stored completed records (expired ones not yet reclaimed included).
    pub records_completed: u64,
    /// The last storage error, if any.
    pub last_error: Option<String>,
}

struct ShardHandle {
    data: Sender<Mail>,
    /// What a slot's move hands its owner at its end (unbounded: sent under the routing
    /// table's lock, which must never wait for a shard).
    moved: Sender<shard::Moved>,
    control: Sender<Control>,
    /// Callers that stop waiting nudge the shard here (capacity 1: nudges coalesce).
    gone: Sender<()>,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct Inner {
    config: Arc<EngineConfig>,
    clock: Arc<dyn Clock>,
    /// The shards and the slot map that routes to them (`routes.rs`).
    table: RwLock<routes::Table>,
    /// The map as shards read it when they open, with the slot moving now.
    live: Arc<slots::LiveMap>,
    closing: AtomicBool,
    /// The time frame for deriving keys in directories routed by whole keys (bucket
    /// routing derives in the shard's transaction), anchored like the shards' (wall clock
    /// at open, then monotonic time), so a clock step cannot move a derived key into
    /// another bucket.
    frame: Mutex<ClockGuard>,
    /// The shards' persisted marks, which the frame never goes below.
    floor: Arc<FrameFloor>,
    /// The marks of the shards opened with the engine, which lift every shard's frame
    /// (and the derived keys') to one time.
    marks: Arc<Marks>,
    /// Each tenant's most records per shard, read by every shard.
    quotas: quota::Quotas,
    /// What shards added later start from, like the first ones.
    start: Start,
    faults: Faults,
    files: Arc<dyn files::Files>,
    /// The shared PostgreSQL store, when the records live there.
    postgres: Option<Arc<store::postgres::Postgres>>,
    /// Held while shards are added or a backup runs: the slot map changes under neither.
    growing: Mutex<()>,
    /// Held for the engine's life: one process owns a data directory.
    _lock: files::LockGuard,
}

/// Where an engine's keys live: the slot map and shard count, the routing, and the
/// database when the records are in PostgreSQL.
struct Placement {
    map: slots::SlotMap,
    shards: u32,
    routing: oncegate_core::route::Routing,
    postgres: Option<Arc<store::postgres::Postgres>>,
}

/// Reads (or creates) a data directory's slot map, or, for PostgreSQL, computes one and
/// opens the pool: the records are in the database, and shards only spread this node's
/// work, so any count serves every key and the map is never stored.
fn place(
    config: &EngineConfig,
    kind: StoreKind,
    files: &dyn files::Files,
    clock: &Arc<dyn Clock>,
) -> Result<Placement, OpenError> {
    let placement = match kind {
        StoreKind::Sqlite => {
            let (map, shards, routing) = manifest::open_or_create(files, &config.data_dir, config.shards)?;
            Placement { map, shards, routing, postgres: None }
        }
        StoreKind::Postgres => {
            let node = manifest::node_name(files, &config.data_dir)?;
            let pg = store::postgres::Postgres::new(
                &config.store,
                config.durability,
                node.clone(),
                Arc::clone(clock),
            )
            .map_err(|e| OpenError::Postgres { reason: e.to_string() })?;
            tracing::info!(database = %pg.display, node = %node, shards = config.shards, "records in PostgreSQL");
            Placement {
                map: slots::SlotMap::even(config.shards),
                shards: config.shards,
                routing: store::postgres::ROUTING,
                postgres: Some(Arc::new(pg)),
            }
        }
    };
    if placement.shards > config.shards {
        tracing::warn!(
            configured = config.shards,
            shards = placement.shards,
            "the data directory has more shards than configured (they were added); serving all of them"
        );
    }
    Ok(placement)
}

/// What every shard of an engine shares.
struct Common {
    config: Arc<EngineConfig>,
    clock: Arc<dyn Clock>,
    start: Start,
    floor: Arc<FrameFloor>,
    marks: Arc<Marks>,
    faults: Faults,
    quotas: quota::Quotas,
    files: Arc<dyn files::Files>,
    slots: Arc<slots::LiveMap>,
    postgres: Option<Arc<store::postgres::Postgres>>,
}

/// Makes one shard's channels and starts its thread.
fn start_shard(id: u32, common: Common, started: shard::Started) -> Result<ShardHandle, OpenError> {
    let (data_tx, data) = crossbeam_channel::bounded(common.config.mailbox_depth_max);
    // Bounded by what it carries: one message per move's end, whose held requests are
    // callers already waiting.
    let (moved_tx, moved) = crossbeam_channel::unbounded();
    // Control messages are rare (shutdown, alarms on demand, reopen); a few slots are
    // plenty and keep the channel bounded.
    let (control_tx, control) = crossbeam_channel::bounded(16);
    let (gone_tx, gone) = crossbeam_channel::bounded(1);
    let shared = Arc::new(Shared::default());
    let data_dir = common.config.data_dir.clone();
    let parts = Parts {
        id,
        config: common.config,
        clock: common.clock,
        start: common.start,
        floor: common.floor,
        arrival: Arrival::new(common.marks),
        faults: common.faults,
        shared: Arc::clone(&shared),
        data,
        moved,
        control,
        gone,
        quotas: common.quotas,
        files: common.files,
        slots: common.slots,
        postgres: common.postgres,
    };
    let thread = spawn_shard(Shard::new(parts), id, Arc::clone(&shared), started)
        .map_err(|source| OpenError::Io { path: data_dir, source })?;
    Ok(ShardHandle {
        data: data_tx,
        moved: moved_tx,
        control: control_tx,
        gone: gone_tx,
        shared,
        thread: Mutex::new(Some(thread)),
    })
}

/// The embedded engine: routes each call to its key's shard and waits for the answer.
///
/// Cloning is cheap and shares the same shards. The shards stop when `shutdown` is called
/// or when the last clone is dropped.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

/// An answer on its way from a shard. Dropped before the answer came (the caller was
/// cancelled or gave up), it closes its channel and nudges the shard, which drops the
/// request if it is still parked: a gone caller is never granted.
struct Pending {
    shard: u32,
    /// Taken once the answer arrived (or a blocked thread waits for it): a `Pending`
    /// dropped with its receiver still here was given up by its caller.
    rx: Option<oneshot::Receiver<Result<Reply, Error>>>,
    gone: Sender<()>,
    /// The request's slot and the engine, to nudge the slot's owner when it is no longer
    /// the shard the request was sent to: a waiter parked there moved with its slot.
    slot: u32,
    engine: std::sync::Weak<Inner>,
}

impl Pending {
    fn lost(shard: u32) -> Error {
        Error::Unavailable { shard, reason: "the shard stopped before answering".to_owned() }
    }

    async fn wait(mut self) -> Result<Reply, Error> {
        let answer = self.rx.as_mut().expect("waited once").await;
        self.rx = None;
        answer.unwrap_or_else(|_| Err(Pending::lost(self.shard)))
    }

    fn wait_blocking(mut self) -> Result<Reply, Error> {
        // A blocked thread cannot give up, so the receiver is taken before it blocks.
        let rx = self.rx.take().expect("waited once");
        rx.blocking_recv().unwrap_or_else(|_| Err(Pending::lost(self.shard)))
    }

    /// Nudges the slot's owner too when the slot moved since the request was sent. A
    /// table being written (a move's flip) is not waited for: a waiter left parked then
    /// is still never granted, and goes at its deadline or the owner's next sweep.
    fn nudge_new_owner(&self) {
        let Some(inner) = self.engine.upgrade() else { return };
        let Ok(table) = inner.table.try_read() else { return };
        let owner = table.map.owner(self.slot);
        if owner != self.shard
            && let Some(handle) = table.shards.get(owner as usize)
        {
            let _ = handle.gone.try_send(());
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(rx) = self.rx.as_mut() {
            // Closed before the nudge, so the shard sees the caller gone when it looks.
            rx.close();
            let _ = self.gone.try_send(());
            self.nudge_new_owner();
        }
    }
}

/// A reserve on its way, and the key its answer will come from.
struct StartedReserve {
    keys: ReserveKeys,
    pending: Pending,
}

enum ReserveKeys {
    /// Named by the caller, or derived before it was sent (a directory routed by whole
    /// keys).
    Known(Key),
    /// Derived by the shard, which names it here before it answers.
    Derived(Arc<OnceLock<Key>>),
}

impl ReserveKeys {
    /// The key the answer came from; read only after the answer arrived.
    fn answered(self, shard: u32) -> Result<Key, Error> {
        match self {
            ReserveKeys::Known(key) => Ok(key),
            ReserveKeys::Derived(named) => named.get().cloned().ok_or_else(|| Error::Unavailable {
                shard,
                reason: "the shard answered a derived reserve without naming its key (a bug)".to_owned(),
            }),
        }
    }
}

/// A request that breaks a rule between its fields.
fn rule(field: &'static str, rule: &'static str) -> Error {
    oncegate_core::Invalid::Rule { field, rule }.into()
}

/// Refuses derived-key fields on a reserve that names its key.
fn only_with_key_parts(request: &ReserveRequest) -> Result<(), Error> {
    if request.bucket_ms != 0 {
        return Err(rule("bucket_ms", "only applies with key_parts"));
    }
    if request.bucket_grace_ms != 0 {
        return Err(rule("bucket_grace_ms", "only applies with key_parts"));
    }
    Ok(())
}

fn expect_reserve(reply: Reply) -> ReserveReply {
    match reply {
        Reply::Reserve(r) => r,
        other => unreachable!("a reserve is answered by a reserve reply, got {other:?}"),
    }
}

fn expect_commit(reply: Reply) -> u64 {
    match reply {
        Reply::Commit { expires_at_ms } => expires_at_ms,
        other => unreachable!("a commit is answered by a commit reply, got {other:?}"),
    }
}

fn expect_release(reply: Reply) {
    match reply {
        Reply::Release => {}
        other => unreachable!("a release is answered by a release reply, got {other:?}"),
    }
}

fn expect_heartbeat(reply: Reply) -> Renewed {
    match reply {
        Reply::Heartbeat { lease_until_ms, expires_at_ms } => Renewed { lease_until_ms, expires_at_ms },
        other => unreachable!("a heartbeat is answered by a heartbeat reply, got {other:?}"),
    }
}

fn expect_get(reply: Reply) -> View {
    match reply {
        Reply::Get(view) => view,
        other => unreachable!("a get is answered by a view, got {other:?}"),
    }
}

impl Engine {
    /// Opens (or creates) the data directory with the system clock.
    pub fn open(config: EngineConfig) -> Result<Engine, OpenError> {
        Engine::open_with(config, Arc::new(SystemClock), Faults::default())
    }

    /// Opens the data directory with an injected clock and fault seam (tests use a
    /// `ManualClock` and arm `Faults`).
    pub fn open_with(
        config: EngineConfig,
        clock: Arc<dyn Clock>,
        faults: Faults,
    ) -> Result<Engine, OpenError> {
        Engine::open_on(config, clock, faults, Arc::new(files::OsFiles))
    }

    /// Opens the data directory through another files seam: the power-loss harness runs
    /// the engine on a simulated disk this way.
    pub fn open_on(
        config: EngineConfig,
        clock: Arc<dyn Clock>,
        faults: Faults,
        files: Arc<dyn files::Files>,
    ) -> Result<Engine, OpenError> {
        config.check().map_err(OpenError::Config)?;
        let lock = manifest::lock(&*files, &config.data_dir)?;
        let mut config = config;
        let kind = manifest::settle_store_kind(&*files, &mut config)?;
        let Placement { map, shards, routing, postgres } = place(&config, kind, &*files, &clock)?;
        let config = Arc::new(config);
        // The one wall-clock reading of the process: every shard's frame, and the frame of
        // derived keys, is anchored to it; nothing re-anchors until the next process.
        let start = Start { wall_ms: clock.now_ms(), monotonic_ms: clock.monotonic_ms() };
        let floor = Arc::new(FrameFloor::default());
        if postgres.is_none() {
            // A file store's derived keys take the directory's format; a shared store's,
            // the database's, which its shards read when they open.
            let _ = floor.format.set(routing);
        }
        // Derived keys use the same frame, never below any shard's persisted mark.
        let mut frame = ClockGuard::new(0);
        frame.anchor(start.wall_ms, start.monotonic_ms);
        // A shared store's time is the database's: its shards do not wait for each other.
        let marks = Arc::new(Marks::new(if postgres.is_none() { shards as usize } else { 0 }));
        let inner = Inner {
            live: Arc::new(slots::LiveMap::new(map.clone(), routing)),
            table: RwLock::new(routes::Table { map, shards: Vec::new(), moving: None }),
            config,
            clock,
            closing: AtomicBool::new(false),
            frame: Mutex::new(frame),
            floor,
            marks,
            quotas: quota::Quotas::default(),
            start,
            faults,
            files,
            postgres,
            growing: Mutex::new(()),
            _lock: lock,
        };
        let handles = inner.start_shards(0..shards)?;
        // The shards' one frame, which derived keys share.
        let base_ms = start.wall_ms.max(inner.marks.highest_ms());
        inner.frame.lock().unwrap_or_else(|p| p.into_inner()).anchor(base_ms, start.monotonic_ms);
        inner.table_mut().shards = handles;
        Ok(Engine { inner: Arc::new(inner) })
    }

    /// Sets each tenant's most stored records per shard (replacing any earlier table); a
    /// tenant not in `table` has no quota. A reserve that would store a record for a new
    /// key of a tenant at its quota on the key's shard is refused `resource_exhausted`
    /// (`tenants[].records_per_shard_max`); the tenant's existing keys are served as
    /// before, and reclaiming its expired records makes room again.
    pub fn set_records_per_shard_max(&self, table: std::collections::HashMap<Tenant, u64>) {
        self.inner.quotas.set(table);
    }

    /// The clock every decision reads; fronts that keep time of their own (rate limits)
    /// read it too, so that tests drive them with the same manual clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.inner.clock
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// The request limits.
    pub fn limits(&self) -> &Limits {
        &self.inner.config.limits
    }

    /// The shard that owns a scope: the slot map's owner of the scope's slot.
    pub fn shard_of(&self, scope: &Scope) -> u32 {
        self.inner.table().map.owner(self.inner.live.routing.slot_of(scope))
    }

    /// The format derived keys take: the directory's routing, or a shared store's as its
    /// schema records it (known once a shard has opened).
    fn derived_format(&self) -> Result<route::Routing, Error> {
        self.inner.floor.format.get().copied().ok_or_else(|| self.not_yet_opened())
    }

    fn not_yet_opened(&self) -> Error {
        let shard = self.shard_states().iter().position(|s| *s != ShardState::Serving).unwrap_or(0) as u32;
        let reason = "derived keys wait until every shard has opened once (its clock mark is unknown)";
        Error::Unavailable { shard, reason: reason.to_owned() }
    }

    /// `now` for deriving keys in a directory routed by whole keys: the process's frame,
    /// never below any shard's persisted mark. Until every shard has opened once the
    /// marks are not all known, and a key bucketed by a clock that may be behind could
    /// land in another bucket than its first attempt (and so on another shard): derived
    /// keys are refused until then.
    fn derive_now_ms(&self) -> Result<u64, Error> {
        let floor = &self.inner.floor;
        if floor.unopened.load(Ordering::SeqCst) > 0 {
            return Err(self.not_yet_opened());
        }
        let monotonic = self.inner.clock.monotonic_ms();
        let mut frame = self.inner.frame.lock().unwrap_or_else(|p| p.into_inner());
        frame.raise(floor.high_water_ms.load(Ordering::SeqCst));
        Ok(frame.read(monotonic))
    }

    /// Queues a request on its slot's shard, or holds it while the slot moves; either
    /// way under the table's read lock (`routes.rs` says why).
    fn submit(&self, scope: Scope, command: Command) -> Result<Pending, Error> {
        self.send(scope, command, None)
    }

    fn send(&self, scope: Scope, command: Command, derive: Option<Box<Derive>>) -> Result<Pending, Error> {
        let slot = self.inner.live.routing.slot_of(&scope);
        let table = self.inner.table();
        let shard = table.map.owner(slot);
        if self.inner.closing.load(Ordering::Acquire) {
            return Err(Error::Unavailable { shard, reason: "the engine is shutting down".to_owned() });
        }
        let (reply, rx) = oneshot::channel();
        let handle = &table.shards[shard as usize];
        let span = tracing::Span::current();
        span.record("shard", shard);
        let request = Request { scope, command, reply, span, derive };
        let sent = match table.moving.as_ref().filter(|moving| moving.step.slot == slot) {
            Some(moving) => moving.hold(request, self.inner.config.mailbox_depth_max),
            None => handle.data.try_send(Mail::Call(request)).map_err(|error| match error {
                TrySendError::Full(_) => Error::ResourceExhausted {
                    what: format!("shard {shard} mailbox"),
                    limit_name: "mailbox_depth_max",
                    limit: self.inner.config.mailbox_depth_max,
                },
                TrySendError::Disconnected(_) => Pending::lost(shard),
            }),
        };
        let engine = Arc::downgrade(&self.inner);
        sent.map(|()| Pending { shard, rx: Some(rx), gone: handle.gone.clone(), slot, engine })
    }

    /// Validates a key's address against the limits.
    pub fn scope(&self, tenant: &Tenant, namespace: &str, key: &str) -> Result<Scope, Error> {
        Ok(Scope {
            tenant: tenant.clone(),
            namespace: Namespace::new(namespace)?,
            key: self.limits().key(key)?,
        })
    }

    fn start_reserve(&self, tenant: &Tenant, request: ReserveRequest) -> Result<StartedReserve, Error> {
        let limits = self.limits();
        let namespace = Namespace::new(&request.namespace)?;
        let reserve = Reserve {
            ttl_ms: limits.ttl_ms(request.ttl_ms)?,
            lease_ms: limits.lease_ms(request.lease_ms)?,
            fingerprint: limits.fingerprint(&request.fingerprint)?,
            wait_ms: limits.wait_ms(request.wait_ms)?,
        };
        match (request.key.is_empty(), request.key_parts.is_empty()) {
            (false, true) => {
                only_with_key_parts(&request)?;
                let key = limits.key(&request.key)?;
                let scope = Scope { tenant: tenant.clone(), namespace, key: key.clone() };
                let pending = self.submit(scope, Command::Reserve(reserve))?;
                Ok(StartedReserve { keys: ReserveKeys::Known(key), pending })
            }
            (true, false) => self.start_derived(tenant, namespace, &request, reserve),
            (false, false) => Err(rule("key_parts", "send either key or key_parts, not both")),
            (true, true) => Err(oncegate_core::Invalid::Empty { field: "key" }.into()),
        }
    }

    /// A reserve sent as parts. Routed by bucket base, every bucket of the key lives on
    /// one shard, which names the key from its batch's time (and, within the grace, looks
    /// at the previous bucket's first): time and decision come from one transaction, so a
    /// retry read after a boundary can never be decided before a first attempt read
    /// before it, on one node or, on a shared database, across nodes. Routed by whole
    /// keys (older directories), the key is derived here and sent as a named one.
    fn start_derived(
        &self,
        tenant: &Tenant,
        namespace: Namespace,
        request: &ReserveRequest,
        reserve: Reserve,
    ) -> Result<StartedReserve, Error> {
        let limits = self.limits();
        let format = self.derived_format()?;
        if request.bucket_grace_ms > 0 && format == route::Routing::WholeKey {
            return Err(rule(
                "bucket_grace_ms",
                "needs bucket routing, which this data directory predates: its derived keys' buckets may live on different shards",
            ));
        }
        let derived =
            limits.derived(&request.key_parts, request.bucket_ms, request.bucket_grace_ms, format)?;
        if format == route::Routing::WholeKey {
            let key = limits.key(&derived.key(derived.bucket_of(self.derive_now_ms()?)))?;
            let scope = Scope { tenant: tenant.clone(), namespace, key: key.clone() };
            let pending = self.submit(scope, Command::Reserve(reserve))?;
            return Ok(StartedReserve { keys: ReserveKeys::Known(key), pending });
        }
        // Routed by its base, as every bucket's key is.
        let base = Scope { tenant: tenant.clone(), namespace, key: limits.key(derived.base())? };
        let named = Arc::new(OnceLock::new());
        let derive = Box::new(Derive { derived, named: Arc::clone(&named) });
        let pending = self.send(base, Command::Reserve(reserve), Some(derive))?;
        Ok(StartedReserve { keys: ReserveKeys::Derived(named), pending })
    }

    fn start_commit(&self, tenant: &Tenant, request: CommitRequest) -> Result<Pending, Error> {
        let scope = self.scope(tenant, &request.namespace, &request.key)?;
        let token = self.limits().token(request.token)?;
        self.limits().response(&request.response)?;
        let command = Command::Commit(Commit { token, outcome: request.outcome, response: request.response });
        self.submit(scope, command)
    }

    fn start_release(&self, tenant: &Tenant, request: &KeyRequest) -> Result<Pending, Error> {
        let scope = self.scope(tenant, &request.namespace, &request.key)?;
        let token = self.limits().token(request.token)?;
        self.submit(scope, Command::Release { token })
    }

    fn start_heartbeat(&self, tenant: &Tenant, request: &KeyRequest) -> Result<Pending, Error> {
        let scope = self.scope(tenant, &request.namespace, &request.key)?;
        let token = self.limits().token(request.token)?;
        let lease_ms = self.limits().lease_ms(request.lease_ms)?;
        self.submit(scope, Command::Heartbeat { token, lease_ms })
    }

    fn start_get(&self, tenant: &Tenant, request: &KeyRequest) -> Result<Pending, Error> {
        let scope = self.scope(tenant, &request.namespace, &request.key)?;
        self.submit(scope, Command::Get)
    }

    // The async methods submit the request before they return the future, so calls made
    // one after another from one thread reach a shard in that order, whether or not (and
    // whenever) the futures are polled. The futures borrow nothing from the engine.

    /// May this attempt proceed? Granted, in progress, completed (replay) or mismatch.
    pub fn reserve(
        &self,
        tenant: &Tenant,
        request: ReserveRequest,
    ) -> impl Future<Output = Result<Reserved, Error>> + Send + 'static + use<> {
        let started = self.start_reserve(tenant, request);
        async move {
            let StartedReserve { keys, pending } = started?;
            let shard = pending.shard;
            let reply = expect_reserve(pending.wait().await?);
            Ok(Reserved { key: keys.answered(shard)?, reply })
        }
    }

    /// Stores the holder's outcome and response; returns the record's expiry.
    pub fn commit(
        &self,
        tenant: &Tenant,
        request: CommitRequest,
    ) -> impl Future<Output = Result<u64, Error>> + Send + 'static + use<> {
        let started = self.start_commit(tenant, request);
        async move { Ok(expect_commit(started?.wait().await?)) }
    }

    /// Gives the key up so a retry may proceed.
    pub fn release(
        &self,
        tenant: &Tenant,
        request: KeyRequest,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'static + use<> {
        let started = self.start_release(tenant, &request);
        async move { started?.wait().await.map(expect_release) }
    }

    /// Renews the holder's lease.
    pub fn heartbeat(
        &self,
        tenant: &Tenant,
        request: KeyRequest,
    ) -> impl Future<Output = Result<Renewed, Error>> + Send + 'static + use<> {
        let started = self.start_heartbeat(tenant, &request);
        async move { started?.wait().await.map(expect_heartbeat) }
    }

    /// Reads the key's state.
    pub fn get(
        &self,
        tenant: &Tenant,
        request: KeyRequest,
    ) -> impl Future<Output = Result<View, Error>> + Send + 'static + use<> {
        let started = self.start_get(tenant, &request);
        async move { started?.wait().await.map(expect_get) }
    }

    /// Operator: the whole live record of a key (none when it is free), and its shard.
    pub fn inspect(
        &self,
        scope: Scope,
    ) -> impl Future<Output = Result<(u32, State, Option<Record>), Error>> + Send + 'static + use<> {
        let shard = self.shard_of(&scope);
        let started = self.submit(scope, Command::Inspect);
        async move {
            match started?.wait().await? {
                Reply::Inspect { state, record } => Ok((shard, state, record)),
                other => unreachable!("an inspect is answered by a record, got {other:?}"),
            }
        }
    }

    /// Operator: frees a pending or abandoned key whatever its token; the next reserve
    /// is granted with a greater token. Returns the state and token that were removed.
    pub fn force_release(
        &self,
        scope: Scope,
    ) -> impl Future<Output = Result<(State, u64), Error>> + Send + 'static + use<> {
        self.remove(scope, Command::ForceRelease)
    }

    /// Operator: deletes a key's live record in any state, completion included.
    pub fn purge(
        &self,
        scope: Scope,
    ) -> impl Future<Output = Result<(State, u64), Error>> + Send + 'static + use<> {
        self.remove(scope, Command::Purge)
    }

    fn remove(
        &self,
        scope: Scope,
        command: Command,
    ) -> impl Future<Output = Result<(State, u64), Error>> + Send + 'static + use<> {
        let started = self.submit(scope, command);
        async move {
            match started?.wait().await? {
                Reply::Removed { previous, token } => Ok((previous, token)),
                other => unreachable!("an operator removal is answered by what it removed, got {other:?}"),
            }
        }
    }

    /// [`Engine::reserve`] for synchronous callers (not from inside an async task).
    pub fn reserve_blocking(&self, tenant: &Tenant, request: ReserveRequest) -> Result<Reserved, Error> {
        let StartedReserve { keys, pending } = self.start_reserve(tenant, request)?;
        let shard = pending.shard;
        let reply = expect_reserve(pending.wait_blocking()?);
        Ok(Reserved { key: keys.answered(shard)?, reply })
    }

    /// [`Engine::commit`] for synchronous callers.
    pub fn commit_blocking(&self, tenant: &Tenant, request: CommitRequest) -> Result<u64, Error> {
        Ok(expect_commit(self.start_commit(tenant, request)?.wait_blocking()?))
    }

    /// [`Engine::release`] for synchronous callers.
    pub fn release_blocking(&self, tenant: &Tenant, request: KeyRequest) -> Result<(), Error> {
        self.start_release(tenant, &request)?.wait_blocking().map(expect_release)
    }

    /// [`Engine::heartbeat`] for synchronous callers.
    pub fn heartbeat_blocking(&self, tenant: &Tenant, request: KeyRequest) -> Result<Renewed, Error> {
        self.start_heartbeat(tenant, &request)?.wait_blocking().map(expect_heartbeat)
    }

    /// [`Engine::get`] for synchronous callers.
    pub fn get_blocking(&self, tenant: &Tenant, request: KeyRequest) -> Result<View, Error> {
        self.start_get(tenant, &request)?.wait_blocking().map(expect_get)
    }

    /// Each shard's state, cheaply (no message to the shard): for health checks.
    pub fn shard_states(&self) -> Vec<ShardState> {
        self.inner.table().shards.iter().map(|s| s.shared.state()).collect()
    }

    /// Waits until a shard reaches `state` or `timeout` passes; returns whether it did.
    /// Operators and tests use it to wait for recovery without polling.
    pub fn wait_shard_state(&self, shard: u32, state: ShardState, timeout: std::time::Duration) -> bool {
        match self.inner.handle(shard) {
            Some(handle) => handle.shared.wait_until(timeout, |shared| shared.state() == state),
            None => false,
        }
    }

    /// Each shard's counters.
    pub fn stats(&self) -> Vec<ShardStats> {
        let table = self.inner.table();
        let slots = table.map.slots_per_shard(table.shards.len() as u32);
        table.shards.iter().enumerate().map(|(id, s)| s.stats(id as u32, slots[id])).collect()
    }

    /// The slot moving now, if an add-shards is under way.
    pub fn slot_moving(&self) -> Option<slots::SlotMove> {
        self.inner.table().moving.as_ref().map(|moving| moving.step)
    }

    /// Waits until one shard's counters satisfy `done` (checked whenever the shard
    /// publishes them) or `timeout` passes; returns whether they did. Tests and operators
    /// use it to wait for an effect without polling or sleeping.
    pub fn wait_stats(
        &self,
        shard: u32,
        timeout: std::time::Duration,
        done: impl Fn(&ShardStats) -> bool,
    ) -> bool {
        let Some(handle) = self.inner.handle(shard) else { return false };
        // The slot count is read once: the predicate runs under the shard's counters'
        // lock, where taking the routing table's would order the two locks both ways.
        let slots = {
            let table = self.inner.table();
            table.map.slots_per_shard(table.shards.len() as u32)[shard as usize]
        };
        handle.shared.wait_until(timeout, |_| done(&handle.stats(shard, slots)))
    }

    /// Makes every shard run its alarm now and waits until all have: reclaim, lease
    /// expiry for waiters, waiter deadlines. Shards do this on their own at each
    /// deadline; tests that move a `ManualClock` call it instead of sleeping.
    pub fn run_alarms(&self) {
        let shards = self.inner.handles();
        let (done_tx, done_rx) = crossbeam_channel::bounded(shards.len());
        let mut asked = 0;
        for shard in &shards {
            if shard.control.send(Control::RunAlarms(done_tx.clone())).is_ok() {
                asked += 1;
            }
        }
        for _ in 0..asked {
            if done_rx.recv().is_err() {
                break;
            }
        }
    }

    /// Asks one shard to close and reopen its file now; returns whether it serves again.
    /// Refused (`unavailable`, saying a restart is required) for a shard halted by a
    /// failed sync: only a new process may open its file again.
    pub fn reopen_shard(&self, shard: u32) -> Result<bool, Error> {
        let Some(handle) = self.inner.handle(shard) else { return Ok(false) };
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        if handle.control.send(Control::Reopen(done_tx)).is_err() {
            return Ok(false);
        }
        done_rx.recv().unwrap_or(Ok(false))
    }

    /// Stops accepting calls, lets every shard finish what it accepted (commit, answer
    /// waiters `in progress`), closes the files and waits for the threads. Idempotent;
    /// dropping the last clone does the same.
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }
}

impl ShardHandle {
    fn stats(&self, shard: u32, slots: u32) -> ShardStats {
        let shared = &self.shared;
        let batches = shared.batches.load(Ordering::Relaxed);
        let commands = shared.commands.load(Ordering::Relaxed);
        ShardStats {
            shard,
            slots,
            state: shared.state(),
            mailbox_depth: self.data.len(),
            batches,
            commands,
            batch_len_mean: if batches == 0 { 0.0 } else { commands as f64 / batches as f64 },
            commits: shared.commits.load(Ordering::Relaxed),
            failures: shared.failures.load(Ordering::Relaxed),
            reclaimed: shared.reclaimed.load(Ordering::Relaxed),
            alarms: shared.alarms.load(Ordering::Relaxed),
            checkpoints: shared.checkpoints.load(Ordering::Relaxed),
            waiters: shared.waiters.load(Ordering::Relaxed),
            records_pending: shared.records_pending.load(Ordering::Relaxed),
            records_completed: shared.records_completed.load(Ordering::Relaxed),
            last_error: shared.last_error.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
    }
}

/// Runs a shard on its own thread. A panic (a bug) is caught at the thread's edge and
/// reported: the shard's state becomes `Panicked` (health and readiness fail), the reason
/// is logged and kept as its last error, and its callers hear `unavailable` because its
/// mailbox is gone. It never looks healthy while dead.
fn spawn_shard(
    shard: Shard,
    id: u32,
    shared: Arc<Shared>,
    started: shard::Started,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(format!("oncegate-shard-{id:04}")).spawn(move || {
        let mut started = Some(started);
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| shard.run(&mut started)));
        // A panic before the first send still reports the open attempt as over.
        if let Err(payload) = ran {
            let reason = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned());
            tracing::error!(
                shard = id,
                reason,
                "shard thread panicked; the shard answers unavailable until the process restarts"
            );
            shared.set_last_error(format!("the shard's thread panicked: {reason}"));
            shared.waiters.store(0, Ordering::Relaxed);
            shared.set_state(ShardState::Panicked);
            if let Some(started) = started.take() {
                let _ = started.send((id, None));
            }
        }
    })
}

impl Inner {
    fn table(&self) -> RwLockReadGuard<'_, routes::Table> {
        self.table.read().unwrap_or_else(|p| p.into_inner())
    }

    fn table_mut(&self) -> RwLockWriteGuard<'_, routes::Table> {
        self.table.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The shards, taken out of the table so that waiting on one holds no lock.
    /// Takes the lock an add-shards and a backup hold while they run, so that the slot
    /// map changes under neither; `busy` says why it is refused while the other holds it.
    /// A poisoned lock only says an earlier holder panicked; the table says where it was.
    fn map_unchanged(&self, busy: &'static str) -> Result<std::sync::MutexGuard<'_, ()>, OpenError> {
        match self.growing.try_lock() {
            Ok(guard) => Ok(guard),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => Ok(poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => Err(OpenError::Busy { what: busy }),
        }
    }

    fn handles(&self) -> Vec<Arc<ShardHandle>> {
        self.table().shards.clone()
    }

    fn handle(&self, shard: u32) -> Option<Arc<ShardHandle>> {
        self.table().shards.get(shard as usize).cloned()
    }

    fn common(&self) -> Common {
        Common {
            config: Arc::clone(&self.config),
            clock: Arc::clone(&self.clock),
            start: self.start,
            floor: Arc::clone(&self.floor),
            marks: Arc::clone(&self.marks),
            faults: self.faults.clone(),
            quotas: self.quotas.clone(),
            files: Arc::clone(&self.files),
            slots: Arc::clone(&self.live),
            postgres: self.postgres.clone(),
        }
    }

    /// Starts shards `ids` and returns once each has made its first open attempt, so
    /// states read right after are meaningful. A shard whose file failed to open is not
    /// fatal: it answers `unavailable` and keeps retrying while the others serve. A full
    /// disk is: retrying would only fail the same way, shard after shard, so the shards
    /// are stopped and the error names the file that could not be written.
    fn start_shards(&self, ids: std::ops::Range<u32>) -> Result<Vec<Arc<ShardHandle>>, OpenError> {
        let (started_tx, started_rx) = crossbeam_channel::bounded(ids.len());
        let mut handles = Vec::with_capacity(ids.len());
        for id in ids.clone() {
            // Counted before it starts: its first open takes it off again.
            self.floor.unopened.fetch_add(1, Ordering::SeqCst);
            match start_shard(id, self.common(), started_tx.clone()) {
                Ok(handle) => handles.push(Arc::new(handle)),
                Err(error) => {
                    self.floor.unopened.fetch_sub(1, Ordering::SeqCst);
                    // The shards already started must not wait for marks that never come.
                    self.marks.abandon();
                    return Err(error);
                }
            }
        }
        drop(started_tx);
        let mut disk_full = None;
        for _ in 0..handles.len() {
            match started_rx.recv() {
                Ok((shard, Some(path))) => disk_full = disk_full.or(Some((shard, path))),
                Ok((_, None)) => {}
                Err(_) => break,
            }
        }
        // A full disk at start fails the open with the file it could not write: serving
        // on would only retry the same open, shard after shard.
        if let Some((shard, path)) = disk_full {
            for handle in &handles {
                let _ = handle.control.send(Control::Shutdown);
            }
            for handle in &handles {
                if let Some(thread) = handle.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    let _ = thread.join();
                }
            }
            return Err(OpenError::DiskFull { shard, path });
        }
        for (id, shard) in ids.zip(&handles) {
            if shard.shared.state() != ShardState::Serving {
                tracing::warn!(shard = id, "shard failed to open; it answers unavailable and keeps retrying");
            }
        }
        Ok(handles)
    }

    fn shutdown(&self) {
        // Under the table's write lock no call is between its `closing` check and its
        // mailbox, so every call accepted is queued before its shard hears the stop, and
        // `finish` serves the mailbox to its end. The shards are told before calls are
        // refused: a refusal then means every shard has heard. A shard never takes this
        // lock, so a full control channel waits only for its shard's current batch.
        let shards = {
            let table = self.table_mut();
            for shard in &table.shards {
                let _ = shard.control.send(Control::Shutdown);
            }
            self.closing.store(true, Ordering::Release);
            table.shards.clone()
        };
        for shard in &shards {
            let thread = shard.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(thread) = thread
                && thread.join().is_err()
            {
                tracing::error!("a shard thread panicked");
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown();
    }
}
