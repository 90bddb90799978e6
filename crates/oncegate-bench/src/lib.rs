//! Load generation for oncegate and the stores teams usually hand-roll an idempotency
//! gate on, doing the same durable work on each: reserve a key (insert-if-absent with a
//! lease and a ttl), then commit a response, with a share of duplicate reserves that must
//! be answered with the stored response.
//!
//! Targets: oncegate over gRPC, oncegate embedded, Redis (`SET NX PX`, a Lua script that
//! commits only for the holder's token, `appendfsync always`), PostgreSQL
//! (`INSERT ... ON CONFLICT DO NOTHING`, an `UPDATE` fenced by token, synchronous commit).

pub mod plot;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use oncegate_proto::v1 as pb;
use oncegate_proto::v1::gate_client::GateClient;

/// The work every target does, in the same shape.
#[derive(Clone, Debug)]
pub struct Work {
    /// Bytes of the committed response.
    pub response_bytes: usize,
    /// Share of reserves that repeat an already committed key, 0.0 to 1.0.
    pub duplicate_share: f64,
    /// The lease of a reserve.
    pub lease_ms: u64,
    /// The ttl of a record.
    pub ttl_ms: u64,
}

impl Default for Work {
    fn default() -> Self {
        Work { response_bytes: 256, duplicate_share: 0.1, lease_ms: 30_000, ttl_ms: 3_600_000 }
    }
}

/// A connected target.
#[derive(Clone)]
pub enum Target {
    /// oncegate over gRPC, with a few connections (one HTTP/2 connection caps lower).
    Grpc(Vec<GateClient<tonic::transport::Channel>>),
    /// oncegate in-process.
    Embedded(oncegate_engine::Engine),
    /// Redis with `appendfsync always`.
    Redis(redis::aio::MultiplexedConnection, redis::Script),
    /// PostgreSQL with `synchronous_commit = on`: one connection per worker.
    Postgres(Arc<Vec<tokio_postgres::Client>>),
}

/// What one reserve answered.
enum Reserved {
    Granted(u64),
    Replayed,
    Busy,
}

const REDIS_COMMIT: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"#;

impl Target {
    /// The target's name in reports.
    pub fn name(&self) -> &'static str {
        match self {
            Target::Grpc(_) => "oncegate-grpc",
            Target::Embedded(_) => "oncegate-embedded",
            Target::Redis(..) => "redis",
            Target::Postgres(_) => "postgres",
        }
    }

    /// Connects to oncegate over gRPC with `connections` HTTP/2 connections.
    pub async fn grpc(addr: &str, connections: usize) -> anyhow::Result<Target> {
        let mut clients = Vec::new();
        for _ in 0..connections.max(1) {
            let channel = tonic::transport::Channel::from_shared(addr.to_owned())?.connect().await?;
            clients.push(GateClient::new(channel));
        }
        Ok(Target::Grpc(clients))
    }

    /// Connects to Redis (for example `redis://127.0.0.1:6390`).
    pub async fn redis(url: &str) -> anyhow::Result<Target> {
        let client = redis::Client::open(url)?;
        let connection = client.get_multiplexed_async_connection().await.context("redis")?;
        Ok(Target::Redis(connection, redis::Script::new(REDIS_COMMIT)))
    }

    /// Connects `connections` clients to PostgreSQL and creates the table.
    pub async fn postgres(config: &str, connections: usize) -> anyhow::Result<Target> {
        let mut clients = Vec::new();
        for _ in 0..connections.max(1) {
            let (client, connection) =
                tokio_postgres::connect(config, tokio_postgres::NoTls).await.context("postgres")?;
            tokio::spawn(connection);
            clients.push(client);
        }
        clients[0]
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS gate (
                    key text PRIMARY KEY, token bigint NOT NULL, done boolean NOT NULL DEFAULT false,
                    lease_until timestamptz NOT NULL, expires_at timestamptz NOT NULL, response bytea);
                 TRUNCATE gate;",
            )
            .await?;
        Ok(Target::Postgres(Arc::new(clients)))
    }

    async fn reserve(&self, worker: usize, key: &str, token: u64, work: &Work) -> anyhow::Result<Reserved> {
        Ok(match self {
            Target::Grpc(clients) => {
                let mut client = clients[worker % clients.len()].clone();
                let request = pb::ReserveRequest {
                    namespace: "bench".into(),
                    key: key.into(),
                    ttl_ms: work.ttl_ms,
                    lease_ms: work.lease_ms,
                    ..Default::default()
                };
                match client.reserve(request).await?.into_inner().outcome {
                    Some(pb::reserve_response::Outcome::Granted(g)) => Reserved::Granted(g.token),
                    Some(pb::reserve_response::Outcome::Completed(_)) => Reserved::Replayed,
                    _ => Reserved::Busy,
                }
            }
            Target::Embedded(engine) => {
                let request = oncegate_engine::ReserveRequest {
                    namespace: "bench".into(),
                    key: key.into(),
                    ttl_ms: work.ttl_ms,
                    lease_ms: work.lease_ms,
                    ..Default::default()
                };
                match engine.reserve(&oncegate_core::Tenant::default_tenant(), request).await?.reply {
                    oncegate_core::ReserveReply::Granted { token, .. } => Reserved::Granted(token),
                    oncegate_core::ReserveReply::Completed { .. } => Reserved::Replayed,
                    _ => Reserved::Busy,
                }
            }
            Target::Redis(connection, _) => {
                let mut connection = connection.clone();
                let set: Option<String> = redis::cmd("SET")
                    .arg(key)
                    .arg(format!("pending:{token}"))
                    .arg("NX")
                    .arg("PX")
                    .arg(work.ttl_ms)
                    .query_async(&mut connection)
                    .await?;
                if set.is_some() {
                    Reserved::Granted(token)
                } else {
                    // The duplicate reads the stored answer, as a gateway would to replay it.
                    let stored: Option<Vec<u8>> =
                        redis::cmd("GET").arg(key).query_async(&mut connection).await?;
                    match stored {
                        Some(v) if v.starts_with(b"done:") => Reserved::Replayed,
                        _ => Reserved::Busy,
                    }
                }
            }
            Target::Postgres(clients) => {
                let client = &clients[worker % clients.len()];
                let inserted = client
                    .execute(
                        "INSERT INTO gate (key, token, lease_until, expires_at)
                         VALUES ($1, $2, now() + $3 * interval '1 millisecond', now() + $4 * interval '1 millisecond')
                         ON CONFLICT DO NOTHING",
                        &[&key, &(token as i64), &(work.lease_ms as f64), &(work.ttl_ms as f64)],
                    )
                    .await?;
                if inserted == 1 {
                    Reserved::Granted(token)
                } else {
                    let row =
                        client.query_opt("SELECT done, response FROM gate WHERE key = $1", &[&key]).await?;
                    match row {
                        Some(row) if row.get::<_, bool>(0) => Reserved::Replayed,
                        _ => Reserved::Busy,
                    }
                }
            }
        })
    }

    async fn commit(
        &self,
        worker: usize,
        key: &str,
        token: u64,
        response: &[u8],
        work: &Work,
    ) -> anyhow::Result<()> {
        match self {
            Target::Grpc(clients) => {
                let mut client = clients[worker % clients.len()].clone();
                let request = pb::CommitRequest {
                    namespace: "bench".into(),
                    key: key.into(),
                    token,
                    outcome: pb::Outcome::Succeeded as i32,
                    response: response.to_vec(),
                };
                client.commit(request).await?;
            }
            Target::Embedded(engine) => {
                let request = oncegate_engine::CommitRequest {
                    namespace: "bench".into(),
                    key: key.into(),
                    token,
                    outcome: oncegate_core::Outcome::Succeeded,
                    response: response.to_vec(),
                };
                engine.commit(&oncegate_core::Tenant::default_tenant(), request).await?;
            }
            Target::Redis(connection, script) => {
                let mut connection = connection.clone();
                let mut done = b"done:".to_vec();
                done.extend_from_slice(response);
                let committed: i64 = script
                    .key(key)
                    .arg(format!("pending:{token}"))
                    .arg(done)
                    .arg(work.ttl_ms)
                    .invoke_async(&mut connection)
                    .await?;
                anyhow::ensure!(committed == 1, "redis commit fenced off");
            }
            Target::Postgres(clients) => {
                let client = &clients[worker % clients.len()];
                let updated = client
                    .execute(
                        "UPDATE gate SET done = true, response = $3,
                             expires_at = greatest(expires_at, now() + $4 * interval '1 millisecond')
                         WHERE key = $1 AND token = $2 AND NOT done",
                        &[&key, &(token as i64), &response, &(work.ttl_ms as f64)],
                    )
                    .await?;
                anyhow::ensure!(updated == 1, "postgres commit fenced off");
            }
        }
        Ok(())
    }
}

/// How a run is shaped.
#[derive(Clone, Debug)]
pub struct Load {
    /// Requests in flight (workers, each with one pair outstanding).
    pub in_flight: usize,
    /// Measured time.
    pub duration: Duration,
    /// Time before measuring starts.
    pub warm_up: Duration,
}

/// What a run measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Report {
    /// The target's name.
    pub target: String,
    /// Requests in flight.
    pub in_flight: usize,
    /// Completed reserve+commit pairs (and answered duplicates) per second.
    pub pairs_per_s: f64,
    /// Latency of one pair, in microseconds.
    pub p50_us: u64,
    /// 99th percentile, in microseconds.
    pub p99_us: u64,
    /// 99.9th percentile, in microseconds.
    pub p999_us: u64,
    /// Calls that failed.
    pub errors: u64,
    /// Duplicates answered with the stored response.
    pub replays: u64,
    /// For the embedded target: commands per transaction while measuring.
    pub batch_len_mean: Option<f64>,
}

/// Runs `load` against `target` and reports. `progress` is called about once a second
/// with the pairs done so far.
pub async fn run(target: Target, work: Work, load: Load, progress: impl Fn(u64) + Send + 'static) -> Report {
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let replays = Arc::new(AtomicU64::new(0));
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let histogram =
        Arc::new(std::sync::Mutex::new(Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("bounds")));
    let run_id =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let response = vec![b'r'; work.response_bytes];
    let mut workers = Vec::new();
    for worker in 0..load.in_flight {
        let (target, work, response) = (target.clone(), work.clone(), response.clone());
        let (done, errors, replays, measuring, stop, histogram) = (
            done.clone(),
            errors.clone(),
            replays.clone(),
            measuring.clone(),
            stop.clone(),
            histogram.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut i = 0u64;
            let mut last_committed: Option<String> = None;
            let mut local = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("bounds");
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let duplicate = last_committed.is_some()
                    && (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 11) as f64 / (1u64 << 53) as f64
                        <= work.duplicate_share;
                let key = match (&last_committed, duplicate) {
                    (Some(k), true) => k.clone(),
                    _ => format!("{run_id}-{worker}-{i}"),
                };
                let token = (worker as u64) << 40 | i;
                let started = Instant::now();
                let result = async {
                    match target.reserve(worker, &key, token, &work).await? {
                        Reserved::Granted(token) => {
                            target.commit(worker, &key, token, &response, &work).await?;
                            anyhow::Ok(false)
                        }
                        Reserved::Replayed => anyhow::Ok(true),
                        Reserved::Busy => anyhow::Ok(false),
                    }
                }
                .await;
                let measured = measuring.load(Ordering::Relaxed);
                match result {
                    Ok(replayed) => {
                        if !duplicate {
                            last_committed = Some(key);
                        }
                        if measured {
                            done.fetch_add(1, Ordering::Relaxed);
                            if replayed {
                                replays.fetch_add(1, Ordering::Relaxed);
                            }
                            let _ = local.record(started.elapsed().as_micros().max(1) as u64);
                        }
                    }
                    Err(_) if measured => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {}
                }
            }
            histogram.lock().expect("histogram").add(&local).expect("same bounds");
        }));
    }
    tokio::time::sleep(load.warm_up).await;
    let batches = |target: &Target| match target {
        Target::Embedded(engine) => {
            Some(engine.stats().iter().fold((0u64, 0u64), |(b, c), s| (b + s.batches, c + s.commands)))
        }
        _ => None,
    };
    let batches_before = batches(&target);
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    while started.elapsed() < load.duration {
        tokio::time::sleep(Duration::from_secs(1).min(load.duration.saturating_sub(started.elapsed()))).await;
        progress(done.load(Ordering::Relaxed));
    }
    measuring.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed();
    let batch_len_mean = match (batches_before, batches(&target)) {
        (Some((b0, c0)), Some((b1, c1))) if b1 > b0 => Some((c1 - c0) as f64 / (b1 - b0) as f64),
        _ => None,
    };
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        let _ = worker.await;
    }
    let h = histogram.lock().expect("histogram");
    Report {
        target: target.name().to_owned(),
        in_flight: load.in_flight,
        pairs_per_s: done.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64(),
        p50_us: h.value_at_quantile(0.5),
        p99_us: h.value_at_quantile(0.99),
        p999_us: h.value_at_quantile(0.999),
        errors: errors.load(Ordering::Relaxed),
        replays: replays.load(Ordering::Relaxed),
        batch_len_mean,
    }
}

/// Renders reports as a markdown table.
pub fn markdown(reports: &[Report]) -> String {
    let mut out = String::from(
        "| target | in flight | pairs/s | p50 (ms) | p99 (ms) | p99.9 (ms) | errors | replays |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in reports {
        out.push_str(&format!(
            "| {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {} |\n",
            r.target,
            r.in_flight,
            r.pairs_per_s,
            r.p50_us as f64 / 1000.0,
            r.p99_us as f64 / 1000.0,
            r.p999_us as f64 / 1000.0,
            r.errors,
            r.replays
        ));
    }
    out
}

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
    },
}

/// Runs an oncegate server for a load tool's child process: opens `data_dir` with
/// `shards`, listens on a free loopback port, prints `addr=...` on standard output, and
/// serves until killed.
pub fn serve_child(data_dir: std::path::PathBuf, shards: u32) -> anyhow::Result<()> {
    let mut config = oncegate_server::Config::default();
    config.engine.data_dir = data_dir;
    config.engine.shards = shards;
    config.server.listen = "127.0.0.1:0".parse()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let engine = oncegate_engine::Engine::open(config.engine.clone())?;
        let listener = tokio::net::TcpListener::bind(config.server.listen).await?;
        println!("addr={}", listener.local_addr()?);
        let listeners = oncegate_server::Listeners { gate: listener, metrics: None };
        oncegate_server::serve(engine, &config, listeners, std::future::pending()).await?;
        anyhow::Ok(())
    })
}

/// Starts this executable's `serve` mode as a child process; returns it and its address.
pub fn start_child(data_dir: &std::path::Path, shards: u32) -> anyhow::Result<(std::process::Child, String)> {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["serve", "--data-dir"])
        .arg(data_dir)
        .args(["--shards", &shards.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().context("stdout")?).read_line(&mut line)?;
    let addr = line.trim().strip_prefix("addr=").context("the server prints its address")?.to_owned();
    Ok((child, format!("http://{addr}")))
}

/// The raw SQLite group-commit ceiling: `shards` threads, each with its own WAL file set up
/// as oncegate's shards are (`synchronous=FULL`, the same checkpoint interval and page
/// cache), each committing batches of `batch` fresh keys (insert-if-absent with a
/// response-less pending row) and then a second transaction completing them (the
/// response written), as fast as it can: no channels, no decisions, no network. Returns
/// completed pairs per second.
pub fn raw_sqlite_ceiling(
    dir: &std::path::Path,
    shards: u32,
    batch: usize,
    duration: Duration,
    work: &Work,
) -> anyhow::Result<f64> {
    let defaults = oncegate_engine::EngineConfig::default();
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for shard in 0..shards {
        let path = dir.join(format!("raw-{shard}.sqlite"));
        let (stop, done, work) = (stop.clone(), done.clone(), work.clone());
        let (pages, cache_kib) = (defaults.wal_checkpoint_pages, defaults.page_cache_bytes_max / 1024);
        threads.push(std::thread::spawn(move || -> anyhow::Result<()> {
            let mut conn = rusqlite::Connection::open(&path)?;
            let _: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
            conn.pragma_update(None, "synchronous", "FULL")?;
            let _: i64 = conn.query_row(&format!("PRAGMA wal_autocheckpoint = {pages}"), [], |r| r.get(0))?;
            conn.pragma_update(None, "cache_size", -(cache_kib as i64))?;
            conn.execute_batch(
                "CREATE TABLE IF NOT EXISTS records (key TEXT PRIMARY KEY, token INTEGER NOT NULL,
                 expires_at_ms INTEGER NOT NULL, response BLOB) WITHOUT ROWID",
            )?;
            let response = vec![b'r'; work.response_bytes];
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let keys: Vec<String> = (0..batch).map(|i| format!("{shard}-{n}-{i}")).collect();
                n += 1;
                let tx = conn.transaction()?;
                {
                    let mut insert = tx.prepare_cached(
                        "INSERT INTO records (key, token, expires_at_ms) VALUES (?1, ?2, ?3) ON CONFLICT DO NOTHING",
                    )?;
                    for (i, key) in keys.iter().enumerate() {
                        insert.execute(rusqlite::params![key, i as i64, work.ttl_ms as i64])?;
                    }
                }
                tx.commit()?;
                let tx = conn.transaction()?;
                {
                    let mut complete =
                        tx.prepare_cached("UPDATE records SET response = ?2 WHERE key = ?1 AND response IS NULL")?;
                    for key in &keys {
                        complete.execute(rusqlite::params![key, response])?;
                    }
                }
                tx.commit()?;
                done.fetch_add(batch as u64, Ordering::Relaxed);
            }
            Ok(())
        }));
    }
    std::thread::sleep(Duration::from_millis(500));
    let before = done.load(Ordering::Relaxed);
    let started = Instant::now();
    std::thread::sleep(duration);
    let pairs = done.load(Ordering::Relaxed) - before;
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread.join().map_err(|_| anyhow::anyhow!("a raw SQLite thread panicked"))??;
    }
    Ok(pairs as f64 / elapsed.as_secs_f64())
}

/// Fills a data directory with `count` completed records (fresh keys, one-day ttl)
/// through the embedded engine, `in_flight` pairs at a time, so that a later run measures
/// a store that already holds them. Returns the time it took.
pub fn preload(
    data_dir: &std::path::Path,
    shards: u32,
    count: u64,
    in_flight: u64,
) -> anyhow::Result<Duration> {
    let config =
        oncegate_engine::EngineConfig { data_dir: data_dir.to_owned(), shards, ..Default::default() };
    let engine = oncegate_engine::Engine::open(config)?;
    let started = Instant::now();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let next = Arc::new(AtomicU64::new(0));
    runtime.block_on(async {
        let mut workers = Vec::new();
        for _ in 0..in_flight {
            let (engine, next) = (engine.clone(), next.clone());
            workers.push(tokio::spawn(async move {
                let tenant = oncegate_core::Tenant::default_tenant();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        return anyhow::Ok(());
                    }
                    let key = format!("preload-{i}");
                    let request = oncegate_engine::ReserveRequest {
                        namespace: "bench".into(),
                        key: key.clone(),
                        ttl_ms: 86_400_000,
                        ..Default::default()
                    };
                    let token = match engine.reserve(&tenant, request).await?.reply {
                        oncegate_core::ReserveReply::Granted { token, .. } => token,
                        _ => continue,
                    };
                    let commit = oncegate_engine::CommitRequest {
                        namespace: "bench".into(),
                        key,
                        token,
                        outcome: oncegate_core::Outcome::Succeeded,
                        response: vec![b'p'; 64],
                    };
                    engine.commit(&tenant, commit).await?;
                }
            }));
        }
        for worker in workers {
            worker.await??;
        }
        anyhow::Ok(())
    })?;
    engine.shutdown();
    Ok(started.elapsed())
}

/// The resident set size of a process, in bytes (Linux).
pub fn rss_bytes(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .map_or(0, |kib: u64| kib * 1024)
}
