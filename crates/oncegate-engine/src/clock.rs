//! Time, injected: the engine reads wall-clock milliseconds only through [`Clock`].

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Wall-clock and monotonic time in milliseconds.
///
/// Shards read the wall clock only when they open (to anchor their frame) and measure
/// everything after with the monotonic clock, through a `ClockGuard` whose high-water
/// mark is persisted; see `oncegate_core::ClockGuard`.
pub trait Clock: Send + Sync + 'static {
    /// The current wall-clock time, in milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;

    /// A monotonic reading in milliseconds from an arbitrary origin: never steps, and
    /// advances with real time.
    fn monotonic_ms(&self) -> u64;
}

/// The operating system's clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        // A clock before 1970 reads as 0; the guard then holds the last good value.
        SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
    }

    fn monotonic_ms(&self) -> u64 {
        static ORIGIN: OnceLock<Instant> = OnceLock::new();
        ORIGIN.get_or_init(Instant::now).elapsed().as_millis() as u64
    }
}

/// A clock that reads 0 and never moves, for work that is not the service's time: a
/// shard's clock guard never lifts its frame above its persisted marks on it, so no lease
/// ends and nothing expires while such work runs (the offline reshard's).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct StoppedClock;

impl Clock for StoppedClock {
    fn now_ms(&self) -> u64 {
        0
    }

    fn monotonic_ms(&self) -> u64 {
        0
    }
}

/// A clock that moves only when told to, for tests of expiry, leases and clock jumps.
///
/// Clones share the same time. [`ManualClock::advance`] is time passing (both readings
/// move); [`ManualClock::step`] is the wall clock being stepped (only the wall reading
/// moves). Moving it does not wake shards by itself: tests call `Engine::run_alarms`
/// after moving it, which is what makes them free of sleeps.
#[derive(Clone, Debug)]
pub struct ManualClock {
    wall_ms: Arc<AtomicU64>,
    monotonic_ms: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock whose wall reading is `now_ms`.
    pub fn new(now_ms: u64) -> ManualClock {
        ManualClock { wall_ms: Arc::new(AtomicU64::new(now_ms)), monotonic_ms: Arc::new(AtomicU64::new(0)) }
    }

    /// Lets `ms` of time pass.
    pub fn advance(&self, ms: u64) {
        self.wall_ms.fetch_add(ms, Ordering::SeqCst);
        self.monotonic_ms.fetch_add(ms, Ordering::SeqCst);
    }

    /// Steps the wall clock by `delta_ms` (negative: back) without time passing, as an
    /// operator or NTP would.
    pub fn step(&self, delta_ms: i64) {
        let wall = self.wall_ms.load(Ordering::SeqCst);
        self.wall_ms.store(wall.saturating_add_signed(delta_ms), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.wall_ms.load(Ordering::SeqCst)
    }

    fn monotonic_ms(&self) -> u64 {
        self.monotonic_ms.load(Ordering::SeqCst)
    }
}
