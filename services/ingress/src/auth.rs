//! Authentication: `authorization: Bearer <API key>` -> tenant. Every review-service
//! handler starts with it (health and reflection stay open), so a refusal is counted
//! and traced like any other outcome. The tenant never comes from a message body.

use std::sync::Arc;

use reviewlane_shared::tenants::{Tenant, Tenants};
use tonic::Request;

use crate::error::ApiError;

#[derive(Clone)]
pub struct Authenticator {
    tenants: Arc<Tenants>,
}

impl Authenticator {
    pub fn new(tenants: Arc<Tenants>) -> Self {
        Authenticator { tenants }
    }

    pub fn tenant<T>(&self, req: &Request<T>) -> Result<Arc<Tenant>, ApiError> {
        let header = req.metadata().get("authorization").ok_or(ApiError::Unauthenticated("missing bearer API key"))?;
        let key = header
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or(ApiError::Unauthenticated("malformed authorization header (expected `Bearer <key>`)"))?;
        let tenant = self.tenants.authenticate(key).ok_or(ApiError::Unauthenticated("unknown API key"))?;
        let span = tracing::Span::current();
        span.record("tenant", tenant.id.as_str()).record("region", tenant.region.as_str());
        Ok(tenant)
    }
}
