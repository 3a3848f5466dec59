//! Matmuls that read a GGUF's quantized weight blocks as stored
//! (`--dtype gguf`): the weights stay at the file's size in memory and a
//! decode step reads 4.5–8.5 bits per weight instead of 32.
//!
//! # Storage
//! A quantized weight `[out, in]` is the file's bytes, row after row:
//! `in / 32` blocks per row in llama.cpp's layouts (`ggml-common.h`,
//! little-endian, no padding), held in a `u8` tensor `[out, row_bytes]` so
//! it moves, copies and permutes like any other weight:
//! - `block_q8_0` (34 bytes): `f16 d`, `i8 qs[32]`; `w[j] = qs[j]·d`;
//! - `block_q4_0` (18 bytes): `f16 d`, `u8 qs[16]`; `w[j] = (lo(qs[j]) − 8)·d`,
//!   `w[j+16] = (hi(qs[j]) − 8)·d`;
//! - `block_q4_1` (20 bytes): `f16 d`, `f16 m`, `u8 qs[16]`;
//!   `w[j] = lo(qs[j])·d + m`, `w[j+16] = hi(qs[j])·d + m`.
//!
//! Other GGUF types (F16, the K-quants, …) are dequantized to f32 at load.
//!
//! # Numbers: f32 activations, not llama.cpp's 8-bit ones
//! llama.cpp quantizes each activation row to 8 bits (`Q8_0` / `Q8_1`) and
//! takes integer dots against the weight blocks: faster, but every logit
//! then differs from the dequantized model's by the activation rounding, and
//! the backward (`dx = g·W`), which has no such rounding, would not be the
//! transpose of the forward's arithmetic. temper keeps f32 activations: a
//! block of weight rows is dequantized to f32 (`q·d + m`, multiplied then
//! added, exactly as the loader's dequantization computes it) into a small
//! buffer that stays in cache, and the f32 matmul kernel ([`super::matmul`])
//! runs on it. So
//! - every output is the f32 kernel's fixed-order reduction over the very
//!   values the dequantized model holds: `--dtype gguf` gives the same bits
//!   as `--dtype f32` on the same file, only from 4–7× less memory;
//! - a row's result does not depend on the batch, so the sampler's decode
//!   and the trainer's full-sequence pass agree bit for bit, as in f32;
//! - the input gradient dequantizes the weight the same way and runs the f32
//!   backward kernel: QLoRA's gradients are the dequantized model's.
//!
//! The dequantization is plain Rust compiled twice (baseline and AVX2, chosen
//! at run time); without fused multiply-adds both copies round identically.

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::f32_slice;
use super::matmul::SendPtr;
use crate::error::{ModelError, Result};

/// Values per block in every supported format.
pub const QUANT_BLOCK: usize = 32;

/// A quantized block format kept as stored (`--dtype gguf`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantFormat {
    /// `block_q8_0`: 8-bit values, one f16 scale per 32.
    Q8_0,
    /// `block_q4_0`: 4-bit values around 8, one f16 scale per 32.
    Q4_0,
    /// `block_q4_1`: 4-bit values, an f16 scale and an f16 minimum per 32.
    Q4_1,
}

impl QuantFormat {
    /// Bytes of one block of [`QUANT_BLOCK`] values.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q8_0 => 34,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
        }
    }

    /// Bytes of a row of `cols` values (`cols` a multiple of 32).
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / QUANT_BLOCK * self.block_bytes()
    }

    /// llama.cpp's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Q8_0 => "Q8_0",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
        }
    }
}

/// A quantized weight's rows: `bytes` holds whole rows of `cols` values.
#[derive(Clone, Copy)]
pub(crate) struct QuantRows<'a> {
    pub(crate) format: QuantFormat,
    pub(crate) bytes: &'a [u8],
    pub(crate) cols: usize,
}

impl QuantRows<'_> {
    /// Rows held.
    pub(crate) fn rows(&self) -> usize {
        self.bytes.len() / self.format.row_bytes(self.cols).max(1)
    }

    /// Rows `r0..r1` as f32, into `out` (`(r1 − r0)·cols` values).
    pub(crate) fn dequantize(&self, r0: usize, r1: usize, out: &mut [f32]) {
        let rb = self.format.row_bytes(self.cols);
        dequantize_blocks(
            self.format,
            &self.bytes[r0 * rb..r1 * rb],
            &mut out[..(r1 - r0) * self.cols],
        );
    }

    /// Every row as f32 (`[rows, cols]`).
    pub(crate) fn to_f32(self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows() * self.cols];
        self.dequantize(0, self.rows(), &mut out);
        out
    }
}

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

twice_compiled! {
    /// Blocks of `format` in `bytes` as f32 into `out` (one value per
    /// element, in order): `q·d` or `q·d + m`, never fused.
    fn dequantize_blocks / dequantize_blocks_body(format: QuantFormat, bytes: &[u8], out: &mut [f32])
}

#[inline(always)]
fn dequantize_blocks_body(format: QuantFormat, bytes: &[u8], out: &mut [f32]) {
    let bb = format.block_bytes();
    for (blk, y) in bytes
        .chunks_exact(bb)
        .zip(out.chunks_exact_mut(QUANT_BLOCK))
    {
        let d = f16_at(blk, 0);
        match format {
            QuantFormat::Q8_0 => {
                for (y, &q) in y.iter_mut().zip(&blk[2..34]) {
                    *y = (q as i8) as f32 * d;
                }
            }
            QuantFormat::Q4_0 => {
                let (lo, hi) = y.split_at_mut(QUANT_BLOCK / 2);
                for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&blk[2..18]) {
                    *l = ((q & 0x0F) as i16 - 8) as f32 * d;
                    *h = ((q >> 4) as i16 - 8) as f32 * d;
                }
            }
            QuantFormat::Q4_1 => {
                let m = f16_at(blk, 2);
                let (lo, hi) = y.split_at_mut(QUANT_BLOCK / 2);
                for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&blk[4..20]) {
                    *l = (q & 0x0F) as f32 * d + m;
                    *h = (q >> 4) as f32 * d + m;
                }
            }
        }
    }
}

/// Weight rows per work item: dequantized into a per-thread buffer that
/// stays in L2 while every row of `x` passes over it.
const N_BLOCK: usize = 48;
/// Below this many multiply-adds a call runs on the calling thread.
const SEQUENTIAL_WORK: usize = 1 << 17;

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `y[m, n] = dot(x[m, :], w[n, :])` for a quantized `w` `[n, k]`: each
/// block of rows dequantized, then the f32 kernel's tiles — the same bits
/// as `matmul_nt_f32` on the dequantized weight.
pub(crate) fn matmul_nt_quant(
    x: &[f32],
    w: QuantRows<'_>,
    m: usize,
    n: usize,
    k: usize,
    y: &mut [f32],
) {
    assert!(x.len() >= m * k && w.cols == k && w.rows() >= n && y.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    let kernel = super::matmul::kernel();
    let out = SendPtr(y.as_mut_ptr());
    let run = |b: usize| {
        let (n0, n1) = (b * N_BLOCK, ((b + 1) * N_BLOCK).min(n));
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < N_BLOCK * k {
                s.resize(N_BLOCK * k, 0.0);
            }
            w.dequantize(n0, n1, &mut s);
            // SAFETY: block `b` writes only columns `n0..n1` of `y` (the
            // kernel's columns `0..n1-n0` from `y + n0`, row stride `n`),
            // disjoint from every other block's; `y` outlives the loop.
            unsafe { kernel(x, &s, m, n, k, 0, n1 - n0, out.get().add(n0)) };
        });
    };
    let blocks = n.div_ceil(N_BLOCK);
    if m * n * k < SEQUENTIAL_WORK || rayon::current_num_threads() == 1 {
        (0..blocks).for_each(run);
    } else {
        (0..blocks).into_par_iter().for_each(run);
    }
}

/// A quantized weight as the model holds it: its block bytes in a `u8`
/// tensor `[out, row_bytes]`, the format and the row length.
#[derive(Debug, Clone)]
pub struct QuantWeight {
    /// The blocks, `[out, row_bytes]`.
    pub blocks: Tensor,
    /// Their format.
    pub format: QuantFormat,
    /// Values per row (`in`).
    pub cols: usize,
}

impl QuantWeight {
    /// `blocks` (`u8` `[out, row_bytes]` on the CPU) read as rows of `cols`
    /// values in `format`.
    pub fn new(blocks: Tensor, format: QuantFormat, cols: usize) -> Result<Self> {
        let (_, rb) = blocks.dims2()?;
        if blocks.dtype() != DType::U8
            || !blocks.device().is_cpu()
            || !cols.is_multiple_of(QUANT_BLOCK)
            || rb != format.row_bytes(cols)
        {
            return Err(ModelError::InvalidInput(format!(
                "{} weight: {:?} {:?} bytes for rows of {cols}",
                format.as_str(),
                blocks.dtype(),
                blocks.dims()
            )));
        }
        Ok(Self {
            blocks,
            format,
            cols,
        })
    }

    /// `[out, in]`.
    pub fn dims(&self) -> (usize, usize) {
        (self.blocks.dims()[0], self.cols)
    }

    /// Run `f` on the rows.
    pub(crate) fn with_rows<T>(
        &self,
        f: impl FnOnce(QuantRows<'_>) -> candle_core::Result<T>,
    ) -> candle_core::Result<T> {
        let blocks = self.blocks.contiguous()?;
        let (storage, layout) = blocks.storage_and_layout();
        let (candle_core::Storage::Cpu(CpuStorage::U8(v)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        else {
            return Err(candle_core::Error::Msg(
                "quantized weight: not u8 bytes on the CPU".into(),
            ));
        };
        f(QuantRows {
            format: self.format,
            bytes: &v[a..b],
            cols: self.cols,
        })
    }

    /// The weight dequantized to f32 `[out, in]` (the loader's values).
    pub fn dequantize(&self) -> Result<Tensor> {
        let (out, cols) = self.dims();
        let v = self.with_rows(|r| Ok(r.to_f32()))?;
        Ok(Tensor::from_vec(v, (out, cols), &Device::Cpu)?)
    }
}

/// `x·Wᵀ` for a frozen quantized `W`: `x` `[n, in]` f32 on the CPU.
/// Differentiable w.r.t. `x` (`dx = g·W` through the dequantized rows).
pub fn matmul_nt_quant_op(x: &Tensor, w: &QuantWeight) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    if k != w.cols || x.dtype() != DType::F32 || !x.device().is_cpu() {
        return Err(ModelError::InvalidInput(format!(
            "quantized matmul: x {:?} {:?} against a {} weight {:?}",
            x.dims(),
            x.dtype(),
            w.format.as_str(),
            w.dims()
        )));
    }
    Ok(x.contiguous()?.apply_op1(QuantMatmul { w: w.clone() })?)
}

struct QuantMatmul {
    w: QuantWeight,
}

impl CustomOp1 for QuantMatmul {
    fn name(&self) -> &'static str {
        "quant-matmul"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice("quant_matmul", xs, xl, "x")?;
        let (m, k) = xl.shape().dims2()?;
        let (n, _) = self.w.dims();
        let mut y = vec![0f32; m * n];
        self.w.with_rows(|w| {
            matmul_nt_quant(x, w, m, n, k, &mut y);
            Ok(())
        })?;
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let (m, n) = grad.dims2()?;
        let k = self.w.cols;
        let w = self.w.with_rows(|w| Ok(w.to_f32()))?;
        let dx = super::with_f32("quant_matmul", grad, |g| {
            let mut dx = vec![0f32; m * k];
            super::matmul_nn::matmul_nn_rows(g, super::WeightRows::F32(&w), m, n, k, &mut dx);
            Ok(dx)
        })?;
        Ok(Some(Tensor::from_vec(dx, (m, k), &Device::Cpu)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};

    /// A random `[rows, cols]` weight quantized by candle (llama.cpp's
    /// reference quantizers), its bytes and candle's dequantization.
    fn quantized(format: QuantFormat, rows: usize, cols: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
        let vals = super::super::test_util::rand_vec(rows * cols, seed);
        let t = Tensor::from_vec(vals, (rows, cols), &Device::Cpu).unwrap();
        let dt = match format {
            QuantFormat::Q8_0 => GgmlDType::Q8_0,
            QuantFormat::Q4_0 => GgmlDType::Q4_0,
            QuantFormat::Q4_1 => GgmlDType::Q4_1,
        };
        let q = QTensor::quantize(&t, dt).unwrap();
        let deq = q.dequantize(&Device::Cpu).unwrap();
        (
            q.data().unwrap().into_owned(),
            deq.flatten_all().unwrap().to_vec1().unwrap(),
        )
    }

    const FORMATS: [QuantFormat; 3] = [QuantFormat::Q8_0, QuantFormat::Q4_0, QuantFormat::Q4_1];

    #[test]
    fn dequantization_matches_candle_bit_for_bit_on_every_path() {
        for f in FORMATS {
            let (bytes, want) = quantized(f, 7, 96, 3);
            let rows = QuantRows {
                format: f,
                bytes: &bytes,
                cols: 96,
            };
            assert_eq!(rows.rows(), 7);
            assert_eq!(rows.to_f32(), want, "{f:?} (dispatched)");
            // The portable body, whatever the CPU.
            let mut portable = vec![0f32; want.len()];
            dequantize_blocks_body(f, &bytes, &mut portable);
            assert_eq!(portable, want, "{f:?} (portable)");
        }
    }

    #[test]
    fn quantized_matmul_equals_the_f32_kernel_on_the_dequantized_weight() {
        for f in FORMATS {
            // n spans several row blocks and a partial one; m odd.
            let (m, n, k) = (5, 2 * N_BLOCK + 7, 64);
            let (bytes, deq) = quantized(f, n, k, 11);
            let x = super::super::test_util::rand_vec(m * k, 12);
            let mut want = vec![0f32; m * n];
            super::super::matmul::matmul_nt_f32(&x, &deq, m, n, k, &mut want);
            let mut got = vec![0f32; m * n];
            let w = QuantRows {
                format: f,
                bytes: &bytes,
                cols: k,
            };
            matmul_nt_quant(&x, w, m, n, k, &mut got);
            assert_eq!(got, want, "{f:?}");
            // One row at a time: the same bits (batch invariance).
            for i in 0..m {
                let mut row = vec![0f32; n];
                matmul_nt_quant(&x[i * k..(i + 1) * k], w, 1, n, k, &mut row);
                assert_eq!(row, want[i * n..(i + 1) * n], "{f:?} row {i}");
            }
        }
    }

    #[test]
    fn quantized_matmul_input_gradient_is_the_dequantized_weights() {
        let (n, k) = (40, 64);
        let (bytes, deq) = quantized(QuantFormat::Q4_1, n, k, 5);
        let blocks =
            Tensor::from_vec(bytes, (n, QuantFormat::Q4_1.row_bytes(k)), &Device::Cpu).unwrap();
        let w = QuantWeight::new(blocks, QuantFormat::Q4_1, k).unwrap();
        let x = candle_core::Var::from_slice(
            &super::super::test_util::rand_vec(3 * k, 6),
            (3, k),
            &Device::Cpu,
        )
        .unwrap();
        let g = Tensor::from_vec(
            super::super::test_util::rand_vec(3 * n, 7),
            (3, n),
            &Device::Cpu,
        )
        .unwrap();
        let y = matmul_nt_quant_op(x.as_tensor(), &w).unwrap();
        let grads = (y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let dx: Vec<f32> = grads
            .get(x.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let dense = Tensor::from_vec(deq, (n, k), &Device::Cpu).unwrap();
        let want: Vec<f32> = g
            .matmul(&dense)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let worst = dx
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "dx differs from g·W by {worst}");
        assert_eq!(
            w.dequantize().unwrap().dims(),
            &[n, k],
            "dequantize keeps [out, in]"
        );
    }
}
