//! One server span and one set of metric samples per RPC.
//!
//! The span is made from the request's headers before any handler runs (tonic's
//! `trace_fn`), so an incoming W3C `traceparent` becomes its parent and the submit's
//! `enqueue` span — whose context travels in the NATS headers — its child. Handlers fill
//! in the job's ids and classes; [`Metrics::finish`] records the gRPC status. Labels
//! are bounded: method names, status codes, regions, lanes, decisions.

use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tonic::Status;
use tracing::field::Empty;

/// The review service's methods; anything else is `unknown` in a span name.
const METHODS: [&str; 18] = [
    "SubmitReview",
    "GetReview",
    "WatchReview",
    "CancelReview",
    "ListReviews",
    "ListDeadLetters",
    "GetDeadLetter",
    "ReplayDeadLetter",
    "ListLanes",
    "ListDeployments",
    "CreateSweep",
    "AddSweepItems",
    "SealSweep",
    "GetSweep",
    "ListSweepItems",
    "CancelSweep",
    "ListSweeps",
    "WatchSweep",
];
const SERVICE: &str = "reviewlane.v1.ReviewService";

/// The span of one incoming request (none for health checks, which probes call every
/// few seconds).
pub fn span_for(req: &http::Request<()>) -> tracing::Span {
    let path = req.uri().path();
    if path.starts_with("/grpc.health.") {
        return tracing::Span::none();
    }
    let method = method_of(path);
    let span = tracing::info_span!(
        parent: None,
        "rpc",
        otel.name = format!("{SERVICE}/{method}"),
        otel.kind = "server",
        otel.status_code = Empty,
        rpc.system = "grpc",
        rpc.service = SERVICE,
        rpc.method = method,
        rpc.grpc.status_code = Empty,
        tenant = Empty,
        region = Empty,
        job_id = Empty,
        lane = Empty,
        schema_version = Empty,
        review_depth = Empty,
    );
    reviewlane_shared::telemetry::set_remote_parent(
        &span,
        reviewlane_shared::telemetry::parent_from_http(req.headers()),
    );
    span
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    pub method: String,
    /// gRPC status code name, e.g. `OK`, `RESOURCE_EXHAUSTED`.
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabel {
    pub method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdmissionLabels {
    pub region: String,
    pub lane: String,
    /// `accept`, `degrade`, `refuse`.
    pub decision: String,
}

#[derive(Clone)]
pub struct Metrics {
    pub requests: Family<RpcLabels, Counter>,
    pub duration: Family<MethodLabel, Histogram>,
    pub admission: Family<AdmissionLabels, Counter>,
    /// Cancellations end jobs here.
    pub terminal: reviewlane_shared::job_metrics::TerminalJobs,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            requests: Family::default(),
            duration: Family::new_with_constructor(|| {
                Histogram::new([0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5])
            }),
            admission: Family::default(),
            terminal: reviewlane_shared::job_metrics::TerminalJobs::register(registry),
        };
        registry.register("reviewlane_rpc_requests", "gRPC requests by method and status code", m.requests.clone());
        registry.register(
            "reviewlane_rpc_duration_seconds",
            "gRPC handling time by method (a watch: until its stream is open)",
            m.duration.clone(),
        );
        registry.register(
            "reviewlane_admission_decisions",
            "Submit admission decisions by region, lane and decision",
            m.admission.clone(),
        );
        m
    }

    /// Records the outcome of a handled request on its span and in the metrics.
    pub fn finish<T>(&self, method: &'static str, started: Instant, res: Result<T, Status>) -> Result<T, Status> {
        let code = match &res {
            Ok(_) => tonic::Code::Ok,
            Err(s) => s.code(),
        };
        self.record(method, code);
        self.duration.get_or_create(&MethodLabel { method: method.into() }).observe(started.elapsed().as_secs_f64());
        res
    }

    /// Records a status on the current RPC span and in the request counter.
    pub fn record(&self, method: &'static str, code: tonic::Code) {
        let span = tracing::Span::current();
        span.record("rpc.grpc.status_code", code as i32);
        if matches!(
            code,
            tonic::Code::Internal
                | tonic::Code::Unknown
                | tonic::Code::Unavailable
                | tonic::Code::DataLoss
                | tonic::Code::DeadlineExceeded
                | tonic::Code::Unimplemented
        ) {
            span.record("otel.status_code", "ERROR");
        }
        self.requests.get_or_create(&RpcLabels { method: method.into(), code: code_name(code).into() }).inc();
    }

    pub fn admission(&self, region: &str, lane: &str, decision: &str) {
        self.admission
            .get_or_create(&AdmissionLabels { region: region.into(), lane: lane.into(), decision: decision.into() })
            .inc();
    }
}

/// The review-service method a request path names; `unknown` for anything else.
pub fn method_of(path: &str) -> &'static str {
    path.strip_prefix("/reviewlane.v1.ReviewService/")
        .and_then(|m| METHODS.iter().find(|k| **k == m))
        .copied()
        .unwrap_or("unknown")
}

fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn span_names_and_metric_labels_come_from_a_closed_set() {
        assert_eq!(method_of("/reviewlane.v1.ReviewService/SubmitReview"), "SubmitReview");
        assert_eq!(method_of("/reviewlane.v1.ReviewService/anything-a-client-sends"), "unknown");
        assert_eq!(method_of("/other.Service/SubmitReview"), "unknown");
        assert_eq!(code_name(tonic::Code::ResourceExhausted), "RESOURCE_EXHAUSTED");
    }
}
