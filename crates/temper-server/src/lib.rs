//! temper's HTTP services: the OpenAI-compatible inference server
//! ([`openai`]: chat, completions, token-in/token-out, logprobs, streaming,
//! tools, LoRA hot-swap) on a continuous-batching [`scheduler`], and the
//! training API ([`training_api`]), wire-compatible with the official
//! `tinker` Python SDK, over the in-process [`temper_engine::Engine`].
//!
//! `fn app(state) -> Router` builds each service so tests drive it with
//! `tower::ServiceExt::oneshot`, no network needed.
#![deny(missing_docs)]

mod error;
pub mod http;
pub mod metrics;
pub mod openai;
pub mod scheduler;
pub mod training_api;

pub use error::ApiError;
pub use temper_client::proto;
