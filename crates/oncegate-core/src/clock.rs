//! The shard's notion of `now`: it never goes backwards, and while a shard runs it
//! moves only as fast as real (monotonic) time, whatever the wall clock does.

/// Turns clock readings into a `now` that never decreases and never jumps.
///
/// Two ways to use it:
///
/// - **Anchored** (what shards do): [`ClockGuard::anchor`] once when the store opens,
///   with a wall-clock and a monotonic reading; then [`ClockGuard::read`] with monotonic
///   readings only. `now` is `max(high-water mark, wall at open)` plus the monotonic time
///   elapsed since. A wall clock stepped forward or back while the shard runs changes
///   nothing: no lease ends early, none is lengthened, no record comes back. The frame
///   re-anchors to the wall clock at the next open, where the persisted high-water mark
///   keeps `now` from going backwards and the restart grace keeps live leases alive.
/// - **Unanchored**: [`ClockGuard::observe`] with wall-clock readings, lifted to the
///   high-water mark when they step back.
///
/// The engine persists [`ClockGuard::high_water_ms`] with every batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClockGuard {
    high_water_ms: u64,
    /// `(now at the anchor, monotonic reading at the anchor)`.
    frame: Option<(u64, u64)>,
}

impl ClockGuard {
    /// Starts from a persisted high-water mark (0 for a new store).
    pub const fn new(high_water_ms: u64) -> ClockGuard {
        ClockGuard { high_water_ms, frame: None }
    }

    /// Fixes the frame: from now on `now` is the anchor plus monotonic time elapsed.
    /// Returns `now` at the anchor.
    pub fn anchor(&mut self, wall_ms: u64, monotonic_ms: u64) -> u64 {
        self.high_water_ms = self.high_water_ms.max(wall_ms);
        self.frame = Some((self.high_water_ms, monotonic_ms));
        self.high_water_ms
    }

    /// Whether [`ClockGuard::anchor`] has fixed the frame.
    pub const fn is_anchored(&self) -> bool {
        self.frame.is_some()
    }

    /// Raises the high-water mark (a reopened store's persisted mark) without touching
    /// the frame: an in-process reopen keeps the process's one time frame.
    pub fn raise(&mut self, high_water_ms: u64) {
        self.high_water_ms = self.high_water_ms.max(high_water_ms);
    }

    /// `now` from a monotonic reading, in an anchored frame. Without an anchor, the
    /// high-water mark.
    pub fn read(&mut self, monotonic_ms: u64) -> u64 {
        if let Some((base, base_monotonic)) = self.frame {
            let now = base.saturating_add(monotonic_ms.saturating_sub(base_monotonic));
            self.high_water_ms = self.high_water_ms.max(now);
        }
        self.high_water_ms
    }

    /// Feeds one wall-clock reading (unanchored use) and returns the guarded `now`.
    pub fn observe(&mut self, wall_ms: u64) -> u64 {
        self.high_water_ms = self.high_water_ms.max(wall_ms);
        self.high_water_ms
    }

    /// The greatest `now` ever returned (the value to persist).
    pub const fn high_water_ms(&self) -> u64 {
        self.high_water_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_goes_backwards_and_restores_from_the_mark() {
        let mut guard = ClockGuard::new(1_000);
        assert_eq!(guard.observe(500), 1_000, "a reading behind the restored mark is lifted");
        assert_eq!(guard.observe(2_000), 2_000);
        assert_eq!(guard.observe(1_999), 2_000, "a step back is ignored");
        assert_eq!(guard.high_water_ms(), 2_000);
        let mut reopened = ClockGuard::new(guard.high_water_ms());
        assert_eq!(reopened.observe(0), 2_000);
    }

    #[test]
    fn anchored_time_follows_the_monotonic_clock_only() {
        let mut guard = ClockGuard::new(0);
        assert_eq!(guard.anchor(10_000, 5), 10_000);
        assert_eq!(guard.read(1_005), 11_000, "one second of monotonic time");
        assert_eq!(guard.read(1_005), 11_000);
        assert_eq!(guard.read(2_005), 12_000);
        let mut restarted = ClockGuard::new(guard.high_water_ms());
        assert_eq!(
            restarted.anchor(9_000, 77),
            12_000,
            "a wall clock behind the mark is lifted at the anchor"
        );
        assert_eq!(restarted.read(1_077), 13_000);
        let mut forward = ClockGuard::new(13_000);
        assert_eq!(
            forward.anchor(3_613_000, 0),
            3_613_000,
            "a forward step is taken at the anchor (downtime)"
        );
    }

    #[test]
    fn raising_the_mark_keeps_the_frame() {
        let mut guard = ClockGuard::new(0);
        guard.anchor(10_000, 0);
        guard.raise(3_610_000);
        assert!(guard.is_anchored());
        assert_eq!(guard.read(2_000), 3_610_000, "time holds at the raised mark");
        guard.raise(5);
        assert_eq!(guard.read(3_600_001), 3_610_001, "then moves with the monotonic clock");
    }

    #[test]
    fn unanchored_read_returns_the_mark() {
        let mut guard = ClockGuard::new(42);
        assert_eq!(guard.read(1_000_000), 42);
    }
}
