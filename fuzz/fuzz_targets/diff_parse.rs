//! The diff parser on any bytes, decoded as the ingress decodes `diff_bytes`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reviewlane_core::diff;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(d) = diff::parse(&text) {
        // What the validator and the analyzer then walk.
        for (f, h, l) in d.added_lines() {
            let _ = (f.new_path.as_deref(), h.covers_new_line(l.new_line.unwrap_or(0)));
        }
    }
});
