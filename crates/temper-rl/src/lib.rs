//! RL and SFT training loops.
//!
//! - [`preset`]: a tiny Llama-architecture model with a built-in
//!   character-level tokenizer and ChatML template, written as a real Hugging
//!   Face directory (so it loads through the same code as any checkpoint).
//! - [`sft`]: supervised fine-tuning on chat data, loss on assistant tokens.

pub mod config;
pub mod error;
pub mod policy;
pub mod preset;
pub mod quickstart;
pub mod rl;
pub mod runlog;
pub mod sft;

pub use error::{Result, RlError};
