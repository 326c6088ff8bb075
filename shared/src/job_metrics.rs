//! Metric families about jobs that more than one service records. Terminal reasons are
//! counted where the job ends: the extractor (budgets, rejections, invalid output), the
//! publisher (delivery) and the ingress (cancellation); dashboards sum over services.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use reviewlane_core::job::TerminalReason;
use reviewlane_core::region::{Lane, Region};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TerminalLabels {
    pub region: String,
    pub lane: String,
    pub reason: String,
}

/// `reviewlane_jobs_terminal_total{region, lane, reason}`.
#[derive(Clone, Default)]
pub struct TerminalJobs(Family<TerminalLabels, Counter>);

impl TerminalJobs {
    pub fn register(registry: &mut Registry) -> TerminalJobs {
        let t = TerminalJobs::default();
        registry.register("reviewlane_jobs_terminal", "Jobs that ended without a result, by reason", t.0.clone());
        t
    }

    /// Every (lane, reason) of `region` exposed at zero from the start: `increase()`
    /// over a series born at its first event reads 0, so an alert on the first
    /// delivery failure, dead letter or exhausted budget would never fire.
    pub fn at_zero(&self, region: Region) {
        for lane in Lane::ALL {
            for reason in TerminalReason::ALL {
                let _ = self.0.get_or_create(&TerminalLabels {
                    region: region.as_str().into(),
                    lane: lane.as_str().into(),
                    reason: reason.as_str().into(),
                });
            }
        }
    }

    pub fn inc(&self, region: Region, lane: Lane, reason: TerminalReason) {
        self.0
            .get_or_create(&TerminalLabels {
                region: region.as_str().into(),
                lane: lane.as_str().into(),
                reason: reason.as_str().into(),
            })
            .inc();
    }
}
