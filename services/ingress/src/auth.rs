//! Authentication: `authorization: Bearer <API key>` -> tenant, checked from the
//! request's headers before its body is read or decoded ([`Authenticated`] wraps the
//! review service; health and reflection stay open). A caller without a valid key
//! cannot make the server decode a multi-megabyte body, and a refusal is counted and
//! traced like any other outcome. The tenant never comes from a message body.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use http::HeaderMap;
use reviewlane_core::tenants::{Tenant, Tenants};
use tonic::Request;
use tonic::codegen::{BoxFuture, Service};
use tonic::server::NamedService;

use crate::error::{ApiError, AuthFailure};
use crate::rpc::{Metrics, method_of};

#[derive(Clone)]
pub struct Authenticator {
    tenants: Arc<Tenants>,
}

/// The tenant [`Authenticated`] found for a request, in its extensions.
#[derive(Clone)]
pub struct Caller(pub Arc<Tenant>);

impl Authenticator {
    pub fn new(tenants: Arc<Tenants>) -> Self {
        Authenticator { tenants }
    }

    /// The tenant of a request that went through [`Authenticated`]; one that did not
    /// (a handler called directly) is authenticated from its metadata here.
    pub fn tenant<T>(&self, req: &Request<T>) -> Result<Arc<Tenant>, ApiError> {
        match req.extensions().get::<Caller>() {
            Some(Caller(t)) => Ok(t.clone()),
            None => self.from_headers(req.metadata().as_ref()),
        }
    }

    /// The tenant a request's `authorization` header names; records it on the span.
    pub fn from_headers(&self, headers: &HeaderMap) -> Result<Arc<Tenant>, ApiError> {
        let header = headers.get("authorization").ok_or(ApiError::Unauthenticated(AuthFailure::Missing))?;
        let key = header
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or(ApiError::Unauthenticated(AuthFailure::Malformed))?;
        let tenant = self.tenants.authenticate(key).ok_or(ApiError::Unauthenticated(AuthFailure::Unknown))?;
        let span = tracing::Span::current();
        span.record("tenant", tenant.id.as_str()).record("region", tenant.region.as_str());
        Ok(tenant)
    }
}

/// A gRPC service behind authentication: the key is checked from the headers, inside
/// the request's span, before the inner service reads the body. A refusal is answered
/// `UNAUTHENTICATED` without reading the body at all.
#[derive(Clone)]
pub struct Authenticated<S> {
    inner: S,
    auth: Authenticator,
    metrics: Metrics,
}

impl<S> Authenticated<S> {
    pub fn new(inner: S, auth: Authenticator, metrics: Metrics) -> Self {
        Authenticated { inner, auth, metrics }
    }
}

impl<S, B> Service<http::Request<B>> for Authenticated<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        // The clone that was made ready serves this call (tower's usual swap).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (auth, metrics) = (self.auth.clone(), self.metrics.clone());
        Box::pin(async move {
            let started = Instant::now();
            match auth.from_headers(req.headers()) {
                Ok(tenant) => {
                    req.extensions_mut().insert(Caller(tenant));
                    inner.call(req).await
                }
                Err(e) => {
                    let method = method_of(req.uri().path());
                    let refused = metrics.finish::<()>(method, started, Err(e.into()));
                    Ok(refused.expect_err("a refusal").into_http())
                }
            }
        })
    }
}

impl<S: NamedService> NamedService for Authenticated<S> {
    const NAME: &'static str = S::NAME;
}
