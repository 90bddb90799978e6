//! When each row becomes reclaimable, kept in memory by the shard's one thread and rebuilt
//! from the table at every open, like the [`Index`](crate::index::Index).
//!
//! An index on `reclaim_at_ms` in the file cost about a fifth of the pages every batch
//! wrote (its right edge for new records, and the entry each commit moved), and the
//! checkpoint copied them again (docs/benchmarks.md). Here the rows are grouped by the
//! end of the `reclaim_granularity_ms` window in which they become reclaimable, and an
//! alarm takes whole windows that have ended. A window holds runs of consecutive row ids:
//! rows are appended in arrival order and most records of a window arrived together with
//! the same ttl, so a window is usually a few runs whatever its size (10 million live
//! records cost kilobytes here, not the 80 MB a list of ids would). An id that starts no
//! run is kept alone, in 8 bytes.
//!
//! Entries are hints, never the truth: the row's own `reclaim_at_ms` decides, in the
//! `DELETE` that reclaims it. A row whose deadline moved to another window gets a new
//! entry there and its old one is dropped when its window comes (the delete finds the
//! row not yet due); an entry whose row is gone finds nothing. So an entry left behind by
//! a rolled-back transaction is harmless, and only entries taken out by a transaction
//! that did not commit must go back ([`Schedule::restore`]).

use std::collections::BTreeMap;

/// Row ids by the instant at which their window ends.
#[derive(Debug)]
pub(crate) struct Schedule {
    granularity_ms: u64,
    windows: BTreeMap<u64, Window>,
}

/// One window's ids, as items: an item `>= 0` is an id alone; an item `< 0` is `!first`,
/// the start of the run `first ..= last` whose `last` is the next item. Ids (SQLite's
/// row ids) are never negative, so the two never mix up, and an entry is a run exactly
/// when the item before its last is negative.
#[derive(Debug, Default)]
struct Window {
    items: Vec<i64>,
}

impl Window {
    /// The last entry: its first and last id, and how many items it takes.
    fn last(&self) -> Option<(i64, i64, usize)> {
        let n = self.items.len();
        let last = *self.items.last()?;
        match n.checked_sub(2).map(|at| self.items[at]) {
            Some(start) if start < 0 => Some((!start, last, 2)),
            _ => Some((last, last, 1)),
        }
    }

    /// Replaces the last entry (of `items` items) by `first ..= last`.
    fn set_last(&mut self, items: usize, first: i64, last: i64) {
        self.items.truncate(self.items.len() - items);
        self.push(first, last);
    }

    fn push(&mut self, first: i64, last: i64) {
        if first == last {
            self.items.push(first);
        } else {
            self.items.extend([!first, last]);
        }
    }

    fn add(&mut self, id: i64) {
        match self.last() {
            Some((first, last, _)) if (first..=last).contains(&id) => {}
            Some((first, last, items)) if last.checked_add(1) == Some(id) => self.set_last(items, first, id),
            Some((first, last, items)) if id.checked_add(1) == Some(first) => self.set_last(items, id, last),
            _ => self.items.push(id),
        }
    }

    /// Takes the last id.
    fn pop(&mut self) -> Option<i64> {
        let (first, last, items) = self.last()?;
        self.items.truncate(self.items.len() - items);
        if first < last {
            self.push(first, last - 1);
        }
        Some(last)
    }
}

impl Schedule {
    pub fn new(granularity_ms: u64) -> Schedule {
        Schedule { granularity_ms: granularity_ms.max(1), windows: BTreeMap::new() }
    }

    /// The end of the window in which `reclaim_at_ms` falls: the earliest instant at which
    /// the window's alarm may take the row (never before its deadline). Saturates, so a
    /// far deadline lands in the last window rather than wrapping to an early one.
    pub fn due_ms(&self, reclaim_at_ms: u64) -> u64 {
        reclaim_at_ms.div_ceil(self.granularity_ms).saturating_mul(self.granularity_ms)
    }

    /// Files row `id` under the window of `reclaim_at_ms`.
    pub fn add(&mut self, reclaim_at_ms: u64, id: i64) {
        self.windows.entry(self.due_ms(reclaim_at_ms)).or_default().add(id);
    }

    pub fn next_ms(&self) -> Option<u64> {
        self.windows.first_key_value().map(|(due, _)| *due)
    }

    /// Takes at most `limit` entries of windows that have ended by `now_ms`, earliest
    /// window first, each with the instant it was filed under.
    pub fn take_due(&mut self, now_ms: u64, limit: usize) -> Vec<(u64, i64)> {
        let mut taken = Vec::new();
        while taken.len() < limit {
            let Some(mut window) = self.windows.first_entry() else { break };
            let due = *window.key();
            if due > now_ms {
                break;
            }
            let entries = window.get_mut();
            while taken.len() < limit {
                let Some(id) = entries.pop() else { break };
                taken.push((due, id));
            }
            if entries.items.is_empty() {
                window.remove();
            }
        }
        taken
    }

    /// Puts back entries taken by a transaction that did not commit.
    pub fn restore(&mut self, taken: impl IntoIterator<Item = (u64, i64)>) {
        for (due, id) in taken {
            self.windows.entry(due).or_default().items.push(id);
        }
    }

    /// Row ids held, live and stale.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        let mut len = 0;
        for window in self.windows.values() {
            let mut items = window.items.iter().copied();
            while let Some(item) = items.next() {
                len += if item < 0 {
                    (items.next().expect("a run has its last") - !item + 1) as usize
                } else {
                    1
                };
            }
        }
        len
    }

    /// Entries held (runs and ids alone): what the schedule's memory follows.
    #[cfg(test)]
    pub fn runs(&self) -> usize {
        self.windows.values().map(|window| window.items.iter().filter(|item| **item >= 0).count()).sum()
    }

    /// Bytes the entries take (the windows' items).
    #[cfg(test)]
    pub fn entry_bytes(&self) -> usize {
        self.windows.values().map(|window| window.items.len() * 8).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_end_at_the_granularity_and_never_before_the_deadline() {
        let schedule = Schedule::new(1_000);
        assert_eq!(schedule.due_ms(0), 0);
        assert_eq!(schedule.due_ms(1), 1_000);
        assert_eq!(schedule.due_ms(1_000), 1_000);
        assert_eq!(schedule.due_ms(1_001), 2_000);
        assert_eq!(schedule.due_ms(u64::MAX), u64::MAX, "saturates rather than wrap to an earlier window");
        assert_eq!(Schedule::new(1).due_ms(1_234), 1_234);
    }

    #[test]
    fn takes_ended_windows_in_order_up_to_the_limit_and_restores() {
        let mut schedule = Schedule::new(10);
        schedule.add(25, 3);
        schedule.add(5, 1);
        schedule.add(7, 2);
        schedule.add(7, 2);
        assert_eq!((schedule.len(), schedule.next_ms()), (3, Some(10)));
        assert!(schedule.take_due(9, 10).is_empty());
        let first = schedule.take_due(30, 1);
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].0, 10);
        let rest = schedule.take_due(30, 10);
        assert_eq!(rest.iter().map(|(due, _)| *due).collect::<Vec<_>>(), vec![10, 30]);
        assert_eq!(schedule.next_ms(), None);
        schedule.restore(first.into_iter().chain(rest));
        assert_eq!((schedule.len(), schedule.next_ms()), (3, Some(10)));
    }

    #[test]
    fn consecutive_rows_share_a_run_and_are_taken_one_by_one() {
        let mut schedule = Schedule::new(1_000);
        for id in 1..=100_000 {
            schedule.add(5_000, id);
        }
        schedule.add(5_000, 7);
        schedule.add(5_000, 200_000);
        assert_eq!((schedule.len(), schedule.runs()), (100_001, 2));
        let taken = schedule.take_due(5_000, 3);
        assert_eq!(taken.iter().map(|(_, id)| *id).collect::<Vec<_>>(), vec![200_000, 100_000, 99_999]);
        assert_eq!((schedule.len(), schedule.runs()), (99_998, 1));
        let rest = schedule.take_due(5_000, usize::MAX);
        assert_eq!(rest.len(), 99_998);
        assert_eq!(schedule.next_ms(), None);
    }

    /// Ids that start no run take 8 bytes each, and a run formed
    /// from either end takes 16 whatever its length; every id comes back out once.
    #[test]
    fn lone_ids_take_one_item_and_runs_two() {
        let mut schedule = Schedule::new(1_000);
        for id in (0..1_000).map(|n| n * 100) {
            schedule.add(5_000, id);
        }
        assert_eq!((schedule.len(), schedule.runs(), schedule.entry_bytes()), (1_000, 1_000, 8_000));
        for id in [100_001, 100_002, 100_000, 99_999] {
            schedule.add(5_000, id);
        }
        schedule.add(5_000, 100_001);
        assert_eq!((schedule.len(), schedule.runs(), schedule.entry_bytes()), (1_004, 1_001, 8_016));
        let mut taken: Vec<i64> =
            schedule.take_due(5_000, usize::MAX).into_iter().map(|(_, id)| id).collect();
        assert_eq!(&taken[..5], &[100_002, 100_001, 100_000, 99_999, 99_900]);
        taken.sort_unstable();
        taken.dedup();
        assert_eq!(taken.len(), 1_004);
        assert_eq!(schedule.next_ms(), None);
    }
}
