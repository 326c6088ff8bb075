//! Pure classification of provider answers and the retry-delay policy.
//!
//! Every upstream answer becomes one `UpstreamOutcome`. Only `RateLimited` enters the
//! congestion path, only `Transient` the transient path, an `Ok` whose output fails
//! validation the schema path; `Permanent` and `QuotaExhausted` are never retried.

use std::time::Duration;

use http::HeaderMap;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamOutcome {
    /// 2xx with the model's output text.
    Ok { output: String },
    /// 429 rate limit: retry after the provider's hint, else backoff.
    RateLimited { retry_after: Option<Duration> },
    /// 429 `insufficient_quota`: the account is out of money; retrying cannot help.
    QuotaExhausted,
    /// 408, 5xx, timeout, connection reset.
    Transient { status_class: &'static str },
    /// Other 4xx (auth, bad request): never retried.
    Permanent { status: u16 },
}

impl UpstreamOutcome {
    /// Content-free status class for records, logs and labels.
    pub fn status_class(&self) -> &'static str {
        match self {
            UpstreamOutcome::Ok { .. } => "2xx",
            UpstreamOutcome::RateLimited { .. } | UpstreamOutcome::QuotaExhausted => "429",
            UpstreamOutcome::Transient { status_class } => status_class,
            UpstreamOutcome::Permanent { .. } => "4xx",
        }
    }
}

/// Classifies an HTTP answer of an OpenAI-compatible API. `body` is read only for the
/// error code of a 429 and for the output of a 2xx.
pub fn classify(status: u16, headers: &HeaderMap, body: &[u8]) -> UpstreamOutcome {
    match status {
        200..=299 => UpstreamOutcome::Ok { output: chat_output(body).unwrap_or_default() },
        429 if is_insufficient_quota(body) => UpstreamOutcome::QuotaExhausted,
        429 => UpstreamOutcome::RateLimited { retry_after: retry_hint(headers) },
        408 => UpstreamOutcome::Transient { status_class: "408" },
        500..=599 => UpstreamOutcome::Transient { status_class: "5xx" },
        s => UpstreamOutcome::Permanent { status: s },
    }
}

/// `choices[0].message.content` of a chat completion.
fn chat_output(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v["choices"][0]["message"]["content"].as_str().map(str::to_string)
}

fn is_insufficient_quota(body: &[u8]) -> bool {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
        return false;
    };
    let e = &v["error"];
    [&e["code"], &e["type"]]
        .iter()
        .any(|f| matches!(f.as_str(), Some("insufficient_quota" | "billing_hard_limit_reached")))
}

/// The provider's own retry hint. Precedence: `retry-after-ms`, then `retry-after`
/// (delta-seconds). Garbage is ignored.
pub fn retry_hint(headers: &HeaderMap) -> Option<Duration> {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(ms) = get("retry-after-ms").and_then(|v| v.parse::<f64>().ok())
        && ms.is_finite()
        && ms >= 0.0
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    if let Some(secs) = get("retry-after").and_then(|v| v.parse::<f64>().ok())
        && secs.is_finite()
        && secs >= 0.0
    {
        return Some(Duration::from_secs_f64(secs));
    }
    None
}

/// Capped exponential backoff with jitter, for when the provider gives no hint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    pub base: Duration,
    pub cap: Duration,
    /// The delay is multiplied by a factor drawn from this range.
    pub jitter: (f64, f64),
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { base: Duration::from_secs(1), cap: Duration::from_secs(60), jitter: (0.5, 1.5) }
    }
}

impl Backoff {
    /// Delay before retry number `attempt` (1-based); `unit` is uniform in [0, 1).
    pub fn delay(&self, attempt: u32, unit: f64) -> Duration {
        let exp = self.base.as_secs_f64() * 2f64.powi(attempt.saturating_sub(1).min(30) as i32);
        let capped = exp.min(self.cap.as_secs_f64());
        let factor = self.jitter.0 + (self.jitter.1 - self.jitter.0) * unit.clamp(0.0, 1.0);
        Duration::from_secs_f64((capped * factor).min(self.cap.as_secs_f64()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn classifies_by_status() {
        let h = HeaderMap::new();
        let ok = br#"{"choices":[{"message":{"content":"{\"findings\":[]}"}}]}"#;
        assert_eq!(classify(200, &h, ok), UpstreamOutcome::Ok { output: "{\"findings\":[]}".into() });
        assert_eq!(classify(200, &h, b"garbage"), UpstreamOutcome::Ok { output: String::new() });
        assert_eq!(classify(429, &h, b"{}"), UpstreamOutcome::RateLimited { retry_after: None });
        assert_eq!(classify(408, &h, b""), UpstreamOutcome::Transient { status_class: "408" });
        assert_eq!(classify(503, &h, b""), UpstreamOutcome::Transient { status_class: "5xx" });
        assert_eq!(classify(401, &h, b""), UpstreamOutcome::Permanent { status: 401 });
        assert_eq!(classify(400, &h, b""), UpstreamOutcome::Permanent { status: 400 });
    }

    #[test]
    fn insufficient_quota_is_not_a_rate_limit() {
        let body = br#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#;
        assert_eq!(classify(429, &HeaderMap::new(), body), UpstreamOutcome::QuotaExhausted);
        let body = br#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#;
        assert!(matches!(classify(429, &HeaderMap::new(), body), UpstreamOutcome::RateLimited { .. }));
    }

    #[test]
    fn retry_hints_and_precedence() {
        assert_eq!(retry_hint(&headers(&[("retry-after", "2")])), Some(Duration::from_secs(2)));
        assert_eq!(retry_hint(&headers(&[("retry-after", "0.5")])), Some(Duration::from_millis(500)));
        assert_eq!(retry_hint(&headers(&[("retry-after-ms", "250")])), Some(Duration::from_millis(250)));
        assert_eq!(
            retry_hint(&headers(&[("retry-after", "9"), ("retry-after-ms", "1500")])),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(retry_hint(&headers(&[("retry-after", "soon")])), None);
        assert_eq!(retry_hint(&headers(&[("retry-after", "-3")])), None);
        assert_eq!(
            retry_hint(&headers(&[("retry-after-ms", "NaN"), ("retry-after", "1")])),
            Some(Duration::from_secs(1))
        );
    }

    #[test]
    fn backoff_is_exponential_capped_and_jittered() {
        let b = Backoff::default();
        assert_eq!(b.delay(1, 0.5), Duration::from_secs(1));
        assert_eq!(b.delay(2, 0.5), Duration::from_secs(2));
        assert_eq!(b.delay(3, 0.5), Duration::from_secs(4));
        assert_eq!(b.delay(1, 0.0), Duration::from_millis(500));
        assert_eq!(b.delay(1, 1.0), Duration::from_millis(1500));
        assert_eq!(b.delay(20, 0.0), Duration::from_secs(30));
        assert_eq!(b.delay(20, 1.0), Duration::from_secs(60));
        assert_eq!(b.delay(u32::MAX, 0.9), Duration::from_secs(60));
        for attempt in 1..12 {
            for u in [0.0, 0.3, 0.99] {
                let d = b.delay(attempt, u);
                assert!(d <= b.cap && d >= Duration::from_millis(500), "{attempt} {u} {d:?}");
            }
        }
    }
}
