//! The last committed frames, kept in memory so that a commit reads the record its
//! reserve wrote without a `pread`.
//!
//! A client's commit follows its reserve by a few batches, not by one: under a pipelined
//! load the reserve's answer, the client's work and the commit's trip take several of the
//! shard's syncs. Keeping only the last transaction's frames sent most commits to the
//! file (a `pread` each, 4–5% of the shard's CPU under the Session stream). The frames
//! here are committed, so their bytes are the file's: they are never changed in place,
//! and a position names the same bytes until its segment is retired.

use std::collections::BTreeMap;

use super::{position, split};

/// The most bytes of frames kept (per shard): at 64 calls in flight about seventy
/// batches, a second or more of a busy shard's writes.
pub(super) const RECENT_FRAMES_BYTES_MAX: usize = 1 << 20;

/// Committed frames by the position they start at, oldest first.
#[derive(Default)]
pub(super) struct Recent {
    frames: BTreeMap<i64, Vec<u8>>,
    bytes: usize,
}

impl Recent {
    /// Keeps a frame just committed, dropping the oldest while the total passes
    /// [`RECENT_FRAMES_BYTES_MAX`] (the newest frame is always kept).
    pub fn add(&mut self, seq: u32, start: u64, bytes: Vec<u8>) {
        self.bytes += bytes.len();
        if let Some(replaced) = self.frames.insert(position(seq, start), bytes) {
            // A committed position is never written again; kept correct all the same.
            self.bytes -= replaced.len();
        }
        while self.bytes > RECENT_FRAMES_BYTES_MAX && self.frames.len() > 1 {
            let (_, oldest) = self.frames.pop_first().expect("more than one frame");
            self.bytes -= oldest.len();
        }
    }

    /// The bytes from `at` to the end of the frame that holds it, if one kept does.
    pub fn from(&self, at: i64) -> Option<&[u8]> {
        let (seq, offset) = split(at);
        let (&starts, bytes) = self.frames.range(..=at).next_back()?;
        let (frame_seq, start) = split(starts);
        (frame_seq == seq && offset < start + bytes.len() as u64).then(|| &bytes[(offset - start) as usize..])
    }

    /// Forgets a retired segment's frames: a position there names nothing any more.
    pub fn forget(&mut self, seq: u32) {
        let first = position(seq, 0);
        let next = position(seq.saturating_add(1), 0);
        let gone: Vec<i64> = self.frames.range(first..next).map(|(at, _)| *at).collect();
        for at in gone {
            if let Some(bytes) = self.frames.remove(&at) {
                self.bytes -= bytes.len();
            }
        }
    }

    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_inside_a_kept_frame_reads_from_there_and_nothing_else_does() {
        let mut recent = Recent::default();
        recent.add(3, 100, vec![1, 2, 3, 4]);
        recent.add(3, 104, vec![5, 6]);
        assert_eq!(recent.from(position(3, 100)), Some(&[1, 2, 3, 4][..]));
        assert_eq!(recent.from(position(3, 102)), Some(&[3, 4][..]));
        assert_eq!(recent.from(position(3, 105)), Some(&[6][..]));
        assert_eq!(recent.from(position(3, 106)), None, "past the last frame");
        assert_eq!(recent.from(position(3, 99)), None, "before the first frame");
        assert_eq!(recent.from(position(4, 0)), None, "another segment");
        assert_eq!(recent.from(position(2, 100)), None, "an earlier segment");
    }

    #[test]
    fn the_oldest_frames_go_first_and_the_newest_always_stays() {
        let mut recent = Recent::default();
        let frame = RECENT_FRAMES_BYTES_MAX / 4;
        for i in 0..8u64 {
            recent.add(1, i * frame as u64, vec![i as u8; frame]);
            assert!(recent.bytes() <= RECENT_FRAMES_BYTES_MAX);
        }
        assert_eq!(recent.from(position(1, 3 * frame as u64)), None, "dropped");
        assert_eq!(recent.from(position(1, 4 * frame as u64)).map(|b| b[0]), Some(4));
        assert_eq!(recent.from(position(1, 7 * frame as u64)).map(|b| b[0]), Some(7));
        recent.add(2, 0, vec![9; RECENT_FRAMES_BYTES_MAX * 2]);
        assert_eq!(
            recent.from(position(2, 5)).map(|b| b[0]),
            Some(9),
            "a frame over the limit is kept alone"
        );
        assert_eq!(recent.from(position(1, 7 * frame as u64)), None);
    }

    #[test]
    fn a_retired_segment_s_frames_are_forgotten() {
        let mut recent = Recent::default();
        recent.add(1, 0, vec![1; 10]);
        recent.add(2, 0, vec![2; 10]);
        recent.forget(1);
        assert_eq!(recent.from(position(1, 0)), None);
        assert_eq!(recent.from(position(2, 0)).map(|b| b[0]), Some(2));
        assert_eq!(recent.bytes(), 10);
    }
}
