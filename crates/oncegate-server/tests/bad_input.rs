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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        engine: EngineConfig { data_dir: dir.path().to_owned(), shards: 2, ..EngineConfig::default() },
        ..Config::default()
    };
    config.check().unwrap();
    let server = start_in(config, Some(dir)).await;
    let addr = server.addr;
    let channel = server.channel().await;
    let mut gate = GateClient::new(channel.clone());

    // One key held, for commit, release and heartbeat cases.
    let held = gate.reserve(reserve("held")).await.unwrap().into_inner();
    let Some(pb::reserve_response::Outcome::Granted(grant)) = held.outcome else { panic!("{held:?}") };
    let token = grant.token;

    let long = |n: usize| "k".repeat(n);
    let day = 86_400_000u64;
    let mut cases: Vec<(&str, Result<(), Status>, Expect)> = Vec::new();
    macro_rules! case {
        ($name:expr, $call:expr, $expect:expr) => {
            cases.push(($name, $call.await.map(drop), $expect));
        };
    }
    let g = &mut gate;
    case!(
        "namespace empty",
        g.reserve(pb::ReserveRequest { namespace: "".into(), ..reserve("a") }),
        Expect::Invalid("namespace")
    );
    case!(
        "namespace 65 bytes",
        g.reserve(pb::ReserveRequest { namespace: "n".repeat(65), ..reserve("a") }),
        Expect::Invalid("namespace")
    );
    case!(
        "namespace with a slash",
        g.reserve(pb::ReserveRequest { namespace: "live/test".into(), ..reserve("a") }),
        Expect::Invalid("namespace")
    );
    case!(
        "namespace non-ascii",
        g.reserve(pb::ReserveRequest { namespace: "живой".into(), ..reserve("a") }),
        Expect::Invalid("namespace")
    );
    case!("key empty, no parts", g.reserve(reserve("")), Expect::Invalid("key"));
    case!("key 512 bytes (at the limit)", g.reserve(reserve(&long(512))), Expect::Ok);
    case!("key 513 bytes", g.reserve(reserve(&long(513))), Expect::Invalid("key"));
    case!("key holding NUL", g.reserve(reserve("order\u{0}42")), Expect::Invalid("key"));
    case!("key part holding NUL", g.reserve(parts(&["a", "b\u{0}"], 60_000)), Expect::Invalid("key_parts"));
    case!(
        "key and key_parts together",
        g.reserve(pb::ReserveRequest { key: "a".into(), ..parts(&["p"], 1000) }),
        Expect::Invalid("key_parts")
    );
    case!("an empty key part", g.reserve(parts(&["a", ""], 60_000)), Expect::Invalid("key_parts"));
    case!("a key part with ':'", g.reserve(parts(&["a:b"], 60_000)), Expect::Invalid("key_parts"));
    case!("17 key parts", g.reserve(parts(&["p"; 17], 60_000)), Expect::Invalid("key_parts"));
    case!("16 key parts (at the limit)", g.reserve(parts(&["q"; 16], 60_000)), Expect::Ok);
    case!("zero bucket", g.reserve(parts(&["a"], 0)), Expect::Invalid("bucket_ms"));
    case!("bucket over 7 days", g.reserve(parts(&["a"], 7 * day + 1)), Expect::Invalid("bucket_ms"));
    case!(
        "bucket without parts",
        g.reserve(pb::ReserveRequest { bucket_ms: 1000, ..reserve("a") }),
        Expect::Invalid("bucket_ms")
    );
    case!("derived key over 512 bytes", g.reserve(parts(&[&long(510)], 1)), Expect::Invalid("key"));
    case!(
        "ttl 999 ms",
        g.reserve(pb::ReserveRequest { ttl_ms: 999, ..reserve("a") }),
        Expect::Invalid("ttl_ms")
    );
    case!(
        "ttl 1 s (at the limit)",
        g.reserve(pb::ReserveRequest { ttl_ms: 1000, ..reserve("ttl-min") }),
        Expect::Ok
    );
    case!(
        "ttl over 7 days",
        g.reserve(pb::ReserveRequest { ttl_ms: 7 * day + 1, ..reserve("a") }),
        Expect::Invalid("ttl_ms")
    );
    case!(
        "lease 99 ms",
        g.reserve(pb::ReserveRequest { lease_ms: 99, ..reserve("a") }),
        Expect::Invalid("lease_ms")
    );
    case!(
        "lease over 1 h",
        g.reserve(pb::ReserveRequest { lease_ms: 3_600_001, ..reserve("a") }),
        Expect::Invalid("lease_ms")
    );
    case!(
        "fingerprint 65 bytes",
        g.reserve(pb::ReserveRequest { fingerprint: vec![1; 65], ..reserve("a") }),
        Expect::Invalid("fingerprint")
    );
    case!(
        "fingerprint 64 bytes (at the limit)",
        g.reserve(pb::ReserveRequest { fingerprint: vec![1; 64], ..reserve("fp-max") }),
        Expect::Ok
    );
    case!(
        "wait over 30 s",
        g.reserve(pb::ReserveRequest { wait_ms: 30_001, ..reserve("a") }),
        Expect::Invalid("wait_ms")
    );
    case!(
        "key not utf-8",
        raw_reserve(
            channel.clone(),
            RawReserve { namespace: b"live".to_vec(), key: vec![0xff, 0xfe], ..Default::default() }
        ),
        Expect::Invalid("key")
    );
    case!(
        "namespace not utf-8",
        raw_reserve(
            channel.clone(),
            RawReserve { namespace: vec![0xc3, 0x28], key: b"a".to_vec(), ..Default::default() }
        ),
        Expect::Invalid("namespace")
    );
    case!(
        "key part not utf-8",
        raw_reserve(
            channel.clone(),
            RawReserve {
                namespace: b"live".to_vec(),
                key_parts: vec![vec![0x80]],
                bucket_ms: 1000,
                ..Default::default()
            }
        ),
        Expect::Invalid("key_parts")
    );
    case!("commit token 0", g.commit(commit(0, 1, 1)), Expect::Invalid("token"));
    case!("commit outcome unspecified", g.commit(commit(token, 0, 1)), Expect::Invalid("outcome"));
    case!("commit outcome unknown (9)", g.commit(commit(token, 9, 1)), Expect::Invalid("outcome"));
    case!("commit outcome negative", g.commit(commit(token, -1, 1)), Expect::Invalid("outcome"));
    case!("response 64 KiB + 1", g.commit(commit(token, 1, 64 * 1024 + 1)), Expect::Invalid("response"));
    case!(
        "commit key 513 bytes",
        g.commit(pb::CommitRequest { key: long(513), ..commit(token, 1, 1) }),
        Expect::Invalid("key")
    );
    case!(
        "release token 0",
        g.release(pb::ReleaseRequest { namespace: "live".into(), key: "held".into(), token: 0 }),
        Expect::Invalid("token")
    );
    case!(
        "release bad namespace",
        g.release(pb::ReleaseRequest { namespace: "a b".into(), key: "held".into(), token }),
        Expect::Invalid("namespace")
    );
    case!(
        "heartbeat token 0",
        g.heartbeat(pb::HeartbeatRequest {
            namespace: "live".into(),
            key: "held".into(),
            token: 0,
            lease_ms: 0
        }),
        Expect::Invalid("token")
    );
    case!(
        "heartbeat lease 50 ms",
        g.heartbeat(pb::HeartbeatRequest {
            namespace: "live".into(),
            key: "held".into(),
            token,
            lease_ms: 50
        }),
        Expect::Invalid("lease_ms")
    );
    case!(
        "get key empty",
        g.get(pb::GetRequest { namespace: "live".into(), key: "".into() }),
        Expect::Invalid("key")
    );
    case!(
        "message over 256 KiB",
        g.commit(commit(token, 1, 300 * 1024)),
        Expect::Code(&[Code::OutOfRange, Code::ResourceExhausted])
    );
    let mut huge = Request::new(reserve("a"));
    huge.metadata_mut().insert("x-padding", "p".repeat(64 * 1024).parse().unwrap());
    let huge_result = g.reserve(huge).await.map(drop);
    cases.push((
        "metadata over 16 KiB",
        huge_result,
        Expect::Code(&[
            Code::Internal,
            Code::Unavailable,
            Code::Unknown,
            Code::ResourceExhausted,
            Code::Cancelled,
        ]),
    ));

    assert!(cases.len() >= 30, "the table has {} cases", cases.len());
    for (name, result, expect) in &cases {
        match (expect, result) {
            (Expect::Ok, Ok(())) => {}
            (Expect::Invalid(field), Err(status)) => {
                assert_eq!(status.code(), Code::InvalidArgument, "{name}: {status:?}");
                let trailer = |k| status.metadata().get(k).and_then(|v| v.to_str().ok());
                assert_eq!(trailer(CODE_METADATA), Some("invalid_argument"), "{name}: {status:?}");
                assert_eq!(trailer(FIELD_METADATA), Some(*field), "{name}: {status:?}");
                assert!(status.message().contains(field), "{name}: the message names the field: {status:?}");
            }
            (Expect::Code(codes), Err(status)) => {
                assert!(codes.contains(&status.code()), "{name}: {status:?}")
            }
            (_, other) => panic!("{name}: unexpected {other:?}"),
        }
    }

    // Garbage on a raw socket: the connection is refused, the server is not.
    let mut socket = std::net::TcpStream::connect(addr).unwrap();
    socket.write_all(b"\x00\x01GARBAGE not http/2 at all \xff\xfe\r\n\r\n").unwrap();
    let mut sink = Vec::new();
    let _ = socket.read_to_end(&mut sink);

    // Nothing changed: the refused keys are free, the held key is as it was.
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
    drop((gate, channel));
    server.stop().await;
}
