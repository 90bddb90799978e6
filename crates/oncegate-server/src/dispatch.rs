//! The gRPC port's first stop: a `Gate` call goes straight to its tonic service, and
//! every other request (Admin, health, reflection, the HTTP/JSON API) to the router.
//!
//! Through tonic's `Routes`, a call is routed by axum (a path lookup, a boxed clone of
//! the route's service and a boxed future) and its request and response bodies are each
//! wrapped twice more (tonic's body into axum's and back), so that every frame the call
//! reads or writes passes through two more dynamic calls. The `Gate` calls are the
//! product's hot path and their path prefix is fixed, so they skip all of it; the
//! router keeps everything else, where its flexibility is worth its cost.

use std::convert::Infallible;
use std::task::{Context, Poll, ready};

use axum::http::{Request, Response};
use futures_util::future::Either;
use oncegate_proto::v1::gate_server::GateServer;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::Routes;
use tower::{Layer, Service};

use crate::gate::GateService;

type Gate = GateServer<GateService>;

/// Puts [`Dispatch`] in front of the router (tonic's server takes it as a layer).
#[derive(Clone)]
pub(crate) struct DispatchLayer {
    gate: Gate,
}

impl DispatchLayer {
    pub(crate) fn new(gate: Gate) -> DispatchLayer {
        DispatchLayer { gate }
    }
}

impl Layer<Routes> for DispatchLayer {
    type Service = Dispatch;

    fn layer(&self, routes: Routes) -> Dispatch {
        Dispatch { gate: self.gate.clone(), routes }
    }
}

/// Sends `/oncegate.v1.Gate/*` to the `Gate` service and everything else to `routes`.
#[derive(Clone)]
pub(crate) struct Dispatch {
    gate: Gate,
    routes: Routes,
}

/// When a request for the router reached the port: tonic's request timeout counts from
/// about then, and the HTTP API must answer before it does, however long the body took.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Arrived(pub tokio::time::Instant);

/// Whether `path` names a method of the `Gate` service (`/oncegate.v1.Gate/Reserve`).
fn is_gate_call(path: &str) -> bool {
    path.strip_prefix('/')
        .and_then(|rest| rest.strip_prefix(Gate::NAME))
        .is_some_and(|method| method.len() > 1 && method.starts_with('/'))
}

impl Service<Request<Body>> for Dispatch {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future =
        Either<<Gate as Service<Request<Body>>>::Future, <Routes as Service<Request<Body>>>::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Both are always ready today; asking both keeps that an implementation detail.
        ready!(Service::<Request<Body>>::poll_ready(&mut self.gate, cx))?;
        Service::<Request<Body>>::poll_ready(&mut self.routes, cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        if is_gate_call(request.uri().path()) {
            Either::Left(self.gate.call(request))
        } else {
            let mut request = request;
            request.extensions_mut().insert(Arrived(tokio::time::Instant::now()));
            Either::Right(self.routes.call(request))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::is_gate_call;

    #[test]
    fn only_a_method_of_the_gate_service_is_a_gate_call() {
        assert!(is_gate_call("/oncegate.v1.Gate/Reserve"));
        assert!(is_gate_call("/oncegate.v1.Gate/Session"));
        // The router answers these as it did before: its fallback, or another service.
        assert!(!is_gate_call("/oncegate.v1.Gate/"));
        assert!(!is_gate_call("/oncegate.v1.Gate"));
        assert!(!is_gate_call("/oncegate.v1.GateX/Reserve"));
        assert!(!is_gate_call("/oncegate.v1.Admin/Stats"));
        assert!(!is_gate_call("/v1/reserve"));
        assert!(!is_gate_call(""));
    }
}
