//! Trace export over OTLP/gRPC, off unless `[telemetry] otlp_endpoint` (or
//! `OTEL_EXPORTER_OTLP_ENDPOINT`) is set: each call's `request` span and the `batch` span
//! of the shard that served it (linked to the request) go to a collector, and a caller's
//! W3C `traceparent` makes them part of the caller's trace.
//!
//! Off, nothing here runs on a call: [`caller_span`] reads one atomic and returns.

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Subscriber;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::registry::LookupSpan;

use crate::config::TelemetryConfig;

/// Whether spans are exported: the fronts read a caller's trace context only then.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Why traces cannot be exported.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TracesError {
    /// The endpoint is not a plain `http://` address (this build exports without TLS;
    /// a collector on the same host or network, or a local agent, takes plain gRPC).
    #[error("the OTLP endpoint {endpoint:?} must start with http:// (this build exports without TLS)")]
    Endpoint {
        /// The endpoint.
        endpoint: String,
    },
    /// The exporter could not be built.
    #[error("the OTLP trace exporter for {endpoint}")]
    Exporter {
        /// The endpoint.
        endpoint: String,
        /// What the exporter said.
        #[source]
        source: opentelemetry_otlp::ExporterBuildError,
    },
}

/// A `tracing` layer that exports the request and batch spans (the server's and the
/// engine's debug spans, whatever the log filter) to the configured OTLP/gRPC endpoint,
/// and the provider to shut down at exit, which sends what is left; `None` when no
/// endpoint is set. Call it inside a tokio runtime: the exporter's channel runs on it.
pub fn otlp_layer<S>(
    config: &TelemetryConfig,
) -> Result<Option<(impl Layer<S> + use<S>, TraceExport)>, TracesError>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    let endpoint = config
        .otlp_endpoint
        .clone()
        .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok())
        .filter(|endpoint| !endpoint.is_empty());
    let Some(endpoint) = endpoint else { return Ok(None) };
    if !endpoint.starts_with("http://") {
        return Err(TracesError::Endpoint { endpoint });
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint.clone())
        .build()
        .map_err(|source| TracesError::Exporter { endpoint: endpoint.clone(), source })?;
    let resource = opentelemetry_sdk::Resource::builder().with_service_name("oncegate").build();
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
    let tracer = provider.tracer("oncegate");
    let spans = Targets::new()
        .with_target("oncegate_server", tracing::Level::DEBUG)
        .with_target("oncegate_engine", tracing::Level::DEBUG);
    EXPORTING.store(true, Ordering::Relaxed);
    let layer = tracing_opentelemetry::layer().with_tracer(tracer).with_filter(spans);
    Ok(Some((layer, TraceExport { provider, endpoint })))
}

/// The running export: dropped (before its runtime), it sends the spans not sent yet.
pub struct TraceExport {
    provider: SdkTracerProvider,
    endpoint: String,
}

impl TraceExport {
    /// Sends every finished span now.
    pub fn flush(&self) {
        let _ = self.provider.force_flush();
    }

    /// Where the spans go.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
}

impl Drop for TraceExport {
    fn drop(&mut self) {
        let _ = self.provider.shutdown();
    }
}

/// The span a front opens around starting a call whose caller sent a W3C `traceparent`
/// (`get` reads the call's headers or metadata): the call's request span is its child,
/// so the call continues the caller's trace. A disabled span, and no header read, unless
/// traces are exported, or when the traceparent does not parse.
pub(crate) fn caller_span<'a>(front: &'static str, get: impl Fn(&str) -> Option<&'a str>) -> tracing::Span {
    if !EXPORTING.load(Ordering::Relaxed) {
        return tracing::Span::none();
    }
    let Some(traceparent) = get("traceparent") else { return tracing::Span::none() };
    let carrier = Carrier { traceparent, tracestate: get("tracestate") };
    let context = TraceContextPropagator::new().extract(&carrier);
    // A traceparent that does not parse continues nothing (a Session call then takes
    // its stream's trace).
    if !opentelemetry::trace::TraceContextExt::span(&context).span_context().is_valid() {
        return tracing::Span::none();
    }
    let span = tracing::debug_span!("caller", front);
    let _ = span.set_parent(context);
    span
}

/// A caller's trace context, as the propagator reads it.
struct Carrier<'a> {
    traceparent: &'a str,
    tracestate: Option<&'a str>,
}

impl Extractor for Carrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            "traceparent" => Some(self.traceparent),
            "tracestate" => self.tracestate,
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}
