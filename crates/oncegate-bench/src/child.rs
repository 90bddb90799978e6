//! The server a load tool measures, run as a child process of the tool itself, so that
//! its CPU and disk figures are its own.

use anyhow::Context;

/// The hidden mode in which a load tool runs the server it measures, as a child process
/// of itself (see [`start_child`]).
#[derive(clap::Subcommand)]
pub enum ChildMode {
    /// Internal: run the server on a data directory and print its address.
    Serve {
        /// The data directory.
        #[arg(long)]
        data_dir: std::path::PathBuf,
        /// Shards, for a new directory.
        #[arg(long)]
        shards: u32,
        /// Where the records live (`sqlite`, or `postgres` with `--postgres-url`).
        #[arg(long, default_value = "sqlite", value_parser = clap::value_parser!(oncegate_engine::StoreKind))]
        store: oncegate_engine::StoreKind,
        /// The PostgreSQL database of `--store postgres`.
        #[arg(long)]
        postgres_url: Option<String>,
    },
}

/// Runs an oncegate server for a load tool's child process: opens `data_dir` with
/// `shards`, listens on a free loopback port, prints `addr=...` on standard output, and
/// serves until killed.
pub fn serve_child(mode: ChildMode) -> anyhow::Result<()> {
    let ChildMode::Serve { data_dir, shards, store, postgres_url } = mode;
    let mut config = oncegate_server::Config::default();
    config.engine.data_dir = data_dir;
    config.engine.shards = shards;
    config.store = match (store, postgres_url) {
        (oncegate_engine::StoreKind::Postgres, Some(url)) => oncegate_engine::StoreConfig::postgres(url),
        (kind, _) => oncegate_engine::StoreConfig::of_kind(kind),
    };
    config.server.listen = "127.0.0.1:0".parse()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let engine = oncegate_engine::Engine::open(config.engine_config())?;
        let listener = tokio::net::TcpListener::bind(config.server.listen).await?;
        println!("addr={}", listener.local_addr()?);
        let listeners = oncegate_server::Listeners { gate: listener, metrics: None };
        oncegate_server::serve(engine, &config, listeners, std::future::pending()).await?;
        anyhow::Ok(())
    })
}

/// Starts this executable's `serve` mode as a child process on `store` (`postgres_url`
/// names the database of `StoreKind::Postgres`); returns it and its address.
pub fn start_child(
    data_dir: &std::path::Path,
    shards: u32,
    store: oncegate_engine::StoreKind,
    postgres_url: &str,
) -> anyhow::Result<(std::process::Child, String)> {
    use std::io::BufRead;
    let mut command = std::process::Command::new(std::env::current_exe()?);
    command.args(["serve", "--data-dir"]).arg(data_dir).args(["--shards", &shards.to_string()]);
    command.arg("--store").arg(store.name());
    if store == oncegate_engine::StoreKind::Postgres {
        command.args(["--postgres-url", postgres_url]);
    }
    let mut child =
        command.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::null()).spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().context("stdout")?).read_line(&mut line)?;
    let addr = line.trim().strip_prefix("addr=").context("the server prints its address")?.to_owned();
    Ok((child, format!("http://{addr}")))
}
