//! The model family: the decoder (Llama, Qwen2, Qwen3 and their kin), its
//! configuration and rotary embeddings.

pub(crate) mod config;
pub(crate) mod model;
pub(crate) mod rope;
