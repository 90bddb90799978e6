//! Prometheus metrics and the plain HTTP routes `/metrics`, `/healthz` (the process
//! answers) and `/readyz` (every shard serves), on their own listener
//! (`server.metrics_listen`, loopback by default): the metrics name every tenant and its
//! traffic, so they stay off the port that tenants reach.
//!
//! Metrics go through the `metrics` facade; the exposition format is
//! `metrics-exporter-prometheus`'s. The engine records its own histograms (batch length,
//! commit latency) through the same facade; shard gauges and process figures are read
//! when `/metrics` is scraped.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use oncegate_core::Tenant;
use oncegate_engine::{Engine, ShardState};
use tokio::time::Instant;

/// Histogram buckets for latencies, in seconds: 100 µs to 10 s.
const SECONDS_BUCKETS: &[f64] =
    &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];
/// Histogram buckets for batch lengths, in commands.
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0];

/// The `Session` streams open in this process, their calls started and not yet answered,
/// their calls read and held for room, and the bytes of their answers not yet handed to
/// the transport: counted by
/// `session.rs` as they change (a plain atomic each, where a recorder's gauge would cost a
/// lookup per answer) and read into their gauges at each scrape.
pub(crate) static SESSION_STREAMS: AtomicU64 = AtomicU64::new(0);
pub(crate) static SESSION_CALLS_IN_FLIGHT: AtomicU64 = AtomicU64::new(0);
pub(crate) static SESSION_CALLS_HELD: AtomicU64 = AtomicU64::new(0);
pub(crate) static SESSION_UNSENT_BYTES: AtomicU64 = AtomicU64::new(0);

/// How often histogram samples are folded into their buckets.
const UPKEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// The process-wide recorder: the `metrics` facade allows one, so every server in the
/// process (tests start several) shares it.
pub fn handle() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
                SECONDS_BUCKETS,
            )
            .and_then(|b| {
                b.set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Full("oncegate_shard_batch_len".into()),
                    BATCH_BUCKETS,
                )
            })
            .expect("bucket lists are not empty")
            .build_recorder();
        let handle = recorder.handle();
        let build_info = [
            ("version", crate::build::VERSION.to_owned()),
            ("commit", crate::build::COMMIT.to_owned()),
            ("stores", crate::build::stores()),
        ];
        // Another recorder may already be installed by an embedding program; then its
        // recorder gets the figures and this handle renders only what it saw.
        let _ = metrics::set_global_recorder(recorder);
        describe();
        metrics::gauge!("oncegate_build_info", &build_info).set(1.0);
        // Histogram samples pile up in the recorder until upkeep drains them into their
        // buckets; without it memory grows with every request when nobody scrapes (the
        // soak test found this). The exporter's own installer runs upkeep on a task; this
        // recorder is built by hand, so a thread does it.
        let upkeep = handle.clone();
        let _ = std::thread::Builder::new().name("oncegate-metrics-upkeep".into()).spawn(move || {
            loop {
                std::thread::sleep(UPKEEP_INTERVAL);
                upkeep.run_upkeep();
            }
        });
        handle
    })
}

/// Counts one call and records its latency. `result` is the outcome (`granted`,
/// `in_progress`, `completed`, `mismatch`, `granted_after_abandon`, `ok`) or the stable
/// error code of a refusal. `started` is on tokio's clock, as every call's deadline is,
/// so that the latency and the deadline of one call are measured alike.
pub(crate) fn record_call(
    rpc: &'static str,
    tenant: Option<&Tenant>,
    result: &'static str,
    started: Instant,
) {
    let tenant = tenant.map_or_else(|| "-".to_owned(), ToString::to_string);
    metrics::counter!("oncegate_requests_total", "rpc" => rpc, "result" => result, "tenant" => tenant)
        .increment(1);
    metrics::histogram!("oncegate_request_duration_seconds", "rpc" => rpc)
        .record(started.elapsed().as_secs_f64());
}

/// Every metric's help text (`# HELP`), so that `promtool check metrics` and a reader of
/// `/metrics` know what each one is; docs/operations.md has the same table.
fn describe() {
    use metrics::{describe_counter as counter, describe_gauge as gauge, describe_histogram as histogram};
    counter!("oncegate_requests_total", "Calls by rpc, result (outcome or refusal code) and tenant.");
    histogram!("oncegate_request_duration_seconds", "Time from a call's arrival to its answer.");
    histogram!("oncegate_shard_batch_len", "Commands per shard transaction.");
    histogram!("oncegate_shard_commit_seconds", "Time of a shard's COMMIT (its WAL fsync).");
    gauge!("oncegate_shard_serving", "1 when the shard serves, 0 otherwise.");
    gauge!("oncegate_shard_state", "1 for the shard's state, 0 for the others.");
    gauge!("oncegate_shard_mailbox_depth", "Requests waiting for the shard.");
    gauge!("oncegate_shard_mailbox_depth_max", "engine.mailbox_depth_max.");
    gauge!("oncegate_shard_waiters", "Reserves parked with wait_ms.");
    gauge!("oncegate_shard_records_pending", "Stored pending records (expired, unreclaimed ones included).");
    gauge!(
        "oncegate_shard_records_completed",
        "Stored completed records (expired, unreclaimed ones included)."
    );
    gauge!("oncegate_shard_slots", "Slots the slot map gives the shard.");
    gauge!(
        "oncegate_shard_file_bytes",
        "Bytes of the shard file's pages in use, read at most a second before its last write batch."
    );
    gauge!("oncegate_shard_file_bytes_max", "store.shard_file_bytes_max.");
    gauge!("oncegate_shard_clock_ahead_seconds", "The shard's time less the wall clock.");
    counter!("oncegate_shard_reclaimed_total", "Expired records deleted by the shard's alarm.");
    counter!("oncegate_shard_batches_total", "Shard transactions.");
    counter!("oncegate_shard_commands_total", "Commands in shard transactions.");
    counter!("oncegate_shard_failures_total", "Storage failures of the shard.");
    counter!("oncegate_shard_checkpoints_total", "WAL checkpoints of the shard file.");
    gauge!("oncegate_slot_moving", "1 while an add-shards moves a slot.");
    counter!("oncegate_slot_moves_total", "Slots moved online.");
    counter!("oncegate_slot_moved_records_total", "Records carried by online slot moves.");
    histogram!("oncegate_slot_move_seconds", "One slot move, from holding its requests to releasing them.");
    gauge!("oncegate_session_streams", "Session streams open.");
    gauge!("oncegate_session_unsent_bytes", "Bytes of Session answers not yet taken by the transport.");
    gauge!("oncegate_session_calls_in_flight", "Session calls started and not yet answered.");
    gauge!(
        "oncegate_session_calls_held",
        "Session calls read and not started: their stream's calls in flight or unsent bytes are at their limit."
    );
    counter!("oncegate_connections_refused_total", "Connections closed at once, by the limit reached.");
    counter!("oncegate_connections_closed_total", "Connections closed at a deadline, by the limit reached.");
    gauge!("oncegate_build_info", "1, labelled with the version, the git commit and the stores built in.");
    gauge!("process_resident_memory_bytes", "Resident memory of the server process.");
    gauge!("process_open_fds", "Open file descriptors of the server process.");
    gauge!("process_max_fds", "The server process's open-files limit.");
    // Counters without labels exist from the start, so that a rate over them (and a
    // dashboard's panel) reads 0 rather than nothing before the first slot moves.
    metrics::counter!("oncegate_slot_moves_total").increment(0);
    metrics::counter!("oncegate_slot_moved_records_total").increment(0);
}

/// Sets the gauges that are read, not counted: shard state and queues, process figures.
fn refresh(engine: &Engine) {
    let config = engine.config();
    for stats in engine.stats() {
        let shard = stats.shard.to_string();
        let gauge =
            |name: &'static str, value: f64| metrics::gauge!(name, "shard" => shard.clone()).set(value);
        gauge("oncegate_shard_serving", if stats.state == ShardState::Serving { 1.0 } else { 0.0 });
        for state in ShardState::ALL {
            let on = if stats.state == state { 1.0 } else { 0.0 };
            metrics::gauge!("oncegate_shard_state", "shard" => shard.clone(), "state" => state.as_str())
                .set(on);
        }
        gauge("oncegate_shard_mailbox_depth", stats.mailbox_depth as f64);
        gauge("oncegate_shard_mailbox_depth_max", config.mailbox_depth_max as f64);
        gauge("oncegate_shard_file_bytes", stats.file_bytes as f64);
        gauge("oncegate_shard_file_bytes_max", config.store.sqlite().shard_file_bytes_max as f64);
        gauge("oncegate_shard_clock_ahead_seconds", stats.clock_ahead_ms as f64 / 1_000.0);
        gauge("oncegate_shard_waiters", stats.waiters as f64);
        gauge("oncegate_shard_records_pending", stats.records_pending as f64);
        gauge("oncegate_shard_records_completed", stats.records_completed as f64);
        gauge("oncegate_shard_slots", f64::from(stats.slots));
        let counter = |name: &'static str, value: u64| {
            metrics::counter!(name, "shard" => shard.clone()).absolute(value)
        };
        counter("oncegate_shard_reclaimed_total", stats.reclaimed);
        counter("oncegate_shard_batches_total", stats.batches);
        counter("oncegate_shard_commands_total", stats.commands);
        counter("oncegate_shard_failures_total", stats.failures);
        counter("oncegate_shard_checkpoints_total", stats.checkpoints);
    }
    metrics::gauge!("oncegate_slot_moving").set(if engine.slot_moving().is_some() { 1.0 } else { 0.0 });
    let read = |gauge: &AtomicU64| gauge.load(Ordering::Relaxed) as f64;
    metrics::gauge!("oncegate_session_streams").set(read(&SESSION_STREAMS));
    metrics::gauge!("oncegate_session_calls_in_flight").set(read(&SESSION_CALLS_IN_FLIGHT));
    metrics::gauge!("oncegate_session_calls_held").set(read(&SESSION_CALLS_HELD));
    metrics::gauge!("oncegate_session_unsent_bytes").set(read(&SESSION_UNSENT_BYTES));
    if let Some(rss) = process_rss_bytes() {
        metrics::gauge!("process_resident_memory_bytes").set(rss as f64);
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        metrics::gauge!("process_open_fds").set(fds.count() as f64);
    }
    if let Some(max) = process_max_fds() {
        metrics::gauge!("process_max_fds").set(max as f64);
    }
}

/// The soft limit on open files (`RLIMIT_NOFILE`), from `/proc/self/limits`.
fn process_max_fds() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.trim_start_matches("Max open files").split_whitespace().next()?.parse().ok()
}

fn process_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 =
        status.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Serves the routes on `listener` within `limits`; once `stopping` is true, `/readyz`
/// fails and the listener shuts down gracefully.
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: Engine,
    limits: oncegate_listen::serve::HttpLimits,
    stopping: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    // Installed already when `serve_with_ready` spawned this; here for other callers.
    handle();
    let mut stopped = stopping.clone();
    let stop = async move {
        let _ = stopped.wait_for(|stopping| *stopping).await;
    };
    oncegate_listen::serve::serve_router(listener, routes(engine, stopping), limits, stop).await
}

/// The HTTP routes; `/readyz` fails once `stopping` is true.
pub fn routes(engine: Engine, stopping: tokio::sync::watch::Receiver<bool>) -> axum::Router {
    let metrics_engine = engine.clone();
    axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let engine = metrics_engine.clone();
                async move {
                    refresh(&engine);
                    handle().render()
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let engine = engine.clone();
                let stopping = *stopping.borrow();
                async move {
                    if stopping {
                        return (StatusCode::SERVICE_UNAVAILABLE, "not ready: shutting down\n".to_owned());
                    }
                    let states = engine.shard_states();
                    if states.iter().all(|s| *s == ShardState::Serving) {
                        (StatusCode::OK, "ready\n".to_owned())
                    } else {
                        let down: Vec<String> = states
                            .iter()
                            .enumerate()
                            .filter(|(_, s)| **s != ShardState::Serving)
                            .map(|(i, s)| format!("shard {i} {}", s.as_str()))
                            .collect();
                        (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {}\n", down.join(", ")))
                    }
                }
            }),
        )
}
