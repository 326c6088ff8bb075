//! `WatchReview` and `CancelReview` (`GetReview` is one read, in the dispatcher): a
//! watch follows every revision of the record; a cancel ends the job and drops its
//! content.

use super::*;

impl ReviewApi {
    /// A watch of one of the tenant's reviews: the review now, then at each change (and
    /// at least every keepalive), until it is final.
    pub(super) async fn watch(&self, tenant: Arc<Tenant>, id: String) -> Result<WatchStream, ApiError> {
        let (handle, _) = self.owned_job(&tenant, &id).await?;
        let permit = self.watch_permit(&tenant.id)?;
        // Read, then follow every later revision: nothing falls between the two.
        let (mut rec, last) = handle.jobs.get(&id).await?.ok_or(ApiError::NotFound)?;
        let mut changes = handle.jobs.changes_after(&id, last).await?;
        let (tx, rx) = mpsc::channel(8);
        let api = self.clone();
        let handle = handle.clone();
        let shutdown = self.shutdown.clone();
        let every = self.limits.watch_keepalive;
        tokio::spawn(
            async move {
                // Held while the stream is open.
                let _permit = permit;
                // Sends the review as it stands at least this often: callers and proxies
                // see the stream alive.
                let mut keepalive = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
                loop {
                    let review = match api.view(&handle, &rec).await {
                        Ok(r) => r,
                        Err(e) => {
                            let _ = tx.send(Err(e.into())).await;
                            return;
                        }
                    };
                    if tx.send(Ok(WatchReviewResponse { review: Some(review) })).await.is_err() || rec.state.is_final()
                    {
                        return;
                    }
                    // The next revision, or the review as it stands when the keepalive is due.
                    tokio::select! {
                        c = changes.next() => match c {
                            Some(Ok(Some((r, _)))) => rec = r,
                            // Removed under the watch (retention).
                            Some(Ok(None)) => {
                                let _ = tx.send(Err(ApiError::NotFound.into())).await;
                                return;
                            }
                            None => {
                                let lost = ApiError::StreamInterrupted {
                                    reason: Reason::RegionStoreUnavailable,
                                    what: "region store connection lost; watch again",
                                };
                                let _ = tx.send(Err(lost.into())).await;
                                return;
                            }
                            Some(Err(e)) => {
                                let _ = tx.send(Err(ApiError::from(e).into())).await;
                                return;
                            }
                        },
                        _ = keepalive.tick() => {}
                        _ = shutdown.cancelled() => {
                            let down = ApiError::StreamInterrupted { reason: Reason::ShuttingDown, what: "server shutting down; watch again" };
                            let _ = tx.send(Err(down.into())).await;
                            return;
                        }
                        _ = tx.closed() => return,
                    }
                }
            }
            .instrument(tracing::Span::current()),
        );
        Ok(Box::pin(ReceiverStream::new(rx)))
    }

    /// Cancels one of the tenant's reviews (unless its delivery has started): the review
    /// as it stands after.
    pub(super) async fn cancel(&self, tenant: &Tenant, id: &str) -> Result<proto::Review, ApiError> {
        let (handle, rec) = self.owned_job(tenant, id).await?;
        let rec = match handle.jobs.apply(&rec.job_id, &Event::Cancel).await {
            Ok(r) => {
                tracing::info!("review cancelled");
                self.metrics.terminal.inc(r.region, r.lane, reviewlane_core::job::TerminalReason::Cancelled);
                // A cancelled job keeps none of its content. If this fails, retention
                // removes it later; the cancel itself stands.
                if let Err(e) = reviewlane_shared::content::drop_content(&handle.layout, &r).await {
                    tracing::warn!(error = %e, kind = e.kind(), "dropping a cancelled job's content failed");
                }
                r
            }
            Err(StoreError::Transition(_, current)) => *current,
            Err(e) => return Err(e.into()),
        };
        self.view(handle, &rec).await
    }
}
