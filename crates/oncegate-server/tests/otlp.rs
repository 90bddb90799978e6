//! Trace export over OTLP/gRPC: an in-process collector (a tonic server of
//! opentelemetry-proto's `TraceService`) receives a reserve's request span in the trace of
//! the caller's W3C `traceparent`, and the shard's batch span linked to it. One test per
//! process: the tracing subscriber is process-wide.

mod common;

use std::time::{Duration, Instant};

use common::{granted, reserve, start_with};
use oncegate_proto::v1 as pb;
use oncegate_server::TelemetryConfig;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::trace::v1::Span;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The caller's trace: 16 bytes of trace id and 8 of span id, as `traceparent` carries them.
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN_ID: &str = "00f067aa0ba902b7";
/// Another caller's trace, carried by one call of a `Session` stream.
const SESSION_TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";

/// A collector that hands every span it receives to the test.
struct Collector(mpsc::UnboundedSender<Span>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans = request.into_inner().resource_spans.into_iter().flat_map(|r| r.scope_spans);
        for span in spans.flat_map(|scope| scope.spans) {
            let _ = self.0.send(span);
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Starts the collector on a free loopback port; returns its endpoint and what it receives.
async fn collector() -> (String, mpsc::UnboundedReceiver<Span>) {
    let (spans, received) = mpsc::unbounded_channel();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Collector(spans)))
            .serve_with_incoming(incoming),
    );
    (endpoint, received)
}

/// Takes spans as they arrive until `done` holds for what came, within a bound (the
/// exporter sends on its own schedule once flushed).
async fn spans_until(
    received: &mut mpsc::UnboundedReceiver<Span>,
    done: impl Fn(&[Span]) -> bool,
) -> Vec<Span> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut spans = Vec::new();
    while !done(&spans) {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, received.recv()).await {
            Ok(Some(span)) => spans.push(span),
            _ => panic!("the collector got {} spans, not the ones awaited: {spans:?}", spans.len()),
        }
    }
    spans
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_s_spans_continue_the_caller_s_trace_and_the_batch_links_to_it() {
    let (endpoint, mut received) = collector().await;
    let config = TelemetryConfig { otlp_endpoint: Some(endpoint) };
    let (layer, export) = oncegate_server::otlp_layer(&config).unwrap().expect("an endpoint is set");
    tracing_subscriber::registry().with(layer).init();
    let server = start_with(|_| {}).await;

    let mut request = tonic::Request::new(reserve("traced"));
    let traceparent = format!("00-{TRACE_ID}-{CALLER_SPAN_ID}-01");
    request.metadata_mut().insert("traceparent", traceparent.parse().unwrap());
    let mut client = server.client().await;
    granted(&client.reserve(request).await.unwrap().into_inner());
    export.flush();

    // The request, the batch, and the caller span that is the request's parent (which
    // ends after its child, so it may come in a later export).
    let spans = spans_until(&mut received, |spans| {
        let request = spans.iter().find(|s| s.name == "request");
        let parent = request.is_some_and(|r| spans.iter().any(|s| s.span_id == r.parent_span_id));
        parent && spans.iter().any(|s| s.name == "batch")
    })
    .await;
    let request = spans.iter().find(|s| s.name == "request").unwrap();
    assert_eq!(hex(&request.trace_id), TRACE_ID, "the request continues the caller's trace");
    let caller = spans.iter().find(|s| s.span_id == request.parent_span_id).expect("the request's parent");
    assert_eq!(hex(&caller.parent_span_id), CALLER_SPAN_ID, "whose parent is the caller's span");
    let batch = spans.iter().find(|s| s.name == "batch").unwrap();
    assert!(
        batch.links.iter().any(|link| link.span_id == request.span_id && hex(&link.trace_id) == TRACE_ID),
        "the batch links to the request it served: {batch:?}"
    );

    // A Session call's own traceparent puts that call in its caller's trace.
    let call = pb::SessionRequest {
        id: 1,
        call: Some(pb::session_request::Call::Reserve(reserve("traced-in-a-session"))),
        traceparent: format!("00-{SESSION_TRACE_ID}-{CALLER_SPAN_ID}-01"),
        ..Default::default()
    };
    let (tx, rx) = mpsc::channel(1);
    tx.send(call).await.unwrap();
    let mut answers = client.session(ReceiverStream::new(rx)).await.unwrap().into_inner();
    answers.message().await.unwrap().expect("an answer");
    export.flush();
    let in_session = |s: &Span| s.name == "request" && hex(&s.trace_id) == SESSION_TRACE_ID;
    spans_until(&mut received, |spans| spans.iter().any(in_session)).await;
    drop((tx, answers, client));
    server.stop().await;
}
