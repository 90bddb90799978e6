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
//! records cost kilobytes here, not the 80 MB a list of ids would), and at worst one run
//! (16 bytes) per row.
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
    windows: BTreeMap<u64, Vec<Run>>,
}

/// The ids `first ..= last`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    first: i64,
    last: i64,
}

impl Schedule {
    pub fn new(granularity_ms: u64) -> Schedule {
        Schedule { granularity_ms: granularity_ms.max(1), windows: BTreeMap::new() }
    }

    /// The instant from which a row reclaimable at `reclaim_at_ms` is taken: the end of
    /// its window, never earlier than the row's own deadline.
    pub fn due_ms(&self, reclaim_at_ms: u64) -> u64 {
        reclaim_at_ms.div_ceil(self.granularity_ms).saturating_mul(self.granularity_ms)
    }

    /// Schedules a row; a row already last in its window is not added twice, and a row
    /// next to the window's last run extends it.
    pub fn add(&mut self, reclaim_at_ms: u64, id: i64) {
        let runs = self.windows.entry(self.due_ms(reclaim_at_ms)).or_default();
        match runs.last_mut() {
            Some(run) if (run.first..=run.last).contains(&id) => {}
            Some(run) if run.last.checked_add(1) == Some(id) => run.last = id,
            Some(run) if id.checked_add(1) == Some(run.first) => run.first = id,
            _ => runs.push(Run { first: id, last: id }),
        }
    }

    /// The end of the earliest window that holds an entry.
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
            let runs = window.get_mut();
            while taken.len() < limit {
                let Some(run) = runs.last_mut() else { break };
                taken.push((due, run.last));
                if run.first == run.last {
                    runs.pop();
                } else {
                    run.last -= 1;
                }
            }
            if runs.is_empty() {
                window.remove();
            }
        }
        taken
    }

    /// Puts back entries taken by a transaction that did not commit.
    pub fn restore(&mut self, taken: impl IntoIterator<Item = (u64, i64)>) {
        for (due, id) in taken {
            self.windows.entry(due).or_default().push(Run { first: id, last: id });
        }
    }

    /// Row ids held, live and stale.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.windows.values().flatten().map(|run| (run.last - run.first + 1) as usize).sum()
    }

    /// Runs held: what the schedule's memory follows.
    #[cfg(test)]
    pub fn runs(&self) -> usize {
        self.windows.values().map(Vec::len).sum()
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
}
