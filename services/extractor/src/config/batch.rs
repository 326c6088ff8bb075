//! The provider-batch section: how sweeps run through the provider's own batch API
//! (`REVIEWLANE_PROVIDER_BATCH`).

use std::time::Duration;

/// How sweeps run through the provider's own batch API: one setting,
/// `REVIEWLANE_PROVIDER_BATCH` = `off`, or comma-separated `poll=<first>..<cap>`,
/// `requests=<n>`, `mb=<n>`, `resubmit=<n>`, `enqueued_tokens=<n>`, `price=<percent>`
/// (durations as `500ms`, `30s`, `5m`). Unset: on, with the defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSettings {
    pub enabled: bool,
    pub poll: reviewlane_core::batch::PollBackoff,
    /// Requests per provider batch at most (below the provider's own limit): a batch's
    /// item ids are one KV entry.
    pub max_requests: usize,
    /// Bytes of a batch's requests at most (below the provider's own limit).
    pub max_bytes: Option<usize>,
    /// Times an item whose line did not run (expired, cancelled, 5xx, missing) is sent
    /// again, in a later provider batch.
    pub resubmissions: u32,
    /// Where such an item goes again: a later provider batch, or the batch lane (one
    /// synchronous call at the full price, within the lane's own budgets).
    pub resubmit_via: ResubmitVia,
    /// Tokens the model's batches may hold enqueued at once (`None`: no budget).
    pub enqueued_tokens: Option<u64>,
    /// The batch price, in percent of the synchronous price (both providers: 50).
    pub price_percent: u32,
}

impl Default for BatchSettings {
    fn default() -> Self {
        BatchSettings {
            enabled: true,
            poll: Default::default(),
            max_requests: 10_000,
            max_bytes: None,
            resubmissions: 2,
            resubmit_via: ResubmitVia::Batches,
            enqueued_tokens: None,
            price_percent: 50,
        }
    }
}

/// Where an item of a provider batch whose line did not run goes again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResubmitVia {
    Batches,
    Lanes,
}

/// `500ms`, `30s`, `5m`.
fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let (n, unit) = s.find(|c: char| !c.is_ascii_digit()).map_or((s, ""), |i| s.split_at(i));
    let n: u64 = n.parse().ok()?;
    match unit {
        "ms" => Some(Duration::from_millis(n)),
        "s" => Some(Duration::from_secs(n)),
        "m" => Some(Duration::from_secs(n * 60)),
        _ => None,
    }
}

impl BatchSettings {
    pub fn parse(spec: &str) -> Result<BatchSettings, String> {
        let mut b = BatchSettings::default();
        match spec.trim() {
            "" | "on" => return Ok(b),
            "off" => return Ok(BatchSettings { enabled: false, ..b }),
            _ => {}
        }
        for entry in spec.split(',').map(str::trim).filter(|e| !e.is_empty() && *e != "on") {
            let (key, value) = entry.split_once('=').ok_or_else(|| format!("`{entry}` is not key=value"))?;
            let count = || value.parse::<u64>().map_err(|_| format!("`{key}` takes a whole number"));
            match key {
                "poll" => {
                    let (first, cap) = value.split_once("..").ok_or("poll is `<first>..<cap>`, e.g. 30s..5m")?;
                    let (first, cap) = parse_duration(first)
                        .zip(parse_duration(cap))
                        .filter(|(f, c)| !f.is_zero() && f <= c)
                        .ok_or("poll durations are like 500ms, 30s, 5m, the first positive and at most the cap")?;
                    b.poll = reviewlane_core::batch::PollBackoff { first, cap };
                }
                "requests" => b.max_requests = count()?.clamp(1, 50_000) as usize,
                "mb" => b.max_bytes = Some((count()?.max(1) as usize).saturating_mul(1024 * 1024)),
                "resubmit" => b.resubmissions = count()?.min(10) as u32,
                "resubmit_via" => {
                    b.resubmit_via = match value {
                        "batches" => ResubmitVia::Batches,
                        "lanes" => ResubmitVia::Lanes,
                        _ => return Err("resubmit_via is `batches` or `lanes`".into()),
                    }
                }
                "enqueued_tokens" => b.enqueued_tokens = Some(count()?.max(1)),
                "price" => b.price_percent = count()?.min(100) as u32,
                other => return Err(format!("unknown key `{other}`")),
            }
        }
        Ok(b)
    }

    /// The provider's limits on one batch, lowered to these settings.
    pub fn limits(&self, provider: reviewlane_core::batch::BatchLimits) -> reviewlane_core::batch::BatchLimits {
        reviewlane_core::batch::BatchLimits {
            max_requests: provider.max_requests.min(self.max_requests),
            max_bytes: self.max_bytes.map_or(provider.max_bytes, |b| b.min(provider.max_bytes)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batch_setting_reads_off_or_its_keys_and_refuses_the_rest() {
        assert_eq!(BatchSettings::parse(""), Ok(BatchSettings::default()));
        assert!(!BatchSettings::parse("off").unwrap().enabled);
        assert_eq!(BatchSettings::default().resubmit_via, ResubmitVia::Batches);
        let b = BatchSettings::parse(
            "poll=50ms..2s, requests=300, mb=5, resubmit=1, resubmit_via=lanes, enqueued_tokens=9000, price=40",
        )
        .unwrap();
        assert_eq!(b.resubmit_via, ResubmitVia::Lanes);
        assert_eq!((b.poll.first, b.poll.cap), (Duration::from_millis(50), Duration::from_secs(2)));
        assert_eq!((b.max_requests, b.max_bytes, b.resubmissions), (300, Some(5 * 1024 * 1024), 1));
        assert_eq!((b.enqueued_tokens, b.price_percent, b.enabled), (Some(9000), 40, true));
        let lowered = b.limits(reviewlane_core::batch::BatchLimits::OPENAI);
        assert_eq!((lowered.max_requests, lowered.max_bytes), (300, 5 * 1024 * 1024));
        assert_eq!(
            BatchSettings::default().limits(reviewlane_core::batch::BatchLimits::ANTHROPIC).max_requests,
            10_000
        );
        for bad in ["poll=5m..30s", "poll=30", "requests=lots", "colour=blue", "requests", "resubmit_via=carrier"] {
            assert!(BatchSettings::parse(bad).is_err(), "{bad}");
        }
    }
}
