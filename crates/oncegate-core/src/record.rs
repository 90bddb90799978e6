//! The stored record of a key and the states derived from it at a given time.

use crate::Fingerprint;

/// How a completed attempt ended, as its holder reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The work was done; replays tell retries it succeeded.
    Succeeded,
    /// The work failed for good; replays tell retries not to try again.
    Failed,
}

impl Outcome {
    /// The stable number stored in SQLite and sent on the wire (`OUTCOME_SUCCEEDED = 1`).
    pub const fn as_u8(self) -> u8 {
        match self {
            Outcome::Succeeded => 1,
            Outcome::Failed => 2,
        }
    }

    /// The inverse of [`Outcome::as_u8`].
    pub const fn from_u8(value: u8) -> Option<Outcome> {
        match value {
            1 => Some(Outcome::Succeeded),
            2 => Some(Outcome::Failed),
            _ => None,
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Outcome::Succeeded => "succeeded",
            Outcome::Failed => "failed",
        })
    }
}

/// The state of a key as every reply reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    /// No live record: never reserved, released, or expired.
    Free,
    /// An attempt holds the key and its lease is live.
    Pending,
    /// Pending, but the lease ran out without commit, release or heartbeat.
    Abandoned,
    /// An attempt committed; its outcome and response are stored.
    Completed,
}

/// The most transitions a record remembers; older ones are dropped first.
pub const HISTORY_LEN_MAX: usize = 16;

/// A change in a record's life, kept for operators (`inspect`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transition {
    /// A first grant of the key (or a grant after it expired).
    Granted,
    /// The holder renewed its lease.
    Heartbeat,
    /// The holder's lease ran out (recorded when the next attempt took over).
    Abandoned,
    /// A grant that took over an abandoned attempt.
    Regranted,
    /// The holder committed.
    Committed,
}

impl Transition {
    /// The stable number stored on disk.
    pub const fn as_u8(self) -> u8 {
        match self {
            Transition::Granted => 1,
            Transition::Heartbeat => 2,
            Transition::Abandoned => 3,
            Transition::Regranted => 4,
            Transition::Committed => 5,
        }
    }

    /// The inverse of [`Transition::as_u8`].
    pub const fn from_u8(value: u8) -> Option<Transition> {
        match value {
            1 => Some(Transition::Granted),
            2 => Some(Transition::Heartbeat),
            3 => Some(Transition::Abandoned),
            4 => Some(Transition::Regranted),
            5 => Some(Transition::Committed),
            _ => None,
        }
    }

    /// The lowercase name shown to operators.
    pub const fn as_str(self) -> &'static str {
        match self {
            Transition::Granted => "granted",
            Transition::Heartbeat => "heartbeat",
            Transition::Abandoned => "abandoned",
            Transition::Regranted => "regranted",
            Transition::Committed => "committed",
        }
    }
}

/// One entry of a record's history.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Event {
    /// What happened.
    pub transition: Transition,
    /// When, by the shard's clock.
    pub at_ms: u64,
    /// The token of the attempt it happened to.
    pub token: u64,
}

/// What a committed attempt left behind for replays.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// As reported by the holder.
    pub outcome: Outcome,
    /// Opaque bytes replayed to every later reserve until the record expires.
    pub response: Vec<u8>,
    /// When the commit was applied.
    pub completed_at_ms: u64,
}

/// The durable record of one key. Only `pending` and `completed` are stored; `free` is
/// the absence of a live record and `abandoned` is derived from the lease deadline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The fencing token of the latest grant; strictly greater than every earlier grant's
    /// for the same key, because tokens come from one counter per shard.
    pub token: u64,
    /// 1 for a first grant, one more for each re-grant after abandonment.
    pub attempt: u32,
    /// The holder's lease runs until this instant (exclusive).
    pub lease_until_ms: u64,
    /// The record is free from this instant on, unless a live lease keeps it.
    pub expires_at_ms: u64,
    /// The ttl the granting reserve asked for, kept so a commit can extend expiry by it.
    pub ttl_ms: u64,
    /// The fingerprint the record is bound to (empty when none was ever sent).
    pub fingerprint: Fingerprint,
    /// Present once the holder committed.
    pub completion: Option<Completion>,
    /// The record's transitions, oldest first, at most [`HISTORY_LEN_MAX`]. A record that
    /// is released, purged or reclaimed takes its history with it.
    pub history: Vec<Event>,
}

impl Record {
    /// Appends a transition, dropping the oldest beyond [`HISTORY_LEN_MAX`].
    pub fn push_event(&mut self, transition: Transition, at_ms: u64, token: u64) {
        self.history.push(Event { transition, at_ms, token });
        if self.history.len() > HISTORY_LEN_MAX {
            let excess = self.history.len() - HISTORY_LEN_MAX;
            self.history.drain(..excess);
        }
    }

    /// The instant from which the record is free and its storage may be reclaimed.
    ///
    /// A pending record with a live lease never expires, so for pending records this is
    /// the later of the two deadlines.
    pub fn reclaim_at_ms(&self) -> u64 {
        match self.completion {
            Some(_) => self.expires_at_ms,
            None => self.expires_at_ms.max(self.lease_until_ms),
        }
    }

    /// Whether the record counts as free at `now_ms`.
    pub fn is_expired(&self, now_ms: u64) -> bool {
        now_ms >= self.reclaim_at_ms()
    }

    /// The state at `now_ms`.
    pub fn state(&self, now_ms: u64) -> State {
        if self.is_expired(now_ms) {
            State::Free
        } else if self.completion.is_some() {
            State::Completed
        } else if now_ms < self.lease_until_ms {
            State::Pending
        } else {
            State::Abandoned
        }
    }

    /// The next instant after `now_ms` at which the record changes state without any
    /// request: a live lease running out (pending becomes abandoned, and waiters may be
    /// granted) or the record expiring. `None` when it is already free.
    pub fn next_deadline_ms(&self, now_ms: u64) -> Option<u64> {
        let reclaim = self.reclaim_at_ms();
        if now_ms >= reclaim {
            return None;
        }
        if self.completion.is_none() && now_ms < self.lease_until_ms && self.lease_until_ms < reclaim {
            return Some(self.lease_until_ms);
        }
        Some(reclaim)
    }

    /// Applies the restart grace: after the store reopens, a lease that was still live
    /// when the shard last observed time (`last_seen_ms`, its persisted clock high-water
    /// mark) runs at least as long as it had left then, and at least `grace_ms`, from
    /// `now_ms`. The downtime itself (or a wall clock stepped forward during it) never
    /// ends a lease early. A lease that had already run out before the stop stays
    /// abandoned. Returns whether the record changed (and must be written back).
    pub fn apply_restart_grace(&mut self, last_seen_ms: u64, now_ms: u64, grace_ms: u64) -> bool {
        if self.completion.is_some() || self.lease_until_ms <= last_seen_ms {
            return false;
        }
        let remaining_ms = self.lease_until_ms - last_seen_ms;
        let floor = now_ms.saturating_add(remaining_ms.max(grace_ms));
        if self.lease_until_ms < floor {
            self.lease_until_ms = floor;
            return true;
        }
        false
    }

    /// Carries the record into a clock frame `ahead_ms` ahead of the one it was decided
    /// in (a slot moved to a shard whose clock is ahead of its source's): the lease and
    /// the expiry keep the time they had left, so a move never ends either early, and
    /// what had run out stays run out.
    pub fn carry_forward(&mut self, ahead_ms: u64) {
        self.lease_until_ms = self.lease_until_ms.saturating_add(ahead_ms);
        self.expires_at_ms = self.expires_at_ms.saturating_add(ahead_ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_carried_into_a_later_frame_keeps_what_it_had_left() {
        // Decided at 1_000 in the source's frame; the destination's clock reads 61_000.
        let (source_now, ahead_ms) = (1_000, 60_000);
        for (lease_until_ms, expires_at_ms) in [(1_500, 9_000), (900, 9_000), (900, 950)] {
            let mut record = pending(lease_until_ms, expires_at_ms);
            let live = (record.lease_until_ms > source_now, record.expires_at_ms > source_now);
            record.carry_forward(ahead_ms);
            let now = source_now + ahead_ms;
            assert_eq!((record.lease_until_ms > now, record.expires_at_ms > now), live);
            assert_eq!(record.lease_until_ms - ahead_ms, lease_until_ms, "the same time left");
        }
    }

    fn pending(lease_until_ms: u64, expires_at_ms: u64) -> Record {
        Record {
            token: 1,
            attempt: 1,
            lease_until_ms,
            expires_at_ms,
            ttl_ms: expires_at_ms,
            fingerprint: Fingerprint::NONE,
            completion: None,
            history: Vec::new(),
        }
    }

    #[test]
    fn next_deadline_is_lease_end_then_expiry() {
        let r = pending(100, 1_000);
        assert_eq!(r.next_deadline_ms(0), Some(100), "the lease runs out first");
        assert_eq!(r.next_deadline_ms(100), Some(1_000), "then the record expires");
        assert_eq!(r.next_deadline_ms(1_000), None);
        let long_lease = pending(2_000, 1_000);
        assert_eq!(long_lease.next_deadline_ms(0), Some(2_000), "a live lease holds the record past ttl");
        let mut done = pending(100, 1_000);
        done.completion =
            Some(Completion { outcome: Outcome::Failed, response: vec![], completed_at_ms: 50 });
        assert_eq!(done.next_deadline_ms(50), Some(1_000), "a completion ignores its old lease");
    }

    #[test]
    fn restart_grace_extends_only_leases_live_at_the_stop() {
        // Last seen at 500; reopened at 10_000 with a 2_000 grace.
        let mut live_at_stop = pending(600, 100_000);
        assert!(live_at_stop.apply_restart_grace(500, 10_000, 2_000));
        assert_eq!(live_at_stop.lease_until_ms, 12_000, "100 ms left, so the grace applies");

        let mut abandoned_before_stop = pending(400, 100_000);
        assert!(!abandoned_before_stop.apply_restart_grace(500, 10_000, 2_000));
        assert_eq!(abandoned_before_stop.lease_until_ms, 400);

        let mut long_lease = pending(50_000, 100_000);
        assert!(long_lease.apply_restart_grace(500, 10_000, 2_000));
        assert_eq!(long_lease.lease_until_ms, 59_500, "the 49.5 s it had left run from the reopen");

        let mut after_a_short_stop = pending(50_000, 100_000);
        assert!(!after_a_short_stop.apply_restart_grace(500, 500, 2_000), "no downtime, nothing to add");
    }

    #[test]
    fn history_is_bounded_and_keeps_the_newest() {
        let mut r = pending(100, 1_000);
        for i in 0..(HISTORY_LEN_MAX as u64 + 5) {
            r.push_event(Transition::Heartbeat, i, 1);
        }
        assert_eq!(r.history.len(), HISTORY_LEN_MAX);
        assert_eq!(r.history.first().unwrap().at_ms, 5);
        assert_eq!(r.history.last().unwrap().at_ms, HISTORY_LEN_MAX as u64 + 4);
        for t in [
            Transition::Granted,
            Transition::Heartbeat,
            Transition::Abandoned,
            Transition::Regranted,
            Transition::Committed,
        ] {
            assert_eq!(Transition::from_u8(t.as_u8()), Some(t));
        }
    }

    #[test]
    fn outcome_numbers_round_trip() {
        for outcome in [Outcome::Succeeded, Outcome::Failed] {
            assert_eq!(Outcome::from_u8(outcome.as_u8()), Some(outcome));
        }
        assert_eq!(Outcome::from_u8(0), None);
    }
}
