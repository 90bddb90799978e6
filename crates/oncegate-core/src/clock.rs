//! The shard's notion of `now`, which never goes backwards.

/// Turns wall-clock readings into a `now` that never decreases.
///
/// The guard keeps a high-water mark; the engine persists it with every batch and
/// restores it on open. A clock stepped back therefore cannot lengthen a lease or bring
/// an expired record back, before or after a restart. A clock stepped forward moves the
/// mark forward for good, which may end leases early; that is the safe direction, since
/// an early end only lets a retry proceed after the holder lost its lease (the holder's
/// late commit is then fenced off by its token).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClockGuard {
    high_water_ms: u64,
}

impl ClockGuard {
    /// Starts from a persisted high-water mark (0 for a new store).
    pub const fn new(high_water_ms: u64) -> ClockGuard {
        ClockGuard { high_water_ms }
    }

    /// Feeds one wall-clock reading and returns the guarded `now`.
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
}
