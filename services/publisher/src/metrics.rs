//! The publisher's metric families, registered in one place. Labels: region, lane,
//! closed outcome sets — never content.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use reviewlane_core::job::TerminalReason;
use reviewlane_core::region::{Lane, Region};
use reviewlane_shared::job_metrics::TerminalJobs;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub region: String,
    /// `published`, `duplicate`, `failed`, `dropped`, `retry_scheduled`.
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LaneLabels {
    pub region: String,
    pub lane: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub region: String,
    pub reason: String,
}

#[derive(Clone)]
pub struct Metrics {
    region: Region,
    pub outcomes: Family<OutcomeLabels, Counter>,
    pub submit_to_published: Family<LaneLabels, Histogram, Buckets>,
    pub retry_delay: Family<ReasonLabels, Histogram>,
    pub terminal: TerminalJobs,
    /// GitHub answers that hit a rate limit, by kind, and the content interval.
    pub github: crate::github::GitHubMetrics,
}

/// Histograms with bucket bounds from configuration.
#[derive(Clone)]
pub struct Buckets(std::sync::Arc<[f64]>);

impl MetricConstructor<Histogram> for Buckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(self.0.iter().copied())
    }
}

/// Latency buckets with every lane's window among the bounds, so "published within
/// the SLO" is one bucket read.
pub fn latency_buckets(windows: &[Duration]) -> Vec<f64> {
    let mut b = vec![0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0];
    b.extend(windows.iter().map(|w| w.as_secs_f64()));
    b.sort_by(f64::total_cmp);
    b.dedup();
    b
}

impl Metrics {
    pub fn register(registry: &mut Registry, region: Region, lane_windows: [Duration; 2]) -> Metrics {
        let buckets = latency_buckets(&lane_windows);
        let m = Metrics {
            region,
            outcomes: Family::default(),
            submit_to_published: Family::new_with_constructor(Buckets(buckets.into())),
            retry_delay: Family::new_with_constructor(|| {
                Histogram::new([0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0])
            }),
            terminal: TerminalJobs::register(registry),
            github: crate::github::GitHubMetrics { region: region.as_str().into(), ..Default::default() },
        };
        registry.register("reviewlane_publish_outcomes", "Findings messages handled, by outcome", m.outcomes.clone());
        registry.register(
            "reviewlane_submit_to_published_seconds",
            "From submit to findings delivered, by lane; the lane's window is a bucket bound",
            m.submit_to_published.clone(),
        );
        registry.register(
            "reviewlane_retry_delay_seconds",
            "Delay of each scheduled retry, by reason",
            m.retry_delay.clone(),
        );
        registry.register(
            "reviewlane_github_rate_limited",
            "GitHub answers that hit a rate limit, by kind (primary, secondary)",
            m.github.limited.clone(),
        );
        registry.register(
            "reviewlane_github_content_interval_seconds",
            "Least time between content-creating GitHub requests to one account, as widened by secondary limits (the widest in force)",
            m.github.interval.clone(),
        );
        for kind in ["primary", "secondary"] {
            let _ = m
                .github
                .limited
                .get_or_create(&crate::github::LimitLabels { region: region.as_str().into(), kind: kind.into() });
        }
        m.github
            .interval
            .get_or_create(&crate::github::RegionLabel { region: region.as_str().into() })
            .set(crate::github::CONTENT_INTERVAL.as_secs_f64());
        // At zero from the start: the delivery alerts see the first failure.
        m.terminal.at_zero(region);
        m
    }

    pub fn outcome(&self, outcome: &str) {
        self.outcomes
            .get_or_create(&OutcomeLabels { region: self.region.as_str().into(), outcome: outcome.into() })
            .inc();
    }

    pub fn published(&self, lane: Lane, since_submit: Duration) {
        self.submit_to_published
            .get_or_create(&LaneLabels { region: self.region.as_str().into(), lane: lane.as_str().into() })
            .observe(since_submit.as_secs_f64());
    }

    pub fn retry(&self, delay: Duration) {
        self.retry_delay
            .get_or_create(&ReasonLabels { region: self.region.as_str().into(), reason: "delivery".into() })
            .observe(delay.as_secs_f64());
    }

    pub fn failed(&self, lane: Lane, reason: TerminalReason) {
        self.terminal.inc(self.region, lane, reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_lane_window_is_a_bucket_bound() {
        let b = latency_buckets(&[Duration::from_secs(45), Duration::from_secs(3600)]);
        assert!(b.contains(&45.0) && b.contains(&3600.0));
        assert!(b.windows(2).all(|w| w[0] < w[1]));
    }
}
