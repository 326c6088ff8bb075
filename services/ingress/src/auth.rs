//! Authentication: `authorization: Bearer <API key>` -> tenant. Runs as an interceptor
//! in front of the review service only (health and reflection stay open), and puts the
//! tenant into the request's extensions. The tenant never comes from a message body.

use std::sync::Arc;

use reviewlane_shared::tenants::{Tenant, Tenants};
use tonic::{Request, Status};

use crate::error::ApiError;

#[derive(Clone)]
pub struct Authenticator {
    tenants: Arc<Tenants>,
}

impl Authenticator {
    pub fn new(tenants: Arc<Tenants>) -> Self {
        Authenticator { tenants }
    }

    pub fn intercept(&self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let header = req.metadata().get("authorization").ok_or(ApiError::Unauthenticated("missing bearer API key"))?;
        let key = header
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or(ApiError::Unauthenticated("malformed authorization header (expected `Bearer <key>`)"))?;
        let tenant = self.tenants.authenticate(key).ok_or(ApiError::Unauthenticated("unknown API key"))?;
        req.extensions_mut().insert(tenant);
        Ok(req)
    }
}

/// The authenticated tenant of a request that passed the interceptor.
pub fn tenant<T>(req: &Request<T>) -> Result<Arc<Tenant>, ApiError> {
    req.extensions().get::<Arc<Tenant>>().cloned().ok_or(ApiError::Unauthenticated("missing bearer API key"))
}
