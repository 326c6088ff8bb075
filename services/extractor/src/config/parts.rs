//! The parts section: how reviews larger than the model's context are split (see
//! `reviewlane_core::parts`) and merged, capped to what the key's budgets let one call
//! carry.

use crate::env;
use reviewlane_core::config::Reader;

use super::ProviderConfig;

/// How reviews larger than the model's context are split (see
/// `reviewlane_core::parts`) and merged.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PartConfig {
    /// Limits and tokenizer of new splits (a split job keeps the plan it started with).
    pub plan: reviewlane_core::parts::Plan,
    pub max_parts: u32,
    pub findings_cap: u32,
}

impl PartConfig {
    /// Defaults for a model: its tokenizer when tiktoken knows it, else the estimate.
    pub fn for_model(model: &str) -> Self {
        PartConfig {
            plan: reviewlane_core::parts::Plan {
                limits: Default::default(),
                tokenizer: crate::tokenizer::for_model(model).unwrap_or_default(),
            },
            max_parts: 64,
            findings_cap: 500,
        }
    }
}

pub(super) fn p_output(provider: &Option<ProviderConfig>) -> u32 {
    provider.as_ref().map_or(0, ProviderConfig::output_reserve)
}

/// Caps a part so that one call fits each of the key's token budgets with what every
/// call sends besides the diff and, where the budget counts it at start, the output
/// limit: a part that does not could never run. `Err` when no part could.
pub fn fit_parts_to_budget(
    parts: &mut PartConfig,
    budgets: &[(reviewlane_core::meter::Dimension, u64)],
    output: u32,
) -> Result<(), String> {
    use reviewlane_core::meter::Dimension;
    let output = u64::from(output);
    let fixed = crate::tokenizer::counter(parts.plan.tokenizer).tokens(&crate::provider::fixed_prompt()) as u64;
    let too_small = |dim: Dimension, beside: u64| {
        format!(
            "the {} budget in {} must exceed what one call takes besides its diff ({beside} tokens: \
             the instructions and schema, and the output limit where it is counted)",
            dim.short(),
            env::KEY_BUDGETS
        )
    };
    for &(dim, limit) in budgets {
        let beside = match dim {
            Dimension::Requests => continue,
            // Output is not the part's: the budget only has to hold one call's limit.
            Dimension::OutputTokens if output < limit => continue,
            Dimension::OutputTokens => return Err(too_small(dim, output)),
            Dimension::InputTokens => fixed,
            Dimension::Tokens | Dimension::TokensPerDay => fixed + output,
        };
        let Some(room) = limit.checked_sub(beside).filter(|room| *room > 0) else {
            return Err(too_small(dim, beside));
        };
        let fill = parts.plan.limits.fill_percent.max(1);
        let cap = usize::try_from(room).unwrap_or(usize::MAX).saturating_mul(100) / fill;
        parts.plan.limits.max_tokens = parts.plan.limits.max_tokens.min(cap);
    }
    Ok(())
}

/// `REVIEWLANE_CONTEXT_TOKENS` and the rest of the split settings.
pub(super) fn read_parts(r: &mut Reader<'_>, provider: &Option<ProviderConfig>) -> PartConfig {
    use reviewlane_core::parts::{PartLimits, Plan, Tokenizer};
    let model = match provider {
        Some(p) => p.model(),
        None => "builtin",
    };
    let d = PartConfig::for_model(model);
    let limits = PartLimits {
        max_tokens: r.or(env::CONTEXT_TOKENS, d.plan.limits.max_tokens, "a token count"),
        fill_percent: r.or(env::PART_FILL_PERCENT, d.plan.limits.fill_percent, "a percentage"),
        overlap: d.plan.limits.overlap,
    };
    if limits.max_tokens < 1000 {
        r.error("REVIEWLANE_CONTEXT_TOKENS must be at least 1000");
    }
    if !(1..=100).contains(&limits.fill_percent) {
        r.error("REVIEWLANE_PART_FILL_PERCENT must be between 1 and 100");
    }
    let bytes_per_token: f64 = r.or(env::BYTES_PER_TOKEN, 3.0, "a number");
    // At least 1: no tokenizer makes more tokens than bytes, which is what lets a diff
    // no longer in bytes than the budget skip counting.
    if !(1.0..=16.0).contains(&bytes_per_token) {
        r.error("REVIEWLANE_BYTES_PER_TOKEN must be between 1 and 16");
    }
    let estimate = Tokenizer::Estimate { milli_bytes_per_token: (bytes_per_token * 1000.0) as u32 };
    let tokenizer = match r.raw(env::TOKENIZER).as_deref().unwrap_or("auto") {
        "auto" => crate::tokenizer::for_model(model).unwrap_or(estimate),
        "o200k" => Tokenizer::O200k,
        "cl100k" => Tokenizer::Cl100k,
        "estimate" => estimate,
        _ => {
            r.error("REVIEWLANE_TOKENIZER must be `auto`, `o200k`, `cl100k` or `estimate`");
            estimate
        }
    };
    let max_parts: u32 = r.or(env::MAX_PARTS, d.max_parts, "a count");
    let findings_cap: u32 = r.or(env::FINDINGS_CAP, d.findings_cap, "a count");
    if max_parts == 0 || findings_cap == 0 {
        r.error("REVIEWLANE_MAX_PARTS and REVIEWLANE_FINDINGS_CAP must be positive");
    }
    PartConfig { plan: Plan { limits, tokenizer }, max_parts, findings_cap }
}
