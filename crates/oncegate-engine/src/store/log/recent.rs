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

use super::split;

/// The most bytes of frames kept (per shard): at 64 calls in flight about seventy
/// batches, a second or more of a busy shard's writes.
pub(super) const RECENT_FRAMES_BYTES_MAX: usize = 1 << 20;

/// Committed frames by where they start (segment, offset), oldest first. Keyed by the
/// pair rather than the packed position, whose sign turns at segment 2^31.
#[derive(Default)]
pub(super) struct Recent {
    frames: BTreeMap<(u32, u64), Vec<u8>>,
    /// The frames' buffers, counted by capacity (what they hold in memory).
    bytes: usize,
}

impl Recent {
    /// Keeps a frame just committed, dropping the oldest while the total passes
    /// [`RECENT_FRAMES_BYTES_MAX`] (the newest frame is always kept).
    pub fn add(&mut self, seq: u32, start: u64, bytes: Vec<u8>) {
        self.bytes += bytes.capacity();
        if let Some(replaced) = self.frames.insert((seq, start), bytes) {
            // A committed position is never written again; kept correct all the same.
            self.bytes -= replaced.capacity();
        }
        while self.bytes > RECENT_FRAMES_BYTES_MAX && self.frames.len() > 1 {
            let (_, oldest) = self.frames.pop_first().expect("more than one frame");
            self.bytes -= oldest.capacity();
        }
    }

    /// The bytes from `at` to the end of the frame that holds it, if one kept does.
    pub fn from(&self, at: i64) -> Option<&[u8]> {
        let (seq, offset) = split(at);
        let (&(frame_seq, start), bytes) = self.frames.range(..=(seq, offset)).next_back()?;
        (frame_seq == seq && offset < start + bytes.len() as u64).then(|| &bytes[(offset - start) as usize..])
    }

    /// Forgets a retired segment's frames: a position there names nothing any more.
    pub fn forget(&mut self, seq: u32) {
        let gone: Vec<(u32, u64)> =
            self.frames.range((seq, 0)..=(seq, u64::MAX)).map(|(at, _)| *at).collect();
        for at in gone {
            if let Some(bytes) = self.frames.remove(&at) {
                self.bytes -= bytes.capacity();
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
    use super::super::position;
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

    #[test]
    fn segments_past_2_to_the_31_are_kept_and_forgotten_too() {
        let mut recent = Recent::default();
        for seq in [0x7fff_fffe, 0x7fff_ffff, 0x8000_0000, u32::MAX] {
            recent.add(seq, 8, vec![seq as u8; 4]);
        }
        for seq in [0x7fff_ffff, u32::MAX] {
            assert_eq!(recent.from(position(seq, 9)).map(|b| b.len()), Some(3));
            recent.forget(seq);
            assert_eq!(recent.from(position(seq, 9)), None);
        }
        assert_eq!(recent.from(position(0x8000_0000, 8)).map(|b| b[0]), Some(0));
        assert_eq!(recent.bytes(), 8);
    }
}
