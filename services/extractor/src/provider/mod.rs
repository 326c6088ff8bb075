//! Provider adapters: one trait, one adapter per provider contract. An adapter is built
//! for one region and refuses content of another.

pub mod anthropic;
pub mod builtin;
pub mod openai;

use futures::future::BoxFuture;
use reviewlane_shared::Region;
use reviewlane_shared::diff::Diff;
use reviewlane_shared::job::ReviewDepth;

use crate::upstream::UpstreamOutcome;

/// What a provider is asked. Content: never logged.
pub struct ProviderRequest<'a> {
    pub job_id: &'a str,
    pub region: Region,
    pub schema_version: &'a str,
    pub diff_text: &'a str,
    pub diff: &'a Diff,
    pub review_depth: ReviewDepth,
}

pub trait Provider: Send + Sync + 'static {
    /// Short fixed name for labels: `builtin`, `openai`, `anthropic`.
    fn name(&self) -> &'static str;
    /// The region this adapter's endpoint belongs to.
    fn region(&self) -> Region;
    /// One call. Implementations return `Permanent` for a request of another region.
    fn review<'a>(&'a self, req: &'a ProviderRequest<'a>) -> BoxFuture<'a, UpstreamOutcome>;
}

/// Version of the instructions the adapters send; part of the result-cache key, so a
/// changed prompt never serves answers to the old one. Bump it with any prompt change.
pub const PROMPT_VERSION: &str = "prompt.v1";

/// Status of a request the adapter refuses to send (another region's content).
pub const REFUSED_OTHER_REGION: u16 = 421;
