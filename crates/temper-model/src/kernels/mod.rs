//! CPU kernels with their own backward, for what candle's composed ops do
//! too slowly or with too much memory.

mod lm_head;

pub use lm_head::{for_each_logprob_row, fused_lm_head_supported, lm_head_logprobs, ROW_BLOCK};
