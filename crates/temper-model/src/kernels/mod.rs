//! CPU kernels with their own backward, for what candle's composed ops do
//! too slowly or with too much memory.

use candle_core::{CpuStorage, Layout};

mod attention;
mod lm_head;
mod matmul;
mod matmul_bf16;
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

pub use matmul_bf16::{bf16_dot_available, PackedBf16};

pub use matmul_nn::{matmul_nn, matmul_nn_isa};

pub use rms_norm::{fused_rms_norm_supported, rms_norm};

pub use swiglu::{fused_swiglu_supported, swiglu};

pub use matmul::{
    forward_matmul, linear_nt, matmul_nt, matmul_nt_packed, matmul_nt_supported,
    set_forward_matmul, use_matmul_nt, ForwardMatmul,
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

/// A weight matrix's rows in the dtype they are stored in.
#[derive(Clone, Copy)]
pub(crate) enum WeightRows<'a> {
    F32(&'a [f32]),
    /// Raw bf16 bits.
    Bf16(&'a [u16]),
}

impl WeightRows<'_> {
    /// Elements held.
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::F32(w) => w.len(),
            Self::Bf16(w) => w.len(),
        }
    }
}

/// An op's contiguous f32 or bf16 weight; errors name the op.
fn weight_rows<'a>(op: &str, s: &'a CpuStorage, l: &Layout) -> candle_core::Result<WeightRows<'a>> {
    use half::slice::HalfFloatSliceExt;
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: non-contiguous weight")))?;
    match s {
        CpuStorage::F32(v) => Ok(WeightRows::F32(&v[a..b])),
        CpuStorage::BF16(v) => Ok(WeightRows::Bf16(v[a..b].reinterpret_cast())),
        _ => Err(candle_core::Error::Msg(format!(
            "{op}: the weight must be f32 or bf16"
        ))),
    }
}
