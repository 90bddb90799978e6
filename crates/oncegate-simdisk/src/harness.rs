//! The power-loss harness: clients drive the embedded engine on a simulated disk, the
//! power is cut at a random moment, the disk keeps what survived, the engine reopens on
//! it, and a checker compares every key with what was acknowledged.
//!
//! Each client owns its keys and has at most one call in flight per key, so a key's
//! history is a sequence: at a cut, the key's state must be the one its acknowledged calls
//! made, or, if a call was unanswered (in flight, or refused by the failing disk), the
//! one that call would have made. Across cuts the checker also holds the engine to:
//! tokens of a shard never go back, its clock frame never goes back, and every shard
//! opens cleanly.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use oncegate_core::{Outcome, ReserveReply, State, Tenant};
use oncegate_engine::{
    CommitRequest, Durability, Engine, EngineConfig, Error, Faults, KeyRequest, ManualClock, ReserveRequest,
    ShardState,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::disk::{Cut, Disk};

/// The lease every grant asks for; long enough that no lease runs out in a run.
const LEASE_MS: u64 = 3_600_000;
/// How far the wall clock moves during a cycle, and how far it steps back at a restart.
const CYCLE_ADVANCE_MS: u64 = 10;
const RESTART_STEP_BACK_MS: i64 = 5_000;
const NAMESPACE: &str = "power";

/// What a run does.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Power cuts to make.
    pub cuts: u64,
    /// Every how many cuts one is torn (1: all of them; 0: none).
    pub torn_every: u64,
    /// Client threads.
    pub clients: usize,
    /// Keys each client owns.
    pub keys_per_client: usize,
    /// Shards of the engine.
    pub shards: u32,
    /// The most acknowledged calls between two cuts (the cut comes after a random number
    /// of them, from 0).
    pub calls_per_cut_max: u64,
    /// How the engine syncs.
    pub durability: Durability,
    /// The deliberate ack-before-commit bug (the harness must catch it).
    pub ack_before_commit: bool,
    /// WAL pages between checkpoints (small, so that cuts land around checkpoints).
    pub checkpoint_pages: u64,
    /// The most disk operations before a fused cut (see [`Disk::cut_after_ops`]).
    pub fuse_ops_max: u64,
    /// Stop after this many violations.
    pub violations_max: usize,
    /// The seed of every random choice.
    pub seed: u64,
}

impl Default for Plan {
    fn default() -> Self {
        Plan {
            cuts: 100,
            torn_every: 2,
            clients: 6,
            keys_per_client: 12,
            shards: 3,
            calls_per_cut_max: 240,
            durability: Durability::Full,
            ack_before_commit: false,
            checkpoint_pages: 4,
            fuse_ops_max: 600,
            violations_max: 20,
            seed: 1,
        }
    }
}

/// What a run found.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Cuts made.
    pub cuts: u64,
    /// Of which torn.
    pub torn: u64,
    /// Calls acknowledged before the cuts.
    pub acknowledged: u64,
    /// Key states compared after a restart with what was acknowledged.
    pub keys_checked: u64,
    /// Grants checked against the tokens and clock frame before the last cut.
    pub grants_checked: u64,
    /// Cuts that came while the engine opened (recovery included).
    pub cut_while_opening: u64,
    /// Syncs of shard files: checkpoints, mostly.
    pub checkpoints: u64,
    /// Everything that broke a guarantee, in words.
    pub violations: Vec<String>,
}

/// A key's state as the clients know it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Known {
    Free,
    Held { token: u64 },
    Done { token: u64, response: Vec<u8> },
}

/// What a call that went unanswered would have left.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Maybe {
    /// A grant: the key held with a token newer than any before.
    Granted,
    /// Another state.
    State(Known),
}

#[derive(Clone, Debug)]
struct KeyModel {
    key: String,
    shard: u32,
    acked: Known,
    maybe: Option<Maybe>,
    /// The newest token the key was ever seen with.
    last_token: u64,
    /// When its latest acknowledged grant was decided.
    last_started_ms: u64,
}

/// A client's keys: those it works on, and completed ones it moved on from, which are
/// still checked after every cut (the most recent few).
#[derive(Clone, Debug, Default)]
struct ClientKeys {
    client: usize,
    live: Vec<KeyModel>,
    retired: std::collections::VecDeque<KeyModel>,
    next_id: u64,
}

/// Completed keys a client keeps checking after it moved on from them.
const RETIRED_KEPT: usize = 24;

impl ClientKeys {
    fn all_mut(&mut self) -> impl Iterator<Item = &mut KeyModel> {
        self.live.iter_mut().chain(self.retired.iter_mut())
    }

    fn all(&self) -> impl Iterator<Item = &KeyModel> {
        self.live.iter().chain(self.retired.iter())
    }

    /// Retires the completed key at `slot` and puts a new key in its place.
    fn rotate(&mut self, slot: usize, engine: &Engine) {
        let key = new_key(engine, self.client, self.next_id);
        self.next_id += 1;
        let done = std::mem::replace(&mut self.live[slot], key);
        self.retired.push_back(done);
        if self.retired.len() > RETIRED_KEPT {
            self.retired.pop_front();
        }
    }
}

fn new_key(engine: &Engine, client: usize, id: u64) -> KeyModel {
    let key = format!("c{client}-k{id}");
    let scope = engine.scope(&Tenant::default_tenant(), NAMESPACE, &key).expect("a valid key");
    let shard = engine.shard_of(&scope);
    KeyModel { key, shard, acked: Known::Free, maybe: None, last_token: 0, last_started_ms: 0 }
}

/// What every shard had reached at the last cut, for the checks after it.
#[derive(Clone, Debug, Default)]
struct Marks {
    /// The highest token acknowledged.
    token: Vec<u64>,
    /// The latest lease start acknowledged (a grant's decision time).
    started_ms: Vec<u64>,
}

/// A cycle's shared state for its client threads.
struct Cycle {
    engine: Engine,
    disk: Disk,
    clock: ManualClock,
    tenant: Tenant,
    /// The call count at which the power is cut.
    cut_at: u64,
    calls: AtomicU64,
    cut: AtomicBool,
    before: Marks,
}

/// Runs `plan` on a new disk.
pub fn run(plan: &Plan) -> Report {
    let mut run = Run::new(plan);
    for cut in 0..plan.cuts {
        run.cycle(cut);
        if run.report.violations.len() >= plan.violations_max || run.stop {
            break;
        }
    }
    run.report.checkpoints = run.disk.stats().checkpoints;
    run.report
}

/// A run's state from one cycle to the next.
struct Run<'p> {
    plan: &'p Plan,
    rng: StdRng,
    disk: Disk,
    clock: ManualClock,
    faults: Faults,
    report: Report,
    models: Vec<ClientKeys>,
    marks: Marks,
    /// Set when the engine is found broken: nothing more can be checked.
    stop: bool,
}

impl Run<'_> {
    fn new(plan: &Plan) -> Run<'_> {
        let faults = Faults::default();
        faults.checkpoint_after_pages(plan.checkpoint_pages);
        if plan.ack_before_commit {
            faults.ack_before_commit();
        }
        let shards = plan.shards as usize;
        Run {
            plan,
            rng: StdRng::seed_from_u64(plan.seed),
            disk: Disk::new(),
            clock: ManualClock::new(1_700_000_000_000),
            faults,
            report: Report::default(),
            models: Vec::new(),
            marks: Marks { token: vec![0; shards], started_ms: vec![0; shards] },
            stop: false,
        }
    }

    /// Opens the engine, checks every key, runs traffic until the cut, and restarts the
    /// disk. A third of the cycles light a fuse instead of counting calls, so the cut may
    /// land anywhere, opening and recovery included.
    fn cycle(&mut self, cut: u64) {
        let fused = self.rng.random_bool(0.3);
        if fused {
            self.disk.cut_after_ops(self.rng.random_range(0..=self.plan.fuse_ops_max));
        }
        if let Some(engine) = self.open(cut) {
            let checked = self.models.is_empty()
                || check_keys(&engine, &mut self.models, &mut self.report, cut, &self.disk);
            if self.models.is_empty() {
                self.models = key_models(&engine, self.plan);
            }
            let cut_at =
                if fused { u64::MAX } else { self.rng.random_range(0..=self.plan.calls_per_cut_max) };
            if checked && self.disk.powered() {
                self.traffic(engine, cut, cut_at);
            } else {
                engine.shutdown();
            }
        }
        self.restart();
    }

    /// The engine on what survived, or `None` when the power went while it opened (or a
    /// violation was found).
    fn open(&mut self, cut: u64) -> Option<Engine> {
        let config = EngineConfig {
            data_dir: PathBuf::from("/data"),
            shards: self.plan.shards,
            durability: self.plan.durability,
            batch_len_max: [1, 4, 64, 256][self.rng.random_range(0..4)],
            ..EngineConfig::default()
        };
        let clock = Arc::new(self.clock.clone());
        let opened = Engine::open_on(config, clock, self.faults.clone(), Arc::new(self.disk.clone()));
        let engine = match opened {
            Ok(engine) => engine,
            Err(_) if !self.disk.powered() => {
                self.report.cut_while_opening += 1;
                return None;
            }
            Err(error) => {
                self.report.violations.push(format!("cut {cut}: the engine did not open: {error}"));
                self.stop = true;
                return None;
            }
        };
        if let Some(problem) = unclean_shards(&engine) {
            if self.disk.powered() {
                self.report.violations.push(format!("cut {cut}: {problem}"));
                self.stop = true;
            } else {
                self.report.cut_while_opening += 1;
            }
            engine.shutdown();
            return None;
        }
        Some(engine)
    }

    /// Clients call until the power goes; their models come back with what was answered.
    fn traffic(&mut self, engine: Engine, cut: u64, cut_at: u64) {
        let cycle = Arc::new(Cycle {
            engine,
            disk: self.disk.clone(),
            clock: self.clock.clone(),
            tenant: Tenant::default_tenant(),
            cut_at,
            calls: AtomicU64::new(0),
            cut: AtomicBool::new(false),
            before: self.marks.clone(),
        });
        if cut_at == 0 {
            cut_power(&cycle);
        }
        let threads: Vec<_> = std::mem::take(&mut self.models)
            .into_iter()
            .map(|keys| {
                let cycle = Arc::clone(&cycle);
                let seed = self.plan.seed ^ (cut << 16) ^ keys.client as u64;
                std::thread::spawn(move || drive(&cycle, keys, seed))
            })
            .collect();
        for thread in threads {
            let (keys, found) = thread.join().expect("a client thread panicked");
            self.models.push(keys);
            self.report.violations.extend(found.violations);
            self.report.grants_checked += found.grants_checked;
        }
        cut_power(&cycle);
        self.report.acknowledged += cycle.calls.load(Ordering::SeqCst);
        let Ok(cycle) = Arc::try_unwrap(cycle) else { unreachable!("every client has returned") };
        cycle.engine.shutdown();
        self.marks = new_marks(&self.models, std::mem::take(&mut self.marks), self.plan.shards);
    }

    /// Cuts the power (if still on) and restarts the disk, plain or torn; the wall clock
    /// comes back earlier than it was, as a machine's may.
    fn restart(&mut self) {
        self.disk.cut();
        let n = self.report.cuts;
        let torn = self.plan.torn_every > 0 && n % self.plan.torn_every == self.plan.torn_every - 1;
        self.disk.restart(if torn { Cut::Torn } else { Cut::Plain }, &mut self.rng);
        self.clock.step(-RESTART_STEP_BACK_MS);
        self.report.cuts += 1;
        self.report.torn += u64::from(torn);
    }
}

fn cut_power(cycle: &Cycle) {
    if !cycle.cut.swap(true, Ordering::SeqCst) {
        cycle.disk.cut();
    }
}

fn unclean_shards(engine: &Engine) -> Option<String> {
    let stats = engine.stats();
    let failed: Vec<String> = stats
        .iter()
        .filter(|s| s.state != ShardState::Serving)
        .map(|s| {
            format!("shard {} is {} ({})", s.shard, s.state.as_str(), s.last_error.as_deref().unwrap_or("-"))
        })
        .collect();
    (!failed.is_empty()).then(|| format!("shards did not open cleanly: {}", failed.join("; ")))
}

fn key_models(engine: &Engine, plan: &Plan) -> Vec<ClientKeys> {
    (0..plan.clients)
        .map(|client| {
            let live = (0..plan.keys_per_client as u64).map(|id| new_key(engine, client, id)).collect();
            ClientKeys { client, live, retired: Default::default(), next_id: plan.keys_per_client as u64 }
        })
        .collect()
}

/// The marks for the next cycle: the highest token and lease start each shard had
/// acknowledged by the cut (or seen since, at the check).
fn new_marks(models: &[ClientKeys], mut marks: Marks, shards: u32) -> Marks {
    marks.token.resize(shards as usize, 0);
    marks.started_ms.resize(shards as usize, 0);
    for key in models.iter().flat_map(ClientKeys::all) {
        let shard = key.shard as usize;
        marks.token[shard] = marks.token[shard].max(key.last_token);
        marks.started_ms[shard] = marks.started_ms[shard].max(key.last_started_ms);
    }
    marks
}

/// Reads every key after a restart and compares it with what was acknowledged.
/// Returns whether every key was read (a fused cut may come in the middle).
fn check_keys(
    engine: &Engine,
    models: &mut [ClientKeys],
    report: &mut Report,
    cut: u64,
    disk: &Disk,
) -> bool {
    let tenant = Tenant::default_tenant();
    for key in models.iter_mut().flat_map(ClientKeys::all_mut) {
        report.keys_checked += 1;
        let request = KeyRequest { namespace: NAMESPACE.into(), key: key.key.clone(), token: 0, lease_ms: 0 };
        let observed = match engine.get_blocking(&tenant, request) {
            Ok(view) => match view.state {
                State::Free => Known::Free,
                State::Pending | State::Abandoned => Known::Held { token: view.token },
                State::Completed => Known::Done { token: view.token, response: view.response },
            },
            Err(Error::Refused(oncegate_core::Error::NotFound)) => Known::Free,
            Err(_) if !disk.powered() => return false,
            Err(error) => {
                report.violations.push(format!("after cut {cut}: reading {} failed: {error}", key.key));
                continue;
            }
        };
        let allowed = observed == key.acked
            || match &key.maybe {
                Some(Maybe::State(state)) => observed == *state,
                Some(Maybe::Granted) => matches!(observed, Known::Held { token } if token > key.last_token),
                None => false,
            };
        if !allowed {
            report.violations.push(format!(
                "after cut {cut}: key {} (shard {}) is {observed:?}; acknowledged {:?}, and the unanswered call could have left {:?}",
                key.key, key.shard, key.acked, key.maybe
            ));
        }
        if let Known::Held { token } | Known::Done { token, .. } = &observed {
            key.last_token = key.last_token.max(*token);
        }
        key.acked = observed;
        key.maybe = None;
    }
    true
}

/// What one client found.
#[derive(Default)]
struct Found {
    violations: Vec<String>,
    grants_checked: u64,
}

/// One client: calls on its own keys until the power is cut.
fn drive(cycle: &Cycle, mut keys: ClientKeys, seed: u64) -> (ClientKeys, Found) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut found = Found::default();
    while !cycle.cut.load(Ordering::SeqCst) && cycle.disk.powered() {
        let pick = rng.random_range(0..keys.live.len());
        if matches!(keys.live[pick].acked, Known::Done { .. }) && rng.random_bool(0.3) {
            keys.rotate(pick, &cycle.engine);
        }
        let key = &mut keys.live[pick];
        if !call(cycle, key, &mut rng, &mut found) {
            // The power is cut before any call can fail: a failure with power is a fault.
            if cycle.disk.powered() {
                found.violations.push(format!("{}: a call failed with the power on", key.key));
            }
            break;
        }
        let n = cycle.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if n == cycle.cut_at / 2 {
            cycle.clock.advance(CYCLE_ADVANCE_MS);
        }
        if n >= cycle.cut_at {
            cut_power(cycle);
        }
    }
    (keys, found)
}

/// Makes one call on `key`; returns whether it was answered.
fn call(cycle: &Cycle, key: &mut KeyModel, rng: &mut StdRng, found: &mut Found) -> bool {
    let engine = &cycle.engine;
    let tenant = &cycle.tenant;
    let key_request =
        |token| KeyRequest { namespace: NAMESPACE.into(), key: key.key.clone(), token, lease_ms: 0 };
    match key.acked.clone() {
        acked if rng.random_bool(0.1) => {
            key.maybe = None;
            let Ok(view) = engine.get_blocking(tenant, key_request(0)) else { return false };
            let seen = match view.state {
                State::Free => Known::Free,
                State::Pending | State::Abandoned => Known::Held { token: view.token },
                State::Completed => Known::Done { token: view.token, response: view.response },
            };
            if seen != acked {
                found.violations.push(format!("{}: read {seen:?}, acknowledged {acked:?}", key.key));
            }
            true
        }
        Known::Held { token } if rng.random_bool(0.1) => {
            // A duplicate attempt while the key is held: never a second grant.
            key.maybe = None;
            let request = ReserveRequest {
                namespace: NAMESPACE.into(),
                key: key.key.clone(),
                ..ReserveRequest::default()
            };
            let Ok(reserved) = engine.reserve_blocking(tenant, request) else { return false };
            if !matches!(reserved.reply, ReserveReply::InProgress { .. }) {
                found.violations.push(format!(
                    "{}: held with token {token}, a duplicate got {:?}",
                    key.key, reserved.reply
                ));
            }
            true
        }
        Known::Free => {
            key.maybe = Some(Maybe::Granted);
            let request = ReserveRequest {
                namespace: NAMESPACE.into(),
                key: key.key.clone(),
                lease_ms: LEASE_MS,
                ..ReserveRequest::default()
            };
            match engine.reserve_blocking(tenant, request) {
                Ok(reserved) => {
                    granted(cycle, key, reserved.reply, found);
                    true
                }
                Err(_) => false,
            }
        }
        Known::Done { token, response } => {
            key.maybe = None;
            let request = ReserveRequest {
                namespace: NAMESPACE.into(),
                key: key.key.clone(),
                ..ReserveRequest::default()
            };
            match engine.reserve_blocking(tenant, request) {
                Ok(reserved) => {
                    let replayed = matches!(&reserved.reply, ReserveReply::Completed { token: t, response: r, .. } if *t == token && *r == response);
                    if !replayed {
                        found
                            .violations
                            .push(format!("{}: a completed key answered {:?}", key.key, reserved.reply));
                    }
                    true
                }
                Err(_) => false,
            }
        }
        Known::Held { token } => {
            let (next, answered) = match rng.random_range(0..10) {
                0..=1 => {
                    (Known::Held { token }, engine.heartbeat_blocking(tenant, key_request(token)).map(drop))
                }
                2..=3 => (Known::Free, engine.release_blocking(tenant, key_request(token))),
                _ => {
                    let response = format!("{}#{token}", key.key).into_bytes();
                    let request = CommitRequest {
                        namespace: NAMESPACE.into(),
                        key: key.key.clone(),
                        token,
                        outcome: Outcome::Succeeded,
                        response: response.clone(),
                    };
                    (Known::Done { token, response }, engine.commit_blocking(tenant, request).map(drop))
                }
            };
            key.maybe = Some(Maybe::State(next.clone()));
            match answered {
                Ok(()) => {
                    key.acked = next;
                    key.maybe = None;
                    true
                }
                Err(_) => false,
            }
        }
    }
}

/// Records an acknowledged reserve of a free key, which must be a grant with a token
/// above every token of its key and of its shard before the last cut, decided no earlier
/// than the shard's clock frame at the cut.
fn granted(cycle: &Cycle, key: &mut KeyModel, reply: ReserveReply, found: &mut Found) {
    let ReserveReply::Granted { token, lease_until_ms, .. } = reply else {
        found.violations.push(format!("{}: a free key answered {reply:?}", key.key));
        key.maybe = None;
        return;
    };
    found.grants_checked += 1;
    let shard = key.shard as usize;
    if token <= key.last_token || token <= cycle.before.token[shard] {
        found.violations.push(format!(
            "{}: token {token} went back (key's newest {}, shard {}'s highest before the cut {})",
            key.key, key.last_token, key.shard, cycle.before.token[shard]
        ));
    }
    let started_ms = lease_until_ms.saturating_sub(LEASE_MS);
    if started_ms < cycle.before.started_ms[shard] {
        found.violations.push(format!(
            "{}: decided at {started_ms}, before shard {}'s clock frame at the cut ({})",
            key.key, key.shard, cycle.before.started_ms[shard]
        ));
    }
    key.last_token = token;
    key.last_started_ms = started_ms;
    key.acked = Known::Held { token };
    key.maybe = None;
}
