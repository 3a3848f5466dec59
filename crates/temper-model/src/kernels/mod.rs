//! CPU kernels with their own backward, for what candle's composed ops do
//! too slowly or with too much memory.

use candle_core::{CpuStorage, Layout};

/// Whether to run the AVX2 copies of `twice_compiled!` loops. They are the
/// same Rust code compiled with 256-bit vectors: Rust never fuses a multiply and
/// an add on its own, so each copy performs the same f32 operations in the
/// same order and gives the same bits — only faster.
pub(crate) fn use_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVX2.get_or_init(|| std::arch::is_x86_feature_detected!("avx2"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `$name(args)` dispatching to a baseline or an AVX2 compilation of the
/// same `#[inline(always)]` body `$body`.
macro_rules! twice_compiled {
    ($(#[$doc:meta])* fn $name:ident / $body:ident ($($arg:ident: $ty:ty),*) $(-> $ret:ty)?) => {
        $(#[$doc])*
        #[allow(clippy::too_many_arguments)]
        pub(super) fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                /// # Safety
                /// The CPU must have AVX2.
                #[target_feature(enable = "avx2")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn wide($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if $crate::kernels::use_avx2() {
                    // SAFETY: the CPU has AVX2 (checked at run time).
                    return unsafe { wide($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

mod attention;
mod exp;
mod lm_head;
mod lora_linear;
mod matmul;
mod matmul_bf16;
mod matmul_nn;
mod packed_attention;
mod peak;
mod quant;
#[cfg(target_arch = "x86_64")]
mod quant_avx2;
mod rms_norm;
mod swiglu;
#[cfg(test)]
mod test_util;

pub use attention::{causal_attention, fused_attention_supported, KEY_BLOCK};

pub(crate) use exp::exp_weights;

pub use lm_head::{
    for_each_logprob_row, fused_lm_head_supported, lm_head_logprobs, row_log_softmax, row_logprob,
    HeadKernel, ROW_BLOCK,
};

pub use lora_linear::{lora_linear, lora_linear_quant, lora_linear_supported};

pub use matmul_bf16::{bf16_dot_available, PackedBf16};

pub use matmul_nn::{matmul_nn, matmul_nn_isa};

pub use peak::{peak_gflops, PeakInstr};

pub use quant::{matmul_nt_quant_op, QuantFormat, QuantWeight};

pub use packed_attention::{packed_attention, PackedHeads, PackedSeq, RopeTables};

pub use rms_norm::{fused_rms_norm_supported, rms_norm};

pub use swiglu::{fused_swiglu_supported, swiglu};

pub use matmul::{
    grad_times_packed, linear_nt, matmul_nt, matmul_nt_packed, matmul_nt_supported, use_matmul_nt,
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

/// Run `f` on a CPU f32 tensor's values without copying them (a backward's
/// saved inputs and incoming gradient); a non-contiguous tensor is made
/// contiguous first.
fn with_f32<R>(
    op: &str,
    t: &candle_core::Tensor,
    f: impl FnOnce(&[f32]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    with_f32s(op, [t], |[x]| f(x))
}

/// [`with_f32`] for several tensors at once.
fn with_f32s<R, const N: usize>(
    op: &str,
    ts: [&candle_core::Tensor; N],
    f: impl FnOnce([&[f32]; N]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let ts = ts
        .iter()
        .map(|t| t.contiguous())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let guards: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
    let mut slices = Vec::with_capacity(N);
    for (storage, layout) in &guards {
        let candle_core::Storage::Cpu(cpu) = &**storage else {
            return Err(candle_core::Error::Msg(format!(
                "{op}: tensor not on the CPU"
            )));
        };
        slices.push(f32_slice(op, cpu, layout, "tensor")?);
    }
    let slices: [&[f32]; N] = slices
        .try_into()
        .map_err(|_| candle_core::Error::Msg(format!("{op}: tensor count")))?;
    f(slices)
}

/// `s·Mᵀ` for a row-major `m` `[rows, cols]`: `[cols, ld]` row-major, zero
/// past column `rows` (`ld ≥ rows`). Square tiles keep the strided writes
/// in a few cache lines.
fn transposed(m: &[f32], rows: usize, cols: usize, s: f32, ld: usize) -> Vec<f32> {
    const TILE: usize = 16;
    assert!(ld >= rows && m.len() >= rows * cols);
    let mut t = vec![0f32; cols * ld];
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    t[c * ld + r] = m[r * cols + c] * s;
                }
            }
        }
    }
    t
}

/// A weight matrix's rows in the dtype they are stored in.
#[derive(Clone, Copy)]
pub(crate) enum WeightRows<'a> {
    F32(&'a [f32]),
    /// Raw bf16 bits.
    Bf16(&'a [u16]),
    /// GGUF blocks (see [`quant`]).
    Quant(quant::QuantRows<'a>),
}

impl WeightRows<'_> {
    /// Elements held.
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::F32(w) => w.len(),
            Self::Bf16(w) => w.len(),
            Self::Quant(q) => q.rows() * q.cols,
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
