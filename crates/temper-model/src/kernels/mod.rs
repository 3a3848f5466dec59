//! CPU kernels with their own backward, for what candle's composed ops do
//! too slowly or with too much memory.

mod attention;
mod lm_head;
mod matmul;

pub use attention::{causal_attention, fused_attention_supported, KEY_BLOCK};

pub use lm_head::{for_each_logprob_row, fused_lm_head_supported, lm_head_logprobs, ROW_BLOCK};

pub use matmul::{linear_nt, matmul_nt, matmul_nt_supported};
