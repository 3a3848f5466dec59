//! temper's HTTP services. Today: the training API ([`training_api`]),
//! wire-compatible with the official `tinker` Python SDK, over the in-process
//! [`temper_engine::Engine`]. `fn app(state) -> Router` builds each service so
//! tests drive it with `tower::ServiceExt::oneshot`, no network needed.
#![deny(missing_docs)]

mod error;
pub mod training_api;

pub use error::ApiError;
pub use temper_client::proto;
