//! `oncegate serve`: configuration (file, environment, flags), logging, the engine, the
//! gRPC server, and graceful shutdown on SIGTERM or SIGINT.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use oncegate_engine::{Engine, ShardState, StoreConfig, StoreKind};
use oncegate_server::{Config, Listeners, LogFormat, TraceExport};
use tracing_subscriber::EnvFilter;

/// Flags override the environment, which overrides the file, which overrides defaults.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// A TOML configuration file (see config/oncegate.toml for every key).
    #[arg(long, env = "ONCEGATE_CONFIG")]
    config: Option<PathBuf>,
    /// The address to listen on (`server.listen`).
    #[arg(long, env = "ONCEGATE_LISTEN")]
    listen: Option<SocketAddr>,
    /// The address of `/metrics`, `/healthz` and `/readyz` (`server.metrics_listen`).
    #[arg(long, env = "ONCEGATE_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// Where the shard files live (`engine.data_dir`).
    #[arg(long, env = "ONCEGATE_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Shards for a new data directory (`engine.shards`).
    #[arg(long, env = "ONCEGATE_SHARDS")]
    shards: Option<u32>,
    /// Where the records live: `sqlite` (the default) or `postgres` (`store.kind`).
    #[arg(long, env = "ONCEGATE_STORE", value_parser = clap::value_parser!(StoreKind))]
    store: Option<StoreKind>,
    /// The PostgreSQL connection string (`store.postgres_url`); `sslmode=require` asks
    /// for TLS.
    #[arg(long, env = "ONCEGATE_POSTGRES_URL", hide_env_values = true)]
    postgres_url: Option<String>,
    /// `text` or `json` log lines (`log.format`).
    #[arg(long, env = "ONCEGATE_LOG_FORMAT", value_parser = ["text", "json"])]
    log_format: Option<String>,
}

fn load(args: &ServeArgs) -> anyhow::Result<Config> {
    let mut config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    if let Some(listen) = args.listen {
        config.server.listen = listen;
    }
    if let Some(metrics_listen) = args.metrics_listen {
        config.server.metrics_listen = metrics_listen;
    }
    if let Some(dir) = &args.data_dir {
        config.engine.data_dir = dir.clone();
    }
    if let Some(shards) = args.shards {
        config.engine.shards = shards;
    }
    if let Some(kind) = args.store.filter(|kind| *kind != config.store.kind()) {
        config.store = StoreConfig::of_kind(kind);
    }
    if let Some(url) = &args.postgres_url {
        let StoreConfig::Postgres(postgres) = &mut config.store else {
            anyhow::bail!(
                "--postgres-url (ONCEGATE_POSTGRES_URL) is given but the store is SQLite: add --store postgres (or store.kind = \"postgres\")"
            );
        };
        postgres.postgres_url = url.as_str().into();
    }
    if let Some(format) = &args.log_format {
        config.log.format = if format == "json" { LogFormat::Json } else { LogFormat::Text };
    }
    if let Err(problems) = config.check() {
        let problems: Vec<String> = problems.iter().map(ToString::to_string).collect();
        anyhow::bail!("configuration refused:\n  {}", problems.join("\n  "));
    }
    Ok(config)
}

/// Logs to standard error under the log filter, and exports traces when `[telemetry]`
/// says where (the export is returned, to be dropped before the runtime).
fn init_logging(config: &Config) -> anyhow::Result<Option<TraceExport>> {
    use std::io::IsTerminal;
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&config.log.filter));
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let logs = match config.log.format {
        LogFormat::Json => logs.json().with_filter(filter).boxed(),
        LogFormat::Text => logs.with_filter(filter).boxed(),
    };
    let (traces, export) = oncegate_server::otlp_layer(&config.telemetry)?.unzip();
    tracing_subscriber::registry().with(logs).with(traces).init();
    if let Some(export) = &export {
        tracing::info!(endpoint = export.endpoint(), "exporting traces over OTLP/gRPC");
    }
    Ok(export)
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = load(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    // The trace exporter's channel runs on the runtime, so it is made inside it.
    let export = {
        let _inside = runtime.enter();
        init_logging(&config)?
    };
    let served = runtime.block_on(serve(config));
    drop(export);
    served
}

async fn serve(config: Config) -> anyhow::Result<()> {
    // Bind first: a port in use is found before the data directory is opened and checked.
    let listeners = Listeners::bind(&config.server).await?;
    let engine = Engine::open(config.engine_config())
        .with_context(|| format!("opening data directory {}", config.engine.data_dir.display()))?;
    let addr = listeners.gate.local_addr()?;
    let metrics = listeners.metrics.as_ref().map(|l| l.local_addr()).transpose()?;
    let metrics = metrics.map_or_else(|| "-".to_owned(), |a| a.to_string());
    tracing::info!(
        %addr,
        tls = config.server.tls_enabled(),
        %metrics,
        data_dir = %config.engine.data_dir.display(),
        shards = engine.stats().len(),
        store = engine.config().store.kind().name(),
        durability = ?config.engine.durability,
        "listening"
    );
    let signalled = shutdown_signal().context("listening for SIGINT and SIGTERM")?;
    let stopping = async {
        signalled.await;
        notify(&[sd_notify::NotifyState::Stopping]);
    };
    let ready = || notify_ready(&engine);
    let served = oncegate_server::serve_with_ready(engine.clone(), &config, listeners, stopping, ready).await;
    tracing::info!("stopped accepting; in-flight calls finished; closing the shards");
    tokio::task::spawn_blocking(move || engine.shutdown()).await?;
    tracing::info!("shut down");
    served.map_err(anyhow::Error::from)
}

/// Tells systemd (`Type=notify`; a no-op without `NOTIFY_SOCKET`) that the service is
/// ready: it accepts calls, and every shard has made its first open (`Engine::open`
/// returns only then). A shard that failed to open answers `unavailable` while the others
/// serve, so it does not hold READY back (that would leave the unit starting, or kill a
/// node that serves most keys); the status line names how many serve, `/readyz` fails
/// and the `OncegateShardNotServing` alert fires.
fn notify_ready(engine: &Engine) {
    let states = engine.shard_states();
    let serving = states.iter().filter(|s| **s == ShardState::Serving).count();
    let status = format!("serving; {serving} of {} shards serving", states.len());
    notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(&status)]);
    tracing::info!(serving, shards = states.len(), "ready");
}

/// Sends `states` to the service manager, if one listens; a failure is logged, never
/// fatal (the service serves whether or not systemd heard).
fn notify(states: &[sd_notify::NotifyState]) {
    if let Err(error) = sd_notify::notify(false, states) {
        tracing::warn!(%error, "could not notify the service manager (NOTIFY_SOCKET)");
    }
}

/// Listens for SIGINT and SIGTERM from now on (the handlers are installed before this
/// returns, so a signal sent right after READY is not the default, fatal one); the future
/// resolves on the first.
fn shutdown_signal() -> std::io::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => tracing::info!("SIGINT received; shutting down"),
            _ = terminate.recv() => tracing::info!("SIGTERM received; shutting down"),
        }
    })
}
