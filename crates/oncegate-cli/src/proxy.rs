//! `oncegate proxy`: the Idempotency-Key reverse proxy in front of `--upstream`, on the
//! engine in process (`--data-dir`) or on a remote oncegate (`--gate URL --token ...`),
//! with everything else in the `[proxy]` section of `--config FILE` (the file `serve`
//! reads; its `[engine]` and `[store]` sections serve the engine in process).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use oncegate_client::Client;
use oncegate_engine::Engine;
use oncegate_proxy::{ProxyConfig, ProxyFile};
use oncegate_server::Config;

/// Flags of `oncegate proxy`.
#[derive(clap::Args)]
pub struct ProxyArgs {
    /// Where the proxy listens.
    #[arg(long, env = "ONCEGATE_PROXY_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// A TOML configuration file: its `[proxy]` section (see config/oncegate.toml) and,
    /// for the engine in process, `[engine]` and `[store]`. Flags override it.
    #[arg(long, env = "ONCEGATE_CONFIG")]
    config: Option<PathBuf>,
    /// The service behind the proxy, `http://HOST:PORT` (or `proxy.upstream`).
    #[arg(long, env = "ONCEGATE_PROXY_UPSTREAM")]
    upstream: Option<String>,
    /// Keys live in this data directory (the engine in process); the default without --gate.
    #[arg(long, env = "ONCEGATE_DATA_DIR", conflicts_with = "gate")]
    data_dir: Option<PathBuf>,
    /// Keys live on this remote oncegate instead.
    #[arg(long, env = "ONCEGATE_PROXY_GATE")]
    gate: Option<String>,
    /// A file holding the bearer token for --gate; without it, `ONCEGATE_TOKEN`.
    #[arg(long, value_name = "PATH", requires = "gate")]
    token_file: Option<PathBuf>,
    /// Refused: the process list would show the token to every user of the machine.
    #[arg(long, hide = true)]
    token: Option<String>,
    /// The CA certificate (PEM) of an https:// --gate.
    #[arg(long, env = "ONCEGATE_TLS_CA", requires = "gate")]
    tls_ca: Option<PathBuf>,
    /// A path prefix whose POST and PATCH requests must carry an Idempotency-Key (400
    /// without one); repeat for each.
    #[arg(long = "require-key")]
    require_key: Vec<String>,
    /// How long a retry waits for the first request's answer before 409 (default 5000,
    /// or `proxy.wait_ms`).
    #[arg(long)]
    wait_ms: Option<u64>,
    /// How long the upstream may take (default 25000, or `proxy.upstream_timeout_ms`).
    #[arg(long)]
    upstream_timeout_ms: Option<u64>,
}

/// The file's sections with the flags over them, checked as a whole.
fn load(args: &ProxyArgs) -> anyhow::Result<(Config, ProxyConfig)> {
    let mut config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    let mut file = std::mem::take(&mut config.proxy);
    if args.upstream.is_none() && !file.contains_key("upstream") {
        anyhow::bail!("no upstream: give --upstream http://HOST:PORT or set proxy.upstream");
    }
    let mut set = |key: &str, value: toml::Value| {
        file.insert(key.to_owned(), value);
    };
    if let Some(upstream) = &args.upstream {
        set("upstream", upstream.clone().into());
    }
    if let Some(wait_ms) = args.wait_ms {
        set("wait_ms", toml::Value::Integer(wait_ms.try_into()?));
    }
    if let Some(timeout_ms) = args.upstream_timeout_ms {
        set("upstream_timeout_ms", toml::Value::Integer(timeout_ms.try_into()?));
    }
    let proxy = ProxyFile::from_table(file).and_then(ProxyFile::into_config).map(|mut proxy| {
        proxy.key_required_prefixes.extend(args.require_key.iter().cloned());
        proxy
    });
    let proxy = proxy.map_err(|problems| {
        let problems: Vec<String> = problems.iter().map(ToString::to_string).collect();
        anyhow::anyhow!("configuration refused:\n  {}", problems.join("\n  "))
    })?;
    if let Some(dir) = &args.data_dir {
        config.engine.data_dir = dir.clone();
    }
    Ok((config, proxy))
}

pub fn run(args: ProxyArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(serve(args))
}

async fn serve(args: ProxyArgs) -> anyhow::Result<()> {
    // Read (or refused, when given as --token) before anything is opened, with or
    // without --gate.
    let token =
        crate::client::secret(args.token.is_some(), "--token", args.token_file.as_deref(), "ONCEGATE_TOKEN")?;
    let (file, config) = load(&args)?;
    let listener =
        tokio::net::TcpListener::bind(args.listen).await.with_context(|| args.listen.to_string())?;
    let addr = listener.local_addr()?;
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    if let Some(url) = &args.gate {
        let mut builder = Client::builder(url.clone());
        if let Some(token) = token {
            builder = builder.token(token);
        }
        if let Some(ca) = &args.tls_ca {
            builder = builder.tls_ca(ca);
        }
        let router = oncegate_proxy::router(builder.connect().await?, config.clone());
        eprintln!("oncegate proxy: listening on {addr}, forwarding to {}, keys on {url}", config.upstream);
        oncegate_proxy::serve(listener, router, &config, shutdown).await?;
        return Ok(());
    }
    let data_dir = file.engine.data_dir.clone();
    let engine = Engine::open(file.engine_config())
        .with_context(|| format!("opening data directory {}", data_dir.display()))?;
    let response_bytes_max = engine.limits().response_bytes_max;
    if config.stored_bytes_max > response_bytes_max {
        anyhow::bail!(
            "proxy.stored_bytes_max is {} bytes; the engine stores at most {response_bytes_max} \
             (engine.limits.response_bytes_max), and a stored answer is one record's response",
            config.stored_bytes_max
        );
    }
    let router = oncegate_proxy::router(engine.gate(oncegate_core::Tenant::default_tenant()), config.clone());
    eprintln!(
        "oncegate proxy: listening on {addr}, forwarding to {}, keys in {}",
        config.upstream,
        data_dir.display()
    );
    oncegate_proxy::serve(listener, router, &config, shutdown).await?;
    tokio::task::spawn_blocking(move || engine.shutdown()).await?;
    Ok(())
}
