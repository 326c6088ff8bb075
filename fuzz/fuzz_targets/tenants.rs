//! The tenants file as every service reads it (`Tenants::parse`), and the typed
//! environment reader the services' configs are built on. Input: a tenants TOML text,
//! then optionally a line `---` and lines `KEY=VALUE` as an environment.
//!
//! Asserts what an operator relies on: nothing panics, and no error message echoes a
//! value (a value may be a secret).
#![no_main]

use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use reviewlane_core::config::Reader;
use reviewlane_core::region::Region;
use reviewlane_core::schema_dialect::SchemaDialect;
use reviewlane_core::tenants::Tenants;

/// A value this long appearing in an error text was echoed, not matched by chance.
const ECHO_MIN: usize = 12;
const WINDOW_KEYS: [&str; 2] = ["REVIEWLANE_INTERACTIVE_WINDOW_SECS", "REVIEWLANE_BATCH_WINDOW_SECS"];
const LANE_WINDOWS: &str = "  - lane windows (REVIEWLANE_*_WINDOW_SECS) must be positive";

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (toml, env_text) = text.split_once("\n---\n").unwrap_or((&text, ""));
    if let Err(errs) = Tenants::parse(toml) {
        for line in toml.lines() {
            let Some((k, v)) = line.split_once('=') else { continue };
            let v = v.trim().trim_matches('"');
            // A valid tenant id is how an error says which tenant it is about; a value with
            // one of these characters cannot be any message's own words.
            if k.trim() != "id" && v.len() >= ECHO_MIN && v.contains(['!', '@', '%', '^', '&', '~', '|', '$', '?']) {
                assert!(errs.iter().all(|e| !e.contains(v)), "a tenants error echoes a value");
            }
        }
    }
    let env: HashMap<String, String> = env_text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    const EXPECTED: [&str; 4] = ["a number", "true or false", "a region", "a dialect"];
    let mut r = Reader::new(&env);
    for key in env.keys() {
        let _: Option<u64> = r.optional(key, EXPECTED[0]);
        let _: Option<f64> = r.optional(key, EXPECTED[0]);
        let _: Option<bool> = r.optional(key, EXPECTED[1]);
        let _: Option<Region> = r.optional(key, EXPECTED[2]);
        let _: Option<SchemaDialect> = r.optional(key, EXPECTED[3]);
    }
    let _ = r.lane_windows();
    if let Err(errs) = r.finish() {
        let shown = errs.to_string();
        // Every line the reader can write names a key and what was expected, never a value:
        // a value found in the text must be part of such a line's fixed words.
        let mut lines = vec!["invalid configuration:".to_string(), LANE_WINDOWS.to_string()];
        for k in env.keys().map(String::as_str).chain(WINDOW_KEYS) {
            for e in EXPECTED.iter().chain(&["whole seconds"]) {
                lines.push(format!("  - {k} has an invalid value ({e})"));
            }
        }
        for v in env.values().map(|v| v.trim()) {
            if v.len() >= ECHO_MIN && shown.contains(v) {
                assert!(lines.iter().any(|l| l.contains(v)), "a config error echoes a value");
            }
        }
    }
});
