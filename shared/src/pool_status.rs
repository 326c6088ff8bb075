//! What the extractors last saw of each deployment of their region's pool, for
//! operators (`ListDeployments`, `reviewctl pool`): its class, state and room. Every
//! extractor replica writes it every few seconds to `QUOTA_<R>` under
//! `status.<deployment id>` (the last writer stands; each reads the fleet's shared
//! state, so they agree), and the ingress reads it. It names configured deployments
//! and their limits, never content or keys.

use async_nats::jetstream::kv;
pub use reviewlane_core::pool_status::{BudgetRoom, DeploymentStatus};

use crate::store::StoreError;

const PREFIX: &str = "status.";

/// Writes what this replica sees of one deployment.
pub async fn put(kv: &kv::Store, status: &DeploymentStatus) -> Result<(), StoreError> {
    let bytes = serde_json::to_vec(status).expect("a status serializes");
    kv.put(format!("{PREFIX}{}", status.deployment), bytes.into()).await.map_err(StoreError::other)?;
    Ok(())
}

/// Every deployment of the region's pool, as last written, by id (its keys from the
/// stream's subject index: `kv_listing`).
pub async fn list(kv: &kv::Store) -> Result<Vec<DeploymentStatus>, StoreError> {
    let keys = crate::kv_listing::keys(kv, &format!("{PREFIX}>")).await?;
    let mut out = Vec::new();
    for key in keys {
        if let Some(v) = kv.get(&key).await.map_err(StoreError::other)?
            && let Ok(s) = serde_json::from_slice::<DeploymentStatus>(&v)
        {
            out.push(s);
        }
    }
    out.sort_by(|a, b| (&a.model_class, &a.deployment).cmp(&(&b.model_class, &b.deployment)));
    Ok(out)
}
