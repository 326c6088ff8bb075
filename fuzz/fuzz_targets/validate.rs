//! The validator: the bytes before the first NUL are the diff, the rest the model's
//! answer, for every known schema version.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reviewlane_core::{diff, findings};

fuzz_target!(|data: &[u8]| {
    let split = data.iter().position(|b| *b == 0).unwrap_or(data.len());
    let output = String::from_utf8_lossy(data.get(split + 1..).unwrap_or_default());
    let Ok(d) = diff::parse_bytes(&data[..split]) else { return };
    for version in findings::known_schemas() {
        let _ = findings::validate(version, &output, &d);
    }
});
