//! The extractor's metric families, registered in one place. Labels: region, lane,
//! provider, model class, tenant (from config), schema version (known versions only)
//! and closed outcome/reason sets — never content.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use reviewlane_core::job::{Budget, TerminalReason};
use reviewlane_core::region::{Lane, Region};
use reviewlane_shared::job_metrics::TerminalJobs;

use crate::quota::Scope;
use crate::upstream::Usage;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScopeLabels {
    pub region: String,
    pub provider: String,
    pub model_class: String,
    pub tenant: String,
}

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabels {
    pub region: String,
    pub provider: String,
    /// `2xx`, `4xx`, `429`, `5xx`, `timeout`, `connect`.
    pub status_class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub region: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ValidationLabels {
    pub region: String,
    pub schema_version: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheLabels {
    pub region: String,
    /// `hit`, `miss`.
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreLabels {
    pub region: String,
    /// `account` (the region's JetStream storage) or a stream with its own bound.
    pub store: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PaidLabels {
    pub region: String,
    /// The deployment's id (configured, never content).
    pub deployment: String,
    pub class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PaidTokenLabels {
    pub region: String,
    pub deployment: String,
    pub class: String,
    /// `in`, `out`.
    pub direction: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeploymentLabels {
    pub region: String,
    /// The deployment's id (configured, never content).
    pub deployment: String,
    pub class: String,
    /// One of `DEPLOYMENT_STATES`.
    pub state: String,
}

/// What a deployment of the pool is doing: `routing` (it takes reviews), `paused` (a
/// 429), `refusing` (its budgets have no room for a while), or its circuit open:
/// `out_of_quota`, `key_refused`, `failing`.
pub const DEPLOYMENT_STATES: [&str; 6] = ["routing", "paused", "refusing", "out_of_quota", "key_refused", "failing"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenLabels {
    pub region: String,
    pub tenant: String,
    pub model_class: String,
    /// `in`, `out`.
    pub direction: String,
}

#[derive(Clone)]
pub struct Metrics {
    region: Region,
    /// Age of the oldest review on the lane (waiting, being processed, or waiting out
    /// a retry delay), from stream metadata.
    pub queue_age: Family<LaneLabels, Gauge<f64, AtomicU64>>,
    /// Reviews on the lane.
    pub queue_depth: Family<LaneLabels, Gauge>,
    /// The lane's service window (SLO), for dashboards and alerts to compare against.
    pub lane_slo: Family<LaneLabels, Gauge<f64, AtomicU64>>,
    /// Provider answers by quota scope and outcome class.
    pub upstream: Family<ScopeOutcome, Counter>,
    pub upstream_duration: Family<StatusLabels, Histogram>,
    /// Calls running and the calls this replica may run, by quota scope.
    pub scope_in_flight: Family<ScopeLabels, Gauge>,
    pub scope_limit: Family<ScopeLabels, Gauge>,
    /// Retry hints above the ceiling, rescheduled at the ceiling.
    pub hints_capped: Family<RegionLabel, Counter>,
    pub batch_lines_unrecognised: Family<RegionLabel, Counter>,
    pub retry_delay: Family<ReasonLabels, Histogram>,
    pub attempts: Family<LaneLabels, Histogram>,
    pub validation_failures: Family<ValidationLabels, Counter>,
    pub quarantined: Family<ReasonLabels, Counter>,
    pub findings: Family<RegionLabel, Counter>,
    pub cache: Family<CacheLabels, Counter>,
    pub tokens: Family<TokenLabels, Counter>,
    pub tokens_saved: Family<TokenLabels, Counter>,
    pub terminal: TerminalJobs,
    /// Answers of a holder whose lease had been taken over: discarded, never recorded.
    pub stale_results: Family<RegionLabel, Counter>,
    /// Store writes retried after a paid answer, by what failed (`timeout`, ...).
    pub store_retries: Family<ReasonLabels, Counter>,
    /// Results kept, by where (`inline`, `object`).
    pub kept: Family<ReasonLabels, Counter>,
    /// Jobs the reconciler found stranded, by what it did (`resumed`, `ended`).
    pub reconciled: Family<ReasonLabels, Counter>,
    /// Jobs not final, past their deadline, with no message and no live lease, at the
    /// reconciler's last pass (before it acted on them).
    pub stuck: Family<RegionLabel, Gauge>,
    /// How full the region's store is: the JetStream account's storage against its
    /// limit, and each lane against its bound (bytes or messages, the fuller).
    pub store_used: Family<StoreLabels, Gauge<f64, AtomicU64>>,
    /// Each deployment of the pool: 1 for its state, 0 for the others.
    pub deployment_state: Family<DeploymentLabels, Gauge>,
    deployment_tokens: Family<PaidTokenLabels, Counter>,
    deployment_cost: Family<PaidLabels, Counter<f64, AtomicU64>>,
}

impl Metrics {
    pub fn register(registry: &mut Registry, region: Region) -> Metrics {
        let m = Metrics {
            region,
            queue_age: Family::default(),
            queue_depth: Family::default(),
            lane_slo: Family::default(),
            upstream: Family::default(),
            upstream_duration: Family::new_with_constructor(|| {
                Histogram::new([0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0])
            }),
            scope_in_flight: Family::default(),
            scope_limit: Family::default(),
            hints_capped: Family::default(),
            batch_lines_unrecognised: Family::default(),
            retry_delay: Family::new_with_constructor(|| {
                Histogram::new([0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0])
            }),
            attempts: Family::new_with_constructor(|| Histogram::new([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 15.0])),
            validation_failures: Family::default(),
            quarantined: Family::default(),
            findings: Family::default(),
            cache: Family::default(),
            tokens: Family::default(),
            tokens_saved: Family::default(),
            terminal: TerminalJobs::register(registry),
            stale_results: Family::default(),
            store_retries: Family::default(),
            kept: Family::default(),
            reconciled: Family::default(),
            stuck: Family::default(),
            store_used: Family::default(),
            deployment_state: Family::default(),
            deployment_tokens: Family::default(),
            deployment_cost: Family::default(),
        };
        registry.register(
            "reviewlane_deployment_tokens",
            "Provider tokens paid, by the deployment that answered, its model class and direction",
            m.deployment_tokens.clone(),
        );
        registry.register(
            "reviewlane_deployment_cost_usd",
            "Estimated cost of the paid calls in US dollars at the deployment's price (batch price for a sweep's lines), by deployment and model class",
            m.deployment_cost.clone(),
        );
        registry.register(
            "reviewlane_deployment_state",
            "Each deployment of the region's pool: 1 for its state (routing, paused, refusing, out_of_quota, key_refused, failing)",
            m.deployment_state.clone(),
        );
        registry.register(
            "reviewlane_stale_results",
            "Provider answers discarded because their holder's lease had been taken over",
            m.stale_results.clone(),
        );
        registry.register(
            "reviewlane_store_retries",
            "Store writes retried after a paid answer (never the provider call), by failure kind",
            m.store_retries.clone(),
        );
        registry.register("reviewlane_results_kept", "Results kept, by where (inline, object)", m.kept.clone());
        // Exposed at zero from the start, so alerts see the series before the first event.
        for action in ["resumed", "ended"] {
            let _ = m.reconciled.get_or_create(&m.reason(action));
        }
        m.terminal.at_zero(region);
        for lane in Lane::ALL {
            let _ = m.attempts.get_or_create(&m.lane_labels(lane));
        }
        m.stuck(0);
        registry.register(
            "reviewlane_store_used_ratio",
            "How full the region's store is, 0..1: the JetStream account's storage against its limit, each lane against its bound",
            m.store_used.clone(),
        );
        registry.register(
            "reviewlane_reconciled_jobs",
            "Stranded jobs the reconciler resumed or ended, by action",
            m.reconciled.clone(),
        );
        registry.register(
            "reviewlane_stuck_jobs",
            "Jobs not final, past their deadline, with neither a message on the lane nor a live lease",
            m.stuck.clone(),
        );
        registry.register(
            "reviewlane_queue_age_seconds",
            "Age of the oldest review on the lane, including ones waiting out a retry delay",
            m.queue_age.clone(),
        );
        registry.register("reviewlane_queue_depth", "Reviews on the lane", m.queue_depth.clone());
        registry.register(
            "reviewlane_lane_slo_seconds",
            "The lane's service window: a review should be published within it",
            m.lane_slo.clone(),
        );
        registry.register(
            "reviewlane_upstream_responses",
            "Provider answers by quota scope and outcome class (rate_limited = 429)",
            m.upstream.clone(),
        );
        registry.register(
            "reviewlane_upstream_request_duration_seconds",
            "Provider call duration by status class",
            m.upstream_duration.clone(),
        );
        registry.register(
            "reviewlane_scope_in_flight",
            "Provider calls running on this replica, by quota scope",
            m.scope_in_flight.clone(),
        );
        registry.register(
            "reviewlane_scope_limit",
            "Provider calls this replica may run now (its share of the scope's window), by quota scope",
            m.scope_limit.clone(),
        );
        registry.register(
            "reviewlane_retry_hints_capped",
            "Provider retry hints above the ceiling (rescheduled at the ceiling)",
            m.hints_capped.clone(),
        );
        registry.register(
            "reviewlane_batch_lines_unrecognised",
            "Provider batch result lines whose error code is not known here (taken as not run)",
            m.batch_lines_unrecognised.clone(),
        );
        registry.register(
            "reviewlane_retry_delay_seconds",
            "Delay of each scheduled retry, by the budget it spends",
            m.retry_delay.clone(),
        );
        registry.register(
            "reviewlane_job_attempts",
            "Provider calls per job that reached a result or ended",
            m.attempts.clone(),
        );
        registry.register(
            "reviewlane_validation_failures",
            "Provider outputs that failed validation, by schema version and reason",
            m.validation_failures.clone(),
        );
        registry.register(
            "reviewlane_findings_quarantined",
            "Findings withheld from delivery, by reason",
            m.quarantined.clone(),
        );
        registry.register("reviewlane_findings", "Findings validated for delivery", m.findings.clone());
        registry.register("reviewlane_result_cache", "Result cache look-ups by result", m.cache.clone());
        registry.register(
            "reviewlane_tokens",
            "Provider tokens by tenant, model class and direction",
            m.tokens.clone(),
        );
        registry.register(
            "reviewlane_tokens_saved",
            "Provider tokens result-cache hits saved (what the cached call cost), by tenant, model class and direction",
            m.tokens_saved.clone(),
        );
        m
    }

    fn scope_labels(&self, scope: &Scope) -> ScopeLabels {
        ScopeLabels {
            region: self.region.as_str().into(),
            provider: scope.provider.clone(),
            model_class: scope.model_class.clone(),
            tenant: scope.tenant.clone(),
        }
    }

    fn reason(&self, reason: &str) -> ReasonLabels {
        ReasonLabels { region: self.region.as_str().into(), reason: reason.into() }
    }

    pub fn stale_result(&self) {
        self.stale_results.get_or_create(&RegionLabel { region: self.region.as_str().into() }).inc();
    }

    pub fn store_retry(&self, kind: &str) {
        self.store_retries.get_or_create(&self.reason(kind)).inc();
    }

    pub fn kept(&self, kept: reviewlane_shared::results::Kept) {
        let at = match kept {
            reviewlane_shared::results::Kept::Inline => "inline",
            reviewlane_shared::results::Kept::Object => "object",
        };
        self.kept.get_or_create(&self.reason(at)).inc();
    }

    pub fn reconciled(&self, action: &str) {
        self.reconciled.get_or_create(&self.reason(action)).inc();
    }

    pub fn store_used(&self, store: &str, ratio: f64) {
        self.store_used
            .get_or_create(&StoreLabels { region: self.region.as_str().into(), store: store.into() })
            .set(ratio);
    }

    pub fn stuck(&self, n: usize) {
        self.stuck.get_or_create(&RegionLabel { region: self.region.as_str().into() }).set(n as i64);
    }

    /// The outcome classes of `reviewlane_upstream_responses_total`.
    pub const OUTCOMES: [&'static str; 5] = ["ok", "rate_limited", "insufficient_quota", "transient", "rejected"];

    /// A quota scope this replica serves: its answer counters exposed at zero from the
    /// start, so the first `insufficient_quota` (after which the open circuit stops
    /// every call) is an increase an alert sees.
    pub fn known_scope(&self, scope: &Scope) {
        for outcome in Self::OUTCOMES {
            let _ = self.upstream.get_or_create(&self.scope_outcome(scope, outcome));
        }
    }

    fn scope_outcome(&self, scope: &Scope, outcome: &str) -> ScopeOutcome {
        ScopeOutcome {
            region: self.region.as_str().into(),
            provider: scope.provider.clone(),
            model_class: scope.model_class.clone(),
            tenant: scope.tenant.clone(),
            outcome: outcome.to_string(),
        }
    }

    pub fn upstream(&self, scope: &Scope, outcome: &str, status_class: &str, took: Duration) {
        self.upstream.get_or_create(&self.scope_outcome(scope, outcome)).inc();
        self.upstream_duration
            .get_or_create(&StatusLabels {
                region: self.region.as_str().into(),
                provider: scope.provider.clone(),
                status_class: status_class.into(),
            })
            .observe(took.as_secs_f64());
    }

    /// A paid call, by the deployment that answered it: its tokens and estimated cost.
    pub fn charged(&self, c: &reviewlane_core::job::Charge) {
        let (deployment, class) = (&c.served_by.deployment, &c.served_by.model_class);
        for (direction, n) in [("in", c.tokens.input), ("out", c.tokens.output)] {
            let labels = PaidTokenLabels {
                region: self.region.as_str().into(),
                deployment: deployment.clone(),
                class: class.clone(),
                direction: direction.into(),
            };
            self.deployment_tokens.get_or_create(&labels).inc_by(n);
        }
        let labels =
            PaidLabels { region: self.region.as_str().into(), deployment: deployment.clone(), class: class.clone() };
        self.deployment_cost.get_or_create(&labels).inc_by(c.cost_micro_usd as f64 / 1e6);
    }

    /// Deployment `id` of `class` is in `state` (one of `DEPLOYMENT_STATES`).
    pub fn deployment(&self, id: &str, class: &str, state: &str) {
        for s in DEPLOYMENT_STATES {
            let labels = DeploymentLabels {
                region: self.region.as_str().into(),
                deployment: id.into(),
                class: class.into(),
                state: s.into(),
            };
            self.deployment_state.get_or_create(&labels).set(i64::from(s == state));
        }
        // Exposed at zero from the start, so a panel or a rate sees the series.
        let paid = PaidLabels { region: self.region.as_str().into(), deployment: id.into(), class: class.into() };
        let _ = self.deployment_cost.get_or_create(&paid);
    }

    pub fn scope(&self, scope: &Scope, in_flight: u32, limit: u32) {
        let labels = self.scope_labels(scope);
        self.scope_in_flight.get_or_create(&labels).set(in_flight as i64);
        self.scope_limit.get_or_create(&labels).set(limit as i64);
    }

    fn lane_labels(&self, lane: Lane) -> LaneLabels {
        LaneLabels { region: self.region.as_str().into(), lane: lane.as_str().into() }
    }

    pub fn lane(&self, lane: Lane, age_secs: f64, depth: i64) {
        let labels = self.lane_labels(lane);
        self.queue_age.get_or_create(&labels).set(age_secs);
        self.queue_depth.get_or_create(&labels).set(depth);
    }

    pub fn slo(&self, lane: Lane, window: Duration) {
        self.lane_slo.get_or_create(&self.lane_labels(lane)).set(window.as_secs_f64());
    }

    pub fn hint_capped(&self) {
        self.hints_capped.get_or_create(&RegionLabel { region: self.region.as_str().into() }).inc();
    }

    pub fn batch_lines_unrecognised(&self, n: u64) {
        self.batch_lines_unrecognised.get_or_create(&RegionLabel { region: self.region.as_str().into() }).inc_by(n);
    }

    pub fn retry(&self, budget: Budget, delay: Duration) {
        self.retry_delay
            .get_or_create(&ReasonLabels { region: self.region.as_str().into(), reason: budget.as_str().into() })
            .observe(delay.as_secs_f64());
    }

    /// A job reached a result or ended after `calls` provider calls.
    pub fn finished(&self, lane: Lane, calls: u32, terminal: Option<TerminalReason>) {
        self.attempts.get_or_create(&self.lane_labels(lane)).observe(calls as f64);
        if let Some(reason) = terminal {
            self.terminal.inc(self.region, lane, reason);
        }
    }

    pub fn invalid_output(&self, schema_version: &str, reason: &str) {
        // Only known versions reach the extractor (the ingress refuses others).
        let schema_version =
            if reviewlane_core::findings::is_known_schema(schema_version) { schema_version } else { "unknown" };
        self.validation_failures
            .get_or_create(&ValidationLabels {
                region: self.region.as_str().into(),
                schema_version: schema_version.into(),
                reason: reason.into(),
            })
            .inc();
    }

    pub fn validated(&self, findings: usize, quarantined: impl Iterator<Item = &'static str>) {
        self.findings.get_or_create(&RegionLabel { region: self.region.as_str().into() }).inc_by(findings as u64);
        for reason in quarantined {
            self.quarantined
                .get_or_create(&ReasonLabels { region: self.region.as_str().into(), reason: reason.into() })
                .inc();
        }
    }

    pub fn cache(&self, hit: bool) {
        let result = if hit { "hit" } else { "miss" };
        self.cache.get_or_create(&CacheLabels { region: self.region.as_str().into(), result: result.into() }).inc();
    }

    /// Tokens a result-cache hit saved (what the cached call cost).
    pub fn tokens_saved(&self, tenant: &str, model_class: &str, t: Usage) {
        self.count_tokens(&self.tokens_saved, tenant, model_class, t);
    }

    pub fn tokens(&self, tenant: &str, model_class: &str, usage: Usage) {
        self.count_tokens(&self.tokens, tenant, model_class, usage);
    }

    fn count_tokens(&self, family: &Family<TokenLabels, Counter>, tenant: &str, model_class: &str, t: Usage) {
        for (direction, n) in [("in", t.input), ("out", t.output)] {
            family
                .get_or_create(&TokenLabels {
                    region: self.region.as_str().into(),
                    tenant: tenant.into(),
                    model_class: model_class.into(),
                    direction: direction.into(),
                })
                .inc_by(n);
        }
    }
}
