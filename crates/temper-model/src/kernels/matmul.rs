//! `y = x·Wᵀ` for the linear layers and the LM head, with every output a
//! reduction over `k` in one fixed order: a row's result is bit-identical
//! whatever the number of rows in the call, the row's position in it, or the
//! thread count.
//!
//! # Why not candle's matmul
//! candle's CPU `gemm` picks its blocking from a cache model and takes a
//! matrix-vector path for one row, so a token's logits differ (in the last
//! bits) between a decode step and a full-sequence pass. Here output
//! `(m, n)` is always `dot(x[m, :], w[n, :])` computed the same way: eight
//! lane sums over `k = l, l+8, l+16, …` (one fused multiply-add each, in `k`
//! order), then the lanes added in a fixed tree. Tiling over `m` and `n` and
//! splitting `n` across threads only decide *which* outputs a loop computes,
//! never how one is summed.
//!
//! `W` is used in its stored `[out, in]` layout (both operands contiguous in
//! `k`), so nothing is packed or copied per call; a decode step reads each
//! weight row once for all its sequences.
//!
//! The AVX2+FMA path is chosen at run time; other CPUs get a portable loop
//! with the same lane structure (rounded differently, but one process only
//! ever uses one of the two).

use std::sync::{Arc, OnceLock};

use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::matmul_bf16::PackedBf16;
use super::{f32_slice, weight_rows, WeightRows};
use crate::error::{ModelError, Result};

/// Below this many multiply-adds a call runs on the calling thread.
const SEQUENTIAL_WORK: usize = 1 << 17;
/// Rows of `x` per register tile.
const MR: usize = 4;
/// Rows of `W` (output columns) per register tile.
const NR: usize = 3;
/// Weight rows per work item: a block of `W` that stays in L2 while every
/// row of `x` passes over it.
const N_BLOCK: usize = 48;
/// Calls with at most this many rows (decode steps) use one-weight-row
/// tiles: there the weights stream from memory with little arithmetic per
/// byte, and one linear stream reads faster than `NR` interleaved ones
/// (SmolLM2 decode from `temper serve`, 2 threads: 37 → 48 tokens/s at one
/// sequence, 148 → 162 at eight). Longer calls do their first row tile of
/// each block that way too, the pass that reads the block from memory
/// (a 65,536×576 weight at 32 rows: 122 → 153 GFLOP/s). The tile shape only
/// decides which outputs a loop computes, never how one is summed: the
/// bits are the same.
const STREAM_ROWS: usize = 8;

/// `x·Wᵀ`: `x` `[m, k]`, `w` `[n, k]` → `[m, n]`, differentiable w.r.t. both
/// (the weight's gradient only when `w` is tracked). f32 on the CPU; see
/// [`matmul_nt_supported`].
pub fn matmul_nt(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    let (_, wk) = w.dims2()?;
    if k != wk {
        return Err(ModelError::InvalidInput(format!(
            "matmul_nt: x {:?} and w {:?} differ in k",
            x.dims(),
            w.dims()
        )));
    }
    let op = MatmulNt {
        weight_grad: w.track_op(),
    };
    Ok(x.contiguous()?.apply_op2(&w.contiguous()?, op)?)
}

/// Which matmul the model's forward uses for `x·Wᵀ` on the CPU in f32: a
/// model's own setting ([`crate::LoadOptions::matmul`]), never a process's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardMatmul {
    /// [`matmul_nt`]: every row reduced in one fixed order (the default).
    #[default]
    BatchInvariant,
    /// candle's `gemm`: rows round differently with the call's shape. For
    /// comparisons (`TEMPER_MATMUL=candle`).
    Candle,
}

impl ForwardMatmul {
    /// The name `TEMPER_MATMUL` and `[model] matmul` take.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BatchInvariant => "invariant",
            Self::Candle => "candle",
        }
    }
}

impl std::str::FromStr for ForwardMatmul {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "invariant" => Ok(Self::BatchInvariant),
            "candle" => Ok(Self::Candle),
            other => Err(ModelError::InvalidInput(format!(
                "matmul {other:?}: expected \"invariant\" or \"candle\""
            ))),
        }
    }
}

/// Whether [`matmul_nt`] handles these operands: `x` f32 on the CPU, `w`
/// f32 or bf16 (then `x` is rounded to bf16 and products are summed in f32).
pub fn matmul_nt_supported(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cpu()
        && w.device().is_cpu()
        && x.dtype() == DType::F32
        && matches!(w.dtype(), DType::F32 | DType::BF16)
}

/// Whether the forward runs `x·Wᵀ` through [`matmul_nt`]: supported
/// operands and [`ForwardMatmul::BatchInvariant`] chosen (`m`, the model's
/// choice: see [`crate::Model::set_forward_matmul`]).
pub fn use_matmul_nt(m: ForwardMatmul, x: &Tensor, w: &Tensor) -> bool {
    m == ForwardMatmul::BatchInvariant && matmul_nt_supported(x, w)
}

struct MatmulNt {
    weight_grad: bool,
}

impl CustomOp2 for MatmulNt {
    fn name(&self) -> &'static str {
        "matmul-nt"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice("matmul_nt", xs, xl, "x")?;
        let w = weight_rows("matmul_nt", ws, wl)?;
        let (m, k) = xl.shape().dims2()?;
        let (n, _) = wl.shape().dims2()?;
        let mut y = vec![0f32; m * n];
        matmul_nt_rows(x, w, m, n, k, &mut y);
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // The input gradient through our own `g·W` kernel (detached
        // operands: a gradient that tracked `x` would keep the whole forward
        // graph alive for as long as the caller holds the gradient). The
        // weight's gradient (LoRA's small factors, or full training) stays
        // on candle's matmul: deterministic for a given shape.
        let dx = super::matmul_nn::matmul_nn(grad, w)?;
        let dw = if self.weight_grad {
            Some(grad.t()?.matmul(&x.detach())?.to_dtype(w.dtype())?)
        } else {
            None
        };
        Ok((Some(dx), dw))
    }
}

/// `x·Wᵀ` into `y` for a weight stored in f32 or bf16.
pub(crate) fn matmul_nt_rows(
    x: &[f32],
    w: WeightRows<'_>,
    m: usize,
    n: usize,
    k: usize,
    y: &mut [f32],
) {
    match w {
        WeightRows::F32(w) => matmul_nt_f32(x, w, m, n, k, y),
        WeightRows::Bf16(w) => super::matmul_bf16::matmul_nt_bf16(x, w, m, n, k, y),
        WeightRows::Quant(w) => super::quant::matmul_nt_quant(x, w, m, n, k, y),
    }
}

/// `y[m, n] = dot(x[m, :], w[n, :])` into `y` (`[m, n]`, row-major).
pub(crate) fn matmul_nt_f32(x: &[f32], w: &[f32], m: usize, n: usize, k: usize, y: &mut [f32]) {
    assert!(x.len() >= m * k && w.len() >= n * k && y.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    let kernel = kernel();
    let out = SendPtr(y.as_mut_ptr());
    let blocks = n.div_ceil(N_BLOCK);
    let run = |b: usize| {
        let n0 = b * N_BLOCK;
        let n1 = (n0 + N_BLOCK).min(n);
        // SAFETY: block `b` writes only columns `n0..n1` of `y`, disjoint
        // from every other block's; `y` outlives the loop.
        unsafe { kernel(x, w, m, n, k, n0, n1, out.get()) };
    };
    if m * n * k < SEQUENTIAL_WORK || rayon::current_num_threads() == 1 {
        (0..blocks).for_each(run);
    } else {
        (0..blocks).into_par_iter().for_each(run);
    }
}

#[derive(Clone, Copy)]
pub(super) struct SendPtr(pub(super) *mut f32);
// SAFETY: used only to hand disjoint output columns to worker threads.
unsafe impl Send for SendPtr {}
// SAFETY: shared only to be copied out (`get`); each worker writes its own
// disjoint outputs through the copy.
unsafe impl Sync for SendPtr {}
impl SendPtr {
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }
}

/// Computes columns `n0..n1` of `y` for every row.
pub(super) type Kernel = unsafe fn(&[f32], &[f32], usize, usize, usize, usize, usize, *mut f32);

pub(super) fn kernel() -> Kernel {
    static K: OnceLock<Kernel> = OnceLock::new();
    *K.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return avx2::block;
        }
        portable::block
    })
}

mod portable {
    // The same eight-lane structure as the AVX2 kernel, in plain Rust.
    use crate::kernels::attention::dot;

    /// # Safety
    /// `y` must point to `m·n` writable floats; no other thread writes
    /// columns `n0..n1`.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn block(
        x: &[f32],
        w: &[f32],
        m: usize,
        n: usize,
        k: usize,
        n0: usize,
        n1: usize,
        y: *mut f32,
    ) {
        // SAFETY: `i < m` and `n0 ≤ j < n1 ≤ n`, so `i·n + j < m·n`: inside the
        // `m·n` floats the caller guarantees at `y`.
        unsafe {
            for i in 0..m {
                let xr = &x[i * k..(i + 1) * k];
                for j in n0..n1 {
                    *y.add(i * n + j) = dot(xr, &w[j * k..(j + 1) * k]);
                }
            }
        }
    }
}

/// The AVX2 kernel's lane sum, for kernels that must round as it does.
#[cfg(target_arch = "x86_64")]
pub(super) use avx2::hsum as hsum_avx2;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{MR, NR, STREAM_ROWS};

    /// Lanes summed as `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`, the
    /// portable kernel's order.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(in crate::kernels) unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }

    /// Loads `k % 8` trailing floats at `p`, zeros in the other lanes.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `p` must point to `rem` (at most 8)
    /// readable floats.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_tail(p: *const f32, rem: usize) -> __m256 {
        // SAFETY: AVX2 is the caller's contract; the mask enables only the first `rem`
        // lanes, readable by the caller's contract, and masked-off lanes are
        // never accessed.
        unsafe {
            let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem as i32), idx);
            _mm256_maskload_ps(p, mask)
        }
    }

    /// One `R×C` tile of outputs: rows `x[0..R]` (stride `k`) against
    /// weight rows `w[0..C]` (stride `k`), written to `y` (row stride `ldy`).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `x` must point to `R` rows and `w` to
    /// `C` rows of `k` readable floats (stride `k`), `y` to `R` rows (stride
    /// `ldy`) of `C` writable floats.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const R: usize, const C: usize>(
        x: *const f32,
        w: *const f32,
        k: usize,
        y: *mut f32,
        ldy: usize,
    ) {
        // SAFETY: AVX2/FMA are the caller's contract; each load reads 8 floats at
        // column `kk` with `kk + 8 ≤ k` (or the tail, masked to `k - k8` lanes)
        // of a row `r < R` of `x` or `c < C` of `w`, and each store writes
        // `y[r·ldy + c]`: all inside the caller's ranges.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); C]; R];
            let k8 = k - k % 8;
            let mut kk = 0;
            while kk < k8 {
                let mut wv = [_mm256_setzero_ps(); C];
                for (c, v) in wv.iter_mut().enumerate() {
                    *v = _mm256_loadu_ps(w.add(c * k + kk));
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(x.add(r * k + kk));
                    for (a, v) in row.iter_mut().zip(&wv) {
                        *a = _mm256_fmadd_ps(xv, *v, *a);
                    }
                }
                kk += 8;
            }
            if k8 < k {
                let rem = k - k8;
                let mut wv = [_mm256_setzero_ps(); C];
                for (c, v) in wv.iter_mut().enumerate() {
                    *v = load_tail(w.add(c * k + k8), rem);
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let xv = load_tail(x.add(r * k + k8), rem);
                    for (a, v) in row.iter_mut().zip(&wv) {
                        *a = _mm256_fmadd_ps(xv, *v, *a);
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for (c, a) in row.iter().enumerate() {
                    *y.add(r * ldy + c) = hsum(*a);
                }
            }
        }
    }

    /// Rows `R` of one tile row against weight rows `n0..n1`.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `x` must point to `R` rows of `k`
    /// readable floats (stride `k`), `w` to weight rows `0..n1` (stride `k`), `y`
    /// to `R` rows (stride `ldy`) whose columns `n0..n1` are writable.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_row<const R: usize>(
        x: *const f32,
        w: *const f32,
        k: usize,
        n0: usize,
        n1: usize,
        y: *mut f32,
        ldy: usize,
        narrow: bool,
    ) {
        // SAFETY: AVX2/FMA are the caller's contract; each `tile::<R, C>` gets
        // weight rows `j..j + C` and output columns `j..j + C` with `j + C ≤ n1`,
        // which is what `tile` requires.
        unsafe {
            let mut j = n0;
            if narrow {
                // One weight row at a time: a single linear stream through
                // memory (see `STREAM_ROWS`).
                while j < n1 {
                    tile::<R, 1>(x, w.add(j * k), k, y.add(j), ldy);
                    j += 1;
                }
                return;
            }
            while j + NR <= n1 {
                tile::<R, NR>(x, w.add(j * k), k, y.add(j), ldy);
                j += NR;
            }
            match n1 - j {
                2 => tile::<R, 2>(x, w.add(j * k), k, y.add(j), ldy),
                1 => tile::<R, 1>(x, w.add(j * k), k, y.add(j), ldy),
                _ => {}
            }
        }
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA; `y` must point to `m·n` writable
    /// floats; no other thread writes columns `n0..n1`.
    ///
    /// `x` must hold `m·k` floats and `w` `n1·k` (they are read unchecked).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block(
        x: &[f32],
        w: &[f32],
        m: usize,
        n: usize,
        k: usize,
        n0: usize,
        n1: usize,
        y: *mut f32,
    ) {
        // SAFETY: AVX2/FMA are the caller's contract; row tile `i..i + R`
        // (`i + R ≤ m`) gets `x` at row `i` (inside its `m·k` floats), `w`
        // (rows up to `n1`) and `y` at row `i` with stride `n`, which is what
        // `tile_row` requires.
        unsafe {
            let (x, w) = (x.as_ptr(), w.as_ptr());
            let narrow = m <= STREAM_ROWS;
            let mut i = 0;
            while i + MR <= m {
                // The first row tile reads this block of `W` from memory: one
                // linear stream (see `STREAM_ROWS`); later ones find it in cache.
                tile_row::<MR>(
                    x.add(i * k),
                    w,
                    k,
                    n0,
                    n1,
                    y.add(i * n),
                    n,
                    narrow || i == 0,
                );
                i += MR;
            }
            match m - i {
                3 => tile_row::<3>(x.add(i * k), w, k, n0, n1, y.add(i * n), n, narrow),
                2 => tile_row::<2>(x.add(i * k), w, k, n0, n1, y.add(i * n), n, narrow),
                1 => tile_row::<1>(x.add(i * k), w, k, n0, n1, y.add(i * n), n, narrow),
                _ => {}
            }
        }
    }
}

/// `x·Wᵀ` for a frozen bf16 weight through its packed form: `x` `[m, k]`
/// f32, `packed` the weight `[n, k]`. Differentiable w.r.t. `x` (the input
/// gradient runs the same kernel on the transposed packing, see
/// [`PackedBf16::transposed`]).
pub fn matmul_nt_packed(x: &Tensor, packed: &Arc<PackedBf16>) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    let (n, pk) = packed.dims();
    if k != pk {
        return Err(ModelError::InvalidInput(format!(
            "matmul_nt_packed: x {:?}, packed weight [{n}, {pk}]",
            x.dims(),
        )));
    }
    let op = MatmulPacked {
        packed: packed.clone(),
    };
    Ok(x.contiguous()?.apply_op1(op)?)
}

struct MatmulPacked {
    packed: Arc<PackedBf16>,
}

impl candle_core::CustomOp1 for MatmulPacked {
    fn name(&self) -> &'static str {
        "matmul-nt-packed"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice("matmul_nt_packed", xs, xl, "x")?;
        let (m, _) = xl.shape().dims2()?;
        let (n, _) = self.packed.dims();
        let y = rows_times_packed(x, m, &self.packed);
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad_times_packed(grad, &self.packed)?))
    }
}

/// `g·W` for a packed bf16 `W` through its transposed packing (see
/// [`PackedBf16::transposed`]): `g`'s rows are rounded to bf16, the products
/// summed in f32, as in the forward.
pub fn grad_times_packed(grad: &Tensor, packed: &PackedBf16) -> candle_core::Result<Tensor> {
    let (m, _) = grad.dims2()?;
    let g = grad.contiguous()?;
    let (storage, layout) = g.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return Err(candle_core::Error::Msg(
            "g·W with a packed weight: the gradient is not on the CPU".into(),
        ));
    };
    let gs = f32_slice("g·W", cpu, layout, "gradient")?;
    let t = packed.transposed();
    let y = rows_times_packed(gs, m, t);
    Tensor::from_vec(y, (m, t.dims().0), &Device::Cpu)
}

/// `[rows, k]·Wᵀ` for f32 rows against a packed bf16 weight.
pub(crate) fn rows_times_packed(xb: &[f32], rows: usize, packed: &PackedBf16) -> Vec<f32> {
    super::matmul_bf16::packed_product(xb, packed, rows, None)
}

/// `x·Wᵀ` through [`matmul_nt`] when the forward uses it (see
/// [`use_matmul_nt`]), else candle's matmul.
pub fn linear_nt(m: ForwardMatmul, x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if use_matmul_nt(m, x, w) {
        matmul_nt(x, w)
    } else if w.dtype() != x.dtype() {
        // bf16 weights under candle's matmul (`TEMPER_MATMUL=candle`).
        Ok(x.matmul(&w.to_dtype(x.dtype())?.t()?)?)
    } else {
        Ok(x.matmul(&w.t()?)?)
    }
}

/// A plain-slice entry point for kernels that already hold f32 rows (the LM
/// head's blocks): `[rows, k]·Wᵀ` with `W` a CPU f32 tensor.
pub(crate) fn rows_times_weight(
    xb: &[f32],
    rows: usize,
    weight: &Tensor,
) -> candle_core::Result<Vec<f32>> {
    let (n, k) = weight.dims2()?;
    let w = weight.to_device(&Device::Cpu)?.contiguous()?;
    let (storage, layout) = w.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return Err(candle_core::Error::Msg(
            "matmul_nt: weight not on the CPU".into(),
        ));
    };
    let ws = weight_rows("matmul_nt", cpu, layout)?;
    let mut y = vec![0f32; rows * n];
    matmul_nt_rows(xb, ws, rows, n, k, &mut y);
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::bits;
    use candle_core::Var;

    fn rand(shape: (usize, usize), seed: u64) -> Tensor {
        crate::kernels::test_util::rand_tensor(&[shape.0, shape.1], seed)
    }

    #[test]
    fn matches_an_f64_reference() {
        for &(m, n, k) in &[
            (1, 1, 1),
            (5, 7, 9),
            (37, 53, 37),
            (130, 97, 576),
            (4, 200, 1536),
        ] {
            let x = rand((m, k), 1);
            let w = rand((n, k), 2);
            let y = matmul_nt(&x, &w).unwrap();
            let r = x
                .to_dtype(DType::F64)
                .unwrap()
                .matmul(&w.to_dtype(DType::F64).unwrap().t().unwrap())
                .unwrap();
            let d = (y.to_dtype(DType::F64).unwrap() - r)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            assert!(d < 1e-5 * (k as f64).sqrt(), "{m}x{n}x{k}: max error {d}");
        }
    }

    /// The contract: a row's bits do not depend on the call's row count,
    /// the row's position or the thread count (candle's gemm fails this at
    /// one row and at small shapes).
    #[test]
    fn a_rows_result_does_not_depend_on_the_call() {
        for &(n, k) in &[(53, 37), (97, 576), (300, 64)] {
            let x = rand((160, k), 3);
            let w = rand((n, k), 4);
            let full = matmul_nt(&x, &w).unwrap();
            for &(start, len) in &[(0, 1), (7, 1), (159, 1), (3, 2), (10, 5), (1, 150)] {
                let part = matmul_nt(&x.narrow(0, start, len).unwrap(), &w).unwrap();
                assert_eq!(
                    bits(&part),
                    bits(&full.narrow(0, start, len).unwrap()),
                    "n={n} k={k}: rows {start}..{} differ",
                    start + len
                );
            }
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let y = pool.install(|| matmul_nt(&x, &w).unwrap());
                assert_eq!(bits(&y), bits(&full), "{threads} threads");
            }
        }
    }

    #[test]
    fn gradients_match_candles_matmul() {
        let x = Var::from_tensor(&rand((9, 21), 5)).unwrap();
        let w = Var::from_tensor(&rand((13, 21), 6)).unwrap();
        let g = rand((9, 13), 7);
        let ours = (matmul_nt(x.as_tensor(), w.as_tensor()).unwrap() * &g)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let theirs = (x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap() * &g)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for v in [&x, &w] {
            let a = ours.get(v.as_tensor()).unwrap();
            let b = theirs.get(v.as_tensor()).unwrap();
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
            assert!(d.to_scalar::<f32>().unwrap() < 1e-5);
        }
        // A frozen weight gets no gradient.
        let frozen = rand((13, 21), 6);
        let grads = matmul_nt(x.as_tensor(), &frozen)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert!(grads.get(&frozen).is_none());
        assert!(grads.get(x.as_tensor()).is_some());
    }

    #[test]
    fn rejects_mismatched_inner_dimensions() {
        assert!(matmul_nt(&rand((2, 3), 1), &rand((4, 5), 2)).is_err());
    }
}
