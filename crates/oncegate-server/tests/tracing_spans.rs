//! One span per request (RPC, tenant, namespace, a digest of the key and never the key,
//! shard, outcome, duration), and the shard's batch span linked to the requests it served.
//! One test per process: the subscriber is global.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use common::start_in;
use oncegate_engine::EngineConfig;
use oncegate_proto::v1 as pb;
use oncegate_server::Config;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

#[derive(Clone, Debug, Default)]
struct Seen {
    name: String,
    fields: BTreeMap<String, String>,
    follows: Vec<u64>,
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<BTreeMap<u64, Seen>>>);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}").trim_matches('"').to_owned());
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        let mut seen = Seen { name: attrs.metadata().name().to_owned(), ..Seen::default() };
        attrs.record(&mut Fields(&mut seen.fields));
        self.0.lock().unwrap().insert(id.into_u64(), seen);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        if let Some(seen) = self.0.lock().unwrap().get_mut(&id.into_u64()) {
            values.record(&mut Fields(&mut seen.fields));
        }
    }

    fn on_follows_from(&self, id: &Id, follows: &Id, _: Context<'_, S>) {
        if let Some(seen) = self.0.lock().unwrap().get_mut(&id.into_u64()) {
            seen.follows.push(follows.into_u64());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_have_spans_and_batches_link_to_them() {
    let capture = Capture::default();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_subscriber::filter::LevelFilter::DEBUG)
        .with(capture.clone());
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        engine: EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() },
        ..Config::default()
    };
    let server = start_in(config, Some(dir)).await;
    let mut client = server.client().await;
    let secret_key = "customer-4242-card-visa";
    client
        .reserve(pb::ReserveRequest {
            namespace: "live".into(),
            key: secret_key.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    drop(client);
    server.stop().await;

    let spans = capture.0.lock().unwrap().clone();
    let (request_id, request) = spans
        .iter()
        .find(|(_, s)| s.name == "request" && s.fields.get("rpc").map(String::as_str) == Some("reserve"))
        .expect("a request span");
    let field = |name: &str| request.fields.get(name).cloned().unwrap_or_default();
    assert_eq!(field("tenant"), "default");
    assert_eq!(field("namespace"), "live");
    assert_eq!(field("key"), oncegate_server::key_digest(secret_key));
    assert_eq!(field("outcome"), "granted");
    assert!(!field("shard").is_empty(), "the shard is recorded: {request:?}");
    assert!(!field("duration_us").is_empty());
    for seen in spans.values() {
        assert!(!seen.fields.values().any(|v| v.contains(secret_key)), "a raw key in span {seen:?}");
    }
    let batch = spans.values().find(|s| s.name == "batch" && s.follows.contains(request_id));
    assert!(batch.is_some(), "the batch that served the request links to it: {spans:#?}");
}
