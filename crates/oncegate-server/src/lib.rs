//! The oncegate server: the gRPC front over the shard engine, with authentication,
//! limits and load shedding, the standard health and reflection services, and the
//! configuration file that sets it all up.
//!
//! The binary (`oncegate serve`) reads a [`Config`], opens the engine and calls
//! [`serve`]; tests do the same on port 0.

mod admin;
mod auth;
pub mod config;
mod gate;
mod status;
pub mod telemetry;

use std::future::Future;
use std::time::Duration;

use oncegate_engine::{Engine, ShardState};
use oncegate_proto::v1::gate_server::GateServer;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic_health::ServingStatus;

pub use admin::AdminService;
pub use auth::{AdminAuth, Auth, token_sha256};
pub use config::{
    AdminConfig, Config, ConfigError, LogConfig, LogFormat, ServerConfig, TenantConfig, TokenSha256,
};
pub use gate::{GateService, key_digest};
pub use status::{CODE_METADATA, FIELD_METADATA, grpc_code, status};

/// The fully qualified name of the gate service, as health checks name it.
pub const GATE_SERVICE_NAME: &str = "oncegate.v1.Gate";

/// Why the server could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The configuration's credentials could not be loaded.
    #[error("configuration: {0}")]
    Credentials(#[from] oncegate_core::Problem),
    /// The reflection service could not be built from the descriptor set.
    #[error("reflection: {0}")]
    Reflection(String),
    /// The listener failed.
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves `engine` on `listener` until `shutdown` resolves, then finishes in-flight calls
/// and returns. The caller shuts the engine down afterwards.
pub async fn serve(
    engine: Engine,
    config: &Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let server = &config.server;
    let auth = Auth::new(&config.tenants)?;
    if auth.is_open() {
        tracing::warn!(
            "no tenants configured: serving the `default` tenant without authentication (loopback only)"
        );
    }
    let engine_for_routes = engine.clone();
    let admin_auth = AdminAuth::new(config)?;
    let admin =
        oncegate_proto::v1::admin_server::AdminServer::new(AdminService::new(engine.clone(), admin_auth));
    let gate = GateServer::new(GateService::new(engine.clone(), auth, server.requests_in_flight_max))
        .max_decoding_message_size(server.message_bytes_max)
        .max_encoding_message_size(server.message_bytes_max);

    let (reporter, health) = tonic_health::server::health_reporter();
    // The first status is set before the listener accepts anything, so a health check
    // right after start-up never finds the service unregistered.
    let all_serving = engine.shard_states().iter().all(|s| *s == ShardState::Serving);
    set_health(&reporter, all_serving).await;
    let poll = Duration::from_millis(server.health_poll_ms);
    let health_task = tokio::spawn(report_health(engine, reporter.clone(), poll));

    let reflection = |builder: tonic_reflection::server::Builder<'static>| {
        builder
            .register_encoded_file_descriptor_set(oncegate_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection(tonic_reflection::server::Builder::configure())
        .build_v1()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    let reflection_v1alpha = reflection(tonic_reflection::server::Builder::configure())
        .build_v1alpha()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;

    // On the signal: report NOT_SERVING (so balancers stop sending), stop accepting, and
    // give in-flight calls `shutdown_grace_ms` to finish. Long-lived streams (health
    // watches) would otherwise hold the shutdown open for ever.
    let (signalled_tx, signalled_rx) = tokio::sync::oneshot::channel::<()>();
    let signal = async move {
        shutdown.await;
        let _ = signalled_tx.send(());
    };
    // gRPC and the plain HTTP routes (metrics, liveness, readiness) share one port.
    let mut routes = tonic::service::Routes::new(gate)
        .add_service(admin)
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);
    let grpc = std::mem::replace(routes.axum_router_mut(), axum::Router::new());
    *routes.axum_router_mut() = grpc.merge(telemetry::routes(engine_for_routes));
    telemetry::handle();
    let serving = tonic::transport::Server::builder()
        .accept_http1(true)
        .timeout(Duration::from_millis(server.request_timeout_ms))
        .max_concurrent_streams(Some(server.streams_per_connection_max))
        .http2_max_header_list_size(Some(server.metadata_bytes_max))
        .tcp_nodelay(true)
        .add_routes(routes)
        .serve_with_incoming_shutdown(incoming(listener), signal);
    let grace = Duration::from_millis(server.shutdown_grace_ms);
    let deadline = async move {
        if signalled_rx.await.is_ok() {
            health_task.abort();
            let _ = health_task.await;
            reporter.set_service_status("", ServingStatus::NotServing).await;
            reporter.set_service_status(GATE_SERVICE_NAME, ServingStatus::NotServing).await;
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        result = serving => result.map_err(ServeError::from),
        () = deadline => {
            tracing::warn!(grace_ms = server.shutdown_grace_ms, "shutdown grace elapsed; closing the remaining connections");
            Ok(())
        }
    }
}

/// The accepted connections, with Nagle's algorithm off. tonic's own `tcp_nodelay`
/// applies only to listeners it binds itself; without this, small replies wait for the
/// peer's delayed ACK (about 40 ms on Linux).
fn incoming(
    listener: TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> + Send + 'static {
    use tokio_stream::StreamExt;
    TcpListenerStream::new(listener).map(|accepted| {
        let stream = accepted?;
        stream.set_nodelay(true)?;
        Ok(stream)
    })
}

/// Keeps the health service in step with the shards: `SERVING` when every shard serves,
/// `NOT_SERVING` otherwise, for the whole server and for `oncegate.v1.Gate`.
async fn report_health(engine: Engine, reporter: tonic_health::server::HealthReporter, poll: Duration) {
    let mut last = engine.shard_states().iter().all(|s| *s == ShardState::Serving);
    set_health(&reporter, last).await;
    loop {
        tokio::time::sleep(poll).await;
        let all_serving = engine.shard_states().iter().all(|s| *s == ShardState::Serving);
        if all_serving != last {
            set_health(&reporter, all_serving).await;
            tracing::warn!(serving = all_serving, "health changed");
            last = all_serving;
        }
    }
}

async fn set_health(reporter: &tonic_health::server::HealthReporter, all_serving: bool) {
    let status = if all_serving { ServingStatus::Serving } else { ServingStatus::NotServing };
    reporter.set_service_status("", status).await;
    reporter.set_service_status(GATE_SERVICE_NAME, status).await;
}
