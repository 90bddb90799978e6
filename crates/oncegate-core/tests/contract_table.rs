//! The contract table, one named test per cell: state × operation × token freshness ×
//! fingerprint. Each cell names the stored record, the command, `now` and the whole
//! expected decision (the change to store and the reply).

use oncegate_core::{
    Change, Command, Commit, Completion, Decision, Error, Event, Fingerprint, Outcome, Previous, Record,
    Reply, Reserve, ReserveReply, State, Transition, View, answers_from_earlier_bucket, decide,
};

const T0: u64 = 1_000_000;
const LEASE: u64 = 30_000;
const TTL: u64 = 100_000;
/// The token the shard would hand out next.
const NEXT: u64 = 20;
/// The current holder's token in every fixture.
const CUR: u64 = 7;
/// An older token that some earlier attempt held.
const STALE: u64 = 3;

fn fp(bytes: &[u8]) -> Fingerprint {
    Fingerprint::from_stored(bytes.to_vec())
}

/// Granted at T0 with fingerprint "A"; pending until T0 + LEASE, abandoned after.
fn held() -> Record {
    Record {
        token: CUR,
        attempt: 1,
        lease_until_ms: T0 + LEASE,
        expires_at_ms: T0 + TTL,
        ttl_ms: TTL,
        fingerprint: fp(b"A"),
        completion: None,
        history: vec![event(Transition::Granted, T0, CUR)],
    }
}

fn event(transition: Transition, at_ms: u64, token: u64) -> Event {
    Event { transition, at_ms, token }
}

/// `held()` committed at T0 + 10 s with outcome succeeded.
fn done() -> Record {
    let mut r = held();
    r.expires_at_ms = T0 + 10_000 + TTL;
    r.completion = Some(Completion {
        outcome: Outcome::Succeeded,
        response: b"fill-1".to_vec(),
        completed_at_ms: T0 + 10_000,
    });
    r
}

/// Times at which `held()` is pending, abandoned, and expired.
const PENDING_AT: u64 = T0 + 5_000;
const ABANDONED_AT: u64 = T0 + LEASE + 1_000;
const EXPIRED_AT: u64 = T0 + TTL;
const DONE_AT: u64 = T0 + 20_000;

fn reserve(fingerprint: &[u8]) -> Command {
    Command::Reserve(Reserve { ttl_ms: TTL, lease_ms: LEASE, fingerprint: fp(fingerprint), wait_ms: 0 })
}

fn commit(token: u64, outcome: Outcome) -> Command {
    Command::Commit(Commit { token, outcome, response: b"fill-2".to_vec() })
}

fn granted_at(now: u64, attempt: u32, previous: Previous, fingerprint: &[u8]) -> Decision {
    let record = Record {
        token: NEXT,
        attempt,
        lease_until_ms: now + LEASE,
        expires_at_ms: now + TTL,
        ttl_ms: TTL,
        fingerprint: fp(fingerprint),
        completion: None,
        history: match previous {
            Previous::None => vec![event(Transition::Granted, now, NEXT)],
            Previous::Abandoned => {
                let mut history = held().history;
                history.push(event(Transition::Abandoned, T0 + LEASE, CUR));
                history.push(event(Transition::Regranted, now, NEXT));
                history
            }
        },
    };
    let reply = ReserveReply::Granted {
        token: NEXT,
        attempt,
        lease_until_ms: now + LEASE,
        lease_ms: LEASE,
        expires_at_ms: now + TTL,
        previous,
    };
    Decision { change: Change::Put(record), reply: Ok(Reply::Reserve(reply)) }
}

fn keep(reply: Result<Reply, Error>) -> Decision {
    Decision { change: Change::Keep, reply }
}

fn in_progress(now: u64) -> Decision {
    let retry_after_ms = (T0 + LEASE - now).min(oncegate_core::RETRY_AFTER_MS_MAX);
    keep(Ok(Reply::Reserve(ReserveReply::InProgress {
        attempt: 1,
        lease_until_ms: T0 + LEASE,
        retry_after_ms,
    })))
}

fn replay() -> Decision {
    keep(Ok(Reply::Reserve(ReserveReply::Completed {
        token: CUR,
        outcome: Outcome::Succeeded,
        response: b"fill-1".to_vec(),
        completed_at_ms: T0 + 10_000,
        expires_at_ms: T0 + 10_000 + TTL,
    })))
}

fn mismatch(expires_at_ms: u64) -> Decision {
    keep(Ok(Reply::Reserve(ReserveReply::Mismatch { expires_at_ms })))
}

fn completed_by_commit(now: u64, outcome: Outcome) -> Decision {
    let mut record = held();
    record.expires_at_ms = (T0 + TTL).max(now + TTL);
    record.completion = Some(Completion { outcome, response: b"fill-2".to_vec(), completed_at_ms: now });
    record.history.push(event(Transition::Committed, now, CUR));
    let expires_at_ms = record.expires_at_ms;
    Decision { change: Change::Put(record), reply: Ok(Reply::Commit { expires_at_ms }) }
}

fn renewed(now: u64) -> Decision {
    let mut record = held();
    record.lease_until_ms = now + 5_000;
    record.history.push(event(Transition::Heartbeat, now, CUR));
    let reply = Reply::Heartbeat { lease_until_ms: now + 5_000, expires_at_ms: T0 + TTL };
    Decision { change: Change::Put(record), reply: Ok(reply) }
}

fn lease_lost() -> Decision {
    keep(Err(Error::LeaseLost { token: STALE, current: CUR }))
}

fn released() -> Decision {
    Decision { change: Change::Delete, reply: Ok(Reply::Release) }
}

fn view(state: State, record: &Record) -> Decision {
    keep(Ok(Reply::Get(View {
        state,
        token: record.token,
        attempt: record.attempt,
        lease_until_ms: record.lease_until_ms,
        expires_at_ms: record.expires_at_ms,
        outcome: record.completion.as_ref().map(|c| c.outcome),
        response: record.completion.as_ref().map(|c| c.response.clone()).unwrap_or_default(),
    })))
}

/// One test per cell: `name: record, command, now => expected decision`.
macro_rules! cells {
    ($($name:ident: $record:expr, $command:expr, $now:expr => $expected:expr;)+) => {$(
        #[test]
        fn $name() {
            let record: Option<Record> = $record;
            let got = decide(record.as_ref(), &$command, $now, NEXT);
            assert_eq!(got, $expected);
        }
    )+};
}

cells! {
    // free × reserve
    free_reserve_grants_first_attempt: None, reserve(b""), T0 => granted_at(T0, 1, Previous::None, b"");
    free_reserve_with_fingerprint_grants_and_binds_it: None, reserve(b"A"), T0 => granted_at(T0, 1, Previous::None, b"A");
    expired_completed_reserve_grants_as_free: Some(done()), reserve(b"B"), T0 + 10_000 + TTL => granted_at(T0 + 10_000 + TTL, 1, Previous::None, b"B");
    abandoned_past_expiry_reserve_grants_previous_none: Some(held()), reserve(b""), EXPIRED_AT => granted_at(EXPIRED_AT, 1, Previous::None, b"");

    // pending × reserve
    pending_reserve_same_fingerprint_in_progress: Some(held()), reserve(b"A"), PENDING_AT => in_progress(PENDING_AT);
    pending_reserve_no_fingerprint_in_progress: Some(held()), reserve(b""), PENDING_AT => in_progress(PENDING_AT);
    pending_reserve_other_fingerprint_mismatch: Some(held()), reserve(b"B"), PENDING_AT => mismatch(T0 + TTL);
    pending_reserve_retry_after_is_capped: Some(held()), reserve(b"A"), T0 => in_progress(T0);
    pending_reserve_near_lease_end_retry_after_is_remaining: Some(held()), reserve(b"A"), T0 + LEASE - 200 => in_progress(T0 + LEASE - 200);

    // abandoned × reserve
    abandoned_reserve_regrants_with_previous_abandoned: Some(held()), reserve(b"A"), ABANDONED_AT => granted_at(ABANDONED_AT, 2, Previous::Abandoned, b"A");
    abandoned_reserve_no_fingerprint_regrants_keeping_binding: Some(held()), reserve(b""), ABANDONED_AT => granted_at(ABANDONED_AT, 2, Previous::Abandoned, b"A");
    abandoned_reserve_other_fingerprint_mismatch: Some(held()), reserve(b"B"), ABANDONED_AT => mismatch(T0 + TTL);
    abandoned_exactly_at_lease_deadline_regrants: Some(held()), reserve(b"A"), T0 + LEASE => granted_at(T0 + LEASE, 2, Previous::Abandoned, b"A");

    // completed × reserve
    completed_reserve_same_fingerprint_replays: Some(done()), reserve(b"A"), DONE_AT => replay();
    completed_reserve_no_fingerprint_replays: Some(done()), reserve(b""), DONE_AT => replay();
    completed_reserve_other_fingerprint_mismatch: Some(done()), reserve(b"B"), DONE_AT => mismatch(T0 + 10_000 + TTL);
    completed_reserve_just_before_expiry_replays: Some(done()), reserve(b"A"), T0 + 10_000 + TTL - 1 => replay();

    // × commit
    free_commit_not_found: None, commit(CUR, Outcome::Succeeded), T0 => keep(Err(Error::NotFound));
    expired_commit_not_found: Some(held()), commit(CUR, Outcome::Succeeded), EXPIRED_AT => keep(Err(Error::NotFound));
    pending_commit_current_completes: Some(held()), commit(CUR, Outcome::Succeeded), PENDING_AT => completed_by_commit(PENDING_AT, Outcome::Succeeded);
    pending_commit_current_failed_outcome_completes: Some(held()), commit(CUR, Outcome::Failed), PENDING_AT => completed_by_commit(PENDING_AT, Outcome::Failed);
    pending_commit_stale_lease_lost: Some(held()), commit(STALE, Outcome::Succeeded), PENDING_AT => lease_lost();
    abandoned_commit_current_completes: Some(held()), commit(CUR, Outcome::Succeeded), ABANDONED_AT => completed_by_commit(ABANDONED_AT, Outcome::Succeeded);
    abandoned_commit_stale_lease_lost: Some(held()), commit(STALE, Outcome::Succeeded), ABANDONED_AT => lease_lost();
    late_commit_just_before_expiry_completes: Some(held()), commit(CUR, Outcome::Succeeded), T0 + TTL - 1 => completed_by_commit(T0 + TTL - 1, Outcome::Succeeded);
    completed_commit_same_token_same_outcome_ok: Some(done()), commit(CUR, Outcome::Succeeded), DONE_AT => keep(Ok(Reply::Commit { expires_at_ms: T0 + 10_000 + TTL }));
    completed_commit_same_token_other_outcome_conflict: Some(done()), commit(CUR, Outcome::Failed), DONE_AT => keep(Err(Error::Conflict { current: CUR, outcome: Outcome::Succeeded }));
    completed_commit_stale_token_conflict: Some(done()), commit(STALE, Outcome::Succeeded), DONE_AT => keep(Err(Error::Conflict { current: CUR, outcome: Outcome::Succeeded }));

    // × release
    free_release_not_found: None, Command::Release { token: CUR }, T0 => keep(Err(Error::NotFound));
    expired_release_not_found: Some(held()), Command::Release { token: CUR }, EXPIRED_AT => keep(Err(Error::NotFound));
    pending_release_current_frees: Some(held()), Command::Release { token: CUR }, PENDING_AT => released();
    pending_release_stale_lease_lost: Some(held()), Command::Release { token: STALE }, PENDING_AT => lease_lost();
    abandoned_release_current_frees: Some(held()), Command::Release { token: CUR }, ABANDONED_AT => released();
    abandoned_release_stale_lease_lost: Some(held()), Command::Release { token: STALE }, ABANDONED_AT => lease_lost();
    completed_release_current_refused: Some(done()), Command::Release { token: CUR }, DONE_AT => keep(Err(Error::AlreadyCompleted));
    completed_release_stale_refused: Some(done()), Command::Release { token: STALE }, DONE_AT => keep(Err(Error::AlreadyCompleted));

    // × heartbeat
    free_heartbeat_not_found: None, Command::Heartbeat { token: CUR, lease_ms: 5_000 }, T0 => keep(Err(Error::NotFound));
    expired_heartbeat_not_found: Some(held()), Command::Heartbeat { token: CUR, lease_ms: 5_000 }, EXPIRED_AT => keep(Err(Error::NotFound));
    pending_heartbeat_current_renews: Some(held()), Command::Heartbeat { token: CUR, lease_ms: 5_000 }, PENDING_AT => renewed(PENDING_AT);
    pending_heartbeat_stale_lease_lost: Some(held()), Command::Heartbeat { token: STALE, lease_ms: 5_000 }, PENDING_AT => lease_lost();
    abandoned_heartbeat_current_renews: Some(held()), Command::Heartbeat { token: CUR, lease_ms: 5_000 }, ABANDONED_AT => renewed(ABANDONED_AT);
    abandoned_heartbeat_stale_lease_lost: Some(held()), Command::Heartbeat { token: STALE, lease_ms: 5_000 }, ABANDONED_AT => lease_lost();
    completed_heartbeat_refused: Some(done()), Command::Heartbeat { token: CUR, lease_ms: 5_000 }, DONE_AT => keep(Err(Error::AlreadyCompleted));

    // × get
    free_get_is_free: None, Command::Get, T0 => keep(Ok(Reply::Get(View::FREE)));
    expired_get_is_free: Some(done()), Command::Get, T0 + 10_000 + TTL => keep(Ok(Reply::Get(View::FREE)));
    pending_get_is_pending: Some(held()), Command::Get, PENDING_AT => view(State::Pending, &held());
    abandoned_get_is_abandoned: Some(held()), Command::Get, ABANDONED_AT => view(State::Abandoned, &held());
    completed_get_is_completed: Some(done()), Command::Get, DONE_AT => view(State::Completed, &done());

    // × operator actions
    free_force_release_not_found: None, Command::ForceRelease, T0 => keep(Err(Error::NotFound));
    pending_force_release_frees_whatever_the_token: Some(held()), Command::ForceRelease, PENDING_AT => Decision { change: Change::Delete, reply: Ok(Reply::Removed { previous: State::Pending, token: CUR }) };
    abandoned_force_release_frees: Some(held()), Command::ForceRelease, ABANDONED_AT => Decision { change: Change::Delete, reply: Ok(Reply::Removed { previous: State::Abandoned, token: CUR }) };
    completed_force_release_refused: Some(done()), Command::ForceRelease, DONE_AT => keep(Err(Error::AlreadyCompleted));
    completed_purge_deletes: Some(done()), Command::Purge, DONE_AT => Decision { change: Change::Delete, reply: Ok(Reply::Removed { previous: State::Completed, token: CUR }) };
    pending_purge_deletes: Some(held()), Command::Purge, PENDING_AT => Decision { change: Change::Delete, reply: Ok(Reply::Removed { previous: State::Pending, token: CUR }) };
    expired_purge_not_found: Some(done()), Command::Purge, T0 + 10_000 + TTL => keep(Err(Error::NotFound));
    pending_inspect_returns_the_record: Some(held()), Command::Inspect, PENDING_AT => keep(Ok(Reply::Inspect { state: State::Pending, record: Some(held()) }));
    free_inspect_returns_none: None, Command::Inspect, T0 => keep(Ok(Reply::Inspect { state: State::Free, record: None }));

    // expiry boundaries
    completed_expires_exactly_at_deadline: Some(done()), Command::Get, T0 + 10_000 + TTL => keep(Ok(Reply::Get(View::FREE)));
    live_pending_never_expires_past_ttl: Some(Record { lease_until_ms: T0 + TTL + 50_000, ..held() }), Command::Get, T0 + TTL + 10_000 => view(State::Pending, &Record { lease_until_ms: T0 + TTL + 50_000, ..held() });
    pending_past_ttl_expires_when_lease_ends: Some(Record { lease_until_ms: T0 + TTL + 50_000, ..held() }), Command::Get, T0 + TTL + 50_000 => keep(Ok(Reply::Get(View::FREE)));
}

/// One test per cell of the bucket grace: the earlier bucket's record and `now` decide
/// which key answers a reserve sent just after a boundary. (The engine then calls
/// `decide` on that key's record, so the reply is the one the cells above give it; a
/// released key has no record, the `None` cell.)
macro_rules! grace_cells {
    ($($name:ident: $earlier:expr, $now:expr => $answers:expr;)+) => {$(
        #[test]
        fn $name() {
            let earlier: Option<Record> = $earlier;
            assert_eq!(answers_from_earlier_bucket(earlier.as_ref(), $now), $answers == Bucket::Earlier);
        }
    )+};
}

#[derive(PartialEq)]
enum Bucket {
    Earlier,
    Current,
}

grace_cells! {
    grace_earlier_free_reserves_current: None, T0 => Bucket::Current;
    grace_earlier_pending_answers_in_progress_from_earlier: Some(held()), PENDING_AT => Bucket::Earlier;
    grace_earlier_abandoned_is_taken_over_on_the_earlier_key: Some(held()), ABANDONED_AT => Bucket::Earlier;
    grace_earlier_completed_replays_from_earlier: Some(done()), DONE_AT => Bucket::Earlier;
    grace_earlier_completed_failed_replays_from_earlier: Some(Record { completion: Some(Completion { outcome: Outcome::Failed, ..done().completion.unwrap() }), ..done() }), DONE_AT => Bucket::Earlier;
    grace_earlier_expired_reserves_current: Some(done()), T0 + 10_000 + TTL => Bucket::Current;
    grace_earlier_pending_past_ttl_answers_from_earlier: Some(Record { lease_until_ms: T0 + TTL + 50_000, ..held() }), T0 + TTL + 10_000 => Bucket::Earlier;
}

#[test]
fn late_commit_keeps_completion_for_a_full_ttl() {
    let now = T0 + TTL - 1;
    let decision = decide(Some(&held()), &commit(CUR, Outcome::Succeeded), now, NEXT);
    let Change::Put(record) = decision.change else { panic!("commit must store the completion") };
    assert_eq!(record.expires_at_ms, now + TTL, "expires_at = max(expires_at, now + ttl)");
}

#[test]
fn only_grants_consume_tokens() {
    assert!(decide(None, &reserve(b""), T0, NEXT).consumes_token());
    assert!(!decide(Some(&held()), &reserve(b""), PENDING_AT, NEXT).consumes_token());
    assert!(!decide(Some(&done()), &reserve(b""), DONE_AT, NEXT).consumes_token());
    assert!(!decide(Some(&held()), &commit(CUR, Outcome::Succeeded), PENDING_AT, NEXT).consumes_token());
}
