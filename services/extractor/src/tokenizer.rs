//! Token counts for splitting large reviews: OpenAI's own tokenizers (tiktoken's
//! `o200k_base`, `cl100k_base`) for the models that use them, else the documented
//! bytes-per-token estimate (`reviewlane_core::parts::Estimate`).

use reviewlane_core::parts::{Estimate, TokenCount, Tokenizer};

/// The tokenizer of a model family, when tiktoken knows the model; else `None`.
pub fn for_model(model: &str) -> Option<Tokenizer> {
    use tiktoken_rs::tokenizer::{Tokenizer as T, get_tokenizer};
    match get_tokenizer(model)? {
        T::O200kBase | T::O200kHarmony => Some(Tokenizer::O200k),
        T::Cl100kBase => Some(Tokenizer::Cl100k),
        _ => None,
    }
}

struct Bpe(&'static tiktoken_rs::CoreBPE);

impl TokenCount for Bpe {
    fn tokens(&self, text: &str) -> usize {
        self.0.count_ordinary(text)
    }
}

/// A counter for `tokenizer` (the BPE tables load once per process, on first use).
pub fn counter(tokenizer: Tokenizer) -> Box<dyn TokenCount> {
    match tokenizer {
        Tokenizer::Estimate { milli_bytes_per_token } => {
            Box::new(Estimate { bytes_per_token: f64::from(milli_bytes_per_token.max(1)) / 1000.0 })
        }
        Tokenizer::O200k => Box::new(Bpe(tiktoken_rs::o200k_base_singleton())),
        Tokenizer::Cl100k => Box::new(Bpe(tiktoken_rs::cl100k_base_singleton())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_models_get_their_tokenizer_others_the_estimate() {
        assert_eq!(for_model("gpt-4o-mini"), Some(Tokenizer::O200k));
        assert_eq!(for_model("gpt-4.1"), Some(Tokenizer::O200k));
        assert_eq!(for_model("gpt-4"), Some(Tokenizer::Cl100k));
        assert_eq!(for_model("claude-sonnet-4-5"), None);
        assert_eq!(for_model("sim"), None);
    }

    #[test]
    fn counts_are_the_tokenizers_and_the_estimate_is_bytes_over_ratio() {
        let code = "fn main() {\n    let total: u64 = values.iter().sum();\n}\n";
        let real = counter(Tokenizer::O200k).tokens(code);
        // Real BPE counts: far fewer tokens than bytes, more than words.
        assert!(real > 10 && real < code.len() / 2, "{real}");
        let est = counter(Tokenizer::Estimate { milli_bytes_per_token: 2000 }).tokens(code);
        assert_eq!(est, code.len().div_ceil(2));
    }
}
