//! Kept results: the validated result of one lease generation of a job, on
//! `FINDINGS_<R>` (subject per generation, `Nats-Msg-Id` = `<job id>.<generation>`).
//! A result too large for one message goes whole into the region's `FINDINGS_<R>`
//! object store, and the stream carries a small message naming it. Every size is
//! checked before the write, so no write is retried that can never fit. The results of
//! a split review's parts are kept the same way on `PARTS_<R>`.

use async_nats::jetstream::stream::LastRawMessageErrorKind;

use crate::layout::{self, RegionLayout};
use crate::store::StoreError;
use reviewlane_core::messages::FindingsMessage;

/// Room left in a message for headers (ids, trace context).
const HEADER_ROOM: usize = 1024;

#[derive(Clone)]
pub struct Results {
    layout: RegionLayout,
    /// Largest result written inline; larger ones go to the object store.
    inline_max: usize,
}

/// Where a kept result went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    Inline,
    Object,
}

impl Results {
    /// `message_max`: the smaller of the server's `max_payload` and the stream's
    /// maximum message size.
    pub fn new(layout: RegionLayout, message_max: usize) -> Self {
        Results { layout, inline_max: message_max.saturating_sub(HEADER_ROOM) }
    }

    pub fn inline_max(&self) -> usize {
        self.inline_max
    }

    /// Keeps `result` (idempotent per job and generation: a repeat is deduplicated by the
    /// stream, or overwrites the same object).
    pub async fn keep(&self, result: &FindingsMessage, trace: &async_nats::HeaderMap) -> Result<Kept, StoreError> {
        let id = format!("{}.{}", result.job_id, result.generation);
        let subject = layout::findings_subject(result.region, &result.tenant, &result.job_id, result.generation);
        self.put(result, subject, id, trace).await.map(|(kept, _)| kept)
    }

    /// Keeps the result of one part of a split review (`result.part`) on `PARTS_<R>`;
    /// returns where, and its stream sequence (the reference the job record keeps).
    pub async fn keep_part(
        &self,
        result: &FindingsMessage,
        trace: &async_nats::HeaderMap,
    ) -> Result<(Kept, u64), StoreError> {
        let index = result.part.expect("a part result names its part");
        let id = format!("{}.part{index}", result.job_id);
        let subject = layout::parts_subject(result.region, &result.tenant, &result.job_id, index);
        self.put(result, subject, id, trace).await
    }

    async fn put(
        &self,
        result: &FindingsMessage,
        subject: String,
        id: String,
        trace: &async_nats::HeaderMap,
    ) -> Result<(Kept, u64), StoreError> {
        let body = serde_json::to_vec(result).expect("findings serialize");
        let (payload, kept) = if body.len() <= self.inline_max {
            (body, Kept::Inline)
        } else {
            self.layout.objects.put(id.as_str(), &mut body.as_slice()).await.map_err(StoreError::object_put)?;
            let pointer = FindingsMessage {
                findings: Vec::new(),
                quarantined: Vec::new(),
                stored_as: Some(id.clone()),
                ..result.clone()
            };
            (serde_json::to_vec(&pointer).expect("findings serialize"), Kept::Object)
        };
        let mut headers = trace.clone();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
        let ack = self
            .layout
            .js
            .publish_with_headers(subject, headers, payload.into())
            .await
            .map_err(StoreError::publish)?
            .await
            .map_err(StoreError::publish)?;
        Ok((kept, ack.sequence))
    }

    /// The kept result of one part of a job, if any (the newest, should a holder that
    /// lost its lease have kept one too), with its stream sequence.
    pub async fn read_part(
        &self,
        tenant: &str,
        job_id: &str,
        index: u32,
    ) -> Result<Option<(FindingsMessage, u64)>, StoreError> {
        let subject = layout::parts_subject(self.layout.region, tenant, job_id, index);
        match self.parts_stream().await?.get_last_raw_message_by_subject(&subject).await {
            Ok(m) => Ok(Some((self.resolve(&m.payload).await?, m.sequence))),
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(StoreError::other(e)),
        }
    }

    /// A part result by the sequence the job record keeps for it.
    pub async fn read_part_at(&self, seq: u64) -> Result<FindingsMessage, StoreError> {
        let m = self.parts_stream().await?.get_raw_message(seq).await.map_err(StoreError::other)?;
        self.resolve(&m.payload).await
    }

    async fn parts_stream(&self) -> Result<async_nats::jetstream::stream::Stream<()>, StoreError> {
        self.layout.js.get_stream_no_info(layout::parts_stream(self.layout.region)).await.map_err(StoreError::other)
    }

    /// The kept result of one generation of a job, if any.
    pub async fn read(
        &self,
        tenant: &str,
        job_id: &str,
        generation: u32,
    ) -> Result<Option<FindingsMessage>, StoreError> {
        let stream = self
            .layout
            .js
            .get_stream_no_info(layout::findings_stream(self.layout.region))
            .await
            .map_err(StoreError::other)?;
        let subject = layout::findings_subject(self.layout.region, tenant, job_id, generation);
        match stream.get_last_raw_message_by_subject(&subject).await {
            Ok(m) => Ok(Some(self.resolve(&m.payload).await?)),
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(StoreError::other(e)),
        }
    }

    /// A `FINDINGS_<R>` payload as the whole result (fetching it from the object store
    /// when the message only names it).
    pub async fn resolve(&self, payload: &[u8]) -> Result<FindingsMessage, StoreError> {
        let msg: FindingsMessage = serde_json::from_slice(payload).map_err(|_| StoreError::Corrupt)?;
        let Some(name) = msg.stored_as.as_deref() else { return Ok(msg) };
        let mut object = self.layout.objects.get(name).await.map_err(StoreError::object_get)?;
        let mut body = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut object, &mut body).await.map_err(StoreError::other)?;
        serde_json::from_slice(&body).map_err(|_| StoreError::Corrupt)
    }
}

/// The largest message the server and the region's lane streams accept.
pub fn message_max(client: &async_nats::Client, layout: &layout::RegionLayout) -> usize {
    let server = client.server_info().max_payload;
    layout.max_message_bytes.map_or(server, |m| m.min(server))
}
