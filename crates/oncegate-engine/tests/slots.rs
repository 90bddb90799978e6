//! The slot map: a new directory gets one that routes as `slot % shards` did, a directory
//! made before the map gets exactly that map (no key moves), and a map that is lost or
//! damaged is refused, never recomputed.

mod common;

use std::sync::Arc;

use common::*;
use oncegate_core::route::SLOT_COUNT;
use oncegate_core::{ReserveReply, State};
use oncegate_engine::testing::manifest::{MANIFEST_FILE, ROUTING, ROUTING_COMPUTED, ROUTING_WHOLE_KEY};
use oncegate_engine::testing::slots::SLOTS_FILE;
use oncegate_engine::{Engine, EngineConfig, Faults, LayoutError, ManualClock, OpenError};

fn try_open(config: EngineConfig, clock: &ManualClock) -> Result<Engine, OpenError> {
    Engine::open_with(config, Arc::new(clock.clone()), Faults::default())
}

fn manifest(dir: &std::path::Path) -> String {
    std::fs::read_to_string(dir.join(MANIFEST_FILE)).unwrap()
}

/// Whether the manifest names exactly `routing`.
fn routes_by(dir: &std::path::Path, routing: &str) -> bool {
    manifest(dir).lines().any(|line| line == format!("routing = \"{routing}\""))
}

#[test]
fn a_new_directory_is_routed_by_its_slot_map_spread_evenly() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let engine = open(EngineConfig { shards: 3, ..config(dir.path()) }, &clock, &Faults::default());
    assert!(routes_by(dir.path(), ROUTING), "{}", manifest(dir.path()));
    assert!(dir.path().join(SLOTS_FILE).exists());
    let slots: Vec<u32> = engine.stats().iter().map(|s| s.slots).collect();
    assert_eq!(slots, vec![5_462, 5_461, 5_461]);
    assert_eq!(slots.iter().sum::<u32>(), SLOT_COUNT);
    for key in ["a", "b", "fill-8812"] {
        let scope = engine.scope(&tenant(), "live", key).unwrap();
        assert_eq!(engine.shard_of(&scope), oncegate_core::route::shard_of(&scope, 3));
    }
}

/// A directory written before the slot map (the schema-v4 fixture: its manifest routes by
/// `slot % shards`) keeps every key where it was.
#[test]
fn a_directory_routed_by_slot_mod_shards_gets_that_map_and_keeps_its_keys() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/schema-v4");
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    assert!(manifest(dir.path()).contains(ROUTING_COMPUTED));
    let clock = ManualClock::new(1_700_000_000_000 + 1_000);
    let config = EngineConfig { shards: 2, ..config(dir.path()) };
    let engine = try_open(config.clone(), &clock).expect("the old directory opens");
    assert!(
        routes_by(dir.path(), ROUTING_WHOLE_KEY),
        "the manifest names the map now, and whole-key routing"
    );
    let acme = oncegate_core::Tenant::new("acme").unwrap();
    let done = engine
        .get_blocking(
            &acme,
            oncegate_engine::KeyRequest {
                namespace: "live".into(),
                key: "done".into(),
                token: 0,
                lease_ms: 0,
            },
        )
        .unwrap();
    assert_eq!((done.state, done.response.as_slice()), (State::Completed, &b"answer"[..]));
    drop(engine);
    // And it opens again by the map.
    let engine = try_open(config, &clock).expect("reopens");
    let reply = engine
        .reserve_blocking(
            &acme,
            oncegate_engine::ReserveRequest {
                namespace: "live".into(),
                key: "done".into(),
                fingerprint: b"fp".to_vec(),
                ..Default::default()
            },
        )
        .unwrap()
        .reply;
    assert!(matches!(reply, ReserveReply::Completed { .. }), "{reply:?}");
}

/// An upgrade that wrote the map but crashed before the manifest named it: the next
/// open finishes it.
#[test]
fn an_upgrade_cut_between_the_map_and_the_manifest_finishes_at_the_next_open() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let config = EngineConfig { shards: 2, ..config(dir.path()) };
    drop(open(config.clone(), &clock, &Faults::default()));
    let text = manifest(dir.path()).replace(ROUTING, ROUTING_COMPUTED);
    std::fs::write(dir.path().join(MANIFEST_FILE), text).unwrap();
    drop(try_open(config, &clock).expect("opens"));
    assert!(routes_by(dir.path(), ROUTING_WHOLE_KEY), "{}", manifest(dir.path()));
}

#[test]
fn a_lost_slot_map_is_refused_not_recomputed() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let config = EngineConfig { shards: 2, ..config(dir.path()) };
    drop(open(config.clone(), &clock, &Faults::default()));
    std::fs::remove_file(dir.path().join(SLOTS_FILE)).unwrap();
    let refused = try_open(config, &clock).expect_err("refused");
    assert!(matches!(refused, OpenError::Layout(LayoutError::SlotMapMissing { .. })), "{refused:?}");
    assert!(refused.to_string().contains("will not guess"), "{refused}");
}

#[test]
fn a_damaged_slot_map_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let config = EngineConfig { shards: 2, ..config(dir.path()) };
    drop(open(config.clone(), &clock, &Faults::default()));
    let path = dir.path().join(SLOTS_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[100] ^= 0x01;
    std::fs::write(&path, bytes).unwrap();
    let refused = try_open(config, &clock).expect_err("refused");
    assert!(matches!(refused, OpenError::Layout(LayoutError::SlotMap(_))), "{refused:?}");
    assert!(refused.to_string().contains("checksum"), "{refused}");
}
