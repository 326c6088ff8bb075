//! The API's protobuf codec: prost's, except that a request that does not decode is
//! the caller's error. A `string` field holding bytes that are not UTF-8 (the usual
//! case: a diff in a legacy encoding sent as `diff`) is `INVALID_ARGUMENT` pointing to
//! the `bytes` form; any other malformed message is `INVALID_ARGUMENT` too, where
//! prost's codec answers `INTERNAL`, which tells a caller the server is at fault.
//!
//! prost's error names the message and field that failed, never their bytes, so it is
//! safe to return.

use std::marker::PhantomData;

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstEncoder};

#[derive(Debug, Clone)]
pub struct ApiCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for ApiCodec<T, U> {
    fn default() -> Self {
        ApiCodec(PhantomData)
    }
}

impl<T, U> Codec for ApiCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ApiDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::default().encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        ApiDecoder(PhantomData)
    }
}

#[derive(Debug, Clone)]
pub struct ApiDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for ApiDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf).map(Some).map_err(|e| decode_status(&e))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

/// The status for a message that does not decode (with `ErrorInfo` reason
/// `MALFORMED_REQUEST`).
pub fn decode_status(e: &prost::DecodeError) -> Status {
    use tonic_types::{ErrorDetails, StatusExt};
    let what = e.to_string();
    // prost's error names the field only in its text: the hint is for `diff` alone.
    let message = if what.contains("SubmitReviewRequest.diff: invalid string value") {
        format!("{what}; a diff that is not UTF-8 goes in `diff_bytes`, exactly as git produced it")
    } else {
        what
    };
    let details = ErrorDetails::with_error_info(
        crate::Reason::MalformedRequest.as_str(),
        crate::ERROR_DOMAIN,
        std::collections::HashMap::new(),
    );
    Status::with_error_details(tonic::Code::InvalidArgument, message, details)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::SubmitReviewRequest;

    /// Field 3 (`diff`, a string) holding the bytes `0xff 0xfe`.
    fn non_utf8_diff() -> Vec<u8> {
        vec![0x1a, 0x02, 0xff, 0xfe]
    }

    #[test]
    fn non_utf8_string_field_is_invalid_argument_pointing_to_the_bytes_form() {
        let e = SubmitReviewRequest::decode(non_utf8_diff().as_slice()).unwrap_err();
        let s = decode_status(&e);
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert!(s.message().contains("diff_bytes"), "{}", s.message());
        assert!(s.message().contains("SubmitReviewRequest.diff"), "{}", s.message());
    }

    #[test]
    fn the_bytes_hint_is_for_the_diff_alone() {
        // Field 1 (`idempotency_key`) and field 5 (`metadata`) with `repository`
        // (field 1) holding 0xff.
        for raw in [vec![0x0a, 0x01, 0xff], vec![0x2a, 0x03, 0x0a, 0x01, 0xff]] {
            let e = SubmitReviewRequest::decode(raw.as_slice()).unwrap_err();
            let s = decode_status(&e);
            assert_eq!(s.code(), tonic::Code::InvalidArgument);
            assert!(!s.message().contains("diff_bytes"), "{}", s.message());
            assert!(s.message().contains("invalid string value"), "{}", s.message());
        }
    }

    #[test]
    fn truncated_message_is_invalid_argument() {
        // Field 3 announcing 9 bytes with 1 present.
        let e = SubmitReviewRequest::decode([0x1a, 0x09, b'x'].as_slice()).unwrap_err();
        assert_eq!(decode_status(&e).code(), tonic::Code::InvalidArgument);
    }
}
