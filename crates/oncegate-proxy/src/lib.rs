//! The Idempotency-Key reverse proxy: put it in front of an unchanged HTTP service, and a
//! guarded request (by default `POST` and `PATCH`) carrying an `Idempotency-Key` header runs
//! upstream at most once; its retries get the stored answer (status, `Content-Type`,
//! `Location` and the body byte for byte), marked `Idempotent-Replayed: true`. It runs on any [`Gate`]: the engine in process or a remote
//! oncegate, through the client crate's `once` (reserve, heartbeat while the upstream
//! works, commit the answer, release when the upstream failed).
//!
//! | the request | the answer |
//! | --- | --- |
//! | not guarded, or no key (and none required) | passed through |
//! | no key on a path that requires one | `400` problem |
//! | two different keys, or none of the `caller_headers` (unless anonymous callers share keys) | `400` problem |
//! | a guarded body that does not arrive within `body_read_timeout_ms` | `408` problem; nothing reserved |
//! | first with its key | forwarded; a `2xx` or `4xx` (other than `408`, `409`, `429`) is stored |
//! | a retry after the first completed | the stored answer, `Idempotent-Replayed: true` |
//! | the same key while the first is in flight | waits up to `wait_ms`, then `409` with `Retry-After` |
//! | the same key with another payload | `422` problem |
//! | upstream `5xx`, other statuses not stored, a soft failure, no connection | key released; the answer passed on (`502` for no connection) |
//! | a timeout or a connection lost after sending | `504`/`502` "outcome unknown"; the key held until its lease ends |
//! | a body or key over its limit | `413`/`400` problem |
//! | a guarded request while `guarded_requests_max` are in flight | `503` problem with `Retry-After`; nothing reserved |
//! | an answer to store that cannot be stored whole (over `stored_bytes_max`, past the bytes read whole, encoded) | passed on with a `Warning`; stored without its body, which a retry is told of |

mod config;
mod payload;
mod problem;
mod stored;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use oncegate_client::{Gate, Lease, OnCancel, OnceError, OnceKey, OnceOptions, Ran, WorkError, once};
use oncegate_core::Fingerprint;
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

pub use config::{ProxyConfig, ProxyFile, StatusRuleError, StoredStatuses};
pub use problem::Problem;
pub use stored::Stored;

/// The proxy: a gate, the upstream's client, the configuration and the places of guarded
/// requests in flight.
pub struct Proxy<G> {
    gate: G,
    upstream: HttpClient<HttpConnector, Body>,
    guarded: Arc<Semaphore>,
    config: ProxyConfig,
}

/// The proxy's routes: every path, every method.
pub fn router<G: Gate + Clone + 'static>(gate: G, config: ProxyConfig) -> axum::Router {
    let upstream = HttpClient::builder(TokioExecutor::new()).build_http();
    let guarded = Arc::new(Semaphore::new(config.guarded_requests_max));
    let proxy = Arc::new(Proxy { gate, upstream, guarded, config });
    axum::Router::new().fallback(handle::<G>).with_state(proxy)
}

/// Serves `router` (the proxy) on `listener` within the listener limits of `config`
/// until `shutdown`; requests in flight then get the upstream's timeout to finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    config: &ProxyConfig,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> std::io::Result<()> {
    use oncegate_listen::activity::{Limits, Timeout};
    let request_head = Timeout {
        within: Duration::from_millis(config.header_read_timeout_ms),
        setting: "proxy.header_read_timeout_ms",
    };
    let limits = oncegate_listen::serve::HttpLimits {
        connections_max: (config.connections_max, "proxy.connections_max"),
        deadlines: Limits {
            request_head,
            idle: Timeout::ms(config.idle_timeout_ms, "proxy.idle_timeout_ms"),
            send: Timeout::ms(config.send_timeout_ms, "proxy.send_timeout_ms"),
        },
        grace: config.shutdown_grace(),
    };
    oncegate_listen::serve::serve_router(listener, router, limits, shutdown).await
}

impl ProxyConfig {
    /// Who is calling, as the record key names it: `t:<tenant>` from the tenant header
    /// (required when one is configured), else a hash of the caller headers' values:
    /// `c:<hash>` of the first `Authorization` value when that is the one header
    /// configured (the form keys had before the list existed, so a retry across the
    /// upgrade finds its record), `h:<hash>` of every configured header's
    /// name and values otherwise; else `-` where anonymous callers may share keys, and a
    /// `400` where not.
    fn caller(&self, headers: &HeaderMap) -> Result<String, Problem> {
        if let Some(name) = &self.tenant_header {
            let tenant = headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .filter(|t| !t.is_empty() && t.len() <= 64 && !t.contains(' '));
            return tenant.map(|t| format!("t:{t}")).ok_or_else(|| {
                let detail =
                    format!("a guarded request needs a {name} header: 1 to 64 visible ASCII characters");
                Problem::new(StatusCode::BAD_REQUEST, "Tenant required", "invalid_argument", detail)
            });
        }
        let names = &self.caller_headers;
        let sent: Vec<(&HeaderName, &HeaderValue)> = names
            .iter()
            .flat_map(|name| headers.get_all(name).iter().map(move |value| (name, value)))
            .collect();
        let hex = |hash: &[u8]| hash[..8].iter().map(|b| format!("{b:02x}")).collect::<String>();
        match sent.as_slice() {
            [] if self.anonymous_callers_share_keys => Ok("-".to_owned()),
            [] => {
                let names = names.iter().map(HeaderName::as_str).collect::<Vec<_>>().join(", ");
                let detail = format!(
                    "a guarded request needs one of the caller headers ({names}), which tell callers apart so that \
                     one caller's key never answers another's request"
                );
                Err(Problem::new(StatusCode::BAD_REQUEST, "Caller required", "invalid_argument", detail))
            }
            // The form keys had before the list existed: the first `Authorization` value.
            [(name, credential), ..] if *name == header::AUTHORIZATION && names.len() == 1 => {
                Ok(format!("c:{}", hex(&Sha256::digest(credential.as_bytes()))))
            }
            sent => {
                let mut hasher = Sha256::new();
                for (name, value) in sent {
                    hasher.update(name.as_str().as_bytes());
                    hasher.update(b":");
                    hasher.update(value.as_bytes());
                    hasher.update(b"\n");
                }
                Ok(format!("h:{}", hex(&hasher.finalize())))
            }
        }
    }
}

/// An upstream answer's body that fails once the upstream keeps its reader waiting longer
/// than `idle` for a frame: a stalled upstream must not hold the caller's connection (nor,
/// for a guarded request, the key) for ever. Only the reader's wait counts, from the first
/// poll that finds no frame: time the reader spends elsewhere (committing the answer,
/// sending what it read to a slow caller) is not the upstream's pause.
struct IdleBody<B> {
    body: B,
    idle: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
    /// Whether the reader has been waiting since the last frame (the timer is armed).
    waiting: bool,
}

/// Why a passed-through answer's body was cut.
#[derive(Debug, thiserror::Error)]
#[error("the upstream's body paused longer than upstream_body_idle_ms ({idle_ms} ms)")]
struct UpstreamBodyIdle {
    idle_ms: u128,
}

impl<B> IdleBody<B> {
    fn new(body: B, idle: Duration) -> IdleBody<B> {
        IdleBody { body, idle, timer: Box::pin(tokio::time::sleep(idle)), waiting: false }
    }
}

impl<B> http_body::Body for IdleBody<B>
where
    B: http_body::Body<Data = axum::body::Bytes> + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = axum::body::Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<axum::body::Bytes>, axum::BoxError>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.body).poll_frame(cx) {
            self.waiting = false;
            return Poll::Ready(frame.map(|frame| frame.map_err(Into::into)));
        }
        if !self.waiting {
            self.waiting = true;
            let until = tokio::time::Instant::now() + self.idle;
            self.timer.as_mut().reset(until);
        }
        if self.timer.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(Box::new(UpstreamBodyIdle { idle_ms: self.idle.as_millis() }))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// The answer to a guarded request that finds `guarded_requests_max` in flight.
fn too_many_guarded(max: usize) -> Problem {
    Problem {
        retry_after_s: Some(1),
        limit: Some("proxy.guarded_requests_max"),
        ..Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "Too many guarded requests",
            "resource_exhausted",
            format!("{max} guarded requests are in flight, proxy.guarded_requests_max; retry later"),
        )
    }
}

/// A guarded request's answer, holding its place among `guarded_requests_max` until
/// the body is sent or dropped.
struct Placed {
    body: Body,
    _place: Arc<tokio::sync::OwnedSemaphorePermit>,
}

impl http_body::Body for Placed {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<axum::body::Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// An upstream answer that is not stored: it goes back to the caller as it came, and the
/// key is released so that a retry may run.
#[derive(Debug)]
struct Unstored(Response);

async fn handle<G: Gate + Clone + 'static>(
    State(proxy): State<Arc<Proxy<G>>>,
    mut request: Request,
) -> Response {
    // Only the proxy says which attempt runs: a client's own `oncegate-*` headers could
    // push the upstream's fence past real attempts or fake an abandoned one.
    for name in ATTEMPT_HEADERS {
        request.headers_mut().remove(name);
    }
    let guarded = proxy.config.guarded_methods.contains(request.method());
    let mut keys = request.headers().get_all(&proxy.config.key_header).iter();
    let key = keys.next().cloned();
    if guarded && keys.any(|other| Some(other) != key.as_ref()) {
        let detail = format!("the request carries two different {} headers", proxy.config.key_header);
        return Problem::new(
            StatusCode::BAD_REQUEST,
            "Conflicting Idempotency-Key",
            "invalid_argument",
            detail,
        )
        .into_response();
    }
    match (guarded, key) {
        // On a task of its own: a client that disconnects must not cancel a request the
        // upstream may already be running, or its retry would run it again. The answer is
        // stored whether or not anyone waits for it, and the retry is replayed.
        (true, Some(key)) => {
            let policy = proxy.config.key_policy_url.clone();
            // Held by the work and by the answer's body, whichever ends last.
            let Ok(place) = Arc::clone(&proxy.guarded).try_acquire_owned().map(Arc::new) else {
                let mut refused = too_many_guarded(proxy.config.guarded_requests_max).into_response();
                if let Some(policy) = policy {
                    refused.headers_mut().append(header::LINK, policy);
                }
                return refused;
            };
            let working = Arc::clone(&place);
            let guarded = tokio::spawn(async move {
                let answer = proxy.guard(request, key).await;
                drop(working);
                answer
            });
            let mut answer = match guarded.await {
                Ok(answer) => answer.unwrap_or_else(IntoResponse::into_response),
                Err(_) => bad_gateway("the request's task failed".to_owned()).into_response(),
            };
            if let Some(policy) = policy {
                answer.headers_mut().append(header::LINK, policy);
            }
            answer.map(|body| Body::new(Placed { body, _place: place }))
        }
        (true, None) if proxy.requires_key(request.uri()) => Problem::new(
            StatusCode::BAD_REQUEST,
            "Idempotency-Key required",
            "invalid_argument",
            format!("{} needs an {} header", request.uri().path(), proxy.config.key_header),
        )
        .into_response(),
        _ => proxy.forward(request).await.into_response(),
    }
}

impl<G: Gate + Clone + 'static> Proxy<G> {
    fn requires_key(&self, uri: &Uri) -> bool {
        self.config.key_required_prefixes.iter().any(|prefix| uri.path().starts_with(prefix.as_str()))
    }

    /// A guarded request with its key: at most once upstream.
    async fn guard(&self, request: Request, key: HeaderValue) -> Result<Response, Problem> {
        self.check_headers(request.headers())?;
        let key = self.record_key(&request, &key)?;
        let (parts, body) = request.into_parts();
        let read = axum::body::to_bytes(body, self.config.body_bytes_max);
        let within = Duration::from_millis(self.config.body_read_timeout_ms);
        let body = tokio::time::timeout(within, read)
            .await
            .map_err(|_| {
                Problem::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "Request body too slow",
                    "unavailable",
                    format!(
                        "the body did not arrive within body_read_timeout_ms ({} ms)",
                        within.as_millis()
                    ),
                )
            })?
            .map_err(|_| {
                Problem::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "Request body too large",
                    "invalid_argument",
                    format!("the body passes body_bytes_max ({} bytes)", self.config.body_bytes_max),
                )
            })?;
        let lease_ms = self.config.upstream_timeout_ms.saturating_add(config::LEASE_MARGIN_MS);
        let options = OnceOptions {
            ttl: (self.config.ttl_ms > 0).then(|| Duration::from_millis(self.config.ttl_ms)),
            lease: Some(Duration::from_millis(lease_ms)),
            wait: Duration::from_millis(self.config.wait_ms),
            fingerprint: self.fingerprint(&parts, &body),
            // The work is cancelled only when its task fails (a panic) or the runtime
            // stops, and the upstream may then be running it: the key stays held until
            // its lease ends, as when the proxy is killed, and the next attempt is told
            // `abandoned`.
            on_cancel: OnCancel::KeepUntilLeaseEnds,
            ..OnceOptions::default()
        };
        // What only the caller that ran the request gets: the upstream's cookies (never
        // stored, never replayed) and a whole answer too large to store.
        let first = FirstCaller::default();
        let first_caller = &first;
        let work = |lease: Lease| async move {
            let mut request = Request::from_parts(parts, Body::from(body));
            attempt_headers(request.headers_mut(), &lease);
            // The answer is stored as it comes: ask for it unencoded, so that what is
            // replayed needs no encoding header to be read.
            request.headers_mut().remove(header::ACCEPT_ENCODING);
            let answer = self.forward(request).await;
            self.keep(answer, first_caller).await
        };
        let namespace = &self.config.namespace;
        let ran = once(self.gate.clone(), namespace, OnceKey::Key(key), options, work).await;
        let whole = first.answer.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        match ran {
            Ok(Ran::Now(bytes)) => {
                let answer = match whole {
                    Some(mut whole) => {
                        whole
                            .headers_mut()
                            .append(header::WARNING, HeaderValue::from_static(FIRST_OF_OMITTED));
                        whole
                    }
                    None => replay(&bytes, false),
                };
                Ok(with_cookies(answer, first.cookies.get()))
            }
            // A stored answer is replayed whatever its status: the proxy commits every
            // answer it stores as succeeded.
            Ok(Ran::Replayed(replayed)) => Ok(replay(&replayed.stored().response, true)),
            Err(error) => {
                self.refused(error, whole).map(|response| with_cookies(response, first.cookies.get()))
            }
        }
    }

    /// Refuses a request whose headers are over `headers_bytes_max`: they are forwarded
    /// and some are fingerprinted, so they are bounded like the body.
    fn check_headers(&self, headers: &HeaderMap) -> Result<(), Problem> {
        let bytes: usize = headers.iter().map(|(name, value)| name.as_str().len() + value.len()).sum();
        if bytes <= self.config.headers_bytes_max {
            return Ok(());
        }
        Err(Problem::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "Request headers too large",
            "invalid_argument",
            format!("the headers are {bytes} bytes; headers_bytes_max is {}", self.config.headers_bytes_max),
        ))
    }

    /// The gate's key for a request: the method, the path, the caller (the configured
    /// tenant header's value, or else a hash of the `caller_headers`, so that one caller's
    /// key never answers another's request; see `ProxyConfig::caller`) and the caller's key.
    fn record_key(&self, request: &Request, key: &HeaderValue) -> Result<String, Problem> {
        let invalid = |detail: String| {
            Problem::new(StatusCode::BAD_REQUEST, "Invalid Idempotency-Key", "invalid_argument", detail)
        };
        let key = key.to_str().map_err(|_| invalid("the key is not visible ASCII".to_owned()))?;
        if key.is_empty() || key.len() > self.config.key_bytes_max {
            return Err(invalid(format!(
                "the key is {} bytes; it must be 1 to {} (key_bytes_max)",
                key.len(),
                self.config.key_bytes_max
            )));
        }
        let caller = self.config.caller(request.headers())?;
        Ok(format!("{} {} {caller} {key}", request.method(), request.uri().path()))
    }

    /// The payload's fingerprint: method, path and query, the configured headers, and the
    /// body (canonical JSON when it parses as JSON, so key order and spacing do not count).
    fn fingerprint(&self, parts: &axum::http::request::Parts, body: &[u8]) -> Vec<u8> {
        let headers: serde_json::Map<String, serde_json::Value> = self
            .config
            .fingerprint_headers
            .iter()
            .filter_map(|name| {
                let value = parts.headers.get(name)?.to_str().ok()?;
                Some((name.as_str().to_owned(), serde_json::Value::from(value)))
            })
            .collect();
        // A JSON body counts as written but for spacing and member order
        // (`payload.rs`), since a parsed value would lose what the upstream may still tell
        // apart (digits past a double's precision, a member given twice). It is parsed
        // first only to check it: the parser stops at a depth the walk can take, where
        // `IgnoredAny` would accept any depth.
        let json = std::str::from_utf8(body)
            .ok()
            .filter(|text| serde_json::from_str::<serde_json::Value>(text).is_ok())
            .and_then(payload::canonical_as_written);
        let body = match json {
            Some(text) => serde_json::json!({ "json": text }),
            None => {
                serde_json::json!({ "bytes": body.iter().map(|b| format!("{b:02x}")).collect::<String>() })
            }
        };
        let payload = serde_json::json!({
            "method": parts.method.as_str(),
            "target": parts.uri.path_and_query().map_or("/", |p| p.as_str()),
            "headers": headers,
            "body": body,
        });
        Fingerprint::of_json(&payload).map(|f| f.as_bytes().to_vec()).unwrap_or_default()
    }

    /// Sends `request` upstream (the key header included, hop-by-hop headers not),
    /// within the timeout.
    async fn forward(&self, request: Request) -> Result<Response, Upstream> {
        let (mut parts, body) = request.into_parts();
        let target =
            format!("{}{}", self.config.upstream, parts.uri.path_and_query().map_or("/", |p| p.as_str()));
        parts.uri = target
            .parse()
            .map_err(|_| Upstream::NotSent(bad_gateway(format!("{target} is not a valid upstream URI"))))?;
        parts.version = axum::http::Version::HTTP_11;
        parts.headers.remove(header::HOST);
        strip_hop_by_hop(&mut parts.headers);
        let limit = Duration::from_millis(self.config.upstream_timeout_ms);
        let sent = self.upstream.request(Request::from_parts(parts, body));
        match tokio::time::timeout(limit, sent).await {
            Ok(Ok(response)) => {
                let (mut parts, body) = response.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                let idle = Duration::from_millis(self.config.upstream_body_idle_ms);
                Ok(Response::from_parts(parts, Body::new(IdleBody::new(body, idle))))
            }
            Ok(Err(error)) if error.is_connect() => {
                Err(Upstream::NotSent(bad_gateway(format!("the upstream could not be reached: {error}"))))
            }
            Ok(Err(error)) => Err(Upstream::Unknown(Problem::new(
                StatusCode::BAD_GATEWAY,
                "Outcome unknown",
                "unavailable",
                format!("the upstream's answer was lost ({error}); it may have run the request"),
            ))),
            Err(_) => Err(Upstream::Unknown(Problem::new(
                StatusCode::GATEWAY_TIMEOUT,
                "Outcome unknown",
                "unavailable",
                format!(
                    "no answer within upstream_timeout_ms ({} ms); the upstream may have run the request",
                    self.config.upstream_timeout_ms
                ),
            ))),
        }
    }

    /// Keeps the upstream's answer: a storable one is stored and the key completed; a
    /// storable one that cannot be stored whole (over `stored_bytes_max`, past the bytes
    /// read whole, or encoded) is stored without its body (see [`omitted`]) and goes whole
    /// to the caller that ran it, through `first`; any other is passed on and the key
    /// released.
    async fn keep(
        &self,
        answer: Result<Response, Upstream>,
        first: &FirstCaller,
    ) -> Result<Vec<u8>, WorkError<Unstored>> {
        let response = answer.map_err(|failed| match failed {
            // Nothing reached the upstream: the key is released and a retry may run.
            Upstream::NotSent(problem) => WorkError::Retryable(Unstored(problem.into_response())),
            // It may have run: the key stays held until its lease ends.
            Upstream::Unknown(problem) => WorkError::Unknown(Unstored(problem.into_response())),
        })?;
        let (parts, body) = response.into_parts();
        // The body gets the upstream timeout too: a stalled one would hold the key (its
        // lease renewed by heartbeats) for as long as the upstream stalls.
        let limit = Duration::from_millis(self.config.upstream_timeout_ms);
        let bound = self.config.body_bytes_max.max(self.config.stored_bytes_max);
        let read = match tokio::time::timeout(limit, read_up_to(body, bound)).await {
            Ok(Ok(read)) => read,
            // The upstream ran; its answer cannot be kept: hold the key.
            _ => {
                let problem = bad_gateway("the upstream's answer was cut short or too slow".to_owned());
                return Err(WorkError::Unknown(Unstored(problem.into_response())));
            }
        };
        let _ = first.cookies.set(parts.headers.get_all(header::SET_COOKIE).iter().cloned().collect());
        let stores = self.config.stored_statuses.stores(parts.status);
        let (body, reason) = match read {
            Read::Whole(body) if !stores || self.soft_failure(&body) => {
                return Err(WorkError::Retryable(Unstored(Response::from_parts(parts, Body::from(body)))));
            }
            Read::Past(body) if !stores => {
                return Err(WorkError::Retryable(Unstored(Response::from_parts(parts, body))));
            }
            Read::Past(body) => (body, format!("more than {bound} bytes")),
            Read::Whole(body) => match encoding(&parts.headers) {
                Some(coding) => (Body::from(body), format!("encoded ({coding})")),
                None => {
                    let stored = Stored {
                        status: parts.status,
                        headers: self.stored_headers(&parts.headers),
                        body: body.to_vec(),
                    };
                    let bytes = stored.encode();
                    if bytes.len() <= self.config.stored_bytes_max {
                        return Ok(bytes);
                    }
                    let max = self.config.stored_bytes_max;
                    (
                        Body::from(body),
                        format!("{} bytes to store, over stored_bytes_max ({max})", bytes.len()),
                    )
                }
            },
        };
        // The upstream ran it: a retry must not run it again, so the key is completed
        // with the answer's status and headers, its body left out and said so.
        let marker =
            omitted(parts.status, self.stored_headers(&parts.headers), &reason, self.config.stored_bytes_max);
        let whole = Response::from_parts(parts, body);
        *first.answer.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(whole);
        Ok(marker)
    }

    /// The headers of an answer that are stored with it, in the configured order.
    fn stored_headers(&self, headers: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
        self.config
            .stored_headers
            .iter()
            .filter(|name| config::never_stored(name).is_none())
            .flat_map(|name| headers.get_all(name).iter().map(|value| (name.clone(), value.clone())))
            .collect()
    }

    fn soft_failure(&self, body: &[u8]) -> bool {
        let Some((pointer, value)) = &self.config.soft_failure else { return false };
        serde_json::from_slice::<serde_json::Value>(body).ok().and_then(|json| json.pointer(pointer).cloned())
            == Some(value.clone())
    }

    /// The answer for a request `once` did not complete.
    fn refused(
        &self,
        error: OnceError<G::Error, Unstored>,
        whole: Option<Response>,
    ) -> Result<Response, Problem> {
        use oncegate_core::Code;
        use oncegate_core::gate::GateError;
        // An answer not stored whole is the only copy the caller can get (past the bytes
        // read whole, the rest is still coming): passed on, warned, if the lease was lost.
        let whole = match (&error, whole) {
            (OnceError::LeaseLost { .. }, Some(mut passed)) => {
                passed.headers_mut().append(header::WARNING, HeaderValue::from_static(LOST_BEFORE_STORED));
                return Ok(passed);
            }
            (_, whole) => whole,
        };
        match error {
            OnceError::Retryable(Unstored(response)) | OnceError::Unknown(Unstored(response)) => Ok(response),
            OnceError::InProgress { retry_after_ms } => Err(Problem {
                retry_after_s: Some(oncegate_listen::problem::retry_after_s(retry_after_ms)),
                ..Problem::new(
                    StatusCode::CONFLICT,
                    "Request in progress",
                    "in_progress",
                    "a request with this Idempotency-Key is being processed; retry later".to_owned(),
                )
            }),
            OnceError::Gate(error) if error.code() == Code::InvalidArgument => Err(Problem::new(
                StatusCode::BAD_REQUEST,
                "Request refused",
                "invalid_argument",
                error.to_string(),
            )),
            OnceError::Mismatch { .. } => Err(Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Idempotency-Key reused",
                "mismatch",
                "this Idempotency-Key was used with another request payload".to_owned(),
            )),
            OnceError::Gate(error) if error.code() == Code::ResourceExhausted => Err(Problem {
                retry_after_s: Some(1),
                ..Problem::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "Too many requests",
                    "resource_exhausted",
                    error.to_string(),
                )
            }),
            OnceError::Gate(error) => Err(Problem {
                retry_after_s: Some(1),
                ..Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Gate unavailable",
                    "unavailable",
                    error.to_string(),
                )
            }),
            // The upstream answered and the proxy has its answer; only storing it failed
            // (the gate is down, or refused it: a remote gate's `response_bytes_max` below
            // `stored_bytes_max`). The caller gets it, warned, rather than a `502` that
            // would send its retry upstream again once the still-held key's lease ends.
            OnceError::Unconfirmed { response, error, .. } => {
                tracing::warn!(%error, "the upstream's answer could not be stored; passed on unstored");
                let mut passed = whole.unwrap_or_else(|| replay(&response, false));
                passed.headers_mut().append(
                    header::WARNING,
                    HeaderValue::from_static("299 - \"answer may not be stored; a retry may run again\""),
                );
                Ok(passed)
            }
            OnceError::LeaseLost { .. } | OnceError::Failed { .. } | _ => Err(Problem::new(
                StatusCode::BAD_GATEWAY,
                "Outcome unknown",
                "lease_lost",
                "the upstream may have run this request, but its answer could not be stored; do not retry \
                 blindly: check the upstream"
                    .to_owned(),
            )),
        }
    }
}

/// What became of a request sent upstream without an answer.
enum Upstream {
    /// It never reached the upstream (no connection).
    NotSent(Problem),
    /// It may have reached it (a timeout or a connection lost after sending).
    Unknown(Problem),
}

impl IntoResponse for Upstream {
    fn into_response(self) -> Response {
        match self {
            Upstream::NotSent(problem) | Upstream::Unknown(problem) => problem.into_response(),
        }
    }
}

/// Headers about one connection, never forwarded (RFC 9110, section 7.6.1): each hop
/// frames its own body, so the upstream's `transfer-encoding` must not reach a client
/// that gets the body in another framing.
pub(crate) const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok()))
        .collect();
    for name in HOP_BY_HOP.iter().map(|n| HeaderName::from_static(n)).chain(named) {
        headers.remove(name);
    }
}

/// The headers that tell the upstream which attempt runs; only the proxy sets them.
const ATTEMPT_HEADERS: [HeaderName; 3] = [
    HeaderName::from_static("oncegate-token"),
    HeaderName::from_static("oncegate-attempt"),
    HeaderName::from_static("oncegate-previous"),
];

/// Tells the upstream which attempt this is, with the fencing token, so that it can refuse
/// a stale attempt's writes and check for a partial one after an abandoned attempt.
fn attempt_headers(headers: &mut HeaderMap, lease: &Lease) {
    let [token, attempt, previous] = ATTEMPT_HEADERS;
    headers.insert(token, HeaderValue::from(lease.token));
    headers.insert(attempt, HeaderValue::from(lease.attempt));
    if lease.previous == oncegate_core::Previous::Abandoned {
        headers.insert(previous, HeaderValue::from_static("abandoned"));
    }
}

fn bad_gateway(detail: String) -> Problem {
    Problem::new(StatusCode::BAD_GATEWAY, "Bad gateway", "unavailable", detail)
}

/// The first caller's answer with the upstream's `Set-Cookie` headers, which the stored
/// answer never holds (a response passed on unstored has them already).
fn with_cookies(mut response: Response, cookies: Option<&Vec<HeaderValue>>) -> Response {
    if !response.headers().contains_key(header::SET_COOKIE) {
        for cookie in cookies.into_iter().flatten() {
            response.headers_mut().append(header::SET_COOKIE, cookie.clone());
        }
    }
    response
}

/// What only the caller whose request ran gets.
#[derive(Default)]
struct FirstCaller {
    /// The upstream's cookies: never stored, never replayed.
    cookies: std::sync::OnceLock<Vec<HeaderValue>>,
    /// The answer as it came, when it was not stored whole.
    answer: std::sync::Mutex<Option<Response>>,
}

/// The warning on an answer not stored whole whose lease was lost before it was stored.
const LOST_BEFORE_STORED: &str = "299 - \"lease lost before the answer was stored; a retry may run again\"";

/// The warning on the whole answer of a request whose answer was not stored whole.
const FIRST_OF_OMITTED: &str = "299 - \"answer not stored whole; a retry is answered without its body\"";

/// What is stored for an answer that cannot be stored whole (`reason` says why): its
/// status and stored headers (but `Content-Encoding`: there is no body to decode) with an
/// empty body and a `Warning` saying so, or, when even those are over `stored_bytes_max`,
/// the status and the warning alone (which may pass it: `stored_bytes_max` is at least
/// 256 bytes in a checked configuration, so the gate's limit, never below it, holds them).
/// A retry is told the request ran and how it ended, and never runs it again.
fn omitted(
    status: StatusCode,
    headers: Vec<(HeaderName, HeaderValue)>,
    reason: &str,
    stored_bytes_max: usize,
) -> Vec<u8> {
    let text = format!("299 - \"the answer was not stored whole: {reason}; its body is not replayed\"");
    let visible: String =
        text.chars().map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' }).collect();
    let warning = (header::WARNING, HeaderValue::from_str(&visible).expect("visible ASCII"));
    let mut kept: Vec<_> = headers.into_iter().filter(|(name, _)| name != header::CONTENT_ENCODING).collect();
    kept.push(warning.clone());
    let marker = Stored { status, headers: kept, body: Vec::new() }.encode();
    if marker.len() <= stored_bytes_max {
        return marker;
    }
    Stored { status, headers: vec![warning], body: Vec::new() }.encode()
}

/// An answer's body as read: whole, or past the bytes read whole (what was read, then
/// the rest as it comes).
enum Read {
    Whole(axum::body::Bytes),
    Past(Body),
}

/// Reads `body` whole up to `bound` bytes; past it, gives back a body of what was read
/// followed by the rest.
async fn read_up_to(body: Body, bound: usize) -> Result<Read, axum::Error> {
    let mut stream = body.into_data_stream();
    let (mut chunks, mut len) = (Vec::new(), 0);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        len += chunk.len();
        chunks.push(chunk);
        if len > bound {
            let read = futures_util::stream::iter(chunks.into_iter().map(Ok::<_, axum::Error>));
            return Ok(Read::Past(Body::from_stream(read.chain(stream))));
        }
    }
    Ok(Read::Whole(chunks.concat().into()))
}

/// The content coding of an answer, other than `identity`, from any of its
/// `Content-Encoding` lines.
fn encoding(headers: &HeaderMap) -> Option<String> {
    headers.get_all(header::CONTENT_ENCODING).iter().find_map(|value| {
        let coding = String::from_utf8_lossy(value.as_bytes()).trim().to_owned();
        (!coding.is_empty() && !coding.eq_ignore_ascii_case("identity")).then_some(coding)
    })
}

/// A stored answer as a response; `replayed` marks a retry's.
fn replay(bytes: &[u8], replayed: bool) -> Response {
    let Some(stored) = Stored::decode(bytes) else {
        return bad_gateway("the stored answer is in a format this proxy does not read".to_owned())
            .into_response();
    };
    let mut headers: HeaderMap = stored.header_map();
    if replayed {
        headers.insert(HeaderName::from_static("idempotent-replayed"), HeaderValue::from_static("true"));
    }
    (stored.status, headers, stored.body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer not stored whole keeps its stored headers when they fit (but
    /// `Content-Encoding`), and its status and the warning always.
    #[test]
    fn an_omitted_answer_keeps_its_headers_when_they_fit_and_its_status_always() {
        let headers = vec![
            (header::LOCATION, HeaderValue::from_static("/orders/77")),
            (header::CONTENT_ENCODING, HeaderValue::from_static("gzip")),
        ];
        let kept = Stored::decode(&omitted(StatusCode::CREATED, headers.clone(), "why", 1_024)).unwrap();
        assert_eq!((kept.status, kept.body.len(), kept.headers.len()), (StatusCode::CREATED, 0, 2));
        assert_eq!(kept.headers[0], headers[0]);
        assert_eq!(
            kept.headers[1].1,
            "299 - \"the answer was not stored whole: why; its body is not replayed\""
        );
        let bare = Stored::decode(&omitted(StatusCode::CREATED, headers, "why", 100)).unwrap();
        assert_eq!((bare.status, bare.headers.len()), (StatusCode::CREATED, 1));
        assert_eq!(bare.headers[0].0, header::WARNING);
    }

    /// The proxy and both middlewares store the same bytes for an answer not stored
    /// whole, so that each replays the others' (clients/vectors.json).
    #[test]
    fn what_is_stored_for_an_answer_not_stored_whole_is_the_shared_vector() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../clients/vectors.json");
        let vectors: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let cases = vectors["answers_not_stored_whole"].as_array().unwrap();
        assert!(cases.len() >= 3);
        for case in cases {
            let headers = case["headers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|pair| {
                    let name = HeaderName::from_bytes(pair[0].as_str().unwrap().as_bytes()).unwrap();
                    (name, HeaderValue::from_str(pair[1].as_str().unwrap()).unwrap())
                })
                .collect();
            let status = StatusCode::from_u16(case["status"].as_u64().unwrap() as u16).unwrap();
            let max = case["stored_bytes_max"].as_u64().unwrap() as usize;
            let stored = omitted(status, headers, case["reason"].as_str().unwrap(), max);
            let hex: String = stored.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(hex, case["stored_hex"].as_str().unwrap(), "{}", case["reason"]);
        }
    }

    /// A body whose frames the test hands in one at a time.
    #[derive(Default)]
    struct Handed(std::collections::VecDeque<axum::body::Bytes>);

    impl http_body::Body for Handed {
        type Data = axum::body::Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
            match self.0.pop_front() {
                Some(data) => Poll::Ready(Some(Ok(http_body::Frame::data(data)))),
                None => Poll::Pending,
            }
        }
    }

    /// Only the reader's wait for a frame counts against `upstream_body_idle_ms`: a
    /// reader that comes back after longer than that (it committed the answer, or sent
    /// what it read to a slow caller) still gets the next frame. (The deadline ran from
    /// the last frame, so the rest of an answer past the bytes read whole was cut at once
    /// after a slow commit.)
    #[tokio::test(start_paused = true)]
    async fn only_the_readers_wait_counts_against_the_idle_timeout() {
        use http_body::Body as _;
        let idle = Duration::from_millis(100);
        let mut body = IdleBody::new(Handed(["one".into()].into()), idle);
        let mut poll =
            async || std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx))).await;
        assert!(matches!(poll().await, Poll::Ready(Some(Ok(_)))));
        tokio::time::advance(idle * 3).await;
        assert!(poll().await.is_pending(), "the reader was away, not waiting");
        tokio::time::advance(idle / 2).await;
        assert!(poll().await.is_pending());
        tokio::time::advance(idle).await;
        assert!(matches!(poll().await, Poll::Ready(Some(Err(_)))), "it waited longer than idle");
    }

    #[test]
    fn an_encoding_on_any_line_counts() {
        let mut headers = HeaderMap::new();
        headers.append(header::CONTENT_ENCODING, HeaderValue::from_static("identity"));
        headers.append(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        assert_eq!(encoding(&headers).as_deref(), Some("gzip"));
        headers.remove(header::CONTENT_ENCODING);
        headers.append(header::CONTENT_ENCODING, HeaderValue::from_static(" Identity "));
        assert_eq!(encoding(&headers), None);
    }

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_stripped() {
        let mut headers = HeaderMap::new();
        for name in HOP_BY_HOP {
            headers.insert(HeaderName::from_static(name), HeaderValue::from_static("x"));
        }
        headers.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        headers.append(header::CONNECTION, HeaderValue::from_static("x-hop, X-Other-Hop"));
        for name in ["x-hop", "x-other-hop", "content-type", "location"] {
            headers.insert(HeaderName::from_static(name), HeaderValue::from_static("y"));
        }
        strip_hop_by_hop(&mut headers);
        let mut kept: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        kept.sort_unstable();
        assert_eq!(kept, ["content-type", "location"]);
    }

    /// With the default `caller_headers`, a caller's part of a record key is what it was
    /// before the list existed (`c:` and the first 8 bytes of the SHA-256 of its
    /// `Authorization`, the first value when it sends several), so a retry across the
    /// upgrade finds its record and is replayed, never run again.
    #[test]
    fn the_default_caller_keeps_the_key_form_records_were_written_with() {
        let proxy = ProxyConfig::default();
        let mut headers = HeaderMap::new();
        headers.append(header::AUTHORIZATION, HeaderValue::from_static("Bearer alice"));
        // sha256("Bearer alice"), as the proxy hashed it before.
        let before =
            Sha256::digest(b"Bearer alice")[..8].iter().map(|b| format!("{b:02x}")).collect::<String>();
        assert_eq!(proxy.caller(&headers).unwrap(), format!("c:{before}"));
        headers.append(header::AUTHORIZATION, HeaderValue::from_static("Bearer other"));
        assert_eq!(proxy.caller(&headers).unwrap(), format!("c:{before}"), "the first value, as before");
        let refused = proxy.caller(&HeaderMap::new()).unwrap_err();
        assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    }
}
