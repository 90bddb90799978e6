//! Admission: the limits a call must pass before it reaches the engine. The server's
//! in-flight limit sheds load; each tenant's in-flight, waiter and rate limits keep one
//! tenant from taking what all tenants share (the shards' mailboxes and waiter lists, and
//! the disk that every write fills).
//!
//! The per-tenant table is a `DashMap` read by every tokio worker on every call; the rate
//! limiters are `governor`'s (GCRA), reading the engine's monotonic clock so that tests
//! drive them with the same manual clock as every other decision.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use governor::clock::Clock as _;
use governor::middleware::NoOpMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use oncegate_core::Tenant;
use oncegate_engine::Clock;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::TenantEntry;
use crate::status::Refusal;

/// What a call asks of the limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Demand {
    /// New work or a read (reserve, get): the tenant's in-flight limit and rate apply,
    /// and its waiter limit too when the call `waits` (a reserve with `wait_ms > 0`).
    Start {
        /// Whether the call may park as a waiter.
        waits: bool,
    },
    /// A heartbeat: it keeps work the gate already admitted, so the tenant's in-flight
    /// and request-rate quota never refuse it (a lease would lapse and the work be
    /// granted again); the server's limit and the tenant's `finishes_per_s` do, since
    /// each is a durable write that a client could send as fast as it likes.
    Keep,
    /// A commit or a release: it ends work the gate already admitted; as a heartbeat,
    /// but counted in a bucket of its own, so that heartbeats sent in a loop never
    /// starve the commits of the tenant's other work (a commit refused for long lets its
    /// lease lapse and the work run again). A commit with a stale token still costs a
    /// synced batch, so these are bounded too.
    Finish,
}

/// What an admitted call holds until it finishes; dropping it gives the slots back.
pub(crate) struct Admission {
    _server: OwnedSemaphorePermit,
    _tenant: Option<OwnedSemaphorePermit>,
    _waiter: Option<OwnedSemaphorePermit>,
}

/// What an answered call keeps until its answer leaves (a `Session` answer its client has
/// not read): its place among its tenant's calls in flight. The server's place and a
/// waiter's go back with the engine's answer, so that unread answers cost only their own
/// tenant, never every tenant's share of the server.
pub(crate) struct TenantPlace(#[allow(dead_code, reason = "held for its drop")] OwnedSemaphorePermit);

impl Admission {
    /// The engine answered: the server's place and a waiter's are given back; the
    /// tenant's (none for a finishing call or the open tenant) is kept by the answer.
    pub(crate) fn answered(self) -> Option<TenantPlace> {
        self._tenant.map(TenantPlace)
    }
}

/// The engine's monotonic clock, in the form `governor` reads.
#[derive(Clone)]
struct MonotonicClock(Arc<dyn Clock>);

impl governor::clock::Clock for MonotonicClock {
    type Instant = Duration;

    fn now(&self) -> Duration {
        Duration::from_millis(self.0.monotonic_ms())
    }
}

type Limiter = RateLimiter<NotKeyed, InMemoryState, MonotonicClock, NoOpMiddleware<Duration>>;

struct Rate {
    limiter: Limiter,
    per_s: u32,
    burst: u32,
    /// The setting that names it.
    limit: &'static str,
}

impl Rate {
    fn new(per_s: u32, burst: u32, limit: &'static str, clock: &MonotonicClock) -> Option<Rate> {
        let per_s = NonZeroU32::new(per_s)?;
        let burst = NonZeroU32::new(burst).unwrap_or(per_s);
        let quota = Quota::per_second(per_s).allow_burst(burst);
        let limiter = RateLimiter::direct_with_clock(quota, clock.clone());
        Some(Rate { limiter, per_s: per_s.get(), burst: burst.get(), limit })
    }

    fn spend(&self, tenant: &Tenant, clock: &MonotonicClock) -> Result<(), Refusal> {
        self.limiter.check().map_err(|not_until| Refusal::RateLimited {
            tenant: tenant.clone(),
            limit: self.limit,
            per_s: self.per_s,
            burst: self.burst,
            retry_after_ms: not_until.wait_time_from(clock.now()).as_millis().max(1) as u64,
        })
    }
}

/// One tenant's limits and what it holds of them.
struct TenantLimits {
    in_flight: Arc<Semaphore>,
    in_flight_max: usize,
    waiters: Arc<Semaphore>,
    waiters_max: usize,
    sessions: Arc<Semaphore>,
    sessions_max: usize,
    rate: Option<Rate>,
    /// Heartbeats, and commits with releases: `finishes_per_s` each.
    keep_rate: Option<Rate>,
    finish_rate: Option<Rate>,
}

impl TenantLimits {
    fn new(entry: &TenantEntry, clock: &MonotonicClock) -> TenantLimits {
        let config = &entry.config;
        let rate = Rate::new(config.requests_per_s, config.burst(), "tenants[].requests_per_s", clock);
        let (finishes, burst) = (config.finishes_rate(), config.finishes_burst());
        let keep_rate = Rate::new(finishes, burst, "tenants[].finishes_per_s", clock);
        let finish_rate = Rate::new(finishes, burst, "tenants[].finishes_per_s", clock);
        TenantLimits {
            in_flight: Arc::new(Semaphore::new(config.requests_in_flight_max)),
            in_flight_max: config.requests_in_flight_max,
            waiters: Arc::new(Semaphore::new(config.waiters_max)),
            waiters_max: config.waiters_max,
            sessions: Arc::new(Semaphore::new(config.sessions_max)),
            sessions_max: config.sessions_max,
            rate,
            keep_rate,
            finish_rate,
        }
    }

    fn in_flight_slot(&self) -> Result<OwnedSemaphorePermit, Refusal> {
        Arc::clone(&self.in_flight).try_acquire_owned().map_err(|_| Refusal::Exhausted {
            what: "the tenant's calls in flight are at its limit",
            limit: "tenants[].requests_in_flight_max",
            value: self.in_flight_max as u64,
        })
    }

    fn waiter_slot(&self) -> Result<OwnedSemaphorePermit, Refusal> {
        Arc::clone(&self.waiters).try_acquire_owned().map_err(|_| Refusal::Exhausted {
            what: "the tenant's waiting reserves are at its limit",
            limit: "tenants[].waiters_max",
            value: self.waiters_max as u64,
        })
    }

    fn session_slot(&self) -> Result<OwnedSemaphorePermit, Refusal> {
        Arc::clone(&self.sessions).try_acquire_owned().map_err(|_| Refusal::Exhausted {
            what: "the tenant's open Session streams are at its limit",
            limit: "tenants[].sessions_max",
            value: self.sessions_max as u64,
        })
    }

    fn spend_rate(&self, tenant: &Tenant, clock: &MonotonicClock) -> Result<(), Refusal> {
        self.rate.as_ref().map_or(Ok(()), |rate| rate.spend(tenant, clock))
    }
}

/// The server's and every tenant's limits.
pub(crate) struct Admit {
    server: Arc<Semaphore>,
    server_max: usize,
    tenants: DashMap<Tenant, TenantLimits>,
    clock: MonotonicClock,
}

impl Admit {
    /// Limits for the configured tenants; without tenants, the open `default` tenant has
    /// the server's limits only.
    pub fn new(server_max: usize, tenants: &[TenantEntry], clock: Arc<dyn Clock>) -> Admit {
        let clock = MonotonicClock(clock);
        let table = DashMap::with_capacity(tenants.len());
        for entry in tenants {
            table.insert(entry.tenant.clone(), TenantLimits::new(entry, &clock));
        }
        Admit { server: Arc::new(Semaphore::new(server_max)), server_max, tenants: table, clock }
    }

    /// Takes the call's slots, or refuses it naming the limit it would pass. The
    /// tenant's own limits are tried first, so a tenant over its quota is told so rather
    /// than that the server is busy (a heartbeat, commit or release, which holds no tenant
    /// slot, takes the server's first); the rate is taken last, so that a call refused for
    /// another reason does not spend it.
    pub fn admit(&self, tenant: &Tenant, demand: Demand) -> Result<Admission, Refusal> {
        let waits = match demand {
            Demand::Start { waits } => waits,
            Demand::Keep | Demand::Finish => {
                // The server's slot first, so that a call it refuses spends no rate.
                let server = self.server_slot()?;
                let limits = self.tenants.get(tenant);
                let rate = limits.as_ref().and_then(|limits| match demand {
                    Demand::Keep => limits.keep_rate.as_ref(),
                    _ => limits.finish_rate.as_ref(),
                });
                if let Some(rate) = rate {
                    rate.spend(tenant, &self.clock)?;
                }
                return Ok(Admission { _server: server, _tenant: None, _waiter: None });
            }
        };
        let limits = self.tenants.get(tenant);
        let tenant_slot = limits.as_ref().map(|l| l.in_flight_slot()).transpose()?;
        let waiter = match (&limits, waits) {
            (Some(limits), true) => Some(limits.waiter_slot()?),
            _ => None,
        };
        let server = self.server_slot()?;
        if let Some(limits) = &limits {
            limits.spend_rate(tenant, &self.clock)?;
        }
        Ok(Admission { _server: server, _tenant: tenant_slot, _waiter: waiter })
    }

    /// A place among the tenant's open `Session` streams, held while the stream is open,
    /// or the refusal naming the limit. The open `default` tenant (no tenants configured)
    /// has no such limit.
    pub fn open_session(&self, tenant: &Tenant) -> Result<Option<OwnedSemaphorePermit>, Refusal> {
        self.tenants.get(tenant).map(|limits| limits.session_slot()).transpose()
    }

    fn server_slot(&self) -> Result<OwnedSemaphorePermit, Refusal> {
        Arc::clone(&self.server).try_acquire_owned().map_err(|_| Refusal::Exhausted {
            what: "the server's calls in flight are at its limit",
            limit: "server.requests_in_flight_max",
            value: self.server_max as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TenantConfig;

    fn entry(name: &str, in_flight: usize) -> TenantEntry {
        let config =
            TenantConfig { name: name.into(), requests_in_flight_max: in_flight, ..TenantConfig::default() };
        TenantEntry { tenant: Tenant::new(name).expect("a valid name"), token_sha256: [0; 32], config }
    }

    /// An answered call keeps its tenant's place (a `Session` answer until it leaves) but
    /// gives the server's back: answers one tenant's client does not read take that
    /// tenant's limit, never the other tenants' share of the server. (The whole admission
    /// was kept, so unread answers of one tenant could take every server place.)
    #[test]
    fn an_answered_call_keeps_its_tenants_place_and_gives_the_servers_back() {
        let clock: Arc<dyn Clock> = Arc::new(oncegate_engine::ManualClock::new(0));
        let admit = Admit::new(1, &[entry("slow", 1), entry("other", 1)], clock);
        let (slow, other) = (Tenant::new("slow").unwrap(), Tenant::new("other").unwrap());
        let start = Demand::Start { waits: false };
        let answered = admit.admit(&slow, start).expect("admitted").answered();
        assert!(answered.is_some(), "the answer keeps the tenant's place");
        assert!(admit.admit(&slow, start).is_err(), "the tenant's one place is taken");
        admit.admit(&other, start).expect("the server's one place was given back");
        assert!(admit.admit(&slow, Demand::Finish).expect("a finishing call").answered().is_none());
    }
}
