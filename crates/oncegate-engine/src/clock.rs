//! Time, injected: the engine reads wall-clock milliseconds only through [`Clock`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in milliseconds since the Unix epoch.
///
/// Shards never trust it to be monotonic: each passes readings through a
/// `ClockGuard` whose high-water mark is persisted.
pub trait Clock: Send + Sync + 'static {
    /// The current wall-clock time, in milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
}

/// The operating system's clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        // A clock before 1970 reads as 0; the guard then holds the last good value.
        SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
    }
}

/// A clock that moves only when told to, for tests of expiry, leases and clock jumps.
///
/// Clones share the same time. Moving it does not wake shards by itself: tests call
/// `Engine::run_alarms` after moving it, which is what makes them free of sleeps.
#[derive(Clone, Debug)]
pub struct ManualClock {
    now_ms: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock reading `now_ms`.
    pub fn new(now_ms: u64) -> ManualClock {
        ManualClock { now_ms: Arc::new(AtomicU64::new(now_ms)) }
    }

    /// Moves the clock forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.now_ms.fetch_add(ms, Ordering::SeqCst);
    }

    /// Sets the clock to any value, including one in the past (a clock step back).
    pub fn set(&self, now_ms: u64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}
