//! The extractor's config loader: each line `KEY=VALUE` is an environment variable.
#![no_main]

use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use reviewlane_extractor::config::ExtractorConfig;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let env: HashMap<String, String> = text
        .lines()
        .filter_map(|l| l.split_once('='))
        // A tenants file is read from disk: only the seeds' own file.
        .filter(|(k, v)| *k != "REVIEWLANE_TENANTS_FILE" || v.starts_with("fuzz/seeds/"))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let _ = ExtractorConfig::from_env(&env);
});
