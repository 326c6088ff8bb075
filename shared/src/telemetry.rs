//! Logging set-up shared by the three services: level from `RUST_LOG`, JSON lines when
//! `REVIEWLANE_LOG_FORMAT=json` (production), human-readable otherwise.
//! Content never goes into a log: call sites log ids, states and numbers only.

use tracing_subscriber::EnvFilter;

pub fn init(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    // A second init (tests, several apps in one process) keeps the first subscriber.
    let _ =
        if json { builder.json().flatten_event(true).with_current_span(true).try_init() } else { builder.try_init() };
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
