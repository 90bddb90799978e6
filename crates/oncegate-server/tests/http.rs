//! The HTTP/JSON API on the gRPC port, through the real server on port 0: the whole
//! protocol, refusals as problem documents with the stable code, tenants shared with
//! gRPC, and the OpenAPI document whose examples are run against the server.

mod common;

use common::*;
use oncegate_proto::v1 as pb;
use oncegate_server::{TenantConfig, token_sha256};
use serde_json::{Value, json};

/// Sends `body` (JSON) to `path` as `POST`.
async fn post(server: &Running, path: &str, token: Option<&str>, body: &Value) -> HttpAnswer {
    http(server.addr, "POST", path, token, Some(&body.to_string())).await
}

fn ok(answer: &HttpAnswer) -> &Value {
    assert_eq!(answer.status, 200, "{} {}", answer.headers, answer.body);
    &answer.body
}

/// A problem document with `status` and `code`.
fn problem(answer: &HttpAnswer, status: u16, code: &str) {
    assert_eq!((answer.status, answer.body["code"].as_str()), (status, Some(code)), "{}", answer.body);
    assert_eq!(answer.header("content-type"), Some("application/problem+json"));
    assert_eq!(answer.body["status"], json!(status));
    assert_eq!(answer.body["type"], json!(format!("https://oncegate.dev/problems/{code}")));
    assert!(answer.body["detail"].as_str().is_some_and(|d| !d.is_empty()));
}

#[tokio::test]
async fn the_json_api_runs_the_whole_protocol() {
    let server = start_with(|_| {}).await;
    let reserve = json!({"namespace": "live", "key": "order-1", "fingerprint": "QUJD", "lease_ms": 30000});
    let first = post(&server, "/v1/reserve", None, &reserve).await;
    let granted = &ok(&first)["granted"];
    assert_eq!(first.body["key"], json!("order-1"));
    let token = granted["token"].as_str().expect("64-bit numbers are strings").to_owned();
    assert_eq!(granted["previous"], json!("PREVIOUS_NONE"));
    assert_eq!(granted["lease_until_ms"], json!((T0 + 30_000).to_string()));

    let again = post(&server, "/v1/reserve", None, &reserve).await;
    assert!(ok(&again)["in_progress"]["retry_after_ms"].is_string(), "{}", again.body);
    let other = post(
        &server,
        "/v1/reserve",
        None,
        &json!({"namespace": "live", "key": "order-1", "fingerprint": "WFla"}),
    )
    .await;
    assert!(ok(&other)["mismatch"].is_object(), "{}", other.body);

    let beat = json!({"namespace": "live", "key": "order-1", "token": token, "lease_ms": "60000"});
    assert_eq!(
        ok(&post(&server, "/v1/heartbeat", None, &beat).await)["lease_until_ms"],
        json!((T0 + 60_000).to_string())
    );
    let commit = json!({"namespace": "live", "key": "order-1", "token": token, "outcome": "OUTCOME_SUCCEEDED", "response": "ZmlsbGVk"});
    assert!(ok(&post(&server, "/v1/commit", None, &commit).await)["expires_at_ms"].is_string());

    let replay = post(&server, "/v1/reserve", None, &reserve).await;
    let completed = &ok(&replay)["completed"];
    assert_eq!(
        (&completed["response"], &completed["outcome"]),
        (&json!("ZmlsbGVk"), &json!("OUTCOME_SUCCEEDED"))
    );
    let view = http(server.addr, "GET", "/v1/namespaces/live/keys/order-1", None, None).await;
    assert_eq!(ok(&view)["state"], json!("STATE_COMPLETED"));
    assert_eq!(view.body["token"], json!(token));

    // The same record over gRPC: one engine, one contract.
    let mut client = server.client().await;
    let got = client.get(pb::GetRequest { namespace: "live".into(), key: "order-1".into() }).await.unwrap();
    assert_eq!(got.into_inner().token.to_string(), token);
    server.stop().await;
}

#[tokio::test]
async fn refusals_are_problem_documents_with_the_stable_code() {
    let server = start_with(|c| c.server.message_bytes_max = 70_000).await;
    let granted = post(&server, "/v1/reserve", None, &json!({"namespace": "live", "key": "k"})).await;
    let token: u64 = ok(&granted)["granted"]["token"].as_str().unwrap().parse().unwrap();
    let stale = json!({"namespace": "live", "key": "k", "token": token + 1, "outcome": "OUTCOME_SUCCEEDED"});
    problem(&post(&server, "/v1/commit", None, &stale).await, 409, "lease_lost");
    let missing = json!({"namespace": "live", "key": "nothing", "token": "5"});
    problem(&post(&server, "/v1/release", None, &missing).await, 404, "not_found");

    let long =
        post(&server, "/v1/reserve", None, &json!({"namespace": "live", "key": "k".repeat(700)})).await;
    problem(&long, 400, "invalid_argument");
    assert_eq!(
        (long.body["field"].as_str(), long.body["detail"].as_str()),
        (Some("key"), Some("key is 700 bytes; the limit is 512"))
    );
    let outcome = json!({"namespace": "live", "key": "k", "token": "1", "outcome": "DONE"});
    let bad_outcome = post(&server, "/v1/commit", None, &outcome).await;
    problem(&bad_outcome, 400, "invalid_argument");
    assert_eq!(bad_outcome.body["field"], json!("outcome"));
    let typo =
        post(&server, "/v1/reserve", None, &json!({"namespace": "live", "key": "k", "lease": 5})).await;
    problem(&typo, 400, "invalid_argument");
    assert!(typo.body["detail"].as_str().unwrap().contains("unknown field `lease`"), "{}", typo.body);
    let not_json = http(server.addr, "POST", "/v1/reserve", None, Some("{not json")).await;
    problem(&not_json, 400, "invalid_argument");
    let big = json!({"namespace": "live", "key": "k", "fingerprint": "A".repeat(120_000)});
    problem(&post(&server, "/v1/reserve", None, &big).await, 413, "invalid_argument");
    server.stop().await;
}

#[tokio::test]
async fn the_bearer_token_selects_the_tenant_as_over_grpc() {
    let tenant = |name: &str| TenantConfig {
        name: name.into(),
        token_sha256: token_sha256(name),
        ..TenantConfig::default()
    };
    let server = start_with(|c| {
        c.tenants = vec![tenant("acme"), tenant("globex")];
        c.tenants[0].requests_per_s = 1;
        c.tenants[0].requests_burst_max = 2;
    })
    .await;
    let body = json!({"namespace": "live", "key": "shared-name"});
    let unauthenticated = post(&server, "/v1/reserve", None, &body).await;
    problem(&unauthenticated, 401, "unauthenticated");
    assert_eq!(unauthenticated.header("www-authenticate"), Some("Bearer"));
    problem(&post(&server, "/v1/reserve", Some("wrong"), &body).await, 401, "unauthenticated");
    // Tenants never see each other's keys.
    assert!(ok(&post(&server, "/v1/reserve", Some("acme"), &body).await)["granted"].is_object());
    assert!(ok(&post(&server, "/v1/reserve", Some("globex"), &body).await)["granted"].is_object());
    // acme's rate (1/s, burst 2) is the same limiter the gRPC front uses.
    assert!(ok(&post(&server, "/v1/reserve", Some("acme"), &body).await)["in_progress"].is_object());
    let limited = post(&server, "/v1/reserve", Some("acme"), &body).await;
    problem(&limited, 429, "resource_exhausted");
    assert_eq!(limited.body["limit"], json!("tenants[].requests_per_s"));
    assert_eq!(limited.header("retry-after"), Some("1"));
    server.stop().await;
}

/// The request examples of the OpenAPI document, sent in the order the protocol runs
/// them (the token of each grant put in the calls that follow): each is answered `200`,
/// with the members its documented `200` example has.
#[tokio::test]
async fn the_openapi_examples_run_against_the_server() {
    let server = start_with(|_| {}).await;
    let document = http(server.addr, "GET", "/v1/openapi.json", None, None).await;
    let document = ok(&document).clone();
    assert_eq!(document["openapi"], json!("3.1.0"));
    assert_eq!(document["components"]["securitySchemes"]["bearer"]["scheme"], json!("bearer"));
    let example = |path: &str| {
        document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["example"].clone()
    };
    let documented = |path: &str, method: &str| {
        document["paths"][path][method]["responses"]["200"]["content"]["application/json"]["example"].clone()
    };
    let same_members = |answer: &Value, documented: &Value| {
        let names =
            |v: &Value| v.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>()).unwrap_or_default();
        assert_eq!(names(answer), names(documented), "answer {answer} documented {documented}");
    };
    let with_token = |mut body: Value, token: &Value| {
        body["token"] = token.clone();
        body
    };

    let first = post(&server, "/v1/reserve", None, &example("/v1/reserve")).await;
    same_members(ok(&first), &documented("/v1/reserve", "post"));
    same_members(&first.body["granted"], &documented("/v1/reserve", "post")["granted"]);
    let token = first.body["granted"]["token"].clone();
    for path in ["/v1/heartbeat", "/v1/release"] {
        let answer = post(&server, path, None, &with_token(example(path), &token)).await;
        same_members(ok(&answer), &documented(path, "post"));
    }
    let second = post(&server, "/v1/reserve", None, &example("/v1/reserve")).await;
    let token = ok(&second)["granted"]["token"].clone();
    let committed = post(&server, "/v1/commit", None, &with_token(example("/v1/commit"), &token)).await;
    same_members(ok(&committed), &documented("/v1/commit", "post"));

    let get = "/v1/namespaces/{namespace}/keys/{key}";
    let params = &document["paths"][get]["get"]["parameters"];
    let param = |i: usize| params[i]["example"].as_str().unwrap().to_owned();
    let path = format!("/v1/namespaces/{}/keys/{}", param(0), param(1));
    let view = http(server.addr, "GET", &path, None, None).await;
    same_members(ok(&view), &documented(get, "get"));
    assert_eq!(view.body["state"], json!("STATE_COMPLETED"));
    assert_eq!(view.body["response"], example("/v1/commit")["response"]);
    server.stop().await;
}

/// The port is shared: a path no route serves answers an HTTP client with a `404` problem
/// document and a gRPC client with `UNIMPLEMENTED`, each in its own terms.
#[tokio::test]
async fn unknown_routes_answer_each_protocol_in_its_own_terms() {
    let server = start_with(|_| {}).await;
    let missing = post(&server, "/v1/reserve/extra", None, &json!({})).await;
    problem(&missing, 404, "invalid_argument");
    let wrong_method = http(server.addr, "GET", "/v1/reserve", None, None).await;
    problem(&wrong_method, 405, "invalid_argument");
    assert_eq!(wrong_method.header("allow"), Some("POST"), "{}", wrong_method.headers);
    let mut grpc = tonic::client::Grpc::new(server.channel().await);
    grpc.ready().await.unwrap();
    let codec = tonic_prost::ProstCodec::<(), ()>::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/oncegate.v1.Gate/Nothing");
    let status = grpc.unary(tonic::Request::new(()), path, codec).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unimplemented);
    server.stop().await;
}

#[tokio::test]
async fn keys_holding_a_slash_are_read_percent_encoded_and_bodies_must_be_json() {
    let server = start_with(|_| {}).await;
    let body = json!({"namespace": "live", "key": "orders/77%"});
    assert!(ok(&post(&server, "/v1/reserve", None, &body).await)["granted"].is_object());
    let view = http(server.addr, "GET", "/v1/namespaces/live/keys/orders%2F77%25", None, None).await;
    assert_eq!(ok(&view)["state"], json!("STATE_PENDING"));
    let mut untyped = format!(
        "POST /v1/reserve HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.to_string().len()
    );
    untyped.push_str(&body.to_string());
    let answer = raw(server.addr, &untyped).await;
    assert!(answer.starts_with("HTTP/1.1 415"), "{answer}");
    assert!(answer.contains("application/problem+json"), "{answer}");
    server.stop().await;
}

/// A caller without a valid token learns nothing of its request, not even that its body
/// is malformed.
#[tokio::test]
async fn an_unauthenticated_caller_is_refused_before_its_body_is_judged() {
    let tenant =
        TenantConfig { name: "acme".into(), token_sha256: token_sha256("acme"), ..TenantConfig::default() };
    let server = start_with(|c| c.tenants = vec![tenant]).await;
    let malformed = json!({"namespace": "live", "nonsense": true});
    problem(&post(&server, "/v1/reserve", None, &malformed).await, 401, "unauthenticated");
    problem(&post(&server, "/v1/reserve", Some("acme"), &malformed).await, 400, "invalid_argument");
    server.stop().await;
}

/// Sends `request` as written; the answer as text.
async fn raw(addr: std::net::SocketAddr, request: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    socket.read_to_string(&mut answer).await.unwrap();
    answer
}

/// A key derived from parts over JSON: the answer names the key the shard derived (and,
/// within the grace after a boundary, the previous bucket's that answered).
#[tokio::test]
async fn derived_keys_are_named_in_the_answer() {
    let server = start_with(|_| {}).await;
    let trade = json!({"namespace": "live", "key_parts": ["trade", "BTCUSDT", "buy"], "bucket_ms": "60000", "bucket_grace_ms": 2000});
    let first = post(&server, "/v1/reserve", None, &trade).await;
    let key = ok(&first)["key"].as_str().unwrap().to_owned();
    assert_eq!(key, format!("trade:BTCUSDT:buy::{}", T0 / 60_000));
    let token = first.body["granted"]["token"].clone();
    let commit = json!({"namespace": "live", "key": key, "token": token, "outcome": "OUTCOME_SUCCEEDED", "response": "ZG9uZQ=="});
    ok(&post(&server, "/v1/commit", None, &commit).await);
    // Just past the next boundary, within the grace: the first bucket's key replays.
    server.clock.advance((T0 / 60_000 + 1) * 60_000 - T0 + 500);
    let retry = post(&server, "/v1/reserve", None, &trade).await;
    assert_eq!(
        (ok(&retry)["key"].as_str(), retry.body["completed"]["response"].as_str()),
        (Some(key.as_str()), Some("ZG9uZQ=="))
    );
    server.stop().await;
}

/// tonic's timeout, around every request on the port, takes a `grpc-timeout` header as
/// the call's deadline and answered a JSON caller past it with `200` and a gRPC status in
/// the headers, which a client checking the status took for success. The header is
/// refused over HTTP, before anything is decided.
#[tokio::test]
async fn a_grpc_deadline_header_is_refused_over_http() {
    let server = start_with(|_| {}).await;
    let mut client = server.client().await;
    granted(&client.reserve(reserve("held")).await.unwrap().into_inner());
    let body = json!({"namespace": "live", "key": "held", "wait_ms": 2000}).to_string();
    let request = format!(
        "POST /v1/reserve HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\ngrpc-timeout: 100m\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let answer = raw(server.addr, &request).await;
    let (head, document) = answer.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(head.to_ascii_lowercase().contains("content-type: application/problem+json"), "{answer}");
    let document: Value = serde_json::from_str(document).unwrap();
    assert_eq!(document["code"], json!("invalid_argument"));
    assert!(document["detail"].as_str().unwrap().starts_with("grpc-timeout is a gRPC header"), "{document}");
    server.stop().await;
}

/// HTTP/2 holds a request's headers to `server.metadata_bytes_max` (h2 counts them); over
/// HTTP/1.1 hyper bounded them only by its read buffer, about 400 KiB. The same limit,
/// counted as HTTP/2 counts it, refuses them with `431` before anything is decided.
#[tokio::test]
async fn headers_over_the_metadata_limit_are_refused_over_http1() {
    let server = start_with(|c| c.server.metadata_bytes_max = 4096).await;
    let body = json!({"namespace": "live", "key": "padded"}).to_string();
    let send = |padding: usize| {
        let padding = "p".repeat(padding);
        let body = body.clone();
        async move {
            let headers = [("x-padding", padding.as_str())];
            http_with(server.addr, "POST", "/v1/reserve", &headers, Some(("application/json", &body))).await
        }
    };
    let refused = send(4096).await;
    problem(&refused, 431, "invalid_argument");
    let detail = refused.body["detail"].as_str().unwrap();
    assert!(detail.ends_with("the limit is 4096 (server.metadata_bytes_max)"), "{detail}");
    // Under the limit the same request is served, and granted: the refused one decided
    // nothing.
    assert!(ok(&send(3000).await)["granted"].is_object());
    server.stop().await;
}

/// Each refusal an operation answers before its call is decided, provoked on every
/// operation, is among the responses the OpenAPI document gives that operation; so are
/// the refusals of the call path (`429`, `503`), which need load or a failed store.
#[tokio::test]
async fn every_refusal_an_operation_answers_is_in_its_openapi_responses() {
    let server = start_with(|c| {
        c.server.metadata_bytes_max = 4096;
        c.server.message_bytes_max = 70_000;
        c.tenants = vec![TenantConfig {
            name: "acme".into(),
            token_sha256: token_sha256("acme"),
            ..TenantConfig::default()
        }];
    })
    .await;
    let document = http(server.addr, "GET", "/v1/openapi.json", None, None).await;
    let document = ok(&document).clone();
    let bearer = ("Authorization", "Bearer acme");
    let padding = "p".repeat(4096);
    let padded = ("x-padding", padding.as_str());
    let get_path = "/v1/namespaces/live/keys/k";
    let long_get_path = format!("/v1/namespaces/live/keys/{}", "k".repeat(700));
    let big = json!({"namespace": "live", "key": "k", "fingerprint": "A".repeat(120_000)}).to_string();
    let json_body = |body: &'static str| Some(("application/json", body));
    for path in ["/v1/reserve", "/v1/commit", "/v1/release", "/v1/heartbeat", get_path] {
        let (method, documented_path) =
            if path == get_path { ("get", "/v1/namespaces/{namespace}/keys/{key}") } else { ("post", path) };
        let verb = method.to_ascii_uppercase();
        let body = (method == "post").then_some(("application/json", r#"{"namespace": "live", "key": "k"}"#));
        let mut provoked = vec![
            (401, http_with(server.addr, &verb, path, &[], body).await),
            (431, http_with(server.addr, &verb, path, &[bearer, padded], body).await),
        ];
        if method == "post" {
            provoked
                .push((400, http_with(server.addr, &verb, path, &[bearer], json_body("{not json")).await));
            provoked.push((
                413,
                http_with(server.addr, &verb, path, &[bearer], Some(("application/json", &big))).await,
            ));
            let text = Some(("text/plain", r#"{"namespace": "live", "key": "k"}"#));
            provoked.push((415, http_with(server.addr, &verb, path, &[bearer], text).await));
        } else {
            provoked.push((400, http_with(server.addr, &verb, &long_get_path, &[bearer], None).await));
        }
        let responses = &document["paths"][documented_path][method]["responses"];
        for (status, answer) in &provoked {
            assert_eq!(answer.status, *status, "{verb} {path}: {}", answer.body);
            assert_eq!(answer.header("content-type"), Some("application/problem+json"), "{verb} {path}");
            let documented = &responses[status.to_string()];
            assert_eq!(
                documented["content"]["application/problem+json"]["schema"]["$ref"],
                json!("#/components/schemas/Problem"),
                "{verb} {path} answers {status}, which its OpenAPI responses do not give: {responses}"
            );
        }
        for status in ["429", "503"] {
            assert!(responses[status].is_object(), "{verb} {path} does not document {status}: {responses}");
        }
    }
    server.stop().await;
}

/// Bytes are read as protobuf's JSON mapping writes them in any of its forms (the
/// standard or the URL-safe alphabet, padded or not) and `null` as a field's default:
/// a client library that sends URL-safe base64, or nulls for unset fields, was refused
/// `400`. The answers write standard padded base64.
#[tokio::test]
async fn bytes_in_either_base64_alphabet_and_null_fields_are_read() {
    let server = start_with(|_| {}).await;
    let reserve = |fingerprint: &str| json!({"namespace": "live", "key": "forms", "fingerprint": fingerprint, "wait_ms": null, "key_parts": null});
    // 0xfb 0xff: `-_8` URL-safe unpadded, `+/8=` standard padded.
    let first = post(&server, "/v1/reserve", None, &reserve("-_8")).await;
    let token = ok(&first)["granted"]["token"].clone();
    for same in ["+/8=", "+/8", "-_8="] {
        let again = post(&server, "/v1/reserve", None, &reserve(same)).await;
        assert!(ok(&again)["in_progress"].is_object(), "{same} is the same fingerprint: {}", again.body);
    }
    let commit = json!({"namespace": "live", "key": "forms", "token": token, "outcome": "OUTCOME_SUCCEEDED", "response": "-_8"});
    assert!(ok(&post(&server, "/v1/commit", None, &commit).await)["expires_at_ms"].is_string());
    let view = http(server.addr, "GET", "/v1/namespaces/live/keys/forms", None, None).await;
    assert_eq!(ok(&view)["response"], json!("+/8="));
    server.stop().await;
}

/// A body still arriving at the call's deadline is given up with a `408` problem
/// document, before tonic's own timeout would answer `200` with a gRPC status (which a
/// client that checks the HTTP status took for success).
#[tokio::test]
async fn a_body_that_does_not_arrive_by_the_deadline_is_answered_408() {
    let server = start_with(|c| {
        c.engine.limits.wait_ms_max = 500;
        c.server.request_timeout_ms = 1_500;
    })
    .await;
    let request = "POST /v1/reserve HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
        Content-Type: application/json\r\nContent-Length: 40\r\n\r\n{\"namespace\": ";
    let answer = raw(server.addr, request).await;
    let (head, document) = answer.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(!head.to_ascii_lowercase().contains("grpc-status"), "{answer}");
    let document: Value = serde_json::from_str(document).unwrap();
    assert_eq!(document["code"], json!("unavailable"), "{document}");
    assert!(document["detail"].as_str().unwrap().starts_with("the body did not arrive within 1000 ms"));
    server.stop().await;
}

/// A body whose `Content-Length` is over the limit is refused at once, before any of it
/// is read.
#[tokio::test]
async fn a_body_declared_over_the_limit_is_answered_413_at_once() {
    let server = start_with(|_| {}).await;
    let request = "POST /v1/reserve HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
        Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n";
    let answer = raw(server.addr, request).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("the body is 100000000 bytes; the limit is"), "{answer}");
    server.stop().await;
}

/// A gRPC method asked as plain HTTP gets a problem document, not tonic's `200` with a
/// `grpc-status` header.
#[tokio::test]
async fn a_grpc_method_asked_as_json_is_answered_with_a_problem_document() {
    let server = start_with(|_| {}).await;
    for path in ["/oncegate.v1.Gate/Reserve", "/oncegate.v1.Admin/Stats", "/grpc.health.v1.Health/Check"] {
        let asked = post(&server, path, None, &json!({"namespace": "live", "key": "k"})).await;
        problem(&asked, 415, "invalid_argument");
        assert!(asked.header("grpc-status").is_none(), "{path}: {}", asked.headers);
    }
    server.stop().await;
}

/// Without tenants the port is an open development server, and a request addressed to
/// any other host than a loopback name or address is refused: a web page whose name a
/// DNS-rebinding attack points at 127.0.0.1 could otherwise call every service on it
/// (Admin's purge included) from a browser on this machine.
#[tokio::test]
async fn without_tenants_only_requests_addressed_to_loopback_are_answered() {
    let server = start_with(|_| {}).await;
    let body = json!({"namespace": "live", "key": "rebound"}).to_string();
    let rebound = format!(
        "POST /v1/reserve HTTP/1.1\r\nHost: attacker.example:50051\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let answer = raw(server.addr, &rebound).await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(answer.contains("attacker.example"), "{answer}");
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .origin("http://attacker.example:50051".parse().unwrap())
        .connect()
        .await
        .unwrap();
    let mut client = pb::gate_client::GateClient::new(channel);
    let status = client.reserve(reserve("rebound")).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    let mut local = server.client().await;
    granted(&local.reserve(reserve("rebound")).await.unwrap().into_inner());
    drop(local);
    server.stop().await;
}
