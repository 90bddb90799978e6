//! Metrics, liveness and readiness over plain HTTP on the gRPC port: the exposition text
//! is parsed, and the counters move as requests flow. One test per process, because the
//! metrics recorder is process-wide.

mod common;

use std::collections::BTreeMap;

use common::{http, http_get, start_in};
use oncegate_engine::EngineConfig;
use oncegate_proto::v1 as pb;
use oncegate_server::Config;

/// The samples of a Prometheus exposition: `name{labels}` -> value. Chunked transfer
/// framing lines do not parse as samples and are skipped.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

fn value(samples: &BTreeMap<String, f64>, name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|(series, _)| {
            series.split('{').next() == Some(name)
                && labels.iter().all(|(k, v)| series.contains(&format!("{k}=\"{v}\"")))
        })
        .map(|(_, v)| v)
        .sum()
}

/// After the traffic: calls and commits timed, batches measured, records counted, and the
/// process's figures.
fn timings_records_and_process_are_exported(scraped: &BTreeMap<String, f64>) {
    assert!(value(scraped, "oncegate_request_duration_seconds_count", &[("rpc", "reserve")]) >= 5.0);
    assert!(value(scraped, "oncegate_shard_commit_seconds_count", &[]) >= 2.0, "commits are timed");
    assert!(value(scraped, "oncegate_shard_batch_len_count", &[]) >= 2.0, "batches are measured");
    assert_eq!(value(scraped, "oncegate_shard_records_completed", &[]), 1.0);
    assert_eq!(value(scraped, "oncegate_shard_records_pending", &[]), 0.0);
    assert!(value(scraped, "oncegate_shard_file_bytes", &[]) > 0.0, "a written shard file has pages");
    assert!(value(scraped, "process_resident_memory_bytes", &[]) > 0.0);
    assert!(value(scraped, "process_open_fds", &[]) > 0.0);
}

/// The build's labels, and what the alert rules read (config/prometheus/oncegate-rules.yml).
fn build_and_alert_gauges_are_exported(scraped: &BTreeMap<String, f64>) {
    let build = [("version", env!("CARGO_PKG_VERSION")), ("commit", oncegate_server::build::COMMIT)];
    assert_eq!(value(scraped, "oncegate_build_info", &build), 1.0, "the build is labelled: {scraped:?}");
    assert_eq!(value(scraped, "oncegate_shard_state", &[("state", "serving")]), 2.0);
    assert_eq!(value(scraped, "oncegate_shard_state", &[("state", "halted")]), 0.0);
    let max = EngineConfig::default().mailbox_depth_max as f64;
    assert_eq!(value(scraped, "oncegate_shard_mailbox_depth_max", &[("shard", "0")]), max);
    let file_max = oncegate_engine::SqliteConfig::default().shard_file_bytes_max as f64;
    assert_eq!(value(scraped, "oncegate_shard_file_bytes_max", &[("shard", "0")]), file_max);
    assert!(scraped.keys().any(|series| series.starts_with("oncegate_shard_clock_ahead_seconds{")));
    assert!(value(scraped, "oncegate_shard_file_bytes", &[("shard", "0")]) > 0.0, "read at open");
    assert!(value(scraped, "process_max_fds", &[]) > 0.0, "the open-files limit is read");
}

fn reserve(key: &str) -> pb::ReserveRequest {
    pb::ReserveRequest { namespace: "live".into(), key: key.into(), ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_health_and_readiness_follow_the_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config {
        engine: EngineConfig {
            data_dir: dir.path().to_owned(),
            reopen_backoff_ms_min: 60_000,
            reopen_backoff_ms_max: 60_000,
            ..EngineConfig::default()
        },
        ..Config::default()
    };
    config.server.health_poll_ms = 10;
    let server = start_in(config, Some(dir)).await;
    let addr = server.metrics_addr;
    let scrape = move || tokio::task::spawn_blocking(move || samples(&http_get(addr, "/metrics").1));

    assert_eq!(tokio::task::spawn_blocking(move || http_get(addr, "/healthz")).await.unwrap().0, 200);
    assert_eq!(tokio::task::spawn_blocking(move || http_get(addr, "/readyz")).await.unwrap().0, 200);
    let before = scrape().await.unwrap();
    assert_eq!(value(&before, "oncegate_shard_serving", &[]), 2.0, "both shards serve");
    build_and_alert_gauges_are_exported(&before);

    let mut client = server.client().await;
    let granted = client.reserve(reserve("a")).await.unwrap().into_inner();
    let Some(pb::reserve_response::Outcome::Granted(g)) = granted.outcome else { panic!() };
    client.reserve(reserve("a")).await.unwrap();
    client
        .commit(pb::CommitRequest {
            namespace: "live".into(),
            key: "a".into(),
            token: g.token,
            outcome: pb::Outcome::Succeeded as i32,
            response: b"r".to_vec(),
        })
        .await
        .unwrap();
    client.reserve(reserve("a")).await.unwrap();
    client.reserve(pb::ReserveRequest { fingerprint: b"other".to_vec(), ..reserve("a") }).await.unwrap();
    client.reserve(reserve("")).await.unwrap_err();
    client
        .release(pb::ReleaseRequest { namespace: "live".into(), key: "nothing".into(), token: 3 })
        .await
        .unwrap_err();
    // Over HTTP, a body that is not the operation's JSON is refused before the call path
    // and counted as the gRPC front's invalid argument is.
    let malformed = http(server.addr, "POST", "/v1/reserve", None, Some("{not json")).await;
    assert_eq!(malformed.status, 400, "{}", malformed.body);

    let after = scrape().await.unwrap();
    let moved = |labels: &[(&str, &str)]| {
        value(&after, "oncegate_requests_total", labels) - value(&before, "oncegate_requests_total", labels)
    };
    assert_eq!(moved(&[("rpc", "reserve"), ("result", "granted"), ("tenant", "default")]), 1.0);
    assert_eq!(moved(&[("rpc", "reserve"), ("result", "in_progress")]), 1.0);
    assert_eq!(moved(&[("rpc", "reserve"), ("result", "completed")]), 1.0, "the replay is counted");
    assert_eq!(moved(&[("rpc", "reserve"), ("result", "mismatch")]), 1.0);
    assert_eq!(moved(&[("rpc", "reserve"), ("result", "invalid_argument"), ("tenant", "default")]), 2.0);
    assert_eq!(moved(&[("rpc", "commit"), ("result", "ok")]), 1.0);
    assert_eq!(moved(&[("rpc", "release"), ("result", "not_found")]), 1.0);
    timings_records_and_process_are_exported(&after);

    // A failed shard: readiness and the serving gauge say so.
    server.faults.fail_commits(2);
    client.reserve(reserve("b")).await.unwrap_err();
    client.reserve(reserve("c-other-shard-maybe")).await.ok();
    let (status, body) = tokio::task::spawn_blocking(move || http_get(addr, "/readyz")).await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("failed"), "{body}");
    let failed = scrape().await.unwrap();
    assert!(value(&failed, "oncegate_shard_serving", &[]) < 2.0);
    assert!(value(&failed, "oncegate_requests_total", &[("result", "unavailable")]) >= 1.0);
    drop(client);
    server.stop().await;
}
