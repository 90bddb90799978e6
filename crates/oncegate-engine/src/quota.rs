//! Stored records counted by state and by tenant, and each tenant's quota of records per
//! shard: what keeps one tenant from filling a shard file that every tenant's keys share.
//!
//! The counts are read from the store when a shard opens and kept in step by the book;
//! a quota is checked only when a decision would store a record for a key that has none,
//! so a tenant at its quota still replays, renews, commits and releases what it has.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use oncegate_core::{Record, Tenant};

use crate::error::Error;

/// Stored records: pending, completed, and all of them by tenant (expired records not yet
/// reclaimed included).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Tally {
    pub pending: i64,
    pub completed: i64,
    pub by_tenant: HashMap<Tenant, i64>,
}

impl Tally {
    /// Counts `record` of `tenant` with `sign` (+1 stored, -1 removed); `None` counts nothing.
    pub fn count(&mut self, tenant: &Tenant, record: Option<&Record>, sign: i64) {
        let Some(record) = record else { return };
        if record.completion.is_some() {
            self.completed += sign;
        } else {
            self.pending += sign;
        }
        self.add_tenant(tenant, sign);
    }

    /// Counts one stored row of `tenant`, pending or completed, as read from the store.
    pub fn add_stored(&mut self, tenant: &Tenant, pending: bool) {
        if pending {
            self.pending += 1;
        } else {
            self.completed += 1;
        }
        self.add_tenant(tenant, 1);
    }

    /// Adds `delta` records to `tenant`'s count.
    pub fn add_tenant(&mut self, tenant: &Tenant, delta: i64) {
        if let Some(n) = self.by_tenant.get_mut(tenant) {
            *n += delta;
        } else {
            self.by_tenant.insert(tenant.clone(), delta);
        }
    }

    /// Folds `other` into this tally (a committed transaction's changes into the totals),
    /// and forgets tenants left with none.
    pub fn absorb(&mut self, other: Tally) {
        self.pending += other.pending;
        self.completed += other.completed;
        for (tenant, delta) in other.by_tenant {
            *self.by_tenant.entry(tenant).or_insert(0) += delta;
        }
        self.by_tenant.retain(|_, n| *n > 0);
    }

    /// Subtracts removed records (`removed` counts them positively).
    pub fn remove(&mut self, removed: &Tally) {
        self.pending -= removed.pending;
        self.completed -= removed.completed;
        for (tenant, n) in &removed.by_tenant {
            self.add_tenant(tenant, -n);
        }
    }

    /// `tenant`'s records.
    pub fn of(&self, tenant: &Tenant) -> i64 {
        self.by_tenant.get(tenant).copied().unwrap_or(0)
    }
}

/// Each tenant's most records per shard; a tenant absent from the table has no quota.
/// Shared by the engine (which replaces it) and every shard (which reads it when a new
/// record would be stored).
#[derive(Clone, Debug, Default)]
pub(crate) struct Quotas(Arc<RwLock<HashMap<Tenant, u64>>>);

impl Quotas {
    /// Replaces the whole table.
    pub fn set(&self, table: HashMap<Tenant, u64>) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = table;
    }

    /// The refusal of a new record for `tenant`, which has `stored` records on `shard`,
    /// when that would pass its quota.
    pub fn refusal(&self, tenant: &Tenant, stored: i64, shard: u32) -> Option<Error> {
        let table = self.0.read().unwrap_or_else(PoisonError::into_inner);
        let max = *table.get(tenant)?;
        (stored >= 0 && stored as u64 >= max).then(|| Error::ResourceExhausted {
            what: format!("tenant {tenant}'s records on shard {shard}"),
            limit_name: "tenants[].records_per_shard_max",
            limit: usize::try_from(max).unwrap_or(usize::MAX),
        })
    }
}
