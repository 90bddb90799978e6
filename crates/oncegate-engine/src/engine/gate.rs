//! The engine as a [`Gate`]: the same calls as a remote client's, for one tenant, so that
//! code written against `Gate` (the client crate's `once`, the proxy) runs in process.

use std::future::Future;

use oncegate_core::gate::{CommitRequest, Gate, GateError, KeyRequest, Renewed, ReserveRequest, Reserved};
use oncegate_core::{Code, Tenant, View};

use super::Engine;
use crate::error::Error;

impl GateError for Error {
    fn code(&self) -> Code {
        Error::code(self)
    }
}

/// The engine's calls on behalf of one tenant ([`Engine::gate`]); cheap to clone.
#[derive(Clone)]
pub struct TenantGate {
    engine: Engine,
    tenant: Tenant,
}

impl Engine {
    /// The engine as a [`Gate`] for `tenant` (a remote client's tenant is its bearer
    /// token's; in process it is named here).
    pub fn gate(&self, tenant: Tenant) -> TenantGate {
        TenantGate { engine: self.clone(), tenant }
    }
}

impl Gate for TenantGate {
    type Error = Error;

    fn reserve(&self, request: ReserveRequest) -> impl Future<Output = Result<Reserved, Error>> + Send {
        self.engine.reserve(&self.tenant, request)
    }

    fn commit(&self, request: CommitRequest) -> impl Future<Output = Result<u64, Error>> + Send {
        self.engine.commit(&self.tenant, request)
    }

    fn release(&self, request: KeyRequest) -> impl Future<Output = Result<(), Error>> + Send {
        self.engine.release(&self.tenant, request)
    }

    fn heartbeat(&self, request: KeyRequest) -> impl Future<Output = Result<Renewed, Error>> + Send {
        self.engine.heartbeat(&self.tenant, request)
    }

    fn get(&self, request: KeyRequest) -> impl Future<Output = Result<View, Error>> + Send {
        self.engine.get(&self.tenant, request)
    }
}
