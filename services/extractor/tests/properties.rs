//! Properties of the retry-hint parser and the config loader over generated input:
//! nothing panics, a hint never exceeds the ceiling, and well-formed hints round-trip.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue};
use proptest::prelude::*;
use reviewlane_core::retry_hint::{HintSource, headroom_pause, parse_go_duration, retry_hint};
use reviewlane_extractor::config::ExtractorConfig;

const HINT_HEADERS: [&str; 9] = [
    "retry-after-ms",
    "retry-after",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
    "anthropic-ratelimit-requests-remaining",
    "anthropic-ratelimit-requests-reset",
    "anthropic-ratelimit-tokens-reset",
];

fn headers(pairs: &[(usize, String)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        if let Ok(v) = HeaderValue::from_str(v) {
            h.append(HeaderName::from_static(HINT_HEADERS[k % HINT_HEADERS.len()]), v);
        }
    }
    h
}

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        "[0-9]{0,12}(\\.[0-9]{0,6})?",
        "-?[0-9]{1,4}(ms|s|m|h|us|ns|µs)?",
        "([0-9]{1,3}(h|m|s|ms)){1,4}",
        "(Mon|Tue|Wed), [0-9]{2} (Jan|Feb) [0-9]{4} [0-9]{2}:[0-9]{2}:[0-9]{2} GMT",
        "20[0-9]{2}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]{1,9})?(Z|[+-][0-9]{2}:[0-9]{2})",
        "[ -~]{0,30}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn a_hint_never_panics_and_never_exceeds_the_ceiling(
        pairs in prop::collection::vec((0usize..9, value()), 0..8),
        now_secs in 0u64..4_000_000_000,
        ceiling_secs in 0u64..10_000,
    ) {
        let h = headers(&pairs);
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(now_secs);
        let ceiling = Duration::from_secs(ceiling_secs);
        if let Some(hint) = retry_hint(&h, now, ceiling) {
            prop_assert!(hint.delay <= ceiling);
        }
        if let Some(p) = headroom_pause(&h, now, ceiling) {
            prop_assert!(p <= ceiling && !p.is_zero());
        }
    }

    #[test]
    fn retry_after_ms_and_seconds_round_trip(ms in 0u64..10_000_000, secs in 0u64..100_000) {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let ceiling = Duration::from_secs(1_000_000);
        let mut h = HeaderMap::new();
        h.insert("retry-after-ms", HeaderValue::from_str(&ms.to_string()).unwrap());
        h.insert("retry-after", HeaderValue::from_str(&secs.to_string()).unwrap());
        let hint = retry_hint(&h, now, ceiling).unwrap();
        prop_assert_eq!((hint.delay, hint.source), (Duration::from_millis(ms), HintSource::RetryAfterMs));
        h.remove("retry-after-ms");
        let hint = retry_hint(&h, now, ceiling).unwrap();
        prop_assert_eq!((hint.delay, hint.source), (Duration::from_secs(secs), HintSource::RetryAfter));
    }

    #[test]
    fn go_durations_round_trip(h in 0u64..100, m in 0u64..60, s in 0u64..60, ms in 0u64..1000) {
        let text = format!("{h}h{m}m{s}s{ms}ms");
        let want = Duration::from_millis(((h * 60 + m) * 60 + s) * 1000 + ms);
        let got = parse_go_duration(&text).unwrap();
        prop_assert!(got.abs_diff(want) < Duration::from_micros(1), "{} -> {:?}", text, got);
    }

    #[test]
    fn the_config_loader_never_panics(
        values in prop::collection::vec((any::<prop::sample::Index>(), config_value()), 0..30),
    ) {
        let keys = config_keys();
        let env: HashMap<String, String> =
            values.into_iter().map(|(k, v)| (keys[k.index(keys.len())].clone(), v)).collect();
        let _ = ExtractorConfig::from_env(&env);
    }
}

/// Values a variable might hold: valid ones of each kind, and anything printable.
fn config_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("us".to_string()),
        Just("eu".to_string()),
        Just("openai".to_string()),
        Just("builtin".to_string()),
        Just("anthropic".to_string()),
        Just("http://127.0.0.1:1".to_string()),
        Just("nats://127.0.0.1:1".to_string()),
        "-?[0-9]{1,12}",
        "[ -~]{0,12}",
    ]
}

/// Every variable the extractor's config reads (`env::all()`, which a unit test holds
/// to what the config really reads), so a new one is covered without touching this test.
fn config_keys() -> Vec<String> {
    let keys: Vec<String> = reviewlane_extractor::env::all().into_iter().collect();
    assert!(keys.len() > 30, "{keys:?}");
    keys
}
