//! The measure of a `Session` stream's bounds, alone in its test binary so that
//! no other test's memory counts: 64 streams of one tenant whose client never reads (an
//! HTTP/2 stream window of 0), each asking for 64 answers of 64 KiB, raise the process's
//! resident memory by at most 128 MiB, and another tenant is served meanwhile.

use std::time::Duration;

use oncegate_proto::v1 as pb;
use oncegate_proto::v1::gate_client::GateClient;
use pb::session_request::Call;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

mod common;

use common::session::{authorized, tenant};
use common::{exhausted, gauge, granted, reserve, start_with};

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// The measure. (Before: every stream opened, each held up to 512 answers, and the
/// tenant's places were given back as the engine answered, so 64 streams grew this
/// process by 161 MiB and a stream's share grew with its calls.) Now 16 streams open
/// (`tenants[].sessions_max`); each stops starting calls once its unsent answers reach
/// `server.session_unsent_bytes_max`. The streams are opened one at a time, each waited
/// for until it holds at least the byte budget more and no call of it is in flight: it
/// is then over its budget and starts nothing more, so the memory measured is the most
/// it will take.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_unread_streams_of_one_tenant_take_at_most_128_mib() {
    let server = start_with(|c| c.tenants = vec![tenant("hog", |_| {}), tenant("polite", |_| {})]).await;
    let budget = oncegate_server::ServerConfig::default().session_unsent_bytes_max as f64;
    let mut writer = server.client().await;
    let reply = writer.reserve(authorized(reserve("big"), "hog")).await.unwrap().into_inner();
    let commit = pb::CommitRequest {
        namespace: "live".into(),
        key: "big".into(),
        token: granted(&reply),
        outcome: pb::Outcome::Succeeded as i32,
        response: vec![b'r'; 64 << 10],
    };
    writer.commit(authorized(commit, "hog")).await.unwrap();
    let before = rss_bytes();

    let mut channels: Vec<Channel> = Vec::new();
    for _ in 0..8 {
        let endpoint = Endpoint::from_shared(format!("http://{}", server.addr)).unwrap();
        channels.push(endpoint.initial_stream_window_size(0).connect().await.expect("connects"));
    }
    let (mut open, mut refused) = (Vec::new(), 0);
    for stream in 0..64 {
        let unsent_before = gauge(&server, "oncegate_session_unsent_bytes").await;
        let (requests, rx) = mpsc::channel(64);
        for id in 0..64 {
            let get = pb::GetRequest { namespace: "live".into(), key: "big".into() };
            requests
                .try_send(pb::SessionRequest {
                    id,
                    call: Some(Call::Get(get)),
                    timeout_ms: 0,
                    ..Default::default()
                })
                .unwrap();
        }
        let opened = GateClient::new(channels[stream % 8].clone())
            .session(authorized(ReceiverStream::new(rx), "hog"))
            .await;
        match opened {
            Ok(answers) => {
                let mut settled = false;
                for _ in 0..3_000 {
                    let unsent = gauge(&server, "oncegate_session_unsent_bytes").await;
                    let in_flight = gauge(&server, "oncegate_session_calls_in_flight").await;
                    settled = unsent - unsent_before >= budget && in_flight == 0.0;
                    if settled {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                assert!(settled, "stream {stream} reached its byte budget and started nothing more");
                open.push((requests, answers.into_inner()));
            }
            Err(status) => {
                exhausted(&status, "tenants[].sessions_max");
                refused += 1;
            }
        }
    }
    assert_eq!((open.len(), refused), (16, 48));
    let grown = rss_bytes().saturating_sub(before);
    assert!(grown <= 128 << 20, "64 unread streams grew the process by {} MiB", grown >> 20);

    let mut polite = server.client().await;
    let reply = polite.reserve(authorized(reserve("k"), "polite")).await.expect("polite is served");
    granted(&reply.into_inner());
    drop((open, channels, polite, writer));
    server.stop().await;
}
