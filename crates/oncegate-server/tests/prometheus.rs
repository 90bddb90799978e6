//! A real Prometheus (Debian's `prometheus` package) scrapes the metrics listener with the
//! shipped alert rules loaded (config/prometheus/oncegate-rules.yml): a shard halted by a
//! failed sync fires `OncegateShardHalted`; every expression of the Grafana dashboard
//! (config/grafana/oncegate.json) parses and names metrics the server exports; and
//! `promtool check metrics` finds nothing to say about `/metrics`.
//!
//! Without `prometheus` and `promtool` on the PATH the test passes with a note, unless
//! `ONCEGATE_REQUIRE_PROMETHEUS=1` (set by `.ci/run`, which installs them) fails it.

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{granted, http_get, reserve, start_with};
use oncegate_engine::ShardState;
use oncegate_proto::v1 as pb;
use serde_json::Value;

/// How long Prometheus may take to start, scrape, evaluate and fire: it runs on its own
/// clock (a 1 s scrape and evaluation interval here), so the test polls its API.
const PROMETHEUS_DEADLINE: Duration = Duration::from_secs(90);
/// Between two polls of Prometheus's API.
const POLL: Duration = Duration::from_millis(250);

fn repository(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(path)
}

/// Whether the tools are here; without them the test is skipped, unless CI requires them.
fn tools_present() -> bool {
    let found = ["prometheus", "promtool"]
        .iter()
        .all(|tool| Command::new(tool).arg("--version").output().is_ok_and(|out| out.status.success()));
    if !found && std::env::var("ONCEGATE_REQUIRE_PROMETHEUS").is_ok_and(|v| v == "1") {
        panic!(
            "ONCEGATE_REQUIRE_PROMETHEUS=1 but prometheus or promtool is missing (apt-get install -y prometheus)"
        );
    }
    if !found {
        eprintln!("prometheus or promtool not found: the real-Prometheus test is skipped");
    }
    found
}

/// A Prometheus process, killed when dropped.
struct Prometheus {
    child: Child,
    web: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts Prometheus scraping `target` every second with the shipped rules.
    fn start(target: SocketAddr) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let rules = repository("config/prometheus/oncegate-rules.yml").canonicalize().unwrap();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\n\
             scrape_configs:\n  - job_name: oncegate\n    static_configs:\n      - targets: ['{target}']\n",
            rules.display()
        );
        std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
        let web = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", dir.path().join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={web}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus starts");
        Prometheus { child, web, _dir: dir }
    }

    /// `GET /api/v1/{path}` as JSON, or `None` while Prometheus is not answering yet.
    fn api(&self, path: &str) -> Option<Value> {
        std::net::TcpStream::connect(self.web).ok()?;
        let (_, body) = http_get(self.web, &format!("/api/v1/{path}"));
        serde_json::from_str(&body).ok()
    }

    /// Polls `path` until `done` holds for its answer, up to the deadline.
    fn wait_for(&self, path: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + PROMETHEUS_DEADLINE;
        loop {
            if let Some(answer) = self.api(path)
                && done(&answer)
            {
                return answer;
            }
            assert!(
                Instant::now() < deadline,
                "Prometheus never showed {what} within {PROMETHEUS_DEADLINE:?}"
            );
            std::thread::sleep(POLL);
        }
    }
}

/// Percent-encodes a query parameter.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The dashboard's expressions, with Grafana's variables given values Prometheus reads.
fn dashboard_expressions() -> Vec<String> {
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(repository("config/grafana/oncegate.json")).unwrap())
            .unwrap();
    let panels = dashboard["panels"].as_array().expect("panels");
    let expressions: Vec<String> = panels
        .iter()
        .flat_map(|panel| panel["targets"].as_array().cloned().unwrap_or_default())
        .map(|target| target["expr"].as_str().expect("an expression").to_owned())
        .map(|expr| expr.replace("$__rate_interval", "1m").replace("$instance", ".*"))
        .collect();
    assert!(expressions.len() >= 12, "the dashboard has {} expressions", expressions.len());
    expressions
}

/// The metric names an expression reads (a histogram's by its base name).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("oncegate_") || word.starts_with("process_") {
            names.insert(word.trim_end_matches("_bucket").to_owned());
        }
    }
    names
}

/// `promtool check metrics` on the exposition text: silent and successful.
fn promtool_check_metrics(exposition: &str) {
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    promtool.stdin.take().unwrap().write_all(exposition.as_bytes()).unwrap();
    let out = promtool.wait_with_output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && said.trim().is_empty(), "promtool check metrics: {said}");
}

/// Every dashboard expression parses in Prometheus and reads exported metrics.
fn dashboard_reads_exported_metrics(prometheus: &Prometheus, exposition: &str) {
    for expr in dashboard_expressions() {
        let answer = prometheus.api(&format!("query?query={}", encode(&expr))).expect("Prometheus answers");
        assert_eq!(answer["status"], "success", "{expr}: {answer}");
        for name in metric_names(&expr) {
            assert!(
                exposition.contains(&format!("# TYPE {name} ")),
                "{expr} reads {name}, which /metrics lacks"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_sees_a_halted_shard_fire_and_the_dashboard_s_metrics() {
    if !tools_present() {
        return;
    }
    let server = start_with(|_| {}).await;
    let mut client = server.client().await;
    // Traffic, so that the request and commit metrics exist.
    let grant = granted(&client.reserve(reserve("first")).await.unwrap().into_inner());
    let commit = pb::CommitRequest {
        namespace: "live".into(),
        key: "first".into(),
        token: grant,
        outcome: pb::Outcome::Succeeded as i32,
        response: b"r".to_vec(),
    };
    client.commit(commit).await.unwrap();
    let metrics_addr = server.metrics_addr;
    let exposition = tokio::task::spawn_blocking(move || http_get(metrics_addr, "/metrics").1).await.unwrap();
    promtool_check_metrics(&exposition);

    let prometheus = tokio::task::spawn_blocking(move || Prometheus::start(metrics_addr)).await.unwrap();
    // A failed sync halts the key's shard.
    let scope = server.engine.scope(&oncegate_core::Tenant::default_tenant(), "live", "halts").unwrap();
    let shard = server.engine.shard_of(&scope);
    server.faults.fail_syncs(1);
    client.reserve(reserve("halts")).await.expect_err("the failed sync is refused");
    assert!(server.engine.wait_shard_state(shard, ShardState::Halted, Duration::from_secs(10)));

    let prometheus = tokio::task::spawn_blocking(move || {
        let shard = shard.to_string();
        prometheus.wait_for("alerts", "OncegateShardHalted firing", |answer| {
            answer["data"]["alerts"].as_array().is_some_and(|alerts| {
                alerts.iter().any(|alert| {
                    alert["labels"]["alertname"] == "OncegateShardHalted"
                        && alert["labels"]["shard"] == shard.as_str()
                        && alert["state"] == "firing"
                })
            })
        });
        prometheus
    })
    .await
    .unwrap();
    tokio::task::spawn_blocking(move || dashboard_reads_exported_metrics(&prometheus, &exposition))
        .await
        .unwrap();
    drop(client);
    server.stop().await;
}
