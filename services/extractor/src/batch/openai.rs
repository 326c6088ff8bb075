//! OpenAI's Batch API: the input file uploaded to `/v1/files` (purpose `batch`, one
//! request line each: `OpenAiProvider::batch_line`), the batch created on
//! `/v1/batches` with the chunk's id in its metadata, polled, cancelled, listed (to find
//! a batch a crash may have created: the one whose metadata names the chunk), and its
//! output and error files read back line by line (`lines::openai`). An answer of these
//! endpoints is classified as any provider answer is: a 429 with its hint, a 5xx or
//! timeout transient, any other 4xx refused.
//!
//! Azure OpenAI's global batch is the same API under the resource's `/openai` with its
//! `api-version` on every request (`OpenAiBatches::azure`): lines name the global batch
//! deployment and `/chat/completions`, the batch is created for `/chat/completions`
//! without metadata, and a batch a crash may have created is the one made from the
//! chunk's input file (uploaded by this chunk alone, its id recorded before the create).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use reviewlane_core::batch::{BatchLimits, BatchStatus, ChunkRecord, LineResult};
use reviewlane_shared::Region;
use secrecy::SecretString;

use super::{BatchApi, FIND_PAGES, Found, Polled, Sent};
use crate::provider::ProviderRequest;
use crate::provider::openai::OpenAiProvider;

/// The metadata key naming a chunk on the OpenAI batch it created.
pub const CHUNK_KEY: &str = "reviewlane_chunk";

/// A batch as the API reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchInfo {
    pub id: String,
    pub status: BatchStatus,
    pub input_file_id: String,
    /// `None` until the batch ends, and when no line succeeded.
    pub output_file_id: Option<String>,
    /// `None` when no line failed (the API sends `""` or null).
    pub error_file_id: Option<String>,
    pub total: u64,
    pub completed: u64,
    pub failed: u64,
    pub created_at: u64,
    pub metadata: BTreeMap<String, String>,
}

impl BatchInfo {
    /// Reads a batch object; `None` when it is not one (or its status is unknown).
    pub fn from_json(v: &serde_json::Value) -> Option<BatchInfo> {
        let errors: Vec<(String, Option<u32>)> = v["errors"]["data"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| {
                let code = e["code"].as_str().unwrap_or_default().to_string();
                (code, e["line"].as_u64().and_then(|l| u32::try_from(l).ok()))
            })
            .collect();
        let file = |key: &str| v[key].as_str().filter(|id| !id.is_empty()).map(str::to_string);
        let counts = &v["request_counts"];
        Some(BatchInfo {
            id: v["id"].as_str()?.to_string(),
            status: BatchStatus::openai(v["status"].as_str()?, &errors)?,
            input_file_id: v["input_file_id"].as_str().unwrap_or_default().to_string(),
            output_file_id: file("output_file_id"),
            error_file_id: file("error_file_id"),
            total: counts["total"].as_u64().unwrap_or(0),
            completed: counts["completed"].as_u64().unwrap_or(0),
            failed: counts["failed"].as_u64().unwrap_or(0),
            created_at: v["created_at"].as_u64().unwrap_or(0),
            metadata: v["metadata"]
                .as_object()
                .into_iter()
                .flatten()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
                .collect(),
        })
    }
}

pub use super::BatchApiError;

pub struct OpenAiBatches {
    http: reqwest::Client,
    base: String,
    auth: crate::provider::Auth,
    /// Azure: the `api-version` every request carries.
    api_version: Option<String>,
    region: Region,
    hint_ceiling: Duration,
    /// Builds the request lines.
    adapter: Arc<OpenAiProvider>,
}

impl OpenAiBatches {
    /// The Batch API under `base_url` (the same as the chat completions', e.g.
    /// `https://api.openai.com/v1`), in `region`, its lines built by `adapter`.
    pub fn new(
        base_url: &str,
        api_key: Option<SecretString>,
        region: Region,
        (timeout, hint_ceiling): (Duration, Duration),
        adapter: Arc<OpenAiProvider>,
    ) -> Self {
        OpenAiBatches {
            http: crate::provider::http_client(timeout),
            base: base_url.trim_end_matches('/').to_string(),
            auth: api_key.map_or(crate::provider::Auth::None, crate::provider::Auth::Bearer),
            api_version: None,
            region,
            hint_ceiling,
            adapter,
        }
    }

    /// An Azure OpenAI resource's global batch API (`d.batch_deployment` names the
    /// deployment the lines go to; `adapter` writes them).
    pub fn azure(
        d: &crate::config::AzureDeployment,
        (timeout, hint_ceiling): (Duration, Duration),
        adapter: Arc<OpenAiProvider>,
    ) -> Self {
        OpenAiBatches {
            http: crate::provider::http_client(timeout),
            base: format!("{}/openai", d.endpoint.trim_end_matches('/')),
            auth: crate::provider::Auth::azure(&d.auth),
            api_version: Some(d.api_version.clone()),
            region: d.endpoint_region,
            hint_ceiling,
            adapter,
        }
    }

    /// A request to `path` under the API's base (with Azure's `api-version`).
    fn at(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let rb = self.http.request(method, format!("{}{path}", self.base));
        match &self.api_version {
            Some(v) => rb.query(&[("api-version", v)]),
            None => rb,
        }
    }

    /// Sends with the credential and classifies; the body of a 2xx.
    async fn send(&self, rb: reqwest::RequestBuilder) -> Result<bytes::Bytes, BatchApiError> {
        let rb = self.auth.apply(rb).await.map_err(|_| BatchApiError::Transient("credential"))?;
        super::send(rb, self.hint_ceiling).await
    }

    async fn json(&self, rb: reqwest::RequestBuilder) -> Result<serde_json::Value, BatchApiError> {
        let body = self.send(rb).await?;
        serde_json::from_slice(&body).map_err(|_| BatchApiError::Unreadable)
    }

    async fn batch(&self, rb: reqwest::RequestBuilder) -> Result<BatchInfo, BatchApiError> {
        BatchInfo::from_json(&self.json(rb).await?).ok_or(BatchApiError::Unreadable)
    }

    /// Uploads a batch input file under `file_name` (deterministic per chunk, so a
    /// coordinator that crashed can tell its own upload); its file id.
    pub async fn upload(&self, file_name: &str, jsonl: Vec<u8>) -> Result<String, BatchApiError> {
        let part = reqwest::multipart::Part::bytes(jsonl)
            .file_name(file_name.to_string())
            .mime_str("application/jsonl")
            .map_err(|_| BatchApiError::Unreadable)?;
        let form = reqwest::multipart::Form::new().text("purpose", "batch").part("file", part);
        let v = self.json(self.at(reqwest::Method::POST, "/files").multipart(form)).await?;
        v["id"].as_str().map(str::to_string).ok_or(BatchApiError::Unreadable)
    }

    /// Creates a batch of the uploaded file's requests, within 24 h, with `metadata`.
    pub async fn create(
        &self,
        input_file_id: &str,
        metadata: &BTreeMap<String, String>,
    ) -> Result<BatchInfo, BatchApiError> {
        let body = match self.api_version {
            None => serde_json::json!({
                "input_file_id": input_file_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "metadata": metadata,
            }),
            // Azure: no metadata (its batches are found by their input file).
            Some(_) => serde_json::json!({
                "input_file_id": input_file_id,
                "endpoint": "/chat/completions",
                "completion_window": "24h",
            }),
        };
        self.batch(self.at(reqwest::Method::POST, "/batches").json(&body)).await
    }

    pub async fn retrieve(&self, batch_id: &str) -> Result<BatchInfo, BatchApiError> {
        self.batch(self.at(reqwest::Method::GET, &format!("/batches/{batch_id}"))).await
    }

    /// A page of batches, newest first, after `after` (a batch id); and whether more
    /// follow.
    pub async fn list(&self, after: Option<&str>, limit: u32) -> Result<(Vec<BatchInfo>, bool), BatchApiError> {
        let mut query = vec![("limit", limit.to_string())];
        if let Some(a) = after {
            query.push(("after", a.to_string()));
        }
        let v = self.json(self.at(reqwest::Method::GET, "/batches").query(&query)).await?;
        let page = v["data"].as_array().into_iter().flatten().filter_map(BatchInfo::from_json).collect();
        Ok((page, v["has_more"].as_bool().unwrap_or(false)))
    }

    /// The first batch, newest first within the last `pages` pages, whose metadata has
    /// `key` = `value`: a batch a coordinator may have created before it could record
    /// the id.
    pub async fn find_by_metadata(
        &self,
        key: &str,
        value: &str,
        pages: u32,
    ) -> Result<Option<BatchInfo>, BatchApiError> {
        self.find_where(pages, |b| b.metadata.get(key).is_some_and(|v| v == value)).await
    }

    /// The first batch, newest first within the last `pages` pages, that `ours` picks.
    async fn find_where(
        &self,
        pages: u32,
        ours: impl Fn(&BatchInfo) -> bool,
    ) -> Result<Option<BatchInfo>, BatchApiError> {
        let mut after: Option<String> = None;
        for _ in 0..pages {
            let (page, more) = self.list(after.as_deref(), 100).await?;
            if let Some(found) = page.iter().find(|b| ours(b)) {
                return Ok(Some(found.clone()));
            }
            match page.last() {
                Some(last) if more => after = Some(last.id.clone()),
                _ => return Ok(None),
            }
        }
        Ok(None)
    }

    pub async fn cancel_batch(&self, batch_id: &str) -> Result<BatchInfo, BatchApiError> {
        self.batch(self.at(reqwest::Method::POST, &format!("/batches/{batch_id}/cancel"))).await
    }

    /// Every result line of an ended batch, from its output and error files (either
    /// may be absent), in the order read.
    pub async fn lines(&self, info: &BatchInfo) -> Result<Vec<(String, LineResult)>, BatchApiError> {
        let files: Vec<String> = [&info.output_file_id, &info.error_file_id].into_iter().flatten().cloned().collect();
        self.read_results(&files).await
    }

    /// The lines of result files (output and error files), in the order read.
    /// Unreadable lines name no item and are left out (their items count as missing).
    async fn read_results(&self, files: &[String]) -> Result<Vec<(String, LineResult)>, BatchApiError> {
        let mut out = Vec::new();
        for file in files {
            let body = self.send(self.at(reqwest::Method::GET, &format!("/files/{file}/content"))).await?;
            let read = if self.api_version.is_some() { super::lines::azure } else { super::lines::openai };
            out.extend(body.split(|b| *b == b'\n').filter(|l| !l.is_empty()).filter_map(read));
        }
        Ok(out)
    }
}

#[async_trait::async_trait]
impl BatchApi for OpenAiBatches {
    fn provider(&self) -> &'static str {
        if self.api_version.is_some() { "azure" } else { "openai" }
    }

    fn region(&self) -> Region {
        self.region
    }

    fn limits(&self) -> BatchLimits {
        if self.api_version.is_some() { BatchLimits::AZURE } else { BatchLimits::OPENAI }
    }

    fn line(&self, custom_id: &str, req: &ProviderRequest<'_>) -> serde_json::Value {
        self.adapter.batch_line(custom_id, req)
    }

    /// Uploads the chunk's input file under its id, then (once the file id is recorded)
    /// creates the batch from it with the chunk's id in the metadata.
    async fn send(&self, chunk: &ChunkRecord, lines: &[serde_json::Value]) -> Result<Sent, BatchApiError> {
        match &chunk.file_id {
            None => {
                let mut jsonl = Vec::new();
                for line in lines {
                    jsonl.extend(line.to_string().into_bytes());
                    jsonl.push(b'\n');
                }
                let file_id = self.upload(&format!("{}.jsonl", chunk.chunk_id), jsonl).await?;
                Ok(Sent::Uploaded { file_id })
            }
            Some(file) => {
                let metadata = BTreeMap::from([(CHUNK_KEY.to_string(), chunk.chunk_id.clone())]);
                Ok(Sent::Created { batch_id: self.create(file, &metadata).await?.id })
            }
        }
    }

    /// The batch whose metadata names the chunk (on Azure, made from the chunk's input
    /// file): no other application's can.
    async fn find(
        &self,
        chunk: &ChunkRecord,
        _known: &HashSet<String>,
        _not_ours: &mut HashSet<String>,
    ) -> Result<Found, BatchApiError> {
        let found = match (&self.api_version, &chunk.file_id) {
            (None, _) => self.find_by_metadata(CHUNK_KEY, &chunk.chunk_id, FIND_PAGES).await?,
            (Some(_), Some(file)) => self.find_where(FIND_PAGES, |b| b.input_file_id == *file).await?,
            // Nothing uploaded: no batch can have been made from it.
            (Some(_), None) => None,
        };
        Ok(found.map_or(Found::None, |b| Found::Ours(b.id)))
    }

    async fn get(&self, batch_id: &str) -> Result<Polled, BatchApiError> {
        let info = self.retrieve(batch_id).await?;
        Ok(Polled {
            status: info.status,
            succeeded: info.completed,
            failed: info.failed,
            results: [info.output_file_id, info.error_file_id].into_iter().flatten().collect(),
        })
    }

    async fn cancel(&self, batch_id: &str) -> Result<(), BatchApiError> {
        self.cancel_batch(batch_id).await.map(drop)
    }

    async fn results(&self, polled: &Polled) -> Result<Vec<(String, LineResult)>, BatchApiError> {
        self.read_results(&polled.results).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reviewlane_core::batch::BatchFailure;

    #[test]
    fn a_batch_object_is_read_with_its_absent_files_as_none() {
        let v = serde_json::json!({
            "id": "batch_1", "status": "completed", "input_file_id": "file-in",
            "output_file_id": null, "error_file_id": "",
            "request_counts": {"total": 3, "completed": 0, "failed": 3},
            "created_at": 17, "metadata": {"reviewlane_chunk": "c1", "n": 3},
        });
        let b = BatchInfo::from_json(&v).unwrap();
        assert_eq!((b.status, b.output_file_id, b.error_file_id), (BatchStatus::Ended, None, None));
        assert_eq!((b.total, b.completed, b.failed, b.created_at), (3, 0, 3, 17));
        assert_eq!(b.metadata.get("reviewlane_chunk").map(String::as_str), Some("c1"));
        assert!(!b.metadata.contains_key("n"), "only string metadata");
        let failed = serde_json::json!({
            "id": "batch_2", "status": "failed",
            "errors": {"data": [{"code": "invalid_request", "line": 4}, {"code": "invalid_request", "line": 1}]},
        });
        let b = BatchInfo::from_json(&failed).unwrap();
        assert_eq!(b.status, BatchStatus::Failed(BatchFailure::InvalidInput { lines: vec![1, 4] }));
        assert_eq!(BatchInfo::from_json(&serde_json::json!({"id": "b", "status": "unheard_of"})), None);
        assert_eq!(BatchInfo::from_json(&serde_json::json!({"status": "completed"})), None);
    }
}
