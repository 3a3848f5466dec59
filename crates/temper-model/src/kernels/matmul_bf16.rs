//! `y = x·Wᵀ` with `W` stored in bf16: `x` is rounded to bf16 (round to
//! nearest even), each product of two bf16 values is exact in f32, and the
//! sums are f32. This is what `--dtype bf16` runs for every linear layer and
//! the LM head; it halves the bytes read per token and, with the CPU's
//! `avx512_bf16` dot-product instruction (`vdpbf16ps`), doubles the
//! multiply-adds per instruction.
//!
//! # Layout
//! The model packs each bf16 weight once ([`PackedBf16`]): panels of 64
//! output columns, and within a panel, for each input pair `(2t, 2t+1)`,
//! the 64 columns' two values side by side. One `vdpbf16ps` then multiplies
//! a broadcast pair of `x` into 16 columns at once, a panel is one linear
//! stream through memory, and no output needs a horizontal sum (on Zen 4,
//! one core: ~210 GFLOP/s from 8 rows up against ~100 for the f32 kernel,
//! and twice its speed at one row).
//!
//! # Invariance
//! The same contract as the f32 [`super::matmul_nt`]: output `(m, n)` is one
//! f32 accumulator, `acc += bf16(x[m,2t])·w[n,2t] + bf16(x[m,2t+1])·w[n,2t+1]`
//! for `t` in order. Tiles and threads only decide which outputs a loop
//! computes, so a row's bits do not depend on the call's row count, the
//! row's position or the thread count, in a decode step, a prefill chunk or
//! a training pass alike.
//!
//! CPUs without `avx512_bf16` run a portable loop in the same order (its
//! rounding of each pair may differ from the instruction's; one process only
//! ever uses one of the two).

use std::sync::OnceLock;

use rayon::prelude::*;

use super::matmul::SendPtr;

/// Below this many multiply-adds a call runs on the calling thread.
const SEQUENTIAL_WORK: usize = 1 << 17;

/// `x` rounded to bf16 (round to nearest even), as raw bits: the tests'
/// reference rounding.
#[cfg(test)]
pub(crate) fn round_to_bf16(x: &[f32]) -> Vec<u16> {
    let mut out = vec![0u16; x.len()];
    let run = |(o, x): (&mut [u16], &[f32])| {
        for (o, &v) in o.iter_mut().zip(x) {
            *o = half::bf16::from_f32(v).to_bits();
        }
    };
    if x.len() < 1 << 16 {
        run((&mut out, x));
    } else {
        out.par_chunks_mut(1 << 14)
            .zip(x.par_chunks(1 << 14))
            .for_each(run);
    }
    out
}

/// `x·Wᵀ` for a bf16 weight that has no [`PackedBf16`] yet (a bare bf16
/// tensor): packed for this call, then [`matmul_nt_packed`].
pub(crate) fn matmul_nt_bf16(x: &[f32], w: &[u16], m: usize, n: usize, k: usize, y: &mut [f32]) {
    matmul_nt_packed(x, &PackedBf16::pack(w, n, k), m, y)
}

/// Whether this CPU has the bf16 dot-product instruction (`avx512_bf16`),
/// which makes bf16 matmuls faster than f32 ones.
pub fn bf16_dot_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Output columns per packed panel (four 16-lane vectors).
const PANEL: usize = 64;

/// A bf16 weight `[n, k]` repacked for `x·Wᵀ`: panels of [`PANEL`] output
/// columns, and within a panel, for each pair of inputs `(2t, 2t+1)`, the
/// panel's 64 columns' two values side by side — what `vdpbf16ps` takes
/// with one broadcast pair of `x`. A panel is one linear stream through
/// memory, and each output is one f32 accumulator over `t` in order: no
/// horizontal sums.
#[derive(Debug)]
pub struct PackedBf16 {
    n: usize,
    k: usize,
    /// `[n / PANEL][k / 2][PANEL][2]`, zero-padded.
    data: Vec<u16>,
    /// The transposed weight `[k, n]` packed the same way, for the input
    /// gradient `g·W`; built on first use (only training needs it).
    transposed: OnceLock<Box<PackedBf16>>,
}

impl PackedBf16 {
    /// Pack the raw bits of a row-major `[n, k]` bf16 matrix.
    pub(crate) fn pack(w: &[u16], n: usize, k: usize) -> Self {
        assert!(w.len() >= n * k);
        let k2 = k.div_ceil(2);
        let panels = n.div_ceil(PANEL);
        let mut data = vec![0u16; panels * k2 * PANEL * 2];
        data.par_chunks_mut(k2 * PANEL * 2)
            .enumerate()
            .for_each(|(p, panel)| {
                for c in 0..PANEL.min(n - p * PANEL) {
                    let row = &w[(p * PANEL + c) * k..(p * PANEL + c + 1) * k];
                    for (i, &v) in row.iter().enumerate() {
                        panel[(i / 2) * PANEL * 2 + c * 2 + i % 2] = v;
                    }
                }
            });
        Self {
            n,
            k,
            data,
            transposed: OnceLock::new(),
        }
    }

    /// Pack a CPU bf16 tensor `[n, k]`.
    pub fn from_tensor(w: &candle_core::Tensor) -> candle_core::Result<Self> {
        let (n, k) = w.dims2()?;
        let w = w.detach().contiguous()?;
        let (storage, layout) = w.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            return Err(candle_core::Error::Msg(
                "packing a bf16 weight: not on the CPU".into(),
            ));
        };
        match super::weight_rows("pack", cpu, layout)? {
            super::WeightRows::Bf16(bits) => Ok(Self::pack(bits, n, k)),
            _ => Err(candle_core::Error::Msg(
                "packing a bf16 weight: the tensor is not bf16".into(),
            )),
        }
    }

    /// `[n, k]`.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The raw bits of element `(row, col)` of the `[n, k]` weight.
    fn at(&self, row: usize, col: usize) -> u16 {
        let k2 = self.k.div_ceil(2);
        let (p, c) = (row / PANEL, row % PANEL);
        self.data[p * k2 * PANEL * 2 + (col / 2) * PANEL * 2 + c * 2 + col % 2]
    }

    /// `Wᵀ` (`[k, n]`) packed for [`matmul_nt_packed`]: `g·W` as `g·(Wᵀ)ᵀ`,
    /// with `g`'s rows rounded to bf16 like any input. Built from this
    /// packing on first use and kept (as much memory again).
    pub(crate) fn transposed(&self) -> &PackedBf16 {
        self.transposed.get_or_init(|| {
            let (n, k) = (self.n, self.k);
            let mut t = vec![0u16; k * n];
            t.par_chunks_mut(n.max(1)).enumerate().for_each(|(i, row)| {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = self.at(j, i);
                }
            });
            Box::new(Self::pack(&t, k, n))
        })
    }
}

/// `y[m, n] = Σ_t bf16(x[m, 2t])·w[n, 2t] + bf16(x[m, 2t+1])·w[n, 2t+1]`,
/// one f32 accumulator per output, `t` in order.
pub(crate) fn matmul_nt_packed(x: &[f32], w: &PackedBf16, m: usize, y: &mut [f32]) {
    matmul_nt_packed_low_rank(x, w, m, y, None)
}

/// An f32 term `E·Fᵀ` (`E` `[m, rank]`, `F` `[n, rank]`) that
/// [`matmul_nt_packed_low_rank`] adds to each output's accumulator after its
/// bf16 sum: a LoRA update `s·(x·Aᵀ)·Bᵀ` (`E = x·Aᵀ`, `F = s·B`) or its input
/// gradient `(s·g·B)·A` (`F = Aᵀ`), without a second `[m, n]` pass.
#[derive(Clone, Copy)]
pub(crate) struct LowRank<'a> {
    /// `E`, `[m, rank]` row-major.
    pub e: &'a [f32],
    /// `Fᵀ`, `[rank, padded_cols(n)]` row-major, zero past column `n`.
    pub ft: &'a [f32],
    pub rank: usize,
}

/// Columns a [`LowRank`] factor's rows hold for an `n`-column output: `n`
/// rounded up to whole panels.
pub(crate) fn padded_cols(n: usize) -> usize {
    n.div_ceil(PANEL) * PANEL
}

/// Rows per work item: a multiple of the register tile's rows, few enough
/// that a layer with few panels (a 192-wide k/v projection is 3) still gives
/// every thread a share.
const ROW_BLOCK: usize = 96;

/// [`matmul_nt_packed`], then `y[i, c] += Σ_j E[i, j]·F[c, j]` (`j` in order,
/// one fused multiply-add each) in the same accumulator. Work items are
/// (panel, row block) pairs; they only decide which outputs a thread
/// computes, never an output's order of operations.
pub(crate) fn matmul_nt_packed_low_rank(
    x: &[f32],
    w: &PackedBf16,
    m: usize,
    y: &mut [f32],
    low: Option<LowRank<'_>>,
) {
    assert!(y.len() >= m * w.n);
    // SAFETY: `y` holds `m·n` floats.
    unsafe { packed_into(x, w, m, y.as_mut_ptr(), low) }
}

/// [`matmul_nt_packed_low_rank`] into a new `[m, n]` buffer, which the
/// kernel writes whole: no zero-filling first.
pub(crate) fn packed_product(
    x: &[f32],
    w: &PackedBf16,
    m: usize,
    low: Option<LowRank<'_>>,
) -> Vec<f32> {
    let len = m * w.n;
    let mut y: Vec<std::mem::MaybeUninit<f32>> = Vec::with_capacity(len);
    // SAFETY: `MaybeUninit` needs no initialization; the capacity is `len`.
    unsafe { y.set_len(len) };
    // SAFETY: `y` holds `m·n` floats.
    unsafe { packed_into(x, w, m, y.as_mut_ptr().cast(), low) };
    let mut y = std::mem::ManuallyDrop::new(y);
    // SAFETY: the work items cover every (row, column) of `y` exactly once,
    // so all `len` floats are initialized; same allocation, same layout.
    unsafe { Vec::from_raw_parts(y.as_mut_ptr().cast(), len, y.capacity()) }
}

/// # Safety
/// `y` must point to `m·n` writable floats.
unsafe fn packed_into(x: &[f32], w: &PackedBf16, m: usize, y: *mut f32, low: Option<LowRank<'_>>) {
    let (n, k) = (w.n, w.k);
    assert!(x.len() >= m * k);
    if let Some(l) = &low {
        assert!(l.e.len() >= m * l.rank && l.ft.len() >= l.rank * padded_cols(n));
    }
    if m == 0 || n == 0 {
        return;
    }
    let xb = rows_as_pairs(&x[..m * k], m, k);
    let kernel = packed_kernel();
    let out = SendPtr(y);
    let panels = n.div_ceil(PANEL);
    let blocks = m.div_ceil(ROW_BLOCK);
    let run = |item: usize| {
        let (p, b) = (item / blocks, item % blocks);
        let rows = b * ROW_BLOCK..((b + 1) * ROW_BLOCK).min(m);
        // SAFETY: item (p, b) writes only panel `p`'s columns of rows
        // `rows` of `y`, disjoint from every other item's; `y` outlives the
        // loop.
        unsafe { kernel(&xb, w, rows, p, out.get(), low) };
    };
    if m * n * k < SEQUENTIAL_WORK || rayon::current_num_threads() == 1 {
        (0..panels * blocks).for_each(run);
    } else {
        (0..panels * blocks).into_par_iter().for_each(run);
    }
}

/// Rows of `x` rounded to bf16, each padded to an even length (a zero pads
/// an odd `k`): `[m, 2·⌈k/2⌉]`.
fn rows_as_pairs(x: &[f32], m: usize, k: usize) -> Vec<u16> {
    let k2 = k.div_ceil(2);
    let mut xb = vec![0u16; m * k2 * 2];
    let round = round_row();
    let run = |(dst, src): (&mut [u16], &[f32])| {
        // SAFETY: `round_row` checked the CPU; `dst` holds at least `k`.
        unsafe { round(src, &mut dst[..k]) }
    };
    if m * k < 1 << 15 {
        xb.chunks_exact_mut(k2 * 2)
            .zip(x.chunks_exact(k))
            .for_each(run);
    } else {
        xb.par_chunks_exact_mut(k2 * 2)
            .zip(x.par_chunks_exact(k))
            .for_each(run);
    }
    xb
}

/// Rounds one row to bf16 bits (round to nearest even).
type RoundRow = unsafe fn(&[f32], &mut [u16]);

fn round_row() -> RoundRow {
    #[cfg(target_arch = "x86_64")]
    if bf16_dot_available() {
        return avx512_packed::round_row;
    }
    portable_round_row
}

/// # Safety
/// Always safe; `unsafe` for the [`RoundRow`] signature.
unsafe fn portable_round_row(x: &[f32], out: &mut [u16]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = half::bf16::from_f32(v).to_bits();
    }
}

/// Computes panel `p`'s columns of `y` for rows `rows` (`x` as bf16 pairs),
/// plus the low-rank term if any.
type PackedKernel =
    unsafe fn(&[u16], &PackedBf16, std::ops::Range<usize>, usize, *mut f32, Option<LowRank<'_>>);

fn packed_kernel() -> PackedKernel {
    #[cfg(target_arch = "x86_64")]
    if bf16_dot_available() {
        return avx512_packed::panel;
    }
    portable_packed::panel
}

mod portable_packed {
    use super::{padded_cols, LowRank, PackedBf16, PANEL};

    #[inline]
    fn f(b: u16) -> f32 {
        f32::from_bits((b as u32) << 16)
    }

    /// # Safety
    /// `y` must point to `m·n` writable floats for every row in `rows`; no
    /// other thread writes panel `p`'s columns of those rows.
    pub(super) unsafe fn panel(
        x: &[u16],
        w: &PackedBf16,
        rows: std::ops::Range<usize>,
        p: usize,
        y: *mut f32,
        low: Option<LowRank<'_>>,
    ) {
        // SAFETY: `i` runs over `rows` and `p·PANEL + c < n`: each write is in a row
        // and a column of panel `p` that the caller guarantees writable and
        // ours alone.
        unsafe {
            let (n, k2) = (w.n, w.k.div_ceil(2));
            let data = &w.data[p * k2 * PANEL * 2..(p + 1) * k2 * PANEL * 2];
            let cols = PANEL.min(n - p * PANEL);
            let ld = padded_cols(n);
            for i in rows {
                let xr = &x[i * k2 * 2..(i + 1) * k2 * 2];
                for c in 0..cols {
                    let mut acc = 0f32;
                    for t in 0..k2 {
                        let wp = &data[t * PANEL * 2 + c * 2..];
                        acc += f(xr[2 * t]) * f(wp[0]) + f(xr[2 * t + 1]) * f(wp[1]);
                    }
                    if let Some(l) = &low {
                        for j in 0..l.rank {
                            acc = l.e[i * l.rank + j].mul_add(l.ft[j * ld + p * PANEL + c], acc);
                        }
                    }
                    *y.add(i * n + p * PANEL + c) = acc;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512_packed {
    use std::arch::x86_64::*;

    use super::{padded_cols, LowRank, PackedBf16, PANEL};

    /// Rows per register tile: 6 rows × 4 vectors = 24 accumulators.
    const MR: usize = 6;

    /// `vcvtneps2bf16`, sixteen at a time (round to nearest even; the
    /// instruction treats denormal inputs as zero).
    ///
    /// # Safety
    /// The CPU must have AVX-512 BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx512vl")]
    pub(super) unsafe fn round_row(x: &[f32], out: &mut [u16]) {
        // SAFETY: AVX-512 BF16 is the caller's contract; loads and stores are
        // masked to the `lanes ≤ n - i` elements left, `n` being at most both
        // lengths; the transmute is between 256-bit vectors of the same size.
        unsafe {
            let n = out.len().min(x.len());
            let mut i = 0;
            while i < n {
                let lanes = (n - i).min(16);
                let mask = ((1u32 << lanes) - 1) as __mmask16;
                let v = _mm512_maskz_loadu_ps(mask, x.as_ptr().add(i));
                let b = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v));
                _mm256_mask_storeu_epi16(out.as_mut_ptr().add(i) as *mut i16, mask, b);
                i += lanes;
            }
        }
    }

    /// The low-rank term's pointers for one tile: `e` at the tile's first
    /// row (stride `rank`), `ft` at the panel's first column (stride `ld`).
    #[derive(Clone, Copy)]
    struct TileLow {
        e: *const f32,
        ft: *const f32,
        rank: usize,
        ld: usize,
    }

    /// # Safety
    /// The CPU must have AVX-512 BF16; `x` must point to `R` rows of `k2`
    /// readable bf16 pairs (stride `k2`), `w` to `k2` packed rows of `PANEL`
    /// pairs (stride `2·PANEL` u16), `y` to `R` rows (stride `ldy`) of `cols ≤
    /// PANEL` writable floats, and `low`'s `e` to `R` rows of `rank` floats,
    /// its `ft` to `rank` rows of `PANEL` floats (stride `ld`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn tile<const R: usize>(
        x: *const u32,
        k2: usize,
        w: *const u16,
        y: *mut f32,
        ldy: usize,
        cols: usize,
        low: Option<TileLow>,
    ) {
        // SAFETY: AVX-512 BF16 is the caller's contract; loads read pair row `t < k2`
        // of `w` (4 × 32 u16, one `PANEL`-wide row), `x[r·k2 + t]` and `low`'s
        // `R × rank` and `rank × PANEL` floats, stores are masked to `cols`
        // columns: all inside the caller's ranges. The transmutes reinterpret
        // 512-bit vectors of equal size.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 4]; R];
            for t in 0..k2 {
                let wp = w.add(t * PANEL * 2);
                let wv: [__m512bh; 4] = std::array::from_fn(|v| {
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                        wp.add(v * 32) as *const __m512i
                    ))
                });
                for (r, row) in acc.iter_mut().enumerate() {
                    let xp = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                        *x.add(r * k2 + t) as i32,
                    ));
                    for (a, v) in row.iter_mut().zip(&wv) {
                        *a = _mm512_dpbf16_ps(*a, xp, *v);
                    }
                }
            }
            if let Some(l) = low {
                for j in 0..l.rank {
                    let fp = l.ft.add(j * l.ld);
                    let fv: [__m512; 4] = std::array::from_fn(|v| _mm512_loadu_ps(fp.add(v * 16)));
                    for (r, row) in acc.iter_mut().enumerate() {
                        let ev = _mm512_set1_ps(*l.e.add(r * l.rank + j));
                        for (a, f) in row.iter_mut().zip(&fv) {
                            *a = _mm512_fmadd_ps(ev, *f, *a);
                        }
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for (v, a) in row.iter().enumerate() {
                    let lanes = cols.saturating_sub(v * 16).min(16);
                    if lanes == 0 {
                        break;
                    }
                    let mask = ((1u32 << lanes) - 1) as __mmask16;
                    _mm512_mask_storeu_ps(y.add(r * ldy + v * 16), mask, *a);
                }
            }
        }
    }

    /// # Safety
    /// The CPU must have AVX-512 BF16; see [`super::portable_packed::panel`].
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn panel(
        x: &[u16],
        w: &PackedBf16,
        rows: std::ops::Range<usize>,
        p: usize,
        y: *mut f32,
        low: Option<LowRank<'_>>,
    ) {
        // SAFETY: AVX-512 BF16 is the caller's contract. Panel `p`'s packed data starts
        // at `p·k2·2·PANEL` inside `w.data`; a row tile `i..i + R` (`R ≤ rows.end - i`)
        // gets `x` at row `i` (rows of `k2` pairs, as `rows_as_pairs` builds them),
        // `y` at row `i`, column `p·PANEL` (stride `n`, `cols` columns to the
        // panel's end) and `low` at row `i` of `e` and column `p·PANEL` of `ft`
        // (padded to whole panels, asserted by `packed_into`): what `tile` requires.
        unsafe {
            let (n, k2) = (w.n, w.k.div_ceil(2));
            let data = w.data.as_ptr().add(p * k2 * PANEL * 2);
            let cols = PANEL.min(n - p * PANEL);
            let x = x.as_ptr() as *const u32;
            let y = y.add(p * PANEL);
            let ld = padded_cols(n);
            let at = |i: usize| {
                low.map(|l| TileLow {
                    e: l.e.as_ptr().add(i * l.rank),
                    ft: l.ft.as_ptr().add(p * PANEL),
                    rank: l.rank,
                    ld,
                })
            };
            let mut i = rows.start;
            while i + MR <= rows.end {
                tile::<MR>(x.add(i * k2), k2, data, y.add(i * n), n, cols, at(i));
                i += MR;
            }
            let (xr, yr, lr) = (x.add(i * k2), y.add(i * n), at(i));
            match rows.end - i {
                5 => tile::<5>(xr, k2, data, yr, n, cols, lr),
                4 => tile::<4>(xr, k2, data, yr, n, cols, lr),
                3 => tile::<3>(xr, k2, data, yr, n, cols, lr),
                2 => tile::<2>(xr, k2, data, yr, n, cols, lr),
                1 => tile::<1>(xr, k2, data, yr, n, cols, lr),
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::kernels::test_util::rand_vec as rand;

    fn to_f32(b: &[u16]) -> Vec<f32> {
        b.iter()
            .map(|&v| f32::from_bits((v as u32) << 16))
            .collect()
    }

    #[test]
    fn matches_an_f64_reference_of_the_rounded_inputs() {
        for &(m, n, k) in &[
            (1, 1, 1),
            (5, 7, 9),
            (37, 53, 37),
            (13, 97, 576),
            (4, 200, 1536),
            (9, 50, 33),
        ] {
            let x = rand(m * k, 1);
            let w = round_to_bf16(&rand(n * k, 2));
            let mut y = vec![0f32; m * n];
            matmul_nt_bf16(&x, &w, m, n, k, &mut y);
            let (xr, wr) = (to_f32(&round_to_bf16(&x)), to_f32(&w));
            for i in 0..m {
                for j in 0..n {
                    let r: f64 = (0..k)
                        .map(|t| xr[i * k + t] as f64 * wr[j * k + t] as f64)
                        .sum();
                    let d = (y[i * n + j] as f64 - r).abs();
                    assert!(d < 1e-5 * (k as f64).sqrt(), "{m}x{n}x{k} ({i},{j}): {d}");
                }
            }
        }
    }

    /// `Fᵀ` `[rank, padded_cols(n)]` for a random `F` `[n, rank]`.
    fn factor(n: usize, rank: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let f = rand(n * rank, seed);
        let ld = padded_cols(n);
        let mut ft = vec![0f32; rank * ld];
        for c in 0..n {
            for j in 0..rank {
                ft[j * ld + c] = f[c * rank + j];
            }
        }
        (f, ft)
    }

    #[test]
    fn the_low_rank_term_is_added_to_each_output() {
        for &(m, n, k, rank) in &[
            (1, 1, 1, 1),
            (13, 97, 576, 16),
            (100, 200, 64, 8),
            (7, 64, 9, 3),
        ] {
            let x = rand(m * k, 11);
            let w = round_to_bf16(&rand(n * k, 12));
            let e = rand(m * rank, 13);
            let (f, ft) = factor(n, rank, 14);
            let mut y = vec![0f32; m * n];
            let low = LowRank {
                e: &e,
                ft: &ft,
                rank,
            };
            let packed = PackedBf16::pack(&w, n, k);
            matmul_nt_packed_low_rank(&x, &packed, m, &mut y, Some(low));
            let (xr, wr) = (to_f32(&round_to_bf16(&x)), to_f32(&w));
            for i in 0..m {
                for c in 0..n {
                    let r: f64 = (0..k)
                        .map(|t| xr[i * k + t] as f64 * wr[c * k + t] as f64)
                        .sum::<f64>()
                        + (0..rank)
                            .map(|j| e[i * rank + j] as f64 * f[c * rank + j] as f64)
                            .sum::<f64>();
                    let d = (y[i * n + c] as f64 - r).abs();
                    assert!(
                        d < 1e-5 * ((k + rank) as f64).sqrt(),
                        "{m}x{n}x{k} r{rank} ({i},{c}): {d}"
                    );
                }
            }
            // The portable loop: same order of operations.
            let k2 = k.div_ceil(2);
            let mut xb = vec![0u16; m * k2 * 2];
            for (d, s) in xb.chunks_exact_mut(k2 * 2).zip(round_to_bf16(&x).chunks(k)) {
                d[..k].copy_from_slice(s);
            }
            let mut p = vec![0f32; m * n];
            for panel in 0..n.div_ceil(PANEL) {
                // SAFETY: `p` holds m·n floats; one thread.
                unsafe {
                    portable_packed::panel(&xb, &packed, 0..m, panel, p.as_mut_ptr(), Some(low))
                };
            }
            for (i, (a, b)) in y.iter().zip(&p).enumerate() {
                assert!((a - b).abs() < 1e-4, "output {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn a_rows_result_does_not_depend_on_the_call() {
        for &(n, k) in &[(53, 37), (97, 576), (300, 64), (192, 576)] {
            let m = 400;
            let x = rand(m * k, 3);
            let w = round_to_bf16(&rand(n * k, 4));
            let rank = 5;
            let e = rand(m * rank, 5);
            let (_, ft) = factor(n, rank, 6);
            let packed = PackedBf16::pack(&w, n, k);
            let call = |start: usize, len: usize, y: &mut [f32]| {
                let low = LowRank {
                    e: &e[start * rank..(start + len) * rank],
                    ft: &ft,
                    rank,
                };
                matmul_nt_packed_low_rank(&x[start * k..], &packed, len, y, Some(low));
            };
            let mut full = vec![0f32; m * n];
            call(0, m, &mut full);
            for &(start, len) in &[
                (0, 1),
                (7, 1),
                (399, 1),
                (3, 2),
                (10, 5),
                (1, 150),
                (95, 200),
            ] {
                let mut part = vec![0f32; len * n];
                call(start, len, &mut part);
                let want = &full[start * n..(start + len) * n];
                assert!(
                    part.iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "n={n} k={k}: rows {start}..{} differ",
                    start + len
                );
            }
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut y = vec![0f32; m * n];
                pool.install(|| call(0, m, &mut y));
                assert!(
                    y.iter().zip(&full).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{threads} threads"
                );
            }
        }
    }

    /// The SIMD kernel and the portable loop reduce in the same order; on
    /// these inputs they agree to within a few ulps.
    #[test]
    fn the_portable_loop_agrees_with_the_dispatched_kernel() {
        let (m, n, k) = (7, 70, 101);
        let x = to_f32(&round_to_bf16(&rand(m * k, 5)));
        let w = PackedBf16::pack(&round_to_bf16(&rand(n * k, 6)), n, k);
        let mut y = vec![0f32; m * n];
        matmul_nt_packed(&x, &w, m, &mut y);
        let k2 = k.div_ceil(2);
        let mut xb = vec![0u16; m * k2 * 2];
        for (d, s) in xb.chunks_exact_mut(k2 * 2).zip(round_to_bf16(&x).chunks(k)) {
            d[..k].copy_from_slice(s);
        }
        let mut p = vec![0f32; m * n];
        for panel in 0..n.div_ceil(PANEL) {
            // SAFETY: `p` holds m·n floats; one thread.
            unsafe { portable_packed::panel(&xb, &w, 0..m, panel, p.as_mut_ptr(), None) };
        }
        for (i, (a, b)) in y.iter().zip(&p).enumerate() {
            assert!((a - b).abs() < 1e-5, "output {i}: {a} vs {b}");
        }
    }
}
