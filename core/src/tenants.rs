//! The tenants file: who may call (API keys stored as sha256 hashes), where each
//! tenant's data lives (region), its limits, and where its findings go (sink).
//!
//! ```toml
//! [[tenants]]
//! id = "acme"                   # [a-z0-9][a-z0-9_-]*, used in subjects and labels
//! region = "eu"
//! api_key_sha256 = ["<64 hex>"] # sha256 of each accepted key
//! max_diff_bytes = 1048576      # optional; default from the ingress config
//! sink = { kind = "webhook", url = "https://...", secret = "..." }
//! weight = 1                    # optional: share against other tenants of a lane
//! scope_limit = 4               # optional: provider calls in flight, all replicas
//! # or: sink = { kind = "file", dir = "/var/lib/reviewlane/acme" }   # one <job id>.json per job
//! #     (format = "sarif" or "rdjson": one <job id>.sarif / .rdjson instead)
//! # or: sink = { kind = "github", token_file = "/run/secrets/github-token", max_comments = 20 }
//! #     (or app = { app_id = "123", installation_id = 456, private_key_file = "/run/secrets/app.pem" })
//! #     (api_url = "https://ghe.example/api/v3" for GitHub Enterprise)
//! allow_private_webhook = false # optional: let the webhook point at loopback/private addresses
//! lane_share = 0.5              # optional: share of each lane's bound (default: equal among the region's tenants)
//! deeper_pass = false           # optional: follow a review admitted at `changed_hunks` with a full-depth review
//! role = "operator"             # optional: may also list, read and replay every tenant's dead letters of its region
//! classes = { default = "deep", interactive = "fast" }  # optional: the model class of its reviews, per lane
//! #   (changed_hunks = "fast": the class of its reviews admitted at depth `changed_hunks`, on any lane)
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use secrecy::SecretString;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::job::ReviewDepth;
use crate::region::Region;

#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum SinkConfig {
    Webhook {
        url: String,
        secret: SecretString,
    },
    /// A review on the pull request the review's metadata names (repository
    /// `owner/repo`, pull request number, head revision): line comments for up to
    /// `max_comments` findings, the rest in the review's summary.
    #[serde(rename = "github")]
    GitHub {
        /// The REST API's base URL (GitHub Enterprise: `https://<host>/api/v3`).
        #[serde(default = "github_api")]
        api_url: String,
        /// A file holding a personal access token or an installation token (a
        /// mounted Secret; read at each delivery, so a rotated token is picked up).
        #[serde(default)]
        token_file: Option<PathBuf>,
        /// Or a GitHub App: installation tokens are minted from its private key.
        #[serde(default)]
        app: Option<GitHubApp>,
        #[serde(default = "default_max_comments")]
        max_comments: usize,
    },
    /// One file per job, `<dir>/<job id>.<extension>`, written atomically.
    File {
        dir: PathBuf,
        /// What the file holds (default: the delivery as JSON).
        #[serde(default)]
        format: FileFormat,
    },
}

/// A GitHub App installation a sink posts as.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GitHubApp {
    /// The App's id (or client id): the JWT's issuer.
    pub app_id: String,
    pub installation_id: u64,
    /// The App's PEM private key (a mounted Secret).
    pub private_key_file: PathBuf,
}

fn github_api() -> String {
    "https://api.github.com".into()
}

fn default_max_comments() -> usize {
    20
}

/// What a file sink writes for a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileFormat {
    /// The delivery (the webhook's body): `<job id>.json`.
    #[default]
    Json,
    /// A SARIF 2.1.0 log: `<job id>.sarif`.
    Sarif,
    /// A reviewdog rdjson document: `<job id>.rdjson`.
    Rdjson,
}

impl FileFormat {
    pub fn extension(self) -> &'static str {
        match self {
            FileFormat::Json => "json",
            FileFormat::Sarif => "sarif",
            FileFormat::Rdjson => "rdjson",
        }
    }
}

impl SinkConfig {
    /// `webhook` or `file`: what a span may say about a sink (never its URL or path).
    pub fn kind(&self) -> &'static str {
        match self {
            SinkConfig::Webhook { .. } => "webhook",
            SinkConfig::File { .. } => "file",
            SinkConfig::GitHub { .. } => "github",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    pub id: String,
    pub region: Region,
    #[serde(default)]
    pub api_key_sha256: Vec<String>,
    #[serde(default)]
    pub max_diff_bytes: Option<usize>,
    #[serde(default)]
    pub sink: Option<SinkConfig>,
    /// Share of the extractor's attention against other tenants of the lane (1..=16).
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Provider calls in flight for this tenant's quota scope, summed over replicas;
    /// default from the extractor's configuration.
    #[serde(default)]
    pub scope_limit: Option<u32>,
    /// This tenant's share of each lane's bound (0 to 1): reviews it may have queued on a
    /// lane. Default: an equal share among the region's tenants.
    #[serde(default)]
    pub lane_share: Option<f64>,
    /// Whether the webhook may point at loopback, private, link-local or metadata
    /// addresses (local stacks, in-cluster receivers). Off: such targets are refused.
    #[serde(default)]
    pub allow_private_webhook: bool,
    /// A review admitted at depth `changed_hunks` (its lane over its window) is followed
    /// by a full-depth review of the same diff through the sweep path: its own review,
    /// delivered once, linked both ways (`deeper_of`, `deeper_review`).
    #[serde(default)]
    pub deeper_pass: bool,
    /// `operator`: may also list, read and replay every tenant's dead letters of its
    /// region (an operator's own reviews are still its own).
    #[serde(default)]
    pub role: Role,
    /// The model class of its reviews, per lane (default: the region's).
    #[serde(default)]
    pub classes: Classes,
}

/// A tenant's model classes: the class of its reviews admitted at depth
/// `changed_hunks` (on either lane), else the class of a lane's reviews, else its
/// `default`, else the region's (`REVIEWLANE_MODEL_CLASS`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Classes {
    pub default: Option<String>,
    pub interactive: Option<String>,
    pub batch: Option<String>,
    pub changed_hunks: Option<String>,
}

impl Tenant {
    /// The model class of this tenant's reviews of `depth` on `lane`, if the tenant
    /// names one.
    pub fn class_for(&self, lane: crate::region::Lane, depth: ReviewDepth) -> Option<&str> {
        let on_lane = match lane {
            crate::region::Lane::Interactive => &self.classes.interactive,
            crate::region::Lane::Batch => &self.classes.batch,
        };
        let at_depth = match depth {
            ReviewDepth::ChangedHunks => self.classes.changed_hunks.as_deref(),
            ReviewDepth::Full => None,
        };
        at_depth.or(on_lane.as_deref()).or(self.classes.default.as_deref())
    }

    /// Whether its reviews at depth `changed_hunks` have a class of their own, and so
    /// a lane consumer of their own (`layout::lane_depth_filter`).
    pub fn splits_depth(&self) -> bool {
        self.classes.changed_hunks.is_some()
    }
}

/// What a key may do beyond its own tenant's reviews.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    #[default]
    Tenant,
    Operator,
}

fn default_weight() -> u32 {
    1
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantsFile {
    #[serde(default)]
    tenants: Vec<Tenant>,
}

/// All tenants, indexed by id and by key hash.
#[derive(Debug, Clone, Default)]
pub struct Tenants {
    by_id: HashMap<String, Arc<Tenant>>,
    by_key_hash: HashMap<String, Arc<Tenant>>,
}

pub fn hash_api_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

pub fn is_valid_tenant_id(id: &str) -> bool {
    let b = id.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'_')
}

impl Tenants {
    pub fn load(path: &Path) -> Result<Tenants, Vec<String>> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| vec![format!("tenants file {}: cannot read: {}", path.display(), e.kind())])?;
        Self::parse(&text)
    }

    /// Parses and validates the whole file, reporting every problem.
    pub fn parse(text: &str) -> Result<Tenants, Vec<String>> {
        let file: TenantsFile = toml::from_str(text).map_err(|e| {
            // toml's message quotes the offending input, which may hold a secret:
            // report only where it is.
            let at = e.span().map(|s| format!(" at byte {}", s.start)).unwrap_or_default();
            vec![format!("tenants file is not valid{at}")]
        })?;
        let mut errors = Vec::new();
        let mut t = Tenants::default();
        for (i, tenant) in file.tenants.into_iter().enumerate() {
            let n = i + 1;
            if !is_valid_tenant_id(&tenant.id) {
                errors.push(format!("tenant #{n}: id must match [a-z0-9][a-z0-9_-]{{0,62}}"));
                continue;
            }
            if t.by_id.contains_key(&tenant.id) {
                errors.push(format!("tenant `{}`: duplicate id", tenant.id));
                continue;
            }
            if let Some(SinkConfig::Webhook { url, .. }) = &tenant.sink
                && !(url.starts_with("http://") || url.starts_with("https://"))
            {
                errors.push(format!("tenant `{}`: webhook url must be http(s)", tenant.id));
            }
            if let Some(SinkConfig::GitHub { token_file, app, .. }) = &tenant.sink
                && token_file.is_some() == app.is_some()
            {
                errors.push(format!("tenant `{}`: a github sink needs exactly one of token_file and app", tenant.id));
            }
            if !(1..=16).contains(&tenant.weight) {
                errors.push(format!("tenant `{}`: weight must be 1 to 16", tenant.id));
            }
            if tenant.lane_share.is_some_and(|s| !(s > 0.0 && s <= 1.0)) {
                errors.push(format!("tenant `{}`: lane_share must be above 0 and at most 1", tenant.id));
            }
            if tenant.max_diff_bytes == Some(0) {
                errors.push(format!("tenant `{}`: max_diff_bytes must be positive", tenant.id));
            }
            let tenant = Arc::new(tenant);
            for h in &tenant.api_key_sha256 {
                let h = h.to_ascii_lowercase();
                if h.len() != 64 || !h.bytes().all(|c| c.is_ascii_hexdigit()) {
                    errors.push(format!("tenant `{}`: api_key_sha256 entries must be 64 hex digits", tenant.id));
                } else if t.by_key_hash.insert(h, tenant.clone()).is_some() {
                    errors.push(format!("tenant `{}`: an API key hash is used twice", tenant.id));
                }
            }
            t.by_id.insert(tenant.id.clone(), tenant);
        }
        if errors.is_empty() { Ok(t) } else { Err(errors) }
    }

    /// The tenant a presented API key belongs to.
    pub fn authenticate(&self, api_key: &str) -> Option<Arc<Tenant>> {
        self.by_key_hash.get(&hash_api_key(api_key)).cloned()
    }

    pub fn get(&self, id: &str) -> Option<Arc<Tenant>> {
        self.by_id.get(id).cloned()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Tenant>> {
        self.by_id.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authenticates_by_hash() {
        let h = hash_api_key("k1");
        let t = Tenants::parse(&format!(
            "[[tenants]]\nid = \"acme\"\nregion = \"eu\"\napi_key_sha256 = [\"{h}\"]\nsink = {{ kind = \"file\", dir = \"/tmp/x\" }}\n"
        ))
        .unwrap();
        let acme = t.authenticate("k1").unwrap();
        assert_eq!((acme.id.as_str(), acme.region), ("acme", Region::Eu));
        assert!(t.authenticate("k2").is_none());
        assert!(t.authenticate("").is_none());
    }

    #[test]
    fn a_tenant_names_its_model_class_per_lane_with_a_default() {
        use crate::region::Lane;
        let t = Tenants::parse(
            "[[tenants]]\nid = \"a\"\nregion = \"eu\"\nclasses = { default = \"deep\", interactive = \"fast\" }\n\n[[tenants]]\nid = \"b\"\nregion = \"eu\"\n",
        )
        .unwrap();
        let a = t.get("a").unwrap();
        assert_eq!(
            (a.class_for(Lane::Interactive, ReviewDepth::Full), a.class_for(Lane::Batch, ReviewDepth::Full)),
            (Some("fast"), Some("deep"))
        );
        assert_eq!(a.class_for(Lane::Batch, ReviewDepth::ChangedHunks), Some("deep"), "no class of its own");
        assert!(!a.splits_depth());
        let b = t.get("b").unwrap();
        assert_eq!(b.class_for(Lane::Interactive, ReviewDepth::Full), None, "the region's class");
        assert!(Tenants::parse("[[tenants]]\nid = \"c\"\nregion = \"eu\"\nclasses = { sweeps = \"x\" }\n").is_err());
    }

    #[test]
    fn reviews_admitted_at_changed_hunks_may_name_a_class_of_their_own() {
        use crate::region::Lane;
        let t = Tenants::parse(
            "[[tenants]]\nid = \"a\"\nregion = \"eu\"\nclasses = { default = \"deep\", changed_hunks = \"fast\" }\n",
        )
        .unwrap();
        let a = t.get("a").unwrap();
        assert!(a.splits_depth());
        for lane in Lane::ALL {
            assert_eq!(a.class_for(lane, ReviewDepth::ChangedHunks), Some("fast"), "{lane:?}");
            assert_eq!(a.class_for(lane, ReviewDepth::Full), Some("deep"), "{lane:?}");
        }
    }

    #[test]
    fn reports_every_problem_without_secrets() {
        let errs = Tenants::parse(
            "[[tenants]]\nid = \"Bad.Id\"\nregion = \"us\"\n\n[[tenants]]\nid = \"b\"\nregion = \"us\"\napi_key_sha256 = [\"xyz\"]\nsink = { kind = \"webhook\", url = \"ftp://x\", secret = \"s3cr3t\" }\n",
        )
        .unwrap_err();
        assert_eq!(errs.len(), 3, "{errs:?}");
        assert!(errs.iter().all(|e| !e.contains("s3cr3t")));
        let errs = Tenants::parse("[[tenants]]\nid = \"a\"\nregion = \"apac\"\nsecret = \"s3cr3t\"\n").unwrap_err();
        assert!(errs.iter().all(|e| !e.contains("s3cr3t")), "{errs:?}");
    }

    #[test]
    fn a_github_sink_takes_a_token_file_or_an_app_and_roles_parse() {
        let sink = |auth: &str| {
            Tenants::parse(&format!(
                "[[tenants]]\nid = \"a\"\nregion = \"us\"\nrole = \"operator\"\nsink = {{ kind = \"github\"{auth} }}\n"
            ))
        };
        let t = sink(", token_file = \"/run/t\"").unwrap();
        assert_eq!(t.get("a").unwrap().role, Role::Operator);
        let app = sink(", app = { app_id = \"1\", installation_id = 2, private_key_file = \"/run/k.pem\" }").unwrap();
        match &app.get("a").unwrap().sink {
            Some(SinkConfig::GitHub { api_url, app: Some(a), max_comments, .. }) => {
                assert_eq!((api_url.as_str(), a.installation_id, *max_comments), ("https://api.github.com", 2, 20));
            }
            other => panic!("{other:?}"),
        }
        assert!(sink("").is_err(), "neither");
        assert!(
            sink(", token_file = \"/t\", app = { app_id = \"1\", installation_id = 2, private_key_file = \"/k\" }")
                .is_err(),
            "both"
        );
    }

    #[test]
    fn secrets_do_not_print() {
        let t = Tenants::parse(
            "[[tenants]]\nid = \"a\"\nregion = \"us\"\nsink = { kind = \"webhook\", url = \"http://x\", secret = \"s3cr3t\" }\n",
        )
        .unwrap();
        assert!(!format!("{:?}", t.get("a").unwrap()).contains("s3cr3t"));
    }
}
