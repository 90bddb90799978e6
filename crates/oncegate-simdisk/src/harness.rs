//! The power-loss harness: clients drive the embedded engine on a simulated disk, the
//! power is cut at a random moment, the disk keeps what survived, the engine reopens on
//! it, and a checker compares every key with what was acknowledged.
//!
//! Each client owns its keys and has at most one call in flight per key, so a key's
//! history is a sequence: after a cut, the key's state must be the one its acknowledged
//! calls made, or, if a call was unanswered (in flight, or refused by the failing disk),
//! the one that call would have made. Across cuts the checker also holds the engine to:
//! leases never shorten, tokens of a shard never go back, its clock frame never goes
//! back, and every shard opens cleanly.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use oncegate_core::{Outcome, ReserveReply, State, Tenant, View};
use oncegate_engine::{
    CommitRequest, Durability, Engine, EngineConfig, Error, Faults, KeyRequest, ManualClock, ReserveRequest,
    ShardState, StoreConfig,
};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};

use crate::disk::{Cut, Disk};

/// The lease every grant asks for; long enough that no lease runs out in a run.
const LEASE_MS: u64 = 3_600_000;
/// How far the wall clock moves during a cycle, and how far it steps back at a restart.
const CYCLE_ADVANCE_MS: u64 = 10;
const RESTART_STEP_BACK_MS: i64 = 5_000;
const NAMESPACE: &str = "power";
/// Every this many cuts, every completed key ever acknowledged is read back; between,
/// a sample of them.
const FULL_CHECK_EVERY: u64 = 25;
const RETIRED_SAMPLE: usize = 8;

/// What a run does.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Power cuts to make.
    pub cuts: u64,
    /// Every how many cuts one is torn (1: all of them; 0: none).
    pub torn_every: u64,
    /// Client threads.
    pub clients: usize,
    /// Keys each client works on at a time.
    pub keys_per_client: usize,
    /// Shards of the engine.
    pub shards: u32,
    /// The most acknowledged calls between two cuts (a counted cut comes after a random
    /// number of them, from 0).
    pub calls_per_cut_max: u64,
    /// How the engine syncs.
    pub durability: Durability,
    /// The deliberate ack-before-commit bug (the harness must catch it).
    pub ack_before_commit: bool,
    /// WAL pages between checkpoints (small, so that cuts land around checkpoints).
    pub checkpoint_pages: u64,
    /// SQLite's page cache of each shard, in pages (0: the configuration's). A few pages
    /// and large responses make batches spill the cache into the WAL before their commit.
    pub cache_pages: u64,
    /// Each committed response is padded to this many bytes (if shorter).
    pub response_bytes: usize,
    /// The most keys a client ever works on. A client at it moves on from no completed
    /// key and commits no more: its held keys are heartbeated and released and granted
    /// again, so the shards keep writing while their live records stop growing (a store
    /// with a size limit is never filled by the run). `u64::MAX`: no limit.
    pub client_keys_max: u64,
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
            cache_pages: 0,
            response_bytes: 0,
            client_keys_max: u64::MAX,
            violations_max: 20,
            seed: 1,
        }
    }
}

/// What kind of guarantee a violation broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// After a restart a key is not as its acknowledged calls left it (nor as its one
    /// unanswered call would have): an acknowledged grant, commit or release was lost.
    LostAcknowledged,
    /// A lease ends earlier than acknowledged (a lost heartbeat, or a lease cut short).
    LeaseShortened,
    /// A grant's token is not above every token its key and shard had before.
    TokenWentBack,
    /// A grant was decided at a time before its shard's frame at the last cut.
    FrameWentBack,
    /// A held key was granted again, or a completed key did not replay its response.
    WrongAnswer,
    /// The engine did not open, or a shard did not, with the power on.
    DidNotOpen,
    /// A call failed, or a read disagreed with what was acknowledged, with the power on.
    FailedWithPower,
}

/// One broken guarantee.
#[derive(Clone, Debug)]
pub struct Violation {
    /// Which guarantee.
    pub kind: Kind,
    /// After which cut (0 before the first).
    pub cut: u64,
    /// What was seen, in words.
    pub detail: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cut {}: {:?}: {}", self.cut, self.kind, self.detail)
    }
}

/// What a run found.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Cuts made.
    pub cuts: u64,
    /// Of which torn.
    pub torn: u64,
    /// Cuts that came while the engine opened (recovery included).
    pub cut_while_opening: u64,
    /// Cuts that found a shard file with writes not yet synced (mid-checkpoint).
    pub cut_mid_checkpoint: u64,
    /// Writes to a WAL over bytes written since its last sync: frames of a spilled page
    /// cache, or their checksums, written again before their commit.
    pub wal_overwrites: u64,
    /// Syncs of shard files: checkpoints, mostly.
    pub checkpoints: u64,
    /// What the engine's shards counted as SQLite WAL checkpoints.
    pub engine_checkpoints: u64,
    /// Calls acknowledged before the cuts.
    pub acknowledged: u64,
    /// Key states compared after a restart with what was acknowledged.
    pub keys_checked: u64,
    /// Grants checked against the tokens and clock frame before the last cut.
    pub grants_checked: u64,
    /// Everything that broke a guarantee.
    pub violations: Vec<Violation>,
}

/// The counts in one line; the violations are the caller's to list.
impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} cuts ({} torn, {} while opening, {} mid-checkpoint), {} checkpoints ({} by the engine's count), {} WAL overwrites, {} calls acknowledged, {} key states and {} grants checked, {} violations",
            self.cuts,
            self.torn,
            self.cut_while_opening,
            self.cut_mid_checkpoint,
            self.checkpoints,
            self.engine_checkpoints,
            self.wal_overwrites,
            self.acknowledged,
            self.keys_checked,
            self.grants_checked,
            self.violations.len(),
        )
    }
}

impl Report {
    /// Whether some violation is of `kind`.
    pub fn has(&self, kind: Kind) -> bool {
        self.violations.iter().any(|v| v.kind == kind)
    }

    /// Whether an acknowledged write vanished: a grant, commit or release
    /// (`LostAcknowledged`), or a heartbeat (`LeaseShortened`).
    pub fn lost_acknowledged(&self) -> bool {
        self.has(Kind::LostAcknowledged) || self.has(Kind::LeaseShortened)
    }

    /// Adds `other`'s counts and violations to this report.
    pub fn absorb(&mut self, other: Report) {
        self.cuts += other.cuts;
        self.torn += other.torn;
        self.cut_while_opening += other.cut_while_opening;
        self.cut_mid_checkpoint += other.cut_mid_checkpoint;
        self.wal_overwrites += other.wal_overwrites;
        self.checkpoints += other.checkpoints;
        self.engine_checkpoints += other.engine_checkpoints;
        self.acknowledged += other.acknowledged;
        self.keys_checked += other.keys_checked;
        self.grants_checked += other.grants_checked;
        self.violations.extend(other.violations);
    }
}

/// A key's state as the clients know it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Known {
    Free,
    Held {
        token: u64,
        lease_until_ms: u64,
    },
    /// A lease that ran out: never acknowledged here (no lease runs out in a run).
    Abandoned {
        token: u64,
    },
    Done {
        token: u64,
        response: Vec<u8>,
    },
}

impl Known {
    fn of(view: View) -> Known {
        match view.state {
            State::Free => Known::Free,
            State::Pending => Known::Held { token: view.token, lease_until_ms: view.lease_until_ms },
            State::Abandoned => Known::Abandoned { token: view.token },
            State::Completed => Known::Done { token: view.token, response: view.response },
        }
    }

    fn token(&self) -> Option<u64> {
        match self {
            Known::Free => None,
            Known::Held { token, .. } | Known::Abandoned { token } | Known::Done { token, .. } => {
                Some(*token)
            }
        }
    }

    /// Whether an observed state (`self`) agrees with an expected one: the same, except
    /// that a lease may have been extended (the restart grace does), never shortened.
    fn agrees(&self, expected: &Known) -> bool {
        match (self, expected) {
            (Known::Held { token: a, lease_until_ms: la }, Known::Held { token: b, lease_until_ms: lb }) => {
                a == b && la >= lb
            }
            (observed, expected) => observed == expected,
        }
    }
}

/// What a call that went unanswered would have left.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Maybe {
    /// A grant: the key held with a token above every token its key and shard had.
    Granted { shard_token: u64 },
    /// A heartbeat: the key held with the same token and a lease at least as long.
    Renewed,
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

/// A client's keys: those it works on, and the completed ones it moved on from, which
/// are read back after cuts for the rest of the run.
#[derive(Clone, Debug, Default)]
struct ClientKeys {
    client: usize,
    live: Vec<KeyModel>,
    retired: Vec<KeyModel>,
    next_id: u64,
}

impl ClientKeys {
    /// Retires the completed key at `slot` and puts a new key in its place.
    fn rotate(&mut self, slot: usize, engine: &Engine) {
        let key = new_key(engine, self.client, self.next_id);
        self.next_id += 1;
        let done = std::mem::replace(&mut self.live[slot], key);
        self.retired.push(done);
    }
}

fn new_key(engine: &Engine, client: usize, id: u64) -> KeyModel {
    let key = format!("c{client}-k{id}");
    let scope = engine.scope(&Tenant::default_tenant(), NAMESPACE, &key).expect("a valid key");
    let shard = engine.shard_of(&scope);
    KeyModel { key, shard, acked: Known::Free, maybe: None, last_token: 0, last_started_ms: 0 }
}

/// What every shard had reached, for the checks after the next cut.
#[derive(Clone, Debug, Default)]
struct Marks {
    /// The highest token acknowledged or seen.
    token: Vec<u64>,
    /// The latest lease start acknowledged (a grant's decision time).
    started_ms: Vec<u64>,
}

impl Marks {
    fn new(models: &[ClientKeys], shards: u32) -> Marks {
        let mut marks = Marks { token: vec![0; shards as usize], started_ms: vec![0; shards as usize] };
        for key in models.iter().flat_map(|c| c.live.iter().chain(&c.retired)) {
            let shard = key.shard as usize;
            marks.token[shard] = marks.token[shard].max(key.last_token);
            marks.started_ms[shard] = marks.started_ms[shard].max(key.last_started_ms);
        }
        marks
    }
}

/// Where the next cut comes from.
#[derive(Clone, Copy, Debug)]
enum Trigger {
    /// After this many acknowledged calls.
    Calls(u64),
    /// After this many disk operations from the start of the open.
    WhileOpening(u64),
    /// After this many disk operations from the start of the traffic.
    InTraffic(u64),
}

/// A cycle's shared state for its client threads.
struct Cycle {
    engine: Engine,
    disk: Disk,
    clock: ManualClock,
    tenant: Tenant,
    /// The call count at which the power is cut, if the cut is counted in calls.
    cut_at: u64,
    client_keys_max: u64,
    response_bytes: usize,
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
    let stats = run.disk.stats();
    run.report.checkpoints = stats.checkpoints;
    run.report.cut_mid_checkpoint = stats.cuts_mid_checkpoint;
    run.report.wal_overwrites = stats.wal_overwrites;
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
    /// The marks before the last traffic: an unanswered grant of it must pass them.
    marks: Marks,
    /// Disk operations the last open and the last traffic took, to place fused cuts.
    open_ops: u64,
    traffic_ops: u64,
    /// Set when the engine is found broken: nothing more can be checked.
    stop: bool,
}

impl Run<'_> {
    fn new(plan: &Plan) -> Run<'_> {
        let faults = Faults::default();
        faults.checkpoint_after_pages(plan.checkpoint_pages);
        faults.cap_page_cache(plan.cache_pages);
        if plan.ack_before_commit {
            faults.ack_before_commit();
        }
        Run {
            plan,
            rng: StdRng::seed_from_u64(plan.seed),
            disk: Disk::new(),
            clock: ManualClock::new(1_700_000_000_000),
            faults,
            report: Report::default(),
            models: Vec::new(),
            marks: Marks::default(),
            open_ops: 200,
            traffic_ops: 2_000,
            stop: false,
        }
    }

    fn violation(&mut self, kind: Kind, cut: u64, detail: String) {
        self.report.violations.push(Violation { kind, cut, detail });
    }

    /// Half the cycles cut after a random number of acknowledged calls, which lands
    /// right after an answer; the others light a fuse that cuts after a random number of
    /// disk operations, within the open (recovery included) or within the traffic, so
    /// that cuts also land inside commits and checkpoints.
    fn trigger(&mut self) -> Trigger {
        match self.rng.random_range(0..6) {
            0..=2 => Trigger::Calls(self.rng.random_range(0..=self.plan.calls_per_cut_max)),
            3 => Trigger::WhileOpening(self.rng.random_range(0..=self.open_ops)),
            _ => Trigger::InTraffic(self.rng.random_range(0..=self.traffic_ops)),
        }
    }

    /// Opens the engine, checks every key, runs traffic until the cut, and restarts the
    /// disk.
    fn cycle(&mut self, cut: u64) {
        let trigger = self.trigger();
        if let Trigger::WhileOpening(ops) = trigger {
            self.disk.cut_after_ops(ops);
        }
        let before_open = self.disk.stats().ops;
        if let Some(engine) = self.open(cut) {
            self.open_ops = self.disk.stats().ops - before_open;
            let checked = self.check(&engine, cut);
            if checked && self.disk.powered() {
                let cut_at = match trigger {
                    Trigger::Calls(calls) => calls,
                    Trigger::InTraffic(ops) => {
                        self.disk.cut_after_ops(ops);
                        u64::MAX
                    }
                    Trigger::WhileOpening(_) => u64::MAX,
                };
                let before_traffic = self.disk.stats().ops;
                self.traffic(engine, cut, cut_at);
                if let Trigger::Calls(_) = trigger {
                    self.traffic_ops = (self.disk.stats().ops - before_traffic).max(1);
                }
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
            store: StoreConfig::default(),
            ..EngineConfig::default()
        };
        let clock = Arc::new(self.clock.clone());
        let opened = Engine::open_on(config, clock, self.faults.clone(), Arc::new(self.disk.boot()));
        let engine = match opened {
            Ok(engine) => engine,
            Err(_) if !self.disk.powered() => {
                self.report.cut_while_opening += 1;
                return None;
            }
            Err(error) => {
                self.violation(Kind::DidNotOpen, cut, format!("the engine did not open: {error}"));
                self.stop = true;
                return None;
            }
        };
        if let Some(problem) = unclean_shards(&engine) {
            // With the power gone mid-open, a shard that did not open proves nothing; a
            // fault it found persists and is reported at the next open with power.
            if self.disk.powered() {
                self.violation(Kind::DidNotOpen, cut, problem);
                self.stop = true;
            } else {
                self.report.cut_while_opening += 1;
            }
            engine.shutdown();
            return None;
        }
        Some(engine)
    }

    /// Reads keys back after a restart: every live key, and every completed one each
    /// `FULL_CHECK_EVERY` cuts (a sample otherwise). Returns whether it read them all
    /// (a fused cut may come in the middle).
    fn check(&mut self, engine: &Engine, cut: u64) -> bool {
        if self.models.is_empty() {
            self.models = (0..self.plan.clients)
                .map(|client| ClientKeys {
                    client,
                    live: (0..self.plan.keys_per_client as u64)
                        .map(|id| new_key(engine, client, id))
                        .collect(),
                    retired: Vec::new(),
                    next_id: self.plan.keys_per_client as u64,
                })
                .collect();
            return true;
        }
        let mut models = std::mem::take(&mut self.models);
        let complete = cut.is_multiple_of(FULL_CHECK_EVERY);
        let mut all_read = true;
        'clients: for client in &mut models {
            let sample: Vec<usize> = if complete {
                (0..client.retired.len()).collect()
            } else {
                let indices: Vec<usize> = (0..client.retired.len()).collect();
                indices.choose_multiple(&mut self.rng, RETIRED_SAMPLE).copied().collect()
            };
            let live = client.live.iter_mut();
            let retired =
                client.retired.iter_mut().enumerate().filter(|(i, _)| sample.contains(i)).map(|(_, k)| k);
            for key in live.chain(retired) {
                if !self.check_key(engine, key, cut) {
                    all_read = false;
                    break 'clients;
                }
            }
        }
        self.models = models;
        all_read
    }

    /// Reads one key and holds it to what was acknowledged; returns whether it was read.
    fn check_key(&mut self, engine: &Engine, key: &mut KeyModel, cut: u64) -> bool {
        let request = KeyRequest { namespace: NAMESPACE.into(), key: key.key.clone(), token: 0, lease_ms: 0 };
        let observed = match engine.get_blocking(&Tenant::default_tenant(), request) {
            Ok(view) => Known::of(view),
            Err(Error::Refused(oncegate_core::Error::NotFound)) => Known::Free,
            Err(_) if !self.disk.powered() => return false,
            Err(error) => {
                self.violation(Kind::FailedWithPower, cut, format!("reading {} failed: {error}", key.key));
                return true;
            }
        };
        self.report.keys_checked += 1;
        let shard = key.shard as usize;
        let allowed = observed.agrees(&key.acked)
            || match &key.maybe {
                Some(Maybe::State(state)) => observed.agrees(state),
                Some(Maybe::Renewed) => observed.agrees(&key.acked),
                Some(Maybe::Granted { shard_token }) => matches!(
                    observed,
                    Known::Held { token, .. } if token > key.last_token && token > *shard_token
                ),
                None => false,
            };
        if !allowed {
            let shortened = matches!((&observed, &key.acked), (Known::Held { token: a, .. } | Known::Abandoned { token: a }, Known::Held { token: b, .. }) if a == b);
            let kind = if shortened { Kind::LeaseShortened } else { Kind::LostAcknowledged };
            let detail = format!(
                "key {} (shard {shard}) is {observed:?}; acknowledged {:?}, and the unanswered call could have left {:?}",
                key.key, key.acked, key.maybe
            );
            self.violation(kind, cut, detail);
        }
        if let Some(token) = observed.token() {
            key.last_token = key.last_token.max(token);
        }
        key.acked = observed;
        key.maybe = None;
        true
    }

    /// Clients call until the power goes; their models come back with what was answered.
    fn traffic(&mut self, engine: Engine, cut: u64, cut_at: u64) {
        self.marks = Marks::new(&self.models, self.plan.shards);
        let cycle = Arc::new(Cycle {
            engine,
            disk: self.disk.clone(),
            clock: self.clock.clone(),
            tenant: Tenant::default_tenant(),
            cut_at,
            client_keys_max: self.plan.client_keys_max,
            response_bytes: self.plan.response_bytes,
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
                std::thread::spawn(move || drive(&cycle, keys, seed, cut))
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
        self.report.engine_checkpoints += cycle.engine.stats().iter().map(|s| s.checkpoints).sum::<u64>();
        let Ok(cycle) = Arc::try_unwrap(cycle) else { unreachable!("every client has returned") };
        cycle.engine.shutdown();
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

/// What one client found.
#[derive(Default)]
struct Found {
    violations: Vec<Violation>,
    grants_checked: u64,
}

impl Found {
    fn violation(&mut self, kind: Kind, cut: u64, detail: String) {
        self.violations.push(Violation { kind, cut, detail });
    }
}

/// One client: calls on its own keys until the power is cut.
fn drive(cycle: &Cycle, mut keys: ClientKeys, seed: u64, cut: u64) -> (ClientKeys, Found) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut found = Found::default();
    while !cycle.cut.load(Ordering::SeqCst) && cycle.disk.powered() {
        let pick = rng.random_range(0..keys.live.len());
        let at_max = keys.next_id >= cycle.client_keys_max;
        if matches!(keys.live[pick].acked, Known::Done { .. }) && !at_max && rng.random_bool(0.3) {
            keys.rotate(pick, &cycle.engine);
        }
        let key = &mut keys.live[pick];
        if let Err(error) = call(cycle, key, &mut rng, &mut found, cut, !at_max) {
            // The power is cut before any call can fail: a failure with power is a fault.
            if cycle.disk.powered() {
                found.violation(Kind::FailedWithPower, cut, format!("{}: a call failed: {error}", key.key));
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

/// Makes one call on `key` (a commit only if `may_commit`); an error is the engine's
/// refusal of it.
fn call(
    cycle: &Cycle,
    key: &mut KeyModel,
    rng: &mut StdRng,
    found: &mut Found,
    cut: u64,
    may_commit: bool,
) -> Result<(), Error> {
    match key.acked.clone() {
        acked if rng.random_bool(0.1) => read(cycle, key, &acked, found, cut),
        Known::Held { token, .. } if rng.random_bool(0.1) => duplicate(cycle, key, token, found, cut),
        Known::Free | Known::Abandoned { .. } => reserve(cycle, key, found, cut),
        Known::Done { token, response } => replay(cycle, key, token, &response, found, cut),
        Known::Held { token, .. } => finish(cycle, key, token, rng, may_commit),
    }
}

fn key_request(key: &KeyModel, token: u64) -> KeyRequest {
    KeyRequest { namespace: NAMESPACE.into(), key: key.key.clone(), token, lease_ms: LEASE_MS }
}

/// A read, which must show exactly what was acknowledged.
fn read(cycle: &Cycle, key: &mut KeyModel, acked: &Known, found: &mut Found, cut: u64) -> Result<(), Error> {
    key.maybe = None;
    let view = cycle.engine.get_blocking(&cycle.tenant, key_request(key, 0))?;
    let seen = Known::of(view);
    if &seen != acked {
        found.violation(
            Kind::FailedWithPower,
            cut,
            format!("{}: read {seen:?}, acknowledged {acked:?}", key.key),
        );
    }
    Ok(())
}

/// A duplicate attempt while the key is held: never a second grant.
fn duplicate(
    cycle: &Cycle,
    key: &mut KeyModel,
    token: u64,
    found: &mut Found,
    cut: u64,
) -> Result<(), Error> {
    key.maybe = None;
    let request =
        ReserveRequest { namespace: NAMESPACE.into(), key: key.key.clone(), ..ReserveRequest::default() };
    let reserved = cycle.engine.reserve_blocking(&cycle.tenant, request)?;
    if !matches!(reserved.reply, ReserveReply::InProgress { .. }) {
        let detail = format!("{}: held with token {token}, a duplicate got {:?}", key.key, reserved.reply);
        found.violation(Kind::WrongAnswer, cut, detail);
    }
    Ok(())
}

/// A replay of a completed key: the committed response, with its token.
fn replay(
    cycle: &Cycle,
    key: &mut KeyModel,
    token: u64,
    response: &[u8],
    found: &mut Found,
    cut: u64,
) -> Result<(), Error> {
    key.maybe = None;
    let request =
        ReserveRequest { namespace: NAMESPACE.into(), key: key.key.clone(), ..ReserveRequest::default() };
    let reserved = cycle.engine.reserve_blocking(&cycle.tenant, request)?;
    let replayed = matches!(&reserved.reply, ReserveReply::Completed { token: t, response: r, .. } if *t == token && r == response);
    if !replayed {
        found.violation(
            Kind::WrongAnswer,
            cut,
            format!("{}: a completed key answered {:?}", key.key, reserved.reply),
        );
    }
    Ok(())
}

/// A reserve of a free key, which must be a grant with a token above every token of its
/// key and of its shard before the last cut, decided no earlier than the shard's clock
/// frame at the cut.
fn reserve(cycle: &Cycle, key: &mut KeyModel, found: &mut Found, cut: u64) -> Result<(), Error> {
    let shard = key.shard as usize;
    key.maybe = Some(Maybe::Granted { shard_token: cycle.before.token[shard] });
    let request = ReserveRequest {
        namespace: NAMESPACE.into(),
        key: key.key.clone(),
        lease_ms: LEASE_MS,
        ..ReserveRequest::default()
    };
    let reserved = cycle.engine.reserve_blocking(&cycle.tenant, request)?;
    let ReserveReply::Granted { token, lease_until_ms, .. } = reserved.reply else {
        found.violation(
            Kind::WrongAnswer,
            cut,
            format!("{}: a free key answered {:?}", key.key, reserved.reply),
        );
        key.maybe = None;
        return Ok(());
    };
    found.grants_checked += 1;
    if token <= key.last_token || token <= cycle.before.token[shard] {
        let detail = format!(
            "{}: token {token}; the key's newest was {}, shard {shard}'s highest before the cut {}",
            key.key, key.last_token, cycle.before.token[shard]
        );
        found.violation(Kind::TokenWentBack, cut, detail);
    }
    let started_ms = lease_until_ms.saturating_sub(LEASE_MS);
    if started_ms < cycle.before.started_ms[shard] {
        let detail = format!(
            "{}: decided at {started_ms}, before shard {shard}'s frame at the cut ({})",
            key.key, cycle.before.started_ms[shard]
        );
        found.violation(Kind::FrameWentBack, cut, detail);
    }
    key.last_token = token;
    key.last_started_ms = started_ms;
    key.acked = Known::Held { token, lease_until_ms };
    key.maybe = None;
    Ok(())
}

/// The holder heartbeats, releases or (if `may_commit`) commits.
fn finish(
    cycle: &Cycle,
    key: &mut KeyModel,
    token: u64,
    rng: &mut StdRng,
    may_commit: bool,
) -> Result<(), Error> {
    let (engine, tenant) = (&cycle.engine, &cycle.tenant);
    let answered = match rng.random_range(0..if may_commit { 10 } else { 4 }) {
        0..=1 => {
            key.maybe = Some(Maybe::Renewed);
            engine
                .heartbeat_blocking(tenant, key_request(key, token))
                .map(|renewed| Known::Held { token, lease_until_ms: renewed.lease_until_ms })
        }
        2..=3 => {
            key.maybe = Some(Maybe::State(Known::Free));
            engine.release_blocking(tenant, key_request(key, token)).map(|()| Known::Free)
        }
        _ => {
            let mut response = format!("{}#{token}", key.key).into_bytes();
            if response.len() < cycle.response_bytes {
                response.resize(cycle.response_bytes, b'.');
            }
            let done = Known::Done { token, response: response.clone() };
            key.maybe = Some(Maybe::State(done.clone()));
            let request = CommitRequest {
                namespace: NAMESPACE.into(),
                key: key.key.clone(),
                token,
                outcome: Outcome::Succeeded,
                response,
            };
            engine.commit_blocking(tenant, request).map(|_| done)
        }
    };
    key.acked = answered?;
    key.maybe = None;
    Ok(())
}
