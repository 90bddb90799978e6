//! The oncegate server: the gRPC front over the shard engine, with authentication,
//! limits and load shedding, the standard health and reflection services, and the
//! configuration file that sets it all up.
//!
//! The binary (`oncegate serve`) reads a [`Config`], opens the engine and calls
//! [`serve`]; tests do the same on port 0.

mod admin;
mod auth;
pub mod config;
mod dispatch;
mod gate;
pub mod http;
mod listen;
mod session;
mod status;
mod telemetry;
mod tenants;
mod tls;
mod traces;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use oncegate_engine::{Engine, ShardState};
use oncegate_proto::v1::gate_server::GateServer;
use tokio::net::TcpListener;
use tonic::service::Routes;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

pub(crate) use admin::AdminService;
pub use auth::token_sha256;
pub(crate) use auth::{AdminAuth, Auth};
pub use config::{
    AdminConfig, Config, ConfigError, LogConfig, LogFormat, ServerConfig, TelemetryConfig, TenantConfig,
    TenantEntry, TokenSha256,
};
pub use dispatch::is_loopback_host;
pub(crate) use gate::GateService;
use gate::SessionLimits;
pub use gate::key_digest;
use oncegate_listen::serve::HttpLimits;
pub use status::{CODE_METADATA, FIELD_METADATA, LIMIT_METADATA};
pub use tls::TlsError;
pub use traces::{TraceExport, TracesError, otlp_layer};

/// What this build is: its version, the git commit it was built from and the stores it
/// can keep records in, as `oncegate --version` prints it and `oncegate_build_info`
/// labels it.
pub mod build {
    /// The crate's version.
    pub const VERSION: &str = env!("CARGO_PKG_VERSION");
    /// The git commit (12 hex digits), or `unknown` outside a checkout.
    pub const COMMIT: &str = env!("ONCEGATE_GIT_COMMIT");

    /// The stores, comma-separated: `sqlite,postgres`.
    pub fn stores() -> String {
        oncegate_engine::STORE_KINDS.join(",")
    }

    /// The line `--version` prints after the program's name.
    pub fn long_version() -> &'static str {
        static LINE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        LINE.get_or_init(|| format!("{VERSION} (commit {COMMIT}, stores {})", stores()))
    }
}

/// The fully qualified name of the gate service, as health checks name it.
pub const GATE_SERVICE_NAME: &str = "oncegate.v1.Gate";

/// Why the server could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The configuration breaks a rule (every problem, each naming its key).
    #[error("configuration refused:\n  {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  "))]
    Config(Vec<oncegate_core::Problem>),
    /// A TLS file could not be used.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A listener could not be bound.
    #[error("{field} {addr}: {source}")]
    Bind {
        /// The setting that names the address.
        field: &'static str,
        /// The address.
        addr: SocketAddr,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// The reflection service could not be built from the descriptor set.
    #[error("the reflection service could not be built")]
    Reflection(#[source] tonic_reflection::server::Error),
    /// The gRPC server failed.
    #[error("transport: {}", tls::error_chain(.0))]
    Transport(#[from] tonic::transport::Error),
}

/// The sockets a server serves on.
pub struct Listeners {
    /// The gRPC port: `Gate`, `Admin`, health and reflection.
    pub gate: TcpListener,
    /// `/metrics`, `/healthz` and `/readyz`; `None` serves them nowhere.
    pub metrics: Option<TcpListener>,
}

impl Listeners {
    /// Binds `server.listen` and `server.metrics_listen`.
    pub async fn bind(server: &ServerConfig) -> Result<Listeners, ServeError> {
        let bind = |field, addr| async move {
            TcpListener::bind(addr).await.map_err(|source| ServeError::Bind { field, addr, source })
        };
        let gate = bind("server.listen", server.listen).await?;
        let metrics = bind("server.metrics_listen", server.metrics_listen).await?;
        Ok(Listeners { gate, metrics: Some(metrics) })
    }
}

/// Serves `engine` on `listeners` until `shutdown` resolves, then finishes in-flight calls
/// and returns. The caller shuts the engine down afterwards.
///
/// The configuration is checked first, with the exposure rules applied to the address
/// the gRPC listener is really bound to: an embedding program gets the same refusals as
/// `oncegate serve` (no tenants off loopback, tenants off loopback without TLS, an admin
/// token shared with a tenant, ...).
pub async fn serve(
    engine: Engine,
    config: &Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    serve_with_ready(engine, config, listeners, shutdown, || {}).await
}

/// [`serve`], calling `ready` once everything that can fail has been done (the checks,
/// the TLS files, the services) and the listeners are about to serve: where a service
/// manager hears READY.
pub async fn serve_with_ready(
    engine: Engine,
    config: &Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send,
    ready: impl FnOnce() + Send,
) -> Result<(), ServeError> {
    let server = &config.server;
    let gate_addr = listeners.gate.local_addr().map_err(|source| ServeError::Bind {
        field: "server.listen",
        addr: server.listen,
        source,
    })?;
    config.check_serving_on(gate_addr).map_err(ServeError::Config)?;
    let tls = tls::server_tls(server)?;
    if tls.is_none() && !gate_addr.ip().is_loopback() {
        tracing::warn!(%gate_addr, "serving tenants in plaintext off loopback (server.plaintext_allowed = true)");
    }
    let Services { gate, auth, routes, reporter } = services(&engine, config).await?;
    // Everything that can fail is done before a task is spawned.
    let loopback_hosts_only = config.tenants.is_empty();
    let credentials = dispatch::Credentials { tenants: auth, admin: AdminAuth::new(config) };
    let mut transport =
        transport(server, tls)?.layer(dispatch::DispatchLayer::new(gate, credentials, loopback_hosts_only));
    // On the signal: report NOT_SERVING (gRPC health and `/readyz`, so balancers stop
    // sending), stop accepting, and give in-flight calls `shutdown_grace_ms` to finish.
    // Long-lived streams (health watches) would otherwise hold the shutdown open for ever.
    let (stopping_tx, stopping) = tokio::sync::watch::channel(false);
    let poll = Duration::from_millis(server.health_poll_ms);
    let health_task = tokio::spawn(report_health(engine.clone(), reporter, poll, stopping.clone()));
    let metrics_task =
        listeners.metrics.map(|listener| spawn_metrics(listener, engine.clone(), server, stopping.clone()));
    let signal = async move {
        shutdown.await;
        let _ = stopping_tx.send(true);
    };
    let serving = transport
        .add_routes(routes)
        .serve_with_incoming_shutdown(listen::incoming(listeners.gate, server), signal);
    // The listeners accept from here (they were bound before the engine opened).
    ready();
    let grace = Duration::from_millis(server.shutdown_grace_ms);
    let deadline = async move {
        let mut stopping = stopping;
        // `false`: the server ended without a signal, so there is no grace to count.
        let signalled = stopping.wait_for(|stopping| *stopping).await.is_ok();
        if signalled {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    let served = tokio::select! {
        result = serving => result.map_err(ServeError::from),
        () = deadline => {
            tracing::warn!(grace_ms = server.shutdown_grace_ms, "shutdown grace elapsed; closing the remaining connections");
            Ok(())
        }
    };
    // Both tasks hold the engine; they have ended when `serve` returns. (Connections that
    // outlived the grace still hold the services, and with them the engine, until their
    // peers close them.)
    for task in std::iter::once(health_task).chain(metrics_task) {
        task.abort();
        let _ = task.await;
    }
    served
}

/// tonic's server with the configuration's transport settings and TLS.
fn transport(
    server: &ServerConfig,
    tls: Option<tonic::transport::ServerTlsConfig>,
) -> Result<tonic::transport::Server, ServeError> {
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls).map_err(|e| TlsError {
            field: "server.tls_cert_path",
            path: server.tls_cert_path.clone().unwrap_or_default(),
            reason: tls::error_chain(&e),
        })?;
    }
    if server.connection_age_max_ms > 0 {
        builder = builder
            .max_connection_age(Duration::from_millis(server.connection_age_max_ms))
            .max_connection_age_grace(Duration::from_millis(server.connection_age_grace_ms));
    }
    Ok(builder
        .accept_http1(true)
        .timeout(Duration::from_millis(server.request_timeout_ms))
        .max_concurrent_streams(Some(server.streams_per_connection_max))
        .http2_max_header_list_size(Some(server.metadata_bytes_max))
        .http2_keepalive_interval(
            (server.keepalive_interval_ms > 0).then(|| Duration::from_millis(server.keepalive_interval_ms)),
        )
        .http2_keepalive_timeout(Some(Duration::from_millis(server.keepalive_timeout_ms))))
}

/// Serves `/metrics`, `/healthz` and `/readyz` until the task is aborted; `/readyz`
/// fails, and keep-alive connections are closed, once `stopping` is true.
fn spawn_metrics(
    listener: TcpListener,
    engine: Engine,
    server: &ServerConfig,
    stopping: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    if let Ok(addr) = listener.local_addr()
        && !addr.ip().is_loopback()
    {
        tracing::warn!(%addr, "metrics are served off loopback; they name every tenant and its traffic");
    }
    let limits = HttpLimits {
        connections_max: (server.metrics_connections_max, "server.metrics_connections_max"),
        deadlines: server.connection_deadlines(),
        grace: Duration::from_millis(server.shutdown_grace_ms),
    };
    // The recorder is installed here, before the port accepts: installed by the task
    // below, it missed the calls made before the task first ran.
    telemetry::handle();
    tokio::spawn(async move {
        if let Err(error) = telemetry::serve(listener, engine, limits, stopping).await {
            tracing::error!(%error, "the metrics listener failed");
        }
    })
}

/// What the gRPC port serves.
struct Services {
    /// The `Gate` service, which [`dispatch`] calls without the router.
    gate: GateServer<GateService>,
    /// How callers are authenticated, which [`dispatch`] asks before a call's body is read.
    auth: Arc<Auth>,
    /// Admin, health, reflection and the HTTP/JSON API.
    routes: Routes,
    /// The health service's reporter, whose first status is set before the listener
    /// accepts anything, so that a health check right after start-up never finds the
    /// service unregistered.
    reporter: HealthReporter,
}

/// The largest message the services that need no credentials (health, reflection) read:
/// theirs are a service or symbol name, and anyone may send them, so they must not make
/// the server buffer tonic's default of 4 MiB a stream.
const UNAUTHENTICATED_MESSAGE_BYTES_MAX: usize = 4 * 1024;

async fn services(engine: &Engine, config: &Config) -> Result<Services, ServeError> {
    let server = &config.server;
    let tenants = config.tenant_entries().map_err(ServeError::Config)?;
    let auth = Auth::new(&tenants);
    if auth.is_open() {
        tracing::warn!(
            "no tenants configured: serving the `default` tenant without authentication (loopback only)"
        );
    }
    let admit = tenants::Admit::new(server.requests_in_flight_max, &tenants, engine.clock().clone());
    engine.set_records_per_shard_max(
        tenants
            .iter()
            .filter(|t| t.config.records_per_shard_max > 0)
            .map(|t| (t.tenant.clone(), t.config.records_per_shard_max))
            .collect(),
    );
    let admin = oncegate_proto::v1::admin_server::AdminServer::new(AdminService::new(
        engine.clone(),
        AdminAuth::new(config),
    ));
    let request_timeout = Duration::from_millis(server.request_timeout_ms);
    let session = SessionLimits {
        calls_in_flight_max: server.session_calls_in_flight_max,
        unsent_bytes_max: server.session_unsent_bytes_max,
    };
    let service = GateService::new(engine.clone(), auth, admit, session, request_timeout);
    let auth = Arc::clone(service.auth());
    let json = http::router(service.clone(), server.message_bytes_max, server.metadata_bytes_max as usize);
    let gate = GateServer::new(service)
        .max_decoding_message_size(server.message_bytes_max)
        .max_encoding_message_size(server.message_bytes_max);
    let (reporter, health) = tonic_health::server::health_reporter();
    let health = health.max_decoding_message_size(UNAUTHENTICATED_MESSAGE_BYTES_MAX);
    let all_serving = engine.shard_states().iter().all(|s| *s == ShardState::Serving);
    set_health(&reporter, all_serving).await;
    let reflection = |builder: tonic_reflection::server::Builder<'static>| {
        builder
            .register_encoded_file_descriptor_set(oncegate_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection(tonic_reflection::server::Builder::configure())
        .build_v1()
        .map_err(ServeError::Reflection)?
        .max_decoding_message_size(UNAUTHENTICATED_MESSAGE_BYTES_MAX);
    let reflection_v1alpha = reflection(tonic_reflection::server::Builder::configure())
        .build_v1alpha()
        .map_err(ServeError::Reflection)?
        .max_decoding_message_size(UNAUTHENTICATED_MESSAGE_BYTES_MAX);
    let routes =
        Routes::new(admin).add_service(health).add_service(reflection_v1).add_service(reflection_v1alpha);
    // The HTTP/JSON API shares the port: tonic's server takes HTTP/1.1 and hands every
    // request that is not gRPC to these routes.
    let routes = Routes::from(routes.into_axum_router().merge(json).fallback(http::fallback));
    Ok(Services { gate, auth, routes, reporter })
}
/// Keeps the health service in step with the shards: `SERVING` when every shard serves,
/// `NOT_SERVING` otherwise, for the whole server and for `oncegate.v1.Gate`.
async fn report_health(
    engine: Engine,
    reporter: HealthReporter,
    poll: Duration,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) {
    let mut last = engine.shard_states().iter().all(|s| *s == ShardState::Serving);
    set_health(&reporter, last).await;
    loop {
        // A closed channel means `serve` has ended: stop too.
        let stop = tokio::select! {
            () = tokio::time::sleep(poll) => false,
            _ = stopping.wait_for(|stopping| *stopping) => true,
        };
        if stop {
            set_health(&reporter, false).await;
            return;
        }
        let all_serving = engine.shard_states().iter().all(|s| *s == ShardState::Serving);
        if all_serving != last {
            set_health(&reporter, all_serving).await;
            tracing::warn!(serving = all_serving, "health changed");
            last = all_serving;
        }
    }
}

async fn set_health(reporter: &HealthReporter, all_serving: bool) {
    let status = if all_serving { ServingStatus::Serving } else { ServingStatus::NotServing };
    reporter.set_service_status("", status).await;
    reporter.set_service_status(GATE_SERVICE_NAME, status).await;
}
