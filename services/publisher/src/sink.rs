//! Sinks: where a tenant's findings are delivered. Webhook (signed, idempotent by job
//! id) and file (JSON lines, for the local stack).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, Mac};
use reviewlane_shared::tenants::SinkConfig;
use secrecy::ExposeSecret;
use sha2::Sha256;
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

/// Header carrying `sha256=<hex HMAC-SHA256 of the body with the tenant's secret>`.
pub const SIGNATURE_HEADER: &str = "x-reviewlane-signature";
/// Header carrying the job id: receivers drop repeats by it.
pub const IDEMPOTENCY_HEADER: &str = "idempotency-key";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkOutcome {
    Delivered,
    /// Worth another try later: 408, 429, 5xx, timeout, connection error, I/O error.
    Transient(&'static str),
    /// The receiver refused it for good (other 4xx).
    Permanent(u16),
}

impl SinkOutcome {
    /// Content-free class for spans and logs.
    pub fn as_str(&self) -> &'static str {
        match self {
            SinkOutcome::Delivered => "delivered",
            SinkOutcome::Transient(class) => class,
            SinkOutcome::Permanent(_) => "rejected",
        }
    }
}

/// `sha256=<hex>` over `body` with `secret`.
pub fn sign(secret: &[u8], body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any size");
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
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
    http: reqwest::Client,
    files: Mutex<HashMap<PathBuf, Arc<Mutex<()>>>>,
}

impl Sinks {
    pub fn new(timeout: Duration) -> Self {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(Duration::from_secs(5))
            .build()
            .expect("reqwest client builds");
        Sinks { http, files: Mutex::new(HashMap::new()) }
    }

    /// Delivers one serialized `Delivery` body for `job_id`.
    pub async fn deliver(&self, sink: &SinkConfig, job_id: &str, body: &[u8]) -> SinkOutcome {
        match sink {
            SinkConfig::Webhook { url, secret } => {
                let res = self
                    .http
                    .post(url)
                    .header("content-type", "application/json")
                    .header(IDEMPOTENCY_HEADER, job_id)
                    .header(SIGNATURE_HEADER, sign(secret.expose_secret().as_bytes(), body))
                    .body(body.to_vec())
                    .send()
                    .await;
                match res {
                    Ok(r) => classify_status(r.status().as_u16()),
                    Err(e) if e.is_timeout() => SinkOutcome::Transient("timeout"),
                    Err(_) => SinkOutcome::Transient("connect"),
                }
            }
            SinkConfig::File { path } => match self.append(path, body).await {
                Ok(()) => SinkOutcome::Delivered,
                Err(_) => SinkOutcome::Transient("io"),
            },
        }
    }

    async fn append(&self, path: &Path, body: &[u8]) -> std::io::Result<()> {
        let lock = self.files.lock().await.entry(path.to_path_buf()).or_default().clone();
        let _guard = lock.lock().await;
        let mut f = tokio::fs::OpenOptions::new().create(true).append(true).open(path).await?;
        let mut line = body.to_vec();
        line.push(b'\n');
        f.write_all(&line).await?;
        f.flush().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_is_hmac_sha256_hex() {
        // RFC 4231 test case 2.
        assert_eq!(
            sign(b"Jefe", b"what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn status_classes() {
        assert_eq!(classify_status(204), SinkOutcome::Delivered);
        assert_eq!(classify_status(503), SinkOutcome::Transient("5xx"));
        assert_eq!(classify_status(429), SinkOutcome::Transient("4xx_retryable"));
        assert_eq!(classify_status(400), SinkOutcome::Permanent(400));
        assert_eq!(classify_status(410), SinkOutcome::Permanent(410));
    }

    #[tokio::test]
    async fn file_sink_appends_lines() {
        let dir = std::env::temp_dir().join(format!("reviewlane-sink-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("out.jsonl");
        let _ = std::fs::remove_file(&path);
        let sinks = Sinks::new(Duration::from_secs(1));
        let sink = SinkConfig::File { path: path.clone() };
        assert_eq!(sinks.deliver(&sink, "j1", b"{\"a\":1}").await, SinkOutcome::Delivered);
        assert_eq!(sinks.deliver(&sink, "j2", b"{\"a\":2}").await, SinkOutcome::Delivered);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"a\":1}\n{\"a\":2}\n");
    }
}
