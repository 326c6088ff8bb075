//! Checks that a service's configuration surface is what its docs say
//! (`docs/configuration.md`): the names in a doc table, where they and the names a
//! service reads disagree, and an `Env` that records every name a config asked for —
//! for the services' tests. The names themselves are `env`'s; reading them is
//! `config`'s.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};

use crate::env::{Retired, nats_names, retired_names};

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
    use crate::env::NATS_CREDENTIALS;

    #[test]
    fn a_retired_name_that_is_set_gives_a_notice_without_its_value() {
        let env = Recording::with(&[("REVIEWLANE_LANE_MAX_BYTES", "123456789"), ("REVIEWLANE_OLD", "s3cr3t")]);
        let r = crate::config::Reader::new(&env);
        let notices = r.retired_notices(&[("REVIEWLANE_OLD", "fixed at 7"), ("REVIEWLANE_UNSET", "gone")]);
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
