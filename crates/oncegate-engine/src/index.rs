//! Where each key's row is: the routing hash of its scope to the row id, kept in memory by
//! the shard's one thread (so it is coherent by construction) and rebuilt from the table
//! at every open.
//!
//! Records are appended in arrival order (the row id), so a batch's writes land on the
//! few pages at the table's right edge instead of one random page per record, which is
//! what made the old layout write ~20 KB per pair (docs/benchmarks.md). The index is what
//! makes that order possible without an on-disk index on the key, which would put the
//! random page back.
//!
//! Two scopes may share a hash: the index then holds both ids, and the store compares the
//! full scope kept in each row.

use std::collections::HashMap;

use nohash_hasher::BuildNoHashHasher;

/// The keys are already xxh3 hashes of the scope, well mixed in every bit: hashing them
/// again (std's SipHash) would cost a lookup's time for nothing.
type ByHash<V> = HashMap<u64, V, BuildNoHashHasher<u64>>;

/// Hash to row id(s): 16 bytes per live key plus the table's free slots.
#[derive(Debug, Default)]
pub(crate) struct Index {
    /// The common case: one row per hash.
    one: ByHash<i64>,
    /// Hashes shared by more than one row (rare: 64-bit hashes).
    more: ByHash<Vec<i64>>,
}

/// A change to undo if the transaction that made it does not commit.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Undo {
    /// The row was added: remove it.
    Remove(u64, i64),
    /// The row was removed: add it back.
    Insert(u64, i64),
}

impl Index {
    /// The row ids that may hold a scope with this hash (no allocation: this runs for
    /// every command).
    pub fn ids(&self, hash: u64) -> impl Iterator<Item = i64> + '_ {
        self.one.get(&hash).copied().into_iter().chain(self.more.get(&hash).into_iter().flatten().copied())
    }

    /// Every (hash, row id), in no order: a slot move picks its slot's rows from them.
    pub fn iter(&self) -> impl Iterator<Item = (u64, i64)> + '_ {
        let one = self.one.iter().map(|(hash, id)| (*hash, *id));
        one.chain(self.more.iter().flat_map(|(hash, ids)| ids.iter().map(move |id| (*hash, *id))))
    }

    pub fn insert(&mut self, hash: u64, id: i64) {
        if let Some(ids) = self.more.get_mut(&hash) {
            ids.push(id);
        } else if let Some(first) = self.one.remove(&hash) {
            self.more.insert(hash, vec![first, id]);
        } else {
            self.one.insert(hash, id);
        }
    }

    pub fn remove(&mut self, hash: u64, id: i64) {
        if self.one.get(&hash) == Some(&id) {
            self.one.remove(&hash);
        } else if let Some(ids) = self.more.get_mut(&hash) {
            ids.retain(|i| *i != id);
            if ids.len() == 1 {
                let last = ids[0];
                self.more.remove(&hash);
                self.one.insert(hash, last);
            }
        }
    }

    pub fn undo(&mut self, undo: Undo) {
        match undo {
            Undo::Remove(hash, id) => self.remove(hash, id),
            Undo::Insert(hash, id) => self.insert(hash, id),
        }
    }

    /// Rows indexed.
    pub fn len(&self) -> usize {
        self.one.len() + self.more.values().map(Vec::len).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_hashes_keep_every_row_and_undo_restores() {
        let mut index = Index::default();
        index.insert(7, 1);
        index.insert(7, 2);
        index.insert(9, 3);
        let ids = |index: &Index, hash| index.ids(hash).collect::<Vec<_>>();
        assert_eq!((ids(&index, 7), ids(&index, 9), index.len()), (vec![1, 2], vec![3], 3));
        index.remove(7, 1);
        assert_eq!(ids(&index, 7), vec![2]);
        index.undo(Undo::Insert(7, 1));
        assert_eq!(ids(&index, 7), vec![2, 1]);
        index.undo(Undo::Remove(9, 3));
        assert!(ids(&index, 9).is_empty());
        assert_eq!(index.len(), 2);
    }
}
