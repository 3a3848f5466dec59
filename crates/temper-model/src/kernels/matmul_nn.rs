//! `y = g·W` (`g` `[m, n]`, `W` `[n, k]`, both row-major): the input gradient
//! of `x·Wᵀ`, and the LM head's hidden-space gradient.
//!
//! # Why our own
//! A LoRA step spends a third of its time here. On a decoder's linear-layer
//! shapes this kernel is 1.1× candle's `gemm` per core and scales to two
//! threads without `gemm`'s pool overhead (`temper bench kernels`); the LM
//! head's backward (64 rows against its 49k-token vocabulary) runs it too.
//! `W` is read in its stored layout: for one output tile, each
//! `n` broadcasts `R` values of `g` and multiplies them into `V` vectors of
//! `W[n, k..k+16·V]`, accumulating in registers, so nothing is packed or
//! transposed per call.
//!
//! # Numbers
//! Output `(i, c)` is `Σ_n g[i, n]·W[n, c]` summed in `n` order, one fused
//! multiply-add per term, starting from zero; chunking `n` (to keep a panel
//! of `W` in L2) stores and reloads the partial sum exactly, so it changes no
//! bit. A row's result therefore depends only on that row: the kernel is
//! batch-invariant and deterministic, whatever the row count or threads.
//!
//! AVX-512 (16 lanes) or AVX2+FMA is chosen at run time; other CPUs get a
//! portable loop in the same `n` order (rounded differently, without FMA;
//! one process only ever uses one of them).

use std::sync::OnceLock;

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::quant::QuantRows;
use super::{f32_slice, weight_rows, WeightRows};

/// Below this many multiply-adds a call runs on the calling thread.
const SEQUENTIAL_WORK: usize = 1 << 17;
/// Rows of `g` per work item.
const M_BLOCK: usize = 64;
/// Output columns per work item.
const K_BLOCK: usize = 64;
/// Terms of the `n` sum per pass over a row block: a `N_CHUNK × K_BLOCK`
/// panel of `W` (64 KiB) stays in L2 while every row tile passes over it.
const N_CHUNK: usize = 256;
/// f32 values of a quantized `W` dequantized at once for an input gradient
/// (8 MiB: a decoder layer's matrix in one or two slabs).
const QUANT_SLAB_VALUES: usize = 1 << 21;
/// Rows per task when a slab is dequantized.
const DEQUANT_ROWS: usize = 64;

/// `g·W` for CPU tensors `g` `[m, n]` (f32) and `w` `[n, k]` (f32 or bf16): a new `[m, k]`
/// tensor with no autograd graph (callers are backward passes).
pub fn matmul_nn(g: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let (m, n) = g.dims2()?;
    let (wn, k) = w.dims2()?;
    if n != wn {
        return Err(candle_core::Error::Msg(format!(
            "matmul_nn: g {:?} and w {:?} differ in n",
            g.dims(),
            w.dims()
        )));
    }
    let (g, w) = (
        g.detach().contiguous()?.to_device(&Device::Cpu)?,
        w.detach().contiguous()?.to_device(&Device::Cpu)?,
    );
    let (gs, gl) = g.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (candle_core::Storage::Cpu(gs), candle_core::Storage::Cpu(ws)) = (&*gs, &*ws) else {
        return Err(candle_core::Error::Msg(
            "matmul_nn: operands not on the CPU".into(),
        ));
    };
    let mut y = vec![0f32; m * k];
    matmul_nn_rows(
        f32_slice("matmul_nn", gs, gl, "g")?,
        weight_rows("matmul_nn", ws, wl)?,
        m,
        n,
        k,
        &mut y,
    );
    Tensor::from_vec(y, (m, k), &Device::Cpu)
}

/// `y[m, k] = g[m, n]·w[n, k]` into `y` (`[m, k]`, row-major, overwritten).
#[cfg(test)]
pub(crate) fn matmul_nn_f32(g: &[f32], w: &[f32], m: usize, n: usize, k: usize, y: &mut [f32]) {
    matmul_nn_rows(g, WeightRows::F32(w), m, n, k, y)
}

/// `g·W` into `y` for a `W` stored in f32 or bf16.
pub(crate) fn matmul_nn_rows(
    g: &[f32],
    w: WeightRows<'_>,
    m: usize,
    n: usize,
    k: usize,
    y: &mut [f32],
) {
    nn_rows(g, w, m, n, k, y, false)
}

/// `y += g·W`: each output's sum continues from `y`'s value, one fused
/// multiply-add per term in `n` order (a LoRA update added to the base
/// product in place).
pub(crate) fn matmul_nn_rows_add(
    g: &[f32],
    w: WeightRows<'_>,
    m: usize,
    n: usize,
    k: usize,
    y: &mut [f32],
) {
    nn_rows(g, w, m, n, k, y, true)
}

fn nn_rows(
    g: &[f32],
    w: WeightRows<'_>,
    m: usize,
    n: usize,
    k: usize,
    y: &mut [f32],
    accumulate: bool,
) {
    if let WeightRows::Quant(q) = w {
        return quant_nn_rows(g, q, m, n, k, y, accumulate, QUANT_SLAB_VALUES);
    }
    assert!(g.len() >= m * n && w.len() >= n * k && y.len() >= m * k);
    if m == 0 || k == 0 {
        return;
    }
    if n == 0 {
        if !accumulate {
            y[..m * k].fill(0.0);
        }
        return;
    }
    let chunk = chunk_kernel();
    let out = super::matmul::SendPtr(y.as_mut_ptr());
    let (mb, kb) = (m.div_ceil(M_BLOCK), k.div_ceil(K_BLOCK));
    let run = |item: usize| {
        let (i, c) = (item / kb, item % kb);
        let (m0, k0) = (i * M_BLOCK, c * K_BLOCK);
        let (m1, k1) = ((m0 + M_BLOCK).min(m), (k0 + K_BLOCK).min(k));
        // SAFETY: item (i, c) writes only rows m0..m1, columns k0..k1 of
        // `y`, disjoint from every other item's; `y` outlives the loop.
        unsafe {
            match w {
                WeightRows::F32(w) => {
                    strided_block(chunk, g, w, n, k, m0, m1, k0, k1, out.get(), accumulate)
                }
                WeightRows::Bf16(w) => {
                    bf16_block(g, w, n, k, m0, m1, k0, k1, out.get(), accumulate)
                }
                WeightRows::Quant(_) => unreachable!("dequantized above"),
            }
        };
    };
    if m * n * k < SEQUENTIAL_WORK || rayon::current_num_threads() == 1 {
        (0..mb * kb).for_each(run);
    } else {
        (0..mb * kb).into_par_iter().for_each(run);
    }
}

/// The input gradient through a quantized `W`: its f32 rows, as the
/// dequantized model holds them, `slab_values / k` rows at a time (each slab
/// dequantized on every thread, then its terms of the `n` sum run through the
/// f32 kernel, continuing from the stored partial sums, which changes no bit:
/// see the module doc). So memory is one slab, not the whole f32 matrix: a
/// 152k-token LM head of width 1024 would be 622 MB.
#[allow(clippy::too_many_arguments)]
fn quant_nn_rows(
    g: &[f32],
    q: QuantRows<'_>,
    m: usize,
    n: usize,
    k: usize,
    y: &mut [f32],
    accumulate: bool,
    slab_values: usize,
) {
    assert!(g.len() >= m * n && q.cols == k && q.rows() >= n && y.len() >= m * k);
    let slab = (slab_values / k.max(1)).clamp(1, n.max(1));
    let mut w = vec![0f32; slab.min(n) * k];
    if n <= slab {
        dequantize_rows(q, 0, n, &mut w);
        return nn_rows(g, WeightRows::F32(&w), m, n, k, y, accumulate);
    }
    let mut gs = vec![0f32; m * slab];
    let mut n0 = 0;
    while n0 < n {
        let nc = slab.min(n - n0);
        dequantize_rows(q, n0, n0 + nc, &mut w[..nc * k]);
        for (i, row) in gs.chunks_exact_mut(nc).take(m).enumerate() {
            row.copy_from_slice(&g[i * n + n0..i * n + n0 + nc]);
        }
        let (gs, ws) = (&gs[..m * nc], WeightRows::F32(&w[..nc * k]));
        nn_rows(gs, ws, m, nc, k, y, accumulate || n0 > 0);
        n0 += nc;
    }
}

/// Rows `r0..r1` of `q` as f32 into `out`, `DEQUANT_ROWS` rows per task.
fn dequantize_rows(q: QuantRows<'_>, r0: usize, r1: usize, out: &mut [f32]) {
    let k = q.cols;
    if k == 0 || r1 <= r0 {
        return;
    }
    out[..(r1 - r0) * k]
        .par_chunks_mut(DEQUANT_ROWS * k)
        .enumerate()
        .for_each(|(i, o)| {
            let a = r0 + i * DEQUANT_ROWS;
            q.dequantize(a, a + o.len() / k, o);
        });
}

fn chunk_kernel() -> Chunk {
    match matmul_nn_isa() {
        #[cfg(target_arch = "x86_64")]
        "avx512" => avx512::chunk::<f32>,
        #[cfg(target_arch = "x86_64")]
        "avx2+fma" => avx2::chunk,
        _ => portable::chunk,
    }
}

/// The kernel this CPU runs (detected once): `avx512`, `avx2+fma` or
/// `portable`.
pub fn matmul_nn_isa() -> &'static str {
    static ISA: OnceLock<&'static str> = OnceLock::new();
    ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                return "avx512";
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return "avx2+fma";
            }
        }
        "portable"
    })
}

mod portable {
    /// # Safety
    /// `g` must cover rows `m1` (stride `ldg`) and `nc` terms, `w` `nc` rows
    /// (stride `ldw`) of `cols` columns, `y` rows `m1` (stride `ldy`); no
    /// other thread writes rows `m0..m1` of those columns.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn chunk(
        g: *const f32,
        ldg: usize,
        w: *const f32,
        ldw: usize,
        nc: usize,
        m0: usize,
        m1: usize,
        cols: usize,
        y: *mut f32,
        ldy: usize,
        first: bool,
    ) {
        // SAFETY: rows `m0..m1` of `y` (`cols` floats each) and of `g` (`nc` terms),
        // and `nc` rows of `w` (`cols` floats each), are the caller's ranges;
        // no other thread writes these outputs, so the `&mut` slice is exclusive.
        unsafe {
            for i in m0..m1 {
                let yr = std::slice::from_raw_parts_mut(y.add(i * ldy), cols);
                if first {
                    yr.fill(0.0);
                }
                for j in 0..nc {
                    let a = *g.add(i * ldg + j);
                    let wr = std::slice::from_raw_parts(w.add(j * ldw), cols);
                    for (o, x) in yr.iter_mut().zip(wr) {
                        *o += a * x;
                    }
                }
            }
        }
    }
}

/// One `n` chunk of the tiled loop, shared by both SIMD paths: every
/// `R`-row tile of rows `m0..m1` against `V`-vector column tiles of
/// `cols` columns. `g` points at the chunk's first term of row 0, `w` at
/// its first weight row (stride `ldw`), `y` at row 0's first column (stride
/// `ldy`). `$tile` is the ISA's microkernel, `$mr` its row count, `$lanes`
/// its vector width.
macro_rules! tiled_chunk {
    ($tile:expr, $mr:expr, $lanes:expr, $vmax:expr,
     $g:ident, $ldg:ident, $w:ident, $ldw:ident, $nc:ident, $m0:ident, $m1:ident,
     $cols:ident, $y:ident, $ldy:ident, $first:ident) => {{
        let mut c = 0;
        while c < $cols {
            let width = ($cols - c).min($lanes * $vmax);
            let v = width.div_ceil($lanes);
            let tail = width - (v - 1) * $lanes;
            let mut i = $m0;
            while i < $m1 {
                let r = ($m1 - i).min($mr);
                let (gp, wp, yp) = ($g.add(i * $ldg), $w.add(c), $y.add(i * $ldy + c));
                $tile(r, v, gp, $ldg, wp, $ldw, $nc, yp, $ldy, tail, $first);
                i += r;
            }
            c += width;
        }
    }};
}

/// One `n` chunk (see `tiled_chunk!`) over weights of element type `T`:
/// `(g, ldg, w, ldw, nc, m0, m1, cols, y, ldy, first)`.
type Chunk<T = f32> = unsafe fn(
    *const f32,
    usize,
    *const T,
    usize,
    usize,
    usize,
    usize,
    usize,
    *mut f32,
    usize,
    bool,
);

/// Rows `m0..m1`, columns `k0..k1` of `g·W`, chunk by chunk, `W` read in
/// place (`chunk` loads its element type).
///
/// # Safety
/// `chunk` must run on this CPU; `g` must hold `m1` rows of `n` terms, `w`
/// `n` rows of `k` elements, and `y` must point to `m1` rows of `k` writable
/// floats; no other thread writes rows `m0..m1`, columns `k0..k1` of `y`.
#[allow(clippy::too_many_arguments)]
unsafe fn strided_block<T>(
    chunk: Chunk<T>,
    g: &[f32],
    w: &[T],
    n: usize,
    k: usize,
    m0: usize,
    m1: usize,
    k0: usize,
    k1: usize,
    y: *mut f32,
    accumulate: bool,
) {
    // SAFETY: chunk `n0..n0 + nc` gets `g` at term `n0` (stride `n`), `w` at row
    // `n0`, column `k0` (stride `k`) and `y` at column `k0` (stride `k`) for
    // `k1 - k0` columns: inside the caller's ranges, as `chunk` requires.
    unsafe {
        let (gp, wp) = (g.as_ptr(), w.as_ptr());
        let mut n0 = 0;
        while n0 < n {
            let nc = (n0 + N_CHUNK).min(n) - n0;
            chunk(
                gp.add(n0),
                n,
                wp.add(n0 * k + k0),
                k,
                nc,
                m0,
                m1,
                k1 - k0,
                y.add(k0),
                k,
                n0 == 0 && !accumulate,
            );
            n0 += nc;
        }
    }
}

/// The same for a bf16 `W`, bit-identical to the f32 kernel on the widened
/// weights (widening is exact): the AVX-512 tiles widen each vector as they
/// load it; elsewhere each chunk's panel of `W` is widened into a buffer
/// and run through the f32 tiles.
///
/// # Safety
/// As [`strided_block`] (with `w` as bf16 bits), which picks its own `chunk`.
#[allow(clippy::too_many_arguments)]
unsafe fn bf16_block(
    g: &[f32],
    w: &[u16],
    n: usize,
    k: usize,
    m0: usize,
    m1: usize,
    k0: usize,
    k1: usize,
    y: *mut f32,
    accumulate: bool,
) {
    // SAFETY: `avx512::chunk` runs only where `matmul_nn_isa` detected AVX-512;
    // otherwise `chunk_kernel` picked one this CPU runs, over a widened
    // panel of `nc` rows of `cols` floats (stride `cols`); `g` and `y` as in
    // `strided_block`.
    unsafe {
        #[cfg(target_arch = "x86_64")]
        if matmul_nn_isa() == "avx512" {
            strided_block(
                avx512::chunk::<u16>,
                g,
                w,
                n,
                k,
                m0,
                m1,
                k0,
                k1,
                y,
                accumulate,
            );
            return;
        }
        let chunk = chunk_kernel();
        let cols = k1 - k0;
        let mut panel = vec![0f32; N_CHUNK.min(n) * cols];
        let gp = g.as_ptr();
        let mut n0 = 0;
        while n0 < n {
            let nc = (n0 + N_CHUNK).min(n) - n0;
            for (j, row) in panel.chunks_exact_mut(cols).take(nc).enumerate() {
                let src = &w[(n0 + j) * k + k0..(n0 + j) * k + k1];
                for (o, &b) in row.iter_mut().zip(src) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            chunk(
                gp.add(n0),
                n,
                panel.as_ptr(),
                cols,
                nc,
                m0,
                m1,
                cols,
                y.add(k0),
                k,
                n0 == 0 && !accumulate,
            );
            n0 += nc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    const MR: usize = 6;
    const VMAX: usize = 4;

    /// A weight element the tile widens to f32 as it loads: f32 itself, or
    /// bf16 bits (exactly, by a shift), so a bf16 weight needs no f32 copy.
    pub(super) trait Elem: Copy {
        /// Sixteen elements at `p` as f32, lanes outside `mask` zero.
        ///
        /// # Safety
        /// The CPU must have AVX-512F/BW; every lane `mask` enables must be
        /// readable at `p`.
        unsafe fn load16(p: *const Self, mask: __mmask16) -> __m512;
    }

    impl Elem for f32 {
        #[inline(always)]
        unsafe fn load16(p: *const f32, mask: __mmask16) -> __m512 {
            // SAFETY: the trait's contract: AVX-512F, and the lanes `mask` enables are
            // readable; masked-off lanes are not accessed.
            unsafe { _mm512_maskz_loadu_ps(mask, p) }
        }
    }

    impl Elem for u16 {
        #[inline(always)]
        unsafe fn load16(p: *const u16, mask: __mmask16) -> __m512 {
            // SAFETY: as for f32: the lanes `mask` enables are readable, the rest are
            // not accessed.
            unsafe {
                let h = _mm256_maskz_loadu_epi16(mask, p as *const i16);
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
            }
        }
    }

    /// One `R × 16V` tile over `nc` terms: `y = (first ? 0 : y) + Σ g·w`,
    /// in term order. The last vector keeps only `tail` lanes.
    ///
    /// # Safety
    /// The CPU must have AVX-512F/BW/VL; `g` must point to `R` rows of `nc` terms (stride
    /// `ldg`), `w` to `nc` rows (stride `ldw`) and `y` to `R` rows (stride `ldy`),
    /// the rows of `w` and `y` holding the tile's columns up to its last
    /// vector's `tail` lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<T: Elem, const R: usize, const V: usize>(
        g: *const f32,
        ldg: usize,
        w: *const T,
        ldw: usize,
        nc: usize,
        y: *mut f32,
        ldy: usize,
        tail: usize,
        first: bool,
    ) {
        // SAFETY: the CPU features are the caller's contract; every load and store is
        // in row `r < R`, term `j < nc`, and a lane below the tile's width (the
        // last vector masked to `tail`), which the caller guarantees.
        unsafe {
            let last: __mmask16 = if tail >= 16 {
                0xFFFF
            } else {
                ((1u32 << tail) - 1) as __mmask16
            };
            let mut acc = [[_mm512_setzero_ps(); V]; R];
            if !first {
                for (r, row) in acc.iter_mut().enumerate() {
                    for (v, a) in row.iter_mut().enumerate() {
                        let mask = if v + 1 == V { last } else { 0xFFFF };
                        *a = _mm512_maskz_loadu_ps(mask, y.add(r * ldy + v * 16));
                    }
                }
            }
            for j in 0..nc {
                let wp = w.add(j * ldw);
                let mut wv = [_mm512_setzero_ps(); V];
                for (v, x) in wv.iter_mut().enumerate() {
                    let mask = if v + 1 == V { last } else { 0xFFFF };
                    *x = T::load16(wp.add(v * 16), mask);
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let a = _mm512_set1_ps(*g.add(r * ldg + j));
                    for (x, s) in row.iter_mut().zip(&wv) {
                        *x = _mm512_fmadd_ps(a, *s, *x);
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for (v, a) in row.iter().enumerate() {
                    let mask = if v + 1 == V { last } else { 0xFFFF };
                    _mm512_mask_storeu_ps(y.add(r * ldy + v * 16), mask, *a);
                }
            }
        }
    }

    /// # Safety
    /// As [`tile`] with `R = r` (1 to 6) and `V = v` (1 to 4).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn dispatch<T: Elem>(
        r: usize,
        v: usize,
        g: *const f32,
        ldg: usize,
        w: *const T,
        ldw: usize,
        nc: usize,
        y: *mut f32,
        ldy: usize,
        tail: usize,
        first: bool,
    ) {
        // SAFETY: forwards the caller's contract to the `tile` of its `r` and `v`.
        unsafe {
            macro_rules! go {
            ($($r:literal),*) => {
                match (r, v) {
                    $(
                        ($r, 1) => tile::<T, $r, 1>(g, ldg, w, ldw, nc, y, ldy, tail, first),
                        ($r, 2) => tile::<T, $r, 2>(g, ldg, w, ldw, nc, y, ldy, tail, first),
                        ($r, 3) => tile::<T, $r, 3>(g, ldg, w, ldw, nc, y, ldy, tail, first),
                        ($r, _) => tile::<T, $r, 4>(g, ldg, w, ldw, nc, y, ldy, tail, first),
                    )*
                    _ => unreachable!("row tile of {r} rows"),
                }
            };
        }
            go!(1, 2, 3, 4, 5, 6)
        }
    }

    /// # Safety
    /// The CPU must have AVX-512F/BW/VL; see [`super::portable::chunk`].
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn chunk<T: Elem>(
        g: *const f32,
        ldg: usize,
        w: *const T,
        ldw: usize,
        nc: usize,
        m0: usize,
        m1: usize,
        cols: usize,
        y: *mut f32,
        ldy: usize,
        first: bool,
    ) {
        // SAFETY: the CPU features are the caller's contract; `tiled_chunk!` hands
        // each tile of rows `i..i + r` (`r ≤ MR`, `i + r ≤ m1`) and columns
        // `c..c + width` (`width ≤ lanes·VMAX`, `c + width ≤ cols`) pointers inside
        // the caller's `g`, `w` and `y` ranges, as `dispatch` requires.
        unsafe {
            tiled_chunk!(
                dispatch::<T>,
                MR,
                16,
                VMAX,
                g,
                ldg,
                w,
                ldw,
                nc,
                m0,
                m1,
                cols,
                y,
                ldy,
                first
            );
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    const MR: usize = 4;
    const VMAX: usize = 3;

    /// # Safety
    /// The CPU must have AVX2.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn mask(lanes: usize) -> __m256i {
        let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes as i32), idx)
    }

    /// One `R × 8V` tile; see the AVX-512 tile.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `g` must point to `R` rows of `nc` terms (stride
    /// `ldg`), `w` to `nc` rows (stride `ldw`) and `y` to `R` rows (stride `ldy`),
    /// the rows of `w` and `y` holding the tile's columns up to its last
    /// vector's `tail` lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const R: usize, const V: usize>(
        g: *const f32,
        ldg: usize,
        w: *const f32,
        ldw: usize,
        nc: usize,
        y: *mut f32,
        ldy: usize,
        tail: usize,
        first: bool,
    ) {
        // SAFETY: the CPU features are the caller's contract; every load and store is
        // in row `r < R`, term `j < nc`, and a lane below the tile's width (the
        // last vector masked to `tail`), which the caller guarantees.
        unsafe {
            let full = mask(8);
            let last = mask(tail);
            let mut acc = [[_mm256_setzero_ps(); V]; R];
            if !first {
                for (r, row) in acc.iter_mut().enumerate() {
                    for (v, a) in row.iter_mut().enumerate() {
                        let m = if v + 1 == V { last } else { full };
                        *a = _mm256_maskload_ps(y.add(r * ldy + v * 8), m);
                    }
                }
            }
            for j in 0..nc {
                let wp = w.add(j * ldw);
                let mut wv = [_mm256_setzero_ps(); V];
                for (v, x) in wv.iter_mut().enumerate() {
                    let m = if v + 1 == V { last } else { full };
                    *x = _mm256_maskload_ps(wp.add(v * 8), m);
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let a = _mm256_set1_ps(*g.add(r * ldg + j));
                    for (x, s) in row.iter_mut().zip(&wv) {
                        *x = _mm256_fmadd_ps(a, *s, *x);
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for (v, a) in row.iter().enumerate() {
                    let m = if v + 1 == V { last } else { full };
                    _mm256_maskstore_ps(y.add(r * ldy + v * 8), m, *a);
                }
            }
        }
    }

    /// # Safety
    /// As [`tile`] with `R = r` (1 to 4) and `V = v` (1 to 3).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn dispatch(
        r: usize,
        v: usize,
        g: *const f32,
        ldg: usize,
        w: *const f32,
        ldw: usize,
        nc: usize,
        y: *mut f32,
        ldy: usize,
        tail: usize,
        first: bool,
    ) {
        // SAFETY: forwards the caller's contract to the `tile` of its `r` and `v`.
        unsafe {
            macro_rules! go {
            ($($r:literal),*) => {
                match (r, v) {
                    $(
                        ($r, 1) => tile::<$r, 1>(g, ldg, w, ldw, nc, y, ldy, tail, first),
                        ($r, 2) => tile::<$r, 2>(g, ldg, w, ldw, nc, y, ldy, tail, first),
                        ($r, _) => tile::<$r, 3>(g, ldg, w, ldw, nc, y, ldy, tail, first),
                    )*
                    _ => unreachable!("row tile of {r} rows"),
                }
            };
        }
            go!(1, 2, 3, 4)
        }
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA; see [`super::portable::chunk`].
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn chunk(
        g: *const f32,
        ldg: usize,
        w: *const f32,
        ldw: usize,
        nc: usize,
        m0: usize,
        m1: usize,
        cols: usize,
        y: *mut f32,
        ldy: usize,
        first: bool,
    ) {
        // SAFETY: the CPU features are the caller's contract; `tiled_chunk!` hands
        // each tile of rows `i..i + r` (`r ≤ MR`, `i + r ≤ m1`) and columns
        // `c..c + width` (`width ≤ lanes·VMAX`, `c + width ≤ cols`) pointers inside
        // the caller's `g`, `w` and `y` ranges, as `dispatch` requires.
        unsafe {
            tiled_chunk!(dispatch, MR, 8, VMAX, g, ldg, w, ldw, nc, m0, m1, cols, y, ldy, first);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::kernels::test_util::rand_vec as rand;

    fn reference(g: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
        let mut y = vec![0f64; m * k];
        for i in 0..m {
            for j in 0..n {
                for c in 0..k {
                    y[i * k + c] += g[i * n + j] as f64 * w[j * k + c] as f64;
                }
            }
        }
        y
    }

    #[test]
    fn matches_an_f64_reference() {
        // Tails in every dimension: rows past a 6-row tile, columns past a
        // 16-lane vector and a 128-column block, terms past a 256-term chunk.
        for &(m, n, k) in &[
            (1, 1, 1),
            (5, 7, 9),
            (7, 300, 17),
            (13, 600, 131),
            (50, 37, 576),
            (3, 1536, 200),
        ] {
            let (g, w) = (rand(m * n, 1), rand(n * k, 2));
            let mut y = vec![f32::NAN; m * k];
            matmul_nn_f32(&g, &w, m, n, k, &mut y);
            let r = reference(&g, &w, m, n, k);
            let worst = y
                .iter()
                .zip(&r)
                .map(|(a, b)| (*a as f64 - b).abs())
                .fold(0.0, f64::max);
            assert!(
                worst < 1e-5 * (n as f64).sqrt() * 4.0,
                "{m}x{n}x{k}: max error {worst}"
            );
        }
    }

    /// A row's bits depend only on that row: alone, at any position, in any
    /// number of rows, on any number of threads.
    #[test]
    fn a_rows_result_does_not_depend_on_the_call() {
        let (m, n, k) = (100, 700, 150);
        let (g, w) = (rand(m * n, 3), rand(n * k, 4));
        let mut full = vec![0f32; m * k];
        matmul_nn_f32(&g, &w, m, n, k, &mut full);
        for &(start, len) in &[(0, 1), (7, 1), (99, 1), (3, 2), (10, 13), (1, 97)] {
            let mut part = vec![0f32; len * k];
            matmul_nn_f32(&g[start * n..(start + len) * n], &w, len, n, k, &mut part);
            let want: Vec<u32> = full[start * k..(start + len) * k]
                .iter()
                .map(|x| x.to_bits())
                .collect();
            let got: Vec<u32> = part.iter().map(|x| x.to_bits()).collect();
            assert_eq!(got, want, "rows {start}..{}", start + len);
        }
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut y = vec![0f32; m * k];
            pool.install(|| matmul_nn_f32(&g, &w, m, n, k, &mut y));
            assert!(
                y.iter().zip(&full).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{threads} threads"
            );
        }
    }

    #[test]
    fn no_terms_give_zeros() {
        let mut y = vec![1f32; 6];
        matmul_nn_f32(&[], &[], 2, 0, 3, &mut y);
        assert_eq!(y, vec![0.0; 6]);
    }

    /// A bf16 weight is widened exactly and run through the same tiles: the
    /// result is bit-identical to the f32 kernel on the widened weight.
    #[test]
    fn a_bf16_weight_gives_the_f32_result_of_its_widened_values() {
        for &(m, n, k) in &[(1, 7, 9), (70, 300, 576), (5, 576, 1536), (33, 1536, 100)] {
            let g = rand(m * n, 11);
            let wb = crate::kernels::matmul_bf16::round_to_bf16(&rand(n * k, 12));
            let wf: Vec<f32> = wb
                .iter()
                .map(|&b| f32::from_bits((b as u32) << 16))
                .collect();
            let (mut a, mut b) = (vec![0f32; m * k], vec![0f32; m * k]);
            matmul_nn_f32(&g, &wf, m, n, k, &mut a);
            matmul_nn_rows(&g, WeightRows::Bf16(&wb), m, n, k, &mut b);
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{m}x{n}x{k}"
            );
        }
    }

    /// A quantized weight's input gradient, slab by slab (slabs of 1, 7 and
    /// 100 rows, a slab past the end, with and without accumulation) gives
    /// the bits of the f32 kernel on the whole dequantized matrix.
    #[test]
    fn a_quantized_weight_in_slabs_gives_the_f32_result_of_its_dequantized_values() {
        use super::super::quant::QuantFormat;
        use candle_core::quantized::{GgmlDType, QTensor};
        use candle_core::{Device, Tensor};
        for (format, ggml, k) in [
            (QuantFormat::Q8_0, GgmlDType::Q8_0, 96),
            (QuantFormat::Q4K, GgmlDType::Q4K, 256),
            (QuantFormat::Q6K, GgmlDType::Q6K, 512),
        ] {
            let (m, n) = (9, 300);
            let t = Tensor::from_vec(rand(n * k, 21), (n, k), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&t, ggml).unwrap();
            let bytes = q.data().unwrap().into_owned();
            let rows = QuantRows {
                format,
                bytes: &bytes,
                cols: k,
            };
            let dense = rows.to_f32();
            let g = rand(m * n, 22);
            for accumulate in [false, true] {
                let start = rand(m * k, 23);
                let mut want = start.clone();
                nn_rows(&g, WeightRows::F32(&dense), m, n, k, &mut want, accumulate);
                for slab_rows in [1, 7, 100, n + 5] {
                    let mut got = start.clone();
                    quant_nn_rows(&g, rows, m, n, k, &mut got, accumulate, slab_rows * k);
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{format:?}, slabs of {slab_rows} rows, accumulate {accumulate}"
                    );
                }
            }
        }
    }
}
