//! The server's decoding limit in the product's error shape. tonic refuses a request
//! over its decoding limit before any handler runs, with its own `OUT_OF_RANGE` text
//! and no details; this layer answers that refusal as every other error is answered
//! (`INVALID_ARGUMENT`, `ErrorInfo` reason `REQUEST_TOO_LARGE` with the limit, a field
//! violation on `diff`) and counts it. No handler of the review service answers
//! `OUT_OF_RANGE`, so that code from the inner service is always the decoding limit.

use std::task::{Context, Poll};
use std::time::Instant;

use tonic::codegen::{BoxFuture, Service};
use tonic::server::NamedService;

use crate::error::ApiError;
use crate::rpc::{Metrics, method_of};

#[derive(Clone)]
pub struct DecodingLimit<S> {
    inner: S,
    limit: usize,
    metrics: Metrics,
}

impl<S> DecodingLimit<S> {
    /// `inner` refuses requests over `limit` bytes (its `max_decoding_message_size`).
    pub fn new(inner: S, limit: usize, metrics: Metrics) -> Self {
        DecodingLimit { inner, limit, metrics }
    }
}

/// Whether a response is a gRPC `OUT_OF_RANGE` answered in its headers (a trailers-only
/// answer, as an error before any message is).
pub fn is_out_of_range<B>(res: &http::Response<B>) -> bool {
    res.headers().get("grpc-status").is_some_and(|v| v.as_bytes() == b"11")
}

impl<S, B> Service<http::Request<B>> for DecodingLimit<S>
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

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (limit, metrics) = (self.limit, self.metrics.clone());
        let method = method_of(req.uri().path());
        Box::pin(async move {
            let started = Instant::now();
            let res = inner.call(req).await?;
            if !is_out_of_range(&res) {
                return Ok(res);
            }
            tracing::info!(limit, "request over the decoding limit refused");
            let refused = metrics.finish::<()>(method, started, Err(ApiError::RequestTooLarge { limit }.into()));
            Ok(refused.expect_err("a refusal").into_http())
        })
    }
}

impl<S: NamedService> NamedService for DecodingLimit<S> {
    const NAME: &'static str = S::NAME;
}
