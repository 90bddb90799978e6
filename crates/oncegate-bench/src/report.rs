//! What a run measured, and the tables the tool prints.

use crate::cost::Cost;

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
    /// What the server spent, where the tool could read it.
    pub cost: Option<Cost>,
}

/// Renders reports as a markdown table.
pub fn markdown(reports: &[Report]) -> String {
    let mut out = String::from(
        "| target | in flight | pairs/s | p50 (ms) | p99 (ms) | p99.9 (ms) | errors | replays | commands per batch | server CPU µs/pair | shard CPU µs/command | disk bytes/pair | device bytes/pair |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in reports {
        let cost =
            |f: fn(&Cost) -> f64| r.cost.as_ref().map_or_else(|| "-".to_owned(), |c| format!("{:.1}", f(c)));
        out.push_str(&format!(
            "| {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.target,
            r.in_flight,
            r.pairs_per_s,
            r.p50_us as f64 / 1000.0,
            r.p99_us as f64 / 1000.0,
            r.p999_us as f64 / 1000.0,
            r.errors,
            r.replays,
            r.batch_len_mean.map_or_else(|| "-".to_owned(), |b| format!("{b:.1}")),
            cost(|c| c.cpu_us_per_pair),
            cost(|c| c.shard_cpu_us_per_command),
            cost(|c| c.disk_bytes_per_pair),
            cost(|c| c.device_bytes_per_pair),
        ));
    }
    out
}
