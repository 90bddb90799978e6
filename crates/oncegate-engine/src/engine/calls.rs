//! The API's calls: each is checked against the limits, turned into a command and
//! queued on its key's shard before its future is returned.

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::Ordering;

use crossbeam_channel::TrySendError;
use oncegate_core::gate::{CommitRequest, KeyRequest, Renewed, ReserveRequest, Reserved};
use oncegate_core::{Command, Commit, Namespace, Record, Reserve, Scope, State, Tenant, View, route};
use tokio::sync::oneshot;

use super::Engine;
use super::pending::{self, Narrow, Pending, ReserveKeys, StartedReserve};
use crate::error::Error;
use crate::shard::{Derive, Mail, Request, ShardState};

/// A request that breaks a rule between its fields.
fn rule(field: &'static str, rule: &'static str) -> Error {
    oncegate_core::Invalid::Rule { field, rule }.into()
}

/// Refuses derived-key fields on a reserve that names its key.
fn only_with_key_parts(request: &ReserveRequest) -> Result<(), Error> {
    if request.bucket_ms != 0 {
        return Err(rule("bucket_ms", "only applies with key_parts"));
    }
    if request.bucket_grace_ms != 0 {
        return Err(rule("bucket_grace_ms", "only applies with key_parts"));
    }
    Ok(())
}

impl Engine {
    /// The format derived keys take: the directory's routing, or a shared store's as its
    /// schema records it (known once a shard has opened).
    fn derived_format(&self) -> Result<route::Routing, Error> {
        self.inner.cx.floor.format.get().copied().ok_or_else(|| self.not_yet_opened())
    }

    fn not_yet_opened(&self) -> Error {
        let shard = self.shard_states().iter().position(|s| *s != ShardState::Serving).unwrap_or(0) as u32;
        let reason = "derived keys wait until every shard has opened once (its clock mark is unknown)";
        Error::Unavailable { shard, reason: reason.to_owned() }
    }

    /// `now` for deriving keys in a directory routed by whole keys: the process's frame,
    /// never below any shard's persisted mark. Until every shard has opened once the
    /// marks are not all known, and a key bucketed by a clock that may be behind could
    /// land in another bucket than its first attempt (and so on another shard): derived
    /// keys are refused until then.
    fn derive_now_ms(&self) -> Result<u64, Error> {
        let floor = &self.inner.cx.floor;
        if floor.unopened.load(Ordering::SeqCst) > 0 {
            return Err(self.not_yet_opened());
        }
        let monotonic = self.inner.cx.clock.monotonic_ms();
        let mut frame = self.inner.frame.lock().unwrap_or_else(|p| p.into_inner());
        frame.raise(floor.high_water_ms.load(Ordering::SeqCst));
        Ok(frame.read(monotonic))
    }

    /// Queues a request on its slot's shard, or holds it while the slot moves; either
    /// way under the table's read lock (`routes.rs` says why).
    fn submit<T>(&self, scope: Scope, command: Command, narrow: Narrow<T>) -> Result<Pending<T>, Error> {
        self.send(scope, command, None, narrow)
    }

    fn send<T>(
        &self,
        scope: Scope,
        command: Command,
        derive: Option<Box<Derive>>,
        narrow: Narrow<T>,
    ) -> Result<Pending<T>, Error> {
        let slot = self.inner.cx.slots.routing.slot_of(&scope);
        let table = self.inner.table();
        let shard = table.map.owner(slot);
        if self.inner.closing.load(Ordering::Acquire) {
            return Err(Error::Unavailable { shard, reason: "the engine is shutting down".to_owned() });
        }
        let (reply, rx) = oneshot::channel();
        let handle = &table.shards[shard as usize];
        let span = tracing::Span::current();
        span.record("shard", shard);
        let request = Request { scope, command, reply, span, derive };
        let sent = match table.moving.as_ref().filter(|moving| moving.step.slots.contains(slot)) {
            Some(moving) => moving.hold(request, self.inner.cx.config.mailbox_depth_max),
            None => handle.data.try_send(Mail::Call(request)).map_err(|error| match error {
                TrySendError::Full(_) => Error::ResourceExhausted {
                    what: format!("shard {shard} mailbox"),
                    limit_name: "mailbox_depth_max",
                    limit: self.inner.cx.config.mailbox_depth_max,
                },
                TrySendError::Disconnected(_) => Pending::<T>::lost(shard),
            }),
        };
        let engine = Arc::downgrade(&self.inner);
        sent.map(|()| Pending { shard, rx: Some(rx), narrow, gone: handle.gone.clone(), slot, engine })
    }

    /// Validates a key's address against the limits.
    pub fn scope(&self, tenant: &Tenant, namespace: &str, key: &str) -> Result<Scope, Error> {
        Ok(Scope {
            tenant: tenant.clone(),
            namespace: Namespace::new(namespace)?,
            key: self.limits().key(key)?,
        })
    }

    fn start_reserve(&self, tenant: &Tenant, request: ReserveRequest) -> Result<StartedReserve, Error> {
        let limits = self.limits();
        let namespace = Namespace::new(&request.namespace)?;
        let reserve = Reserve {
            ttl_ms: limits.ttl_ms(request.ttl_ms)?,
            lease_ms: limits.lease_ms(request.lease_ms)?,
            fingerprint: limits.fingerprint(&request.fingerprint)?,
            wait_ms: limits.wait_ms(request.wait_ms)?,
        };
        match (request.key.is_empty(), request.key_parts.is_empty()) {
            (false, true) => {
                only_with_key_parts(&request)?;
                let key = limits.key(&request.key)?;
                let scope = Scope { tenant: tenant.clone(), namespace, key: key.clone() };
                let pending = self.submit(scope, Command::Reserve(reserve), pending::reserve)?;
                Ok(StartedReserve { keys: ReserveKeys::Known(key), pending })
            }
            (true, false) => self.start_derived(tenant, namespace, &request, reserve),
            (false, false) => Err(rule("key_parts", "send either key or key_parts, not both")),
            (true, true) => Err(oncegate_core::Invalid::Empty { field: "key" }.into()),
        }
    }

    /// A reserve sent as parts. Routed by bucket base, every bucket of the key lives on
    /// one shard, which names the key from its batch's time (and, within the grace, looks
    /// at the previous bucket's first): time and decision come from one transaction, so a
    /// retry read after a boundary can never be decided before a first attempt read
    /// before it, on one node or, on a shared database, across nodes. Routed by whole
    /// keys (older directories), the key is derived here and sent as a named one.
    fn start_derived(
        &self,
        tenant: &Tenant,
        namespace: Namespace,
        request: &ReserveRequest,
        reserve: Reserve,
    ) -> Result<StartedReserve, Error> {
        let limits = self.limits();
        let format = self.derived_format()?;
        if request.bucket_grace_ms > 0 && format == route::Routing::WholeKey {
            return Err(rule(
                "bucket_grace_ms",
                "needs bucket routing, which this data directory predates: its derived keys' buckets may live on different shards",
            ));
        }
        let derived =
            limits.derived(&request.key_parts, request.bucket_ms, request.bucket_grace_ms, format)?;
        if format == route::Routing::WholeKey {
            let key = limits.key(&derived.key(derived.bucket_of(self.derive_now_ms()?)))?;
            let scope = Scope { tenant: tenant.clone(), namespace, key: key.clone() };
            let pending = self.submit(scope, Command::Reserve(reserve), pending::reserve)?;
            return Ok(StartedReserve { keys: ReserveKeys::Known(key), pending });
        }
        // Routed by its base, as every bucket's key is.
        let base = Scope { tenant: tenant.clone(), namespace, key: limits.key(derived.base())? };
        let named = Arc::new(OnceLock::new());
        let derive = Box::new(Derive { derived, named: Arc::clone(&named) });
        let pending = self.send(base, Command::Reserve(reserve), Some(derive), pending::reserve)?;
        Ok(StartedReserve { keys: ReserveKeys::Derived(named), pending })
    }

    fn start_commit(&self, tenant: &Tenant, request: CommitRequest) -> Result<Pending<u64>, Error> {
        let scope = self.scope(tenant, &request.namespace, &request.key)?;
        let token = self.limits().token(request.token)?;
        self.limits().response(&request.response)?;
        let command = Command::Commit(Commit { token, outcome: request.outcome, response: request.response });
        self.submit(scope, command, pending::commit)
    }

    fn start_release(&self, tenant: &Tenant, request: &KeyRequest) -> Result<Pending<()>, Error> {
        let scope = self.scope(tenant, &request.namespace, &request.key)?;
        let token = self.limits().token(request.token)?;
        self.submit(scope, Command::Release { token }, pending::release)
    }

    fn start_heartbeat(&self, tenant: &Tenant, request: &KeyRequest) -> Result<Pending<Renewed>, Error> {
        let scope = self.scope(tenant, &request.namespace, &request.key)?;
        let token = self.limits().token(request.token)?;
        let lease_ms = self.limits().lease_ms(request.lease_ms)?;
        self.submit(scope, Command::Heartbeat { token, lease_ms }, pending::heartbeat)
    }

    fn start_get(&self, tenant: &Tenant, request: &KeyRequest) -> Result<Pending<View>, Error> {
        let scope = self.scope(tenant, &request.namespace, &request.key)?;
        self.submit(scope, Command::Get, pending::get)
    }

    // The async methods submit the request before they return the future, so calls made
    // one after another from one thread reach a shard in that order, whether or not (and
    // whenever) the futures are polled. The futures borrow nothing from the engine.

    /// May this attempt proceed? Granted, in progress, completed (replay) or mismatch.
    pub fn reserve(
        &self,
        tenant: &Tenant,
        request: ReserveRequest,
    ) -> impl Future<Output = Result<Reserved, Error>> + Send + 'static + use<> {
        let started = self.start_reserve(tenant, request);
        async move {
            let StartedReserve { keys, pending } = started?;
            let shard = pending.shard;
            let reply = pending.wait().await?;
            Ok(Reserved { key: keys.answered(shard)?, reply })
        }
    }

    /// Stores the holder's outcome and response; returns the record's expiry.
    pub fn commit(
        &self,
        tenant: &Tenant,
        request: CommitRequest,
    ) -> impl Future<Output = Result<u64, Error>> + Send + 'static + use<> {
        let started = self.start_commit(tenant, request);
        async move { started?.wait().await }
    }

    /// Gives the key up so a retry may proceed.
    pub fn release(
        &self,
        tenant: &Tenant,
        request: KeyRequest,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'static + use<> {
        let started = self.start_release(tenant, &request);
        async move { started?.wait().await }
    }

    /// Renews the holder's lease.
    pub fn heartbeat(
        &self,
        tenant: &Tenant,
        request: KeyRequest,
    ) -> impl Future<Output = Result<Renewed, Error>> + Send + 'static + use<> {
        let started = self.start_heartbeat(tenant, &request);
        async move { started?.wait().await }
    }

    /// Reads the key's state.
    pub fn get(
        &self,
        tenant: &Tenant,
        request: KeyRequest,
    ) -> impl Future<Output = Result<View, Error>> + Send + 'static + use<> {
        let started = self.start_get(tenant, &request);
        async move { started?.wait().await }
    }

    /// Operator: the whole live record of a key (none when it is free), and its shard.
    pub fn inspect(
        &self,
        scope: Scope,
    ) -> impl Future<Output = Result<(u32, State, Option<Record>), Error>> + Send + 'static + use<> {
        let shard = self.shard_of(&scope);
        let started = self.submit(scope, Command::Inspect, pending::inspect);
        async move {
            let (state, record) = started?.wait().await?;
            Ok((shard, state, record))
        }
    }

    /// Operator: frees a pending or abandoned key whatever its token; the next reserve
    /// is granted with a greater token. Returns the state and token that were removed.
    pub fn force_release(
        &self,
        scope: Scope,
    ) -> impl Future<Output = Result<(State, u64), Error>> + Send + 'static + use<> {
        self.remove(scope, Command::ForceRelease)
    }

    /// Operator: deletes a key's live record in any state, completion included.
    pub fn purge(
        &self,
        scope: Scope,
    ) -> impl Future<Output = Result<(State, u64), Error>> + Send + 'static + use<> {
        self.remove(scope, Command::Purge)
    }

    fn remove(
        &self,
        scope: Scope,
        command: Command,
    ) -> impl Future<Output = Result<(State, u64), Error>> + Send + 'static + use<> {
        let started = self.submit(scope, command, pending::removed);
        async move { started?.wait().await }
    }

    /// [`Engine::reserve`] for synchronous callers (not from inside an async task).
    pub fn reserve_blocking(&self, tenant: &Tenant, request: ReserveRequest) -> Result<Reserved, Error> {
        let StartedReserve { keys, pending } = self.start_reserve(tenant, request)?;
        let shard = pending.shard;
        let reply = pending.wait_blocking()?;
        Ok(Reserved { key: keys.answered(shard)?, reply })
    }

    /// [`Engine::commit`] for synchronous callers.
    pub fn commit_blocking(&self, tenant: &Tenant, request: CommitRequest) -> Result<u64, Error> {
        self.start_commit(tenant, request)?.wait_blocking()
    }

    /// [`Engine::release`] for synchronous callers.
    pub fn release_blocking(&self, tenant: &Tenant, request: KeyRequest) -> Result<(), Error> {
        self.start_release(tenant, &request)?.wait_blocking()
    }

    /// [`Engine::heartbeat`] for synchronous callers.
    pub fn heartbeat_blocking(&self, tenant: &Tenant, request: KeyRequest) -> Result<Renewed, Error> {
        self.start_heartbeat(tenant, &request)?.wait_blocking()
    }

    /// [`Engine::get`] for synchronous callers.
    pub fn get_blocking(&self, tenant: &Tenant, request: KeyRequest) -> Result<View, Error> {
        self.start_get(tenant, &request)?.wait_blocking()
    }
}
