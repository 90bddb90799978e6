//! `once` through a real server (in process, on port 0, on the system clock unless a
//! test drives a manual one): a race of 64 callers runs the work once, a long work keeps
//! its lease by heartbeats, a work that panics or whose future is dropped gives the key
//! back, and a retry across a bucket boundary within the grace replays.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use std::future::Future;

use oncegate_client::{
    Client, CommitRequest, Gate, GateExt, KeyRequest, OnCancel, OnceError, OnceOptions, Ran, Renewed, Replay,
    ReserveRequest, Reserved, Transport, WorkError,
};
use oncegate_core::Previous;
use oncegate_core::State;
use oncegate_engine::TenantGate;
use oncegate_engine::{Engine, EngineConfig};
use oncegate_server::{Config, Listeners};

struct Server {
    url: String,
    _stop: tokio::sync::oneshot::Sender<()>,
    _dir: tempfile::TempDir,
}

async fn server() -> Server {
    server_on(Arc::new(oncegate_engine::SystemClock)).await
}

/// A server whose engine reads `clock`.
async fn server_on(clock: Arc<dyn oncegate_engine::Clock>) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        engine: EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() },
        ..Config::default()
    };
    let engine = Engine::open_with(config.engine_config(), clock, Default::default()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let listeners = Listeners { gate: listener, metrics: None };
        let _ = oncegate_server::serve(engine, &config, listeners, async {
            let _ = stopped.await;
        })
        .await;
    });
    Server { url, _stop: stop, _dir: dir }
}

fn waiting() -> OnceOptions {
    OnceOptions { wait: Duration::from_secs(20), ..OnceOptions::default() }
}

/// A cancelled or panicking work releases its key at once.
fn releasing() -> OnceOptions {
    OnceOptions { on_cancel: OnCancel::Release, ..OnceOptions::default() }
}

/// 64 callers race for one key, sharing one client (so one session stream, or one
/// connection of unary calls); the work runs once.
async fn race(transport: Transport) {
    let server = server().await;
    let client = Client::builder(server.url.clone()).transport(transport).connect().await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let callers: Vec<_> = (0..64)
        .map(|_| {
            let (client, runs, barrier) = (client.clone(), Arc::clone(&runs), Arc::clone(&barrier));
            tokio::spawn(async move {
                barrier.wait().await;
                client
                    .once("live", "order-1", waiting(), |_| async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Ok::<_, WorkError<()>>(b"filled".to_vec())
                    })
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut now = 0;
    for caller in callers {
        match caller.await.unwrap() {
            Ran::Now(response) => {
                assert_eq!(response, b"filled");
                now += 1;
            }
            Ran::Replayed(Replay::Succeeded(stored)) => assert_eq!(stored.response, b"filled"),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((runs.load(Ordering::SeqCst), now), (1, 1), "the work ran exactly once ({transport:?})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_callers_of_one_key_on_a_session_run_the_work_once() {
    race(Transport::Session).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_callers_of_one_key_on_unary_calls_run_the_work_once() {
    race(Transport::Unary).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_work_longer_than_its_lease_keeps_it_by_heartbeats() {
    let server = server().await;
    let client = Client::connect(server.url.clone()).await.unwrap();
    let other = client.clone();
    // A second lease: each heartbeat (every third of it, a real fsync on a shared 2-core
    // machine) has a good half second to land before the lease would end.
    let options = OnceOptions { lease: Some(Duration::from_millis(1_000)), ..OnceOptions::default() };
    let ran = client
        .once("live", "slow", options, |lease| async move {
            // Three leases long; meanwhile nobody else may take the key.
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_millis(1_000)).await;
                let view = other.get(KeyRequest {
                    namespace: "live".into(),
                    key: "slow".into(),
                    ..Default::default()
                });
                let view = view.await.unwrap();
                assert_eq!(
                    (view.state, view.token),
                    (State::Pending, lease.token),
                    "still held by this attempt"
                );
            }
            Ok::<_, WorkError<()>>(b"done".to_vec())
        })
        .await
        .unwrap();
    assert_eq!(ran, Ran::Now(b"done".to_vec()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_work_that_panics_gives_the_key_back_when_asked_to_release_it() {
    let server = server().await;
    let client = Client::connect(server.url.clone()).await.unwrap();
    let panicking = client.clone();
    let attempt = tokio::spawn(async move {
        panicking
            .once("live", "k", releasing(), |_| async {
                panic!("the work broke");
                #[allow(unreachable_code)]
                Ok::<_, WorkError<()>>(Vec::new())
            })
            .await
    });
    assert!(attempt.await.unwrap_err().is_panic());
    // The next attempt waits for the key and is granted once the release lands.
    let ran =
        client.once("live", "k", waiting(), |_| async { Ok::<_, WorkError<()>>(b"second".to_vec()) }).await;
    assert_eq!(ran.unwrap(), Ran::Now(b"second".to_vec()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_future_gives_the_key_back_when_asked_to_release_it() {
    let server = server().await;
    let client = Client::connect(server.url.clone()).await.unwrap();
    let (started, running) = tokio::sync::oneshot::channel();
    let dropped = client.clone();
    let attempt = tokio::spawn(async move {
        dropped
            .once("live", "k", releasing(), |_| async move {
                let _ = started.send(());
                std::future::pending::<Result<Vec<u8>, WorkError<()>>>().await
            })
            .await
    });
    running.await.unwrap();
    attempt.abort();
    assert!(attempt.await.unwrap_err().is_cancelled());
    let ran =
        client.once("live", "k", waiting(), |_| async { Ok::<_, WorkError<()>>(b"second".to_vec()) }).await;
    assert_eq!(ran.unwrap(), Ran::Now(b"second".to_vec()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retryable_failure_releases_and_a_final_one_is_replayed() {
    let server = server().await;
    let client = Client::connect(server.url.clone()).await.unwrap();
    let failed =
        client.once("live", "k", OnceOptions::default(), |_| async { Err(WorkError::Retryable("timeout")) });
    assert!(matches!(failed.await, Err(OnceError::Retryable("timeout"))));
    let refused = client.once("live", "k", OnceOptions::default(), |_| async {
        Err(WorkError::Final { error: "rejected", response: b"insufficient funds".to_vec() })
    });
    assert!(matches!(refused.await, Err(OnceError::Failed { error: "rejected", .. })));
    let retry =
        client.once("live", "k", OnceOptions::default(), |_| async { Ok::<_, WorkError<()>>(Vec::new()) });
    match retry.await.unwrap() {
        Ran::Replayed(Replay::Failed(stored)) => assert_eq!(stored.response, b"insufficient funds"),
        other => panic!("a stored failure replays as one: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_work_leaves_its_key_to_lapse_by_default_so_the_next_attempt_is_told() {
    let server = server().await;
    let client = Client::connect(server.url.clone()).await.unwrap();
    let (started, running) = tokio::sync::oneshot::channel();
    // The default: releasing would let the next attempt run unaware of the first.
    let keeping = OnceOptions { lease: Some(Duration::from_millis(300)), ..OnceOptions::default() };
    let dropped = client.clone();
    let attempt = tokio::spawn(async move {
        dropped
            .once("live", "k", keeping, |_| async move {
                let _ = started.send(());
                // The side effect may have happened here when the caller goes away.
                std::future::pending::<Result<Vec<u8>, WorkError<()>>>().await
            })
            .await
    });
    running.await.unwrap();
    attempt.abort();
    let _ = attempt.await;
    let next = client
        .once("live", "k", waiting(), |lease| async move {
            assert_eq!(
                (lease.attempt, lease.previous),
                (2, Previous::Abandoned),
                "told to check the first attempt"
            );
            Ok::<_, WorkError<()>>(b"checked, then done".to_vec())
        })
        .await;
    assert_eq!(next.unwrap(), Ran::Now(b"checked, then done".to_vec()));
}

/// A gate whose heartbeats never get through (the engine in process, for every other call).
#[derive(Clone)]
struct Unreachable(TenantGate);

impl Gate for Unreachable {
    type Error = oncegate_engine::Error;

    fn reserve(&self, r: ReserveRequest) -> impl Future<Output = Result<Reserved, Self::Error>> + Send {
        self.0.reserve(r)
    }
    fn commit(&self, r: CommitRequest) -> impl Future<Output = Result<u64, Self::Error>> + Send {
        self.0.commit(r)
    }
    fn release(&self, r: KeyRequest) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.0.release(r)
    }
    fn heartbeat(&self, _: KeyRequest) -> impl Future<Output = Result<Renewed, Self::Error>> + Send {
        std::future::ready(Err(oncegate_engine::Error::Unavailable {
            shard: 0,
            reason: "unreachable".into(),
        }))
    }
    fn get(&self, r: KeyRequest) -> impl Future<Output = Result<oncegate_core::View, Self::Error>> + Send {
        self.0.get(r)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_not_renewed_in_time_cancels_the_work_as_lease_lost() {
    let dir = tempfile::tempdir().unwrap();
    let engine =
        Engine::open(EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() }).unwrap();
    let gate = Unreachable(engine.gate(oncegate_core::Tenant::default_tenant()));
    let options = OnceOptions { lease: Some(Duration::from_millis(200)), ..OnceOptions::default() };
    // Work that left the future (a blocking SDK) hears of the loss through the token.
    let (told, heard) = tokio::sync::oneshot::channel();
    let ran = gate
        .once("live", "k", options, |lease| async move {
            let lost = lease.lost.clone();
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
                runtime.block_on(lost.cancelled());
                let _ = told.send(());
            });
            std::future::pending::<Result<Vec<u8>, WorkError<()>>>().await
        })
        .await;
    assert!(matches!(ran, Err(OnceError::LeaseLost { .. })), "{ran:?}");
    heard.await.expect("the blocking work was told its lease was lost");
    engine.shutdown();
}

/// Another attempt still holding the key when the wait runs out is an error, never an
/// `Ok` a handler could take for success; waiting is what `once` does by default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_still_in_progress_when_the_wait_ends_is_an_error() {
    let server = server().await;
    let client = Client::connect(server.url.clone()).await.unwrap();
    assert_eq!(OnceOptions::default().wait, Duration::from_secs(30), "waiting is the default");
    let holder =
        client.reserve(ReserveRequest { namespace: "live".into(), key: "k".into(), ..Default::default() });
    assert!(holder.await.unwrap().granted_token().is_some());
    let impatient = OnceOptions { wait: Duration::ZERO, ..OnceOptions::default() };
    let ran = client.once("live", "k", impatient, |_| async { Ok::<_, WorkError<()>>(Vec::new()) }).await;
    let Err(error) = ran else { panic!("{ran:?}") };
    assert!(matches!(error, OnceError::InProgress { retry_after_ms } if retry_after_ms > 0), "{error:?}");
    assert!(error.is_retryable() && error.code() == "in_progress", "{error:?}");
}

/// Without a lease of its own, `once` runs under the server's `lease_ms_default` (the
/// grant says how long it is), and heartbeats by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unset_lease_is_the_server_s_default() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() };
    config.limits.lease_ms_default = 600;
    let engine = Engine::open(config).unwrap();
    let gate = engine.gate(oncegate_core::Tenant::default_tenant());
    let ran = gate
        .once("live", "k", OnceOptions::default(), |lease| async move {
            let left = lease.valid_until().saturating_duration_since(tokio::time::Instant::now());
            assert!(
                left <= Duration::from_millis(600),
                "the lease is the server's 600 ms, not 30 s: {left:?}"
            );
            Ok::<_, WorkError<()>>(b"done".to_vec())
        })
        .await;
    assert_eq!(ran.unwrap(), Ran::Now(b"done".to_vec()));
    engine.shutdown();
}

/// A gate whose grants arrive late: each reserve waits `delay` before it is sent.
#[derive(Clone)]
struct LateGrant(TenantGate, Duration);

impl Gate for LateGrant {
    type Error = oncegate_engine::Error;

    fn reserve(&self, r: ReserveRequest) -> impl Future<Output = Result<Reserved, Self::Error>> + Send {
        let (gate, delay) = (self.0.clone(), self.1);
        async move {
            tokio::time::sleep(delay).await;
            gate.reserve(r).await
        }
    }
    fn commit(&self, r: CommitRequest) -> impl Future<Output = Result<u64, Self::Error>> + Send {
        self.0.commit(r)
    }
    fn release(&self, r: KeyRequest) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.0.release(r)
    }
    fn heartbeat(&self, r: KeyRequest) -> impl Future<Output = Result<Renewed, Self::Error>> + Send {
        self.0.heartbeat(r)
    }
    fn get(&self, r: KeyRequest) -> impl Future<Output = Result<oncegate_core::View, Self::Error>> + Send {
        self.0.get(r)
    }
}

/// A grant that arrives three quarters of a lease after its reserve was sent (a wait, or
/// retries) is renewed at once. Its first beat was due a third of a lease after the grant
/// arrived, past the end of the lease as this client counts it from the sending, so the
/// work was cut at that end, half a second in, before any beat was tried: `lease_lost`
/// for a work that may have done its side effect, and the next attempt would run it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_arrives_late_is_renewed_before_its_lease_ends() {
    let dir = tempfile::tempdir().unwrap();
    let engine =
        Engine::open(EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() }).unwrap();
    let gate = LateGrant(engine.gate(oncegate_core::Tenant::default_tenant()), Duration::from_millis(1_500));
    let options = OnceOptions { lease: Some(Duration::from_millis(2_000)), ..OnceOptions::default() };
    let ran = gate
        .once("live", "late", options, |_| async {
            tokio::time::sleep(Duration::from_millis(1_000)).await;
            Ok::<_, WorkError<()>>(b"done".to_vec())
        })
        .await;
    assert_eq!(ran.unwrap(), Ran::Now(b"done".to_vec()));
    engine.shutdown();
}

/// A grant that arrives after its whole lease by this client's count (its reserve
/// waited longer than the lease) is renewed before its work starts. It was given up at
/// once as `lease_lost`, the work never run and the key left held for a lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_arrives_after_its_lease_is_renewed_before_the_work_starts() {
    let dir = tempfile::tempdir().unwrap();
    let engine =
        Engine::open(EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() }).unwrap();
    let gate = LateGrant(engine.gate(oncegate_core::Tenant::default_tenant()), Duration::from_millis(1_200));
    let options = OnceOptions { lease: Some(Duration::from_millis(1_000)), ..OnceOptions::default() };
    let ran = gate
        .once("live", "later", options, |_| async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok::<_, WorkError<()>>(b"done".to_vec())
        })
        .await;
    assert_eq!(ran.unwrap(), Ran::Now(b"done".to_vec()));
    engine.shutdown();
}

/// Far more calls at once on one session stream than the server takes in flight (256 by
/// default) and than the client queues (1,024): every one is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_calls_at_once_on_one_session_are_all_answered() {
    let server = server().await;
    let client = Client::connect(server.url.clone()).await.unwrap();
    let calls: Vec<_> = (0..3_000)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move {
                let key =
                    KeyRequest { namespace: "live".into(), key: format!("k{i}"), ..KeyRequest::default() };
                client.get(key).await.map(|view| view.state)
            })
        })
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap(), State::Free);
    }
}

/// A trade sent just before a minute boundary, retried just after it: within the bucket
/// grace the retry replays the first answer instead of placing the order again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_across_a_bucket_boundary_within_the_grace_replays() {
    const MINUTE_MS: u64 = 60_000;
    let boundary = (1_700_000_000_000 / MINUTE_MS + 1) * MINUTE_MS;
    let clock = oncegate_engine::ManualClock::new(boundary - 100);
    let server = server_on(Arc::new(clock.clone())).await;
    let client = Client::connect(server.url.clone()).await.unwrap();
    let trade = oncegate_client::keys::TradeKey {
        exchange: "binance".into(),
        symbol: "BTCUSDT".into(),
        action: "buy".into(),
        qty: "0.5".into(),
        live: true,
        bucket_ms: MINUTE_MS,
        bucket_grace_ms: 2_000,
    };
    let runs = Arc::new(AtomicUsize::new(0));
    // Places the trade through `once`: the work counts the orders actually placed.
    let place = || {
        let runs = Arc::clone(&runs);
        let work = move |_lease: oncegate_client::Lease| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, WorkError<()>>(b"order 7781 filled".to_vec())
        };
        let options = OnceOptions { on_cancel: OnCancel::Release, ..OnceOptions::default() };
        client.once("live", &trade, options, work)
    };
    assert_eq!(place().await.unwrap(), Ran::Now(b"order 7781 filled".to_vec()));
    clock.advance(200);
    let retry = place().await.unwrap();
    let Ran::Replayed(Replay::Succeeded(stored)) = retry else { panic!("expected a replay, got {retry:?}") };
    assert_eq!(stored.response, b"order 7781 filled");
    let first_bucket = (boundary - 100) / MINUTE_MS;
    assert_eq!(
        stored.key,
        format!("trade:binance:BTCUSDT:buy:0.5:live::{first_bucket}"),
        "the earlier bucket answered"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the order was placed once");
    // Past the grace the same trade is a new order.
    clock.advance(2_000);
    let next = place().await.unwrap();
    assert!(matches!(next, Ran::Now(_)), "{next:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A client whose calls may take as long as they like still calls over the session: the
/// time a call has left is computed without overflowing (adding `Duration::MAX` to the
/// present instant panicked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_client_without_a_deadline_to_speak_of_still_calls() {
    let server = server().await;
    let client = Client::builder(server.url.clone())
        .transport(Transport::Session)
        .timeout(Duration::MAX)
        .connect()
        .await
        .unwrap();
    let request =
        ReserveRequest { namespace: "live".into(), key: "unbounded".into(), ..ReserveRequest::default() };
    let reserved = client.reserve(request).await.expect("answered");
    assert!(matches!(reserved.reply, oncegate_core::ReserveReply::Granted { .. }), "{reserved:?}");
}

/// The embedded engine or a remote server, chosen at run time behind one type: `once`
/// runs the same on `Arc<dyn DynGate>` of either, and on a borrowed or shared gate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_chosen_at_run_time_runs_once() {
    use oncegate_client::DynGate;
    let server = server().await;
    let dir = tempfile::tempdir().unwrap();
    let engine =
        Engine::open(EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() }).unwrap();
    let remote: Arc<dyn DynGate> = Arc::new(Client::connect(server.url.clone()).await.unwrap());
    let embedded: Arc<dyn DynGate> = Arc::new(engine.gate(oncegate_core::Tenant::default_tenant()));
    for gate in [remote, embedded] {
        for expected in [Ran::Now(b"ran".to_vec()), Ran::Now(Vec::new())] {
            let ran = gate
                .once("live", "k", OnceOptions::default(), |_| async {
                    Ok::<_, WorkError<()>>(b"ran".to_vec())
                })
                .await
                .unwrap();
            match (ran, expected) {
                (Ran::Now(response), Ran::Now(want)) if !want.is_empty() => assert_eq!(response, want),
                (Ran::Replayed(Replay::Succeeded(stored)), _) => assert_eq!(stored.response, b"ran"),
                (other, _) => panic!("{other:?}"),
            }
        }
    }
    // A shared gate is a gate too.
    let shared = Arc::new(engine.gate(oncegate_core::Tenant::default_tenant()));
    let ran =
        shared.once("live", "k2", OnceOptions::default(), |_| async { Ok::<_, WorkError<()>>(vec![1]) });
    assert_eq!(ran.await.unwrap(), Ran::Now(vec![1]));
    engine.shutdown();
}

/// An async program opens and closes the engine with `open_async` and `close` (their
/// waits on threads of their own), and can log it.
#[tokio::test(flavor = "current_thread")]
async fn an_engine_opens_and_closes_from_async_code() {
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() };
    let engine = Engine::open_async(config).await.unwrap();
    let shown = format!("{engine:?}");
    assert!(shown.contains("serving") && shown.contains("sqlite"), "{shown}");
    let gate = engine.gate(oncegate_core::Tenant::default_tenant());
    let ran = gate.once("live", "k", OnceOptions::default(), |_| async { Ok::<_, WorkError<()>>(vec![7]) });
    assert_eq!(ran.await.unwrap(), Ran::Now(vec![7]));
    engine.close().await;
    drop((gate, engine));
    let reopened =
        Engine::open_async(EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() });
    let reopened = reopened.await.expect("closed and dropped: the directory's lock was given back");
    reopened.close().await;
}

/// A caller that gives up (drops `once`) fences its work off: work that left the future
/// hears the lease is lost at once, before another attempt may run, whatever `on_cancel`
/// does with the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_once_tells_its_work_the_lease_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let engine =
        Engine::open(EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() }).unwrap();
    let gate = engine.gate(oncegate_core::Tenant::default_tenant());
    for on_cancel in [OnCancel::Release, OnCancel::KeepUntilLeaseEnds] {
        let (started, running) = tokio::sync::oneshot::channel();
        let gate = gate.clone();
        let attempt = tokio::spawn(async move {
            let options = OnceOptions { on_cancel, ..OnceOptions::default() };
            gate.once("live", format!("k-{on_cancel:?}"), options, |lease| async move {
                // What work on a thread of its own (a blocking SDK) would watch.
                let _ = started.send(lease.lost.clone());
                std::future::pending::<Result<Vec<u8>, WorkError<()>>>().await
            })
            .await
        });
        let lost = running.await.unwrap();
        assert!(!lost.is_cancelled(), "the lease holds while the work runs");
        attempt.abort();
        let _ = attempt.await;
        assert!(lost.is_cancelled(), "told as the attempt was dropped ({on_cancel:?})");
    }
    engine.shutdown();
}

/// A server whose `wait_ms_max` is below what `once` asks it to wait refuses the wait;
/// `once` polls instead, rather than failing every call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_waits_less_is_polled() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() };
    config.limits.wait_ms_max = 1_000;
    let engine = Engine::open(config).unwrap();
    let gate = engine.gate(oncegate_core::Tenant::default_tenant());
    let holder =
        ReserveRequest { namespace: "live".into(), key: "k".into(), lease_ms: 300, ..Default::default() };
    assert!(gate.reserve(holder).await.unwrap().granted_token().is_some());
    let ran = gate
        .once("live", "k", OnceOptions::default(), |lease| async move {
            assert_eq!(lease.previous, Previous::Abandoned, "granted once the holder's lease ended");
            Ok::<_, WorkError<()>>(b"done".to_vec())
        })
        .await;
    assert_eq!(ran.unwrap(), Ran::Now(b"done".to_vec()));
    engine.shutdown();
}

/// A gate whose grants do not say their lease's length (a server older than the field),
/// noting the leases its heartbeats ask for.
#[derive(Clone)]
struct OldGrants(TenantGate, Arc<std::sync::Mutex<Vec<u64>>>);

impl Gate for OldGrants {
    type Error = oncegate_engine::Error;

    fn reserve(&self, r: ReserveRequest) -> impl Future<Output = Result<Reserved, Self::Error>> + Send {
        let gate = self.0.clone();
        async move {
            let mut reserved = gate.reserve(r).await?;
            if let oncegate_core::ReserveReply::Granted { lease_ms, .. } = &mut reserved.reply {
                *lease_ms = 0;
            }
            Ok(reserved)
        }
    }
    fn commit(&self, r: CommitRequest) -> impl Future<Output = Result<u64, Self::Error>> + Send {
        self.0.commit(r)
    }
    fn release(&self, r: KeyRequest) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.0.release(r)
    }
    fn heartbeat(&self, r: KeyRequest) -> impl Future<Output = Result<Renewed, Self::Error>> + Send {
        self.1.lock().unwrap().push(r.lease_ms);
        self.0.heartbeat(r)
    }
    fn get(&self, r: KeyRequest) -> impl Future<Output = Result<oncegate_core::View, Self::Error>> + Send {
        self.0.get(r)
    }
}

/// Asked for the server's default by a grant that does not say how long it is, `once`
/// never assumes a length: it renews the lease with a known one before the work runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_of_unknown_length_is_renewed_before_the_work() {
    let dir = tempfile::tempdir().unwrap();
    let engine =
        Engine::open(EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() }).unwrap();
    let beats = Arc::new(std::sync::Mutex::new(Vec::new()));
    let gate = OldGrants(engine.gate(oncegate_core::Tenant::default_tenant()), Arc::clone(&beats));
    let seen = Arc::clone(&beats);
    let ran = gate
        .once("live", "k", OnceOptions::default(), |_| async move {
            assert_eq!(*seen.lock().unwrap(), [30_000], "renewed for 30 s before the work");
            Ok::<_, WorkError<()>>(vec![1])
        })
        .await;
    assert_eq!(ran.unwrap(), Ran::Now(vec![1]));
    engine.shutdown();
}
