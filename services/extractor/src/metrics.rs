//! The extractor's metric families, registered in one place. Labels: region, provider,
//! model class and tenant (from config) and closed outcome sets — never content.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::quota::Scope;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScopeOutcome {
    pub region: String,
    pub provider: String,
    pub model_class: String,
    pub tenant: String,
    /// `ok`, `rate_limited`, `insufficient_quota`, `transient`, `rejected`.
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RegionLabel {
    pub region: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LaneLabels {
    pub region: String,
    pub lane: String,
}

#[derive(Clone)]
pub struct Metrics {
    /// Age of the oldest review on the lane (waiting, being processed, or waiting out
    /// a retry delay), from stream metadata.
    pub queue_age: Family<LaneLabels, Gauge<f64, AtomicU64>>,
    /// Reviews on the lane.
    pub queue_depth: Family<LaneLabels, Gauge>,
    region: String,
    /// Provider answers by quota scope and outcome class.
    pub upstream: Family<ScopeOutcome, Counter>,
    /// Retry hints above the ceiling, rescheduled at the ceiling.
    pub hints_capped: Family<RegionLabel, Counter>,
}

impl Metrics {
    pub fn register(registry: &mut Registry, region: &str) -> Metrics {
        let m = Metrics {
            queue_age: Family::default(),
            queue_depth: Family::default(),
            region: region.to_string(),
            upstream: Family::default(),
            hints_capped: Family::default(),
        };
        registry.register(
            "reviewlane_queue_age_seconds",
            "Age of the oldest review on the lane, including ones waiting out a retry delay",
            m.queue_age.clone(),
        );
        registry.register("reviewlane_queue_depth", "Reviews on the lane", m.queue_depth.clone());
        registry.register(
            "reviewlane_upstream_responses",
            "Provider answers by quota scope and outcome class",
            m.upstream.clone(),
        );
        registry.register(
            "reviewlane_retry_hints_capped",
            "Provider retry hints above the ceiling (rescheduled at the ceiling)",
            m.hints_capped.clone(),
        );
        m
    }

    pub fn upstream(&self, scope: &Scope, outcome: &str) {
        self.upstream
            .get_or_create(&ScopeOutcome {
                region: self.region.clone(),
                provider: scope.provider.clone(),
                model_class: scope.model_class.clone(),
                tenant: scope.tenant.clone(),
                outcome: outcome.to_string(),
            })
            .inc();
    }

    pub fn lane(&self, lane: &str, age_secs: f64, depth: i64) {
        let labels = LaneLabels { region: self.region.clone(), lane: lane.to_string() };
        self.queue_age.get_or_create(&labels).set(age_secs);
        self.queue_depth.get_or_create(&labels).set(depth);
    }

    pub fn hint_capped(&self) {
        self.hints_capped.get_or_create(&RegionLabel { region: self.region.clone() }).inc();
    }
}
