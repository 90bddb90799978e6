//! The fencing-token format: a token epoch in the high bits, a counter in the low bits.
//!
//! A shard's token counter lives in its SQLite file, so a file restored from an older
//! copy brings an older counter back. The epoch lives outside that file
//! (`shard-NNNN.epoch`, written atomically and fsynced) and is raised at every open of the
//! shard, before it grants anything. Every token of an open is at least
//! `epoch << COUNTER_BITS`, so it is greater than every token any earlier open issued,
//! whatever copy of the shard file is opened.
//!
//! An epoch is also never below the wall clock's [`floor`]: milliseconds since
//! [`FLOOR_ORIGIN_MS`]. An epoch runs ahead of the floor only when the shard opened (or
//! ran out of tokens) more than once within a millisecond, and then by that many
//! milliseconds; an open reads its whole file and fsyncs its epoch file, which takes
//! longer. So a copy of the directory (a backup) started later opens above every epoch
//! the original used after the copy was taken, however often it restarted.
//! docs/storage.md describes the format.

/// Bits of a token below its epoch: 4,194,304 tokens per epoch, after which the shard
/// moves to the next (`needs_new_epoch`).
pub const COUNTER_BITS: u32 = 22;

/// The instant the clock floor counts from: 2025-01-01T00:00:00Z, in ms since the Unix
/// epoch. Epochs of directories made before the floor (small numbers) stay below it.
pub const FLOOR_ORIGIN_MS: u64 = 1_735_689_600_000;

/// The lowest epoch an open at wall time `wall_ms` may use: the milliseconds since
/// [`FLOOR_ORIGIN_MS`] (0 before it).
pub(crate) const fn floor(wall_ms: u64) -> u64 {
    wall_ms.saturating_sub(FLOOR_ORIGIN_MS)
}

const COUNTER_MASK: u64 = (1 << COUNTER_BITS) - 1;

/// The last usable epoch: tokens are stored as SQLite's signed 64-bit integers, so every
/// token stays at or below `i64::MAX`. The clock floor reaches it in 2094; a shard that
/// would need a later epoch refuses to open rather than hand out a smaller token.
pub const EPOCH_MAX: u64 = (i64::MAX as u64) >> COUNTER_BITS;

/// The epoch a token was issued in.
pub const fn epoch_of(token: u64) -> u64 {
    token >> COUNTER_BITS
}

/// The smallest token of an epoch. Epoch 0 (a new shard file that never issued a token)
/// starts at 1: token 0 is never valid.
pub const fn first_of(epoch: u64) -> u64 {
    if epoch == 0 { 1 } else { epoch << COUNTER_BITS }
}

/// The epoch to use when a shard opens at clock floor `floor`: one past the greater of
/// the persisted epoch and the epoch of the shard file's own counter (so a lost epoch
/// file still never goes backwards against the file), or, for a new file with no epoch
/// file (nothing was ever issued there), 0; and never below `floor`.
pub fn epoch_at_open(stored: Option<u64>, next_token: u64, new_file: bool, floor: u64) -> u64 {
    let past = match stored {
        None if new_file => 0,
        stored => stored.unwrap_or(0).max(epoch_of(next_token)) + 1,
    };
    past.max(floor)
}

/// The epoch a shard moves to when its counter runs out: the next, never below `floor`.
pub(crate) fn next_epoch(epoch: u64, floor: u64) -> u64 {
    (epoch + 1).max(floor)
}

/// Whether `next_token` has less than `room` tokens left in its epoch, so the shard
/// must move to a new epoch before it grants again.
pub const fn needs_new_epoch(next_token: u64, room: u64) -> bool {
    COUNTER_MASK - (next_token & COUNTER_MASK) < room
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_token_of_a_later_epoch_is_greater() {
        let last_of_epoch_1 = first_of(1) + COUNTER_MASK;
        assert_eq!(epoch_of(last_of_epoch_1), 1);
        assert!(first_of(2) > last_of_epoch_1);
        assert_eq!(first_of(0), 1);
    }

    #[test]
    fn the_open_epoch_never_goes_back() {
        assert_eq!(epoch_at_open(None, 1, true, 0), 0, "a new directory before the floor starts at token 1");
        assert_eq!(epoch_at_open(Some(0), 5, false, 0), 1);
        assert_eq!(epoch_at_open(Some(7), first_of(3) + 9, false, 0), 8, "the epoch file wins");
        assert_eq!(
            epoch_at_open(None, first_of(3) + 9, false, 0),
            4,
            "a lost epoch file: the counter's epoch"
        );
        assert_eq!(
            epoch_at_open(Some(2), first_of(5), true, 0),
            6,
            "a restored file newer than the epoch file"
        );
    }

    #[test]
    fn the_open_epoch_is_never_below_the_clock_floor() {
        let now = floor(FLOOR_ORIGIN_MS + 86_400_000);
        assert_eq!(now, 86_400_000);
        assert_eq!(epoch_at_open(None, 1, true, now), now, "a new directory starts at the floor");
        assert_eq!(epoch_at_open(Some(9), first_of(9) + 5, false, now), now, "an old copy restored");
        assert_eq!(epoch_at_open(Some(now + 3), 1, false, now), now + 4, "ahead of the floor: one past");
        assert_eq!(floor(FLOOR_ORIGIN_MS - 1), 0, "a clock before the origin");
    }

    /// Directories made when the counter had 40 bits keep increasing: an open derives
    /// its epoch from the file's counter in the new split, and its first token is above
    /// every token of the old one.
    #[test]
    fn tokens_of_the_earlier_40_bit_counter_stay_below_the_next_open() {
        for old_epoch in [0u64, 1, 7, 4_096] {
            let last = (old_epoch << 40) | 123_456;
            let epoch = epoch_at_open(Some(old_epoch), last + 1, false, 0);
            assert!(first_of(epoch) > last, "epoch {old_epoch}");
        }
        assert!(EPOCH_MAX > floor(FLOOR_ORIGIN_MS + 69 * 365 * 86_400_000), "the floor fits until 2094");
    }

    #[test]
    fn room_runs_out_near_the_end_of_an_epoch() {
        assert!(!needs_new_epoch(first_of(1), 1_000));
        assert!(needs_new_epoch(first_of(1) + COUNTER_MASK - 10, 1_000));
    }
}
