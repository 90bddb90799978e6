//! The actor's in-memory state that a batch changes alongside the store: the token
//! counter, the record counts, the alarm index and the parked reserves (waiters).
//!
//! Every method that writes does the store write first and changes the book only once
//! the write succeeded, so a statement that fails on its own (a full file) leaves the
//! book as it was and the rest of the batch goes on.

use std::collections::{HashMap, VecDeque};

use oncegate_core::{Change, Command, Decision, Record, Reply, Reserve, ReserveReply, Scope, decide};
use tokio::sync::oneshot;

use crate::config::EngineConfig;
use crate::error::Error;
use crate::placement::slots::Slots;
use crate::quota::{Quotas, Tally};
use crate::store::{StoreError, Txn};

/// Where a request's answer goes.
pub(crate) type ReplyTo = oneshot::Sender<Result<Reply, Error>>;

/// Answers to send once the batch's transaction has committed.
pub(crate) type Outbox = Vec<(ReplyTo, Result<Reply, Error>)>;

/// A reserve parked until its key changes or its wait runs out.
struct Waiter {
    reserve: Reserve,
    deadline_ms: u64,
    reply: ReplyTo,
}

impl Waiter {
    /// Whether the caller has gone (cancelled, past its own deadline, disconnected): such
    /// a waiter is never granted and no longer counts against the waiter limits.
    fn is_gone(&self) -> bool {
        self.reply.is_closed()
    }
}

/// The parked reserves of one key, first come first served.
struct WaitQueue {
    waiters: VecDeque<Waiter>,
    /// The holder's lease deadline as last seen: when it passes, a waiter may be granted.
    lease_until_ms: u64,
}

/// The parked reserves of a moving slot's keys, on their way to its new shard.
#[derive(Default)]
pub(crate) struct Parked(Vec<(Scope, WaitQueue)>);

impl Parked {
    /// Where the waiters' answers go, for refusing them all (the move failed).
    pub fn into_replies(self) -> impl Iterator<Item = ReplyTo> {
        self.0.into_iter().flat_map(|(_, queue)| queue.waiters.into_iter().map(|w| w.reply))
    }
}

/// The refusal for a write while the disk holding the shard's file is full.
pub(crate) fn disk_full(shard: u32, path: &std::path::Path) -> Error {
    Error::DiskFull { shard, path: path.display().to_string() }
}

/// The refusal for a write that does not fit in the shard file.
pub(crate) fn file_full(shard: u32, config: &EngineConfig) -> Error {
    Error::ResourceExhausted {
        what: format!("shard {shard} file"),
        limit_name: "shard_file_bytes_max",
        limit: usize::try_from(config.store.sqlite().shard_file_bytes_max).unwrap_or(usize::MAX),
    }
}

/// A shard's stored records by state, as of its last commit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RecordCounts {
    /// Pending records (expired ones not yet reclaimed included).
    pub pending: u64,
    /// Completed records (expired ones not yet reclaimed included).
    pub completed: u64,
}
pub(crate) struct Book {
    pub next_token: u64,
    queues: HashMap<Scope, WaitQueue>,
    pub waiters_len: usize,
    /// The earliest instant a stored record becomes reclaimable, if known.
    pub next_reclaim_ms: Option<u64>,
    /// Stored records by state and tenant, as of the last commit.
    records: Tally,
    /// Changes to `records` by the transaction in progress.
    pub records_delta: Tally,
    /// Each tenant's most records on this shard.
    quotas: Quotas,
    /// The shard, as refusals name it.
    shard: u32,
}

impl Book {
    pub fn new(shard: u32, quotas: Quotas) -> Book {
        Book {
            shard,
            next_token: 1,
            queues: HashMap::new(),
            waiters_len: 0,
            next_reclaim_ms: None,
            records: Tally::default(),
            records_delta: Tally::default(),
            quotas,
        }
    }

    /// Sets the record counts read from a freshly opened store.
    pub fn reset_records(&mut self, records: Tally) {
        self.records = records;
        self.records_delta = Tally::default();
    }

    /// Forgets the counts of a transaction that did not commit.
    pub fn discard_delta(&mut self) {
        self.records_delta = Tally::default();
    }

    /// The refusal of `decision` when it would store a new record for a tenant already at
    /// its quota of records on this shard.
    pub fn quota_refusal(&self, scope: &Scope, prior: Option<&Record>, decision: &Decision) -> Option<Error> {
        if prior.is_some() || !matches!(decision.change, Change::Put(_)) {
            return None;
        }
        let stored = self.records.of(&scope.tenant) + self.records_delta.of(&scope.tenant);
        self.quotas.refusal(&scope.tenant, stored, self.shard)
    }

    /// Writes a decision's change, then keeps the alarm index, token counter and record
    /// counts in step. `prior` is the stored record the decision was made on.
    pub fn record(
        &mut self,
        txn: &Txn<'_>,
        scope: &Scope,
        prior: Option<&Record>,
        decision: &Decision,
    ) -> Result<(), StoreError> {
        let stored = match &decision.change {
            Change::Keep => return Ok(()),
            Change::Put(record) => {
                let at = txn.put(scope, record)?;
                self.next_reclaim_ms = Some(self.next_reclaim_ms.map_or(at, |n| n.min(at)));
                Some(record)
            }
            Change::Delete => {
                txn.delete(scope)?;
                None
            }
        };
        if decision.consumes_token() {
            self.next_token += 1;
        }
        self.records_delta.count(&scope.tenant, prior, -1);
        self.records_delta.count(&scope.tenant, stored, 1);
        Ok(())
    }

    /// The transaction committed: its record counts become true, and are returned for
    /// the shard to publish.
    pub fn settle(&mut self) -> RecordCounts {
        self.records.absorb(std::mem::take(&mut self.records_delta));
        RecordCounts {
            pending: self.records.pending.max(0) as u64,
            completed: self.records.completed.max(0) as u64,
        }
    }

    /// Whether parked reserves wait on `scope` (a change to it must wake them).
    pub fn has_waiters(&self, scope: &Scope) -> bool {
        self.queues.contains_key(scope)
    }

    /// The keys whose waiters are due at `now_ms`: their holder's lease ended or one of
    /// them reached its deadline.
    pub fn due(&self, now_ms: u64) -> Vec<Scope> {
        self.queues
            .iter()
            .filter(|(_, q)| q.lease_until_ms <= now_ms || q.waiters.iter().any(|w| w.deadline_ms <= now_ms))
            .map(|(scope, _)| scope.clone())
            .collect()
    }

    /// Every key with waiters (shutdown answers them all).
    pub fn waited_keys(&self) -> Vec<Scope> {
        self.queues.keys().cloned().collect()
    }

    /// The waited keys whose parked reserves would be answered at `now_ms` against the
    /// record `read` gives (any decision but `in progress`, or a wait run out): a shared
    /// store's poll reads every waited key and writes only for these. `decide` says it,
    /// as it says what [`Book::serve_waiters`] then does. Each other key's holder lease is
    /// taken as read: another node may have renewed it, and the shard's next alarm waits
    /// for it (left as last seen, the alarm fell due again at once, without end).
    pub fn changed_waits(
        &mut self,
        now_ms: u64,
        mut read: impl FnMut(&Scope) -> Result<Option<Record>, StoreError>,
    ) -> Result<Vec<Scope>, StoreError> {
        let next_token = self.next_token;
        let mut changed = Vec::new();
        for (scope, queue) in &mut self.queues {
            let record = read(scope)?;
            let mut answered = false;
            for waiter in &queue.waiters {
                let command = Command::Reserve(waiter.reserve.clone());
                match decide(record.as_ref(), &command, now_ms, next_token).reply {
                    Ok(Reply::Reserve(ReserveReply::InProgress { lease_until_ms, .. })) => {
                        queue.lease_until_ms = lease_until_ms;
                        answered = waiter.deadline_ms <= now_ms;
                    }
                    _ => answered = true,
                }
                if answered {
                    break;
                }
            }
            if answered {
                changed.push(scope.clone());
            }
        }
        Ok(changed)
    }

    /// Decides every parked reserve of `scope` on its own against the key as it is now:
    /// grants, replays and mismatches are answered at once; `in progress` only when the
    /// waiter's wait ran out (or, with `closing`, for all); the rest stay parked. Waiters
    /// whose caller has gone are dropped unanswered, never granted.
    pub fn serve_waiters(
        &mut self,
        txn: &Txn<'_>,
        scope: &Scope,
        now_ms: u64,
        closing: bool,
        full: &Error,
        outbox: &mut Outbox,
    ) -> Result<(), StoreError> {
        let Some(mut queue) = self.queues.remove(scope) else { return Ok(()) };
        let result = self.decide_waiters(txn, scope, &mut queue, now_ms, closing, full, outbox);
        // On failure the queue goes back too, so the failure path answers every waiter.
        if !queue.waiters.is_empty() {
            self.queues.insert(scope.clone(), queue);
        }
        self.count_waiters();
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn decide_waiters(
        &mut self,
        txn: &Txn<'_>,
        scope: &Scope,
        queue: &mut WaitQueue,
        now_ms: u64,
        closing: bool,
        full: &Error,
        outbox: &mut Outbox,
    ) -> Result<(), StoreError> {
        let mut record = txn.get(scope)?;
        let mut kept = VecDeque::with_capacity(queue.waiters.len());
        while let Some(waiter) = queue.waiters.pop_front() {
            if waiter.is_gone() {
                continue;
            }
            let command = Command::Reserve(waiter.reserve.clone());
            self.next_token = txn.next_token(self.next_token)?;
            let decision = decide(record.as_ref(), &command, now_ms, self.next_token);
            // A waiter granted a key whose record was released stores a new record.
            if let Some(refusal) = self.quota_refusal(scope, record.as_ref(), &decision) {
                outbox.push((waiter.reply, Err(refusal)));
                continue;
            }
            match self.record(txn, scope, record.as_ref(), &decision) {
                Ok(()) => {}
                Err(error) if super::batch::failed_alone(txn, &error) => {
                    outbox.push((waiter.reply, Err(full.clone())));
                    continue;
                }
                Err(error) => {
                    kept.push_back(waiter);
                    kept.append(&mut queue.waiters);
                    queue.waiters = kept;
                    return Err(error);
                }
            }
            match decision.change {
                Change::Keep => {}
                Change::Put(changed) => record = Some(changed),
                Change::Delete => record = None,
            }
            if let Ok(Reply::Reserve(ReserveReply::InProgress { lease_until_ms, .. })) = &decision.reply {
                queue.lease_until_ms = *lease_until_ms;
                if !closing && waiter.deadline_ms > now_ms {
                    kept.push_back(waiter);
                    continue;
                }
            }
            outbox.push((waiter.reply, decision.reply.map_err(Error::from)));
        }
        queue.waiters = kept;
        Ok(())
    }

    /// Drops the waiters whose caller has gone; returns how many.
    pub fn forget_gone(&mut self) -> usize {
        let before = self.waiters_len;
        for queue in self.queues.values_mut() {
            queue.waiters.retain(|w| !w.is_gone());
        }
        self.queues.retain(|_, q| !q.waiters.is_empty());
        self.count_waiters();
        before - self.waiters_len
    }

    fn count_waiters(&mut self) {
        self.waiters_len = self.queues.values().map(|q| q.waiters.len()).sum();
    }

    /// Takes every waiter out (the shard failed or stops): the caller answers them.
    pub fn drain_waiters(&mut self) -> Vec<ReplyTo> {
        self.waiters_len = 0;
        self.queues.drain().flat_map(|(_, q)| q.waiters.into_iter().map(|w| w.reply)).collect()
    }

    /// Takes out the parked reserves of the keys of `slots`, which are moving to another
    /// shard: they wait there, in the same order, with the same deadlines.
    pub fn take_parked(&mut self, slots: &Slots, routing: oncegate_core::route::Routing) -> Parked {
        let scopes: Vec<Scope> =
            self.queues.keys().filter(|scope| slots.contains(routing.slot_of(scope))).cloned().collect();
        let parked = scopes.into_iter().filter_map(|scope| self.queues.remove_entry(&scope)).collect();
        self.count_waiters();
        Parked(parked)
    }

    /// Parks reserves handed over with a slot that moved here, less those whose caller
    /// went while they moved (their nudge went to the source).
    pub fn adopt(&mut self, parked: Parked) {
        self.queues.extend(parked.0);
        self.count_waiters();
        self.forget_gone();
    }

    /// The earliest deadline among parked reserves and the leases they wait on.
    pub fn waiters_alarm_ms(&self) -> Option<u64> {
        self.queues
            .values()
            .flat_map(|q| std::iter::once(q.lease_until_ms).chain(q.waiters.iter().map(|w| w.deadline_ms)))
            .min()
    }

    /// Parks a reserve behind the key's holder, within the per-key and per-shard bounds
    /// (waiters whose caller has gone are dropped first and do not count); on refusal the
    /// reply sender comes back with the error.
    pub fn park(
        &mut self,
        config: &EngineConfig,
        scope: &Scope,
        reserve: &Reserve,
        now_ms: u64,
        lease_until_ms: u64,
        reply: ReplyTo,
    ) -> Result<(), (ReplyTo, Error)> {
        if let Some(error) = self.park_refusal(config, scope) {
            self.forget_gone();
            if self.park_refusal(config, scope).is_some() {
                return Err((reply, error));
            }
        }
        let queue = self
            .queues
            .entry(scope.clone())
            .or_insert_with(|| WaitQueue { waiters: VecDeque::new(), lease_until_ms });
        queue.lease_until_ms = lease_until_ms;
        queue.waiters.push_back(Waiter {
            reserve: reserve.clone(),
            deadline_ms: now_ms.saturating_add(reserve.wait_ms),
            reply,
        });
        self.waiters_len += 1;
        Ok(())
    }

    fn park_refusal(&self, config: &EngineConfig, scope: &Scope) -> Option<Error> {
        if self.waiters_len >= config.waiters_per_shard_max {
            return Some(Error::ResourceExhausted {
                what: "the shard's waiter list".to_owned(),
                limit_name: "waiters_per_shard_max",
                limit: config.waiters_per_shard_max,
            });
        }
        let key_len = self.queues.get(scope).map_or(0, |q| q.waiters.len());
        if key_len >= config.waiters_per_key_max {
            return Some(Error::ResourceExhausted {
                what: "the key's waiter list".to_owned(),
                limit_name: "waiters_per_key_max",
                limit: config.waiters_per_key_max,
            });
        }
        None
    }
}
