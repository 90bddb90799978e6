//! The power-loss harness as part of the suite: 500 cuts, half of them torn, must find
//! every acknowledged call after every restart; and the harness must see the losses of
//! `durability = "normal"` and of a deliberate ack-before-commit bug, or it proves
//! nothing.

use oncegate_engine::Durability;
use oncegate_simdisk::harness::{Plan, Report, run};

fn summary(report: &Report) -> String {
    format!(
        "{} cuts ({} torn, {} while opening), {} checkpoints, {} acknowledged, {} keys and {} grants checked; violations: {:#?}",
        report.cuts,
        report.torn,
        report.cut_while_opening,
        report.checkpoints,
        report.acknowledged,
        report.keys_checked,
        report.grants_checked,
        report.violations.iter().take(10).collect::<Vec<_>>()
    )
}

#[test]
fn every_acknowledged_call_survives_500_plain_and_torn_power_cuts() {
    let report = run(&Plan { cuts: 500, torn_every: 2, seed: 11, ..Plan::default() });
    assert!(report.violations.is_empty(), "{}", summary(&report));
    assert_eq!((report.cuts, report.torn), (500, 250), "{}", summary(&report));
    // The run did real work: thousands of calls, grants across cuts, keys checked, cuts
    // while opening and around checkpoints.
    assert!(report.acknowledged > 10_000, "{}", summary(&report));
    assert!(report.grants_checked > 1_000, "{}", summary(&report));
    assert!(report.keys_checked > 10_000, "{}", summary(&report));
    assert!(report.cut_while_opening > 10, "{}", summary(&report));
    assert!(report.checkpoints > 500, "{}", summary(&report));
}

#[test]
fn the_harness_sees_the_losses_of_durability_normal() {
    let report = run(&Plan {
        cuts: 200,
        durability: Durability::Normal,
        violations_max: 1,
        seed: 12,
        ..Plan::default()
    });
    assert!(!report.violations.is_empty(), "durability = normal lost nothing? {}", summary(&report));
}

#[test]
fn the_harness_sees_an_acknowledgement_sent_before_its_commit() {
    let report =
        run(&Plan { cuts: 200, ack_before_commit: true, violations_max: 1, seed: 13, ..Plan::default() });
    assert!(!report.violations.is_empty(), "an early ack lost nothing? {}", summary(&report));
}
