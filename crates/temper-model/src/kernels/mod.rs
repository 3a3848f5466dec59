//! CPU kernels with their own backward, for what candle's composed ops do
//! too slowly or with too much memory.

use candle_core::{CpuStorage, Layout};

mod attention;
mod lm_head;
mod matmul;
mod matmul_nn;
mod rms_norm;
mod swiglu;
#[cfg(test)]
mod test_util;

pub use attention::{causal_attention, fused_attention_supported, KEY_BLOCK};

pub use lm_head::{
    for_each_logprob_row, fused_lm_head_supported, lm_head_logprobs, row_log_softmax, row_logprob,
    ROW_BLOCK,
};

pub use matmul_nn::{matmul_nn, matmul_nn_isa};

pub use rms_norm::{fused_rms_norm_supported, rms_norm};

pub use swiglu::{fused_swiglu_supported, swiglu};

pub use matmul::{
    forward_matmul, linear_nt, matmul_nt, matmul_nt_supported, set_forward_matmul, use_matmul_nt,
    ForwardMatmul,
};

/// An op's contiguous f32 input as a slice; errors name the op and input.
fn f32_slice<'a>(
    op: &str,
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<&'a [f32]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: non-contiguous {what}")))?;
    match s {
        CpuStorage::F32(v) => Ok(&v[a..b]),
        _ => Err(candle_core::Error::Msg(format!("{op}: {what} must be f32"))),
    }
}
