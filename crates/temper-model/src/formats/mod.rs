//! File formats: GGUF (and its tokenizer, converted both ways),
//! safetensors checkpoints, and export to a Hugging Face directory or GGUF.

pub(crate) mod export;
pub(crate) mod gguf;
pub(crate) mod gguf_tokenizer;
pub(crate) mod weights;
