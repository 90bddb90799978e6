//! A `Session` stream's byte budget for unsent answers, through the real server. Alone in
//! its test binary: it reads process-wide gauges (calls held, bytes unsent) that another
//! test's streams would move.

use std::time::Duration;

use oncegate_proto::v1 as pb;

mod common;

use common::session::{calls_counted, committed, get, tenant, unread_channel, unread_stream};
use common::{gauge, start_with};

/// A stream whose unsent answers reach `server.session_unsent_bytes_max` starts no new
/// call: the next one it reads is held (`oncegate_session_calls_held`) and nothing after
/// it is read. Gets of a 64 KiB answer are sent one at a time, each after the last is
/// answered or held; the transport takes an answer or two past a zero window, and the
/// next fills the budget. (Without the byte budget no call was held: only the stream's
/// 256 calls in flight and its tenant's places bounded what an unread stream held.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_over_its_unsent_bytes_starts_no_call() {
    let server = start_with(|c| {
        c.engine.shards = 1;
        c.server.session_unsent_bytes_max = 64 << 10;
        c.tenants = vec![tenant("budget", |_| {})];
    })
    .await;
    committed(&server, "budget", "big", 64 << 10).await;
    let channel = unread_channel(&server).await;
    let (requests, answers) = unread_stream(&channel, "budget", []).await.expect("opens");
    let mut answered = 0;
    for id in 0..16 {
        let request = pb::SessionRequest { id, call: Some(get("big")), timeout_ms: 0, ..Default::default() };
        requests.try_send(request).expect("room for the call");
        let mut held = false;
        for _ in 0..3_000 {
            held = gauge(&server, "oncegate_session_calls_held").await >= 1.0;
            answered = calls_counted(&server, "get", "budget").await;
            if held || answered > id {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if held {
            assert!(answered <= 4, "{answered} answers of 64 KiB were made before one was held");
            let unsent = gauge(&server, "oncegate_session_unsent_bytes").await;
            assert!(unsent >= f64::from(64 << 10), "held at {unsent} unsent bytes");
            // The stream goes, and its held call with it.
            drop((requests, answers, channel));
            for _ in 0..3_000 {
                if gauge(&server, "oncegate_session_calls_held").await == 0.0 {
                    server.stop().await;
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            panic!("the held call was still counted after its stream went");
        }
        assert_eq!(answered, id + 1, "get {id} was neither answered nor held");
    }
    panic!("16 answers of 64 KiB were made and none of the stream's calls was held");
}
