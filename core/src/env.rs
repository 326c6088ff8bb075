//! The environment variable names more than one service reads, in one place; each
//! service's own are in its `env.rs`. Also what the services' tests need to hold the
//! tables of `docs/configuration.md` to those lists: the table reader and an `Env` that
//! records what a config asked for.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};

pub const REGION: &str = "REVIEWLANE_REGION";
pub const NATS_URL: &str = "REVIEWLANE_NATS_URL";
pub const TENANTS_FILE: &str = "REVIEWLANE_TENANTS_FILE";
pub const ADMIN_ADDR: &str = "REVIEWLANE_ADMIN_ADDR";
pub const SHUTDOWN_GRACE_SECS: &str = "REVIEWLANE_SHUTDOWN_GRACE_SECS";
pub const LOG_FORMAT: &str = "REVIEWLANE_LOG_FORMAT";
pub const OTEL_EXPORTER_OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
pub const INTERACTIVE_WINDOW_SECS: &str = "REVIEWLANE_INTERACTIVE_WINDOW_SECS";
pub const BATCH_WINDOW_SECS: &str = "REVIEWLANE_BATCH_WINDOW_SECS";
pub const STORE_RETRIES: &str = "REVIEWLANE_STORE_RETRIES";
/// The prefix of the NATS credentials (`REVIEWLANE_NATS_USER`, ...).
pub const NATS: &str = "REVIEWLANE_NATS";
/// What follows a NATS prefix: at most one kind of credentials, and TLS.
pub const NATS_CREDENTIALS: [&str; 10] = [
    "_USER",
    "_PASSWORD",
    "_PASSWORD_FILE",
    "_TOKEN",
    "_TOKEN_FILE",
    "_NKEY_SEED_FILE",
    "_CREDS_FILE",
    "_TLS_CA_FILE",
    "_TLS_CERT_FILE",
    "_TLS_KEY_FILE",
];

/// Read by the ingress, the extractor and the publisher alike.
pub const EVERY_SERVICE: [&str; 5] =
    [TENANTS_FILE, ADMIN_ADDR, SHUTDOWN_GRACE_SECS, LOG_FORMAT, OTEL_EXPORTER_OTLP_ENDPOINT];
/// Read by the services that serve one region (the extractor, the publisher).
pub const REGION_BOUND: [&str; 2] = [REGION, NATS_URL];
/// Each lane's service window.
pub const LANE_WINDOWS: [&str; 2] = [INTERACTIVE_WINDOW_SECS, BATCH_WINDOW_SECS];

/// The region's layout (sizes, retention, replicas of its streams and buckets): read by
/// `reviewlane-admin provision` alone, which owns the layout; the services open what it
/// laid out.
pub const LAYOUT: [&str; 13] = [
    "REVIEWLANE_STREAM_REPLICAS",
    "REVIEWLANE_LANE_MAX_MESSAGES",
    "REVIEWLANE_LANE_MAX_BYTES",
    "REVIEWLANE_LANE_MAX_AGE_SECS",
    "REVIEWLANE_MAX_MESSAGE_BYTES",
    "REVIEWLANE_JOBS_MAX_AGE_SECS",
    "REVIEWLANE_PUBLISHED_MAX_AGE_SECS",
    "REVIEWLANE_FINDINGS_MAX_AGE_SECS",
    "REVIEWLANE_FINDINGS_MAX_BYTES",
    "REVIEWLANE_DEADLETTER_MAX_AGE_SECS",
    "REVIEWLANE_DEADLETTER_CONTENT_MAX_AGE_SECS",
    "REVIEWLANE_QUOTA_MAX_AGE_SECS",
    "REVIEWLANE_CACHE_MAX_AGE_SECS",
];

/// Names a service used to read and no longer does, each with where it went.
pub type Retired = &'static [(&'static str, &'static str)];

/// Retired from every service that read them.
pub const EVERY_SERVICE_RETIRED: Retired = &[
    ("REVIEWLANE_STORE_BACKOFF_BASE_MS", "store writes back off from 100 ms"),
    ("REVIEWLANE_STORE_BACKOFF_CAP_MS", "store writes back off up to 4 s"),
];

/// Every name `retired` looks at for a service with its own `retired` list.
pub fn retired_names(retired: Retired) -> impl Iterator<Item = String> {
    LAYOUT.iter().copied().chain(EVERY_SERVICE_RETIRED.iter().chain(retired).map(|(n, _)| *n)).map(str::to_string)
}

/// One notice for each retired name set in the environment (the layout's and the
/// service's own `retired`), naming it and where it went, never its value: a service
/// logs them at start, so a setting that no longer has an effect does not go unseen.
pub fn retired(r: &crate::config::Reader<'_>, retired: Retired) -> Vec<String> {
    let layout = LAYOUT.iter().map(|n| (*n, "the layout belongs to `reviewlane-admin provision`"));
    layout
        .chain(EVERY_SERVICE_RETIRED.iter().copied())
        .chain(retired.iter().copied())
        .filter(|(name, _)| r.raw(name).is_some())
        .map(|(name, went)| format!("{name} is set but no longer read by this service: {went}"))
        .collect()
}

/// Every credential name under each prefix.
pub fn nats_names(prefixes: &[&str]) -> Vec<String> {
    prefixes.iter().flat_map(|p| NATS_CREDENTIALS.iter().map(move |k| format!("{p}{k}"))).collect()
}

/// Every name a service of one region reads: its `own`, those every service reads, the
/// region and its NATS URL, the lane windows, the store retries and the NATS
/// credentials.
pub fn region_service(own: &[&str]) -> BTreeSet<String> {
    let shared = EVERY_SERVICE.iter().chain(&REGION_BOUND).chain(&LANE_WINDOWS).chain(&[STORE_RETRIES]);
    own.iter().chain(shared).map(|n| n.to_string()).chain(nats_names(&[NATS])).collect()
}

/// Where the tables under `headings` in `doc` and the names a service reads disagree:
/// the names read but not listed, and those listed but not read (`None`: they agree).
pub fn doc_mismatch(doc: &str, headings: &[&str], read: &BTreeSet<String>) -> Option<String> {
    let listed = documented(doc, headings);
    let unlisted: Vec<_> = read.difference(&listed).collect();
    let unread: Vec<_> = listed.difference(read).collect();
    (!unlisted.is_empty() || !unread.is_empty())
        .then(|| format!("the docs lack {unlisted:?}; they list {unread:?}, which are not read"))
}

/// The names a config asked `asked` for that are neither in `read` nor retired.
pub fn stray(asked: &Recording, read: BTreeSet<String>, retired: Retired) -> Vec<String> {
    let known: BTreeSet<String> = read.into_iter().chain(retired_names(retired)).collect();
    asked.names().difference(&known).cloned().collect()
}

/// The names in the first column of the table under each `## <heading>` of `doc` (the
/// table must come before the next heading). `REVIEWLANE_NATS_US_*` stands for every
/// credential name under that prefix.
pub fn documented(doc: &str, headings: &[&str]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for heading in headings {
        let title = format!("## {heading}");
        let Some(start) = doc.lines().position(|l| l.trim() == title) else {
            panic!("the docs have no `{title}` section");
        };
        let section = doc.lines().skip(start + 1).take_while(|l| !l.starts_with('#'));
        let rows: Vec<&str> = section.skip_while(|l| !l.starts_with('|')).take_while(|l| l.starts_with('|')).collect();
        assert!(!rows.is_empty(), "`{title}` has no table");
        for row in rows {
            let first = row.split('|').nth(1).unwrap_or("");
            for name in first.split('`').skip(1).step_by(2) {
                if let Some(prefix) = name.strip_suffix("_*") {
                    out.extend(nats_names(&[prefix]));
                } else if name.starts_with("REVIEWLANE_") || name.starts_with("OTEL_") {
                    out.insert(name.to_string());
                }
            }
        }
    }
    out
}

/// An environment that records every name asked for.
#[derive(Debug, Default)]
pub struct Recording {
    values: HashMap<String, String>,
    asked: RefCell<BTreeSet<String>>,
}

impl Recording {
    pub fn with(values: &[(&str, &str)]) -> Recording {
        Recording { values: values.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(), ..Default::default() }
    }

    pub fn names(&self) -> BTreeSet<String> {
        self.asked.borrow().clone()
    }
}

impl crate::config::Env for Recording {
    fn get(&self, key: &str) -> Option<String> {
        self.asked.borrow_mut().insert(key.to_string());
        self.values.get(key).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retired_name_that_is_set_gives_a_notice_without_its_value() {
        let env = Recording::with(&[("REVIEWLANE_LANE_MAX_BYTES", "123456789"), ("REVIEWLANE_OLD", "s3cr3t")]);
        let r = crate::config::Reader::new(&env);
        let notices = retired(&r, &[("REVIEWLANE_OLD", "fixed at 7"), ("REVIEWLANE_UNSET", "gone")]);
        assert_eq!(notices.len(), 2, "{notices:?}");
        assert!(notices[0].contains("REVIEWLANE_LANE_MAX_BYTES") && notices[0].contains("reviewlane-admin provision"));
        assert!(notices[1].contains("REVIEWLANE_OLD") && notices[1].contains("fixed at 7"));
        assert!(notices.iter().all(|n| !n.contains("s3cr3t") && !n.contains("123456789")));
    }

    #[test]
    fn a_table_row_gives_its_names_and_a_prefix_gives_every_credential() {
        let doc = "## x\n\nintro\n\n| variable | default |\n| --- | --- |\n| `REVIEWLANE_A`, `REVIEWLANE_B` | `7` |\n| `REVIEWLANE_NATS_US_*` | unset |\n\n| `REVIEWLANE_AFTER` | no |\n";
        let names = documented(doc, &["x"]);
        assert!(names.contains("REVIEWLANE_A") && names.contains("REVIEWLANE_B"));
        assert!(names.contains("REVIEWLANE_NATS_US_CREDS_FILE"));
        assert!(!names.contains("REVIEWLANE_AFTER"), "the table ends at its first blank line");
        assert_eq!(names.len(), 2 + NATS_CREDENTIALS.len());
    }

    #[test]
    #[should_panic(expected = "has no table")]
    fn a_section_without_a_table_does_not_borrow_the_next_sections() {
        documented("## x\n\nintro\n\n## y\n\n| `REVIEWLANE_Y` | 1 |\n", &["x"]);
    }
}
