//! The provider's own retry hint, read from a 429's headers (pure; `now` is passed in).
//!
//! Precedence, first usable wins:
//! 1. `retry-after-ms` (milliseconds; OpenAI, Azure)
//! 2. `retry-after` (delta-seconds, or an HTTP-date)
//! 3. OpenAI `x-ratelimit-reset-requests` / `-tokens` (durations like `6m0s`, `250ms`,
//!    `1m30.5s`): the reset of each exhausted dimension (`x-ratelimit-remaining-* = 0`),
//!    the longest of them; if none says it is exhausted, the shortest reset given
//! 4. Anthropic `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-reset`
//!    (RFC 3339 timestamps), chosen the same way
//!
//! A value that does not parse is ignored and the next source is tried. A hint longer
//! than the ceiling is cut to the ceiling and marked `capped` (the caller counts it).
//! `headroom_pause` reads the same headers on any answer to slow down before a 429.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HintSource {
    RetryAfterMs,
    RetryAfter,
    OpenAiReset,
    AnthropicReset,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hint {
    pub delay: Duration,
    pub source: HintSource,
    /// The provider asked for longer than the ceiling.
    pub capped: bool,
}

/// Dimensions whose reset headers we read: (remaining header, reset header).
const OPENAI: [(&str, &str); 2] = [
    ("x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"),
    ("x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"),
];
const ANTHROPIC: [(&str, &str); 4] = [
    ("anthropic-ratelimit-requests-remaining", "anthropic-ratelimit-requests-reset"),
    ("anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-tokens-reset"),
    ("anthropic-ratelimit-input-tokens-remaining", "anthropic-ratelimit-input-tokens-reset"),
    ("anthropic-ratelimit-output-tokens-remaining", "anthropic-ratelimit-output-tokens-reset"),
];

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::trim).filter(|v| !v.is_empty())
}

fn non_negative_secs(v: f64) -> Option<Duration> {
    (0.0..1e9).contains(&v).then(|| Duration::from_secs_f64(v))
}

/// `retry-after`: delta-seconds or an HTTP-date.
pub fn parse_retry_after(v: &str, now: SystemTime) -> Option<Duration> {
    if let Ok(secs) = v.parse::<f64>() {
        return non_negative_secs(secs);
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Go-style durations as OpenAI sends them: `6m0s`, `1s`, `250ms`, `1m30.5s`, `2h`.
pub fn parse_go_duration(v: &str) -> Option<Duration> {
    let mut rest = v;
    let mut total = 0f64;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let num_len = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let n: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += n * scale;
        rest = &rest[unit_len..];
    }
    non_negative_secs(total)
}

/// RFC 3339 timestamp, as a delay from `now`.
pub fn parse_rfc3339_delay(v: &str, now: SystemTime) -> Option<Duration> {
    let at = time::OffsetDateTime::parse(v, &time::format_description::well_known::Rfc3339).ok()?;
    let at = SystemTime::UNIX_EPOCH + Duration::try_from(at - time::OffsetDateTime::UNIX_EPOCH).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The reset to wait for among `dims`: the longest of the exhausted ones, else the
/// shortest given.
fn dimension_reset(h: &HeaderMap, dims: &[(&str, &str)], parse: impl Fn(&str) -> Option<Duration>) -> Option<Duration> {
    let mut exhausted = None::<Duration>;
    let mut any = None::<Duration>;
    for (remaining, reset) in dims {
        let Some(d) = header(h, reset).and_then(&parse) else { continue };
        any = Some(any.map_or(d, |a| a.min(d)));
        if header(h, remaining).and_then(|r| r.parse::<f64>().ok()).is_some_and(|r| r <= 0.0) {
            exhausted = Some(exhausted.map_or(d, |e| e.max(d)));
        }
    }
    exhausted.or(any)
}

/// The provider's hint for a 429, with the ceiling applied.
pub fn retry_hint(h: &HeaderMap, now: SystemTime, ceiling: Duration) -> Option<Hint> {
    let found = header(h, "retry-after-ms")
        .and_then(|v| v.parse::<f64>().ok())
        .and_then(|ms| non_negative_secs(ms / 1000.0))
        .map(|d| (d, HintSource::RetryAfterMs))
        .or_else(|| {
            header(h, "retry-after").and_then(|v| parse_retry_after(v, now)).map(|d| (d, HintSource::RetryAfter))
        })
        .or_else(|| dimension_reset(h, &OPENAI, parse_go_duration).map(|d| (d, HintSource::OpenAiReset)))
        .or_else(|| {
            dimension_reset(h, &ANTHROPIC, |v| parse_rfc3339_delay(v, now)).map(|d| (d, HintSource::AnthropicReset))
        });
    found.map(|(delay, source)| Hint { delay: delay.min(ceiling), source, capped: delay > ceiling })
}

/// On any answer: when a dimension's remaining count is zero, the next call would be
/// refused until its reset, so pause the scope that long before a 429 happens.
pub fn headroom_pause(h: &HeaderMap, now: SystemTime, ceiling: Duration) -> Option<Duration> {
    let exhausted = |dims: &[(&str, &str)], parse: &dyn Fn(&str) -> Option<Duration>| {
        dims.iter()
            .filter(|(remaining, _)| header(h, remaining).and_then(|r| r.parse::<f64>().ok()).is_some_and(|r| r <= 0.0))
            .filter_map(|(_, reset)| header(h, reset).and_then(parse))
            .max()
    };
    let openai = exhausted(&OPENAI, &parse_go_duration);
    let anthropic = exhausted(&ANTHROPIC, &|v| parse_rfc3339_delay(v, now));
    openai.into_iter().chain(anthropic).max().map(|d| d.min(ceiling)).filter(|d| !d.is_zero())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CEIL: Duration = Duration::from_secs(300);

    fn h(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.insert(*k, v.parse().unwrap());
        }
        m
    }

    fn now() -> SystemTime {
        // 2026-01-01T00:00:00Z
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_225_600)
    }

    fn hint(pairs: &[(&'static str, &str)]) -> Option<(Duration, HintSource, bool)> {
        retry_hint(&h(pairs), now(), CEIL).map(|x| (x.delay, x.source, x.capped))
    }

    #[test]
    fn retry_after_seconds_and_http_date() {
        assert_eq!(hint(&[("retry-after", "2")]), Some((Duration::from_secs(2), HintSource::RetryAfter, false)));
        assert_eq!(hint(&[("retry-after", "1.5")]).unwrap().0, Duration::from_millis(1500));
        assert_eq!(hint(&[("retry-after", "Thu, 01 Jan 2026 00:00:30 GMT")]).unwrap().0, Duration::from_secs(30));
        // A date in the past means now.
        assert_eq!(hint(&[("retry-after", "Wed, 31 Dec 2025 23:59:00 GMT")]).unwrap().0, Duration::ZERO);
    }

    #[test]
    fn retry_after_ms_wins() {
        assert_eq!(
            hint(&[("retry-after", "9"), ("retry-after-ms", "1200")]),
            Some((Duration::from_millis(1200), HintSource::RetryAfterMs, false))
        );
    }

    #[test]
    fn go_durations() {
        for (v, ms) in
            [("6m0s", 360_000), ("1s", 1000), ("250ms", 250), ("1m30.5s", 90_500), ("2h", 7_200_000), ("0s", 0)]
        {
            assert_eq!(parse_go_duration(v), Some(Duration::from_millis(ms)), "{v}");
        }
        for bad in ["", "s", "5", "1x", "-1s", "1s2", "1..2s"] {
            assert_eq!(parse_go_duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn openai_resets_prefer_the_exhausted_dimension() {
        let both = [
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-reset-tokens", "6m0s"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-remaining-tokens", "5000"),
        ];
        assert_eq!(hint(&both), Some((Duration::from_secs(1), HintSource::OpenAiReset, false)));
        let tokens_out = [
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-reset-tokens", "20s"),
            ("x-ratelimit-remaining-requests", "10"),
            ("x-ratelimit-remaining-tokens", "0"),
        ];
        assert_eq!(hint(&tokens_out).unwrap().0, Duration::from_secs(20));
        // Nothing marked exhausted: the shortest reset.
        assert_eq!(hint(&both[..2]).unwrap().0, Duration::from_secs(1));
    }

    #[test]
    fn anthropic_rfc3339_resets() {
        let p = [
            ("anthropic-ratelimit-requests-reset", "2026-01-01T00:00:05Z"),
            ("anthropic-ratelimit-tokens-reset", "2026-01-01T01:00:12+01:00"),
            ("anthropic-ratelimit-tokens-remaining", "0"),
        ];
        assert_eq!(hint(&p), Some((Duration::from_secs(12), HintSource::AnthropicReset, false)));
        assert_eq!(hint(&p[..1]).unwrap().0, Duration::from_secs(5));
        // retry-after, which Anthropic also sends, comes first.
        let mut with_ra = p.to_vec();
        with_ra.push(("retry-after", "3"));
        assert_eq!(hint(&with_ra).unwrap().1, HintSource::RetryAfter);
    }

    #[test]
    fn garbage_is_ignored_and_the_next_source_used() {
        assert_eq!(hint(&[("retry-after", "soon")]), None);
        assert_eq!(hint(&[("retry-after", "-3")]), None);
        assert_eq!(hint(&[("retry-after-ms", "NaN"), ("retry-after", "1")]).unwrap().1, HintSource::RetryAfter);
        assert_eq!(
            hint(&[("retry-after", "later"), ("x-ratelimit-reset-requests", "2s")]).unwrap().1,
            HintSource::OpenAiReset
        );
        assert_eq!(hint(&[("anthropic-ratelimit-requests-reset", "yesterday")]), None);
        assert_eq!(hint(&[]), None);
    }

    #[test]
    fn ceiling_caps_and_marks() {
        assert_eq!(hint(&[("retry-after", "86400")]), Some((CEIL, HintSource::RetryAfter, true)));
        assert_eq!(hint(&[("x-ratelimit-reset-tokens", "2h")]).unwrap(), (CEIL, HintSource::OpenAiReset, true));
    }

    #[test]
    fn headroom_pauses_only_when_a_dimension_is_empty() {
        let ok = h(&[("x-ratelimit-remaining-requests", "3"), ("x-ratelimit-reset-requests", "2s")]);
        assert_eq!(headroom_pause(&ok, now(), CEIL), None);
        let empty = h(&[("x-ratelimit-remaining-requests", "0"), ("x-ratelimit-reset-requests", "2s")]);
        assert_eq!(headroom_pause(&empty, now(), CEIL), Some(Duration::from_secs(2)));
        let anth = h(&[
            ("anthropic-ratelimit-output-tokens-remaining", "0"),
            ("anthropic-ratelimit-output-tokens-reset", "2026-01-01T00:00:04Z"),
        ]);
        assert_eq!(headroom_pause(&anth, now(), CEIL), Some(Duration::from_secs(4)));
        assert_eq!(headroom_pause(&HeaderMap::new(), now(), CEIL), None);
    }
}
