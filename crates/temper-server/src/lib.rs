//! temper's HTTP services: the OpenAI-compatible inference server
//! ([`openai`]: chat, completions, token-in/token-out, logprobs, streaming,
//! tools, LoRA hot-swap) on a continuous-batching [`scheduler`], and the
//! training API ([`training_api`]), wire-compatible with the official
//! `tinker` Python SDK, over the in-process [`temper_engine::Engine`].
//!
//! `fn app(state) -> Router` builds each service so tests drive it with
//! `tower::ServiceExt::oneshot`, no network needed. The key design choice:
//! one engine thread owns the model and batches every request's decode step
//! (the [`scheduler`]); HTTP handlers only parse, queue and stream.
//!
//! ```
//! use std::sync::Arc;
//! use axum::body::Body;
//! use axum::http::{Request, StatusCode};
//! use temper_model::{LoadOptions, Pretrained};
//! use temper_server::openai::{app, OpenAiState, ServeConfig};
//! use tower::ServiceExt;
//!
//! let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-qwen3");
//! let model = Arc::new(Pretrained::load(&dir, &LoadOptions::default())?);
//! let cfg = ServeConfig::defaults("tiny", &model);
//! let status = tokio::runtime::Runtime::new()?.block_on(async {
//!     let router = app(OpenAiState::new(model, cfg));
//!     let req = Request::get("/v1/models").body(Body::empty())?;
//!     Ok::<_, Box<dyn std::error::Error>>(router.oneshot(req).await?.status())
//! })?;
//! assert_eq!(status, StatusCode::OK);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

mod error;
pub mod http;
pub mod metrics;
pub mod openai;
pub mod scheduler;
pub mod structured;
pub mod training_api;

pub use error::ApiError;
