//! Provider batch processing: the room where a sweep's items go through a provider's
//! own batch API (OpenAI `/v1/batches`, Anthropic `/v1/messages/batches`) rather than
//! one call each. The rules of it are pure and live in `reviewlane_core::batch` (ids,
//! cutting batches, what each status and each line means, polling, the estimate);
//! each adapter builds its own request lines (`OpenAiProvider::batch_line`,
//! `AnthropicProvider::batch_request`: the synchronous call's body under the item's
//! custom id); here is what reads the providers' files: `lines`, one result line into
//! its item and what it says.

pub mod lines;
pub mod openai;
