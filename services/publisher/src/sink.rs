//! Sinks: where a tenant's findings are delivered.
//!
//! - Webhook: POST, signed over a timestamp and the body, idempotent by job id
//!   (`Idempotency-Key`). Redirects are never followed (a 3xx is a failed delivery),
//!   targets on loopback, private, link-local or metadata addresses are refused unless
//!   the tenant allows them (`target`), and at most `RESPONSE_CAP` bytes of an answer
//!   are read.
//! - File: one file per job, `<dir>/<job id>.json` (or `.sarif`, `.rdjson`), written to
//!   a temporary file, synced and renamed into place: a reader never sees half a
//!   delivery, and a repeat of the same job replaces the file with the same content.
//! - GitHub: a pull-request review (`github`).

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use reviewlane_core::tenants::SinkConfig;
use secrecy::ExposeSecret;
use sha2::Sha256;

use crate::target;

/// Header carrying `t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`.
pub const SIGNATURE_HEADER: &str = "x-reviewlane-signature";
/// Header carrying the job id: receivers drop repeats by it.
pub const IDEMPOTENCY_HEADER: &str = "idempotency-key";
/// How old a signature's timestamp a receiver should accept (documented for receivers;
/// our own deliveries are signed when sent).
pub const SIGNATURE_TOLERANCE: Duration = Duration::from_secs(300);
/// Most of a webhook's answer that is read (the status decides; the body is drained
/// only so the connection can be reused).
const RESPONSE_CAP: usize = 64 * 1024;

pub use crate::outcome::SinkOutcome;

/// `t=<unix>,v1=<hex>`: HMAC-SHA256 over `"<unix>." + body` with `secret`.
pub fn sign(secret: &[u8], unix: u64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any size");
    mac.update(unix.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("t={unix},v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// Checks a signature header as a receiver should: the MAC over the timestamp and body,
/// and the timestamp within `tolerance` of `now_unix`.
pub fn verify(secret: &[u8], header: &str, body: &[u8], now_unix: u64, tolerance: Duration) -> bool {
    let mut t = None;
    let mut v1 = None;
    for part in header.split(',') {
        match part.split_once('=') {
            Some(("t", v)) => t = v.parse::<u64>().ok(),
            Some(("v1", v)) => v1 = hex::decode(v).ok(),
            _ => {}
        }
    }
    let (Some(t), Some(v1)) = (t, v1) else { return false };
    if now_unix.abs_diff(t) > tolerance.as_secs() {
        return false;
    }
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any size");
    mac.update(t.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac.verify_slice(&v1).is_ok()
}

pub fn classify_status(status: u16) -> SinkOutcome {
    match status {
        200..=299 => SinkOutcome::Delivered,
        408 | 425 | 429 => SinkOutcome::Transient("4xx_retryable"),
        500..=599 => SinkOutcome::Transient("5xx"),
        s => SinkOutcome::Permanent(s),
    }
}

pub struct Sinks {
    /// For tenants without `allow_private_webhook`: resolves to public addresses only.
    public: reqwest::Client,
    /// For tenants that allow private targets (local stacks, in-cluster receivers).
    any: reqwest::Client,
    github: crate::github::GitHub,
}

impl Sinks {
    pub fn new(timeout: Duration) -> Self {
        let client = |public_only: bool| {
            let b = reqwest::Client::builder()
                .timeout(timeout)
                .connect_timeout(Duration::from_secs(5))
                .redirect(reqwest::redirect::Policy::none());
            let b = if public_only { b.dns_resolver(target::resolver()) } else { b };
            b.build().expect("reqwest client builds")
        };
        Sinks { public: client(true), any: client(false), github: crate::github::GitHub::new() }
    }

    /// GitHub rate-limit pauses shared with the region's other publishers through `kv`.
    pub fn with_shared_pauses(mut self, kv: async_nats::jetstream::kv::Store) -> Self {
        self.github = self.github.with_shared_pauses(kv);
        self
    }

    /// GitHub's limit answers and content interval reported in `metrics`.
    pub fn with_github_metrics(mut self, metrics: crate::github::GitHubMetrics) -> Self {
        self.github = self.github.with_metrics(metrics);
        self
    }

    /// Delivers `delivery` to `sink`: rendered for a webhook or a file, or posted as a
    /// pull-request review.
    pub async fn deliver_review(
        &self,
        sink: &SinkConfig,
        allow_private: bool,
        delivery: &reviewlane_core::messages::Delivery,
    ) -> SinkOutcome {
        match sink {
            SinkConfig::GitHub { api_url, token_file, app, max_comments } => {
                let Ok(url) = reqwest::Url::parse(api_url) else { return SinkOutcome::Refused("invalid_url") };
                if !allow_private && !target::allowed(&url).await {
                    return SinkOutcome::Refused("forbidden_target");
                }
                let http = if allow_private { &self.any } else { &self.public };
                let auth = match (token_file, app) {
                    (Some(file), None) => crate::github::Auth::TokenFile(file),
                    (None, Some(app)) => crate::github::Auth::App(app),
                    _ => return SinkOutcome::Refused("github_auth_misconfigured"),
                };
                self.github.deliver(http, api_url, auth, *max_comments, delivery).await
            }
            other => self.deliver(other, allow_private, &delivery.job_id, &body_for(other, delivery)).await,
        }
    }

    /// Delivers one serialized `Delivery` body for `job_id`.
    pub async fn deliver(&self, sink: &SinkConfig, allow_private: bool, job_id: &str, body: &[u8]) -> SinkOutcome {
        match sink {
            SinkConfig::Webhook { url, secret } => {
                let Ok(url) = reqwest::Url::parse(url) else { return SinkOutcome::Refused("invalid_url") };
                if !allow_private && !target::allowed(&url).await {
                    return SinkOutcome::Refused("forbidden_target");
                }
                let http = if allow_private { &self.any } else { &self.public };
                let unix = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
                let res = http
                    .post(url)
                    .header("content-type", "application/json")
                    .header(IDEMPOTENCY_HEADER, job_id)
                    .header(SIGNATURE_HEADER, sign(secret.expose_secret().as_bytes(), unix, body))
                    .body(body.to_vec())
                    .send()
                    .await;
                match res {
                    Ok(mut r) => {
                        let outcome = classify_status(r.status().as_u16());
                        let mut read = 0;
                        while read < RESPONSE_CAP
                            && let Ok(Some(chunk)) = r.chunk().await
                        {
                            read += chunk.len();
                        }
                        outcome
                    }
                    Err(e) if e.is_timeout() => SinkOutcome::Transient("timeout"),
                    Err(_) => SinkOutcome::Transient("connect"),
                }
            }
            SinkConfig::File { dir, format } => match write_atomically(dir, job_id, format.extension(), body).await {
                Ok(()) => SinkOutcome::Delivered,
                Err(_) => SinkOutcome::Transient("io"),
            },
            SinkConfig::GitHub { .. } => SinkOutcome::Refused("github_needs_the_delivery"),
        }
    }
}

/// The body a sink gets for a delivery: the delivery as JSON, or for a file sink in
/// another format, the findings as SARIF or rdjson.
pub fn body_for(sink: &SinkConfig, d: &reviewlane_core::messages::Delivery) -> Vec<u8> {
    use reviewlane_core::surfaces::{Report, rdjson, sarif};
    use reviewlane_core::tenants::FileFormat;
    let report = || Report {
        job_id: &d.job_id,
        schema_version: &d.schema_version,
        repository: &d.metadata.repository,
        head_revision: &d.metadata.head_revision,
        findings: &d.findings,
    };
    match sink {
        SinkConfig::File { format: FileFormat::Sarif, .. } => serde_json::to_vec_pretty(&sarif::log(&report())),
        SinkConfig::File { format: FileFormat::Rdjson, .. } => serde_json::to_vec(&rdjson::result(&report())),
        _ => serde_json::to_vec(d),
    }
    .expect("a delivery serializes")
}

/// `<dir>/<job id>.<extension>` via a temporary file, fsync, rename and a sync of the
/// folder.
async fn write_atomically(dir: &Path, job_id: &str, extension: &str, body: &[u8]) -> std::io::Result<()> {
    let dir = dir.to_path_buf();
    let name = format!("{job_id}.{extension}");
    let body = body.to_vec();
    tokio::task::spawn_blocking(move || {
        use std::io::Write;
        std::fs::create_dir_all(&dir)?;
        let mut tmp = tempfile::NamedTempFile::new_in(&dir)?;
        tmp.write_all(&body)?;
        tmp.write_all(b"\n")?;
        tmp.as_file().sync_all()?;
        tmp.persist(dir.join(&name)).map_err(|e| e.error)?;
        std::fs::File::open(&dir)?.sync_all()
    })
    .await
    .map_err(std::io::Error::other)?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_covers_timestamp_and_body_and_expires() {
        let header = sign(b"whsec", 1_700_000_000, b"{\"a\":1}");
        assert!(header.starts_with("t=1700000000,v1="));
        assert!(verify(b"whsec", &header, b"{\"a\":1}", 1_700_000_100, SIGNATURE_TOLERANCE));
        assert!(!verify(b"whsec", &header, b"{\"a\":2}", 1_700_000_100, SIGNATURE_TOLERANCE), "body changed");
        assert!(!verify(b"other", &header, b"{\"a\":1}", 1_700_000_100, SIGNATURE_TOLERANCE), "other secret");
        assert!(!verify(b"whsec", &header, b"{\"a\":1}", 1_700_000_301, SIGNATURE_TOLERANCE), "replayed late");
        let moved = header.replace("t=1700000000", "t=1700000200");
        assert!(!verify(b"whsec", &moved, b"{\"a\":1}", 1_700_000_200, SIGNATURE_TOLERANCE), "timestamp swapped");
    }

    #[test]
    fn status_classes() {
        assert_eq!(classify_status(204), SinkOutcome::Delivered);
        assert_eq!(classify_status(503), SinkOutcome::Transient("5xx"));
        assert_eq!(classify_status(429), SinkOutcome::Transient("4xx_retryable"));
        assert_eq!(classify_status(302), SinkOutcome::Permanent(302));
        assert_eq!(classify_status(400), SinkOutcome::Permanent(400));
        assert_eq!(classify_status(410), SinkOutcome::Permanent(410));
    }

    #[tokio::test]
    async fn file_sink_writes_one_whole_file_per_job_and_a_repeat_replaces_it() {
        let dir = tempfile::tempdir().unwrap();
        let sinks = Sinks::new(Duration::from_secs(1));
        let sink = SinkConfig::File { dir: dir.path().join("acme"), format: Default::default() };
        assert_eq!(sinks.deliver(&sink, false, "us_1", b"{\"a\":1}").await, SinkOutcome::Delivered);
        assert_eq!(sinks.deliver(&sink, false, "us_2", b"{\"a\":2}").await, SinkOutcome::Delivered);
        assert_eq!(sinks.deliver(&sink, false, "us_1", b"{\"a\":1}").await, SinkOutcome::Delivered);
        let mut names: Vec<_> =
            std::fs::read_dir(dir.path().join("acme")).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, ["us_1.json", "us_2.json"], "no temporary file left behind");
        assert_eq!(std::fs::read_to_string(dir.path().join("acme/us_1.json")).unwrap(), "{\"a\":1}\n");
    }

    #[tokio::test]
    async fn a_file_sink_can_write_sarif_or_rdjson_instead() {
        use reviewlane_core::messages::Delivery;
        use reviewlane_core::tenants::FileFormat;
        let delivery = Delivery {
            job_id: "us_1".into(),
            tenant: "acme".into(),
            region: reviewlane_shared::Region::Us,
            lane: reviewlane_shared::Lane::Interactive,
            schema_version: "findings.v1".into(),
            review_depth: Default::default(),
            metadata: Default::default(),
            findings: vec![reviewlane_core::findings::Finding {
                path: "a.rs".into(),
                line: 3,
                severity: "high".into(),
                category: "security".into(),
                title: "t".into(),
                message: "m".into(),
                evidence: "e".into(),
                ..Default::default()
            }],
            quarantined_count: 0,
            findings_dropped: 0,
            deeper_of: None,
            deeper_review: None,
        };
        let dir = tempfile::tempdir().unwrap();
        let sinks = Sinks::new(Duration::from_secs(1));
        for (format, file) in [(FileFormat::Sarif, "us_1.sarif"), (FileFormat::Rdjson, "us_1.rdjson")] {
            let sink = SinkConfig::File { dir: dir.path().to_path_buf(), format };
            let body = body_for(&sink, &delivery);
            assert_eq!(sinks.deliver(&sink, false, "us_1", &body).await, SinkOutcome::Delivered);
            let written: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.path().join(file)).unwrap()).unwrap();
            match format {
                FileFormat::Sarif => {
                    assert_eq!(written["version"], "2.1.0");
                    assert_eq!(written["runs"][0]["results"][0]["level"], "error");
                }
                _ => assert_eq!(written["diagnostics"][0]["location"]["path"], "a.rs"),
            }
        }
        // The default is the delivery itself.
        let json = SinkConfig::File { dir: dir.path().to_path_buf(), format: FileFormat::Json };
        let body: serde_json::Value = serde_json::from_slice(&body_for(&json, &delivery)).unwrap();
        assert_eq!(body["job_id"], "us_1");
    }

    #[tokio::test]
    async fn a_private_target_is_refused_before_anything_is_sent_unless_allowed() {
        // Port 9 on loopback: nothing listens; a refusal must come before any attempt.
        let sinks = Sinks::new(Duration::from_secs(1));
        let sink = SinkConfig::Webhook { url: "http://127.0.0.1:9/hook".into(), secret: "s".to_string().into() };
        assert_eq!(sinks.deliver(&sink, false, "us_1", b"{}").await, SinkOutcome::Refused("forbidden_target"));
        assert_eq!(sinks.deliver(&sink, true, "us_1", b"{}").await, SinkOutcome::Transient("connect"));
    }
}
