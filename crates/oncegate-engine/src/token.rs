//! The fencing-token format: a token epoch in the high bits, a counter in the low bits.
//!
//! A shard's token counter lives in its SQLite file, so a file restored from an older
//! copy brings an older counter back. The epoch lives outside that file
//! (`shard-NNNN.epoch`, written atomically and fsynced) and is raised at every open of the
//! shard, before it grants anything. Every token of an open is at least
//! `epoch << COUNTER_BITS`, so it is greater than every token any earlier open issued,
//! whatever copy of the shard file is opened. docs/storage.md describes the format.

/// Bits of a token below its epoch.
pub const COUNTER_BITS: u32 = 40;

const COUNTER_MASK: u64 = (1 << COUNTER_BITS) - 1;

/// The last usable epoch: tokens are stored as SQLite's signed 64-bit integers, so every
/// token stays at or below `i64::MAX`. A shard that would need a later epoch (about
/// eight million opens) refuses to open rather than hand out a smaller token.
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

/// The epoch to use when a shard opens: one past the greater of the persisted epoch and
/// the epoch of the shard file's own counter (so a lost epoch file still never goes
/// backwards against the file), or 0 for a new file with no epoch file (nothing was ever
/// issued there).
pub fn epoch_at_open(stored: Option<u64>, next_token: u64, new_file: bool) -> u64 {
    match stored {
        None if new_file => 0,
        stored => stored.unwrap_or(0).max(epoch_of(next_token)) + 1,
    }
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
        assert_eq!(epoch_at_open(None, 1, true), 0, "a new directory starts at token 1");
        assert_eq!(epoch_at_open(Some(0), 5, false), 1);
        assert_eq!(epoch_at_open(Some(7), first_of(3) + 9, false), 8, "the epoch file wins");
        assert_eq!(epoch_at_open(None, first_of(3) + 9, false), 4, "a lost epoch file: the counter's epoch");
        assert_eq!(epoch_at_open(Some(2), first_of(5), true), 6, "a restored file newer than the epoch file");
    }

    #[test]
    fn room_runs_out_near_the_end_of_an_epoch() {
        assert!(!needs_new_epoch(first_of(1), 1_000));
        assert!(needs_new_epoch(first_of(1) + COUNTER_MASK - 10, 1_000));
    }
}
