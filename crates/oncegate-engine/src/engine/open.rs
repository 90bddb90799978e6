//! Opening a data directory (or a PostgreSQL node) and starting its shards.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

use oncegate_core::ClockGuard;

use super::error::OpenError;
use super::{Engine, Inner, ShardHandle, routes};
use crate::clock::{Clock, SystemClock};
use crate::config::{EngineConfig, StoreConfig};
use crate::faults::Faults;
use crate::files;
use crate::placement::{manifest, slots};
use crate::quota;
use crate::shard::{
    self, Arrival, Context, Control, FrameFloor, Marks, Parts, Shard, ShardState, Shared, Start,
};
use crate::store;

impl Engine {
    /// Opens (or creates) the data directory with the system clock.
    pub fn open(config: EngineConfig) -> Result<Engine, OpenError> {
        Engine::open_with(config, Arc::new(SystemClock), Faults::default())
    }

    /// [`Engine::open`] for async code: the directory is opened (its lock, every shard's
    /// file and index scan) on a thread of its own, not on the runtime's.
    pub async fn open_async(config: EngineConfig) -> Result<Engine, OpenError> {
        let dir = config.data_dir.clone();
        let (done, opened) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("oncegate-open".to_owned())
            .spawn(move || {
                let _ = done.send(Engine::open(config));
            })
            .map_err(|source| OpenError::Io { path: dir, source })?;
        opened
            .await
            .unwrap_or(Err(OpenError::Unsupported { what: "the opening thread ended without an answer" }))
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
        let lock = manifest::lock(&*files, &config.data_dir)?;
        Engine::open_locked(config, clock, faults, files, lock)
    }

    /// [`Engine::open_on`] with the directory's lock already held (an offline reshard
    /// checks the directory under it first, so nothing changes between the two).
    pub(crate) fn open_locked(
        config: EngineConfig,
        clock: Arc<dyn Clock>,
        faults: Faults,
        files: Arc<dyn files::Files>,
        lock: files::LockGuard,
    ) -> Result<Engine, OpenError> {
        config.check().map_err(OpenError::Config)?;
        manifest::check_store_kind(&*files, &config)?;
        let Placement { map, shards, routing, postgres } = place(&config, &*files, &clock)?;
        // The one wall-clock reading of the process: every shard's frame, and the frame of
        // derived keys, is anchored to it; nothing re-anchors until the next process.
        let start = Start { wall_ms: clock.now_ms(), monotonic_ms: clock.monotonic_ms() };
        let floor = FrameFloor::default();
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
        let cx = Context {
            slots: slots::LiveMap::new(map.clone(), routing),
            config,
            clock,
            start,
            floor,
            marks,
            faults,
            quotas: quota::Quotas::default(),
            files,
            postgres,
        };
        let inner = Inner {
            cx: Arc::new(cx),
            table: RwLock::new(routes::Table { map, shards: Vec::new(), moving: None }),
            closing: AtomicBool::new(false),
            frame: Mutex::new(frame),
            growing: Mutex::new(()),
            _lock: lock,
        };
        let handles = inner.start_shards(0..shards)?;
        // The shards' one frame, which derived keys share.
        let base_ms = start.wall_ms.max(inner.cx.marks.highest_ms());
        inner.frame.lock().unwrap_or_else(|p| p.into_inner()).anchor(base_ms, start.monotonic_ms);
        inner.table_mut().shards = handles;
        Ok(Engine { inner: Arc::new(inner) })
    }
}

/// Where an engine's keys live: the slot map and shard count, the routing, and the
/// database when the records are in PostgreSQL.
struct Placement {
    map: slots::SlotMap,
    shards: u32,
    routing: oncegate_core::route::Routing,
    postgres: Option<store::SharedDb>,
}

/// Reads (or creates) a data directory's slot map, or, for PostgreSQL, computes one and
/// opens the pool: the records are in the database, and shards only spread this node's
/// work, so any count serves every key and the map is never stored.
#[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
fn place(
    config: &EngineConfig,
    files: &dyn files::Files,
    clock: &Arc<dyn Clock>,
) -> Result<Placement, OpenError> {
    let placement = match &config.store {
        StoreConfig::Sqlite(_) => {
            let (map, shards, routing) = manifest::open_or_create(files, &config.data_dir, config.shards)?;
            Placement { map, shards, routing, postgres: None }
        }
        #[cfg(not(feature = "postgres"))]
        StoreConfig::Postgres(_) => {
            return Err(OpenError::Unsupported {
                what: "the PostgreSQL store: this build was made without the `postgres` feature",
            });
        }
        #[cfg(feature = "postgres")]
        StoreConfig::Postgres(postgres) => {
            let node = manifest::node_name(files, &config.data_dir)?;
            let pg =
                store::postgres::Postgres::new(postgres, config.durability, node.clone(), Arc::clone(clock))
                    .map_err(OpenError::Postgres)?;
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

/// Makes one shard's channels and starts its thread.
fn start_shard(id: u32, cx: &Arc<Context>, started: shard::Started) -> Result<ShardHandle, OpenError> {
    let (data_tx, data) = crossbeam_channel::bounded(cx.config.mailbox_depth_max);
    // Bounded by what it carries: one message per move's end, whose held requests are
    // callers already waiting.
    let (moved_tx, moved) = crossbeam_channel::unbounded();
    // Control messages are rare (shutdown, alarms on demand, reopen); a few slots are
    // plenty and keep the channel bounded.
    let (control_tx, control) = crossbeam_channel::bounded(16);
    let (gone_tx, gone) = crossbeam_channel::bounded(1);
    let shared = Arc::new(Shared::default());
    let parts = Parts {
        id,
        cx: Arc::clone(cx),
        arrival: Arrival::new(Arc::clone(&cx.marks)),
        shared: Arc::clone(&shared),
        data,
        moved,
        control,
        gone,
    };
    let thread = spawn_shard(Shard::new(parts), id, Arc::clone(&shared), started)
        .map_err(|source| OpenError::Io { path: cx.config.data_dir.clone(), source })?;
    Ok(ShardHandle {
        data: data_tx,
        moved: moved_tx,
        control: control_tx,
        gone: gone_tx,
        shared,
        thread: Mutex::new(Some(thread)),
    })
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
    /// Starts shards `ids` and returns once each has made its first open attempt, so
    /// states read right after are meaningful. A shard whose file failed to open is not
    /// fatal: it answers `unavailable` and keeps retrying while the others serve. A full
    /// disk is: retrying would only fail the same way, shard after shard, so the shards
    /// are stopped and the error names the file that could not be written.
    pub(super) fn start_shards(&self, ids: std::ops::Range<u32>) -> Result<Vec<Arc<ShardHandle>>, OpenError> {
        let (started_tx, started_rx) = crossbeam_channel::bounded(ids.len());
        let mut handles = Vec::with_capacity(ids.len());
        for id in ids.clone() {
            // Counted before it starts: its first open takes it off again.
            self.cx.floor.unopened.fetch_add(1, Ordering::SeqCst);
            match start_shard(id, &self.cx, started_tx.clone()) {
                Ok(handle) => handles.push(Arc::new(handle)),
                Err(error) => {
                    self.cx.floor.unopened.fetch_sub(1, Ordering::SeqCst);
                    // The shards already started must not wait for marks that never come.
                    self.cx.marks.abandon();
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
}
