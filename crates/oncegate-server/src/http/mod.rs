//! The HTTP/JSON form of the `Gate` API, served on the gRPC port (tonic's server takes
//! HTTP/1.1 too): `POST /v1/reserve`, `/v1/commit`, `/v1/release`, `/v1/heartbeat`,
//! `GET /v1/namespaces/{namespace}/keys/{key}`, and the OpenAPI 3.1 document generated
//! from this code at `/v1/openapi.json`.
//!
//! A body is translated to its proto message (`json.rs`) and takes the gRPC front's own
//! call path (`GateService::begin`): the same bearer token and tenant, admission limits,
//! metrics, engine and `decide`. Only the last step differs: a refusal becomes an
//! `application/problem+json` document through [`problem`], this front's one mapping
//! from codes to HTTP statuses.

mod json;

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use oncegate_core::{Code, Tenant};
use oncegate_listen::Problem;
use oncegate_proto::v1 as pb;
use serde::Serialize;
use tokio::time::Instant;
use utoipa::OpenApi;

use crate::gate::{Call, Deadline, GateService};
use crate::status::Refusal;
use json::{
    Body, CommitAnswer, CommitBody, GetAnswer, HeartbeatAnswer, HeartbeatBody, ReleaseAnswer, ReleaseBody,
    ReserveAnswer, ReserveBody,
};

/// When a request for the router reached the port: tonic's request timeout counts from
/// about then, and the HTTP API must answer before it does, however long the body took.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Arrived(pub tokio::time::Instant);

/// Where the OpenAPI document is served.
pub const OPENAPI_PATH: &str = "/v1/openapi.json";

/// What every HTTP call needs: the gRPC front's call path, how long to wait for it, and
/// the header limit that HTTP/2 enforces below it and HTTP/1.1 does not.
#[derive(Clone)]
pub(crate) struct Http {
    gate: GateService,
    /// From the request's arrival, [`answer_within`] of `server.request_timeout_ms`.
    answer_within: Duration,
    /// `server.metadata_bytes_max`, counted as HTTP/2 counts a header list.
    header_bytes_max: usize,
    /// The largest body: `server.message_bytes_max` and a third (base64), and 1 KiB.
    body_bytes_max: usize,
}

/// How long an HTTP call may take from its arrival: `server.request_timeout_ms` less
/// half a second. So the call answers with a problem document before tonic's own timeout,
/// which would answer in gRPC's terms (an HTTP `200` with a gRPC status in its headers),
/// and still after the longest wait a reserve may ask for, since the configuration holds
/// the request timeout a second above `engine.limits.wait_ms_max`.
fn answer_within(request_timeout: Duration) -> Duration {
    request_timeout.saturating_sub(ANSWER_MARGIN)
}

const ANSWER_MARGIN: Duration = Duration::from_millis(500);

/// The routes of the HTTP API. Bodies are limited to `message_bytes_max` (the gRPC
/// message limit) plus a third, since base64 makes bytes a third longer; headers to
/// `header_bytes_max`, as a gRPC call's metadata is.
pub(crate) fn router(gate: GateService, message_bytes_max: usize, header_bytes_max: usize) -> axum::Router {
    let document: Arc<str> = openapi_json().into();
    let answer_within = answer_within(gate.request_timeout);
    let body_bytes_max = message_bytes_max + message_bytes_max / 3 + 1_024;
    let http = Http { gate, answer_within, header_bytes_max, body_bytes_max };
    axum::Router::new()
        .route("/v1/reserve", post(reserve))
        .route("/v1/commit", post(commit))
        .route("/v1/release", post(release))
        .route("/v1/heartbeat", post(heartbeat))
        .route("/v1/namespaces/{namespace}/keys/{key}", get(key))
        .with_state(http)
        .route(OPENAPI_PATH, get(move || openapi(Arc::clone(&document))))
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body_bytes_max))
}

/// What the shared port answers when no route matches: gRPC's `unimplemented` to a gRPC
/// call, a `404` problem document to anything else (tonic's fallback would answer an
/// HTTP client `200` with a gRPC status in its headers).
pub(crate) async fn fallback(request: axum::extract::Request) -> Response {
    let grpc = request
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    if grpc {
        return tonic::Status::unimplemented("").into_http::<axum::body::Body>().into_response();
    }
    let detail = format!(
        "no route {} {}; the API is described at {OPENAPI_PATH}",
        request.method(),
        request.uri().path()
    );
    problem_document(StatusCode::NOT_FOUND, Code::InvalidArgument, detail, None, None, None)
}

/// A request this server does not answer for the host it names (`dispatch.rs`): `403`.
pub(crate) fn forbidden(detail: String) -> Response {
    problem_document(StatusCode::FORBIDDEN, Code::Unauthenticated, detail, None, None, None)
}

/// A gRPC method asked as plain HTTP (no `application/grpc` content type): a `415`
/// problem document pointing at the JSON API.
pub(crate) fn grpc_method_over_http(method: &axum::http::Method, path: &str) -> Response {
    let detail = format!(
        "{method} {path} is a gRPC method: send it as application/grpc; the HTTP/JSON API is described at \
         {OPENAPI_PATH}"
    );
    problem_document(StatusCode::UNSUPPORTED_MEDIA_TYPE, Code::InvalidArgument, detail, None, None, None)
}

/// A known path asked with another method: a `405` problem document (axum adds `Allow`),
/// where axum alone answers with an empty body.
async fn method_not_allowed(request: axum::extract::Request) -> Response {
    let detail = format!(
        "{} is not a method of {}; the API is described at {OPENAPI_PATH}",
        request.method(),
        request.uri().path()
    );
    problem_document(StatusCode::METHOD_NOT_ALLOWED, Code::InvalidArgument, detail, None, None, None)
}

async fn openapi(document: Arc<str>) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], document.to_string()).into_response()
}

/// The one path of every HTTP call: authenticate, then the gRPC front's path for the
/// translated message; the answer as JSON or a problem document. `message` is the
/// request's message, or the answer to a request that has none (a malformed body). A
/// call refused before that path is counted here, as the path counts the calls it takes.
async fn call<M: Call, A: Serialize>(
    http: &Http,
    request: &Head,
    message: Result<M, Unread>,
    answer: impl FnOnce(M::Reply) -> A,
) -> Response {
    let tenant = http.gate.auth().tenant_of_headers(&request.headers);
    let message = match admissible(http, request, message, &tenant) {
        Ok(message) => message,
        Err((code, Unread(refused))) => {
            crate::telemetry::record_call(M::RPC, tenant.as_ref().ok(), code.as_str(), request.arrived);
            return *refused;
        }
    };
    let deadline = Deadline {
        from: request.arrived,
        within: http.answer_within,
        limit: "server.request_timeout_ms less 500 ms, from the request's arrival",
    };
    let headers = &request.headers;
    let caller = crate::traces::caller_span("http", |key| headers.get(key).and_then(|v| v.to_str().ok()));
    let started = caller.in_scope(|| http.gate.begin(tenant, message, Some(deadline)));
    match started.await {
        Ok((reply, _)) => Json(answer(reply)).into_response(),
        Err(refusal) => problem(&refusal),
    }
}

/// The refusals of an HTTP call before the gRPC front's path: headers over the limit, a
/// gRPC deadline header, a caller not authenticated, a message that could not be read.
fn admissible<M>(
    http: &Http,
    request: &Head,
    message: Result<M, Unread>,
    tenant: &Result<Tenant, Refusal>,
) -> Result<M, (Code, Unread)> {
    if request.header_bytes > http.header_bytes_max {
        let detail = format!(
            "the request's headers are {} bytes (each name and value, and 32 bytes a header, as HTTP/2 counts \
             them); the limit is {} (server.metadata_bytes_max)",
            request.header_bytes, http.header_bytes_max
        );
        let status = StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE;
        return Err((
            Code::InvalidArgument,
            problem_document(status, Code::InvalidArgument, detail, None, None, None).into(),
        ));
    }
    // tonic's timeout, around every request on the port, would take this header as the
    // call's deadline and answer in gRPC's terms when it passed.
    if request.headers.contains_key(GRPC_TIMEOUT) {
        let detail = format!(
            "{GRPC_TIMEOUT} is a gRPC header; an HTTP call's deadline is server.request_timeout_ms less {} ms",
            ANSWER_MARGIN.as_millis()
        );
        let status = StatusCode::BAD_REQUEST;
        return Err((
            Code::InvalidArgument,
            problem_document(status, Code::InvalidArgument, detail, None, None, None).into(),
        ));
    }
    match (message, tenant) {
        (Ok(message), _) => Ok(message),
        // An unauthenticated caller learns nothing of its request, not even that it is
        // malformed.
        (Err(_), Err(refusal)) => Err((refusal.code(), problem(refusal).into())),
        (Err(malformed), Ok(_)) => Err((Code::InvalidArgument, malformed)),
    }
}

/// The answer to a request refused before the call path, such as one whose message could
/// not be read (boxed: it is the rare path).
struct Unread(Box<Response>);

impl From<Response> for Unread {
    fn from(response: Response) -> Unread {
        Unread(Box::new(response))
    }
}

/// A body as an operation reads it: its JSON, or the answer saying why not. A body whose
/// `Content-Length` is over the limit is refused at once (`413`), and one that has not
/// arrived by the call's deadline is given up (`408`): reading it is part of the call,
/// which answers before tonic's own timeout would (in gRPC's terms, an HTTP `200`).
struct BodyOf<B>(Result<B, Unread>);

impl<B: serde::de::DeserializeOwned> FromRequest<Http> for BodyOf<B> {
    type Rejection = std::convert::Infallible;

    async fn from_request(request: axum::extract::Request, http: &Http) -> Result<Self, Self::Rejection> {
        let arrived = request.extensions().get::<Arrived>().map_or_else(Instant::now, |Arrived(at)| *at);
        let length =
            request.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse().ok());
        if let Some(length) = length.filter(|length: &u64| *length > http.body_bytes_max as u64) {
            let detail = format!(
                "the body is {length} bytes; the limit is {} (server.message_bytes_max and a third, for base64)",
                http.body_bytes_max
            );
            let status = StatusCode::PAYLOAD_TOO_LARGE;
            return Ok(BodyOf(Err(problem_document(
                status,
                Code::InvalidArgument,
                detail,
                None,
                None,
                None,
            )
            .into())));
        }
        let read =
            tokio::time::timeout_at(arrived + http.answer_within, Json::<B>::from_request(request, http));
        Ok(BodyOf(match read.await {
            Ok(Ok(Json(body))) => Ok(body),
            Ok(Err(rejection)) => Err(bad_body(&rejection).into()),
            Err(_) => {
                let detail = format!(
                    "the body did not arrive within {} ms (server.request_timeout_ms less {} ms, from the \
                     request's arrival)",
                    http.answer_within.as_millis(),
                    ANSWER_MARGIN.as_millis()
                );
                let status = StatusCode::REQUEST_TIMEOUT;
                Err(problem_document(status, Code::Unavailable, detail, None, None, None).into())
            }
        }))
    }
}

/// What [`call`] needs of a request besides its message, extracted with it.
struct Head {
    headers: HeaderMap,
    /// The header list's size as HTTP/2 counts it (RFC 9113, 6.5.2): each name and value
    /// and 32 bytes a field.
    header_bytes: usize,
    /// When it reached the port (now, for a router used without the dispatch), on tokio's
    /// clock, as its deadline is.
    arrived: Instant,
}

impl<S: Send + Sync> FromRequestParts<S> for Head {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Head, Self::Rejection> {
        let arrived = parts.extensions.get::<Arrived>().map_or_else(Instant::now, |Arrived(at)| *at);
        let header_bytes = header_list_bytes(&parts.headers);
        Ok(Head { headers: parts.headers.clone(), header_bytes, arrived })
    }
}

/// HTTP/2's measure of a header list, so that `server.metadata_bytes_max` means the same
/// over HTTP/1.1, where hyper bounds headers only by its read buffer (about 400 KiB).
fn header_list_bytes(headers: &HeaderMap) -> usize {
    headers.iter().map(|(name, value)| name.as_str().len() + value.len() + 32).sum()
}

const GRPC_TIMEOUT: &str = "grpc-timeout";

/// The four `POST` operations: the body, then [`call`].
async fn handle<B: Body>(State(http): State<Http>, head: Head, BodyOf(body): BodyOf<B>) -> Response {
    let message = body.and_then(|body| body.into_wire().map_err(|refusal| problem(&refusal).into()));
    call(&http, &head, message, B::answer).await
}

/// A body that is not the operation's JSON: `400` as every invalid argument (axum says
/// `422` for a body that parses but does not fit), `413` when it is over the limit, `415`
/// when it is not `application/json`; the detail says why.
fn bad_body(rejection: &JsonRejection) -> Response {
    let status = match rejection.status() {
        status @ (StatusCode::PAYLOAD_TOO_LARGE | StatusCode::UNSUPPORTED_MEDIA_TYPE) => status,
        _ => StatusCode::BAD_REQUEST,
    };
    let detail = rejection.body_text();
    problem_document(status, Code::InvalidArgument, detail, None, None, None)
}

/// Asks whether an attempt may proceed.
///
/// Every answer of the contract is `200`: `granted` (proceed, with the fencing token),
/// `in_progress` (another attempt holds the key), `completed` (replay the stored
/// response) or `mismatch` (the key belongs to another payload).
#[utoipa::path(
    post, path = "/v1/reserve", tag = "gate",
    request_body(content = ReserveBody, example = json!({
        "namespace": "live", "key": "order-1001", "lease_ms": "30000", "fingerprint": "c2hhMjU2OmFiYzEyMw=="
    })),
    responses(
        (status = 200, body = ReserveAnswer, example = json!({
            "key": "order-1001",
            "granted": {"token": "4294967297", "attempt": 1, "lease_until_ms": "1764500430000", "lease_ms": "30000", "expires_at_ms": "1764586800000", "previous": "PREVIOUS_NONE"}
        })),
        Refused,
        BodyRefused,
    ),
    security((), ("bearer" = [])),
)]
async fn reserve(http: State<Http>, head: Head, body: BodyOf<ReserveBody>) -> Response {
    handle(http, head, body).await
}

/// Stores the holder's outcome and response; later reserves replay them.
#[utoipa::path(
    post, path = "/v1/commit", tag = "gate",
    request_body(content = CommitBody, example = json!({
        "namespace": "live", "key": "order-1001", "token": "4294967297", "outcome": "OUTCOME_SUCCEEDED", "response": "eyJvcmRlciI6NzcxfQ=="
    })),
    responses(
        (status = 200, body = CommitAnswer, example = json!({"expires_at_ms": "1764586810000"})),
        (status = 404, description = "no live record", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`lease_lost` (another attempt took over) or `conflict` (another outcome is stored)", body = Problem, content_type = "application/problem+json"),
        Refused,
        BodyRefused,
    ),
    security((), ("bearer" = [])),
)]
async fn commit(http: State<Http>, head: Head, body: BodyOf<CommitBody>) -> Response {
    handle(http, head, body).await
}

/// Gives the key up so that a retry may proceed.
#[utoipa::path(
    post, path = "/v1/release", tag = "gate",
    request_body(content = ReleaseBody, example = json!({"namespace": "live", "key": "order-1001", "token": "4294967297"})),
    responses(
        (status = 200, body = ReleaseAnswer, example = json!({})),
        (status = 404, body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`lease_lost` or `already_completed`", body = Problem, content_type = "application/problem+json"),
        Refused,
        BodyRefused,
    ),
    security((), ("bearer" = [])),
)]
async fn release(http: State<Http>, head: Head, body: BodyOf<ReleaseBody>) -> Response {
    handle(http, head, body).await
}

/// Renews the holder's lease while it works.
#[utoipa::path(
    post, path = "/v1/heartbeat", tag = "gate",
    request_body(content = HeartbeatBody, example = json!({"namespace": "live", "key": "order-1001", "token": "4294967297", "lease_ms": "30000"})),
    responses(
        (status = 200, body = HeartbeatAnswer, example = json!({"lease_until_ms": "1764500440000", "expires_at_ms": "1764586800000"})),
        (status = 404, body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`lease_lost` or `already_completed`", body = Problem, content_type = "application/problem+json"),
        Refused,
        BodyRefused,
    ),
    security((), ("bearer" = [])),
)]
async fn heartbeat(http: State<Http>, head: Head, body: BodyOf<HeartbeatBody>) -> Response {
    handle(http, head, body).await
}

/// What a key holds now (a read: no write, no fsync).
///
/// A key holding `/` is sent percent-encoded (`%2F`).
#[utoipa::path(
    get, path = "/v1/namespaces/{namespace}/keys/{key}", tag = "gate",
    params(("namespace" = String, Path, example = "live"), ("key" = String, Path, example = "order-1001")),
    responses(
        (status = 200, body = GetAnswer, example = json!({
            "state": "STATE_COMPLETED", "token": "4294967297", "attempt": 1, "lease_until_ms": "1764500430000",
            "expires_at_ms": "1764586810000", "outcome": "OUTCOME_SUCCEEDED", "response": "eyJvcmRlciI6NzcxfQ=="
        })),
        Refused,
    ),
    security((), ("bearer" = [])),
)]
async fn key(
    State(http): State<Http>,
    head: Head,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    let message = path.map(|Path((namespace, key))| pb::GetRequest { namespace, key }).map_err(|rejection| {
        let detail = rejection.body_text();
        problem_document(StatusCode::BAD_REQUEST, Code::InvalidArgument, detail, None, None, None).into()
    });
    call(&http, &head, message, GetAnswer::from_wire).await
}

/// The refusals every operation may answer, each a problem document (docs/semantics.md,
/// the error table). A type for the OpenAPI document only: answers are built by
/// [`problem`] and [`problem_document`].
#[derive(utoipa::IntoResponses)]
#[expect(dead_code, reason = "describes the answers in the OpenAPI document; never built")]
enum Refused {
    /// A field is outside its limit or malformed, or the request carries a gRPC header.
    #[response(status = 400, content_type = "application/problem+json")]
    BadRequest(Problem),
    /// No bearer token, or an unknown one, on a server with tenants.
    #[response(status = 401, content_type = "application/problem+json")]
    Unauthenticated(Problem),
    /// A queue or a tenant's limit is full; `Retry-After` says when to try again.
    #[response(status = 429, content_type = "application/problem+json")]
    Exhausted(Problem),
    /// The headers are over `server.metadata_bytes_max`.
    #[response(status = 431, content_type = "application/problem+json")]
    HeadersTooLarge(Problem),
    /// The key's shard or the store is down, or the call's deadline passed: nothing was
    /// granted.
    #[response(status = 503, content_type = "application/problem+json")]
    Unavailable(Problem),
}

/// The refusals of an operation with a body, besides [`Refused`].
#[derive(utoipa::IntoResponses)]
#[expect(dead_code, reason = "describes the answers in the OpenAPI document; never built")]
enum BodyRefused {
    /// The body did not arrive before the call's deadline.
    #[response(status = 408, content_type = "application/problem+json")]
    TooSlow(Problem),
    /// The body is over `server.message_bytes_max` (and a third, for base64).
    #[response(status = 413, content_type = "application/problem+json")]
    TooLarge(Problem),
    /// The body is not `application/json`.
    #[response(status = 415, content_type = "application/problem+json")]
    NotJson(Problem),
}

/// This front's one mapping from a refusal to its HTTP answer (the HTTP column of the
/// error table in docs/semantics.md).
pub(crate) fn problem(refusal: &Refusal) -> Response {
    let code = refusal.code();
    let (field, limit) = refusal.detail();
    let retry_after_ms = refusal.retry_after_ms();
    problem_document(http_status(code), code, refusal.to_string(), field, limit, retry_after_ms)
}

fn http_status(code: Code) -> StatusCode {
    match code {
        Code::InvalidArgument => StatusCode::BAD_REQUEST,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::LeaseLost | Code::Conflict | Code::AlreadyCompleted => StatusCode::CONFLICT,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        // A code added to the core later reaches HTTP callers as an error, not as success.
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn problem_document(
    status: StatusCode,
    code: Code,
    detail: String,
    field: Option<&'static str>,
    limit: Option<&'static str>,
    retry_after_ms: Option<u64>,
) -> Response {
    let title = status.canonical_reason().unwrap_or("Error");
    let mut document = Problem::new(status, title, code.as_str(), detail);
    document.field = field;
    document.limit = limit;
    document.retry_after_s = retry_after_ms.map(oncegate_listen::problem::retry_after_s);
    document.into_response()
}

/// The OpenAPI document, generated from the handlers and body types above.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "oncegate",
        description = "An idempotency gate: durably and at most once per key, may this attempt proceed? \
            The HTTP/JSON form of the gRPC service oncegate.v1.Gate; docs/semantics.md is the contract."
    ),
    paths(reserve, commit, release, heartbeat, key),
    components(schemas(Problem)),
    modifiers(&BearerToken),
)]
struct ApiDoc;

/// The bearer token that selects the tenant (not needed by a server without tenants).
struct BearerToken;

impl utoipa::Modify for BearerToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        let scheme = HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build();
        components.add_security_scheme("bearer", SecurityScheme::Http(scheme));
    }
}

/// The OpenAPI document as served, for tools that want it without a server.
pub fn openapi_json() -> String {
    ApiDoc::openapi().to_pretty_json().expect("the document serialises")
}

#[cfg(test)]
mod tests {
    use oncegate_core::ReserveReply;
    use oncegate_engine::{Engine, EngineConfig, ReserveRequest};
    use tower::ServiceExt;

    use super::*;
    use crate::auth::Auth;
    use crate::tenants::Admit;

    fn reserve() -> ReserveRequest {
        ReserveRequest { namespace: "live".into(), key: "k".into(), ..ReserveRequest::default() }
    }

    /// A request's arrival and its deadline are read from one clock, tokio's. (The
    /// arrival was read from the standard clock, so on a tokio clock that had moved on,
    /// paused in tests or not, a request that had just arrived was past its deadline and
    /// refused as not started.) The clock is moved a minute ahead of the standard one and
    /// then runs on, so that the shard's answer is awaited in real time.
    #[tokio::test]
    async fn a_request_is_timed_on_the_clock_its_deadline_is_on() {
        let dir = tempfile::tempdir().unwrap();
        let config = EngineConfig { data_dir: dir.path().to_owned(), shards: 1, ..EngineConfig::default() };
        let engine = Engine::open(config).expect("the engine opens");
        let tenant = Tenant::default_tenant();
        let token = match engine.reserve(&tenant, reserve()).await.unwrap().reply {
            ReserveReply::Granted { token, .. } => token,
            other => panic!("expected a grant, got {other:?}"),
        };
        let admit = Admit::new(64, &[], engine.clock().clone());
        let session = crate::gate::SessionLimits { calls_in_flight_max: 1, unsent_bytes_max: 1 << 20 };
        let gate = GateService::new(engine.clone(), Auth::new(&[]), admit, session, Duration::from_secs(2));
        tokio::time::pause();
        tokio::time::advance(Duration::from_secs(60)).await;
        tokio::time::resume();

        let body = serde_json::json!({"namespace": "live", "key": "k", "token": token.to_string()});
        let request = axum::http::Request::post("/v1/release")
            .header(header::CONTENT_TYPE, "application/json")
            .body(axum::body::Body::from(body.to_string()))
            .unwrap();
        let answer = router(gate, 1 << 20, 16 << 10).oneshot(request).await.unwrap();
        assert_eq!(answer.status(), StatusCode::OK, "the release is answered within its deadline");
        match engine.reserve(&tenant, reserve()).await.unwrap().reply {
            ReserveReply::Granted { .. } => {}
            other => panic!("the release must have freed the key: {other:?}"),
        }
    }

    /// The configuration holds `server.request_timeout_ms` at least a second above
    /// `engine.limits.wait_ms_max`; at that least, an HTTP call still outlasts the longest
    /// wait (nine tenths of the timeout did not, past a 9 s wait).
    #[test]
    fn an_http_call_outlasts_the_longest_wait_the_configuration_allows() {
        for wait_ms_max in [0, 5_000, 30_000, 600_000] {
            let least = Duration::from_millis(wait_ms_max + 1_000);
            assert!(answer_within(least) > Duration::from_millis(wait_ms_max), "{wait_ms_max}");
        }
    }
}
