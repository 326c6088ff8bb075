//! The load generator: a gRPC client of `ReviewService` that submits a list of jobs at
//! a fixed concurrency and, optionally, a fixed rate, with a per-request timeout; then
//! follows every job to a final state (`GetReview`) and takes the time each one was
//! published from the webhook receiver (the tenant's sink).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use reviewlane_api::proto::review_service_client::ReviewServiceClient;
use reviewlane_api::proto::{self, GetReviewRequest, JobState, SubmitReviewRequest};
use reviewlane_core::region::{Lane, Region};
use tokio::sync::Semaphore;
use tonic::transport::Channel;

use crate::stack::{EU_KEY, US_KEY, US2_KEY, authed};
use crate::webhook::WebhookReceiver;

/// The three tenants of `stack::tenants_toml`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tenant {
    /// `acme`, US.
    Acme,
    /// `beta`, US.
    Beta,
    /// `euro`, EU.
    Euro,
}

impl Tenant {
    pub fn id(self) -> &'static str {
        match self {
            Tenant::Acme => "acme",
            Tenant::Beta => "beta",
            Tenant::Euro => "euro",
        }
    }
    pub fn key(self) -> &'static str {
        match self {
            Tenant::Acme => US_KEY,
            Tenant::Beta => US2_KEY,
            Tenant::Euro => EU_KEY,
        }
    }
    pub fn region(self) -> Region {
        match self {
            Tenant::Acme | Tenant::Beta => Region::Us,
            Tenant::Euro => Region::Eu,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Job {
    pub tenant: Tenant,
    pub lane: Lane,
    pub idempotency_key: String,
    pub diff: String,
}

impl Job {
    /// The job id the ingress derives for this request.
    pub fn job_id(&self) -> String {
        reviewlane_core::job_id::derive(self.tenant.region(), self.tenant.id(), &self.idempotency_key)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    Accepted,
    /// No answer within the client timeout.
    Timeout,
    Refused(tonic::Code),
}

/// One submit as the client saw it.
#[derive(Debug, Clone)]
pub struct Submitted {
    pub job: usize,
    pub job_id: String,
    pub started: Instant,
    pub submit_ms: f64,
    pub sent: Sent,
}

/// How the generator paces submits.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// Submits in flight at most.
    pub concurrency: usize,
    /// Submits started per second (`None`: as fast as `concurrency` allows).
    pub rate: Option<f64>,
    pub timeout: Duration,
}

pub async fn connect(addr: SocketAddr) -> anyhow::Result<Channel> {
    Ok(Channel::from_shared(format!("http://{addr}"))?.connect().await?)
}

/// A channel that connects on first use and again after the server restarts.
pub fn connect_lazy(addr: SocketAddr) -> anyhow::Result<Channel> {
    Ok(Channel::from_shared(format!("http://{addr}"))?.connect_timeout(Duration::from_secs(2)).connect_lazy())
}

/// The submit of `job`, authenticated as its tenant.
pub fn request(job: &Job) -> tonic::Request<SubmitReviewRequest> {
    authed(
        job.tenant.key(),
        SubmitReviewRequest {
            idempotency_key: job.idempotency_key.clone(),
            lane: match job.lane {
                Lane::Interactive => proto::Lane::Interactive as i32,
                Lane::Batch => proto::Lane::Batch as i32,
            },
            diff: job.diff.clone(),
            schema_version: "findings.v1".into(),
            metadata: Some(proto::ReviewMetadata {
                repository: format!("load/{}", job.tenant.id()),
                base_revision: "a1b2c3d".into(),
                head_revision: "e4f5a6b".into(),
                ..Default::default()
            }),

            ..Default::default()
        },
    )
}

/// Submits `jobs[i]` for each index in `which`, paced; returns one record per submit in
/// the order they finished.
pub async fn submit(channel: &Channel, jobs: &Arc<Vec<Job>>, which: Vec<usize>, pace: Pace) -> Vec<Submitted> {
    let slots = Arc::new(Semaphore::new(pace.concurrency.max(1)));
    let mut tasks = Vec::with_capacity(which.len());
    let mut ticker = pace.rate.map(|r| tokio::time::interval(Duration::from_secs_f64(1.0 / r.max(0.001))));
    for i in which {
        if let Some(t) = ticker.as_mut() {
            t.tick().await;
        }
        let permit = slots.clone().acquire_owned().await.expect("semaphore open");
        let mut client = ReviewServiceClient::new(channel.clone());
        let jobs = jobs.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let job = &jobs[i];
            let started = Instant::now();
            let res = tokio::time::timeout(pace.timeout, client.submit_review(request(job))).await;
            let submit_ms = started.elapsed().as_secs_f64() * 1000.0;
            let sent = match res {
                Err(_) => Sent::Timeout,
                Ok(Ok(_)) => Sent::Accepted,
                Ok(Err(status)) => Sent::Refused(status.code()),
            };
            Submitted { job: i, job_id: job.job_id(), started, submit_ms, sent }
        }));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.expect("submit task"));
    }
    out
}

/// A job's end as observed.
#[derive(Debug, Clone)]
pub struct Final {
    pub state: JobState,
    pub reason: String,
}

/// Reads every job until it is final or `within` has passed; jobs never seen final are
/// absent from the result.
pub async fn follow(
    channel: &Channel,
    jobs: &[Job],
    submitted: &[Submitted],
    within: Duration,
) -> HashMap<String, Final> {
    let deadline = Instant::now() + within;
    let mut finals: HashMap<String, Final> = HashMap::new();
    loop {
        let open: Vec<(String, &'static str)> = submitted
            .iter()
            .filter(|s| s.sent != Sent::Refused(tonic::Code::InvalidArgument) && !finals.contains_key(&s.job_id))
            .map(|s| (s.job_id.clone(), jobs[s.job].tenant.key()))
            .collect();
        if open.is_empty() || Instant::now() > deadline {
            return finals;
        }
        let reads = futures::stream::iter(open)
            .map(|(id, key)| {
                let mut client = ReviewServiceClient::new(channel.clone());
                async move {
                    let r = client.get_review(authed(key, GetReviewRequest { job_id: id.clone() })).await;
                    (id, r.ok().and_then(|r| r.into_inner().review))
                }
            })
            .buffer_unordered(32)
            .collect::<Vec<_>>()
            .await;
        for (id, review) in reads {
            let Some(r) = review else { continue };
            let state = JobState::try_from(r.state).unwrap_or(JobState::Unspecified);
            if matches!(state, JobState::Published | JobState::Terminal) {
                finals.insert(id, Final { state, reason: r.terminal_reason });
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Follows one job with `WatchReview` until it is final, for up to `within`.
pub async fn watch_final(channel: &Channel, job: &Job, within: Duration) -> Option<Final> {
    let mut client = ReviewServiceClient::new(channel.clone());
    let watch = async {
        let req = authed(job.tenant.key(), proto::WatchReviewRequest { job_id: job.job_id() });
        let mut stream = client.watch_review(req).await.ok()?.into_inner();
        while let Some(Ok(update)) = stream.next().await {
            let Some(r) = update.review else { continue };
            let state = JobState::try_from(r.state).unwrap_or(JobState::Unspecified);
            if matches!(state, JobState::Published | JobState::Terminal) {
                return Some(Final { state, reason: r.terminal_reason });
            }
        }
        None
    };
    tokio::time::timeout(within, watch).await.ok().flatten()
}

/// Deliveries per job id at the webhook, and the first one's arrival.
pub fn deliveries(webhook: &WebhookReceiver) -> BTreeMap<String, (u32, Instant)> {
    let mut out: BTreeMap<String, (u32, Instant)> = BTreeMap::new();
    for r in webhook.received() {
        let e = out.entry(r.idempotency_key.clone().unwrap_or_default()).or_insert((0, r.at));
        e.0 += 1;
        e.1 = e.1.min(r.at);
    }
    out
}

/// The `p` quantile (0..=1) of `values`, nearest rank; 0 when empty.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 51.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn job_ids_match_the_ingress_derivation() {
        let j = Job { tenant: Tenant::Euro, lane: Lane::Batch, idempotency_key: "k".into(), diff: String::new() };
        assert!(j.job_id().starts_with("eu_"));
    }
}
