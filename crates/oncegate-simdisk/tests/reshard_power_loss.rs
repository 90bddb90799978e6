//! Power cuts during `oncegate reshard` (2 to 4 shards), on the simulated disk: wherever
//! the power goes (copying a group, rewriting the slot map or the manifest, writing an
//! epoch file, deleting at the source), plain or torn, the directory opens with every
//! key answered as it was, and running the reshard again finishes it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use oncegate_core::{Outcome, ReserveReply, State, Tenant};
use oncegate_engine::reshard::add_shards_on;
use oncegate_engine::{
    CommitRequest, Engine, EngineConfig, Faults, KeyRequest, ManualClock, ReserveRequest, StoreConfig,
};
use oncegate_simdisk::disk::{Cut, Disk};
use rand::SeedableRng;

const T0: u64 = 1_700_000_000_000;

/// Each key's token, and whether it was committed.
type Written = HashMap<String, (u64, bool)>;

fn config(shards: u32) -> EngineConfig {
    let store = StoreConfig::default();
    EngineConfig { data_dir: PathBuf::from("/data"), shards, store, ..EngineConfig::default() }
}

fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(T0))
}

fn open(disk: &Disk, shards: u32) -> Engine {
    Engine::open_on(config(shards), clock(), Faults::default(), Arc::new(disk.boot())).expect("opens")
}

/// The offline reshard from 2 shards to 4 on `disk`.
fn reshard(disk: &Disk) -> Result<oncegate_engine::reshard::Resharded, oncegate_engine::ResizeError> {
    add_shards_on(&config(2), 4, clock(), Arc::new(disk.boot()), &Faults::default(), &mut |_, _| {})
}

fn fill(disk: &Disk) -> Written {
    let engine = open(disk, 2);
    let tenant = Tenant::default_tenant();
    let mut written = Written::new();
    for i in 0..60 {
        let key = format!("k{i}");
        let request = ReserveRequest {
            namespace: "live".into(),
            key: key.clone(),
            lease_ms: 600_000,
            ..Default::default()
        };
        let ReserveReply::Granted { token, .. } = engine.reserve_blocking(&tenant, request).unwrap().reply
        else {
            panic!("a fresh key is granted")
        };
        let committed = i % 3 != 0;
        if committed {
            let commit = CommitRequest {
                namespace: "live".into(),
                key: key.clone(),
                token,
                outcome: Outcome::Succeeded,
                response: key.as_bytes().to_vec(),
            };
            engine.commit_blocking(&tenant, commit).unwrap();
        }
        written.insert(key, (token, committed));
    }
    engine.shutdown();
    written
}

/// Opens the directory with the shard count its manifest has, and checks every key.
fn check(disk: &Disk, written: &Written, context: &str) -> u32 {
    let boot = disk.boot();
    let shards = oncegate_engine::testing::manifest::read(&boot, &config(2).data_dir)
        .unwrap()
        .expect("a manifest")
        .shards;
    let engine = open(disk, shards);
    let tenant = Tenant::default_tenant();
    for (key, (token, committed)) in written {
        let request = KeyRequest { namespace: "live".into(), key: key.clone(), token: 0, lease_ms: 0 };
        let view = engine.get_blocking(&tenant, request).unwrap();
        let state = if *committed { State::Completed } else { State::Pending };
        assert_eq!((view.state, view.token), (state, *token), "{context}: {key}");
    }
    let stored: u64 = engine.stats().iter().map(|s| s.records_pending + s.records_completed).sum();
    assert_eq!(stored, written.len() as u64, "{context}: every key stored once");
    engine.shutdown();
    shards
}

/// Cuts spread over a whole reshard's disk operations, plain and torn: after each, the
/// directory opens with every key as written, stored once, and the reshard finishes when
/// run again.
fn power_cuts_in_a_reshard(cuts: u64) {
    // How many disk operations a whole reshard takes, to spread the cuts over it.
    let probe = Disk::new();
    fill(&probe);
    let before = probe.stats().ops;
    reshard(&probe).unwrap();
    let total = probe.stats().ops - before;
    assert!(total > 50, "a reshard is many operations: {total}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(1130);
    for n in 0..cuts {
        let at = 1 + total * n / cuts;
        let disk = Disk::new();
        let written = fill(&disk);
        disk.cut_after_ops(at);
        let result = reshard(&disk);
        disk.cut();
        let cut = if n % 2 == 0 { Cut::Plain } else { Cut::Torn };
        disk.restart(cut, &mut rng);
        let context = format!("cut after {at} of {total} ops ({cut:?})");
        check(&disk, &written, &context);
        let again =
            reshard(&disk).unwrap_or_else(|e| panic!("{context}: the reshard finishes when run again: {e}"));
        if result.is_ok() {
            // It reported success (the power went only as it closed its files): all of
            // it was durable.
            assert_eq!(again.slots_moved, 0, "{context}: a finished reshard was lost");
        }
        assert_eq!(check(&disk, &written, &context), 4, "{context}");
    }
}

#[test]
fn a_power_cut_anywhere_in_a_reshard_keeps_every_key_and_the_reshard_finishes() {
    power_cuts_in_a_reshard(40);
}
