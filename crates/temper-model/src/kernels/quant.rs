//! Matmuls that read a GGUF's quantized weight blocks as stored
//! (`--dtype gguf`): the weights stay at the file's size in memory and a
//! decode step reads 4.5–8.5 bits per weight instead of 32.
//!
//! # Storage
//! A quantized weight `[out, in]` is the file's bytes, row after row: whole
//! blocks per row in llama.cpp's layouts (`ggml-common.h`, little-endian, no
//! padding), held in a `u8` tensor `[out, row_bytes]` so it moves, copies
//! and permutes like any other weight. `lo`/`hi` are a byte's low and high
//! nibble. Blocks of 32 values:
//! - `block_q8_0` (34 bytes): `f16 d`, `i8 qs[32]`; `w[j] = qs[j]·d`;
//! - `block_q4_0` (18 bytes): `f16 d`, `u8 qs[16]`; `w[j] = (lo(qs[j]) − 8)·d`,
//!   `w[j+16] = (hi(qs[j]) − 8)·d`;
//! - `block_q4_1` (20 bytes): `f16 d`, `f16 m`, `u8 qs[16]`;
//!   `w[j] = lo(qs[j])·d + m`, `w[j+16] = hi(qs[j])·d + m`;
//! - `block_q5_0` (22 bytes): `f16 d`, `u8 qh[4]` (bit `j` of the LE `u32`
//!   is value `j`'s fifth bit), `u8 qs[16]`; `w[j] = (lo(qs[j]) | h_j<<4 − 16)·d`,
//!   `w[j+16]` from `hi(qs[j])` and bit `j+16`;
//! - `block_q5_1` (24 bytes): `f16 d`, `f16 m`, `u8 qh[4]`, `u8 qs[16]`; as
//!   Q5_0 without the `− 16`, plus `m`.
//!
//! K-quants, super-blocks of 256 values (`QK_K`):
//! - `block_q4_K` (144 bytes): `f16 d`, `f16 dmin`, `u8 scales[12]` (eight
//!   6-bit scales `sc` and mins `mn`, packed as `get_scale_min_k4` reads
//!   them), `u8 qs[128]`. Per 64 values `g`: `qs[32g..32g+32]` gives the low
//!   nibbles to sub-block `2g` and the high ones to `2g+1`; sub-block `s`'s
//!   value is `(d·sc_s)·q − dmin·mn_s`;
//! - `block_q5_K` (176 bytes): `f16 d`, `f16 dmin`, `u8 scales[12]`,
//!   `u8 qh[32]`, `u8 qs[128]`: Q4_K's nibbles plus a fifth bit, bit `s` of
//!   `qh[l]` for value `l` of sub-block `s`;
//! - `block_q6_K` (210 bytes): `u8 ql[128]`, `u8 qh[64]`, `i8 scales[16]`,
//!   `f16 d`; per 128 values `h` and `l < 32`, four 6-bit values
//!   (`ql` nibbles, `qh` bit pairs) minus 32 at `l`, `l+32`, `l+64`, `l+96`,
//!   each times `d·scales[8h + l/16 + 2i]`.
//!
//! Every product is the one the loader's dequantization (candle's
//! `to_float`, llama.cpp's `dequantize_row_*`) computes, in the same order.
//! Other GGUF types (F16, BF16, Q2_K, Q3_K, …) are dequantized to f32 at load.
//!
//! # Numbers: f32 activations, not llama.cpp's 8-bit ones
//! llama.cpp quantizes each activation row to 8 bits (`Q8_0` / `Q8_1`) and
//! takes integer dots against the weight blocks: faster, but every logit
//! then differs from the dequantized model's by the activation rounding, and
//! the backward (`dx = g·W`), which has no such rounding, would not be the
//! transpose of the forward's arithmetic. temper keeps f32 activations:
//! each weight is decoded to f32 (`q·d + m`, multiplied then added, exactly
//! as the loader's dequantization computes it) and multiplied by the
//! activation in the f32 matmul kernel's order ([`super::matmul`]: eight
//! lane sums of fused multiply-adds over `k`, then a fixed tree). So
//! - every output is the f32 kernel's fixed-order reduction over the very
//!   values the dequantized model holds: `--dtype gguf` gives the same bits
//!   as `--dtype f32` on the same file, only from 4–7× less memory;
//! - a row's result does not depend on the batch, so the sampler's decode
//!   and the trainer's full-sequence pass agree bit for bit, as in f32;
//! - the input gradient dequantizes the weight the same way and runs the f32
//!   backward kernel: QLoRA's gradients are the dequantized model's.
//!
//! # Decoders ([`Decoder`])
//! With AVX2 and FMA, every format's blocks are decoded in registers
//! (`quant_avx2`): a decode-sized call (≤ 8 rows) multiplies each eight
//! decoded weights straight into its lane sums and never writes an f32
//! weight, taking up to four weight rows side by side so that one
//! activation row still has independent multiply-add chains to overlap,
//! and prefetching the next rows as it reads these; a longer call
//! dequantizes 48 rows at a time into a buffer that stays in cache and
//! runs the f32 kernel's register tiles on it. Other CPUs (and
//! `TEMPER_QUANT_SIMD=0`) take the portable path: plain Rust compiled twice
//! (baseline and AVX2, chosen at run time; without fused multiply-adds both
//! copies round identically) into the same buffer. The f32 kernel has no
//! AVX-512 tiles, and 16-lane sums would change its order, so there is no
//! AVX-512 decoder either: its wider registers could only hold two rows'
//! eight lanes side by side.

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::f32_slice;
use super::matmul::SendPtr;
use crate::error::{ModelError, Result};

/// Values per super-block of the K-quants (`QK_K`).
const QK_K: usize = 256;

/// A quantized block format kept as stored (`--dtype gguf`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantFormat {
    /// `block_q8_0`: 8-bit values, one f16 scale per 32.
    Q8_0,
    /// `block_q4_0`: 4-bit values around 8, one f16 scale per 32.
    Q4_0,
    /// `block_q4_1`: 4-bit values, an f16 scale and an f16 minimum per 32.
    Q4_1,
    /// `block_q5_0`: 5-bit values around 16, one f16 scale per 32.
    Q5_0,
    /// `block_q5_1`: 5-bit values, an f16 scale and an f16 minimum per 32.
    Q5_1,
    /// `block_q4_K`: 4-bit values, 6-bit scales and minimums per 32, f16
    /// super-scales per 256.
    Q4K,
    /// `block_q5_K`: Q4_K with a fifth bit per value.
    Q5K,
    /// `block_q6_K`: 6-bit values around 32, an 8-bit scale per 16, an f16
    /// super-scale per 256.
    Q6K,
}

impl QuantFormat {
    /// Every format, for tests and messages.
    pub const ALL: [Self; 8] = [
        Self::Q8_0,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
    ];

    /// Values per block: 32, or 256 for the K-quants.
    pub fn block_values(self) -> usize {
        match self {
            Self::Q8_0 | Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 => 32,
            Self::Q4K | Self::Q5K | Self::Q6K => QK_K,
        }
    }

    /// Bytes of one block of [`QuantFormat::block_values`] values.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q8_0 => 34,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// Bytes of a row of `cols` values (`cols` a multiple of
    /// [`QuantFormat::block_values`]).
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_values() * self.block_bytes()
    }

    /// llama.cpp's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Q8_0 => "Q8_0",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
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
        self.dequantize_with(Decoder::best(self.format), r0, r1, out)
    }

    /// [`QuantRows::dequantize`] with a chosen decoder (the same values).
    pub(crate) fn dequantize_with(&self, decoder: Decoder, r0: usize, r1: usize, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if decoder == Decoder::Registers && super::quant_avx2::available() {
            // SAFETY: the CPU qualifies (checked just above); every format
            // has a register decoder.
            unsafe { super::quant_avx2::dequantize(*self, r0, r1, out) };
            return;
        }
        let _ = decoder;
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
    /// element, in order): the loader's products and sums, never fused.
    fn dequantize_blocks / dequantize_blocks_body(format: QuantFormat, bytes: &[u8], out: &mut [f32])
}

#[inline(always)]
fn dequantize_blocks_body(format: QuantFormat, bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes
        .chunks_exact(format.block_bytes())
        .zip(out.chunks_exact_mut(format.block_values()));
    match format {
        QuantFormat::Q8_0 => blocks.for_each(|(b, y)| q8_0(b, y)),
        QuantFormat::Q4_0 => blocks.for_each(|(b, y)| q4_0(b, y)),
        QuantFormat::Q4_1 => blocks.for_each(|(b, y)| q4_1(b, y)),
        QuantFormat::Q5_0 => blocks.for_each(|(b, y)| q5_0(b, y)),
        QuantFormat::Q5_1 => blocks.for_each(|(b, y)| q5_1(b, y)),
        QuantFormat::Q4K => blocks.for_each(|(b, y)| q4_k(b, y)),
        QuantFormat::Q5K => blocks.for_each(|(b, y)| q5_k(b, y)),
        QuantFormat::Q6K => blocks.for_each(|(b, y)| q6_k(b, y)),
    }
}

#[inline(always)]
fn q8_0(blk: &[u8], y: &mut [f32]) {
    let d = f16_at(blk, 0);
    for (y, &q) in y.iter_mut().zip(&blk[2..34]) {
        *y = (q as i8) as f32 * d;
    }
}

#[inline(always)]
fn q4_0(blk: &[u8], y: &mut [f32]) {
    let d = f16_at(blk, 0);
    let (lo, hi) = y.split_at_mut(16);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&blk[2..18]) {
        *l = ((q & 0x0F) as i16 - 8) as f32 * d;
        *h = ((q >> 4) as i16 - 8) as f32 * d;
    }
}

#[inline(always)]
fn q4_1(blk: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
    let (lo, hi) = y.split_at_mut(16);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&blk[4..20]) {
        *l = (q & 0x0F) as f32 * d + m;
        *h = (q >> 4) as f32 * d + m;
    }
}

/// The 32 five-bit values of a Q5_0 / Q5_1 block: `qh` the fifth bits
/// (little-endian), `qs` the nibbles.
#[inline(always)]
fn five_bit(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut v = [0u8; 32];
    for (j, &q) in qs[..16].iter().enumerate() {
        v[j] = (q & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
        v[j + 16] = (q >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
    v
}

#[inline(always)]
fn q5_0(blk: &[u8], y: &mut [f32]) {
    let d = f16_at(blk, 0);
    for (y, q) in y.iter_mut().zip(five_bit(&blk[2..6], &blk[6..22])) {
        *y = (q as i16 - 16) as f32 * d;
    }
}

#[inline(always)]
fn q5_1(blk: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
    for (y, q) in y.iter_mut().zip(five_bit(&blk[4..8], &blk[8..24])) {
        *y = q as f32 * d + m;
    }
}

/// Sub-block `j`'s 6-bit scale and minimum from a K-quant's 12 packed
/// bytes (ggml's `get_scale_min_k4`): `j < 4` in the low 6 bits of bytes
/// `j` and `j + 4`; `j ≥ 4` a nibble of byte `j + 4` and the top 2 bits of
/// bytes `j − 4` and `j`.
#[inline(always)]
pub(super) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

#[inline(always)]
fn q4_k(blk: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
    let (scales, qs) = (&blk[4..16], &blk[16..144]);
    for (g, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc, mn) = scale_min_k4(2 * g, scales);
        let (d1, m1) = (d * sc as f32, dmin * mn as f32);
        let (sc, mn) = scale_min_k4(2 * g + 1, scales);
        let (d2, m2) = (d * sc as f32, dmin * mn as f32);
        let (lo, hi) = y.split_at_mut(32);
        for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(q) {
            *l = d1 * (q & 0x0F) as f32 - m1;
            *h = d2 * (q >> 4) as f32 - m2;
        }
    }
}

#[inline(always)]
fn q5_k(blk: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
    let (scales, qh, qs) = (&blk[4..16], &blk[16..48], &blk[48..176]);
    for (g, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc, mn) = scale_min_k4(2 * g, scales);
        let (d1, m1) = (d * sc as f32, dmin * mn as f32);
        let (sc, mn) = scale_min_k4(2 * g + 1, scales);
        let (d2, m2) = (d * sc as f32, dmin * mn as f32);
        let (u1, u2) = (1u8 << (2 * g), 1u8 << (2 * g + 1));
        let (lo, hi) = y.split_at_mut(32);
        for (((l, h), &q), &b) in lo.iter_mut().zip(hi.iter_mut()).zip(q).zip(qh) {
            let l5 = (q & 0x0F) | if b & u1 != 0 { 16 } else { 0 };
            let h5 = (q >> 4) | if b & u2 != 0 { 16 } else { 0 };
            *l = d1 * l5 as f32 - m1;
            *h = d2 * h5 as f32 - m2;
        }
    }
}

#[inline(always)]
fn q6_k(blk: &[u8], y: &mut [f32]) {
    let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
    let d = f16_at(blk, 208);
    for (h, y) in y.chunks_exact_mut(128).enumerate() {
        let (ql, qh, sc) = (&ql[64 * h..], &qh[32 * h..], &sc[8 * h..]);
        for l in 0..32 {
            let is = l / 16;
            let six = |nib: u8, shift: u32| (nib | (((qh[l] >> shift) & 3) << 4)) as i16 - 32;
            let q = [
                six(ql[l] & 0x0F, 0),
                six(ql[l + 32] & 0x0F, 2),
                six(ql[l] >> 4, 4),
                six(ql[l + 32] >> 4, 6),
            ];
            for (i, q) in q.into_iter().enumerate() {
                y[l + 32 * i] = d * (sc[is + 2 * i] as i8) as f32 * q as f32;
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

/// How the quantized matmul turns blocks into f32 values. Both give the
/// same values, so the same bits; only the speed differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decoder {
    /// Decoded in AVX2 registers (`quant_avx2`): decode-sized calls
    /// multiply the decoded values straight away, longer ones dequantize a
    /// block of rows with them.
    Registers,
    /// Plain Rust dequantization of a block of rows into a buffer, then the
    /// f32 kernel.
    Portable,
}

impl Decoder {
    /// The fastest decoder this CPU has for `format`. `TEMPER_QUANT_SIMD=0`
    /// forces the portable one (to measure what the registers buy).
    pub(crate) fn best(format: QuantFormat) -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            let off =
                *OFF.get_or_init(|| std::env::var("TEMPER_QUANT_SIMD").is_ok_and(|v| v == "0"));
            if !off && super::quant_avx2::available() {
                return Self::Registers;
            }
        }
        let _ = format;
        Self::Portable
    }
}

/// `y[m, n] = dot(x[m, :], w[n, :])` for a quantized `w` `[n, k]`: the same
/// bits as `matmul_nt_f32` on the dequantized weight (see [`Decoder`]).
pub(crate) fn matmul_nt_quant(
    x: &[f32],
    w: QuantRows<'_>,
    m: usize,
    n: usize,
    k: usize,
    y: &mut [f32],
) {
    matmul_nt_quant_with(Decoder::best(w.format), x, w, m, n, k, y)
}

/// [`matmul_nt_quant`] with a chosen decoder (`Registers` runs only on a
/// CPU that has it; elsewhere the portable decoder runs).
pub(crate) fn matmul_nt_quant_with(
    decoder: Decoder,
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
    #[cfg(target_arch = "x86_64")]
    let registers = decoder == Decoder::Registers && super::quant_avx2::available();
    let kernel = super::matmul::kernel();
    let out = SendPtr(y.as_mut_ptr());
    let run = |b: usize| {
        let (n0, n1) = (b * N_BLOCK, ((b + 1) * N_BLOCK).min(n));
        #[cfg(target_arch = "x86_64")]
        if registers && m <= super::quant_avx2::FUSED_ROWS {
            // SAFETY: the CPU has AVX2 and FMA and the format a decoder
            // (checked above); block `b` writes only columns `n0..n1` of
            // `y`, disjoint from every other block's; `y` outlives the loop.
            unsafe { super::quant_avx2::fused(x, w, m, n, k, n0, n1, out.get()) };
            return;
        }
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < N_BLOCK * k {
                s.resize(N_BLOCK * k, 0.0);
            }
            w.dequantize_with(decoder, n0, n1, &mut s);
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
            || !cols.is_multiple_of(format.block_values())
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

    /// Rows `ids` dequantized, one after the other (an embedding lookup:
    /// the loader's values).
    pub fn gather_rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let (out, cols) = self.dims();
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= out) {
            return Err(ModelError::InvalidInput(format!(
                "row {bad} of a {out}-row quantized matrix"
            )));
        }
        let mut v = vec![0f32; ids.len() * cols];
        self.with_rows(|r| {
            for (&i, o) in ids.iter().zip(v.chunks_exact_mut(cols)) {
                r.dequantize(i as usize, i as usize + 1, o);
            }
            Ok(())
        })?;
        Ok(v)
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
        let dx = self.w.with_rows(|w| {
            super::with_f32("quant_matmul", grad, |g| {
                let mut dx = vec![0f32; m * k];
                super::matmul_nn::matmul_nn_rows(g, super::WeightRows::Quant(w), m, n, k, &mut dx);
                Ok(dx)
            })
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
            QuantFormat::Q5_0 => GgmlDType::Q5_0,
            QuantFormat::Q5_1 => GgmlDType::Q5_1,
            QuantFormat::Q4K => GgmlDType::Q4K,
            QuantFormat::Q5K => GgmlDType::Q5K,
            QuantFormat::Q6K => GgmlDType::Q6K,
        };
        let q = QTensor::quantize(&t, dt).unwrap();
        let deq = q.dequantize(&Device::Cpu).unwrap();
        (
            q.data().unwrap().into_owned(),
            deq.flatten_all().unwrap().to_vec1().unwrap(),
        )
    }

    #[test]
    fn dequantization_matches_candle_bit_for_bit_on_every_path() {
        for f in QuantFormat::ALL {
            let (bytes, want) = quantized(f, 7, 512, 3);
            assert_eq!(
                bytes.len(),
                7 * f.row_bytes(512),
                "{f:?}: candle's block size"
            );
            let rows = QuantRows {
                format: f,
                bytes: &bytes,
                cols: 512,
            };
            assert_eq!(rows.rows(), 7);
            assert_eq!(rows.to_f32(), want, "{f:?} (dispatched)");
            for d in decoders(f) {
                let mut got = vec![f32::NAN; 3 * 512];
                rows.dequantize_with(d, 2, 5, &mut got);
                assert_eq!(got, want[2 * 512..5 * 512], "{f:?} {d:?} rows 2..5");
            }
            // The portable body, whatever the CPU.
            let mut portable = vec![0f32; want.len()];
            dequantize_blocks_body(f, &bytes, &mut portable);
            assert_eq!(portable, want, "{f:?} (portable)");
        }
    }

    /// The decoders to check: the register one wherever this CPU can run
    /// it, even when `TEMPER_QUANT_SIMD=0` makes the portable one the
    /// default.
    fn decoders(f: QuantFormat) -> Vec<Decoder> {
        let _ = f;
        let mut d = vec![Decoder::Portable];
        #[cfg(target_arch = "x86_64")]
        if super::super::quant_avx2::available() {
            d.push(Decoder::Registers);
        }
        d
    }

    #[test]
    fn quantized_matmul_equals_the_f32_kernel_on_the_dequantized_weight() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            // The register path must actually be under test on such a CPU,
            // for every format, and be the default unless the benchmarking
            // switch turned it off.
            let off = std::env::var("TEMPER_QUANT_SIMD").is_ok_and(|v| v == "0");
            for f in QuantFormat::ALL {
                assert!(decoders(f).contains(&Decoder::Registers), "{f:?}");
                let want = if off {
                    Decoder::Portable
                } else {
                    Decoder::Registers
                };
                assert_eq!(Decoder::best(f), want, "{f:?}");
            }
        }
        for f in QuantFormat::ALL {
            // n spans several row blocks and a partial one; two K-quant
            // super-blocks per row; m = 5 decodes in registers, m = 13
            // dequantizes blocks of rows.
            let (n, k) = (2 * N_BLOCK + 7, 512);
            let (bytes, deq) = quantized(f, n, k, 11);
            let w = QuantRows {
                format: f,
                bytes: &bytes,
                cols: k,
            };
            for m in [2, 3, 4, 5, 7, 13] {
                let x = super::super::test_util::rand_vec(m * k, 12);
                let mut want = vec![0f32; m * n];
                super::super::matmul::matmul_nt_f32(&x, &deq, m, n, k, &mut want);
                for d in decoders(f) {
                    let mut got = vec![0f32; m * n];
                    matmul_nt_quant_with(d, &x, w, m, n, k, &mut got);
                    assert!(got == want, "{f:?} {d:?} m={m}");
                    // One row at a time: the same bits (batch invariance).
                    for i in 0..m {
                        let mut row = vec![0f32; n];
                        matmul_nt_quant_with(d, &x[i * k..(i + 1) * k], w, 1, n, k, &mut row);
                        assert!(row == want[i * n..(i + 1) * n], "{f:?} {d:?} row {i}");
                    }
                }
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

    /// f16 bytes of `x` (exact in f16 for the values used here).
    fn f16_bytes(x: f32) -> [u8; 2] {
        half::f16::from_f32(x).to_le_bytes()
    }

    /// Hand-packed blocks: `q[i]` the stored integer of value `i`, laid out
    /// as ggml's `quantize_row_*` writes it; every decoder must give
    /// `want(i)` exactly (every product here is exact in f32).
    fn check_block(f: QuantFormat, block: &[u8], want: impl Fn(usize) -> f64) {
        assert_eq!(block.len(), f.block_bytes(), "{f:?}");
        let mut y = vec![f32::NAN; f.block_values()];
        dequantize_blocks_body(f, block, &mut y);
        for (i, &v) in y.iter().enumerate() {
            assert_eq!(v as f64, want(i), "{f:?} value {i}");
        }
        let rows = QuantRows {
            format: f,
            bytes: block,
            cols: f.block_values(),
        };
        for d in decoders(f) {
            let mut got = vec![f32::NAN; f.block_values()];
            rows.dequantize_with(d, 0, 1, &mut got);
            assert_eq!(got, y, "{f:?} {d:?}");
        }
    }

    /// The value pattern of a block: every stored integer below `levels`.
    fn ints(n: usize, levels: usize) -> Vec<u8> {
        (0..n).map(|i| ((i * 7 + i / 5) % levels) as u8).collect()
    }

    /// Eight 6-bit scales and minimums packed into 12 bytes as ggml's
    /// `quantize_row_q4_K` packs them.
    fn pack_scales_k4(sc: [u8; 8], mn: [u8; 8]) -> [u8; 12] {
        let mut s = [0u8; 12];
        for j in 0..8 {
            if j < 4 {
                s[j] = sc[j];
                s[j + 4] = mn[j];
            } else {
                s[j + 4] = (sc[j] & 0x0F) | ((mn[j] & 0x0F) << 4);
                s[j - 4] |= (sc[j] >> 4) << 6;
                s[j] |= (mn[j] >> 4) << 6;
            }
        }
        s
    }

    #[test]
    fn legacy_blocks_decode_hand_packed_values() {
        let q = ints(32, 32);
        let nib = |q: &[u8]| -> Vec<u8> {
            (0..16)
                .map(|j| (q[j] & 15) | ((q[j + 16] & 15) << 4))
                .collect()
        };
        let qh = |q: &[u8]| -> [u8; 4] {
            let bits = (0..32).fold(0u32, |a, j| a | (((q[j] >> 4) as u32 & 1) << j));
            bits.to_le_bytes()
        };
        let q8: Vec<u8> = (0..32).map(|i| (i as i8 * 4 - 64) as u8).collect();
        check_block(
            QuantFormat::Q8_0,
            &[&f16_bytes(0.5)[..], &q8].concat(),
            |i| (i as f64 * 4.0 - 64.0) * 0.5,
        );
        let q4 = ints(32, 16);
        check_block(
            QuantFormat::Q4_0,
            &[&f16_bytes(0.25)[..], &nib(&q4)].concat(),
            |i| (q4[i] as f64 - 8.0) * 0.25,
        );
        let blk = [&f16_bytes(0.25)[..], &f16_bytes(-1.5), &nib(&q4)].concat();
        check_block(QuantFormat::Q4_1, &blk, |i| q4[i] as f64 * 0.25 - 1.5);
        let blk = [&f16_bytes(0.125)[..], &qh(&q), &nib(&q)].concat();
        check_block(QuantFormat::Q5_0, &blk, |i| (q[i] as f64 - 16.0) * 0.125);
        let blk = [&f16_bytes(0.125)[..], &f16_bytes(2.0), &qh(&q), &nib(&q)].concat();
        check_block(QuantFormat::Q5_1, &blk, |i| q[i] as f64 * 0.125 + 2.0);
    }

    #[test]
    fn k_quant_blocks_decode_hand_packed_values() {
        // Scales and minimums that use all six bits, so the packing's top
        // bits matter.
        let sc = [1, 63, 17, 40, 33, 5, 62, 48];
        let mn = [0, 9, 63, 34, 50, 21, 3, 60];
        let (d, dmin) = (0.5, 0.25);
        let k4 = pack_scales_k4(sc, mn);
        // Q4_K: sub-block s (32 values) is group s/2's low (s even) or high
        // (s odd) nibbles.
        let q = ints(256, 16);
        let mut qs = [0u8; 128];
        for (i, &v) in q.iter().enumerate() {
            let (s, l) = (i / 32, i % 32);
            qs[32 * (s / 2) + l] |= v << (4 * (s % 2));
        }
        let blk = [&f16_bytes(d)[..], &f16_bytes(dmin), &k4, &qs].concat();
        check_block(QuantFormat::Q4K, &blk, |i| {
            d as f64 * sc[i / 32] as f64 * q[i] as f64 - dmin as f64 * mn[i / 32] as f64
        });
        // Q5_K: the same nibbles plus bit s of qh[l].
        let q = ints(256, 32);
        let (mut qs, mut qh) = ([0u8; 128], [0u8; 32]);
        for (i, &v) in q.iter().enumerate() {
            let (s, l) = (i / 32, i % 32);
            qs[32 * (s / 2) + l] |= (v & 15) << (4 * (s % 2));
            qh[l] |= (v >> 4) << s;
        }
        let blk = [&f16_bytes(d)[..], &f16_bytes(dmin), &k4, &qh, &qs].concat();
        check_block(QuantFormat::Q5K, &blk, |i| {
            d as f64 * sc[i / 32] as f64 * q[i] as f64 - dmin as f64 * mn[i / 32] as f64
        });
        // Q6_K: per 128 values, quarter t's value l: ql nibble (t even:
        // low, t ≥ 2: high; byte l or l+32), qh[l] bits 2t..2t+1; signed
        // 8-bit scale per 16 values.
        let q = ints(256, 64);
        let scales: Vec<i8> = (0..16).map(|j| (j as i8 - 8) * 9).collect();
        let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
        for (i, &v) in q.iter().enumerate() {
            let (h, t, l) = (i / 128, (i % 128) / 32, i % 32);
            ql[64 * h + l + 32 * (t % 2)] |= (v & 15) << (4 * (t / 2));
            qh[32 * h + l] |= (v >> 4) << (2 * t);
        }
        let sb: Vec<u8> = scales.iter().map(|&s| s as u8).collect();
        let blk = [&ql[..], &qh, &sb, &f16_bytes(d)].concat();
        check_block(QuantFormat::Q6K, &blk, |i| {
            d as f64 * scales[i / 16] as f64 * (q[i] as f64 - 32.0)
        });
    }
}
