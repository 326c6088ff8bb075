//! What an extractor replica sees of one deployment of its region's pool: written by
//! the extractors (`reviewlane_shared::pool_status`), read by the ingress for
//! operators (`ListDeployments`). Configured names and limits, never content or keys.

use serde::{Deserialize, Serialize};

/// One deployment as an extractor replica saw it at `observed_at_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeploymentStatus {
    pub deployment: String,
    /// `openai`, `anthropic`, `azure` or `builtin`.
    pub kind: String,
    pub model: String,
    pub model_class: String,
    /// `routing`, `paused`, `refusing`, `out_of_quota`, `key_refused`, `failing`.
    pub state: String,
    /// Calls in flight on its key across the fleet, and how many the fleet may have at
    /// once now (its congestion window).
    pub in_flight: u32,
    pub window: u32,
    /// Each metered budget of its key (configured or learned): its limit per period and
    /// what the fleet's bucket holds now, not yet taken by a replica.
    pub budgets: Vec<BudgetRoom>,
    /// How much longer a 429 pauses it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_for_ms: Option<u64>,
    pub observed_at_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetRoom {
    /// `rpm`, `tpm`, ...
    pub dimension: String,
    pub limit: u64,
    pub room: u64,
}
