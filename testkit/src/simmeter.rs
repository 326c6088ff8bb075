//! The simulated provider's rate limits by what providers meter: requests, tokens, input
//! and output tokens per minute, each a token bucket with continuous refill, answered
//! with OpenAI's or Anthropic's headers and 429 bodies.
//!
//! - OpenAI style: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` on every
//!   answer (resets as Go durations), a call charged its prompt plus its `max_tokens`
//!   when it starts; a 429 carries no `retry-after` and names the dimension (`type:
//!   tokens`).
//! - Anthropic style: `anthropic-ratelimit-{requests,input-tokens,output-tokens}-*`
//!   (resets as RFC 3339), input tokens charged at start, output tokens estimated from
//!   `max_tokens` at start and adjusted to what was produced at the end; a 429 carries
//!   `retry-after` and says which limit.
//!
//! Tokens are counted as bytes / 4 of what the call sends (instructions, schema, diff)
//! and of what it answers.

use std::time::{Duration, Instant, SystemTime};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MeterStyle {
    OpenAi,
    Anthropic,
}

/// Limits per minute; `None`: not metered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimLimits {
    pub style: MeterStyle,
    pub requests: Option<u64>,
    /// Prompt and `max_tokens` together (OpenAI).
    pub tokens: Option<u64>,
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
}

impl SimLimits {
    pub fn openai(requests: Option<u64>, tokens: Option<u64>) -> SimLimits {
        SimLimits { style: MeterStyle::OpenAi, requests, tokens, input_tokens: None, output_tokens: None }
    }

    pub fn anthropic(requests: Option<u64>, input_tokens: Option<u64>, output_tokens: Option<u64>) -> SimLimits {
        SimLimits { style: MeterStyle::Anthropic, requests, tokens: None, input_tokens, output_tokens }
    }
}

#[derive(Debug, Clone, Copy)]
struct Level {
    limit: u64,
    level: f64,
    at: Instant,
}

impl Level {
    fn new(limit: u64, now: Instant) -> Level {
        Level { limit, level: limit as f64, at: now }
    }

    fn now(&mut self, now: Instant) -> f64 {
        let per_ms = self.limit as f64 / 60_000.0;
        self.level = (self.level + now.saturating_duration_since(self.at).as_secs_f64() * 1000.0 * per_ms)
            .min(self.limit as f64);
        self.at = now;
        self.level
    }

    /// How long until it is full again.
    fn reset(&mut self, now: Instant) -> Duration {
        let missing = self.limit as f64 - self.now(now);
        Duration::from_secs_f64((missing.max(0.0) * 60.0 / self.limit as f64).max(0.0))
    }
}

/// The buckets of one simulated account.
#[derive(Debug)]
pub struct SimMeter {
    limits: SimLimits,
    requests: Option<Level>,
    tokens: Option<Level>,
    input: Option<Level>,
    output: Option<Level>,
}

/// What a call was charged at start, to settle when it ends.
#[derive(Debug, Clone, Copy, Default)]
pub struct Charged {
    max_tokens: u64,
}

/// A refusal: which dimension, for the 429's body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Short {
    Requests,
    Tokens,
    InputTokens,
    OutputTokens,
}

pub fn count(text_bytes: usize) -> u64 {
    text_bytes.div_ceil(4) as u64
}

impl SimMeter {
    pub fn new(limits: SimLimits) -> SimMeter {
        let now = Instant::now();
        let level = |l: Option<u64>| l.map(|l| Level::new(l, now));
        SimMeter {
            limits,
            requests: level(limits.requests),
            tokens: level(limits.tokens),
            input: level(limits.input_tokens),
            output: level(limits.output_tokens),
        }
    }

    pub fn style(&self) -> MeterStyle {
        self.limits.style
    }

    /// Charges a call of `input` tokens asking for at most `max_tokens`, or refuses it
    /// (charging nothing).
    pub fn admit(&mut self, input: u64, max_tokens: u64) -> Result<Charged, Short> {
        let now = Instant::now();
        let tokens = input + max_tokens;
        let checks = [
            (&mut self.requests, 1.0, Short::Requests),
            (&mut self.tokens, tokens as f64, Short::Tokens),
            (&mut self.input, input as f64, Short::InputTokens),
            (&mut self.output, max_tokens as f64, Short::OutputTokens),
        ];
        for (level, cost, short) in checks {
            if let Some(l) = level
                && l.now(now) < cost
            {
                return Err(short);
            }
        }
        let dims = [
            (&mut self.requests, 1),
            (&mut self.tokens, tokens),
            (&mut self.input, input),
            (&mut self.output, max_tokens),
        ];
        for (level, cost) in dims {
            if let Some(l) = level {
                l.level -= cost as f64;
            }
        }
        Ok(Charged { max_tokens })
    }

    /// A charged call answered `output` tokens: Anthropic's output estimate is adjusted
    /// to it; OpenAI counted the output limit at start and keeps it.
    pub fn settle(&mut self, charged: Charged, output: u64) {
        let now = Instant::now();
        if let Some(l) = &mut self.tokens {
            // An answer longer than the limit cannot happen; were it to, it counts.
            l.now(now);
            l.level -= output.saturating_sub(charged.max_tokens) as f64;
        }
        if let Some(l) = &mut self.output {
            l.now(now);
            l.level = (l.level + charged.max_tokens as f64 - output as f64).min(l.limit as f64);
        }
    }

    /// The headers every answer carries.
    pub fn headers(&mut self) -> Vec<(String, String)> {
        let now = Instant::now();
        let mut out = Vec::new();
        let dims = [
            ("requests", &mut self.requests),
            ("tokens", &mut self.tokens),
            ("input-tokens", &mut self.input),
            ("output-tokens", &mut self.output),
        ];
        for (name, level) in dims {
            let Some(l) = level else { continue };
            let remaining = l.now(now).max(0.0).floor() as u64;
            let reset = l.reset(now);
            match self.limits.style {
                MeterStyle::OpenAi => {
                    out.push((format!("x-ratelimit-limit-{name}"), l.limit.to_string()));
                    out.push((format!("x-ratelimit-remaining-{name}"), remaining.to_string()));
                    out.push((format!("x-ratelimit-reset-{name}"), format!("{}ms", reset.as_millis())));
                }
                MeterStyle::Anthropic => {
                    let at = httpdate_rfc3339(SystemTime::now() + reset);
                    out.push((format!("anthropic-ratelimit-{name}-limit"), l.limit.to_string()));
                    out.push((format!("anthropic-ratelimit-{name}-remaining"), remaining.to_string()));
                    out.push((format!("anthropic-ratelimit-{name}-reset"), at));
                }
            }
        }
        out
    }

    /// How long until `short` has room for one call again (Anthropic's `retry-after`).
    pub fn wait(&mut self, short: Short, input: u64, max_tokens: u64) -> Duration {
        let now = Instant::now();
        let (level, cost) = match short {
            Short::Requests => (&mut self.requests, 1.0),
            Short::Tokens => (&mut self.tokens, (input + max_tokens) as f64),
            Short::InputTokens => (&mut self.input, input as f64),
            Short::OutputTokens => (&mut self.output, max_tokens as f64),
        };
        let Some(l) = level else { return Duration::ZERO };
        let short_by = (cost - l.now(now)).max(0.0);
        Duration::from_secs_f64(short_by * 60.0 / l.limit as f64)
    }

    /// The 429 body naming `short`, in the style's words.
    pub fn refusal(&self, short: Short) -> String {
        let (kind, words) = match short {
            Short::Requests => ("requests", "requests per min (RPM)"),
            Short::Tokens => ("tokens", "tokens per min (TPM)"),
            Short::InputTokens => ("tokens", "input tokens per minute"),
            Short::OutputTokens => ("tokens", "output tokens per minute"),
        };
        match self.limits.style {
            MeterStyle::OpenAi => serde_json::json!({"error": {
                "message": format!("Rate limit reached for sim in organization org-sim on {words}. Please try again later."),
                "type": kind,
                "param": null,
                "code": "rate_limit_exceeded",
            }}),
            MeterStyle::Anthropic => serde_json::json!({"type": "error", "error": {
                "type": "rate_limit_error",
                "message": format!("This request would exceed the rate limit for your organization of {words}."),
            }}),
        }
        .to_string()
    }
}

/// `2026-12-03T10:00:00Z` for `t`, whole seconds rounded up (a reset is never early).
fn httpdate_rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64().ceil() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_of_a_known_instant() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(httpdate_rfc3339(t), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn openai_charges_the_output_limit_at_start_and_anthropic_the_output_as_produced() {
        let mut m = SimMeter::new(SimLimits::openai(Some(100), Some(12_000)));
        let c = m.admit(1_000, 4_096).unwrap();
        assert_eq!(m.admit(1_000, 4_096).map(|_| ()), Ok(()));
        m.settle(c, 96);
        assert_eq!(m.admit(1_000, 4_096).map(|_| ()), Err(Short::Tokens), "a third does not fit");
        assert!(m.headers().iter().any(|(k, _)| k == "x-ratelimit-remaining-tokens"));
        let mut a = SimMeter::new(SimLimits::anthropic(None, Some(100_000), Some(10_000)));
        let c = a.admit(1_000, 4_096).unwrap();
        a.admit(1_000, 4_096).unwrap();
        assert_eq!(a.admit(1_000, 4_096).map(|_| ()), Err(Short::OutputTokens), "estimated from max_tokens");
        a.settle(c, 100);
        assert!(a.admit(1_000, 4_096).is_ok(), "adjusted to what was produced");
        assert!(a.headers().iter().any(|(k, _)| k == "anthropic-ratelimit-output-tokens-remaining"));
    }
}
