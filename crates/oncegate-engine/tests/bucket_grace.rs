//! The bucket grace of derived keys (`bucket_grace_ms`): a retry that crosses a bucket
//! boundary is answered from the earlier bucket's key while that key holds a live record
//! (pending, abandoned or completed), and reserves the current bucket's key otherwise. Both stores, four shards,
//! so both buckets must be decided together on the shard their base routes to.

mod common;

use common::*;
use oncegate_core::{Code, Key, Outcome, ReserveReply};
use oncegate_engine::testing::manifest::{MANIFEST_FILE, ROUTING, ROUTING_WHOLE_KEY};
use oncegate_engine::{Engine, ManualClock, ReserveRequest};

const BUCKET_MS: u64 = 60_000;
const GRACE_MS: u64 = 2_000;
/// The first bucket boundary after T0.
const BOUNDARY: u64 = (T0 / BUCKET_MS + 1) * BUCKET_MS;
const BASE: &str = "trade:binance:BTCUSDT:buy:0.5:live";

fn trade(fingerprint: &[u8]) -> ReserveRequest {
    ReserveRequest {
        namespace: "live".into(),
        key_parts: BASE.split(':').map(String::from).collect(),
        bucket_ms: BUCKET_MS,
        bucket_grace_ms: GRACE_MS,
        lease_ms: 1_000,
        fingerprint: fingerprint.to_vec(),
        ..ReserveRequest::default()
    }
}

fn bucket_key(at_ms: u64) -> String {
    format!("{BASE}::{}", at_ms / BUCKET_MS)
}

/// An engine of four shards whose clock reads `at_ms`.
fn engine_at(dir: &std::path::Path, at_ms: u64) -> (Engine, ManualClock) {
    let clock = ManualClock::new(at_ms);
    let engine =
        open(oncegate_engine::EngineConfig { shards: 4, ..config(dir) }, &clock, &Default::default());
    (engine, clock)
}

on_each_store! {
    fn a_retry_across_the_boundary_within_the_grace_replays_the_earlier_bucket() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, clock) = engine_at(dir.path(), BOUNDARY - 100);
        let t = tenant();
        let first = engine.reserve_blocking(&t, trade(b"A")).unwrap();
        assert_eq!(first.key.as_str(), bucket_key(BOUNDARY - 100));
        let token = granted(&first.reply);
        engine.commit_blocking(&t, commit(first.key.as_str(), token, b"filled")).unwrap();

        clock.advance(200);
        let retry = engine.reserve_blocking(&t, trade(b"A")).unwrap();
        assert_eq!(retry.key, first.key, "answered from the earlier bucket's key");
        let ReserveReply::Completed { token: replayed, response, outcome, .. } = retry.reply else {
            panic!("expected the replay, got {:?}", retry.reply)
        };
        assert_eq!((replayed, response.as_slice(), outcome), (token, &b"filled"[..], Outcome::Succeeded));

        // Another payload within the grace is the earlier key's mismatch, not a new order.
        let other = engine.reserve_blocking(&t, trade(b"B")).unwrap();
        assert_eq!(other.key, first.key);
        assert!(matches!(other.reply, ReserveReply::Mismatch { .. }), "{:?}", other.reply);
    }

    fn a_retry_within_the_grace_while_the_first_runs_is_in_progress_on_the_earlier_key() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, clock) = engine_at(dir.path(), BOUNDARY - 100);
        let t = tenant();
        let first = engine.reserve_blocking(&t, ReserveRequest { lease_ms: 30_000, ..trade(b"A") }).unwrap();
        granted(&first.reply);
        clock.advance(GRACE_MS);
        let retry = engine.reserve_blocking(&t, trade(b"A")).unwrap();
        assert_eq!(retry.key, first.key);
        assert!(matches!(retry.reply, ReserveReply::InProgress { .. }), "{:?}", retry.reply);
    }

    fn past_the_grace_the_current_bucket_is_reserved() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, clock) = engine_at(dir.path(), BOUNDARY - 100);
        let t = tenant();
        let first = engine.reserve_blocking(&t, trade(b"A")).unwrap();
        let token = granted(&first.reply);
        engine.commit_blocking(&t, commit(first.key.as_str(), token, b"filled")).unwrap();
        // The grace is [boundary, boundary + grace): its last instant still replays.
        clock.advance(100 + GRACE_MS - 1);
        assert_eq!(engine.reserve_blocking(&t, trade(b"A")).unwrap().key, first.key);
        clock.advance(1);
        let later = engine.reserve_blocking(&t, trade(b"A")).unwrap();
        assert_eq!(later.key.as_str(), bucket_key(BOUNDARY));
        assert!(granted(&later.reply) > token);
    }

    fn an_abandoned_earlier_key_is_taken_over_and_its_stalled_holder_fenced_off() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, clock) = engine_at(dir.path(), BOUNDARY - 1_500);
        let t = tenant();
        // The first attempt stalls: its lease (1 s) runs out before the boundary.
        let first = engine.reserve_blocking(&t, trade(b"A")).unwrap();
        let stalled = granted(&first.reply);
        clock.advance(1_600);
        let retry = engine.reserve_blocking(&t, trade(b"A")).unwrap();
        assert_eq!(retry.key, first.key, "the retry takes the earlier key over");
        let ReserveReply::Granted { token, attempt, previous, .. } = retry.reply else {
            panic!("expected a grant, got {:?}", retry.reply)
        };
        assert_eq!((attempt, previous), (2, oncegate_core::Previous::Abandoned), "and is told");
        assert!(token > stalled);
        // The stalled attempt's late commit is refused: only one of the two may complete.
        let late = engine.commit_blocking(&t, commit(first.key.as_str(), stalled, b"late")).unwrap_err();
        assert_eq!(late.code(), Code::LeaseLost);
        engine.commit_blocking(&t, commit(first.key.as_str(), token, b"filled")).unwrap();
    }

    fn a_released_earlier_key_leaves_the_retry_to_the_current_bucket() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, clock) = engine_at(dir.path(), BOUNDARY - 100);
        let t = tenant();
        let first = engine.reserve_blocking(&t, trade(b"A")).unwrap();
        engine.release_blocking(&t, key(first.key.as_str(), granted(&first.reply))).unwrap();
        clock.advance(200);
        let retry = engine.reserve_blocking(&t, trade(b"A")).unwrap();
        assert_eq!(retry.key.as_str(), bucket_key(BOUNDARY));
        granted(&retry.reply);
    }

    fn derived_keys_are_found_again_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, clock) = engine_at(dir.path(), BOUNDARY - 100);
        let t = tenant();
        let first = engine.reserve_blocking(&t, trade(b"A")).unwrap();
        engine.commit_blocking(&t, commit(first.key.as_str(), granted(&first.reply), b"filled")).unwrap();
        drop(engine);
        // The reopened directory checks every stored hash against its routing.
        drop(clock);
        let (engine, _clock) = engine_at(dir.path(), BOUNDARY + 100);
        let retry = engine.reserve_blocking(&t, trade(b"A")).unwrap();
        assert_eq!(retry.key, first.key);
        assert!(matches!(retry.reply, ReserveReply::Completed { .. }), "{:?}", retry.reply);
    }

    fn a_waiting_retry_answered_from_the_earlier_key_reports_that_key() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, clock) = engine_at(dir.path(), BOUNDARY - 100);
        let t = tenant();
        let first = engine.reserve_blocking(&t, ReserveRequest { lease_ms: 30_000, ..trade(b"A") }).unwrap();
        let token = granted(&first.reply);
        clock.advance(200);
        // Queued before the commit below (the engine sends before it returns the future).
        let waiting = engine.reserve(&t, ReserveRequest { wait_ms: 10_000, ..trade(b"A") });
        engine.commit_blocking(&t, commit(first.key.as_str(), token, b"filled")).unwrap();
        let answered = block_on(waiting).unwrap();
        assert_eq!(answered.key, first.key);
        assert!(matches!(answered.reply, ReserveReply::Completed { .. }), "{:?}", answered.reply);
    }
}

#[test]
fn the_grace_must_be_shorter_than_the_bucket_and_needs_key_parts() {
    let dir = tempfile::tempdir().unwrap();
    let (engine, _clock) = engine_at(dir.path(), BOUNDARY);
    let t = tenant();
    let cases = [
        (ReserveRequest { bucket_grace_ms: BUCKET_MS, ..trade(b"") }, "bucket_grace_ms is 60000 ms"),
        (
            ReserveRequest { bucket_grace_ms: 5, ..reserve("k") },
            "bucket_grace_ms: only applies with key_parts",
        ),
    ];
    for (request, message) in cases {
        let err = engine.reserve_blocking(&t, request).unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.to_string().contains(message), "'{err}' should contain '{message}'");
    }
}

/// A directory made before bucket routing keeps routing whole keys and its derived keys'
/// old format (that its stored keys are still found is `tests/slots.rs`'s); the grace,
/// which needs both buckets on one shard, is refused there with the reason.
#[test]
fn a_directory_routed_by_whole_keys_keeps_its_format_and_refuses_the_grace() {
    let dir = tempfile::tempdir().unwrap();
    let (engine, _clock) = engine_at(dir.path(), BOUNDARY);
    drop(engine);
    let manifest = dir.path().join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&manifest).unwrap();
    assert!(text.contains(ROUTING), "{text}");
    std::fs::write(&manifest, text.replace(ROUTING, ROUTING_WHOLE_KEY)).unwrap();

    let (engine, _clock) = engine_at(dir.path(), BOUNDARY);
    let t = tenant();
    let err = engine.reserve_blocking(&t, trade(b"")).unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.to_string().contains("bucket_grace_ms: needs bucket routing"), "{err}");
    let plain = engine.reserve_blocking(&t, ReserveRequest { bucket_grace_ms: 0, ..trade(b"") }).unwrap();
    assert_eq!(plain.key, Key::from_stored(format!("{BASE}:{}", BOUNDARY / BUCKET_MS)));
}
