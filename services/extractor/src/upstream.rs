//! Pure classification of provider answers and the retry-delay policy.
//!
//! Every upstream answer becomes one `UpstreamOutcome`. Only `RateLimited` enters the
//! congestion path, only `Transient` the transient path, an `Ok` whose output fails
//! validation the schema path; `Permanent` and `QuotaExhausted` are never retried.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

use reviewlane_core::meter::Dimension;
use reviewlane_core::retry_hint::{Hint, HintSource, headroom_pause, retry_hint};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamOutcome {
    /// 2xx with the model's output text; `slow_down` when a rate-limit dimension is
    /// empty, so the scope pauses before a 429; the tokens billed, when reported.
    /// `meter`: what the answer's headers say of the key's limits (`core::meter`).
    Ok { output: String, slow_down: Option<Duration>, usage: Option<Usage>, meter: Meter },
    /// 429 rate limit: retry after the provider's hint (cut to the ceiling, `capped`),
    /// else backoff. `dimension`: the metered dimension it names (its error message, or
    /// a dimension its headers say is empty); `meter`: what its headers say.
    RateLimited { retry_after: Option<Duration>, capped: bool, dimension: Option<Dimension>, meter: Meter },
    /// 429 `insufficient_quota`: the account is out of money; retrying cannot help.
    QuotaExhausted,
    /// 408, 5xx, timeout, connection reset.
    Transient { status_class: &'static str },
    /// Other 4xx (auth, bad request): never retried.
    Permanent { status: u16 },
    /// The provider's content filter refused the prompt (a 400) or cut the answer (a
    /// 200 ending `content_filter`, paid for: `usage`). Never retried: the same prompt
    /// meets the same filter.
    ContentFiltered { usage: Option<Usage> },
}

/// What an answer's headers said per metered dimension.
pub type Meter = std::collections::BTreeMap<reviewlane_core::meter::Dimension, reviewlane_core::meter::Reading>;

/// Tokens a call consumed, as the provider reports them: the same count a job is
/// charged with.
pub use reviewlane_core::job::Tokens as Usage;

impl UpstreamOutcome {
    /// Content-free status class for records, logs and labels.
    pub fn status_class(&self) -> &'static str {
        match self {
            UpstreamOutcome::Ok { .. } => "2xx",
            UpstreamOutcome::RateLimited { .. } | UpstreamOutcome::QuotaExhausted => "429",
            UpstreamOutcome::Transient { status_class } => status_class,
            UpstreamOutcome::Permanent { .. } => "4xx",
            UpstreamOutcome::ContentFiltered { usage: None } => "4xx",
            UpstreamOutcome::ContentFiltered { usage: Some(_) } => "2xx",
        }
    }
}

/// Classifies an HTTP answer of an OpenAI-compatible API. `body` is read only for the
/// error code of a 429 and for the output of a 2xx.
pub fn classify(status: u16, headers: &HeaderMap, body: &[u8], now: SystemTime, ceiling: Duration) -> UpstreamOutcome {
    match status {
        200..=299 => UpstreamOutcome::Ok {
            output: chat_output(body).unwrap_or_default(),
            slow_down: headroom_pause(headers, now, ceiling),
            usage: usage(body),
            meter: reviewlane_core::meter::readings(headers, now),
        },
        429 if is_insufficient_quota(body) => UpstreamOutcome::QuotaExhausted,
        429 => rate_limited(headers, body, now, ceiling),
        408 => UpstreamOutcome::Transient { status_class: "408" },
        500..=599 => UpstreamOutcome::Transient { status_class: "5xx" },
        s => UpstreamOutcome::Permanent { status: s },
    }
}

/// Classifies an HTTP answer of an Azure OpenAI deployment: as an OpenAI-compatible
/// one (its `retry-after-ms` and `x-ratelimit-remaining-*` headers are read by the same
/// rules), except that its content filter's refusals end the review saying so — a 400
/// whose error code is `content_filter`, or a 200 whose choice finished
/// `content_filter` (Azure OpenAI, "Content filtering": the prompt, or the completion,
/// was filtered).
pub fn classify_azure(
    status: u16,
    headers: &HeaderMap,
    body: &[u8],
    now: SystemTime,
    ceiling: Duration,
) -> UpstreamOutcome {
    let v = || serde_json::from_slice::<serde_json::Value>(body).unwrap_or_default();
    match status {
        400 if v()["error"]["code"] == "content_filter" => UpstreamOutcome::ContentFiltered { usage: None },
        200..=299 if v()["choices"][0]["finish_reason"] == "content_filter" => {
            UpstreamOutcome::ContentFiltered { usage: usage(body) }
        }
        _ => classify(status, headers, body, now, ceiling),
    }
}

/// Classifies an HTTP answer of Anthropic's Messages API. The output is the input of
/// the first `tool_use` block (the findings tool the request forces), else the first
/// text block; 529 (overloaded) is transient; 413 (request too large) and other 4xx
/// are permanent. Rate-limit hints and headroom come from the same headers as for any
/// provider (`retry-after`, `anthropic-ratelimit-*`).
pub fn classify_anthropic(
    status: u16,
    headers: &HeaderMap,
    body: &[u8],
    now: SystemTime,
    ceiling: Duration,
) -> UpstreamOutcome {
    match status {
        200..=299 => {
            let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
            let blocks = v["content"].as_array().cloned().unwrap_or_default();
            let output = blocks
                .iter()
                .find(|b| b["type"] == "tool_use")
                .map(|b| b["input"].to_string())
                .or_else(|| {
                    blocks.iter().find(|b| b["type"] == "text").and_then(|b| b["text"].as_str().map(str::to_string))
                })
                .unwrap_or_default();
            let u = &v["usage"];
            let usage = u["input_tokens"]
                .as_u64()
                .zip(u["output_tokens"].as_u64())
                .map(|(input, output)| Usage { input, output });
            let meter = reviewlane_core::meter::readings(headers, now);
            UpstreamOutcome::Ok { output, slow_down: headroom_pause(headers, now, ceiling), usage, meter }
        }
        429 => rate_limited(headers, body, now, ceiling),
        529 => UpstreamOutcome::Transient { status_class: "529" },
        408 => UpstreamOutcome::Transient { status_class: "408" },
        500..=599 => UpstreamOutcome::Transient { status_class: "5xx" },
        s => UpstreamOutcome::Permanent { status: s },
    }
}

/// A 429 of either API: its hint, its headers' readings, and the metered dimension it
/// was refused for — named by the error (OpenAI's `type` `tokens`/`requests` or its
/// message, Anthropic's message), else the first dimension its headers report empty.
fn rate_limited(headers: &HeaderMap, body: &[u8], now: SystemTime, ceiling: Duration) -> UpstreamOutcome {
    let hint = retry_hint(headers, now, ceiling);
    let meter = reviewlane_core::meter::readings(headers, now);
    let error = serde_json::from_slice::<serde_json::Value>(body).unwrap_or_default();
    let named = match error["error"]["type"].as_str() {
        Some("tokens") => Some(Dimension::Tokens),
        Some("requests") => Some(Dimension::Requests),
        _ => error["error"]["message"].as_str().and_then(Dimension::named_in),
    };
    let empty = || meter.iter().find(|(_, r)| r.remaining == Some(0)).map(|(d, _)| *d);
    let dimension = named.or_else(empty);
    // A reset header says when the provider's bucket is full again, not when the next
    // call fits: with the dimension known, its bucket (emptied by the 429) paces the next
    // calls, as after a 2xx that reports it empty. Only an explicit `retry-after` pauses.
    let explicit = |h: &Hint| matches!(h.source, HintSource::RetryAfterMs | HintSource::RetryAfter);
    let hint = hint.filter(|h| dimension.is_none() || explicit(h));
    UpstreamOutcome::RateLimited {
        retry_after: hint.map(|h| h.delay),
        capped: hint.is_some_and(|h| h.capped),
        dimension,
        meter,
    }
}

/// `choices[0].message.content` of a chat completion.
fn chat_output(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v["choices"][0]["message"]["content"].as_str().map(str::to_string)
}

/// `usage.prompt_tokens` / `usage.completion_tokens` of a chat completion.
fn usage(body: &[u8]) -> Option<Usage> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let u = &v["usage"];
    Some(Usage { input: u["prompt_tokens"].as_u64()?, output: u["completion_tokens"].as_u64()? })
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

    #[test]
    fn anthropic_answers_are_classified_like_the_messages_api_defines_them() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let ceiling = Duration::from_secs(300);
        let none = HeaderMap::new();
        let ok = br#"{"content":[{"type":"tool_use","name":"report_findings","input":{"findings":[]}}],"usage":{"input_tokens":12,"output_tokens":3}}"#;
        assert_eq!(
            classify_anthropic(200, &none, ok, now, ceiling),
            UpstreamOutcome::Ok {
                output: r#"{"findings":[]}"#.into(),
                slow_down: None,
                usage: Some(Usage { input: 12, output: 3 }),
                meter: Meter::new(),
            }
        );
        let text = br#"{"content":[{"type":"text","text":"{\"findings\": []}"}]}"#;
        assert!(
            matches!(classify_anthropic(200, &none, text, now, ceiling), UpstreamOutcome::Ok { output, .. } if output == r#"{"findings": []}"#)
        );
        let mut h = HeaderMap::new();
        h.insert("retry-after", "7".parse().unwrap());
        assert_eq!(classify_anthropic(429, &h, b"{}", now, ceiling), limited(Some(Duration::from_secs(7)), false));
        // Anthropic's message names the bucket that is empty.
        let input = br#"{"type":"error","error":{"type":"rate_limit_error","message":"This request would exceed the rate limit for your organization of 50,000 input tokens per minute."}}"#;
        assert!(matches!(
            classify_anthropic(429, &none, input, now, ceiling),
            UpstreamOutcome::RateLimited { dimension: Some(Dimension::InputTokens), .. }
        ));
        assert_eq!(
            classify_anthropic(529, &none, b"{}", now, ceiling),
            UpstreamOutcome::Transient { status_class: "529" }
        );
        assert_eq!(classify_anthropic(413, &none, b"{}", now, ceiling), UpstreamOutcome::Permanent { status: 413 });
        assert_eq!(classify_anthropic(400, &none, b"{}", now, ceiling), UpstreamOutcome::Permanent { status: 400 });
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    const CEIL: Duration = Duration::from_secs(300);

    fn limited(retry_after: Option<Duration>, capped: bool) -> UpstreamOutcome {
        UpstreamOutcome::RateLimited { retry_after, capped, dimension: None, meter: Meter::new() }
    }

    fn classify(status: u16, h: &HeaderMap, body: &[u8]) -> UpstreamOutcome {
        super::classify(status, h, body, SystemTime::now(), CEIL)
    }

    #[test]
    fn classifies_by_status() {
        let h = HeaderMap::new();
        let ok = br#"{"choices":[{"message":{"content":"{\"findings\":[]}"}}]}"#;
        let out = |output: &str, usage| UpstreamOutcome::Ok {
            output: output.into(),
            slow_down: None,
            usage,
            meter: Meter::new(),
        };
        assert_eq!(classify(200, &h, ok), out("{\"findings\":[]}", None));
        assert_eq!(classify(200, &h, b"garbage"), out("", None));
        let billed =
            br#"{"choices":[{"message":{"content":"x"}}],"usage":{"prompt_tokens":120,"completion_tokens":7}}"#;
        assert_eq!(classify(200, &h, billed), out("x", Some(Usage { input: 120, output: 7 })));
        assert_eq!(classify(429, &h, b"{}"), limited(None, false));
        assert_eq!(
            classify(429, &headers(&[("retry-after", "2")]), b"{}"),
            limited(Some(Duration::from_secs(2)), false)
        );
        assert_eq!(classify(429, &headers(&[("retry-after", "3600")]), b"{}"), limited(Some(CEIL), true));
        let empty = headers(&[("x-ratelimit-remaining-requests", "0"), ("x-ratelimit-reset-requests", "1s")]);
        assert!(
            matches!(classify(200, &empty, ok), UpstreamOutcome::Ok { slow_down: Some(d), .. } if d == Duration::from_secs(1))
        );
        assert_eq!(classify(408, &h, b""), UpstreamOutcome::Transient { status_class: "408" });
        assert_eq!(classify(503, &h, b""), UpstreamOutcome::Transient { status_class: "5xx" });
        assert_eq!(classify(401, &h, b""), UpstreamOutcome::Permanent { status: 401 });
        assert_eq!(classify(400, &h, b""), UpstreamOutcome::Permanent { status: 400 });
    }

    #[test]
    fn azure_content_filter_refusals_are_their_own_outcome_and_the_rest_reads_as_openai() {
        let now = SystemTime::now();
        let azure = |status, h: &HeaderMap, body: &[u8]| classify_azure(status, h, body, now, CEIL);
        let none = HeaderMap::new();
        let prompt = br#"{"error":{"message":"The response was filtered due to the prompt triggering Azure OpenAI's content management policy.","type":null,"param":"prompt","code":"content_filter","status":400,"innererror":{"code":"ResponsibleAIPolicyViolation","content_filter_result":{"hate":{"filtered":true,"severity":"high"}}}}}"#;
        assert_eq!(azure(400, &none, prompt), UpstreamOutcome::ContentFiltered { usage: None });
        let completion = br#"{"choices":[{"index":0,"finish_reason":"content_filter","message":{"role":"assistant","content":null},"content_filter_results":{"hate":{"filtered":true,"severity":"high"}}}],"usage":{"prompt_tokens":40,"completion_tokens":5}}"#;
        assert_eq!(
            azure(200, &none, completion),
            UpstreamOutcome::ContentFiltered { usage: Some(Usage { input: 40, output: 5 }) },
            "a filtered completion was paid for"
        );
        // Any other 400 is a rejection, as on OpenAI.
        let bad = br#"{"error":{"code":"BadRequest","message":"Invalid request"}}"#;
        assert_eq!(azure(400, &none, bad), UpstreamOutcome::Permanent { status: 400 });
        // A 429 with Azure's `retry-after-ms` waits that, to the millisecond.
        let h = headers(&[("retry-after-ms", "1500"), ("retry-after", "2")]);
        let body = br#"{"error":{"code":"429","message":"Requests to the ChatCompletions_Create Operation under Azure OpenAI API version 2024-10-21 have exceeded token rate limit of your current OpenAI S0 pricing tier. Please retry after 2 seconds."}}"#;
        assert!(
            matches!(azure(429, &h, body), UpstreamOutcome::RateLimited { retry_after: Some(d), dimension: Some(Dimension::Tokens), .. } if d == Duration::from_millis(1500)),
            "{:?}",
            azure(429, &h, body)
        );
        let calls = br#"{"error":{"code":"429","message":"Requests to the ChatCompletions_Create Operation under Azure OpenAI API version 2024-10-21 have exceeded call rate limit of your current OpenAI S0 pricing tier. Please retry after 1 second."}}"#;
        assert!(matches!(
            azure(429, &none, calls),
            UpstreamOutcome::RateLimited { dimension: Some(Dimension::Requests), .. }
        ));
        // A 200 that finished as usual is an answer, with its remaining readings.
        let ok = br#"{"choices":[{"finish_reason":"stop","message":{"content":"{\"findings\":[]}"}}]}"#;
        let h = headers(&[("x-ratelimit-remaining-requests", "7"), ("x-ratelimit-remaining-tokens", "900")]);
        let UpstreamOutcome::Ok { output, meter, .. } = azure(200, &h, ok) else { panic!() };
        assert_eq!(output, r#"{"findings":[]}"#);
        assert_eq!(meter[&Dimension::Requests].remaining, Some(7));
        assert_eq!(meter[&Dimension::Tokens].remaining, Some(900));
    }

    #[test]
    fn insufficient_quota_is_not_a_rate_limit() {
        let body = br#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#;
        assert_eq!(classify(429, &HeaderMap::new(), body), UpstreamOutcome::QuotaExhausted);
        let body = br#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#;
        assert!(matches!(classify(429, &HeaderMap::new(), body), UpstreamOutcome::RateLimited { .. }));
    }

    #[test]
    fn a_429_names_the_bucket_it_was_refused_for() {
        let dimension = |h: &HeaderMap, body: &[u8]| match classify(429, h, body) {
            UpstreamOutcome::RateLimited { dimension, .. } => dimension,
            other => panic!("{other:?}"),
        };
        let none = HeaderMap::new();
        let tokens = br#"{"error":{"message":"Rate limit reached for gpt-4o on tokens per min (TPM): Limit 30000, Used 28000, Requested 4000.","type":"tokens","code":"rate_limit_exceeded"}}"#;
        assert_eq!(dimension(&none, tokens), Some(Dimension::Tokens));
        let requests = br#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#;
        assert_eq!(dimension(&none, requests), Some(Dimension::Requests));
        // No word of it in the body: the headers say which is empty.
        let empty = headers(&[("x-ratelimit-remaining-requests", "12"), ("x-ratelimit-remaining-tokens", "0")]);
        assert_eq!(dimension(&empty, b"{}"), Some(Dimension::Tokens));
        // A concurrency 429 names none: the window decides.
        assert_eq!(dimension(&none, b"{}"), None);
        let UpstreamOutcome::RateLimited { meter, .. } = classify(429, &empty, b"{}") else { unreachable!() };
        assert_eq!(meter[&Dimension::Tokens].remaining, Some(0), "its readings are kept for the buckets");
    }

    #[test]
    fn a_bucket_429_pauses_only_for_an_explicit_retry_after_not_for_the_time_to_full() {
        let hint = |h: &HeaderMap, body: &[u8]| match classify(429, h, body) {
            UpstreamOutcome::RateLimited { retry_after, .. } => retry_after,
            other => panic!("{other:?}"),
        };
        let tokens = br#"{"error":{"message":"Rate limit reached","type":"tokens","code":"rate_limit_exceeded"}}"#;
        // OpenAI's reset is when the bucket is full again: the emptied bucket paces.
        let reset = headers(&[("x-ratelimit-remaining-tokens", "0"), ("x-ratelimit-reset-tokens", "59.5s")]);
        assert_eq!(hint(&reset, tokens), None);
        assert_eq!(hint(&reset, b"{}"), None, "the headers name the empty bucket");
        // An explicit retry-after is the provider's word: kept.
        let explicit = headers(&[("retry-after", "7"), ("x-ratelimit-reset-tokens", "59.5s")]);
        assert_eq!(hint(&explicit, tokens), Some(Duration::from_secs(7)));
        // No bucket named: the reset is all there is to go by.
        let unnamed = headers(&[("x-ratelimit-remaining-tokens", "12"), ("x-ratelimit-reset-tokens", "3s")]);
        assert_eq!(hint(&unnamed, b"{}"), Some(Duration::from_secs(3)));
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
