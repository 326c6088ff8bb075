//! Provider keys and quota scopes: what they are called, in KV keys and labels.

use std::collections::HashMap;

/// A quota scope within this region.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    pub provider: String,
    pub model_class: String,
    pub tenant: String,
}

impl Scope {
    /// KV key token: `<provider>.<class>.<tenant>`, each part reduced to `[A-Za-z0-9_-]`.
    pub fn token(&self) -> String {
        let clean = |s: &str| {
            s.chars()
                .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' })
                .collect::<String>()
        };
        format!("{}.{}.{}", clean(&self.provider), clean(&self.model_class), clean(&self.tenant))
    }
}

/// What `Quota::new` needs to know about the key and its tenants.
#[derive(Debug, Clone)]
pub struct KeyConfig {
    /// `<provider>.<key id>` (each part reduced to `[A-Za-z0-9_-]`).
    pub key: String,
    /// Calls in flight on the key across the fleet.
    pub limit: u32,
    /// Per tenant, a fleet-wide cap within the key.
    pub tenant_limits: HashMap<String, u32>,
    /// Per tenant, its weight (default 1).
    pub weights: HashMap<String, u32>,
}

impl KeyConfig {
    pub fn token(provider: &str, key_id: &str) -> String {
        format!("{}.{}", clean(provider), clean(key_id))
    }
}

fn clean(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_tokens_are_subject_safe() {
        let s = Scope { provider: "openai".into(), model_class: "gpt-4.1 mini".into(), tenant: "acme".into() };
        assert_eq!(s.token(), "openai.gpt-4_1_mini.acme");
    }
}
