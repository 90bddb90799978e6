//! The gRPC port's first stop: a `Gate` call goes straight to its tonic service, and
//! every other request (Admin, health, reflection, the HTTP/JSON API) to the router.
//!
//! Through tonic's `Routes`, a call is routed by axum (a path lookup, a boxed clone of
//! the route's service and a boxed future) and its request and response bodies are each
//! wrapped twice more (tonic's body into axum's and back), so that every frame the call
//! reads or writes passes through two more dynamic calls. The `Gate` calls are the
//! product's hot path and their path prefix is fixed, so they skip all of it; the
//! router keeps everything else, where its flexibility is worth its cost.
//!
//! Every request is also counted on its connection (`activity::Activity`), which is what
//! the connection's idle timeout reads: a unary `Gate` call until its answer is ready
//! (the hot path keeps its body unwrapped, and a connection whose client never reads
//! unary answers is then idle and closed in time), any other request until the end of
//! its response's body (a `Session` stream, Admin's streams, the JSON API).
//!
//! Without tenants the port is an open development server on loopback, and a request
//! whose `Host` (or `:authority`) is not a loopback name or address is refused: a web page
//! whose name a DNS-rebinding attack points at 127.0.0.1 would otherwise reach every
//! service on it, Admin's purge included. With tenants, a call of the `Gate` service or
//! of the HTTP/JSON API whose bearer token names no tenant, and an Admin call without the
//! admin token, is refused here, from its head, before its body is read: otherwise anyone
//! could make the server hold an unfinished message (up to `server.message_bytes_max`,
//! and tonic's 4 MiB for Admin) on every stream of every connection. (The services
//! authenticate again: this is only the early answer.)

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use axum::http::{Request, Response};
use futures_util::future::Either;
use oncegate_proto::v1::gate_server::GateServer;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::Routes;
use tonic::transport::server::TlsConnectInfo;
use tower::{Layer, Service};

use crate::auth::{AdminAuth, Auth};
use crate::gate::GateService;
use crate::http::Arrived;
use crate::listen::ConnectionInfo;
use oncegate_listen::activity::{Activity, CountedBody, Open};

type Gate = GateServer<GateService>;
type Admin = oncegate_proto::v1::admin_server::AdminServer<crate::admin::AdminService>;

/// Puts [`Dispatch`] in front of the router (tonic's server takes it as a layer).
#[derive(Clone)]
pub(crate) struct DispatchLayer {
    gate: Gate,
    credentials: Credentials,
    loopback_hosts_only: bool,
}

/// How the `Gate` service and the API, and the Admin service, authenticate their callers.
#[derive(Clone)]
pub(crate) struct Credentials {
    pub tenants: Arc<Auth>,
    pub admin: AdminAuth,
}

impl DispatchLayer {
    /// `loopback_hosts_only`: refuse requests addressed to any other host (no tenants).
    pub(crate) fn new(gate: Gate, credentials: Credentials, loopback_hosts_only: bool) -> DispatchLayer {
        DispatchLayer { gate, credentials, loopback_hosts_only }
    }
}

impl Layer<Routes> for DispatchLayer {
    type Service = Dispatch;

    fn layer(&self, routes: Routes) -> Dispatch {
        Dispatch {
            gate: self.gate.clone(),
            credentials: self.credentials.clone(),
            routes,
            loopback_hosts_only: self.loopback_hosts_only,
        }
    }
}

/// Sends `/oncegate.v1.Gate/*` to the `Gate` service and everything else to `routes`.
#[derive(Clone)]
pub(crate) struct Dispatch {
    gate: Gate,
    credentials: Credentials,
    routes: Routes,
    loopback_hosts_only: bool,
}

/// Whether `path` names a method of `service` (`/oncegate.v1.Gate/Reserve`).
fn is_call_of(service: &str, path: &str) -> bool {
    path.strip_prefix('/')
        .and_then(|rest| rest.strip_prefix(service))
        .is_some_and(|method| method.len() > 1 && method.starts_with('/'))
}

/// Whether `path` names a method of the `Gate` service.
fn is_gate_call(path: &str) -> bool {
    is_call_of(Gate::NAME, path)
}

impl Service<Request<Body>> for Dispatch {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Counted<Either<<Gate as Service<Request<Body>>>::Future, Answering>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Both are always ready today; asking both keeps that an implementation detail.
        ready!(Service::<Request<Body>>::poll_ready(&mut self.gate, cx))?;
        Service::<Request<Body>>::poll_ready(&mut self.routes, cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let open = activity(&request).map(Activity::open);
        let grpc = request
            .headers()
            .get(axum::http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
        let path = request.uri().path();
        let unary_gate_call = grpc && is_gate_call(path) && !path.ends_with(SESSION_METHOD);
        let response = if self.loopback_hosts_only
            && let Some(host) = host(&request).filter(|host| !is_loopback_host(host))
        {
            let refused = misaddressed(host, grpc);
            Either::Right(Box::pin(std::future::ready(Ok(refused))) as Answering)
        } else if let Some(refused) = unauthenticated(&self.credentials, &request, grpc) {
            Either::Right(Box::pin(std::future::ready(Ok(refused))) as Answering)
        } else if grpc && is_gate_call(path) {
            Either::Left(self.gate.call(request))
        } else if !grpc && names_grpc_method(path) {
            // tonic would answer `200` with a gRPC status that an HTTP client reads as success.
            let refused = crate::http::grpc_method_over_http(request.method(), path).map(Body::new);
            Either::Right(Box::pin(std::future::ready(Ok(refused))) as Answering)
        } else {
            let mut request = request;
            request.extensions_mut().insert(Arrived(tokio::time::Instant::now()));
            Either::Right(Box::pin(self.routes.call(request)) as Answering)
        };
        Counted { response, open, body_counts: !unary_gate_call }
    }
}

/// The one streaming method of the `Gate` service, whose response body is long-lived.
const SESSION_METHOD: &str = "/Session";

/// A response from the router, or a refusal made here.
type Answering = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

/// The host a request is addressed to: HTTP/2's `:authority`, else HTTP/1.1's `Host`.
fn host(request: &Request<Body>) -> Option<&str> {
    if let Some(authority) = request.uri().authority() {
        return Some(authority.host());
    }
    let value = request.headers().get(axum::http::header::HOST)?.to_str().ok()?;
    // `host[:port]`, the host an IPv6 address in brackets.
    match value.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) && !host.is_empty() => Some(host),
        _ => Some(value),
    }
}

/// Whether `host` names this machine: `localhost` (or a name under it), or a loopback
/// address. (Every request of a server without tenants asks, so nothing is allocated.)
pub fn is_loopback_host(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']').trim_end_matches('.');
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return ip.is_loopback();
    }
    let (name, suffix) = (b"localhost".as_slice(), b".localhost".as_slice());
    let host = host.as_bytes();
    host.eq_ignore_ascii_case(name)
        || (host.len() > suffix.len() && host[host.len() - suffix.len()..].eq_ignore_ascii_case(suffix))
}

/// The answer to a request addressed to another host than this machine, in its
/// protocol's terms: gRPC's `PERMISSION_DENIED`, or a `403` problem document.
fn misaddressed(host: &str, grpc: bool) -> Response<Body> {
    let reason = format!(
        "this server has no tenants and answers only requests addressed to a loopback name or address, not \
         {host:?} (a page whose name was rebound to 127.0.0.1 must not reach it); configure tenants to serve \
         other names"
    );
    if grpc {
        return tonic::Status::permission_denied(reason).into_http();
    }
    crate::http::forbidden(reason).map(Body::new)
}

/// The refusal of a `Gate` call or an HTTP/JSON API call whose bearer token names no
/// tenant (counted as the services count theirs), or of an Admin call without the admin
/// token; none for any other request, or where the caller needs no token.
fn unauthenticated(credentials: &Credentials, request: &Request<Body>, grpc: bool) -> Option<Response<Body>> {
    let path = request.uri().path();
    if grpc && is_call_of(Admin::NAME, path) {
        return credentials.admin.check_headers(request.headers()).err().map(tonic::Status::into_http);
    }
    let auth = &credentials.tenants;
    if auth.is_open() {
        return None;
    }
    // An API path is the API's whatever the content type says (axum reads any
    // `application/*+json` body, `application/grpc+json` included).
    let (rpc, grpc) = match (api_rpc(request), gate_rpc(path)) {
        (Some(rpc), _) => (rpc, false),
        (None, Some(rpc)) if grpc => (rpc, true),
        _ => return None,
    };
    let refusal = auth.tenant_of_headers(request.headers()).err()?;
    crate::telemetry::record_call(rpc, None, refusal.code().as_str(), tokio::time::Instant::now());
    Some(if grpc { refusal.to_status().into_http() } else { crate::http::problem(&refusal).map(Body::new) })
}

/// The metrics' name of a `Gate` method (`/oncegate.v1.Gate/Reserve` is `reserve`).
fn gate_rpc(path: &str) -> Option<&'static str> {
    let method = path.strip_prefix('/')?.strip_prefix(Gate::NAME)?.strip_prefix('/')?;
    Some(match method {
        "Reserve" => "reserve",
        "Commit" => "commit",
        "Release" => "release",
        "Heartbeat" => "heartbeat",
        "Get" => "get",
        "Session" => "session",
        _ => return None,
    })
}

/// The metrics' name of an HTTP/JSON API call (`POST /v1/reserve` is `reserve`).
fn api_rpc(request: &Request<Body>) -> Option<&'static str> {
    use axum::http::Method;
    let path = request.uri().path();
    match *request.method() {
        Method::POST => match path {
            "/v1/reserve" => Some("reserve"),
            "/v1/commit" => Some("commit"),
            "/v1/release" => Some("release"),
            "/v1/heartbeat" => Some("heartbeat"),
            _ => None,
        },
        Method::GET if path.starts_with("/v1/namespaces/") => Some("get"),
        _ => None,
    }
}

/// Whether `path` is a gRPC method's (`/package.Service/Method`), of any service.
fn names_grpc_method(path: &str) -> bool {
    path.strip_prefix('/')
        .and_then(|rest| rest.split_once('/'))
        .is_some_and(|(service, _)| service.contains('.'))
}

/// The connection a request came on, as the accept loop describes it (none for a
/// request that came another way, as in tests below the transport).
fn activity(request: &Request<Body>) -> Option<&Arc<Activity>> {
    let extensions = request.extensions();
    extensions
        .get::<ConnectionInfo>()
        .map(|info| &info.activity)
        .or_else(|| extensions.get::<TlsConnectInfo<ConnectionInfo>>().map(|info| &info.get_ref().activity))
}

/// A response on its way, its request counted open on its connection until its body ends.
pub(crate) struct Counted<F> {
    response: F,
    open: Option<Open>,
    /// Whether the request stays open until its response body ends, not only until the
    /// response is ready.
    body_counts: bool,
}

impl<F> Future for Counted<F>
where
    F: Future<Output = Result<Response<Body>, Infallible>> + Unpin,
{
    type Output = Result<Response<Body>, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Ok(response) = ready!(Pin::new(&mut self.response).poll(cx));
        let response = match self.open.take() {
            Some(open) if self.body_counts => response.map(|body| Body::new(CountedBody::new(body, open))),
            _ => response,
        };
        Poll::Ready(Ok(response))
    }
}

#[cfg(test)]
mod tests {
    use super::{is_gate_call, is_loopback_host, names_grpc_method};

    #[test]
    fn loopback_hosts_are_localhost_and_loopback_addresses() {
        for host in [
            "localhost",
            "LOCALHOST",
            "api.localhost",
            "127.0.0.1",
            "127.8.9.10",
            "[::1]",
            "::1",
            "localhost.",
        ] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in ["evil.example", "localhost.evil.example", "10.0.0.1", "[::2]", "0.0.0.0", ""] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }

    #[test]
    fn a_grpc_method_is_named_by_a_package_qualified_service() {
        assert!(names_grpc_method("/oncegate.v1.Gate/Reserve"));
        assert!(names_grpc_method("/grpc.health.v1.Health/Check"));
        assert!(!names_grpc_method("/v1/reserve"));
        assert!(!names_grpc_method("/v1/namespaces/a.b/keys/k"));
        assert!(!names_grpc_method("/"));
    }

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
