//! The bytes of the log store: entries (a record, or a tombstone naming the record it
//! ends) and the frames that carry them. Pure functions, tested on their own.
//!
//! A frame is a header and a payload of entries:
//!
//! ```text
//! payload_len u32 | flags u32 | seq u64 | prev u64 | salt u64 | next_token u64 | high_water_ms u64 | checksum u64 | payload
//! ```
//!
//! `seq` counts frames from the log's first; `prev` is the checksum of the frame before;
//! `salt` is drawn at each open, so that a frame written after a crash never has the
//! checksum of the one it replaced; `checksum` is xxh3 of the header's other fields and
//! the payload. A frame is accepted at recovery only if its checksum holds and it
//! continues the chain (`seq` one more, `prev` the last accepted frame's checksum), so
//! neither a torn write nor the stale frames of a recycled segment can pass for the log's
//! continuation. Every frame carries
//! the shard's counters after its transaction; the last accepted frame's are the
//! counters at open. `flags` bit 0 marks a transaction's last frame: a transaction whose
//! entries do not fit in the rest of a segment continues in a frame at the start of the
//! next one, and recovery applies a transaction only once its last frame is read.
//!
//! Integers are little-endian. An entry starts with its own length, so that a reader
//! positioned at an entry (from the in-memory index) can read it whole.

use oncegate_core::{Completion, Fingerprint, Outcome, Record, Scope};

use super::super::{Meta, StoreError, decode_history, encode_history, stored_scope};

/// Bytes of a frame's header.
pub(crate) const FRAME_HEADER_BYTES: usize = 56;
/// The flag of a transaction's last frame.
const LAST: u32 = 1;
/// The flag of a frame written with `durability = "full"`: every frame before it was
/// durable before it was written.
const ORDERED: u32 = 2;

const TAG_RECORD: u8 = 1;
const TAG_TOMBSTONE: u8 = 2;

/// Bytes of an entry before its variable parts: length (4), tag (1), hash (8).
const ENTRY_HEAD_BYTES: usize = 13;
/// A tombstone: the head and the position of the record it ends.
pub(crate) const TOMBSTONE_BYTES: usize = ENTRY_HEAD_BYTES + 8;
/// A record's fixed fields after the head: the scope's three lengths (2 + 2 + 4), token,
/// attempt, lease, expiry, ttl (8 + 4 + 8 + 8 + 8), fingerprint length (2), completion
/// flag (1), history length (4).
const RECORD_FIXED_BYTES: usize = ENTRY_HEAD_BYTES + 8 + 36 + 2 + 1 + 4;
/// A completion's fixed fields: outcome (1), completed at (8), response length (4).
const COMPLETION_FIXED_BYTES: usize = 13;

/// A frame's header fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    pub payload_len: u32,
    pub last: bool,
    pub ordered: bool,
    pub seq: u64,
    pub prev: u64,
    pub meta: Meta,
    pub checksum: u64,
}

/// A frame's flags.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Flags {
    /// The transaction's last frame.
    pub last: bool,
    /// Written with every frame before it durable.
    pub ordered: bool,
}

/// Fills in the header of a frame whose payload follows its first
/// [`FRAME_HEADER_BYTES`] in `frame`; returns the frame's checksum.
pub(crate) fn seal_frame(frame: &mut [u8], flags: Flags, seq: u64, prev: u64, meta: Meta, salt: u64) -> u64 {
    let payload_len = (frame.len() - FRAME_HEADER_BYTES) as u32;
    frame[0..4].copy_from_slice(&payload_len.to_le_bytes());
    let bits = if flags.last { LAST } else { 0 } | if flags.ordered { ORDERED } else { 0 };
    frame[4..8].copy_from_slice(&bits.to_le_bytes());
    frame[8..16].copy_from_slice(&seq.to_le_bytes());
    frame[16..24].copy_from_slice(&prev.to_le_bytes());
    frame[24..32].copy_from_slice(&salt.to_le_bytes());
    frame[32..40].copy_from_slice(&meta.next_token.to_le_bytes());
    frame[40..48].copy_from_slice(&meta.high_water_ms.to_le_bytes());
    let checksum = frame_checksum(frame);
    frame[48..56].copy_from_slice(&checksum.to_le_bytes());
    checksum
}

/// The checksum of a frame: its header without the checksum field, and its payload.
fn frame_checksum(frame: &[u8]) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    hasher.update(&frame[..48]);
    hasher.update(&frame[FRAME_HEADER_BYTES..]);
    hasher.digest()
}

/// Reads a frame's header from its first bytes; `None` when they cannot start a frame
/// (too short, or a payload that would run past `room`, the bytes left in the segment).
pub(crate) fn read_header(bytes: &[u8], room: usize) -> Option<FrameHeader> {
    let head = bytes.get(..FRAME_HEADER_BYTES)?;
    let u64_at = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes"));
    let payload_len = u32::from_le_bytes(head[0..4].try_into().expect("4 bytes"));
    if FRAME_HEADER_BYTES + payload_len as usize > room {
        return None;
    }
    let flags = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes"));
    Some(FrameHeader {
        payload_len,
        last: flags & LAST != 0,
        ordered: flags & ORDERED != 0,
        seq: u64_at(8),
        prev: u64_at(16),
        meta: Meta { next_token: u64_at(32), high_water_ms: u64_at(40) },
        checksum: u64_at(48),
    })
}

/// Whether a whole frame (header and payload) holds its checksum.
pub(crate) fn frame_intact(frame: &[u8], header: &FrameHeader) -> bool {
    frame.len() == FRAME_HEADER_BYTES + header.payload_len as usize
        && frame_checksum(frame) == header.checksum
}

/// The number of the first frame at or after `from` in `bytes` that is whole, was written
/// in order, and is numbered past `after + 1`: proof, when the chain ended at frame
/// `after`, that frames the disk had made durable were lost (see `recover.rs`).
/// Every offset is tried (frames are not aligned); most fail at the number. Runs of
/// zeros (a spare segment is one whole) are skipped to the next byte that is not zero:
/// a frame's number is not zero, so no frame starts where its number's eight bytes
/// would all fall in the run.
pub(crate) fn ordered_frame_past(bytes: &[u8], from: usize, after: u64) -> Option<u64> {
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let last_start = bytes.len().checked_sub(FRAME_HEADER_BYTES)?;
    let mut at = from;
    while at <= last_start {
        let seq = u64_at(at + 8);
        if seq == 0 {
            // The next byte that is not zero, at or after this frame's number.
            let next = bytes[at + 8..].iter().position(|b| *b != 0)? + at + 8;
            at = (at + 1).max(next.saturating_sub(15));
            continue;
        }
        if let Some(found) = ordered_frame_at(bytes, at, seq, after) {
            return Some(found);
        }
        at += 1;
    }
    None
}

/// The number of the frame at `at` (whose number field reads `seq`) if it is whole, was
/// written in order, and is numbered past `after + 1`.
fn ordered_frame_at(bytes: &[u8], at: usize, seq: u64, after: u64) -> Option<u64> {
    if seq <= after + 1 || seq - after > u64::from(u32::MAX) {
        return None;
    }
    let header = read_header(&bytes[at..], bytes.len() - at).filter(|h| h.ordered)?;
    let end = at + FRAME_HEADER_BYTES + header.payload_len as usize;
    frame_intact(&bytes[at..end], &header).then_some(seq)
}

/// Bytes a record's entry takes.
pub(crate) fn record_len(scope: &Scope, record: &Record) -> usize {
    RECORD_FIXED_BYTES
        + scope.tenant.as_str().len()
        + scope.namespace.as_str().len()
        + scope.key.as_str().len()
        + record.fingerprint.as_bytes().len()
        + record.completion.as_ref().map_or(0, |c| COMPLETION_FIXED_BYTES + c.response.len())
        + record.history.len() * 17
}

/// Appends a record's entry to `out`.
pub(crate) fn put_record(out: &mut Vec<u8>, hash: u64, scope: &Scope, record: &Record) {
    let len = record_len(scope, record);
    let start = out.len();
    out.reserve(len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.push(TAG_RECORD);
    out.extend_from_slice(&hash.to_le_bytes());
    let (tenant, namespace, key) = (scope.tenant.as_str(), scope.namespace.as_str(), scope.key.as_str());
    out.extend_from_slice(&(tenant.len() as u16).to_le_bytes());
    out.extend_from_slice(&(namespace.len() as u16).to_le_bytes());
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(&record.token.to_le_bytes());
    out.extend_from_slice(&record.attempt.to_le_bytes());
    out.extend_from_slice(&record.lease_until_ms.to_le_bytes());
    out.extend_from_slice(&record.expires_at_ms.to_le_bytes());
    out.extend_from_slice(&record.ttl_ms.to_le_bytes());
    let fingerprint = record.fingerprint.as_bytes();
    out.extend_from_slice(&(fingerprint.len() as u16).to_le_bytes());
    out.push(u8::from(record.completion.is_some()));
    out.extend_from_slice(&(record.history.len() as u32).to_le_bytes());
    out.extend_from_slice(tenant.as_bytes());
    out.extend_from_slice(namespace.as_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(fingerprint);
    if let Some(completion) = &record.completion {
        out.push(completion.outcome.as_u8());
        out.extend_from_slice(&completion.completed_at_ms.to_le_bytes());
        out.extend_from_slice(&(completion.response.len() as u32).to_le_bytes());
        out.extend_from_slice(&completion.response);
    }
    out.extend_from_slice(&encode_history(&record.history));
    debug_assert_eq!(out.len() - start, len);
}

/// Appends a tombstone: the record of `hash` at `position` is gone.
pub(crate) fn put_tombstone(out: &mut Vec<u8>, hash: u64, position: i64) {
    out.extend_from_slice(&(TOMBSTONE_BYTES as u32).to_le_bytes());
    out.push(TAG_TOMBSTONE);
    out.extend_from_slice(&hash.to_le_bytes());
    out.extend_from_slice(&position.to_le_bytes());
}

/// The length an entry's first four bytes give.
pub(crate) fn entry_len(bytes: &[u8]) -> Option<usize> {
    Some(u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize)
}

/// An entry read back.
#[derive(Debug)]
pub(crate) enum Entry {
    Record { hash: u64, scope: Scope, record: Record },
    Tombstone { hash: u64, position: i64 },
}

/// A cursor over an entry's bytes; running past the end is corruption.
struct Reader<'b> {
    bytes: &'b [u8],
    at: usize,
}

impl<'b> Reader<'b> {
    fn take(&mut self, n: usize) -> Result<&'b [u8], StoreError> {
        let end = self.at.checked_add(n).filter(|end| *end <= self.bytes.len());
        let end = end.ok_or_else(|| StoreError::Corrupt("a log entry ends early".into()))?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }
    fn u8(&mut self) -> Result<u8, StoreError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, StoreError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }
    fn u32(&mut self) -> Result<u32, StoreError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64, StoreError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn text(&mut self, n: usize) -> Result<String, StoreError> {
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| StoreError::Corrupt("a log entry's text is not UTF-8".into()))
    }
}

/// Decodes one whole entry (exactly its length's bytes).
pub(crate) fn read_entry(bytes: &[u8]) -> Result<Entry, StoreError> {
    let mut r = Reader { bytes, at: 0 };
    let len = r.u32()? as usize;
    if len != bytes.len() {
        return Err(StoreError::Corrupt(format!("a log entry says {len} bytes and has {}", bytes.len())));
    }
    let tag = r.u8()?;
    let hash = r.u64()?;
    match tag {
        TAG_TOMBSTONE => Ok(Entry::Tombstone { hash, position: r.u64()? as i64 }),
        TAG_RECORD => {
            let (tenant_len, namespace_len, key_len) = (r.u16()?, r.u16()?, r.u32()?);
            let (token, attempt) = (r.u64()?, r.u32()?);
            let (lease_until_ms, expires_at_ms, ttl_ms) = (r.u64()?, r.u64()?, r.u64()?);
            let (fingerprint_len, completed, history_len) = (r.u16()?, r.u8()?, r.u32()? as usize);
            let scope = stored_scope(
                r.text(tenant_len.into())?,
                r.text(namespace_len.into())?,
                r.text(key_len as usize)?,
            )?;
            let fingerprint = Fingerprint::from_stored(r.take(fingerprint_len.into())?.to_vec());
            let completion = match completed {
                0 => None,
                _ => {
                    let outcome = Outcome::from_u8(r.u8()?)
                        .ok_or_else(|| StoreError::Corrupt("a log entry's outcome is unknown".into()))?;
                    let completed_at_ms = r.u64()?;
                    let response_len = r.u32()? as usize;
                    Some(Completion { outcome, response: r.take(response_len)?.to_vec(), completed_at_ms })
                }
            };
            let history = decode_history(r.take(history_len.saturating_mul(17))?);
            let record = Record {
                token,
                attempt,
                lease_until_ms,
                expires_at_ms,
                ttl_ms,
                fingerprint,
                completion,
                history,
            };
            Ok(Entry::Record { hash, scope, record })
        }
        other => Err(StoreError::Corrupt(format!("a log entry has the unknown tag {other}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oncegate_core::{Key, Namespace, Tenant, Transition};
    use proptest::prelude::*;

    fn scope(key: &str) -> Scope {
        Scope {
            tenant: Tenant::default_tenant(),
            namespace: Namespace::new("orders").unwrap(),
            key: Key::from_stored(key.into()),
        }
    }

    fn record(token: u64, response: Option<Vec<u8>>, events: usize) -> Record {
        let mut record = Record {
            token,
            attempt: 3,
            lease_until_ms: 1_000 + token,
            expires_at_ms: 9_000,
            ttl_ms: 8_000,
            fingerprint: Fingerprint::from_stored(vec![9; 32]),
            completion: response.map(|response| Completion {
                outcome: Outcome::Succeeded,
                response,
                completed_at_ms: 1_500,
            }),
            history: Vec::new(),
        };
        for n in 0..events {
            record.push_event(Transition::Granted, n as u64, token);
        }
        record
    }

    proptest! {
        /// Every record and tombstone reads back as written, at the length announced.
        #[test]
        fn entries_read_back_as_written(
            key in "[a-z0-9:]{1,40}",
            token in any::<u64>(),
            response in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..300)),
            events in 0usize..5,
            position in any::<i64>(),
        ) {
            let (scope, record) = (scope(&key), record(token, response, events));
            let mut out = Vec::new();
            put_record(&mut out, 42, &scope, &record);
            prop_assert_eq!(out.len(), record_len(&scope, &record));
            prop_assert_eq!(entry_len(&out), Some(out.len()));
            match read_entry(&out).unwrap() {
                Entry::Record { hash, scope: read_scope, record: read } => {
                    prop_assert_eq!(hash, 42);
                    prop_assert_eq!(read_scope, scope);
                    prop_assert_eq!(read, record);
                }
                Entry::Tombstone { .. } => prop_assert!(false, "read a tombstone"),
            }
            let mut out = Vec::new();
            put_tombstone(&mut out, 7, position);
            let tombstone = matches!(read_entry(&out).unwrap(), Entry::Tombstone { hash: 7, position: p } if p == position);
            prop_assert!(tombstone, "the tombstone reads back");
        }
    }

    /// A frame holds its checksum; any flipped bit, in the header or the payload, breaks
    /// it, and a payload running past the segment is not a frame.
    #[test]
    fn a_frame_with_any_bit_flipped_is_refused() {
        let mut frame = vec![0; FRAME_HEADER_BYTES];
        put_record(&mut frame, 5, &scope("k"), &record(4, Some(vec![1, 2, 3]), 2));
        let meta = Meta { next_token: 11, high_water_ms: 2_000 };
        let checksum = seal_frame(&mut frame, Flags { last: true, ordered: true }, 3, 99, meta, 0x5a17);
        let header = read_header(&frame, frame.len()).unwrap();
        assert_eq!(
            (header.seq, header.prev, header.meta, header.last, header.checksum),
            (3, 99, meta, true, checksum)
        );
        assert!(header.ordered);
        let mut bytes = vec![0; 100];
        bytes.extend_from_slice(&frame);
        bytes.extend_from_slice(&[0; 30]);
        assert_eq!(ordered_frame_past(&bytes, 0, 1), Some(3), "found at an unaligned offset");
        assert_eq!(ordered_frame_past(&bytes, 0, 2), None, "frame 3 may follow frame 2");
        assert_eq!(ordered_frame_past(&bytes, 101, 1), None, "before `from`");
        assert!(frame_intact(&frame, &header));
        assert!(read_header(&frame, frame.len() - 1).is_none(), "runs past the segment");
        for bit in 0..frame.len() * 8 {
            let mut flipped = frame.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            let intact = read_header(&flipped, flipped.len()).is_some_and(|h| frame_intact(&flipped, &h));
            assert!(!intact, "bit {bit} flipped and the frame still reads");
        }
    }

    /// Damaged entries are corruption, never a record read from the wrong bytes.
    #[test]
    fn a_short_or_unknown_entry_is_corruption() {
        let mut out = Vec::new();
        put_record(&mut out, 1, &scope("k"), &record(1, None, 1));
        assert!(read_entry(&out[..out.len() - 1]).is_err());
        out[4] = 9;
        assert!(read_entry(&out).is_err());
    }

    proptest::proptest! {
        /// Skipping runs of zeros finds what trying every offset finds: a sealed frame
        /// after zeros and noise, with any number before it.
        #[test]
        fn skipping_zeros_finds_what_every_offset_finds(
            zeros in 0usize..300,
            noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40),
            seq in 1u64..6,
            after in 0u64..5,
            from in 0usize..50,
        ) {
            let mut frame = vec![0; FRAME_HEADER_BYTES];
            put_tombstone(&mut frame, 5, 77);
            seal_frame(&mut frame, Flags { last: true, ordered: true }, seq, 9, Meta::default(), 1);
            let mut bytes = vec![0; zeros];
            bytes.extend_from_slice(&noise);
            bytes.extend(std::iter::repeat_n(0, zeros / 2));
            bytes.extend_from_slice(&frame);
            bytes.extend(std::iter::repeat_n(0, zeros / 3));
            let every = bytes
                .len()
                .checked_sub(FRAME_HEADER_BYTES)
                .and_then(|last| (from..=last).find_map(|at| {
                    let number = u64::from_le_bytes(bytes[at + 8..at + 16].try_into().unwrap());
                    ordered_frame_at(&bytes, at, number, after)
                }));
            proptest::prop_assert_eq!(ordered_frame_past(&bytes, from, after), every);
        }
    }
}
