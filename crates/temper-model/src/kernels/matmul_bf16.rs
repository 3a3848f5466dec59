//! `y = x·Wᵀ` with `W` stored in bf16: `x` is rounded to bf16 (round to
//! nearest even), each product of two bf16 values is exact in f32, and the
//! sums are f32. This is what `--dtype bf16` runs for every linear layer and
//! the LM head; it halves the bytes read per token and, with the CPU's
//! `avx512_bf16` dot-product instruction (`vdpbf16ps`), doubles the
//! multiply-adds per instruction.
//!
//! # Invariance
//! The same contract as the f32 [`super::matmul_nt`]: output `(m, n)` is
//! always `dot(bf16(x[m, :]), w[n, :])` reduced the same way — sixteen f32
//! lanes, lane `l` taking the pairs `k = 32s + 2l, 32s + 2l + 1` in `s`
//! order, then the lanes added in a fixed tree. Tiling and threads only
//! decide which outputs a loop computes. A row's bits therefore do not
//! depend on the call's row count, the row's position or the thread count,
//! in a decode step, a prefill chunk or a training pass alike.
//!
//! CPUs without `avx512_bf16` get a portable loop with the same lane
//! structure (its rounding of each pair may differ from the instruction's;
//! one process only ever uses one of the two).

use std::sync::OnceLock;

use half::bf16;
use rayon::prelude::*;

use super::matmul::SendPtr;

/// Below this many multiply-adds a call runs on the calling thread.
const SEQUENTIAL_WORK: usize = 1 << 17;
/// Rows of `x` per register tile.
const MR: usize = 4;
/// Rows of `W` per register tile.
const NR: usize = 3;
/// Weight rows per work item (a block of `W` that stays in L2).
const N_BLOCK: usize = 48;
/// Calls with at most this many rows stream the weights one row at a time
/// (see the f32 kernel's `STREAM_ROWS`).
const STREAM_ROWS: usize = 8;
/// bf16 values per 512-bit vector.
const LANES16: usize = 32;

/// `x` rounded to bf16 (round to nearest even), as raw bits.
pub(crate) fn round_to_bf16(x: &[f32]) -> Vec<u16> {
    let mut out = vec![0u16; x.len()];
    let run = |(o, x): (&mut [u16], &[f32])| {
        for (o, &v) in o.iter_mut().zip(x) {
            *o = bf16::from_f32(v).to_bits();
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

/// `y[m, n] = dot(bf16(x[m, :]), w[n, :])` into `y` (`[m, n]`, row-major),
/// `w` the raw bits of a `[n, k]` bf16 matrix.
pub(crate) fn matmul_nt_bf16(x: &[f32], w: &[u16], m: usize, n: usize, k: usize, y: &mut [f32]) {
    assert!(x.len() >= m * k && w.len() >= n * k && y.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    let xb = round_to_bf16(&x[..m * k]);
    let kernel = kernel();
    let out = SendPtr(y.as_mut_ptr());
    let blocks = n.div_ceil(N_BLOCK);
    let run = |b: usize| {
        let n0 = b * N_BLOCK;
        let n1 = (n0 + N_BLOCK).min(n);
        // SAFETY: block `b` writes only columns `n0..n1` of `y`, disjoint
        // from every other block's; `y` outlives the loop.
        unsafe { kernel(&xb, w, m, n, k, n0, n1, out.get()) };
    };
    if m * n * k < SEQUENTIAL_WORK || rayon::current_num_threads() == 1 {
        (0..blocks).for_each(run);
    } else {
        (0..blocks).into_par_iter().for_each(run);
    }
}

/// Computes columns `n0..n1` of `y` for every row (`x` already bf16).
type Kernel = unsafe fn(&[u16], &[u16], usize, usize, usize, usize, usize, *mut f32);

fn kernel() -> Kernel {
    static K: OnceLock<Kernel> = OnceLock::new();
    *K.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if bf16_dot_available() {
            return avx512::block;
        }
        portable::block
    })
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

mod portable {
    use super::LANES16;

    #[inline]
    fn f(b: u16) -> f32 {
        f32::from_bits((b as u32) << 16)
    }

    /// The sixteen-lane dot product of two bf16 rows.
    pub(super) fn dot(x: &[u16], w: &[u16]) -> f32 {
        let mut acc = [0f32; 16];
        for (xc, wc) in x.chunks(LANES16).zip(w.chunks(LANES16)) {
            for (l, a) in acc.iter_mut().enumerate() {
                let (i0, i1) = (2 * l, 2 * l + 1);
                if i0 < xc.len() {
                    *a += f(xc[i0]) * f(wc[i0]);
                }
                if i1 < xc.len() {
                    *a += f(xc[i1]) * f(wc[i1]);
                }
            }
        }
        super::hsum16(&acc)
    }

    /// # Safety
    /// `y` must point to `m·n` writable floats; no other thread writes
    /// columns `n0..n1`.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn block(
        x: &[u16],
        w: &[u16],
        m: usize,
        n: usize,
        k: usize,
        n0: usize,
        n1: usize,
        y: *mut f32,
    ) {
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            for j in n0..n1 {
                *y.add(i * n + j) = dot(xr, &w[j * k..(j + 1) * k]);
            }
        }
    }
}

/// Sixteen lanes summed in a fixed tree: halves, then quarters, then the
/// eight-lane order of the f32 kernels.
#[inline(always)]
fn hsum16(a: &[f32; 16]) -> f32 {
    let h: [f32; 8] = std::array::from_fn(|l| a[l] + a[l + 8]);
    ((h[0] + h[4]) + (h[2] + h[6])) + ((h[1] + h[5]) + (h[3] + h[7]))
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{LANES16, MR, NR, STREAM_ROWS};

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn load(p: *const u16) -> __m512bh {
        std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const __m512i))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn load_tail(p: *const u16, mask: __mmask32) -> __m512bh {
        std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(mask, p as *const i16))
    }

    /// The lanes in [`super::hsum16`]'s order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn hsum(v: __m512) -> f32 {
        let h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
        let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }

    /// One `R×C` tile: bf16 rows `x[0..R]` against weight rows `w[0..C]`
    /// (both stride `k`), written to `y` (row stride `ldy`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn tile<const R: usize, const C: usize>(
        x: *const u16,
        w: *const u16,
        k: usize,
        y: *mut f32,
        ldy: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let kf = k - k % LANES16;
        let mut kk = 0;
        while kk < kf {
            let mut wv = [load(w); C];
            for (c, v) in wv.iter_mut().enumerate() {
                *v = load(w.add(c * k + kk));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let xv = load(x.add(r * k + kk));
                for (a, v) in row.iter_mut().zip(&wv) {
                    *a = _mm512_dpbf16_ps(*a, xv, *v);
                }
            }
            kk += LANES16;
        }
        if kf < k {
            let mask = ((1u64 << (k - kf)) - 1) as __mmask32;
            let mut wv = [load_tail(w, 0); C];
            for (c, v) in wv.iter_mut().enumerate() {
                *v = load_tail(w.add(c * k + kf), mask);
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let xv = load_tail(x.add(r * k + kf), mask);
                for (a, v) in row.iter_mut().zip(&wv) {
                    *a = _mm512_dpbf16_ps(*a, xv, *v);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (c, a) in row.iter().enumerate() {
                *y.add(r * ldy + c) = hsum(*a);
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_row<const R: usize>(
        x: *const u16,
        w: *const u16,
        k: usize,
        n0: usize,
        n1: usize,
        y: *mut f32,
        ldy: usize,
        narrow: bool,
    ) {
        let mut j = n0;
        if narrow {
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

    /// # Safety
    /// The CPU must have AVX-512 BF16; `y` must point to `m·n` writable
    /// floats; no other thread writes columns `n0..n1`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn block(
        x: &[u16],
        w: &[u16],
        m: usize,
        n: usize,
        k: usize,
        n0: usize,
        n1: usize,
        y: *mut f32,
    ) {
        let (x, w) = (x.as_ptr(), w.as_ptr());
        let narrow = m <= STREAM_ROWS;
        let mut i = 0;
        while i + MR <= m {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn rand(len: usize, seed: u64) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

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

    #[test]
    fn a_rows_result_does_not_depend_on_the_call() {
        for &(n, k) in &[(53, 37), (97, 576), (300, 64)] {
            let m = 160;
            let x = rand(m * k, 3);
            let w = round_to_bf16(&rand(n * k, 4));
            let mut full = vec![0f32; m * n];
            matmul_nt_bf16(&x, &w, m, n, k, &mut full);
            for &(start, len) in &[(0, 1), (7, 1), (159, 1), (3, 2), (10, 5), (1, 150)] {
                let mut part = vec![0f32; len * n];
                matmul_nt_bf16(&x[start * k..(start + len) * k], &w, len, n, k, &mut part);
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
                pool.install(|| matmul_nt_bf16(&x, &w, m, n, k, &mut y));
                assert!(
                    y.iter().zip(&full).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{threads} threads"
                );
            }
        }
    }

    /// The SIMD kernel and the portable loop reduce in the same lane order;
    /// on these inputs (no cancellation near the rounding boundary) they
    /// agree to within a few ulps.
    #[test]
    fn the_portable_loop_agrees_with_the_dispatched_kernel() {
        let (m, n, k) = (6, 11, 100);
        let x = round_to_bf16(&rand(m * k, 5));
        let w = round_to_bf16(&rand(n * k, 6));
        let mut y = vec![0f32; m * n];
        matmul_nt_bf16(&to_f32(&x), &w, m, n, k, &mut y);
        for i in 0..m {
            for j in 0..n {
                let p = portable::dot(&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
                assert!(
                    (p - y[i * n + j]).abs() < 1e-5,
                    "({i},{j}): {p} vs {}",
                    y[i * n + j]
                );
            }
        }
    }
}
