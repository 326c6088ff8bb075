//! Logs and traces, set up the same way by the three services.
//!
//! - Logs: level from `RUST_LOG`; `REVIEWLANE_LOG_FORMAT=json` writes one JSON object a
//!   line with the fields of the spans around the event (`job_id`, `tenant`, `region`,
//!   `lane`, ...) and the OpenTelemetry `trace_id`/`span_id`; `text` (the default) is for
//!   people at a terminal.
//! - Traces: `tracing` spans exported over OTLP/gRPC to `OTEL_EXPORTER_OTLP_ENDPOINT`
//!   (off when unset; trace ids are still made and propagated, so logs of one job share
//!   one trace id across services). W3C trace context comes in with gRPC metadata and
//!   travels in NATS message headers ([`inject_nats`], [`parent_from_nats`]).
//!
//! Content never goes into a log or a span: spans are `skip_all` and call sites record
//! ids, states, classes and counts only.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, OnceLock};

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::dispatcher::WeakDispatch;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Record};
use tracing::{Event, Id, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{EnvFilter, Layer};

use reviewlane_core::config::Reader;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// The telemetry part of every service's configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TelemetryConfig {
    pub log_format: LogFormat,
    /// OTLP/gRPC collector, e.g. `http://otel-collector:4317`; no export when `None`.
    pub otlp_endpoint: Option<String>,
}

impl TelemetryConfig {
    /// Reads `REVIEWLANE_LOG_FORMAT` (`text` | `json`) and `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn read(r: &mut Reader<'_>) -> TelemetryConfig {
        let log_format = match r.raw(reviewlane_core::env::LOG_FORMAT).as_deref() {
            None | Some("text") => LogFormat::Text,
            Some("json") => LogFormat::Json,
            Some(_) => {
                r.error("REVIEWLANE_LOG_FORMAT must be `text` or `json`");
                LogFormat::Text
            }
        };
        let otlp_endpoint = r.raw(reviewlane_core::env::OTEL_EXPORTER_OTLP_ENDPOINT).filter(|v| !v.is_empty());
        if let Some(ep) = &otlp_endpoint {
            let ok = ep
                .parse::<http::Uri>()
                .is_ok_and(|u| matches!(u.scheme_str(), Some("http" | "https")) && u.authority().is_some());
            if !ok {
                r.error("OTEL_EXPORTER_OTLP_ENDPOINT must be an http:// or https:// URL");
            }
        }
        TelemetryConfig { log_format, otlp_endpoint }
    }
}

/// Keeps the tracer provider; `shutdown` flushes spans still buffered.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    pub fn shutdown(self) {
        let _ = self.provider.shutdown();
    }
}

/// Installs the process-wide subscriber for `service` (e.g. `reviewlane-ingress`).
/// A second call (several apps in one process) keeps the first subscriber.
pub fn init(service: &'static str, config: &TelemetryConfig) -> Telemetry {
    let resource = opentelemetry_sdk::Resource::builder().with_service_name(service).build();
    let mut builder = SdkTracerProvider::builder().with_resource(resource);
    if let Some(ep) = &config.otlp_endpoint {
        use opentelemetry_otlp::WithExportConfig;
        match opentelemetry_otlp::SpanExporter::builder().with_tonic().with_endpoint(ep.clone()).build() {
            Ok(exporter) => builder = builder.with_batch_exporter(exporter),
            // The endpoint was validated with the config; a failure here is local.
            Err(e) => eprintln!("{service}: OTLP exporter not started: {e}"),
        }
    }
    let provider = builder.build();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing::subscriber::set_global_default(subscriber(filter, config.log_format, std::io::stderr, &provider));
    Telemetry { provider }
}

/// The subscriber every service runs: filter, span fields for logs, the log format,
/// and the OpenTelemetry layer. Tests build it with their own writer and exporter.
pub fn subscriber<W>(
    filter: EnvFilter,
    format: LogFormat,
    writer: W,
    provider: &SdkTracerProvider,
) -> impl Subscriber + Send + Sync + 'static
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    // No busy/idle time per span (it read the clock at every poll of every instrumented
    // future) and no source location: neither is read by anyone.
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("reviewlane"))
        .with_threads(false)
        .with_location(false)
        .with_tracked_inactivity(false);
    let dispatch = Arc::new(OnceLock::new());
    // Not boxed: a boxed subscriber does not pass `on_register_dispatch` on. Each format
    // keeps span fields once: JSON lines as values (`SpanFields`), text as the fmt
    // layer's own text.
    let fields = SpanFields { dispatch: dispatch.clone(), keep: format == LogFormat::Json };
    let (json, text) = match format {
        LogFormat::Json => {
            let json = tracing_subscriber::fmt::layer()
                .fmt_fields(NoSpanText)
                .event_format(JsonLine { dispatch })
                .with_writer(writer);
            (Some(json), None)
        }
        LogFormat::Text => (None, Some(tracing_subscriber::fmt::layer().with_writer(writer))),
    };
    tracing_subscriber::registry().with(filter).with(fields).with(otel).with(json).with(text)
}

/// The fmt layer's text of span fields, for JSON lines: none (`JsonLine` reads the
/// values `SpanFields` keeps, and records event fields itself).
struct NoSpanText;

impl<'w> FormatFields<'w> for NoSpanText {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(&self, _: Writer<'w>, _: R) -> fmt::Result {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------
// Trace context across gRPC and NATS.

struct NatsHeaders<'a>(&'a mut async_nats::HeaderMap);

impl Injector for NatsHeaders<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value.as_str());
    }
}

struct NatsHeadersRef<'a>(&'a async_nats::HeaderMap);

impl Extractor for NatsHeadersRef<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(|v| v.as_str())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_ref()).collect()
    }
}

struct HttpHeaders<'a>(&'a http::HeaderMap);

impl Extractor for HttpHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Writes the current span's W3C trace context (`traceparent`) into NATS headers.
pub fn inject_nats(headers: &mut async_nats::HeaderMap) {
    let cx = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&cx, &mut NatsHeaders(headers));
}

/// The remote parent a message carries; empty when it carries none.
pub fn parent_from_nats(headers: Option<&async_nats::HeaderMap>) -> opentelemetry::Context {
    match headers {
        Some(h) => TraceContextPropagator::new().extract(&NatsHeadersRef(h)),
        None => opentelemetry::Context::new(),
    }
}

/// The remote parent an incoming gRPC/HTTP request carries.
pub fn parent_from_http(headers: &http::HeaderMap) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(&HttpHeaders(headers))
}

/// Makes `span` a child of `parent` when `parent` holds a remote span context. Call it
/// before the span is first entered.
pub fn set_remote_parent(span: &tracing::Span, parent: opentelemetry::Context) {
    if parent.span().span_context().is_valid() {
        let _ = span.set_parent(parent);
    }
}

// ---------------------------------------------------------------------------------
// JSON log lines.

/// Span fields kept as values, so a JSON log line can carry them at top level.
#[derive(Default)]
struct Fields(BTreeMap<&'static str, serde_json::Value>);

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name(), value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name(), value.into());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0.insert(field.name(), value.to_string().into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name(), format!("{value:?}").into());
    }
}

/// Keeps each span's fields (except the `otel.*` controls) in its extensions, and
/// the subscriber it belongs to for [`JsonLine`] (inside an event, the thread's default
/// dispatcher is unavailable).
struct SpanFields {
    dispatch: Arc<OnceLock<WeakDispatch>>,
    /// Whether fields are kept: only JSON lines read them.
    keep: bool,
}

impl<S> Layer<S> for SpanFields
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_register_dispatch(&self, subscriber: &tracing::Dispatch) {
        let _ = self.dispatch.set(subscriber.downgrade());
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if !self.keep {
            return;
        }
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        fields.0.retain(|k, _| !k.starts_with("otel."));
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if !self.keep {
            return;
        }
        if let Some(span) = ctx.span(id) {
            let mut ext = span.extensions_mut();
            if let Some(fields) = ext.get_mut::<Fields>() {
                values.record(fields);
                fields.0.retain(|k, _| !k.starts_with("otel."));
            }
        }
    }
}

/// One JSON object a line: `timestamp`, `level`, `target`, `message`, the event's
/// fields, the fields of the spans around it (innermost wins), `span`, `trace_id`,
/// `span_id`.
struct JsonLine {
    dispatch: Arc<OnceLock<WeakDispatch>>,
}

impl<S, N> FormatEvent<S, N> for JsonLine
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let mut line = serde_json::Map::new();
        let now = time::OffsetDateTime::now_utc();
        let ts = now.format(&time::format_description::well_known::Rfc3339).unwrap_or_default();
        line.insert("timestamp".into(), ts.into());
        line.insert("level".into(), event.metadata().level().as_str().into());
        line.insert("target".into(), event.metadata().target().into());
        let mut own = Fields::default();
        event.record(&mut own);
        for (k, v) in own.0 {
            line.insert(k.into(), v);
        }
        let mut leaf = None;
        if let Some(scope) = ctx.event_scope() {
            for span in scope {
                if leaf.is_none() {
                    line.insert("span".into(), span.name().into());
                    leaf = Some(span.id());
                }
                if let Some(fields) = span.extensions().get::<Fields>() {
                    for (k, v) in &fields.0 {
                        line.entry(k.to_string()).or_insert_with(|| v.clone());
                    }
                }
            }
        }
        if let Some(id) = leaf {
            let dispatch = self.dispatch.get().and_then(|d| d.upgrade());
            if let Some(cx) = dispatch.and_then(|d| tracing_opentelemetry::get_otel_context(&id, &d)) {
                let sc = cx.span().span_context().clone();
                if sc.is_valid() {
                    line.insert("trace_id".into(), sc.trace_id().to_string().into());
                    line.insert("span_id".into(), sc.span_id().to_string().into());
                }
            }
        }
        writeln!(w, "{}", serde_json::Value::Object(line))
    }
}

/// Milliseconds since the Unix epoch.
pub use reviewlane_core::clock::now_ms;

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::Mutex;

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn read(env: &[(&str, &str)]) -> Result<TelemetryConfig, reviewlane_core::config::ConfigErrors> {
        let env: HashMap<String, String> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let mut r = Reader::new(&env);
        let c = TelemetryConfig::read(&mut r);
        r.finish().map(|_| c)
    }

    #[test]
    fn config_reads_format_and_endpoint_and_rejects_bad_ones() {
        assert_eq!(read(&[]).unwrap(), TelemetryConfig::default());
        let c = read(&[("REVIEWLANE_LOG_FORMAT", "json"), ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")])
            .unwrap();
        assert_eq!(c.log_format, LogFormat::Json);
        assert_eq!(c.otlp_endpoint.as_deref(), Some("http://collector:4317"));
        let e = read(&[("REVIEWLANE_LOG_FORMAT", "xml"), ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector")]).unwrap_err();
        assert_eq!(e.0.len(), 2, "{e}");
    }

    #[test]
    fn json_lines_carry_span_fields_and_the_trace_id_of_a_remote_parent() {
        let buf = Buf::default();
        let w = buf.clone();
        let provider = SdkTracerProvider::builder().build();
        let sub = subscriber(EnvFilter::new("info"), LogFormat::Json, move || w.clone(), &provider);
        tracing::subscriber::with_default(sub, || {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
            let span = tracing::info_span!("process", job_id = "us_1", tenant = "acme", otel.kind = "consumer");
            set_remote_parent(&span, parent_from_nats(Some(&headers)));
            let _g = span.enter();
            let inner = tracing::info_span!("provider.attempt", attempt = 2u64);
            let _g2 = inner.enter();
            tracing::info!(outcome = "ok", "provider answered");
            // What goes out carries the same trace.
            let mut out = async_nats::HeaderMap::new();
            inject_nats(&mut out);
            assert!(out.get("traceparent").unwrap().as_str().starts_with("00-0af7651916cd43dd8448eb211c80319c-"));
        });
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let line: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(line["message"], "provider answered");
        assert_eq!(line["outcome"], "ok");
        assert_eq!(line["job_id"], "us_1");
        assert_eq!(line["tenant"], "acme");
        assert_eq!(line["attempt"], 2);
        assert_eq!(line["span"], "provider.attempt");
        assert_eq!(line["trace_id"], "0af7651916cd43dd8448eb211c80319c");
        assert!(line.get("otel.kind").is_none());
    }
}
