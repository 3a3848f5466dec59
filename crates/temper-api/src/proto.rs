//! The protobuf messages of the tinker wire protocol (package
//! `tinker_public`), written out by hand with `prost` derives so no `protoc`
//! is needed. Field numbers follow `docs/tinker-protocol.md`, Appendix A.
//! Packed numbers travel as little-endian byte strings (`tokens`,
//! `logprobs`, dense tensors); helpers below convert them.

use std::collections::HashMap;

/// Element type of a tensor on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum DType {
    /// Not set.
    Unspecified = 0,
    /// f32 little-endian.
    Float32 = 1,
    /// i64 little-endian.
    Int64 = 2,
    /// i32 little-endian.
    Int32 = 3,
    /// bf16 little-endian.
    Bfloat16 = 4,
}

/// Why a sampled sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum StopReason {
    /// EOS or a stop sequence.
    Stop = 0,
    /// max_tokens.
    Length = 1,
}

/// Body of `POST /api/v1/forward_backward`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ForwardBackwardRequest {
    /// `{session}:train:{n}`.
    #[prost(string, tag = "1")]
    pub model_id: String,
    /// Per-model sequence number.
    #[prost(int32, tag = "2")]
    pub seq_id: i32,
    /// The batch.
    #[prost(message, repeated, tag = "3")]
    pub data: Vec<Datum>,
    /// Loss name.
    #[prost(string, tag = "4")]
    pub loss_fn: String,
    /// Numeric loss config (legacy mirror of v2).
    #[prost(map = "string, double", tag = "5")]
    pub loss_fn_config: HashMap<String, f64>,
    /// `forward` instead of `forward_backward`.
    #[prost(bool, tag = "6")]
    pub forward_only: bool,
    /// Loss config, numbers and strings.
    #[prost(map = "string, message", tag = "7")]
    pub loss_fn_config_v2: HashMap<String, LossConfigValue>,
}

/// A number or a string.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LossConfigValue {
    /// The value.
    #[prost(oneof = "loss_config_value::Value", tags = "1, 2")]
    pub value: Option<loss_config_value::Value>,
}

/// Oneof of [`LossConfigValue`].
pub mod loss_config_value {
    /// A config value.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        /// A number.
        #[prost(double, tag = "1")]
        Number(f64),
        /// A string.
        #[prost(string, tag = "2")]
        Text(String),
    }
}

/// One training example.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Datum {
    /// Input chunks.
    #[prost(message, repeated, tag = "1")]
    pub model_input: Vec<Chunk>,
    /// Loss inputs by name.
    #[prost(map = "string, message", tag = "2")]
    pub loss_fn_inputs: HashMap<String, Tensor>,
}

/// A piece of model input.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Chunk {
    /// The chunk.
    #[prost(oneof = "chunk::Chunk", tags = "1, 2, 3")]
    pub chunk: Option<chunk::Chunk>,
}

/// Oneof of [`Chunk`].
pub mod chunk {
    /// Chunk kinds.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Chunk {
        /// Token ids.
        #[prost(message, tag = "1")]
        EncodedText(super::EncodedTextChunk),
        /// An image (unsupported here).
        #[prost(message, tag = "2")]
        Image(super::OpaqueChunk),
        /// Audio (unsupported here).
        #[prost(message, tag = "3")]
        Dmel(super::OpaqueChunk),
    }
}

/// Token ids as int32 little-endian bytes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EncodedTextChunk {
    /// int32 LE.
    #[prost(bytes = "vec", tag = "1")]
    pub tokens: Vec<u8>,
}

/// A chunk kind we only recognise to reject it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OpaqueChunk {
    /// Payload.
    #[prost(bytes = "vec", tag = "1")]
    pub data: Vec<u8>,
}

/// A tensor: dense little-endian bytes or sparse CSR.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Tensor {
    /// The encoding.
    #[prost(oneof = "tensor::Encoding", tags = "1, 2")]
    pub encoding: Option<tensor::Encoding>,
    /// Element type.
    #[prost(enumeration = "DType", tag = "3")]
    pub dtype: i32,
    /// Shape.
    #[prost(int64, repeated, tag = "4")]
    pub shape: Vec<i64>,
}

/// Oneof of [`Tensor`].
pub mod tensor {
    /// Encodings.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Encoding {
        /// Raw LE bytes of all elements.
        #[prost(bytes = "vec", tag = "1")]
        Dense(Vec<u8>),
        /// Sparse CSR (2-D).
        #[prost(message, tag = "2")]
        SparseCsr(super::SparseCsr),
    }
}

/// CSR layout.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SparseCsr {
    /// Non-zero values.
    #[prost(bytes = "vec", tag = "1")]
    pub values: Vec<u8>,
    /// Row pointers (int64 LE).
    #[prost(bytes = "vec", tag = "2")]
    pub crow_indices: Vec<u8>,
    /// Column indices (int64 LE).
    #[prost(bytes = "vec", tag = "3")]
    pub col_indices: Vec<u8>,
}

/// Per-datum outputs of one field, concatenated.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BatchedTensor {
    /// All datums' elements.
    #[prost(bytes = "vec", tag = "1")]
    pub data: Vec<u8>,
    /// int64 LE byte offsets, `num_datums + 1` entries.
    #[prost(bytes = "vec", tag = "2")]
    pub offsets: Vec<u8>,
    /// Element type.
    #[prost(enumeration = "DType", tag = "3")]
    pub dtype: i32,
    /// Per-element trailing shape (empty for per-token values).
    #[prost(int64, repeated, tag = "4")]
    pub trailing_shape: Vec<i64>,
}

/// Named batched fields.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ArrayRecord {
    /// `ArrayRecord`.
    #[prost(string, tag = "1")]
    pub type_tag: String,
    /// Fields by name.
    #[prost(map = "string, message", tag = "2")]
    pub fields: HashMap<String, BatchedTensor>,
    /// Datums covered.
    #[prost(int64, tag = "3")]
    pub num_datums: i64,
}

/// Result of forward / forward_backward.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ForwardBackwardOutput {
    /// `ArrayRecord`.
    #[prost(string, tag = "1")]
    pub loss_fn_output_type: String,
    /// Outputs.
    #[prost(message, repeated, tag = "2")]
    pub loss_fn_outputs: Vec<ArrayRecord>,
    /// `name:reduction` → value.
    #[prost(map = "string, double", tag = "3")]
    pub metrics: HashMap<String, f64>,
}

/// Result of asample.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SampleResponse {
    /// `num_samples` sequences.
    #[prost(message, repeated, tag = "1")]
    pub sequences: Vec<SampledSequence>,
    /// f32 LE per prompt token, NaN where none (position 0).
    #[prost(bytes = "vec", optional, tag = "2")]
    pub prompt_logprobs: Option<Vec<u8>>,
    /// Prompt tokens served from cache.
    #[prost(int32, tag = "4")]
    pub prompt_cache_hit_tokens: i32,
}

/// One sampled sequence.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SampledSequence {
    /// Why it ended.
    #[prost(enumeration = "StopReason", tag = "1")]
    pub stop_reason: i32,
    /// int32 LE token ids.
    #[prost(bytes = "vec", tag = "2")]
    pub tokens: Vec<u8>,
    /// f32 LE logprobs, one per token.
    #[prost(bytes = "vec", optional, tag = "3")]
    pub logprobs: Option<Vec<u8>>,
}

/// Little-endian packing helpers.
pub mod le {
    /// `u32` ids as int32 LE bytes.
    pub fn i32_bytes(ids: &[u32]) -> Vec<u8> {
        ids.iter().flat_map(|&t| (t as i32).to_le_bytes()).collect()
    }

    /// `f32`s as LE bytes.
    pub fn f32_bytes(xs: &[f32]) -> Vec<u8> {
        xs.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// `i64`s as LE bytes.
    pub fn i64_bytes(xs: &[i64]) -> Vec<u8> {
        xs.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// int32 LE bytes as non-negative ids; `None` if malformed.
    pub fn ids_from_i32(b: &[u8]) -> Option<Vec<u32>> {
        if !b.len().is_multiple_of(4) {
            return None;
        }
        b.chunks_exact(4)
            .map(|c| {
                let v = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                u32::try_from(v).ok()
            })
            .collect()
    }

    /// f32 LE bytes; `None` if malformed.
    pub fn f32_from(b: &[u8]) -> Option<Vec<f32>> {
        if !b.len().is_multiple_of(4) {
            return None;
        }
        Some(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    }

    /// i64 LE bytes; `None` if malformed.
    pub fn i64_from(b: &[u8]) -> Option<Vec<i64>> {
        if !b.len().is_multiple_of(8) {
            return None;
        }
        Some(
            b.chunks_exact(8)
                .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect()
    }

    /// Appendix B.1: bytes the tinker SDK sends for one cross-entropy datum.
    #[test]
    fn decodes_the_sdks_forward_backward_request() {
        let b = hex("0a10736573732d6162633a747261696e3a3010011a640a100a0e0a0c010000000200000003000000121e0a077765696768747312130a0c000000000000803f0000803f180122010312300a0d7461726765745f746f6b656e73121f0a180200000000000000030000000000000004000000000000001802220103220d63726f73735f656e74726f7079");
        let r = ForwardBackwardRequest::decode(b.as_slice()).expect("decodes");
        assert_eq!(r.model_id, "sess-abc:train:0");
        assert_eq!(r.seq_id, 1);
        assert_eq!(r.loss_fn, "cross_entropy");
        assert!(!r.forward_only);
        let d = &r.data[0];
        match &d.model_input[0].chunk {
            Some(chunk::Chunk::EncodedText(t)) => {
                assert_eq!(le::ids_from_i32(&t.tokens), Some(vec![1, 2, 3]))
            }
            other => panic!("{other:?}"),
        }
        let tt = &d.loss_fn_inputs["target_tokens"];
        assert_eq!(tt.dtype, DType::Int64 as i32);
        assert_eq!(tt.shape, vec![3]);
        match &tt.encoding {
            Some(tensor::Encoding::Dense(b)) => assert_eq!(le::i64_from(b), Some(vec![2, 3, 4])),
            other => panic!("{other:?}"),
        }
        let w = &d.loss_fn_inputs["weights"];
        match &w.encoding {
            Some(tensor::Encoding::Dense(b)) => {
                assert_eq!(le::f32_from(b), Some(vec![0.0, 1.0, 1.0]))
            }
            other => panic!("{other:?}"),
        }
    }

    /// Appendix B.3: a SampleResponse the SDK decodes.
    #[test]
    fn encodes_a_sample_response_like_the_sdk() {
        let r = SampleResponse {
            sequences: vec![SampledSequence {
                stop_reason: StopReason::Stop as i32,
                tokens: le::i32_bytes(&[7, 8, 151645]),
                logprobs: Some(le::f32_bytes(&[-0.1, -0.2, -0.3])),
            }],
            prompt_logprobs: None,
            prompt_cache_hit_tokens: 0,
        };
        assert_eq!(
            r.encode_to_vec(),
            hex("0a1c120c07000000080000005d5002001a0ccdccccbdcdcc4cbe9a9999be")
        );
        // B.4: compute_logprobs, with NaN at position 0.
        let r = SampleResponse {
            sequences: vec![SampledSequence {
                stop_reason: StopReason::Length as i32,
                tokens: le::i32_bytes(&[9]),
                logprobs: None,
            }],
            prompt_logprobs: Some(le::f32_bytes(&[f32::from_bits(0x7fc00000), -2.5, -0.75])),
            prompt_cache_hit_tokens: 0,
        };
        assert_eq!(
            r.encode_to_vec(),
            hex("0a080801120409000000120c0000c07f000020c0000040bf")
        );
    }

    /// Appendix B.2: a ForwardBackwardOutput the SDK decodes.
    #[test]
    fn encodes_a_forward_backward_output_like_the_sdk() {
        let mut fields = HashMap::new();
        fields.insert(
            "logprobs".to_string(),
            BatchedTensor {
                data: le::f32_bytes(&[-1.5, -0.25, -0.5]),
                offsets: le::i64_bytes(&[0, 12]),
                dtype: DType::Float32 as i32,
                trailing_shape: vec![],
            },
        );
        let mut metrics = HashMap::new();
        metrics.insert("loss:sum".to_string(), 0.75);
        let out = ForwardBackwardOutput {
            loss_fn_output_type: "ArrayRecord".into(),
            loss_fn_outputs: vec![ArrayRecord {
                type_tag: "ArrayRecord".into(),
                fields,
                num_datums: 1,
            }],
            metrics,
        };
        assert_eq!(
            out.encode_to_vec(),
            hex("0a0b41727261795265636f7264123f0a0b41727261795265636f7264122e0a086c6f6770726f627312220a0c0000c0bf000080be000000bf121000000000000000000c00000000000000180118011a130a086c6f73733a73756d11000000000000e83f")
        );
    }
}
