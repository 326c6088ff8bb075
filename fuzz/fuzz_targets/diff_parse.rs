//! The diff parser on any bytes, read as the ingress reads `diff_bytes`: git's colours
//! stripped, then parsed with the file names exact.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reviewlane_core::diff;

fuzz_target!(|data: &[u8]| {
    let plain = diff::strip_colours(data);
    if let Ok(d) = diff::parse_bytes(plain.as_deref().unwrap_or(data)) {
        // What the validator and the analyzer then walk.
        for (f, h, l) in d.added_lines() {
            let _ = (f.new_path.as_deref(), h.covers_new_line(l.new_line.unwrap_or(0)));
        }
        // Every name reads back to one string form.
        for p in d.files.iter().filter_map(|f| f.new_path.as_deref()) {
            assert_eq!(diff::path::from_bytes(&diff::path::to_bytes(p)), p);
        }
    }
});
