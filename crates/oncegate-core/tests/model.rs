//! Random command sequences from several clients, with a clock that moves forward and
//! sometimes steps back, run against the decision function and a deliberately simple
//! reference model. Every reply must equal the model's, and an observer that sees only
//! the replies checks the contract's safety properties. Some reserves fall within a
//! bucket grace and are answered from their key or the next, as the model says.

use std::collections::{BTreeMap, HashMap};

use oncegate_core::{
    Change, ClockGuard, Command, Commit, Error, Fingerprint, Outcome, Previous, Record, Reply, Reserve,
    ReserveReply, State, View, answers_from_earlier_bucket, decide,
};
use proptest::prelude::*;

const CLIENTS: usize = 4;
const KEYS: usize = 3;
const START_MS: u64 = 1_700_000_000_000;

#[derive(Clone, Debug)]
enum TokenPick {
    /// The latest token this client was granted for the key.
    Mine,
    /// Any small number: usually stale, sometimes someone else's.
    Any(u64),
}

#[derive(Clone, Debug)]
enum Op {
    /// With `grace`, the key is the earlier bucket of a derived key whose current bucket
    /// is the next key, and the reserve falls within the grace after their boundary.
    Reserve {
        fingerprint: u8,
        lease_ms: u64,
        ttl_ms: u64,
        grace: bool,
    },
    Commit {
        token: TokenPick,
        failed: bool,
        response: u8,
    },
    Release {
        token: TokenPick,
    },
    Heartbeat {
        token: TokenPick,
        lease_ms: u64,
    },
    Get,
    ForceRelease,
    Purge,
}

#[derive(Clone, Debug)]
enum Step {
    /// The wall clock moves forward.
    Advance(u64),
    /// The wall clock steps back (NTP correction, VM migration).
    ClockBack(u64),
    /// One client sends one command.
    Call { client: usize, key: usize, op: Op },
    /// The shard's alarm deletes what it considers expired.
    Reclaim,
}

fn token_pick() -> impl Strategy<Value = TokenPick> {
    prop_oneof![3 => Just(TokenPick::Mine), 1 => (1u64..40).prop_map(TokenPick::Any)]
}

fn op() -> impl Strategy<Value = Op> {
    let lease = prop_oneof![Just(100u64), Just(5_000), Just(30_000)];
    let ttl = prop_oneof![Just(1_000u64), Just(20_000), Just(90_000)];
    prop_oneof![
        4 => (0u8..3, lease.clone(), ttl, proptest::bool::weighted(0.3)).prop_map(|(fingerprint, lease_ms, ttl_ms, grace)| Op::Reserve { fingerprint, lease_ms, ttl_ms, grace }),
        2 => (token_pick(), any::<bool>(), 0u8..3).prop_map(|(token, failed, response)| Op::Commit { token, failed, response }),
        1 => token_pick().prop_map(|token| Op::Release { token }),
        2 => (token_pick(), lease).prop_map(|(token, lease_ms)| Op::Heartbeat { token, lease_ms }),
        1 => Just(Op::Get),
        1 => prop_oneof![Just(Op::ForceRelease), Just(Op::Purge)],
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0u64..40_000).prop_map(Step::Advance),
        1 => (0u64..3_600_000).prop_map(Step::ClockBack),
        8 => (0..CLIENTS, 0..KEYS, op()).prop_map(|(client, key, op)| Step::Call { client, key, op }),
        1 => Just(Step::Reclaim),
    ]
}

fn fingerprint(code: u8) -> Fingerprint {
    match code {
        0 => Fingerprint::NONE,
        c => Fingerprint::from_stored(vec![b'A' + c]),
    }
}

/// The reference model: the contract's table written as plainly as possible, with
/// expiry applied eagerly before every command.
#[derive(Clone, Debug)]
struct ModelKey {
    token: u64,
    attempt: u32,
    lease_until: u64,
    expires_at: u64,
    ttl: u64,
    fingerprint: Fingerprint,
    done: Option<(Outcome, Vec<u8>, u64)>,
}

fn model(slot: &mut Option<ModelKey>, command: &Command, now: u64, next: u64) -> Result<Reply, Error> {
    let state = model_state(slot, now);
    match (command, state) {
        (Command::Inspect, _) => unreachable!("the model test does not generate inspect"),
        (Command::ForceRelease | Command::Purge, State::Free) => Err(Error::NotFound),
        (Command::ForceRelease, State::Completed) => Err(Error::AlreadyCompleted),
        (Command::ForceRelease | Command::Purge, previous) => {
            let token = slot.as_ref().unwrap().token;
            *slot = None;
            Ok(Reply::Removed { previous, token })
        }
        (Command::Get, State::Free) => Ok(Reply::Get(View::FREE)),
        (Command::Get, state) => Ok(Reply::Get(model_view(slot.as_ref().unwrap(), state))),
        (Command::Reserve(r), state) => model_reserve(slot, r, state, now, next),
        (Command::Commit(_) | Command::Release { .. } | Command::Heartbeat { .. }, State::Free) => {
            Err(Error::NotFound)
        }
        (Command::Commit(c), State::Completed) => {
            let k = slot.as_ref().unwrap();
            let outcome = k.done.as_ref().unwrap().0;
            if c.token == k.token && c.outcome == outcome {
                Ok(Reply::Commit { expires_at_ms: k.expires_at })
            } else {
                Err(Error::Conflict { current: k.token, outcome })
            }
        }
        (Command::Release { .. } | Command::Heartbeat { .. }, State::Completed) => {
            Err(Error::AlreadyCompleted)
        }
        (Command::Commit(Commit { token, .. }), _)
        | (Command::Release { token }, _)
        | (Command::Heartbeat { token, .. }, _)
            if *token != slot.as_ref().unwrap().token =>
        {
            Err(Error::LeaseLost { token: *token, current: slot.as_ref().unwrap().token })
        }
        (Command::Commit(c), _) => {
            let k = slot.as_mut().unwrap();
            k.expires_at = k.expires_at.max(now + k.ttl);
            k.done = Some((c.outcome, c.response.clone(), now));
            Ok(Reply::Commit { expires_at_ms: k.expires_at })
        }
        (Command::Release { .. }, _) => {
            *slot = None;
            Ok(Reply::Release)
        }
        (Command::Heartbeat { lease_ms, .. }, _) => {
            let k = slot.as_mut().unwrap();
            k.lease_until = now + lease_ms;
            Ok(Reply::Heartbeat { lease_until_ms: k.lease_until, expires_at_ms: k.expires_at })
        }
    }
}

/// The model's answer to a reserve of a key in `state` (expiry already applied).
fn model_reserve(
    slot: &mut Option<ModelKey>,
    r: &Reserve,
    state: State,
    now: u64,
    next: u64,
) -> Result<Reply, Error> {
    match state {
        State::Free => model_grant(slot, r, now, next, 1, Previous::None, r.fingerprint.clone()),
        _ if !r.fingerprint.is_none() && r.fingerprint != slot.as_ref().unwrap().fingerprint => {
            Ok(Reply::Reserve(ReserveReply::Mismatch { expires_at_ms: slot.as_ref().unwrap().expires_at }))
        }
        State::Pending => {
            let k = slot.as_ref().unwrap();
            Ok(Reply::Reserve(ReserveReply::InProgress {
                attempt: k.attempt,
                lease_until_ms: k.lease_until,
                retry_after_ms: (k.lease_until - now).clamp(1, oncegate_core::RETRY_AFTER_MS_MAX),
            }))
        }
        State::Abandoned => {
            let k = slot.clone().unwrap();
            let fp = if r.fingerprint.is_none() { k.fingerprint } else { r.fingerprint.clone() };
            model_grant(slot, r, now, next, k.attempt + 1, Previous::Abandoned, fp)
        }
        State::Completed => {
            let k = slot.as_ref().unwrap();
            let (outcome, response, at) = k.done.clone().unwrap();
            Ok(Reply::Reserve(ReserveReply::Completed {
                token: k.token,
                outcome,
                response,
                completed_at_ms: at,
                expires_at_ms: k.expires_at,
            }))
        }
    }
}

/// Grants the key to token `next` in the model, with this attempt, previous state and fingerprint.
fn model_grant(
    slot: &mut Option<ModelKey>,
    r: &Reserve,
    now: u64,
    next: u64,
    attempt: u32,
    previous: Previous,
    fp: Fingerprint,
) -> Result<Reply, Error> {
    *slot = Some(ModelKey {
        token: next,
        attempt,
        lease_until: now + r.lease_ms,
        expires_at: now + r.ttl_ms,
        ttl: r.ttl_ms,
        fingerprint: fp,
        done: None,
    });
    Ok(Reply::Reserve(ReserveReply::Granted {
        token: next,
        attempt,
        lease_until_ms: now + r.lease_ms,
        lease_ms: r.lease_ms,
        expires_at_ms: now + r.ttl_ms,
        previous,
    }))
}

/// The view a get reports of a held model key.
fn model_view(k: &ModelKey, state: State) -> View {
    View {
        state,
        token: k.token,
        attempt: k.attempt,
        lease_until_ms: k.lease_until,
        expires_at_ms: k.expires_at,
        outcome: k.done.as_ref().map(|d| d.0),
        response: k.done.as_ref().map(|d| d.1.clone()).unwrap_or_default(),
    }
}

/// Applies expiry to a model key and says its state.
fn model_state(slot: &mut Option<ModelKey>, now: u64) -> State {
    if let Some(k) = slot {
        let held_by_live_lease = k.done.is_none() && now < k.lease_until;
        if now >= k.expires_at && !held_by_live_lease {
            *slot = None;
        }
    }
    match slot {
        None => State::Free,
        Some(k) if k.done.is_some() => State::Completed,
        Some(k) if now < k.lease_until => State::Pending,
        Some(_) => State::Abandoned,
    }
}

/// The key a reserve within the bucket grace is answered from: in the model, the
/// earlier bucket's whenever it still holds a record (after expiry), whatever its state.
fn grace_target(
    store: &BTreeMap<usize, Record>,
    models: &mut HashMap<usize, Option<ModelKey>>,
    earlier: usize,
    now: u64,
) -> Result<usize, TestCaseError> {
    let current = (earlier + 1) % KEYS;
    let from_earlier = answers_from_earlier_bucket(store.get(&earlier), now);
    let slot = models.entry(earlier).or_default();
    model_state(slot, now);
    let model_earlier = slot.is_some();
    prop_assert_eq!(from_earlier, model_earlier, "grace picks another bucket than the model at {}", now);
    Ok(if from_earlier { earlier } else { current })
}

/// What the observer has learnt about one key from replies alone.
#[derive(Default)]
struct Seen {
    /// The greatest token granted so far.
    token_max: u64,
    /// The current holder and its lease deadline, as the replies told it.
    holder: Option<(u64, u64)>,
    /// The completion and its expiry, as the commit reply told it.
    completion: Option<(u64, Outcome, Vec<u8>, u64)>,
}

fn run(steps: Vec<Step>) -> Result<(), TestCaseError> {
    let mut wall = START_MS;
    let mut clock = ClockGuard::new(0);
    let mut last_now = 0;
    let mut store: BTreeMap<usize, Record> = BTreeMap::new();
    let mut models: HashMap<usize, Option<ModelKey>> = HashMap::new();
    let mut next_token = 1u64;
    let mut mine: HashMap<(usize, usize), u64> = HashMap::new();
    let mut seen: HashMap<usize, Seen> = HashMap::new();

    for step in steps {
        let now = clock.observe(wall);
        prop_assert!(now >= last_now, "now went backwards: {last_now} then {now}");
        last_now = now;
        match step {
            Step::Advance(ms) => wall += ms,
            Step::ClockBack(ms) => wall = wall.saturating_sub(ms),
            Step::Reclaim => reclaim(&mut store, now),
            Step::Call { client, key, op } => {
                let key = match op {
                    Op::Reserve { grace: true, .. } => grace_target(&store, &mut models, key, now)?,
                    _ => key,
                };
                let command = command_for(&op, |t| match t {
                    TokenPick::Mine => mine.get(&(client, key)).copied().unwrap_or(1),
                    TokenPick::Any(t) => *t,
                });
                let decision = decide(store.get(&key), &command, now, next_token);
                let expected = model(models.entry(key).or_default(), &command, now, next_token);
                prop_assert_eq!(&decision.reply, &expected, "command {:?} at {}", command, now);
                if decision.consumes_token() {
                    next_token += 1;
                }
                match decision.change {
                    Change::Keep => {}
                    Change::Put(record) => {
                        store.insert(key, record);
                    }
                    Change::Delete => {
                        store.remove(&key);
                    }
                }
                observe(seen.entry(key).or_default(), &command, &decision.reply, now)?;
                if let Ok(Reply::Reserve(ReserveReply::Granted { token, .. })) = decision.reply {
                    mine.insert((client, key), token);
                }
            }
        }
    }
    Ok(())
}

/// The shard's alarm: deletes every expired record, asserting none holds a live lease.
fn reclaim(store: &mut BTreeMap<usize, Record>, now: u64) {
    store.retain(|_, record| {
        let expired = record.is_expired(now);
        if expired {
            // The safety property checked here does not trust is_expired.
            assert!(
                record.completion.is_some() || now >= record.lease_until_ms,
                "reclaim would delete a pending record with a live lease"
            );
        }
        !expired
    });
}

/// The command a generated op stands for, its tokens picked by `pick`.
fn command_for(op: &Op, pick: impl Fn(&TokenPick) -> u64) -> Command {
    match op {
        Op::Reserve { fingerprint: f, lease_ms, ttl_ms, .. } => Command::Reserve(Reserve {
            ttl_ms: *ttl_ms,
            lease_ms: *lease_ms,
            fingerprint: fingerprint(*f),
            wait_ms: 0,
        }),
        Op::Commit { token, failed, response } => Command::Commit(Commit {
            token: pick(token),
            outcome: if *failed { Outcome::Failed } else { Outcome::Succeeded },
            response: vec![*response; 3],
        }),
        Op::Release { token } => Command::Release { token: pick(token) },
        Op::Heartbeat { token, lease_ms } => Command::Heartbeat { token: pick(token), lease_ms: *lease_ms },
        Op::Get => Command::Get,
        Op::ForceRelease => Command::ForceRelease,
        Op::Purge => Command::Purge,
    }
}

/// Checks the contract's safety properties from the replies alone.
fn observe(
    seen: &mut Seen,
    command: &Command,
    reply: &Result<Reply, Error>,
    now: u64,
) -> Result<(), TestCaseError> {
    if let Some((.., expires_at)) = seen.completion
        && now >= expires_at
    {
        seen.completion = None;
    }
    match (command, reply) {
        (Command::Reserve(_), Ok(Reply::Reserve(ReserveReply::Granted { token, lease_until_ms, .. }))) => {
            prop_assert!(*token > seen.token_max, "token {token} not above {}", seen.token_max);
            if let Some((holder, lease_until)) = seen.holder {
                prop_assert!(now >= lease_until, "granted {token} while {holder} holds a live lease");
            }
            prop_assert!(seen.completion.is_none(), "granted {token} while a completion is live");
            seen.token_max = *token;
            seen.holder = Some((*token, *lease_until_ms));
        }
        (
            Command::Reserve(_),
            Ok(Reply::Reserve(ReserveReply::Completed { token, outcome, response, .. })),
        ) => {
            if let Some((t, o, r, _)) = &seen.completion {
                prop_assert_eq!((t, o, r), (token, outcome, response), "replay differs from the commit");
            }
        }
        (Command::Commit(c), Ok(Reply::Commit { expires_at_ms })) => {
            match &seen.completion {
                Some((t, o, _, _)) => {
                    prop_assert_eq!((t, o), (&c.token, &c.outcome), "second commit acknowledged")
                }
                None => {
                    prop_assert_eq!(
                        seen.holder.map(|h| h.0),
                        Some(c.token),
                        "commit by a non-holder acknowledged"
                    );
                    seen.completion = Some((c.token, c.outcome, c.response.clone(), *expires_at_ms));
                }
            }
            seen.holder = None;
        }
        (Command::Release { token }, Ok(Reply::Release)) => {
            prop_assert_eq!(seen.holder.map(|h| h.0), Some(*token), "release by a non-holder acknowledged");
            seen.holder = None;
        }
        (Command::ForceRelease, Ok(Reply::Removed { .. })) => seen.holder = None,
        (Command::Purge, Ok(Reply::Removed { .. })) => {
            seen.holder = None;
            seen.completion = None;
        }
        (Command::Heartbeat { token, .. }, Ok(Reply::Heartbeat { lease_until_ms, .. })) => {
            prop_assert_eq!(seen.holder.map(|h| h.0), Some(*token), "heartbeat by a non-holder acknowledged");
            seen.holder = Some((*token, *lease_until_ms));
        }
        _ => {}
    }
    Ok(())
}

/// At least 1,000 cases per run; `PROPTEST_CASES` raises it for long runs.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000).max(1_000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn decide_matches_model_and_keeps_safety(steps in proptest::collection::vec(step(), 1..250)) {
        run(steps)?;
    }
}
