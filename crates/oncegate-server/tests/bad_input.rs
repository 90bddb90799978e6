//! A table of malformed requests over gRPC: sizes at and over every limit, invalid UTF-8,
//! unknown enum values, token 0, ttl and lease bounds, bad key parts and buckets,
//! oversized messages and metadata, and garbage bytes on the socket. Each is answered
//! with the right status naming the field, nothing changes in the store, and the server
//! stays up.

use std::io::{Read, Write};

use oncegate_engine::EngineConfig;
use oncegate_proto::v1 as pb;
use oncegate_proto::v1::gate_client::GateClient;
use oncegate_proto::{CODE_METADATA, FIELD_METADATA};
use oncegate_server::Config;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

mod common;

use common::{RawReserve, start_in};

async fn raw_reserve(channel: Channel, message: RawReserve) -> Result<(), Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.map_err(|e| Status::unknown(e.to_string()))?;
    let codec: tonic_prost::ProstCodec<RawReserve, pb::ReserveResponse> = tonic_prost::ProstCodec::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/oncegate.v1.Gate/Reserve");
    grpc.unary(Request::new(message), path, codec).await.map(drop)
}

fn reserve(key: &str) -> pb::ReserveRequest {
    pb::ReserveRequest { namespace: "live".into(), key: key.into(), ..Default::default() }
}

fn parts(parts: &[&str], bucket_ms: u64) -> pb::ReserveRequest {
    pb::ReserveRequest {
        namespace: "live".into(),
        key_parts: parts.iter().map(|p| p.to_string()).collect(),
        bucket_ms,
        ..Default::default()
    }
}

fn commit(token: u64, outcome: i32, response: usize) -> pb::CommitRequest {
    pb::CommitRequest {
        namespace: "live".into(),
        key: "held".into(),
        token,
        outcome,
        response: vec![b'r'; response],
    }
}

/// What a case must get: `Ok` (at a limit), or a code with the field it names.
enum Expect {
    Ok,
    Invalid(&'static str),
    Code(&'static [Code]),
}

/// One call of a case.
enum Call {
    Reserve(pb::ReserveRequest),
    /// A reserve whose bytes a typed request cannot hold (invalid UTF-8).
    RawReserve(RawReserve),
    Commit(pb::CommitRequest),
    Release(pb::ReleaseRequest),
    Heartbeat(pb::HeartbeatRequest),
    Get(pb::GetRequest),
}

const DAY_MS: u64 = 86_400_000;

fn long(n: usize) -> String {
    "k".repeat(n)
}

fn with_reserve(
    name: &'static str,
    request: pb::ReserveRequest,
    expect: Expect,
) -> (&'static str, Call, Expect) {
    (name, Call::Reserve(request), expect)
}

fn raw(namespace: &[u8], key: &[u8], key_parts: Vec<Vec<u8>>, bucket_ms: u64) -> Call {
    Call::RawReserve(RawReserve { namespace: namespace.to_vec(), key: key.to_vec(), key_parts, bucket_ms })
}

/// The reserves: one row per field rule, at and over each limit.
fn reserve_cases() -> Vec<(&'static str, Call, Expect)> {
    use Expect::{Invalid, Ok};
    let r = reserve;
    vec![
        with_reserve(
            "namespace empty",
            pb::ReserveRequest { namespace: "".into(), ..r("a") },
            Invalid("namespace"),
        ),
        with_reserve(
            "namespace 65 bytes",
            pb::ReserveRequest { namespace: "n".repeat(65), ..r("a") },
            Invalid("namespace"),
        ),
        with_reserve(
            "namespace with a slash",
            pb::ReserveRequest { namespace: "live/test".into(), ..r("a") },
            Invalid("namespace"),
        ),
        with_reserve(
            "namespace non-ascii",
            pb::ReserveRequest { namespace: "живой".into(), ..r("a") },
            Invalid("namespace"),
        ),
        with_reserve("key empty, no parts", r(""), Invalid("key")),
        with_reserve("key 512 bytes (at the limit)", r(&long(512)), Ok),
        with_reserve("key 513 bytes", r(&long(513)), Invalid("key")),
        with_reserve("key holding NUL", r("order\u{0}42"), Invalid("key")),
        with_reserve("key part holding NUL", parts(&["a", "b\u{0}"], 60_000), Invalid("key_parts")),
        with_reserve(
            "key and key_parts together",
            pb::ReserveRequest { key: "a".into(), ..parts(&["p"], 1000) },
            Invalid("key_parts"),
        ),
        with_reserve("an empty key part", parts(&["a", ""], 60_000), Invalid("key_parts")),
        with_reserve("a key part with ':'", parts(&["a:b"], 60_000), Invalid("key_parts")),
        with_reserve("17 key parts", parts(&["p"; 17], 60_000), Invalid("key_parts")),
        with_reserve("16 key parts (at the limit)", parts(&["q"; 16], 60_000), Ok),
        with_reserve("zero bucket", parts(&["a"], 0), Invalid("bucket_ms")),
        with_reserve("bucket over 7 days", parts(&["a"], 7 * DAY_MS + 1), Invalid("bucket_ms")),
        with_reserve(
            "bucket without parts",
            pb::ReserveRequest { bucket_ms: 1000, ..r("a") },
            Invalid("bucket_ms"),
        ),
        with_reserve("derived key over 512 bytes", parts(&[&long(510)], 1), Invalid("key")),
        with_reserve("ttl 999 ms", pb::ReserveRequest { ttl_ms: 999, ..r("a") }, Invalid("ttl_ms")),
        with_reserve("ttl 1 s (at the limit)", pb::ReserveRequest { ttl_ms: 1000, ..r("ttl-min") }, Ok),
        with_reserve(
            "ttl over 7 days",
            pb::ReserveRequest { ttl_ms: 7 * DAY_MS + 1, ..r("a") },
            Invalid("ttl_ms"),
        ),
        with_reserve("lease 99 ms", pb::ReserveRequest { lease_ms: 99, ..r("a") }, Invalid("lease_ms")),
        with_reserve(
            "lease over 1 h",
            pb::ReserveRequest { lease_ms: 3_600_001, ..r("a") },
            Invalid("lease_ms"),
        ),
        with_reserve(
            "fingerprint 65 bytes",
            pb::ReserveRequest { fingerprint: vec![1; 65], ..r("a") },
            Invalid("fingerprint"),
        ),
        with_reserve(
            "fingerprint 64 bytes (at the limit)",
            pb::ReserveRequest { fingerprint: vec![1; 64], ..r("fp-max") },
            Ok,
        ),
        with_reserve("wait over 30 s", pb::ReserveRequest { wait_ms: 30_001, ..r("a") }, Invalid("wait_ms")),
        ("key not utf-8", raw(b"live", &[0xff, 0xfe], Vec::new(), 0), Invalid("key")),
        ("namespace not utf-8", raw(&[0xc3, 0x28], b"a", Vec::new(), 0), Invalid("namespace")),
        ("key part not utf-8", raw(b"live", b"", vec![vec![0x80]], 1000), Invalid("key_parts")),
    ]
}

/// The calls on the held key (`token` is its grant).
fn held_key_cases(token: u64) -> Vec<(&'static str, Call, Expect)> {
    use Expect::Invalid;
    let heartbeat = |token, lease_ms| {
        Call::Heartbeat(pb::HeartbeatRequest {
            namespace: "live".into(),
            key: "held".into(),
            token,
            lease_ms,
        })
    };
    vec![
        ("commit token 0", Call::Commit(commit(0, 1, 1)), Invalid("token")),
        ("commit outcome unspecified", Call::Commit(commit(token, 0, 1)), Invalid("outcome")),
        ("commit outcome unknown (9)", Call::Commit(commit(token, 9, 1)), Invalid("outcome")),
        ("commit outcome negative", Call::Commit(commit(token, -1, 1)), Invalid("outcome")),
        ("response 64 KiB + 1", Call::Commit(commit(token, 1, 64 * 1024 + 1)), Invalid("response")),
        (
            "commit key 513 bytes",
            Call::Commit(pb::CommitRequest { key: long(513), ..commit(token, 1, 1) }),
            Invalid("key"),
        ),
        (
            "release token 0",
            Call::Release(pb::ReleaseRequest { namespace: "live".into(), key: "held".into(), token: 0 }),
            Invalid("token"),
        ),
        (
            "release bad namespace",
            Call::Release(pb::ReleaseRequest { namespace: "a b".into(), key: "held".into(), token }),
            Invalid("namespace"),
        ),
        ("heartbeat token 0", heartbeat(0, 0), Invalid("token")),
        ("heartbeat lease 50 ms", heartbeat(token, 50), Invalid("lease_ms")),
        (
            "get key empty",
            Call::Get(pb::GetRequest { namespace: "live".into(), key: "".into() }),
            Invalid("key"),
        ),
        (
            "message over 256 KiB",
            Call::Commit(commit(token, 1, 300 * 1024)),
            Expect::Code(&[Code::OutOfRange, Code::ResourceExhausted]),
        ),
    ]
}

/// Sends one case's call.
async fn send(gate: &mut GateClient<Channel>, channel: &Channel, call: Call) -> Result<(), Status> {
    match call {
        Call::Reserve(request) => gate.reserve(request).await.map(drop),
        Call::RawReserve(request) => raw_reserve(channel.clone(), request).await,
        Call::Commit(request) => gate.commit(request).await.map(drop),
        Call::Release(request) => gate.release(request).await.map(drop),
        Call::Heartbeat(request) => gate.heartbeat(request).await.map(drop),
        Call::Get(request) => gate.get(request).await.map(drop),
    }
}

/// Checks one case's answer against what it must get.
fn check(name: &str, result: &Result<(), Status>, expect: &Expect) {
    match (expect, result) {
        (Expect::Ok, Ok(())) => {}
        (Expect::Invalid(field), Err(status)) => {
            assert_eq!(status.code(), Code::InvalidArgument, "{name}: {status:?}");
            let trailer = |k| status.metadata().get(k).and_then(|v| v.to_str().ok());
            assert_eq!(trailer(CODE_METADATA), Some("invalid_argument"), "{name}: {status:?}");
            assert_eq!(trailer(FIELD_METADATA), Some(*field), "{name}: {status:?}");
            assert!(status.message().contains(field), "{name}: the message names the field: {status:?}");
        }
        (Expect::Code(codes), Err(status)) => assert!(codes.contains(&status.code()), "{name}: {status:?}"),
        (_, other) => panic!("{name}: unexpected {other:?}"),
    }
}

/// Metadata over the server's 16 KiB: refused by the transport, whichever way it says so.
async fn oversized_metadata(gate: &mut GateClient<Channel>) {
    let mut huge = Request::new(reserve("a"));
    huge.metadata_mut().insert("x-padding", "p".repeat(64 * 1024).parse().unwrap());
    let codes = &[Code::Internal, Code::Unavailable, Code::Unknown, Code::ResourceExhausted, Code::Cancelled];
    check("metadata over 16 KiB", &gate.reserve(huge).await.map(drop), &Expect::Code(codes));
}

/// Garbage on a raw socket: the connection is refused, the server is not.
fn garbage_on_the_socket(addr: std::net::SocketAddr) {
    let mut socket = std::net::TcpStream::connect(addr).unwrap();
    socket.write_all(b"\x00\x01GARBAGE not http/2 at all \xff\xfe\r\n\r\n").unwrap();
    let mut sink = Vec::new();
    let _ = socket.read_to_end(&mut sink);
}

/// Nothing changed: the refused keys are free, the held key is as it was.
async fn nothing_changed(addr: std::net::SocketAddr, token: u64) {
    let mut gate =
        GateClient::new(Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap());
    let view =
        gate.get(pb::GetRequest { namespace: "live".into(), key: "a".into() }).await.unwrap().into_inner();
    assert_eq!(view.state, pb::State::Free as i32, "refused reserves left no record");
    let view =
        gate.get(pb::GetRequest { namespace: "live".into(), key: "held".into() }).await.unwrap().into_inner();
    assert_eq!(
        (view.state, view.token),
        (pb::State::Pending as i32, token),
        "refused calls left the held key alone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        engine: EngineConfig { data_dir: dir.path().to_owned(), shards: 2, ..EngineConfig::default() },
        ..Config::default()
    };
    config.check().unwrap();
    let server = start_in(config, Some(dir)).await;
    let channel = server.channel().await;
    let mut gate = GateClient::new(channel.clone());

    // One key held, for commit, release and heartbeat cases.
    let held = gate.reserve(reserve("held")).await.unwrap().into_inner();
    let Some(pb::reserve_response::Outcome::Granted(grant)) = held.outcome else { panic!("{held:?}") };
    let cases: Vec<_> = reserve_cases().into_iter().chain(held_key_cases(grant.token)).collect();
    assert!(cases.len() >= 30, "the table has {} cases", cases.len());
    for (name, call, expect) in cases {
        check(name, &send(&mut gate, &channel, call).await, &expect);
    }
    oversized_metadata(&mut gate).await;

    garbage_on_the_socket(server.addr);
    nothing_changed(server.addr, grant.token).await;
    drop((gate, channel));
    server.stop().await;
}
