//! The power-loss harness as part of the suite: 500 cuts, half of them torn, must find
//! every acknowledged call after every restart; and the harness must see the losses of
//! `durability = "normal"` and of a deliberate ack-before-commit bug as lost
//! acknowledgements, while the same plan without them passes, or it proves nothing.

use oncegate_engine::{Durability, StoreKind};
use oncegate_simdisk::harness::{Plan, Report, run};

fn summary(report: &Report) -> String {
    let violations: Vec<String> = report.violations.iter().take(10).map(ToString::to_string).collect();
    format!(
        "{} cuts ({} torn, {} while opening, {} mid-checkpoint), {} checkpoints ({} by the engine's count), {} acknowledged, {} keys and {} grants checked; violations: {violations:#?}",
        report.cuts,
        report.torn,
        report.cut_while_opening,
        report.cut_mid_checkpoint,
        report.checkpoints,
        report.engine_checkpoints,
        report.acknowledged,
        report.keys_checked,
        report.grants_checked,
    )
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

/// The same on the log store: a transaction is one frame appended and synced, cut
/// anywhere (a torn frame, a segment half zero-filled, a segment being recycled).
/// One shard with a log of at most six 320 KiB segments, so that compaction copies and
/// retires segments within the run (about a dozen times; the engine's count misses those
/// of cycles cut short) and cuts also land inside it. The harness keeps every completed
/// key live, and nothing expires, so without a bound such a log is full ("shard 0 file
/// is full") after about 8,000 keys, 48,000 acknowledged calls: 400 cuts made 41,000
/// calls here and 49,200 on CI (which batches more per disk operation), so CI filled it
/// at cut 382. Each client stops at 700 keys (4,200 in all); from there its keys are
/// granted, heartbeated and released, so the log keeps being written and compacted while
/// its live records stay at about half of it (800 cuts, 79,000 calls, did not fill it).
#[test]
fn every_acknowledged_call_survives_400_plain_and_torn_power_cuts_on_a_compacting_log() {
    let plan = Plan {
        cuts: 400,
        torn_every: 2,
        seed: 14,
        shards: 1,
        store: StoreKind::Log,
        client_keys_max: 700,
        ..Plan::default()
    };
    let report = run(&plan);
    assert!(report.violations.is_empty(), "{}", summary(&report));
    assert!(report.engine_checkpoints >= 5, "compaction retired few segments: {}", summary(&report));
    assert_eq!((report.cuts, report.torn), (400, 200), "{}", summary(&report));
    assert!(report.acknowledged > 10_000, "{}", summary(&report));
    assert!(report.grants_checked > 1_000, "{}", summary(&report));
    assert!(report.keys_checked > 10_000, "{}", summary(&report));
    assert!(report.cut_while_opening > 10, "{}", summary(&report));
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

#[test]
fn the_harness_sees_the_log_store_without_its_syncs() {
    let plan = Plan { cuts: 150, violations_max: 1, seed: 15, store: StoreKind::Log, ..Plan::default() };
    sees(Plan { durability: Durability::Normal, ..plan });
}
