//! Several oncegate nodes on one PostgreSQL database: races split across nodes, one clock
//! for nodes whose own clocks disagree, tokens across nodes and expiry, waiting and
//! reclaim across nodes, and failing closed when the database goes away, turns
//! read-only or holds a newer schema. (The contract itself runs on both stores in the
//! other test files.)

mod common;

use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use common::pg::{Cluster, shared};
use common::*;
use oncegate_core::{Code, ReserveReply, State};
use oncegate_engine::{
    Clock, Durability, Engine, EngineConfig, Faults, KeyRequest, ManualClock, PgClock, PostgresConfig,
    ShardState, StoreConfig, SystemClock,
};

const WAIT: Duration = Duration::from_secs(20);

/// A node on database `url` with its own data directory (its name and lock).
fn node(dir: &std::path::Path, url: &str, clock: PgClock, time: Arc<dyn Clock>) -> Engine {
    node_with(dir, url, clock, time, Faults::default())
}

/// [`node`] with a fault seam.
fn node_with(
    dir: &std::path::Path,
    url: &str,
    clock: PgClock,
    time: Arc<dyn Clock>,
    faults: Faults,
) -> Engine {
    let config = EngineConfig {
        data_dir: dir.to_owned(),
        store: StoreConfig::Postgres(PostgresConfig {
            postgres_url: url.into(),
            postgres_clock: clock,
            ..PostgresConfig::default()
        }),
        reopen_backoff_ms_min: 10,
        reopen_backoff_ms_max: 200,
        ..EngineConfig::default()
    };
    Engine::open_with(config, time, faults).expect("node opens")
}

/// A one-shard node's configuration in `dir` on database `url`, its store's settings as
/// `store` edits them.
fn one_shard(dir: &std::path::Path, url: &str, store: impl FnOnce(&mut PostgresConfig)) -> EngineConfig {
    let mut config = EngineConfig {
        data_dir: dir.to_owned(),
        shards: 1,
        store: StoreConfig::Postgres(PostgresConfig {
            postgres_url: url.into(),
            ..PostgresConfig::default()
        }),
        ..EngineConfig::default()
    };
    if let StoreConfig::Postgres(postgres) = &mut config.store {
        store(postgres);
    }
    config
}

/// Runs SQL on the database (the operator's side of a test).
fn sql(url: &str, statement: &str) {
    block_on(async {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
        let driver = tokio::spawn(connection);
        client.batch_execute(statement).await.unwrap();
        drop(client);
        let _ = driver.await;
    });
}

fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(future)
}

/// Two nodes of one database, each with its own directory.
struct Pair {
    a: Engine,
    b: Engine,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

fn pair(name: &str, clock: PgClock, time_a: Arc<dyn Clock>, time_b: Arc<dyn Clock>) -> Option<Pair> {
    let url = shared()?.database(name);
    let dirs = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = node(dirs.0.path(), &url, clock, time_a);
    let b = node(dirs.1.path(), &url, clock, time_b);
    Some(Pair { a, b, _dirs: dirs })
}

#[test]
fn a_race_split_across_two_nodes_grants_exactly_once() {
    let Some(pair) = pair("race", PgClock::Database, Arc::new(SystemClock), Arc::new(SystemClock)) else {
        return;
    };
    let t = tenant();
    for round in 0..20 {
        let name = format!("race-{round}");
        let barrier = std::sync::Barrier::new(64);
        let grants: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..64)
                .map(|i| {
                    let (engine, barrier, name, t) =
                        (if i % 2 == 0 { &pair.a } else { &pair.b }, &barrier, &name, &t);
                    s.spawn(move || {
                        barrier.wait();
                        let reply = engine.reserve_blocking(t, reserve(name)).unwrap().reply;
                        usize::from(matches!(reply, ReserveReply::Granted { .. }))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(grants, 1, "round {round}: exactly one of 64 racers on two nodes is granted");
    }
}

#[test]
fn nodes_whose_clocks_disagree_decide_by_the_database_clock() {
    // Node B's own clock is an hour ahead of node A's; both decide by the database's.
    let (a_time, b_time) = (ManualClock::new(T0), ManualClock::new(T0 + 3_600_000));
    let Some(pair) = pair("skew", PgClock::Database, Arc::new(a_time), Arc::new(b_time)) else { return };
    let t = tenant();
    let granted_on_a = pair.a.reserve_blocking(&t, reserve_for("k", 10_000, 60_000, 0)).unwrap().reply;
    let ReserveReply::Granted { lease_until_ms, .. } = granted_on_a else { panic!("{granted_on_a:?}") };
    let seen_on_b = pair.b.reserve_blocking(&t, reserve_for("k", 10_000, 60_000, 0)).unwrap().reply;
    match seen_on_b {
        ReserveReply::InProgress { lease_until_ms: seen, .. } => {
            assert_eq!(seen, lease_until_ms, "B sees the lease A was given, an hour of skew or not")
        }
        other => panic!("B's hour-ahead clock must not expire A's lease: {other:?}"),
    }
    let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    assert!(lease_until_ms.abs_diff(wall + 10_000) < 60_000, "the lease runs on the database's clock");
}

#[test]
fn tokens_increase_across_nodes_and_across_expiry() {
    let time = ManualClock::new(T0);
    let Some(pair) = pair("tokens", PgClock::Engine, Arc::new(time.clone()), Arc::new(time.clone())) else {
        return;
    };
    let t = tenant();
    let t1 = granted(&pair.a.reserve_blocking(&t, reserve_for("k", 1_000, 1_000, 0)).unwrap().reply);
    pair.a.release_blocking(&t, key("k", t1)).unwrap();
    let t2 = granted(&pair.b.reserve_blocking(&t, reserve_for("k", 1_000, 1_000, 0)).unwrap().reply);
    assert!(t2 > t1, "B's grant after A's: {t2} > {t1}");
    pair.b.commit_blocking(&t, commit("k", t2, b"done")).unwrap();
    // The record expires and is reclaimed (by whichever node gets there), then A grants
    // the key again: its token is still above every earlier one.
    time.advance(5_000);
    pair.a.run_alarms();
    pair.b.run_alarms();
    let reclaimed: u64 = pair.a.stats().iter().chain(pair.b.stats().iter()).map(|s| s.reclaimed).sum();
    assert_eq!(reclaimed, 1, "the expired record was deleted once");
    let t3 = granted(&pair.a.reserve_blocking(&t, reserve_for("k", 1_000, 1_000, 0)).unwrap().reply);
    assert!(t3 > t2, "after expiry: {t3} > {t2}");
    // A stale holder's token is fenced on either node.
    assert_eq!(pair.b.commit_blocking(&t, commit("k", t2, b"late")).unwrap_err().code(), Code::LeaseLost);
}

#[test]
fn a_waiter_on_one_node_is_answered_when_another_node_commits() {
    let Some(pair) = pair("wait", PgClock::Database, Arc::new(SystemClock), Arc::new(SystemClock)) else {
        return;
    };
    let t = tenant();
    let token = granted(&pair.a.reserve_blocking(&t, reserve_for("k", 60_000, 60_000, 0)).unwrap().reply);
    let waiter = pair.b.reserve(&t, reserve_for("k", 60_000, 60_000, 15_000));
    let shard = pair.b.shard_of(&pair.b.scope(&t, "live", "k").unwrap());
    assert!(pair.b.wait_stats(shard, WAIT, |s| s.waiters == 1), "parked on B");
    pair.a.commit_blocking(&t, commit("k", token, b"from A")).unwrap();
    match block_on(waiter).unwrap().reply {
        ReserveReply::Completed { response, .. } => assert_eq!(response, b"from A"),
        other => panic!("B's waiter hears A's commit (by its poll), not {other:?}"),
    }
}

/// A parked reserve's poll reads its key and writes nothing while the key is unchanged:
/// polls that wrote locked every waited key (a shard then stalled behind any other node's
/// transaction on one of them) and cost the database a WAL flush every 50 ms. When the
/// holder's node commits, the next poll answers the waiter.
#[test]
fn a_poll_that_finds_its_waits_unchanged_writes_nothing() {
    let Some(cluster) = shared() else { return };
    let url = cluster.database("quietpoll");
    let dirs = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = node(dirs.0.path(), &url, PgClock::Database, Arc::new(SystemClock));
    // No reclaim comes due within the test: the alarms it counts are the polls.
    let config = EngineConfig { reclaim_granularity_ms: 60_000, ..one_shard(dirs.1.path(), &url, |_| {}) };
    let b = Engine::open_with(config, Arc::new(SystemClock), Faults::default()).unwrap();
    let t = tenant();
    let token = granted(&a.reserve_blocking(&t, reserve_for("k", 60_000, 60_000, 0)).unwrap().reply);
    let waiter = b.reserve(&t, reserve_for("k", 60_000, 60_000, 30_000));
    assert!(b.wait_stats(0, WAIT, |s| s.waiters == 1), "parked on B");
    let parked = b.stats()[0].clone();
    assert!(b.wait_stats(0, WAIT, |s| s.alarms >= parked.alarms + 5), "B polls");
    let polled = b.stats()[0].clone();
    assert_eq!(polled.commits, parked.commits, "{} polls, and each wrote", polled.alarms - parked.alarms);
    a.commit_blocking(&t, commit("k", token, b"from A")).unwrap();
    match block_on(waiter).unwrap().reply {
        ReserveReply::Completed { response, .. } => assert_eq!(response, b"from A"),
        other => panic!("B's waiter hears A's commit (by its poll), not {other:?}"),
    }
    assert!(b.stats()[0].commits > polled.commits, "the poll that answered wrote");
}

/// A parked reserve's poll takes the holder's lease as it reads it. Renewed on another
/// node, the lease the waiter last saw passed while the key was still held; the alarm
/// for it fell due again at once after each poll that found the key unchanged, so the
/// shard polled without end and never read its mailbox: every other request on it waited
/// until the waiter's own deadline.
#[test]
fn a_lease_renewed_on_another_node_does_not_keep_the_waiting_shard_polling() {
    let Some(cluster) = shared() else { return };
    let url = cluster.database("renewed");
    let dirs = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let time = ManualClock::new(T0);
    let a = node(dirs.0.path(), &url, PgClock::Engine, Arc::new(time.clone()));
    let config = one_shard(dirs.1.path(), &url, |store| store.postgres_clock = PgClock::Engine);
    let b = Engine::open_with(config, Arc::new(time.clone()), Faults::default()).unwrap();
    let t = tenant();
    let token = granted(&a.reserve_blocking(&t, reserve_for("k", 1_000, 600_000, 0)).unwrap().reply);
    let waiter = b.reserve(&t, reserve_for("k", 1_000, 600_000, 30_000));
    if !b.wait_stats(0, WAIT, |s| s.waiters == 1) {
        panic!("not parked on B: {:?} {:?}", b.stats(), block_on(waiter));
    }
    let beat = KeyRequest { namespace: "live".into(), key: "k".into(), token, lease_ms: 120_000 };
    a.heartbeat_blocking(&t, beat).unwrap();
    // Past the lease B's waiter saw, well within the renewed one; then B's shard polls
    // (twice, so that the second was the alarm that lease brought due, whatever the timer
    // it slept on) before a request reaches its mailbox.
    let polled = b.stats()[0].alarms;
    time.advance(1_500);
    assert!(b.wait_stats(0, WAIT, |s| s.alarms >= polled + 2), "B polls");
    let other = b.reserve(&t, reserve("other"));
    let answered = block_on(async { tokio::time::timeout(WAIT, other).await });
    let answered = answered.expect("B's shard reads its mailbox while its waiter waits");
    granted(&answered.unwrap().reply);
}

#[test]
fn expired_records_are_reclaimed_by_whichever_node_gets_there() {
    let time = ManualClock::new(T0);
    let Some(pair) = pair("reclaim", PgClock::Engine, Arc::new(time.clone()), Arc::new(time.clone())) else {
        return;
    };
    let t = tenant();
    for i in 0..30 {
        let name = format!("k{i}");
        let token = granted(&pair.a.reserve_blocking(&t, reserve_for(&name, 1_000, 1_000, 0)).unwrap().reply);
        pair.a.commit_blocking(&t, commit(&name, token, b"x")).unwrap();
    }
    time.advance(5_000);
    // B's alarms run now; A's may run on their own timers meanwhile. Each record is
    // deleted by exactly one of them.
    for _ in 0..10 {
        pair.b.run_alarms();
    }
    pair.a.run_alarms();
    let reclaimed = |engine: &Engine| engine.stats().iter().map(|s| s.reclaimed).sum::<u64>();
    let (on_a, on_b) = (reclaimed(&pair.a), reclaimed(&pair.b));
    assert_eq!(on_a + on_b, 30, "every expired record deleted once: {on_a} by A, {on_b} by B");
    assert!(on_b > 0, "B reclaims records A wrote");
    assert_eq!(pair.a.get_blocking(&t, key("k0", 0)).unwrap().state, State::Free);
}

#[test]
fn a_database_that_goes_away_answers_unavailable_and_the_node_recovers() {
    let Some(cluster) = Cluster::start() else { return };
    let url = cluster.database("outage");
    let dir = tempfile::tempdir().unwrap();
    let engine = node(dir.path(), &url, PgClock::Database, Arc::new(SystemClock));
    let t = tenant();
    let token = granted(&engine.reserve_blocking(&t, reserve("before")).unwrap().reply);
    engine.commit_blocking(&t, commit("before", token, b"kept")).unwrap();

    cluster.stop();
    let err = engine.reserve_blocking(&t, reserve("during")).unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    let shard = engine.shard_of(&engine.scope(&t, "live", "during").unwrap());
    assert_ne!(
        engine.shard_states()[shard as usize],
        ShardState::Serving,
        "health reports it: {:?}",
        engine.stats()
    );

    cluster.restart();
    for shard in 0..engine.shard_states().len() as u32 {
        assert!(
            engine.wait_shard_state(shard, ShardState::Serving, WAIT),
            "shard {shard} reconnected by itself"
        );
    }
    assert!(matches!(
        engine.reserve_blocking(&t, reserve("during")).unwrap().reply,
        ReserveReply::Granted { .. }
    ));
    match engine.reserve_blocking(&t, reserve("before")).unwrap().reply {
        ReserveReply::Completed { response, .. } => assert_eq!(response, b"kept"),
        other => panic!("what was acknowledged before the outage is there after it: {other:?}"),
    }
}

/// The records a node's shards count, completed ones, in all.
fn completed(engine: &Engine) -> u64 {
    engine.stats().iter().map(|s| s.records_completed).sum()
}

/// A node counts the table's records when it starts (each shard its slots'), and again
/// when an operator reopens a shard; a shard that reconnects by itself after a failure
/// keeps its own counts instead of scanning the table, so a database that comes back is
/// not met by every shard of every node counting at once.
#[test]
fn a_node_counts_the_records_when_it_starts_and_a_reconnect_does_not_count_again() {
    let Some(cluster) = shared() else { return };
    let url = cluster.database("counts");
    let dirs = [(); 3].map(|_| tempfile::tempdir().unwrap());
    let time = || -> Arc<dyn Clock> { Arc::new(SystemClock) };
    let a = node(dirs[0].path(), &url, PgClock::Database, time());
    let faults = Faults::default();
    let b = node_with(dirs[1].path(), &url, PgClock::Database, time(), faults.clone());
    let t = tenant();
    for n in 0..40 {
        let key = format!("k{n}");
        let token = granted(&a.reserve_blocking(&t, reserve(&key)).unwrap().reply);
        a.commit_blocking(&t, commit(&key, token, b"r")).unwrap();
    }
    assert_eq!(completed(&a), 40, "the writer counts its own");
    assert_eq!(completed(&b), 0, "b opened before the writes");

    // Each of b's shards fails a commit, closes, and reconnects by itself.
    let shards = b.shard_states().len() as u32;
    let mut keys = (0..).map(|n| format!("fail{n}"));
    for shard in 0..shards {
        // An alarm's transaction may take the armed failure first: then arm it again.
        loop {
            let key = keys.find(|k| b.shard_of(&b.scope(&t, "live", k).unwrap()) == shard).unwrap();
            faults.fail_commits(1);
            if b.reserve_blocking(&t, reserve(&key)).is_err() {
                break;
            }
        }
    }
    for shard in 0..shards {
        assert!(b.wait_shard_state(shard, ShardState::Serving, WAIT), "shard {shard} reconnected");
    }
    assert_eq!(completed(&b), 0, "a reconnect keeps the shard's counts: {:?}", b.stats());

    for shard in 0..shards {
        assert!(b.reopen_shard(shard).unwrap());
    }
    assert_eq!(completed(&b), 40, "an operator's reopen counts again: {:?}", b.stats());

    let c = node(dirs[2].path(), &url, PgClock::Database, time());
    assert_eq!(completed(&c), 40, "a node that starts counts the table: {:?}", c.stats());
    assert!(c.stats().iter().all(|s| s.records_completed < 40), "each shard counts its own slots");
}

#[test]
fn a_read_only_database_is_refused_and_a_newer_schema_too() {
    let Some(cluster) = shared() else { return };
    let url = cluster.database("readonly");
    let dir = tempfile::tempdir().unwrap();
    let time: Arc<dyn Clock> = Arc::new(ManualClock::new(T0));
    drop(node(dir.path(), &url, PgClock::Engine, Arc::clone(&time)));
    sql(&cluster.url("postgres"), "ALTER DATABASE readonly SET default_transaction_read_only = on");
    let engine = node(dir.path(), &url, PgClock::Engine, Arc::clone(&time));
    let stats = engine.stats();
    assert!(stats.iter().all(|s| s.state == ShardState::Failed));
    let error = stats[0].last_error.clone().unwrap_or_default();
    assert!(error.contains("read-only"), "{error}");
    assert_eq!(engine.reserve_blocking(&tenant(), reserve("k")).unwrap_err().code(), Code::Unavailable);
    drop(engine);

    sql(&cluster.url("postgres"), "ALTER DATABASE readonly SET default_transaction_read_only = off");
    sql(&url, "UPDATE oncegate_schema SET version = 99");
    let engine = node(dir.path(), &url, PgClock::Engine, time);
    let error = engine.stats()[0].last_error.clone().unwrap_or_default();
    assert!(error.contains("schema version 99 is unknown"), "{error}");
}

/// What the process logged at INFO and above, from every thread, since the first call.
/// (The node reports its database's durability from its shard's thread, so a subscriber
/// for one thread would not see it.)
fn logs() -> &'static Mutex<Vec<u8>> {
    static LOGS: OnceLock<&'static Mutex<Vec<u8>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs: &'static Mutex<Vec<u8>> = Box::leak(Box::default());
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || Captured(logs))
            .init();
        logs
    })
}

/// Where [`logs`] writes.
struct Captured(&'static Mutex<Vec<u8>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Under `durability = "full"` (the default) an answer leaves once its commit is flushed,
/// even on a database whose own default is `synchronous_commit = off`: each of the node's
/// sessions raises it to `on`, and the node's report, read from its session, says so.
/// Under `normal` the database's setting stands, with a warning. (The node only warned,
/// and answered from commits a crash of the database could forget.)
#[test]
fn a_node_flushes_its_commits_where_the_database_would_not() {
    let Some(cluster) = shared() else { return };
    let logs = logs();
    for (name, durability, session) in
        [("sync_off_full", Durability::Full, "on"), ("sync_off_normal", Durability::Normal, "off")]
    {
        let url = cluster.database(name);
        sql(&cluster.url("postgres"), &format!("ALTER DATABASE {name} SET synchronous_commit = off"));
        let dir = tempfile::tempdir().unwrap();
        let config = EngineConfig { durability, ..one_shard(dir.path(), &url, |_| {}) };
        let engine = Engine::open(config).expect("node opens");
        let reply = engine.reserve_blocking(&tenant(), reserve("k")).unwrap().reply;
        assert!(matches!(reply, ReserveReply::Granted { .. }), "{reply:?}");
        drop(engine);
        // The report comes before the shard serves, so it is logged by now.
        let text = String::from_utf8(logs.lock().unwrap_or_else(PoisonError::into_inner).clone()).unwrap();
        let database = format!("dbname={name} ");
        let reported: Vec<&str> = text
            .lines()
            .filter(|line| line.contains(&database) && line.contains(" synchronous_commit="))
            .collect();
        let wanted = format!(" synchronous_commit={session}");
        assert!(!reported.is_empty(), "no report of {name}'s durability in:\n{text}");
        assert!(reported.iter().all(|line| line.contains(&wanted)), "{durability:?}: {reported:#?}");
    }
}

/// Nodes on one database use the tables of `postgres_schema`, whatever their roles'
/// `search_path` would choose: a role with a schema of its own name got tables of its own
/// there (`"$user", public`), and its node granted a key another node had granted. A node
/// configured for a schema without the tables while another schema holds them is refused
/// rather than started on empty tables, and so is a schema that does not exist.
#[test]
fn nodes_whose_roles_would_choose_other_schemas_share_the_configured_one() {
    let Some(cluster) = shared() else { return };
    let url = cluster.database("schemas");
    let time: Arc<dyn Clock> = Arc::new(ManualClock::new(T0));
    let in_schema = |dir: &std::path::Path, url: &str, schema: &str| {
        let config = one_shard(dir, url, |store| {
            store.postgres_clock = PgClock::Engine;
            store.postgres_schema = schema.to_owned();
        });
        Engine::open_with(config, Arc::clone(&time), Faults::default()).expect("node opens")
    };
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let a = in_schema(dirs[0].path(), &url, "public");
    assert!(matches!(
        a.reserve_blocking(&tenant(), reserve("k")).unwrap().reply,
        ReserveReply::Granted { .. }
    ));
    sql(
        &url,
        "CREATE ROLE schema_owner LOGIN; CREATE SCHEMA schema_owner AUTHORIZATION schema_owner; \
         GRANT USAGE ON SCHEMA public TO schema_owner; \
         GRANT ALL ON ALL TABLES IN SCHEMA public TO schema_owner; \
         GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO schema_owner;",
    );
    let owner_url = url.replace("user=postgres", "user=schema_owner");
    let b = in_schema(dirs[1].path(), &owner_url, "public");
    let on_b = b.reserve_blocking(&tenant(), reserve("k")).unwrap();
    assert!(matches!(on_b.reply, ReserveReply::InProgress { .. }), "granted twice: {:?}", on_b.reply);
    drop(b);

    let failed = |engine: &Engine| {
        assert_eq!(engine.reserve_blocking(&tenant(), reserve("k")).unwrap_err().code(), Code::Unavailable);
        engine.stats()[0].last_error.clone().unwrap_or_default()
    };
    let c = in_schema(dirs[2].path(), &owner_url, "schema_owner");
    let error = failed(&c);
    assert!(error.contains("oncegate's tables are in schema public, not in postgres_schema"), "{error}");
    let d = in_schema(dirs[3].path(), &url, "nowhere");
    let error = failed(&d);
    assert!(error.contains("postgres_schema \"nowhere\" does not exist"), "{error}");
}

/// A batch that waits for a row lock another session holds decides at the database's
/// time after the wait, not at the bound on the database's clock reckoned before it: the
/// node's clock ran through the wait too. Held to the earlier bound, the heartbeat's lease
/// was dated back by the wait and so ran out that much sooner than the caller was told.
#[test]
fn a_batch_that_waited_for_a_lock_decides_at_the_time_after_the_wait() {
    let Some(cluster) = shared() else { return };
    let url = cluster.database("lockwait");
    let dir = tempfile::tempdir().unwrap();
    let time = ManualClock::new(T0);
    let config = one_shard(dir.path(), &url, |_| {});
    let engine = Engine::open_with(config, Arc::new(time.clone()), Faults::default()).unwrap();
    let ReserveReply::Granted { token, .. } = engine.reserve_blocking(&tenant(), reserve("k")).unwrap().reply
    else {
        panic!("the first reserve is granted")
    };
    let renewed = block_on(async {
        let (holder, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        holder
            .batch_execute("BEGIN; SELECT 1 FROM oncegate_records WHERE key = 'k' FOR UPDATE")
            .await
            .unwrap();
        let renewing = {
            let engine = engine.clone();
            let beat = KeyRequest { namespace: "live".into(), key: "k".into(), token, lease_ms: 30_000 };
            std::thread::spawn(move || engine.heartbeat_blocking(&tenant(), beat))
        };
        // The heartbeat's batch waits on the row; the node's clock runs a minute meanwhile.
        let waiting =
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = 'lockwait'";
        while holder.query_one(waiting, &[]).await.unwrap().get::<_, i64>(0) == 0 {
            tokio::task::yield_now().await;
        }
        time.advance(60_000);
        let now = "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint";
        let released_ms = holder.query_one(now, &[]).await.unwrap().get::<_, i64>(0) as u64;
        holder.batch_execute("COMMIT").await.unwrap();
        (released_ms, tokio::task::spawn_blocking(move || renewing.join().unwrap()).await.unwrap())
    });
    let (released_ms, renewed) = renewed;
    let lease_until_ms = renewed.unwrap().lease_until_ms;
    assert!(
        lease_until_ms >= released_ms + 30_000,
        "the lease ends at {lease_until_ms}, {} ms short of 30 s after the wait ended",
        released_ms + 30_000 - lease_until_ms
    );
}

/// One node with one shard on `url`, its clock (the engine's) at `time`: T0, years
/// behind the database's.
fn one_shard_node(dir: &std::path::Path, url: &str, time: &ManualClock) -> Engine {
    Engine::open_with(one_shard(dir, url, |_| {}), Arc::new(time.clone()), Faults::default()).unwrap()
}

/// A token sequence that could hand tokens out again or out of order is refused when a
/// node starts: one set back behind the stored tokens (a copy of the database made
/// without it), and one that caches values per session.
#[test]
fn a_token_sequence_behind_the_records_or_cached_is_refused() {
    let Some(cluster) = shared() else { return };
    let url = cluster.database("sequence");
    let dir = tempfile::tempdir().unwrap();
    // A node clock before the token floor's origin: the sequence is not raised, and
    // only the check stands between a set-back sequence and a reissued token.
    let start = || node(dir.path(), &url, PgClock::Database, Arc::new(ManualClock::new(T0)));
    let engine = start();
    for n in 0..3 {
        assert!(matches!(
            engine.reserve_blocking(&tenant(), reserve(&format!("k{n}"))).unwrap().reply,
            ReserveReply::Granted { .. }
        ));
    }
    drop(engine);
    let refused = |expected: &str| {
        let engine = start();
        let error = engine.stats()[0].last_error.clone().unwrap_or_default();
        assert!(error.contains(expected), "{error}");
        assert_eq!(engine.reserve_blocking(&tenant(), reserve("new")).unwrap_err().code(), Code::Unavailable);
    };
    sql(&url, "ALTER SEQUENCE oncegate_tokens RESTART");
    refused("behind the stored tokens");
    sql(&url, "SELECT setval('oncegate_tokens', 1000000); ALTER SEQUENCE oncegate_tokens CACHE 20");
    refused("CACHE 20");
    sql(&url, "ALTER SEQUENCE oncegate_tokens CACHE 1");
    let engine = start();
    assert!(
        matches!(engine.reserve_blocking(&tenant(), reserve("new")).unwrap().reply, ReserveReply::Granted { token, .. } if token > 1_000_000)
    );
}

/// A database restored from a backup brings its token sequence back; a node connecting
/// to it raises the sequence to its clock's floor, so every token granted after the
/// restore is above every token the original granted, however often its nodes restarted
/// after the backup. Before, the restored sequence handed out tokens below them again.
#[test]
fn a_restored_database_grants_above_every_token_the_original_granted() {
    let Some(cluster) = shared() else { return };
    let url = cluster.database("restored");
    let dir = tempfile::tempdir().unwrap();
    // 2025-01-02: a day past the token floor's origin.
    let time = ManualClock::new(1_735_776_000_000);
    let granted =
        |engine: &Engine, key: &str| match engine.reserve_blocking(&tenant(), reserve(key)).unwrap().reply {
            ReserveReply::Granted { token, .. } => token,
            other => panic!("{key}: {other:?}"),
        };
    let engine = one_shard_node(dir.path(), &url, &time);
    let before = granted(&engine, "before");
    engine.commit_blocking(&tenant(), commit("before", before, b"done")).unwrap();
    // The backup: the records as they are now, and the sequence with them.
    sql(
        &url,
        "CREATE TABLE backup_records AS TABLE oncegate_records; \
               CREATE TABLE backup_tokens AS SELECT last_value, is_called FROM oncegate_tokens",
    );
    drop(engine);
    let mut original = Vec::new();
    for restart in 0..3 {
        time.advance(1_000);
        let engine = one_shard_node(dir.path(), &url, &time);
        original.push(granted(&engine, &format!("after-{restart}")));
        engine.shutdown();
    }
    // The restore, a second later.
    sql(
        &url,
        "DELETE FROM oncegate_records; INSERT INTO oncegate_records TABLE backup_records; \
               SELECT setval('oncegate_tokens', last_value, is_called) FROM backup_tokens",
    );
    time.advance(1_000);
    let engine = one_shard_node(dir.path(), &url, &time);
    assert!(
        matches!(
            engine.reserve_blocking(&tenant(), reserve("before")).unwrap().reply,
            ReserveReply::Completed { .. }
        ),
        "the backup's commit is in the restored database"
    );
    let highest = original.iter().max().copied().unwrap();
    for restart in 0..3 {
        let again = granted(&engine, &format!("after-{restart}"));
        assert!(
            again > highest,
            "after-{restart}: {again} is not above {highest}, granted before the restore"
        );
    }
}

/// The lease end of a grant of `key` for `lease_ms`.
fn lease_of(engine: &Engine, key: &str, lease_ms: u64) -> u64 {
    match engine.reserve_blocking(&tenant(), reserve_for(key, lease_ms, 60_000, 0)).unwrap().reply {
        ReserveReply::Granted { lease_until_ms, .. } => lease_until_ms,
        other => panic!("{other:?}"),
    }
}

/// The database server's clock, read on a connection of its own.
fn database_ms(url: &str) -> u64 {
    block_on(async {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
        let driver = tokio::spawn(connection);
        let row =
            client.query_one("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint", &[]).await;
        drop(client);
        let _ = driver.await;
        row.unwrap().get::<_, i64>(0) as u64
    })
}

/// The database's clock is read in every transaction, but it may not run ahead of the
/// node's own clock: a forward step of the database server's clock (here, its time
/// passing while the node's manual clock stands still) is held back, so no lease ages
/// at once. Before the cap, every grant below got a later lease than the first.
#[test]
fn a_database_clock_running_ahead_of_the_node_is_held_to_the_node_pace() {
    let Some(cluster) = shared() else { return };
    let url = cluster.database("ahead");
    let dir = tempfile::tempdir().unwrap();
    let time = ManualClock::new(T0);
    let engine = one_shard_node(dir.path(), &url, &time);
    let first = lease_of(&engine, "k0", 10_000);
    // Grant keys until the database's clock has moved 100 ms past the first grant.
    let mut n = 0;
    while database_ms(&url) < first - 10_000 + 100 {
        n += 1;
        assert_eq!(
            lease_of(&engine, &format!("k{n}"), 10_000),
            first,
            "grant {n}: time stood still with the node's clock"
        );
    }
    // Once the node's clock moves on, time follows the database's again (up to the node's
    // pace plus 1%): it catches up with the 100 ms it was held back, never past it.
    time.advance(10_000);
    let later = lease_of(&engine, "after", 10_000);
    let database_now = database_ms(&url);
    assert!(
        later >= first + 100 && later <= database_now + 10_000,
        "time caught up with the database's clock: {later} vs {first}, database now {database_now}"
    );
}

/// A reopened shard (after a failure, here at the operator's word) still holds the
/// database's clock to the node's pace: its first transaction does not take the
/// database's time as it is, which after a fail-over to a host whose clock runs ahead
/// would age every lease at once.
#[test]
fn a_reopened_shard_still_holds_the_database_clock_to_the_node_pace() {
    let Some(cluster) = shared() else { return };
    let url = cluster.database("ahead_reopened");
    let dir = tempfile::tempdir().unwrap();
    let time = ManualClock::new(T0);
    let engine = one_shard_node(dir.path(), &url, &time);
    let first = lease_of(&engine, "k0", 10_000);
    while database_ms(&url) < first - 10_000 + 100 {}
    assert!(engine.reopen_shard(0).unwrap());
    assert_eq!(lease_of(&engine, "k1", 10_000), first, "the reopen took the database's clock as it is");
}

/// Time goes on moving after a reopen when the node's clock is behind the database's
/// (the reopen must not lift the shard's own clock to the database's mark, where it
/// would stand still until the node's clock caught up): a lease still ends.
#[test]
fn a_lease_still_ends_after_a_reopen_when_the_node_clock_is_behind_the_database() {
    let Some(cluster) = shared() else { return };
    let url = cluster.database("behind_reopened");
    let dir = tempfile::tempdir().unwrap();
    let time = ManualClock::new(T0);
    let engine = one_shard_node(dir.path(), &url, &time);
    lease_of(&engine, "a", 10_000);
    assert!(engine.reopen_shard(0).unwrap());
    let lease_until_ms = lease_of(&engine, "k", 1_000);
    // The database's clock first, then the node's: a transaction in between (an alarm)
    // would take a time the database had not reached yet and hold the next ones to it.
    while database_ms(&url) < lease_until_ms + 500 {}
    time.advance(1_500);
    match engine.reserve_blocking(&tenant(), reserve_for("k", 1_000, 60_000, 0)).unwrap().reply {
        ReserveReply::Granted { attempt: 2, .. } => {}
        other => panic!("the lease never ended: {other:?}"),
    }
}

#[path = "../../oncegate-server/tests/common/certs.rs"]
#[allow(dead_code)]
mod certs;

/// `sslmode=require` gets TLS, with the database's certificate checked against the
/// configured CA: a node without that CA is refused (it answers `unavailable`), a node
/// with it serves. The cluster takes TLS connections only.
#[test]
fn the_database_is_reached_over_tls_when_the_url_asks() {
    let files = tempfile::tempdir().unwrap();
    let pki = certs::Pki::new(files.path(), "pg");
    let Some(cluster) = Cluster::start_tls(&pki.server.cert, &pki.server.key) else { return };
    let url = format!("{} sslmode=require", cluster.database("tls"));
    let open = |ca: Option<&std::path::Path>| {
        let dir = tempfile::tempdir().unwrap();
        let config = one_shard(dir.path(), &url, |store| {
            store.postgres_tls_ca_path = ca.map(std::path::Path::to_path_buf)
        });
        (Engine::open_with(config, Arc::new(SystemClock), Faults::default()).unwrap(), dir)
    };
    let (untrusting, _dir) = open(None);
    let error = untrusting.stats()[0].last_error.clone().unwrap_or_default();
    assert_eq!(untrusting.shard_states(), [ShardState::Failed], "{error}");
    assert_eq!(untrusting.reserve_blocking(&tenant(), reserve("k")).unwrap_err().code(), Code::Unavailable);
    let (trusting, _dir) = open(Some(&pki.ca));
    assert_eq!(trusting.shard_states(), [ShardState::Serving], "{:?}", trusting.stats()[0].last_error);
    assert!(matches!(
        trusting.reserve_blocking(&tenant(), reserve("k")).unwrap().reply,
        ReserveReply::Granted { .. }
    ));
}

/// A database made at schema version 1 derived keys as `base:bucket`; upgraded, it keeps
/// that format (a retry must find the key its first attempt stored under an older node)
/// and refuses the bucket grace. A new database derives `base::bucket`.
#[test]
fn a_database_from_schema_version_1_keeps_its_derived_key_format() {
    let Some(cluster) = shared() else { return };
    let url = cluster.database("schema_v1");
    let dir = tempfile::tempdir().unwrap();
    let time: Arc<dyn Clock> = Arc::new(ManualClock::new(T0));
    let parts = |grace_ms| oncegate_engine::ReserveRequest {
        namespace: "live".into(),
        key_parts: vec!["trade".into(), "BTCUSDT".into()],
        bucket_ms: 60_000,
        bucket_grace_ms: grace_ms,
        ..Default::default()
    };
    let engine = node(dir.path(), &url, PgClock::Engine, Arc::clone(&time));
    let made = engine.reserve_blocking(&tenant(), parts(0)).unwrap();
    assert_eq!(made.key.as_str(), format!("trade:BTCUSDT::{}", T0 / 60_000));
    drop(engine);

    // What a version-1 database looks like: no format recorded.
    sql(&url, "ALTER TABLE oncegate_schema DROP COLUMN derived_keys; UPDATE oncegate_schema SET version = 1");
    let engine = node(dir.path(), &url, PgClock::Engine, time);
    let old = engine.reserve_blocking(&tenant(), parts(0)).unwrap();
    assert_eq!(old.key.as_str(), format!("trade:BTCUSDT:{}", T0 / 60_000));
    let refused = engine.reserve_blocking(&tenant(), parts(1_000)).unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.to_string().contains("bucket_grace_ms"), "{refused}");
}

const BUCKET_MS: u64 = 60_000;
/// The first bucket boundary after `T0`.
const BOUNDARY: u64 = (T0 / BUCKET_MS + 1) * BUCKET_MS;

/// A buy of `symbol` as a derived key of one-minute buckets with a two-second grace.
fn trade(symbol: &str) -> oncegate_engine::ReserveRequest {
    oncegate_engine::ReserveRequest {
        namespace: "live".into(),
        key_parts: vec!["trade".into(), symbol.into(), "buy".into()],
        bucket_ms: BUCKET_MS,
        bucket_grace_ms: 2_000,
        lease_ms: 30_000,
        ..Default::default()
    }
}

/// Nodes whose clocks sit either side of a bucket boundary derive one key for one trade:
/// the bucket comes from the transaction's time, which never runs below a time another
/// node decided by. Node B (just past the boundary) places the trade; node A (just before
/// it, by its own clock) is told it is in progress on B's key, not granted a key of its
/// own bucket. (Deriving by each node's clock before the transaction gave two grants.)
#[test]
fn nodes_either_side_of_a_bucket_boundary_derive_one_key() {
    let (time_a, time_b) = (ManualClock::new(BOUNDARY - 100), ManualClock::new(BOUNDARY + 100));
    let Some(nodes) = pair("boundary", PgClock::Engine, Arc::new(time_a), Arc::new(time_b)) else { return };
    let trade = trade("BTCUSDT");
    let on_b = nodes.b.reserve_blocking(&tenant(), trade.clone()).unwrap();
    assert_eq!(on_b.key.as_str(), format!("trade:BTCUSDT:buy::{}", BOUNDARY / BUCKET_MS));
    granted(&on_b.reply);
    let on_a = nodes.a.reserve_blocking(&tenant(), trade).unwrap();
    assert_eq!(on_a.key, on_b.key);
    assert!(matches!(on_a.reply, ReserveReply::InProgress { .. }), "{:?}", on_a.reply);
}

/// A node whose clock is years from the database's locks a derived reserve's buckets by
/// its own time moved by how far ahead the store was at its last transaction. A batch
/// whose transaction could not begin (here its clock statement outwaited the statement
/// timeout behind an operator's lock) set that distance to 0, and the first derived
/// reserve after the shard reopened was refused `unavailable`, its buckets locked years
/// away from the database's time.
#[test]
fn a_transaction_that_could_not_begin_keeps_the_store_s_distance() {
    let Some(cluster) = shared() else { return };
    let url = cluster.database("distance");
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig {
        reopen_backoff_ms_min: 10,
        reopen_backoff_ms_max: 10,
        ..one_shard(dir.path(), &url, |store| store.postgres_statement_timeout_ms = 200)
    };
    let engine = Engine::open_with(config, Arc::new(ManualClock::new(T0)), Faults::default()).unwrap();
    granted(&engine.reserve_blocking(&tenant(), reserve("learns-the-distance")).unwrap().reply);
    granted(&engine.reserve_blocking(&tenant(), trade("BTCUSDT")).unwrap().reply);
    let failed = block_on(async {
        let (operator, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        operator.batch_execute("BEGIN; LOCK TABLE oncegate_clock IN ACCESS EXCLUSIVE MODE").await.unwrap();
        let engine = engine.clone();
        let failed =
            tokio::task::spawn_blocking(move || engine.reserve_blocking(&tenant(), reserve("refused")));
        let failed = failed.await.unwrap();
        operator.batch_execute("COMMIT").await.unwrap();
        failed
    });
    assert_eq!(failed.unwrap_err().code(), Code::Unavailable);
    assert!(engine.wait_shard_state(0, ShardState::Serving, WAIT), "{:?}", engine.stats()[0].last_error);
    let after = engine.reserve_blocking(&tenant(), trade("ETHUSDT"));
    granted(&after.unwrap_or_else(|e| panic!("the derived reserve after the failure: {e}")).reply);
}

/// The same, raced: in each round (a fresh database, so no mark is left from the one
/// before) a node just before a boundary and a node just after it reserve one trade at
/// once. Whichever order the database serialises them in, exactly one is granted and
/// both name the same key.
#[test]
fn a_trade_raced_across_a_bucket_boundary_on_two_nodes_is_granted_once() {
    let trade = trade("ETHUSDT");
    for round in 0..8 {
        let (before, after) = (ManualClock::new(BOUNDARY - 100), ManualClock::new(BOUNDARY + 100));
        let name = format!("straddle{round}");
        let Some(nodes) = pair(&name, PgClock::Engine, Arc::new(before), Arc::new(after)) else { return };
        let barrier = std::sync::Barrier::new(2);
        let answers: Vec<_> = std::thread::scope(|s| {
            let racers: Vec<_> = [&nodes.a, &nodes.b]
                .into_iter()
                .map(|node| {
                    let (barrier, trade) = (&barrier, trade.clone());
                    s.spawn(move || {
                        barrier.wait();
                        node.reserve_blocking(&tenant(), trade).unwrap()
                    })
                })
                .collect();
            racers.into_iter().map(|r| r.join().unwrap()).collect()
        });
        let grants = answers.iter().filter(|a| matches!(a.reply, ReserveReply::Granted { .. })).count();
        assert_eq!(grants, 1, "round {round}: {answers:?}");
        assert_eq!(answers[0].key, answers[1].key, "round {round}");
    }
}
