//! `oncegate proxy`: the Idempotency-Key reverse proxy in front of `--upstream`, on the
//! engine in process (`--data-dir`) or on a remote oncegate (`--gate URL --token ...`).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use oncegate_client::Client;
use oncegate_engine::{Engine, EngineConfig};
use oncegate_proxy::ProxyConfig;

/// Flags of `oncegate proxy`.
#[derive(clap::Args)]
pub struct ProxyArgs {
    /// Where the proxy listens.
    #[arg(long, env = "ONCEGATE_PROXY_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// The service behind the proxy, `http://HOST:PORT`.
    #[arg(long, env = "ONCEGATE_PROXY_UPSTREAM")]
    upstream: String,
    /// Keys live in this data directory (the engine in process); the default without --gate.
    #[arg(long, env = "ONCEGATE_DATA_DIR", conflicts_with = "gate")]
    data_dir: Option<PathBuf>,
    /// Keys live on this remote oncegate instead.
    #[arg(long, env = "ONCEGATE_PROXY_GATE")]
    gate: Option<String>,
    /// The bearer token for --gate.
    #[arg(long, env = "ONCEGATE_TOKEN", hide_env_values = true, requires = "gate")]
    token: Option<String>,
    /// The CA certificate (PEM) of an https:// --gate.
    #[arg(long, env = "ONCEGATE_TLS_CA", requires = "gate")]
    tls_ca: Option<PathBuf>,
    /// A path prefix whose POST and PATCH requests must carry an Idempotency-Key (400
    /// without one); repeat for each.
    #[arg(long = "require-key")]
    require_key: Vec<String>,
    /// How long a retry waits for the first request's answer before 409.
    #[arg(long, default_value_t = 5_000)]
    wait_ms: u64,
    /// How long the upstream may take.
    #[arg(long, default_value_t = 25_000)]
    upstream_timeout_ms: u64,
}

pub fn run(args: ProxyArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(serve(args))
}

async fn serve(args: ProxyArgs) -> anyhow::Result<()> {
    let config = ProxyConfig {
        upstream: args.upstream.trim_end_matches('/').to_owned(),
        key_required_prefixes: args.require_key.clone(),
        wait_ms: args.wait_ms,
        upstream_timeout_ms: args.upstream_timeout_ms,
        ..ProxyConfig::default()
    };
    let listener =
        tokio::net::TcpListener::bind(args.listen).await.with_context(|| args.listen.to_string())?;
    let addr = listener.local_addr()?;
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    if let Some(url) = &args.gate {
        let mut builder = Client::builder(url.clone());
        if let Some(token) = &args.token {
            builder = builder.token(token);
        }
        if let Some(ca) = &args.tls_ca {
            builder = builder.tls_ca(ca);
        }
        let router = oncegate_proxy::router(builder.connect().await?, config.clone());
        eprintln!("oncegate proxy: listening on {addr}, forwarding to {}, keys on {url}", config.upstream);
        axum::serve(listener, router).with_graceful_shutdown(shutdown).await?;
        return Ok(());
    }
    let data_dir = args.data_dir.clone().unwrap_or_else(|| PathBuf::from("data"));
    let engine = Engine::open(EngineConfig { data_dir: data_dir.clone(), ..EngineConfig::default() })
        .with_context(|| format!("opening data directory {}", data_dir.display()))?;
    let router = oncegate_proxy::router(engine.gate(oncegate_core::Tenant::default_tenant()), config.clone());
    eprintln!(
        "oncegate proxy: listening on {addr}, forwarding to {}, keys in {}",
        config.upstream,
        data_dir.display()
    );
    axum::serve(listener, router).with_graceful_shutdown(shutdown).await?;
    tokio::task::spawn_blocking(move || engine.shutdown()).await?;
    Ok(())
}
