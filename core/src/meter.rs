//! What a provider says it meters, read from any answer's headers (pure; `now` is
//! passed in): per dimension, the limit, what remains of it, and when it is full again.
//!
//! - OpenAI: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, resets as Go
//!   durations (`6m0s`, `250ms`).
//! - Anthropic: `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-
//!   {limit,remaining,reset}`, resets as RFC 3339 timestamps.
//!
//! A value that does not parse is left out; a dimension with nothing readable is not
//! reported. The token buckets follow these readings (a provider that reports less
//! than the bucket holds wins), and an unconfigured limit is learned from them.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use http::HeaderMap;

use crate::retry_hint::{parse_go_duration, parse_rfc3339_delay};

/// One metered dimension of a provider key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dimension {
    /// Requests per minute.
    Requests,
    /// Tokens per minute, input and output together (OpenAI counts the request's
    /// `max_tokens` when it starts).
    Tokens,
    /// Input tokens per minute (Anthropic).
    InputTokens,
    /// Output tokens per minute (Anthropic, counted as produced).
    OutputTokens,
    /// Tokens per day, input and output together (configured only: no provider
    /// reports it in headers).
    TokensPerDay,
}

/// What one call is metered for: its prompt, and its output (the output limit before
/// it runs, what it produced after).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cost {
    pub input: u64,
    pub output: u64,
}

impl Dimension {
    pub const ALL: [Dimension; 5] = [
        Dimension::Requests,
        Dimension::Tokens,
        Dimension::InputTokens,
        Dimension::OutputTokens,
        Dimension::TokensPerDay,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Dimension::Requests => "requests",
            Dimension::Tokens => "tokens",
            Dimension::InputTokens => "input_tokens",
            Dimension::OutputTokens => "output_tokens",
            Dimension::TokensPerDay => "tokens_per_day",
        }
    }

    /// The name of its limit in `REVIEWLANE_KEY_BUDGETS` (the providers' own terms).
    pub fn short(self) -> &'static str {
        match self {
            Dimension::Requests => "rpm",
            Dimension::Tokens => "tpm",
            Dimension::InputTokens => "itpm",
            Dimension::OutputTokens => "otpm",
            Dimension::TokensPerDay => "tpd",
        }
    }

    /// The period its limit is metered over: a minute, or a day.
    pub fn period(self) -> Duration {
        match self {
            Dimension::TokensPerDay => Duration::from_secs(86_400),
            _ => Duration::from_secs(60),
        }
    }

    /// What a call of `cost` takes of this dimension.
    pub fn of(self, cost: Cost) -> u64 {
        match self {
            Dimension::Requests => 1,
            Dimension::Tokens | Dimension::TokensPerDay => cost.input + cost.output,
            Dimension::InputTokens => cost.input,
            Dimension::OutputTokens => cost.output,
        }
    }

    /// Which dimension a 429's error message names, if any (OpenAI: "on tokens per min
    /// (TPM)", error type `tokens`; Anthropic: "... input tokens per minute").
    pub fn named_in(message: &str) -> Option<Dimension> {
        let m = message.to_ascii_lowercase();
        [
            ("input tokens per minute", Dimension::InputTokens),
            ("output tokens per minute", Dimension::OutputTokens),
            ("tokens per day", Dimension::TokensPerDay),
            ("(tpd)", Dimension::TokensPerDay),
            ("tokens per min", Dimension::Tokens),
            ("(tpm)", Dimension::Tokens),
            ("requests per min", Dimension::Requests),
            ("(rpm)", Dimension::Requests),
            // Azure OpenAI: "have exceeded token rate limit" / "call rate limit".
            ("token rate limit", Dimension::Tokens),
            ("call rate limit", Dimension::Requests),
        ]
        .into_iter()
        .find(|(needle, _)| m.contains(needle))
        .map(|(_, d)| d)
    }
}

/// A key's configured limits, as `REVIEWLANE_KEY_BUDGETS` gives them: comma-separated
/// `name=limit` pairs with the providers' names (`rpm`, `tpm`, `itpm`, `otpm`, `tpd`),
/// each at most once, each positive. `Err` names what is wrong, never a value.
pub fn parse_budgets(text: &str) -> Result<Vec<(Dimension, u64)>, String> {
    let mut out: Vec<(Dimension, u64)> = Vec::new();
    for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, limit) = pair.split_once('=').ok_or("each budget is name=limit")?;
        let dim = Dimension::ALL
            .into_iter()
            .find(|d| d.short() == name.trim())
            .ok_or("a budget's name is one of rpm, tpm, itpm, otpm, tpd")?;
        let limit: u64 = limit.trim().parse().map_err(|_| "a budget's limit is a whole number")?;
        if limit == 0 {
            return Err(format!("the {} budget must be positive", dim.short()));
        }
        if out.iter().any(|(d, _)| *d == dim) {
            return Err(format!("the {} budget is given twice", dim.short()));
        }
        out.push((dim, limit));
    }
    out.sort();
    Ok(out)
}

/// What an answer said about one dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reading {
    pub limit: Option<u64>,
    pub remaining: Option<u64>,
    /// How long until the dimension is full again.
    pub reset: Option<Duration>,
}

impl Reading {
    fn is_empty(&self) -> bool {
        self.limit.is_none() && self.remaining.is_none() && self.reset.is_none()
    }
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::trim).filter(|v| !v.is_empty())
}

fn count(h: &HeaderMap, name: &str) -> Option<u64> {
    header(h, name)?.parse().ok()
}

/// Every dimension the answer's headers report.
pub fn readings(h: &HeaderMap, now: SystemTime) -> BTreeMap<Dimension, Reading> {
    let mut out = BTreeMap::new();
    let openai = [(Dimension::Requests, "requests"), (Dimension::Tokens, "tokens")];
    for (dim, name) in openai {
        let r = Reading {
            limit: count(h, &format!("x-ratelimit-limit-{name}")),
            remaining: count(h, &format!("x-ratelimit-remaining-{name}")),
            reset: header(h, &format!("x-ratelimit-reset-{name}")).and_then(parse_go_duration),
        };
        if !r.is_empty() {
            out.insert(dim, r);
        }
    }
    let anthropic = [
        (Dimension::Requests, "requests"),
        (Dimension::Tokens, "tokens"),
        (Dimension::InputTokens, "input-tokens"),
        (Dimension::OutputTokens, "output-tokens"),
    ];
    for (dim, name) in anthropic {
        let r = Reading {
            limit: count(h, &format!("anthropic-ratelimit-{name}-limit")),
            remaining: count(h, &format!("anthropic-ratelimit-{name}-remaining")),
            reset: header(h, &format!("anthropic-ratelimit-{name}-reset")).and_then(|v| parse_rfc3339_delay(v, now)),
        };
        if !r.is_empty() {
            out.insert(dim, r);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_are_named_pairs_each_once_and_positive() {
        assert_eq!(
            parse_budgets("tpm=48000, rpm=20,tpd=1000000").unwrap(),
            vec![(Dimension::Requests, 20), (Dimension::Tokens, 48_000), (Dimension::TokensPerDay, 1_000_000)]
        );
        assert_eq!(
            parse_budgets("itpm=40000,otpm=8000").unwrap(),
            vec![(Dimension::InputTokens, 40_000), (Dimension::OutputTokens, 8_000)]
        );
        assert_eq!(parse_budgets("").unwrap(), vec![]);
        for bad in ["tpm", "tpm=0", "tpm=1k", "tps=4", "rpm=1,rpm=2"] {
            assert!(parse_budgets(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_429_message_names_its_dimension() {
        let openai = "Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000";
        assert_eq!(Dimension::named_in(openai), Some(Dimension::Tokens));
        assert_eq!(Dimension::named_in("... on requests per min (RPM): Limit 3"), Some(Dimension::Requests));
        assert_eq!(Dimension::named_in("... on tokens per day (TPD): Limit 90000"), Some(Dimension::TokensPerDay));
        let anthropic =
            "This request would exceed the rate limit for your organization of 50,000 input tokens per minute.";
        assert_eq!(Dimension::named_in(anthropic), Some(Dimension::InputTokens));
        assert_eq!(Dimension::named_in("... 8,000 output tokens per minute"), Some(Dimension::OutputTokens));
        assert_eq!(Dimension::named_in("Too many concurrent requests"), None);
    }

    fn h(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.insert(*k, v.parse().unwrap());
        }
        m
    }

    const NOW: Duration = Duration::from_secs(1_700_000_000);

    #[test]
    fn openai_requests_and_tokens_with_go_duration_resets() {
        let got = readings(
            &h(&[
                ("x-ratelimit-limit-requests", "500"),
                ("x-ratelimit-remaining-requests", "499"),
                ("x-ratelimit-reset-requests", "120ms"),
                ("x-ratelimit-limit-tokens", "48000"),
                ("x-ratelimit-remaining-tokens", "43700"),
                ("x-ratelimit-reset-tokens", "5.375s"),
            ]),
            SystemTime::UNIX_EPOCH + NOW,
        );
        assert_eq!(
            got[&Dimension::Requests],
            Reading { limit: Some(500), remaining: Some(499), reset: Some(Duration::from_millis(120)) }
        );
        assert_eq!(
            got[&Dimension::Tokens],
            Reading { limit: Some(48_000), remaining: Some(43_700), reset: Some(Duration::from_millis(5375)) }
        );
        assert_eq!(got.len(), 2);
    }

    #[test]
    fn anthropic_input_and_output_tokens_with_timestamp_resets() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000); // 2023-11-14T22:13:20Z
        let got = readings(
            &h(&[
                ("anthropic-ratelimit-input-tokens-limit", "40000"),
                ("anthropic-ratelimit-input-tokens-remaining", "39000"),
                ("anthropic-ratelimit-input-tokens-reset", "2023-11-14T22:13:50Z"),
                ("anthropic-ratelimit-output-tokens-limit", "8000"),
                ("anthropic-ratelimit-output-tokens-remaining", "0"),
                ("anthropic-ratelimit-requests-limit", "50"),
            ]),
            now,
        );
        assert_eq!(
            got[&Dimension::InputTokens],
            Reading { limit: Some(40_000), remaining: Some(39_000), reset: Some(Duration::from_secs(30)) }
        );
        assert_eq!(got[&Dimension::OutputTokens], Reading { limit: Some(8000), remaining: Some(0), reset: None });
        assert_eq!(got[&Dimension::Requests], Reading { limit: Some(50), ..Default::default() });
        assert!(!got.contains_key(&Dimension::Tokens));
    }

    #[test]
    fn what_does_not_parse_is_left_out() {
        let got = readings(
            &h(&[
                ("x-ratelimit-limit-tokens", "lots"),
                ("x-ratelimit-remaining-tokens", "-3"),
                ("x-ratelimit-reset-tokens", "soon"),
                ("x-ratelimit-limit-requests", "10"),
            ]),
            SystemTime::UNIX_EPOCH + NOW,
        );
        assert!(!got.contains_key(&Dimension::Tokens), "{got:?}");
        assert_eq!(got[&Dimension::Requests].limit, Some(10));
        assert!(readings(&HeaderMap::new(), SystemTime::UNIX_EPOCH + NOW).is_empty());
    }
}
