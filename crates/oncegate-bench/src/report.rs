//! What a run measured, and the tables the tool prints.

use crate::cost::Cost;

/// What a run measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Report {
    /// The target's name.
    pub target: String,
    /// Which round of the targets this run was in (from 0; `--rounds`).
    pub round: usize,
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
    /// The tool's own CPU per pair, in microseconds, when the server is another process:
    /// the load generator shares the machine's cores with the server, so a client that
    /// costs more leaves the server less.
    pub load_cpu_us_per_pair: Option<f64>,
}

/// Renders reports as a markdown table, with a column for the round when there were
/// several.
pub fn markdown(reports: &[Report]) -> String {
    let rounds = reports.iter().any(|r| r.round > 0);
    let (head, rule) = if rounds { ("| round ", "| --- ") } else { ("", "") };
    let mut out = format!(
        "{head}| target | in flight | pairs/s | p50 (ms) | p99 (ms) | p99.9 (ms) | errors | replays | commands per batch | server CPU µs/pair | shard CPU µs/command | front CPU µs/command | disk bytes/pair | device bytes/pair | load generator CPU µs/pair |\n\
         {rule}| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in reports {
        let cost =
            |f: fn(&Cost) -> f64| r.cost.as_ref().map_or_else(|| "-".to_owned(), |c| format!("{:.1}", f(c)));
        if rounds {
            out.push_str(&format!("| {} ", r.round + 1));
        }
        out.push_str(&format!(
            "| {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
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
            cost(|c| c.front_cpu_us_per_command),
            cost(|c| c.disk_bytes_per_pair),
            cost(|c| c.device_bytes_per_pair),
            r.load_cpu_us_per_pair.map_or_else(|| "-".to_owned(), |l| format!("{l:.1}")),
        ));
    }
    out
}

/// The median of each figure over the rounds of each target at each load, in the order
/// the targets first ran. On a noisy machine one run says little; the median of runs
/// taken in turns with the other targets says more.
pub fn medians(reports: &[Report]) -> Vec<Report> {
    let mut groups: Vec<Vec<&Report>> = Vec::new();
    for r in reports {
        match groups.iter_mut().find(|g| g[0].target == r.target && g[0].in_flight == r.in_flight) {
            Some(group) => group.push(r),
            None => groups.push(vec![r]),
        }
    }
    groups.iter().map(|runs| median_report(runs)).collect()
}

/// The medians of one target's runs at one load; errors and replays are the runs' totals,
/// so that an error in any round shows.
fn median_report(runs: &[&Report]) -> Report {
    let of = |field: fn(&Report) -> f64| median(runs.iter().map(|r| field(r)));
    let costs: Option<Vec<Cost>> = runs.iter().map(|r| r.cost).collect();
    let cost = costs.map(|costs| {
        let of = |field: fn(&Cost) -> f64| median(costs.iter().map(field));
        Cost {
            cpu_us_per_pair: of(|c| c.cpu_us_per_pair),
            shard_cpu_us_per_command: of(|c| c.shard_cpu_us_per_command),
            front_cpu_us_per_command: of(|c| c.front_cpu_us_per_command),
            disk_bytes_per_pair: of(|c| c.disk_bytes_per_pair),
            device_bytes_per_pair: of(|c| c.device_bytes_per_pair),
        }
    });
    let batches: Option<Vec<f64>> = runs.iter().map(|r| r.batch_len_mean).collect();
    let loads: Option<Vec<f64>> = runs.iter().map(|r| r.load_cpu_us_per_pair).collect();
    Report {
        target: runs[0].target.clone(),
        round: 0,
        in_flight: runs[0].in_flight,
        pairs_per_s: of(|r| r.pairs_per_s),
        p50_us: of(|r| r.p50_us as f64).round() as u64,
        p99_us: of(|r| r.p99_us as f64).round() as u64,
        p999_us: of(|r| r.p999_us as f64).round() as u64,
        errors: runs.iter().map(|r| r.errors).sum(),
        replays: runs.iter().map(|r| r.replays).sum(),
        batch_len_mean: batches.map(|b| median(b.into_iter())),
        cost,
        load_cpu_us_per_pair: loads.map(|l| median(l.into_iter())),
    }
}

/// The middle value (the mean of the two middle ones for an even count); 0 for none.
fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut values: Vec<f64> = values.collect();
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// One of oncegate's targets against a peer (Redis, PostgreSQL) at one load, round by
/// round: each ratio is of two runs of the same round, taken minutes apart at most.
#[derive(Clone, Debug, PartialEq)]
pub struct Ratio {
    /// oncegate's target.
    pub ours: String,
    /// The peer.
    pub peer: String,
    /// Requests in flight.
    pub in_flight: usize,
    /// Pairs/s of ours over the peer's, per round.
    pub pairs: Vec<f64>,
    /// The server's CPU per pair, ours over the peer's, per round where both were read.
    pub cpu: Vec<f64>,
}

impl Ratio {
    /// The median of the rounds' pairs/s ratios.
    pub fn pairs_median(&self) -> f64 {
        median(self.pairs.iter().copied())
    }

    /// The line the tool prints: the median, and each round's ratio when there were several.
    pub fn line(&self) -> String {
        let rounds = |ratios: &[f64]| {
            let each: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
            if ratios.len() > 1 { format!(" (median of {})", each.join(", ")) } else { String::new() }
        };
        let mut line = format!(
            "{} / {} at {} in flight: {:.2}x{}",
            self.ours,
            self.peer,
            self.in_flight,
            self.pairs_median(),
            rounds(&self.pairs)
        );
        if !self.cpu.is_empty() {
            let cpu = median(self.cpu.iter().copied());
            line.push_str(&format!("; server CPU per pair {cpu:.2}x{}", rounds(&self.cpu)));
        }
        line
    }
}

/// Every oncegate target against every peer at each load, matched round by round.
pub fn ratios(reports: &[Report]) -> Vec<Ratio> {
    let is_ours = |r: &&Report| r.target.starts_with("oncegate");
    let mut out: Vec<Ratio> = Vec::new();
    for ours in reports.iter().filter(is_ours) {
        let peers =
            reports.iter().filter(|p| !is_ours(p) && p.in_flight == ours.in_flight && p.round == ours.round);
        for peer in peers {
            let at = out.iter().position(|r| {
                r.ours == ours.target && r.peer == peer.target && r.in_flight == ours.in_flight
            });
            let ratio = match at {
                Some(at) => &mut out[at],
                None => {
                    out.push(Ratio {
                        ours: ours.target.clone(),
                        peer: peer.target.clone(),
                        in_flight: ours.in_flight,
                        pairs: Vec::new(),
                        cpu: Vec::new(),
                    });
                    out.last_mut().expect("just pushed")
                }
            };
            ratio.pairs.push(ours.pairs_per_s / peer.pairs_per_s.max(1e-9));
            if let (Some(a), Some(b)) = (ours.cost, peer.cost) {
                ratio.cpu.push(a.cpu_us_per_pair / b.cpu_us_per_pair.max(1e-9));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(target: &str, round: usize, pairs_per_s: f64, cpu: f64) -> Report {
        Report {
            target: target.to_owned(),
            round,
            in_flight: 64,
            pairs_per_s,
            p50_us: (pairs_per_s / 10.0) as u64,
            p99_us: 9_000,
            p999_us: 20_000,
            errors: 1,
            replays: 10,
            batch_len_mean: None,
            cost: Some(Cost { cpu_us_per_pair: cpu, ..Cost::default() }),
            load_cpu_us_per_pair: None,
        }
    }

    /// oncegate's unary target and Redis in turn, three rounds.
    fn three_rounds() -> [Report; 6] {
        [
            run("oncegate-grpc", 0, 100.0, 20.0),
            run("redis", 0, 200.0, 10.0),
            run("oncegate-grpc", 1, 300.0, 30.0),
            run("redis", 1, 100.0, 30.0),
            run("oncegate-grpc", 2, 200.0, 40.0),
            run("redis", 2, 400.0, 20.0),
        ]
    }

    #[test]
    fn medians_are_per_target_in_the_order_they_first_ran() {
        let medians = medians(&three_rounds());
        let names: Vec<&str> = medians.iter().map(|r| r.target.as_str()).collect();
        assert_eq!(names, ["oncegate-grpc", "redis"]);
        assert_eq!(medians[0].pairs_per_s, 200.0);
        assert_eq!(medians[0].p50_us, 20);
        assert_eq!(medians[0].errors, 3, "errors are summed, never hidden by a median");
        assert_eq!(medians[0].cost.map(|c| c.cpu_us_per_pair), Some(30.0));
        assert_eq!(medians[1].pairs_per_s, 200.0);
    }

    #[test]
    fn the_load_generators_cpu_is_a_median_and_a_dash_where_it_was_not_read() {
        let mut rounds = three_rounds();
        for (report, load) in rounds.iter_mut().step_by(2).zip([9.0, 3.0, 6.0]) {
            report.load_cpu_us_per_pair = Some(load);
        }
        let medians = medians(&rounds);
        assert_eq!(medians[0].load_cpu_us_per_pair, Some(6.0));
        assert_eq!(medians[1].load_cpu_us_per_pair, None, "Redis's runs did not read it");
        let table = markdown(&medians);
        let grpc = table.lines().find(|l| l.starts_with("| oncegate-grpc")).expect("a row");
        let redis = table.lines().find(|l| l.starts_with("| redis")).expect("a row");
        assert!(grpc.ends_with("| 6.0 |"), "{grpc}");
        assert!(redis.ends_with("| - |"), "{redis}");
        assert!(table.lines().next().expect("a header").ends_with("| load generator CPU µs/pair |"));
    }

    #[test]
    fn an_even_count_takes_the_mean_of_the_middle_two() {
        assert_eq!(median([4.0, 1.0, 3.0, 2.0].into_iter()), 2.5);
        assert_eq!(median(std::iter::empty()), 0.0);
    }

    #[test]
    fn ratios_pair_the_runs_of_one_round() {
        let ratios = ratios(&three_rounds());
        assert_eq!(ratios.len(), 1);
        assert_eq!(ratios[0].pairs, [0.5, 3.0, 0.5]);
        assert_eq!(ratios[0].cpu, [2.0, 1.0, 2.0]);
        assert_eq!(ratios[0].pairs_median(), 0.5, "not the ratio of the medians (1.0)");
        assert_eq!(
            ratios[0].line(),
            "oncegate-grpc / redis at 64 in flight: 0.50x (median of 0.50, 3.00, 0.50); \
             server CPU per pair 2.00x (median of 2.00, 1.00, 2.00)"
        );
    }

    #[test]
    fn one_round_prints_one_ratio() {
        let reports = [run("oncegate-session", 0, 300.0, 15.0), run("redis", 0, 200.0, 15.0)];
        assert_eq!(
            ratios(&reports)[0].line(),
            "oncegate-session / redis at 64 in flight: 1.50x; server CPU per pair 1.00x"
        );
    }
}
