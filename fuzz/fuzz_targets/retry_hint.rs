//! The retry-hint parser: each line `name: value` is a response header.
#![no_main]

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;
use reviewlane_core::retry_hint::{headroom_pause, parse_go_duration, parse_retry_after, retry_hint};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut h = HeaderMap::new();
    for line in text.lines() {
        let Some((name, value)) = line.split_once(':') else { continue };
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name.trim().as_bytes()), HeaderValue::from_str(value.trim())) {
            h.append(n, v);
        }
        let _ = parse_go_duration(value.trim());
        let _ = parse_retry_after(value.trim(), SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000));
    }
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let ceiling = Duration::from_secs(300);
    if let Some(hint) = retry_hint(&h, now, ceiling) {
        assert!(hint.delay <= ceiling);
    }
    if let Some(p) = headroom_pause(&h, now, ceiling) {
        assert!(p <= ceiling);
    }
});
