//! Integration tests of temper-model, one module per topic.

mod common;
mod decode;
mod export;
mod gguf_tokenizers;
mod golden;
mod invariance;
mod loading;
mod quantized;
mod sampling;
mod smollm2;
mod top_logprobs;
mod training;
