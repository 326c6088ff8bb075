//! One face for both providers' batch APIs, as the coordinator uses them: the request
//! line of an item, sending a chunk (OpenAI: upload, then create; Anthropic: create with
//! the requests inline), finding a batch a crash may have created before its id was
//! recorded, polling, cancelling and reading the result lines.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use reviewlane_core::batch::{self, BatchLimits, BatchStatus, ChunkRecord, LineResult};

use crate::batch::BatchApiError;
use crate::batch::anthropic::{AnthropicBatches, MessageBatch};
use crate::batch::openai::{BatchInfo, OpenAiBatches};
use crate::provider::ProviderRequest;
use crate::provider::anthropic::AnthropicProvider;
use crate::provider::openai::OpenAiProvider;

/// The metadata key naming a chunk on the OpenAI batch it created.
pub const CHUNK_KEY: &str = "reviewlane_chunk";
/// Pages of the account's batches looked through for one a crash may have created.
const FIND_PAGES: u32 = 5;

pub enum BatchClient {
    OpenAi { batches: OpenAiBatches, adapter: Arc<OpenAiProvider> },
    Anthropic { batches: AnthropicBatches, adapter: Arc<AnthropicProvider> },
}

/// What looking for a batch a crash may have left unrecorded found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// This batch is the chunk's.
    Ours(String),
    /// A batch that may be the chunk's is still running: it cannot be told yet.
    Unproven,
    /// None: the chunk's batch was never created.
    None,
}

/// A batch as polled, in both providers' terms.
#[derive(Debug, Clone)]
pub struct Polled {
    pub status: BatchStatus,
    /// Lines that succeeded and lines that failed so far (OpenAI reports them while the
    /// batch runs; Anthropic once it has ended).
    pub succeeded: u64,
    pub failed: u64,
    raw: Raw,
}

#[derive(Debug, Clone)]
enum Raw {
    OpenAi(BatchInfo),
    Anthropic(MessageBatch),
}

impl BatchClient {
    pub fn provider(&self) -> &'static str {
        match self {
            BatchClient::OpenAi { .. } => "openai",
            BatchClient::Anthropic { .. } => "anthropic",
        }
    }

    pub fn region(&self) -> reviewlane_shared::Region {
        match self {
            BatchClient::OpenAi { batches, .. } => batches.region(),
            BatchClient::Anthropic { batches, .. } => batches.region(),
        }
    }

    /// The provider's own limits on one batch.
    pub fn limits(&self) -> BatchLimits {
        match self {
            BatchClient::OpenAi { .. } => BatchLimits::OPENAI,
            BatchClient::Anthropic { .. } => BatchLimits::ANTHROPIC,
        }
    }

    /// An item's request line (the synchronous call's body under its custom id).
    pub fn line(&self, custom_id: &str, req: &ProviderRequest<'_>) -> serde_json::Value {
        match self {
            BatchClient::OpenAi { adapter, .. } => adapter.batch_line(custom_id, req),
            BatchClient::Anthropic { adapter, .. } => adapter.batch_request(custom_id, req),
        }
    }

    /// Anthropic: the newest batch of the account now (stored with the intent, so a
    /// batch newer than it can be told as possibly this chunk's after a crash).
    pub async fn newest(&self) -> Result<Option<String>, BatchApiError> {
        match self {
            BatchClient::OpenAi { .. } => Ok(None),
            BatchClient::Anthropic { batches, .. } => Ok(batches.list(None, 1).await?.0.first().map(|b| b.id.clone())),
        }
    }

    /// OpenAI: uploads the chunk's input file under its id; the file id.
    pub async fn upload(&self, chunk: &ChunkRecord, lines: &[serde_json::Value]) -> Result<String, BatchApiError> {
        let BatchClient::OpenAi { batches, .. } = self else { unreachable!("only OpenAI uploads") };
        let mut jsonl = Vec::new();
        for line in lines {
            jsonl.extend(line.to_string().into_bytes());
            jsonl.push(b'\n');
        }
        batches.upload(&format!("{}.jsonl", chunk.chunk_id), jsonl).await
    }

    /// Creates the chunk's batch: OpenAI from its uploaded file, with the chunk's id in
    /// the metadata; Anthropic with the requests inline. The batch id.
    pub async fn create(&self, chunk: &ChunkRecord, lines: &[serde_json::Value]) -> Result<String, BatchApiError> {
        match self {
            BatchClient::OpenAi { batches, .. } => {
                let file = chunk.file_id.as_deref().expect("an OpenAI chunk is created from its upload");
                let metadata = BTreeMap::from([(CHUNK_KEY.to_string(), chunk.chunk_id.clone())]);
                Ok(batches.create(file, &metadata).await?.id)
            }
            BatchClient::Anthropic { batches, .. } => Ok(batches.create(lines).await?.id),
        }
    }

    /// A batch the chunk may have created before a crash kept its id, adopted only on
    /// proof that it is the chunk's. OpenAI: the one whose metadata names the chunk.
    /// Anthropic (no metadata): among the batches listed before the newest at the intent,
    /// with as many requests as the chunk, that no known chunk names, the one whose
    /// results — once it has ended — carry exactly the chunk's custom ids (its items' job
    /// ids, which no other application uses). A candidate still running cannot be told
    /// yet: `Found::Unproven`, and the chunk waits (no second create) until it ends. An
    /// ended candidate's results are read once, for their custom ids; one shown not the
    /// chunk's joins `not_ours` and is looked at no more. A batch not proven the chunk's
    /// is never polled, applied or cancelled.
    pub async fn find(
        &self,
        chunk: &ChunkRecord,
        known: &HashSet<String>,
        not_ours: &mut HashSet<String>,
    ) -> Result<Found, BatchApiError> {
        match self {
            BatchClient::OpenAi { batches, .. } => Ok(batches
                .find(CHUNK_KEY, &chunk.chunk_id, FIND_PAGES)
                .await?
                .map_or(Found::None, |b| Found::Ours(b.id))),
            BatchClient::Anthropic { batches, .. } => {
                let mut candidates = Vec::new();
                let mut after: Option<String> = None;
                'pages: for _ in 0..FIND_PAGES {
                    let (page, more) = batches.list(after.as_deref(), 100).await?;
                    for b in &page {
                        if Some(&b.id) == chunk.newest_before.as_ref() {
                            break 'pages;
                        }
                        let requests = b.processing + b.succeeded + b.errored + b.canceled + b.expired;
                        let unknown = !known.contains(&b.id) && !not_ours.contains(&b.id);
                        if unknown && requests == chunk.job_ids.len() as u64 {
                            candidates.push(b.clone());
                        }
                    }
                    match page.last() {
                        Some(last) if more => after = Some(last.id.clone()),
                        _ => break,
                    }
                }
                let mine: HashSet<&str> = chunk.job_ids.iter().map(String::as_str).collect();
                let mut unproven = false;
                for b in candidates {
                    if batch::step(&b.status) == batch::BatchStep::Poll {
                        unproven = true;
                        continue;
                    }
                    let ids: HashSet<String> = batches.lines(&b).await?.into_iter().map(|(id, _)| id).collect();
                    if ids.len() == mine.len() && ids.iter().all(|id| mine.contains(id.as_str())) {
                        return Ok(Found::Ours(b.id));
                    }
                    not_ours.insert(b.id);
                }
                Ok(if unproven { Found::Unproven } else { Found::None })
            }
        }
    }

    pub async fn get(&self, batch_id: &str) -> Result<Polled, BatchApiError> {
        Ok(match self {
            BatchClient::OpenAi { batches, .. } => polled_openai(batches.get(batch_id).await?),
            BatchClient::Anthropic { batches, .. } => polled_anthropic(batches.get(batch_id).await?),
        })
    }

    pub async fn cancel(&self, batch_id: &str) -> Result<(), BatchApiError> {
        match self {
            BatchClient::OpenAi { batches, .. } => batches.cancel(batch_id).await.map(drop),
            BatchClient::Anthropic { batches, .. } => batches.cancel(batch_id).await.map(drop),
        }
    }

    /// Every result line of an ended batch: (custom id, what it says), in any order.
    pub async fn lines(&self, polled: &Polled) -> Result<Vec<(String, LineResult)>, BatchApiError> {
        match (self, &polled.raw) {
            (BatchClient::OpenAi { batches, .. }, Raw::OpenAi(info)) => batches.lines(info).await,
            (BatchClient::Anthropic { batches, .. }, Raw::Anthropic(batch)) => batches.lines(batch).await,
            _ => unreachable!("a batch is polled by its own provider's client"),
        }
    }
}

fn polled_openai(info: BatchInfo) -> Polled {
    Polled { status: info.status.clone(), succeeded: info.completed, failed: info.failed, raw: Raw::OpenAi(info) }
}

fn polled_anthropic(batch: MessageBatch) -> Polled {
    let failed = batch.errored + batch.canceled + batch.expired;
    Polled { status: batch.status.clone(), succeeded: batch.succeeded, failed, raw: Raw::Anthropic(batch) }
}
