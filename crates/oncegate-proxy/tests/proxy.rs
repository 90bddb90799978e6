//! The proxy between a real client and a real upstream (an in-process axum service that
//! counts its executions), on the engine in process.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderName, Request, StatusCode, header};
use axum::routing::post;
use futures_util::StreamExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use oncegate_core::View;
use oncegate_core::gate::{CommitRequest, Gate, KeyRequest, Renewed, ReserveRequest, Reserved};
use oncegate_engine::{Engine, EngineConfig, TenantGate};
use oncegate_proxy::ProxyConfig;

/// Executions per upstream route, and a signal that the slow one has started.
#[derive(Default)]
struct Counts {
    orders: AtomicUsize,
    flaky: AtomicUsize,
    soft: AtomicUsize,
    slow: AtomicUsize,
    slow_started: tokio::sync::Notify,
    hang: AtomicUsize,
    big: AtomicUsize,
    /// Lets `/stream` send the rest of its answer.
    stream_rest: tokio::sync::Notify,
}

async fn serve(router: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    url
}

/// The service behind the proxy.
async fn upstream(counts: Arc<Counts>) -> String {
    let (orders, flaky, soft) = (Arc::clone(&counts), Arc::clone(&counts), Arc::clone(&counts));
    let slow = Arc::clone(&counts);
    let hang = Arc::clone(&counts);
    let big = Arc::clone(&counts);
    let encoded = Arc::clone(&counts);
    let stream = Arc::clone(&counts);
    let router = axum::Router::new()
        .route(
            "/echo",
            post(|headers: axum::http::HeaderMap| async move {
                let seen = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_owned());
                format!("token={:?} previous={:?}", seen("oncegate-token"), seen("oncegate-previous"))
            }),
        )
        .route(
            "/linked",
            post(|| async {
                let mut headers = axum::http::HeaderMap::new();
                headers.append(header::LINK, "</orders/77>; rel=\"self\"".parse().unwrap());
                headers.append(header::LINK, "</orders>; rel=\"collection\"".parse().unwrap());
                headers.append(header::SET_COOKIE, "session=first-caller".parse().unwrap());
                (StatusCode::CREATED, headers, "linked")
            }),
        )
        .route(
            "/big",
            post(move || async move {
                big.big.fetch_add(1, Ordering::SeqCst);
                "b".repeat(4_000)
            }),
        )
        .route(
            "/stream",
            post(move || async move {
                stream.big.fetch_add(1, Ordering::SeqCst);
                let first = futures_util::stream::once(async {
                    Ok::<_, std::convert::Infallible>(vec![b's'; 1_500])
                });
                let rest = futures_util::stream::once(async move {
                    stream.stream_rest.notified().await;
                    Ok(vec![b't'; 500])
                });
                Body::from_stream(first.chain(rest))
            }),
        )
        .route(
            "/encoded",
            post(move || async move {
                encoded.big.fetch_add(1, Ordering::SeqCst);
                let headers = [(header::CONTENT_ENCODING, "gzip"), (header::LOCATION, "/orders/9")];
                (StatusCode::CREATED, headers, vec![0x1f_u8, 0x8b, 8, 0])
            }),
        )
        .route(
            "/orders",
            post(move || async move {
                let n = orders.orders.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
                let headers = [(header::CONTENT_TYPE, "application/json"), (header::LOCATION, "/orders/77")];
                (StatusCode::CREATED, headers, format!("{{\"order\":\"A-{n}\"}}"))
            }),
        )
        .route(
            "/flaky",
            post(move || async move {
                let n = flaky.flaky.fetch_add(1, Ordering::SeqCst) + 1;
                if n == 1 { (StatusCode::SERVICE_UNAVAILABLE, "busy") } else { (StatusCode::OK, "done") }
            }),
        )
        .route(
            "/slow",
            post(move || async move {
                let n = slow.slow.fetch_add(1, Ordering::SeqCst) + 1;
                slow.slow_started.notify_one();
                tokio::time::sleep(Duration::from_millis(200)).await;
                (StatusCode::CREATED, format!("slow run {n}"))
            }),
        )
        .route(
            "/hang",
            post(move || async move {
                hang.hang.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(5)).await;
                "too late"
            }),
        )
        .route(
            "/stall",
            axum::routing::get(|| async {
                // One chunk, then nothing, for ever: an upstream that stalls mid-body.
                let first = futures_util::stream::once(async { Ok::<_, std::io::Error>("first chunk") });
                Body::from_stream(first.chain(futures_util::stream::pending()))
            }),
        )
        .route(
            "/soft",
            post(move || async move {
                let n = soft.soft.fetch_add(1, Ordering::SeqCst) + 1;
                format!("{{\"success\":{}}}", n > 1)
            }),
        );
    serve(echo_trace(listener_routes(router))).await
}

/// `/endless` answers in 64 KiB chunks for as long as its caller takes them, and `/hello`
/// at once: the listener's tests.
fn listener_routes(router: axum::Router) -> axum::Router {
    router
        .route(
            "/endless",
            axum::routing::get(|| async {
                let chunk = axum::body::Bytes::from(vec![b'x'; 64 << 10]);
                Body::from_stream(futures_util::stream::repeat_with(move || {
                    Ok::<_, std::io::Error>(chunk.clone())
                }))
            }),
        )
        .route("/hello", axum::routing::get(|| async { "hello" }))
}

/// `/trace` answers with the `traceparent` the upstream received.
fn echo_trace(router: axum::Router) -> axum::Router {
    router.route(
        "/trace",
        post(|headers: axum::http::HeaderMap| async move {
            headers.get("traceparent").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default()
        }),
    )
}

struct Setup {
    proxy: String,
    counts: Arc<Counts>,
    http: Client<HttpConnector, Body>,
    _engine: Engine,
    _dir: tempfile::TempDir,
}

async fn setup(edit: impl FnOnce(&mut ProxyConfig)) -> Setup {
    setup_on(edit, |_| {}, |gate| gate).await
}

/// [`setup`] with the engine's configuration edited too, and the proxy on `wrap` of the
/// engine's gate.
async fn setup_on<G: Gate + Clone + 'static>(
    edit: impl FnOnce(&mut ProxyConfig),
    edit_engine: impl FnOnce(&mut EngineConfig),
    wrap: impl FnOnce(TenantGate) -> G,
) -> Setup {
    let counts = Arc::new(Counts::default());
    let dir = tempfile::tempdir().unwrap();
    let mut engine_config = EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() };
    edit_engine(&mut engine_config);
    let engine = Engine::open(engine_config).unwrap();
    let mut config = ProxyConfig { upstream: upstream(Arc::clone(&counts)).await, ..ProxyConfig::default() };
    config.soft_failure = Some(("/success".to_owned(), serde_json::Value::Bool(false)));
    // Most tests send no credential; the rule for callers without one has its own test.
    config.anonymous_callers_share_keys = true;
    edit(&mut config);
    let proxy =
        serve(oncegate_proxy::router(wrap(engine.gate(oncegate_core::Tenant::default_tenant())), config))
            .await;
    let http = Client::builder(TokioExecutor::new()).build_http();
    Setup { proxy, counts, http, _engine: engine, _dir: dir }
}

/// An answer: status, the replay marker, the body.
type Answer = (StatusCode, Option<String>, Vec<u8>);

impl Setup {
    async fn post(&self, path: &str, key: Option<&str>, body: &str) -> Answer {
        self.post_as(path, key, body, None).await
    }

    async fn post_as(&self, path: &str, key: Option<&str>, body: &str, credential: Option<&str>) -> Answer {
        let credential = credential.map(|c| ("authorization", c));
        let (answer, _) = self.post_with(path, key, body, credential.as_slice()).await;
        answer
    }

    /// A `POST` with more headers; the answer and its headers.
    async fn post_with(
        &self,
        path: &str,
        key: Option<&str>,
        body: &str,
        headers: &[(&str, &str)],
    ) -> (Answer, axum::http::HeaderMap) {
        let mut request =
            Request::post(format!("{}{path}", self.proxy)).header(header::CONTENT_TYPE, "application/json");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = self.http.request(request.body(Body::from(body.to_owned())).unwrap()).await.unwrap();
        let (parts, body) = response.into_parts();
        let replayed = parts
            .headers
            .get(HeaderName::from_static("idempotent-replayed"))
            .map(|v| v.to_str().unwrap().to_owned());
        let body = axum::body::to_bytes(Body::new(body), 1 << 20).await.unwrap().to_vec();
        ((parts.status, replayed, body), parts.headers)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_posts_with_one_key_run_upstream_once() {
    let setup = Arc::new(setup(|_| {}).await);
    let posts: Vec<_> = (0..50)
        .map(|_| {
            let setup = Arc::clone(&setup);
            tokio::spawn(async move { setup.post("/orders", Some("order-1"), r#"{"qty":1}"#).await })
        })
        .collect();
    for post in posts {
        let (status, _, body) = post.await.unwrap();
        match status {
            StatusCode::CREATED => assert_eq!(body, br#"{"order":"A-1"}"#),
            StatusCode::CONFLICT => {}
            other => panic!("every caller gets the stored answer or 409, not {other}"),
        }
    }
    assert_eq!(setup.counts.orders.load(Ordering::SeqCst), 1, "the upstream ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_is_replayed_byte_for_byte_and_another_payload_is_refused() {
    let setup = setup(|_| {}).await;
    let first = setup.post("/orders", Some("k"), r#"{"qty":1,"symbol":"BTC"}"#).await;
    assert_eq!((first.0, first.1.as_deref()), (StatusCode::CREATED, None));
    // The same JSON with its keys reordered and spaced is the same payload.
    let retry = setup.post("/orders", Some("k"), r#"{ "symbol": "BTC", "qty": 1 }"#).await;
    assert_eq!(retry, (StatusCode::CREATED, Some("true".to_owned()), first.2.clone()));
    let other = setup.post("/orders", Some("k"), r#"{"qty":2,"symbol":"BTC"}"#).await;
    assert_eq!(other.0, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(String::from_utf8_lossy(&other.2).contains("\"code\":\"mismatch\""), "{other:?}");
    assert_eq!(setup.counts.orders.load(Ordering::SeqCst), 1);
}

/// The engine's gate, but every heartbeat panics: the proxy's task for a request then
/// unwinds while the upstream is still at work.
#[derive(Clone)]
struct PanickingHeartbeats(TenantGate);

impl Gate for PanickingHeartbeats {
    type Error = <TenantGate as Gate>::Error;

    fn reserve(&self, request: ReserveRequest) -> impl Future<Output = Result<Reserved, Self::Error>> + Send {
        self.0.reserve(request)
    }

    fn commit(&self, request: CommitRequest) -> impl Future<Output = Result<u64, Self::Error>> + Send {
        self.0.commit(request)
    }

    fn release(&self, request: KeyRequest) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.0.release(request)
    }

    async fn heartbeat(&self, _: KeyRequest) -> Result<Renewed, Self::Error> {
        panic!("the test's gate fails every heartbeat")
    }

    fn get(&self, request: KeyRequest) -> impl Future<Output = Result<View, Self::Error>> + Send {
        self.0.get(request)
    }
}

/// The engine's gate, but every commit finds its lease gone: the key is released first, as
/// an operator's force-release would, and granted to another attempt.
#[derive(Clone)]
struct LostAtCommit(TenantGate);

impl Gate for LostAtCommit {
    type Error = <TenantGate as Gate>::Error;

    fn reserve(&self, request: ReserveRequest) -> impl Future<Output = Result<Reserved, Self::Error>> + Send {
        self.0.reserve(request)
    }

    async fn commit(&self, request: CommitRequest) -> Result<u64, Self::Error> {
        let (namespace, key) = (request.namespace.clone(), request.key.clone());
        self.0
            .release(KeyRequest {
                namespace: namespace.clone(),
                key: key.clone(),
                token: request.token,
                lease_ms: 0,
            })
            .await?;
        // Another attempt is granted the key meanwhile: the commit is fenced off.
        self.0.reserve(ReserveRequest { namespace, key, ..ReserveRequest::default() }).await?;
        self.0.commit(request).await
    }

    fn release(&self, request: KeyRequest) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.0.release(request)
    }

    fn heartbeat(&self, request: KeyRequest) -> impl Future<Output = Result<Renewed, Self::Error>> + Send {
        self.0.heartbeat(request)
    }

    fn get(&self, request: KeyRequest) -> impl Future<Output = Result<View, Self::Error>> + Send {
        self.0.get(request)
    }
}

/// An answer not stored whole whose lease is lost before its commit still reaches its
/// caller, warned that a retry may run again: it is the only copy. (It was dropped for a
/// `502`; past the bytes read whole, the upstream's answer was lost with it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_not_stored_whole_reaches_its_caller_when_the_lease_is_lost() {
    let setup = setup_on(|c| c.stored_bytes_max = 1_024, |_| {}, LostAtCommit).await;
    let ((status, _, body), headers) = setup.post_with("/big", Some("b"), "{}", &[]).await;
    assert_eq!((status, body.len()), (StatusCode::OK, 4_000));
    let warning = headers[header::WARNING].to_str().unwrap();
    assert!(warning.contains("lease lost before the answer was stored"), "{headers:?}");
}

/// A request whose task fails while the upstream may be running it leaves its key held
/// until the lease ends, as a killed proxy does: a retry in the meantime is told the
/// request is in progress and does not run it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_task_fails_mid_way_keeps_its_key_held() {
    // An 8 s lease (the upstream's 3 s and the margin), so the first heartbeat goes
    // after about 2.7 s, while `/hang` still runs; the retry waits up to 1 s.
    let setup = setup_on(
        |c| {
            c.upstream_timeout_ms = 3_000;
            c.wait_ms = 1_000;
        },
        |_| {},
        PanickingHeartbeats,
    )
    .await;
    assert_eq!(setup.post("/hang", Some("h"), "{}").await.0, StatusCode::BAD_GATEWAY);
    let retry = setup.post("/hang", Some("h"), "{}").await;
    assert_eq!(retry.0, StatusCode::CONFLICT, "{retry:?}");
    assert_eq!(setup.counts.hang.load(Ordering::SeqCst), 1, "the upstream ran it again");
}

/// An answer the gate refuses to store (as a remote gate does whose `response_bytes_max`
/// is below the proxy's `stored_bytes_max`) still reaches the caller, with a warning,
/// rather than a `502` after which the caller's retry would run it again once the lease
/// ended; the key stays held meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_the_gate_cannot_store_is_passed_on_and_its_key_stays_held() {
    let setup = setup_on(|c| c.wait_ms = 0, |e| e.limits.response_bytes_max = 1_024, |gate| gate).await;
    let ((status, _, body), headers) = setup.post_with("/big", Some("b"), "{}", &[]).await;
    assert_eq!((status, body.len()), (StatusCode::OK, 4_000));
    assert!(
        headers.get(header::WARNING).is_some_and(|w| w.to_str().unwrap().contains("may not be stored")),
        "{headers:?}"
    );
    assert_eq!(setup.post("/big", Some("b"), "{}").await.0, StatusCode::CONFLICT);
    assert_eq!(setup.counts.big.load(Ordering::SeqCst), 1);
}

/// A body nested deeper than any parser takes is fingerprinted as bytes: the proxy still
/// serves it (a walk through every level would overflow the stack and take the process
/// down with it), and its retry is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_nested_past_any_parser_is_served_and_replayed() {
    let setup = setup(|_| {}).await;
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let first = setup.post("/orders", Some("deep"), &deep).await;
    assert_eq!(first.0, StatusCode::CREATED);
    assert_eq!(setup.post("/orders", Some("deep"), &deep).await.1.as_deref(), Some("true"));
    assert_eq!(setup.counts.orders.load(Ordering::SeqCst), 1);
}

/// Two payloads whose values trade places are two payloads, even where parsing would read
/// them the same (numbers past a double's precision): the second is refused, not given
/// the first one's stored answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_that_trade_places_are_another_payload_even_past_a_double_precision() {
    let setup = setup(|_| {}).await;
    let first = setup
        .post("/orders", Some("t"), r#"{"from":100000000000000000001,"to":100000000000000000002}"#)
        .await;
    assert_eq!(first.0, StatusCode::CREATED);
    let swapped = setup
        .post("/orders", Some("t"), r#"{"from":100000000000000000002,"to":100000000000000000001}"#)
        .await;
    assert_eq!(swapped.0, StatusCode::UNPROCESSABLE_ENTITY, "{swapped:?}");
    let retry = setup
        .post("/orders", Some("t"), r#"{ "to":100000000000000000002, "from":100000000000000000001 }"#)
        .await;
    assert_eq!(retry, (StatusCode::CREATED, Some("true".to_owned()), first.2));
    assert_eq!(setup.counts.orders.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_5xx_or_soft_failure_releases_the_key_and_the_retry_runs() {
    let setup = setup(|_| {}).await;
    assert_eq!(setup.post("/flaky", Some("f"), "{}").await.0, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(setup.post("/flaky", Some("f"), "{}").await, (StatusCode::OK, None, b"done".to_vec()));
    assert_eq!(setup.counts.flaky.load(Ordering::SeqCst), 2);

    assert_eq!(setup.post("/soft", Some("s"), "{}").await.2, br#"{"success":false}"#);
    assert_eq!(setup.post("/soft", Some("s"), "{}").await.2, br#"{"success":true}"#);
    let replay = setup.post("/soft", Some("s"), "{}").await;
    assert_eq!((replay.1.as_deref(), replay.2.as_slice()), (Some("true"), &br#"{"success":true}"#[..]));
    assert_eq!(setup.counts.soft.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_and_missing_keys_give_problem_documents() {
    let setup = setup(|c| {
        c.body_bytes_max = 64;
        c.key_required_prefixes = vec!["/orders".to_owned()];
    })
    .await;
    let large = setup.post("/orders", Some("big"), &format!("{{\"pad\":\"{}\"}}", "x".repeat(100))).await;
    assert_eq!(large.0, StatusCode::PAYLOAD_TOO_LARGE);
    let long = setup.post("/orders", Some(&"k".repeat(300)), "{}").await;
    assert_eq!(long.0, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&long.2).contains("key_bytes_max"), "{long:?}");
    let missing = setup.post("/orders", None, "{}").await;
    assert_eq!(missing.0, StatusCode::BAD_REQUEST);
    // Without a key and off the required prefixes, a request passes through.
    assert_eq!(setup.post("/flaky", None, "{}").await.0, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(setup.counts.orders.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_request_gets_the_answer_on_its_retry() {
    let setup = Arc::new(setup(|_| {}).await);
    let first = {
        let setup = Arc::clone(&setup);
        tokio::spawn(async move { setup.post("/slow", Some("gone"), "{}").await })
    };
    setup.counts.slow_started.notified().await;
    // The client goes away while the upstream works; its retry must not run it again.
    first.abort();
    let retry = setup.post("/slow", Some("gone"), "{}").await;
    assert_eq!(retry, (StatusCode::CREATED, Some("true".to_owned()), b"slow run 1".to_vec()));
    assert_eq!(setup.counts.slow.load(Ordering::SeqCst), 1, "the upstream ran once");
}

/// An upstream that takes the request and does not answer in time may have run it: the
/// caller hears the outcome is unknown, and the key stays held (a retry is not run again
/// while the lease lasts; the next attempt after it is told the first was abandoned).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_after_sending_keeps_the_key_held() {
    // A second for the upstream to take the request (which `/hang` then never answers):
    // a shorter timeout could end before it reached the upstream on a slow machine.
    let setup = setup(|c| {
        c.upstream_timeout_ms = 1_000;
        c.wait_ms = 0;
    })
    .await;
    let first = setup.post("/hang", Some("h"), "{}").await;
    assert_eq!(first.0, StatusCode::GATEWAY_TIMEOUT);
    assert!(String::from_utf8_lossy(&first.2).contains("Outcome unknown"), "{first:?}");
    assert_eq!(setup.post("/hang", Some("h"), "{}").await.0, StatusCode::CONFLICT, "not run again");
    assert_eq!(setup.counts.hang.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_callers_key_never_answers_another_caller() {
    let setup = setup(|_| {}).await;
    let alice = setup.post_as("/orders", Some("same"), "{}", Some("Bearer alice")).await;
    let bob = setup.post_as("/orders", Some("same"), "{}", Some("Bearer bob")).await;
    assert_eq!((alice.1.as_deref(), bob.1.as_deref()), (None, None), "both ran, neither replayed the other");
    assert_ne!(alice.2, bob.2);
    let again = setup.post_as("/orders", Some("same"), "{}", Some("Bearer alice")).await;
    assert_eq!(again, (StatusCode::CREATED, Some("true".to_owned()), alice.2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_header_scopes_keys_and_is_required() {
    let setup = setup(|c| c.tenant_header = Some(HeaderName::from_static("x-tenant"))).await;
    let acme = setup.post_with("/orders", Some("same"), "{}", &[("x-tenant", "acme")]).await.0;
    let globex = setup.post_with("/orders", Some("same"), "{}", &[("x-tenant", "globex")]).await.0;
    assert_eq!((acme.1.as_deref(), globex.1.as_deref()), (None, None), "each tenant's key is its own");
    let again = setup.post_with("/orders", Some("same"), "{}", &[("x-tenant", "acme")]).await.0;
    assert_eq!(again, (StatusCode::CREATED, Some("true".to_owned()), acme.2));
    let anonymous = setup.post("/orders", Some("same"), "{}").await;
    assert_eq!(anonymous.0, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&anonymous.2).contains("x-tenant"), "{anonymous:?}");
    assert_eq!(setup.counts.orders.load(Ordering::SeqCst), 2);
}

/// `stored_statuses` decides what is replayed (here a `503` too, as Stripe does), and
/// every guarded answer links the published key policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_statuses_and_the_key_policy_link_are_configured() {
    let setup = setup(|c| {
        c.stored_statuses = oncegate_proxy::StoredStatuses::parse(&["2xx".into(), "503".into()]).unwrap();
        c.key_policy_url = Some("<https://example.com/keys>; rel=\"describedby\"".parse().unwrap());
    })
    .await;
    let (first, headers) = setup.post_with("/flaky", Some("f"), "{}", &[]).await;
    assert_eq!(first.0, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers.get(header::LINK).unwrap(), "<https://example.com/keys>; rel=\"describedby\"");
    let retry = setup.post("/flaky", Some("f"), "{}").await;
    assert_eq!(retry, (StatusCode::SERVICE_UNAVAILABLE, Some("true".to_owned()), b"busy".to_vec()));
    assert_eq!(setup.counts.flaky.load(Ordering::SeqCst), 1, "the stored 503 is replayed, not run again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_over_their_limit_give_a_problem_document() {
    let setup = setup(|c| c.headers_bytes_max = 1_024).await;
    let padding = "p".repeat(2_000);
    let ((status, _, body), headers) =
        setup.post_with("/orders", Some("k"), "{}", &[("x-padding", &padding)]).await;
    assert_eq!(status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    assert_eq!(headers.get(header::CONTENT_TYPE).unwrap(), "application/problem+json");
    assert!(String::from_utf8_lossy(&body).contains("headers_bytes_max"));
    assert_eq!(setup.counts.orders.load(Ordering::SeqCst), 0);
}

/// A client cannot speak for the proxy: `oncegate-*` headers it sends are dropped, and the
/// upstream sees only the proxy's own attempt headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempt_headers_come_from_the_proxy_only() {
    let setup = setup(|_| {}).await;
    let forged = [("oncegate-token", "999999999"), ("oncegate-previous", "abandoned")];
    let ((status, _, body), _) = setup.post_with("/echo", Some("e"), "{}", &forged).await;
    assert_eq!(status, StatusCode::OK);
    let body = String::from_utf8(body).unwrap();
    assert!(!body.contains("999999999") && body.contains("previous=None"), "{body}");
    assert!(body.starts_with("token=Some("), "the proxy's own token goes upstream: {body}");
    let ((_, _, unguarded), _) = setup.post_with("/echo", None, "{}", &forged).await;
    assert_eq!(String::from_utf8(unguarded).unwrap(), "token=None previous=None");
}

/// A caller's W3C `traceparent` goes upstream with its request, so the upstream's spans
/// join the caller's trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_s_traceparent_goes_upstream() {
    let setup = setup(|_| {}).await;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let ((status, _, body), _) =
        setup.post_with("/trace", Some("t"), "{}", &[("traceparent", traceparent)]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(String::from_utf8(body).unwrap(), traceparent);
}

/// An answer larger than `stored_bytes_max` goes whole to the caller whose request ran,
/// with a `Warning`, and its key is completed without the body: a retry is answered with
/// the status and stored headers, an empty body and a `Warning` saying why, and never
/// runs upstream again. (The key was released, and a caller that lost the answer ran the
/// request twice.) A stored answer's chosen headers are replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_large_answers_run_once_and_their_retries_get_no_body_and_stored_headers_replay() {
    let setup = setup(|c| c.stored_bytes_max = 1_024).await;
    let ((status, _, body), headers) = setup.post_with("/big", Some("b"), "{}", &[]).await;
    assert_eq!((status, body.len()), (StatusCode::OK, 4_000));
    let warning = |headers: &axum::http::HeaderMap| headers[header::WARNING].to_str().unwrap().to_owned();
    assert!(warning(&headers).contains("a retry is answered without its body"), "{headers:?}");
    let ((status, replayed, body), headers) = setup.post_with("/big", Some("b"), "{}", &[]).await;
    assert_eq!((status, replayed.as_deref(), body.len()), (StatusCode::OK, Some("true"), 0));
    assert!(warning(&headers).contains("bytes to store, over stored_bytes_max (1024)"), "{headers:?}");
    assert_eq!(headers[header::CONTENT_TYPE], "text/plain; charset=utf-8", "stored headers are kept");
    assert_eq!(setup.counts.big.load(Ordering::SeqCst), 1, "the retry did not run again");

    setup.post("/orders", Some("o"), "{}").await;
    let (replay, headers) = setup.post_with("/orders", Some("o"), "{}", &[]).await;
    assert_eq!(replay.1.as_deref(), Some("true"));
    assert_eq!(headers.get(header::LOCATION).unwrap(), "/orders/77");
    assert_eq!(headers.get(header::CONTENT_TYPE).unwrap(), "application/json");
}

/// An answer past the bytes read whole (the larger of `body_bytes_max` and
/// `stored_bytes_max`) goes to its caller as it comes, and an encoded one whole; either
/// key is completed without the body, so a retry never runs again. (Past the bound the
/// caller got a `502` and lost the answer, and the key was held until its lease ended,
/// when a retry ran it again; an encoded answer was stored and replayed without its
/// `Content-Encoding`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_past_the_bound_or_encoded_run_once_and_go_whole_to_their_caller() {
    let setup = setup(|c| {
        c.body_bytes_max = 2_048;
        c.stored_bytes_max = 1_024;
        c.stored_headers = vec![header::CONTENT_TYPE, header::LOCATION, header::CONTENT_ENCODING];
    })
    .await;
    let warning = |headers: &axum::http::HeaderMap| headers[header::WARNING].to_str().unwrap().to_owned();
    let ((status, _, body), headers) = setup.post_with("/big", Some("b"), "{}", &[]).await;
    assert_eq!((status, body.len()), (StatusCode::OK, 4_000), "passed on as it came");
    assert!(warning(&headers).contains("a retry is answered without its body"), "{headers:?}");
    let ((status, replayed, body), headers) = setup.post_with("/big", Some("b"), "{}", &[]).await;
    assert_eq!((status, replayed.as_deref(), body.len()), (StatusCode::OK, Some("true"), 0));
    assert!(warning(&headers).contains("not stored whole: more than 2048 bytes"), "{headers:?}");

    let ((status, _, body), headers) = setup.post_with("/encoded", Some("e"), "{}", &[]).await;
    assert_eq!((status, body), (StatusCode::CREATED, vec![0x1f, 0x8b, 8, 0]), "passed on whole");
    assert_eq!(headers[header::CONTENT_ENCODING], "gzip");
    let ((status, replayed, body), headers) = setup.post_with("/encoded", Some("e"), "{}", &[]).await;
    assert_eq!((status, replayed.as_deref(), body.len()), (StatusCode::CREATED, Some("true"), 0));
    assert!(headers.get(header::CONTENT_ENCODING).is_none(), "no body to decode: {headers:?}");
    assert_eq!(headers[header::LOCATION], "/orders/9");
    assert!(warning(&headers).contains("not stored whole: encoded (gzip)"), "{headers:?}");
    assert_eq!(setup.counts.big.load(Ordering::SeqCst), 2, "each ran once");
}

/// Past the bytes read whole, the answer reaches its caller while the upstream still
/// sends it: the upstream holds back its rest until the caller has the first part, so a
/// proxy that read the answer whole would never answer (the test's minute runs out). Its
/// key is then completed without the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_past_the_bound_reaches_its_caller_before_the_upstream_ends() {
    let setup = setup(|c| {
        c.body_bytes_max = 1_024;
        c.stored_bytes_max = 512;
    })
    .await;
    let (mut body, mut read) = first_part_of_stream(&setup, "s").await;
    setup.counts.stream_rest.notify_one();
    while let Some(chunk) = body.next().await {
        read += chunk.unwrap().len();
    }
    assert_eq!(read, 2_000, "the whole answer");
    let ((status, replayed, body), _) = setup.post_with("/stream", Some("s"), "{}", &[]).await;
    assert_eq!((status, replayed.as_deref(), body.len()), (StatusCode::OK, Some("true"), 0));
    assert_eq!(setup.counts.big.load(Ordering::SeqCst), 1, "it ran once");
}

/// Sends a guarded `/stream` with `key` and reads the first part of its answer, which
/// the upstream sends before it holds back the rest until `stream_rest`: the answer's
/// body, and the bytes read of it. The timeout is a safety net, not a measurement.
async fn first_part_of_stream(setup: &Setup, key: &str) -> (axum::body::BodyDataStream, usize) {
    let request = Request::post(format!("{}/stream", setup.proxy))
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key)
        .body(Body::from("{}"))
        .unwrap();
    let response = setup.http.request(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = Body::new(response.into_body()).into_data_stream();
    let mut read = 0;
    let first = async {
        while read < 1_500 {
            read += body.next().await.expect("more of the answer").unwrap().len();
        }
    };
    tokio::time::timeout(Duration::from_secs(60), first).await.expect("the first part came before the rest");
    (body, read)
}

/// At most `guarded_requests_max` guarded requests are in flight: one more is answered
/// `503` naming the limit, with `Retry-After`, and nothing of it goes upstream; a place
/// comes free once a request's answer is sent. (Nothing bounded them: each holds up to
/// `body_bytes_max` of its body and as much of its answer, and its work outlives a
/// caller that went away, so callers could make the proxy hold any amount of memory.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guarded_request_past_guarded_requests_max_is_answered_503() {
    let setup = setup(|c| {
        c.guarded_requests_max = 1;
        c.body_bytes_max = 1_024;
        c.stored_bytes_max = 512;
    })
    .await;
    // The one place: `/stream` holds back the rest of its answer until told.
    let (mut body, _) = first_part_of_stream(&setup, "held").await;
    let ((status, _, problem), headers) = setup.post_with("/orders", Some("refused"), "{}", &[]).await;
    let problem = String::from_utf8_lossy(&problem);
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{problem}");
    assert_eq!(headers[header::RETRY_AFTER], "1");
    assert!(problem.contains("proxy.guarded_requests_max"), "{problem}");
    assert_eq!(setup.counts.orders.load(Ordering::SeqCst), 0, "nothing went upstream");
    setup.counts.stream_rest.notify_one();
    while let Some(chunk) = body.next().await {
        chunk.unwrap();
    }
    // The place comes free as the held answer's work and body end; until then a retry is
    // refused as before. The timeout is a safety net, not a measurement.
    let retried = async {
        loop {
            let ((status, _, _), _) = setup.post_with("/orders", Some("refused"), "{}", &[]).await;
            if status != StatusCode::SERVICE_UNAVAILABLE {
                return status;
            }
        }
    };
    let status = tokio::time::timeout(Duration::from_secs(60), retried).await.expect("the place came free");
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(setup.counts.orders.load(Ordering::SeqCst), 1, "the retry ran once");
}

/// A header the upstream sends twice is stored and replayed with both values, in order;
/// a `set-cookie` put in `stored_headers` by a library caller is still not replayed, and
/// the first caller still gets its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_value_of_a_stored_header_is_replayed() {
    let setup = setup(|c| c.stored_headers = vec![header::LINK, header::SET_COOKIE]).await;
    let links = |headers: &axum::http::HeaderMap| -> Vec<String> {
        headers.get_all(header::LINK).iter().map(|v| v.to_str().unwrap().to_owned()).collect()
    };
    let (first, first_headers) = setup.post_with("/linked", Some("l"), "{}", &[]).await;
    let (replay, replay_headers) = setup.post_with("/linked", Some("l"), "{}", &[]).await;
    assert_eq!((first.0, replay.1.as_deref()), (StatusCode::CREATED, Some("true")));
    let expected = ["</orders/77>; rel=\"self\"", "</orders>; rel=\"collection\""];
    assert_eq!(links(&first_headers), expected);
    assert_eq!(links(&replay_headers), expected);
    assert!(replay_headers.get(header::SET_COOKIE).is_none(), "{replay_headers:?}");
    // The first caller gets its cookie, from the upstream's answer rather than the store.
    assert_eq!(first_headers.get(header::SET_COOKIE).unwrap(), "session=first-caller");
}

/// Sends `bytes` on a new connection to `addr` (`host:port`), then reads until the proxy
/// closes it; what it read. The read timeout is a safety net for a broken proxy (the test
/// then fails on the error), not a measurement.
async fn sent_then_closed(addr: &str, bytes: &'static [u8]) -> std::io::Result<Vec<u8>> {
    let addr = addr.trim_start_matches("http://").to_owned();
    tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut socket = std::net::TcpStream::connect(addr)?;
        socket.set_read_timeout(Some(Duration::from_secs(60)))?;
        socket.write_all(bytes)?;
        let mut read = Vec::new();
        socket.read_to_end(&mut read)?;
        Ok(read)
    })
    .await
    .unwrap()
}

/// A guarded request's body must arrive within `body_read_timeout_ms`: past it the caller
/// gets a `408` problem and nothing was reserved. (The body was read with no deadline.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guarded_body_that_does_not_arrive_in_time_is_answered_408() {
    let setup = setup(|c| c.body_read_timeout_ms = 200).await;
    let request = b"POST /orders HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: slow-body\r\n\
        Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"partial\": ";
    let answer = sent_then_closed(&setup.proxy, request).await.expect("answered and closed");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_read_timeout_ms (200 ms)"), "{answer}");
    assert_eq!(setup.counts.orders.load(Ordering::SeqCst), 0, "nothing went upstream");
}

/// A passed-through answer whose body stalls is cut after `upstream_body_idle_ms`: the
/// caller's read ends instead of waiting for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passed_through_body_that_stalls_is_cut_at_its_idle_timeout() {
    let setup = setup(|c| c.upstream_body_idle_ms = 200).await;
    let request = b"GET /stall HTTP/1.1\r\nHost: proxy\r\n\r\n";
    let answer = sent_then_closed(&setup.proxy, request).await.expect("the stalled body is cut");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200") && answer.contains("first chunk"), "{answer}");
}

/// The proxy's listener: a connection must send a request head within
/// `header_read_timeout_ms`, and past `connections_max` a connection is closed unanswered.
/// (It was served by plain `axum::serve`: no header timeout and no limit, so 80 silent
/// connections exhausted a proxy with 64 file descriptors.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_times_request_heads_and_limits_connections() {
    let listening = listen(|c| {
        c.header_read_timeout_ms = 200;
        c.connections_max = 2;
    })
    .await;
    let addr = listening.addr.clone();
    for silent in [&b""[..], b"P", b"POST /orders HTTP/1.1\r\nHost: pro"] {
        let closed = sent_then_closed(&addr, silent).await;
        assert!(closed.is_ok(), "{:?} was not closed: {closed:?}", String::from_utf8_lossy(silent));
    }
    // Two connections hold both places (each has a request open: a body that stalls);
    // the third is closed at once, unanswered.
    let mut holders = Vec::new();
    for _ in 0..2 {
        let holder = tokio::task::spawn_blocking({
            let addr = addr.clone();
            move || {
                use std::io::{Read, Write};
                let mut holder = std::net::TcpStream::connect(addr).unwrap();
                holder.write_all(b"GET /stall HTTP/1.1\r\nHost: proxy\r\n\r\n").unwrap();
                holder.read_exact(&mut [0u8; 12]).unwrap();
                holder
            }
        });
        holders.push(holder.await.unwrap());
    }
    let third = sent_then_closed(&addr, b"GET /stall HTTP/1.1\r\nHost: proxy\r\n\r\n").await;
    let unanswered = matches!(&third, Ok(read) if read.is_empty())
        || matches!(&third, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset);
    assert!(unanswered, "the third connection is closed unanswered: {third:?}");
    drop(holders);
    listening.stop().await;
}

/// A proxy serving through `oncegate_proxy::serve`, its listener's limits as `edit` sets
/// them, on an engine and upstream of its own.
struct Listening {
    addr: String,
    stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<std::io::Result<()>>,
    _engine: Engine,
    _dir: tempfile::TempDir,
}

async fn listen(edit: impl FnOnce(&mut ProxyConfig)) -> Listening {
    let counts = Arc::new(Counts::default());
    let dir = tempfile::tempdir().unwrap();
    let engine =
        Engine::open(EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() }).unwrap();
    let mut config = ProxyConfig { upstream: upstream(Arc::clone(&counts)).await, ..ProxyConfig::default() };
    edit(&mut config);
    let router = oncegate_proxy::router(engine.gate(oncegate_core::Tenant::default_tenant()), config.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(async move {
        oncegate_proxy::serve(listener, router, &config, async {
            let _ = stopped.await;
        })
        .await
    });
    Listening { addr, stop, served, _engine: engine, _dir: dir }
}

impl Listening {
    async fn stop(self) {
        let _ = self.stop.send(());
        self.served.await.unwrap().unwrap();
    }
}

/// A caller that stops reading an answer loses its connection after `send_timeout_ms`,
/// and its place goes to the next caller. (Nothing timed a write to the caller: one that
/// never read held its place, and the upstream's answer, for ever, so `connections_max`
/// such callers locked every other caller out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_stops_reading_loses_its_connection_at_the_send_timeout() {
    let listening = listen(|c| {
        c.connections_max = 1;
        c.send_timeout_ms = 200;
    })
    .await;
    let holder = tokio::task::spawn_blocking({
        let addr = listening.addr.clone();
        move || {
            use std::io::{Read, Write};
            let mut holder = std::net::TcpStream::connect(addr).unwrap();
            holder.write_all(b"GET /endless HTTP/1.1\r\nHost: proxy\r\n\r\n").unwrap();
            let mut status = [0u8; 12];
            holder.read_exact(&mut status).unwrap();
            assert_eq!(&status, b"HTTP/1.1 200");
            // Never read again: the answer fills both ends' socket buffers.
            holder
        }
    });
    let holder = holder.await.unwrap();
    // Callers are closed unanswered while the holder has the one place; one is answered
    // once the proxy gave up on the holder. The timeout is a safety net for a broken
    // proxy, not a measurement.
    let answered = async {
        loop {
            let request = b"GET /hello HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n";
            if let Ok(read) = sent_then_closed(&listening.addr, request).await
                && read.starts_with(b"HTTP/1.1 200")
            {
                return read;
            }
        }
    };
    let read =
        tokio::time::timeout(Duration::from_secs(60), answered).await.expect("the holder's place came free");
    assert!(read.ends_with(b"hello"), "{}", String::from_utf8_lossy(&read));
    drop(holder);
    listening.stop().await;
}

/// Callers are told apart by the configured headers' values, hashed together: behind an
/// upstream that authenticates by `X-Api-Key`, caller B sending caller A's key runs its
/// own request, never gets A's stored answer. (Only `Authorization` told callers apart:
/// B was replayed A's status, `Location` and body.) A guarded request with none of the
/// headers is refused unless anonymous callers may share keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_are_told_apart_by_the_configured_headers() {
    let setup = setup(|c| {
        c.caller_headers = vec![HeaderName::from_static("x-api-key"), header::COOKIE];
        c.anonymous_callers_share_keys = false;
    })
    .await;
    let (a, _) = setup.post_with("/orders", Some("shared"), "{}", &[("x-api-key", "caller-a")]).await;
    let (b, _) = setup.post_with("/orders", Some("shared"), "{}", &[("x-api-key", "caller-b")]).await;
    let (c, _) = setup.post_with("/orders", Some("shared"), "{}", &[("cookie", "session=c")]).await;
    assert_eq!((a.1.as_deref(), b.1.as_deref(), c.1.as_deref()), (None, None, None), "none is a replay");
    assert_eq!(setup.counts.orders.load(Ordering::SeqCst), 3, "each caller's request ran");
    let (again, _) = setup.post_with("/orders", Some("shared"), "{}", &[("x-api-key", "caller-a")]).await;
    assert_eq!((again.1.as_deref(), &again.2), (Some("true"), &a.2), "A's retry is A's answer");

    let (anonymous, _) = setup.post_with("/orders", Some("anonymous"), "{}", &[]).await;
    assert_eq!(anonymous.0, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&anonymous.2).contains("caller headers (x-api-key, cookie)"));
    assert_eq!(setup.counts.orders.load(Ordering::SeqCst), 3, "the anonymous request did not run");
}

/// Behind an upstream that authenticates by cookie: with the default `caller_headers`
/// (`Authorization`) a guarded request carrying only a cookie is refused, so caller B
/// can never be replayed caller A's answer by sending A's key; with `caller_headers =
/// ["cookie"]` each cookie is its own caller. (Before, both cookie callers shared one
/// caller value, and B was replayed A's status, `Location` and body.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_cookie_callers_never_share_an_answer() {
    let defaults = setup(|c| c.anonymous_callers_share_keys = false).await;
    for cookie in ["session=a", "session=b"] {
        let (answer, _) = defaults.post_with("/orders", Some("shared"), "{}", &[("cookie", cookie)]).await;
        assert_eq!(answer.0, StatusCode::BAD_REQUEST, "{}", String::from_utf8_lossy(&answer.2));
    }
    assert_eq!(defaults.counts.orders.load(Ordering::SeqCst), 0, "neither ran");

    let by_cookie = setup(|c| {
        c.caller_headers = vec![header::COOKIE];
        c.anonymous_callers_share_keys = false;
    })
    .await;
    let (a, _) = by_cookie.post_with("/orders", Some("shared"), "{}", &[("cookie", "session=a")]).await;
    let (b, _) = by_cookie.post_with("/orders", Some("shared"), "{}", &[("cookie", "session=b")]).await;
    assert_eq!((a.1.as_deref(), b.1.as_deref()), (None, None), "neither is a replay");
    assert_ne!(a.2, b.2, "each ran its own request");
    assert_eq!(by_cookie.counts.orders.load(Ordering::SeqCst), 2);
    let (again, _) = by_cookie.post_with("/orders", Some("shared"), "{}", &[("cookie", "session=a")]).await;
    assert_eq!((again.1.as_deref(), &again.2), (Some("true"), &a.2), "A's retry is A's answer");
}

/// A request with two different `Idempotency-Key` values is refused: which one guards it
/// would be a guess. (The first was guarded and both went upstream.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_different_keys_on_one_request_are_refused() {
    let setup = setup(|_| {}).await;
    let (answer, _) = setup.post_with("/orders", Some("one"), "{}", &[("idempotency-key", "two")]).await;
    assert_eq!(answer.0, StatusCode::BAD_REQUEST, "{}", String::from_utf8_lossy(&answer.2));
    assert_eq!(setup.counts.orders.load(Ordering::SeqCst), 0);
    let (same, _) = setup.post_with("/orders", Some("one"), "{}", &[("idempotency-key", "one")]).await;
    assert_eq!(same.0, StatusCode::CREATED, "the same value twice is one key");
}
