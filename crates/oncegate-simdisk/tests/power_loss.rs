//! The power-loss harness as part of the suite: 500 cuts, half of them torn, must find
//! every acknowledged call after every restart; and the harness must see the losses of
//! `durability = "normal"` and of a deliberate ack-before-commit bug as lost
//! acknowledgements, while the same plan without them passes, or it proves nothing. A
//! second run cuts the power among batches that spill SQLite's page cache.

use oncegate_engine::Durability;
use oncegate_simdisk::harness::{Plan, Report, run};

fn summary(report: &Report) -> String {
    let violations: Vec<String> = report.violations.iter().take(10).map(ToString::to_string).collect();
    format!("{report}: {violations:#?}")
}

#[test]
fn every_acknowledged_call_survives_500_plain_and_torn_power_cuts() {
    let report = run(&Plan { cuts: 500, torn_every: 2, seed: 11, ..Plan::default() });
    assert!(report.violations.is_empty(), "{}", summary(&report));
    assert_eq!((report.cuts, report.torn), (500, 250), "{}", summary(&report));
    // The run did real work: thousands of calls, grants across cuts, keys checked, and
    // cuts while opening and in the middle of checkpoints.
    assert!(report.acknowledged > 10_000, "{}", summary(&report));
    assert!(report.grants_checked > 1_000, "{}", summary(&report));
    assert!(report.keys_checked > 10_000, "{}", summary(&report));
    assert!(report.cut_while_opening > 10, "{}", summary(&report));
    assert!(report.cut_mid_checkpoint > 10, "{}", summary(&report));
}

/// A batch whose dirty pages outgrow SQLite's page cache writes some of them into the WAL
/// before its commit, and overwrites those frames when it changes the pages again (the
/// gathering VFS writes what it holds first): a 16-page cache and 6,000-byte responses
/// (three overflow pages each) make such batches, and the cuts land among them.
#[test]
fn every_acknowledged_call_survives_power_cuts_among_batches_that_spill_the_page_cache() {
    let plan = Plan {
        cuts: 60,
        clients: 24,
        keys_per_client: 4,
        shards: 1,
        cache_pages: 16,
        response_bytes: 6_000,
        seed: 14,
        ..Plan::default()
    };
    let report = run(&plan);
    assert!(report.violations.is_empty(), "{}", summary(&report));
    // About seven a cut with SQLite 3.50; at least one a cut on average, or the run no
    // longer tests what it is for.
    assert!(report.wal_overwrites >= plan.cuts, "too few batches spilled: {}", summary(&report));
    assert!(report.acknowledged > 1_000, "{}", summary(&report));
}

/// Runs `plan` with a flaw and without: the flawed run must lose an acknowledged write (a
/// grant, commit or release, or a heartbeat, whichever the cut happens to catch), and
/// the same plan without the flaw must not, so the failure is the flaw's.
fn sees(flawed: Plan) {
    let control = run(&Plan { durability: Durability::Full, ack_before_commit: false, ..flawed.clone() });
    assert!(control.violations.is_empty(), "the control run failed: {}", summary(&control));
    let report = run(&flawed);
    assert!(report.lost_acknowledged(), "the flaw lost nothing: {}", summary(&report));
}

#[test]
fn the_harness_sees_the_losses_of_durability_normal() {
    sees(Plan { cuts: 150, durability: Durability::Normal, violations_max: 1, seed: 12, ..Plan::default() });
}

#[test]
fn the_harness_sees_an_acknowledgement_sent_before_its_commit() {
    sees(Plan { cuts: 150, ack_before_commit: true, violations_max: 1, seed: 13, ..Plan::default() });
}
