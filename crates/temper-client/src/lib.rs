//! Client side of temper's training API — the tinker wire protocol.
//!
//! [`RemoteTrainer`] implements [`temper_engine::Trainer`] over HTTP, so a
//! training loop written against the trait runs unchanged on the in-process
//! engine or on a `temper api serve` (or another tinker-compatible service)
//! elsewhere. It speaks the protocol as the tinker SDK ([`SDK_VERSION`])
//! does — auth header and JWT exchange, session heartbeat, future polling,
//! retries, request chunking — and `tests/python/test_tinker_client.py`
//! checks every request it sends against the SDK's own types. The
//! protocol's messages are `temper-api`'s, shared with the server.
//!
//! ```no_run
//! # async fn demo() -> Result<(), temper_engine::EngineError> {
//! use temper_client::RemoteTrainer;
//! use temper_engine::{AdamParams, Trainer};
//! let t = RemoteTrainer::connect("http://127.0.0.1:8000", "tml-local", "tiny", 8, None).await?;
//! let stats = t.optim_step(AdamParams::default()).await;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod conn;
mod remote;

pub use conn::SDK_VERSION;
pub use remote::RemoteTrainer;
