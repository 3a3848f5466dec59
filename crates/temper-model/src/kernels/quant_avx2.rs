//! The quantized matmul decoded in AVX2 registers (`--dtype gguf`).
//!
//! Eight weights at a time are decoded from their block into a `__m256`
//! (bytes widened to `i32` lanes, nibbles, fifth bits and bit pairs masked
//! out, converted to f32, then scaled: `q·d`, `q·d + m` or `d₁·q − m₁`
//! with one `vmulps` and one `vaddps`/`vsubps`, never fused, so each lane
//! holds exactly the value the loader's dequantization computes) and used
//! straight away by the f32 kernel's arithmetic: one fused multiply-add per
//! activation row into eight lane sums over `k = l, l+8, …` in `k` order,
//! the lanes added in [`super::matmul`]'s fixed tree. Every output is
//! therefore the very reduction `matmul_nt_f32` computes on the dequantized
//! weight, whatever the number of rows in the call.
//!
//! Calls of at most [`FUSED_ROWS`] rows (decode steps) decode each weight
//! row once and run all their activation rows against it, so no f32 copy of
//! the weight is ever written. Longer calls (prefill, training) dequantize a
//! block of rows with the same decoders into a cache-resident buffer and run
//! the f32 kernel's register tiles on it: there the decoding is shared by
//! every row of the call.
//!
//! Tried and dropped: decoding the 4-bit formats by a 16-entry table per
//! block (AVX-512VL `vpermt2ps`, the same values in fewer instructions) ran
//! 15% slower per weight than this arithmetic on Zen 4.
//!
//! Every format `quant` keeps has a decoder here (Q8_0, Q4_0, Q4_1, Q5_0,
//! Q5_1, Q4_K, Q5_K, Q6_K), each tested bit-identical to the portable
//! dequantization, which remains for CPUs without AVX2, FMA and F16C.

use std::arch::x86_64::*;

use super::quant::{QuantFormat, QuantRows};

/// Calls with at most this many rows decode in registers and never write
/// the f32 weight (the f32 kernel's `STREAM_ROWS`).
pub(super) const FUSED_ROWS: usize = 8;

const Q8_0: u8 = 0;
const Q4_0: u8 = 1;
const Q4_1: u8 = 2;
const Q5_0: u8 = 3;
const Q5_1: u8 = 4;
const Q4K: u8 = 5;
const Q5K: u8 = 6;
const Q6K: u8 = 7;

/// Whether this path runs: the CPU has AVX2 and FMA — the f32 kernel then
/// runs its AVX2 tiles, whose rounding this path reproduces — and F16C (every
/// such CPU has it) for the block scales.
pub(super) fn available() -> bool {
    static A: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *A.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    })
}

/// The little-endian f16 at `p` as f32 (exact), with one `vcvtph2ps`: the
/// `half` crate's portable conversion would cost more than the 32 values
/// it scales.
///
/// # Safety
/// The CPU must have F16C; `p` must point to two readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: F16C and the two bytes are the caller's contract.
    unsafe {
        let bits = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }
}

/// Eight bytes at `p` widened to eight `i32` lanes (`u8` values).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `p` must point to 8 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes8(p: *const u8) -> __m256i {
    // SAFETY: AVX2 and the 8 bytes are the caller's contract.
    unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)) }
}

/// The 32 values of group `g` (values `32g..32g+32` of the row) as four
/// vectors of eight, in `k` order; each lane the loader's value.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `row` must point to a whole row of `F`'s
/// blocks holding value `32g + 31`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group<const F: u8>(row: *const u8, g: usize) -> [__m256; 4] {
    // SAFETY: every read is inside the block holding group `g`, at the
    // offsets `ggml-common.h`'s layout gives (see `quant`'s module docs).
    unsafe {
        let nib = _mm256_set1_epi32(0x0F);
        let mut w = [_mm256_setzero_ps(); 4];
        match F {
            Q8_0 => {
                let blk = row.add(34 * g);
                let d = _mm256_set1_ps(f16_at(blk));
                for (c, w) in w.iter_mut().enumerate() {
                    let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(blk.add(2 + 8 * c) as *const _));
                    *w = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
                }
            }
            Q4_0 | Q4_1 | Q5_0 | Q5_1 => {
                // Q4_0 and Q5_0 store values around 8 / 16 (subtracted from
                // the integer, then converted: exact) and no `m`; Q4_1 and
                // Q5_1 multiply, then add `m`. The Q5s add a fifth bit.
                let five = F == Q5_0 || F == Q5_1;
                let centred = F == Q4_0 || F == Q5_0;
                let (size, qh, qs) = match F {
                    Q4_0 => (18, 0, 2),
                    Q4_1 => (20, 0, 4),
                    Q5_0 => (22, 2, 6),
                    _ => (24, 4, 8),
                };
                let blk = row.add(size * g);
                let d = _mm256_set1_ps(f16_at(blk));
                let m = _mm256_set1_ps(if centred { 0.0 } else { f16_at(blk.add(2)) });
                let bias = _mm256_set1_epi32(if five { 16 } else { 8 });
                // Value `v`'s fifth bit is bit `v` of the little-endian
                // `u32` `qh`: every lane holds all 32 and shifts its own
                // down (`vpsrlvd`), lane `l` of vector `i` being value `8i + l`.
                let bits = if five {
                    _mm256_set1_epi32((blk.add(qh) as *const i32).read_unaligned())
                } else {
                    _mm256_setzero_si256()
                };
                let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let one = _mm256_set1_epi32(1);
                for c in 0..2 {
                    let b = bytes8(blk.add(qs + 8 * c));
                    let lo = _mm256_and_si256(b, nib);
                    let hi = _mm256_srli_epi32(b, 4);
                    for (i, q) in [(c, lo), (c + 2, hi)] {
                        let q = if five {
                            let at = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * i as i32));
                            let h = _mm256_and_si256(_mm256_srlv_epi32(bits, at), one);
                            _mm256_or_si256(q, _mm256_slli_epi32(h, 4))
                        } else {
                            q
                        };
                        w[i] = if centred {
                            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, bias)), d)
                        } else {
                            _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d), m)
                        };
                    }
                }
            }
            Q4K | Q5K => {
                // Q5_K is Q4_K's nibbles plus bit `s` of `qh[l]` as the fifth.
                let five = F == Q5K;
                let (blk, s) = (row.add(if five { 176 } else { 144 } * (g / 8)), g % 8);
                let (d, dmin) = (f16_at(blk), f16_at(blk.add(2)));
                let scales = std::slice::from_raw_parts(blk.add(4), 12);
                let (sc, mn) = super::quant::scale_min_k4(s, scales);
                let d1 = _mm256_set1_ps(d * sc as f32);
                let m1 = _mm256_set1_ps(dmin * mn as f32);
                let qh = blk.add(16);
                let qs = blk.add(if five { 48 } else { 16 } + 32 * (s / 2));
                let shift = _mm_cvtsi32_si128(4 * (s % 2) as i32);
                let hshift = _mm_cvtsi32_si128(s as i32);
                let one = _mm256_set1_epi32(1);
                for (c, w) in w.iter_mut().enumerate() {
                    let mut q =
                        _mm256_and_si256(_mm256_srl_epi32(bytes8(qs.add(8 * c)), shift), nib);
                    if five {
                        let h =
                            _mm256_and_si256(_mm256_srl_epi32(bytes8(qh.add(8 * c)), hshift), one);
                        q = _mm256_or_si256(q, _mm256_slli_epi32(h, 4));
                    }
                    *w = _mm256_sub_ps(_mm256_mul_ps(d1, _mm256_cvtepi32_ps(q)), m1);
                }
            }
            Q6K => {
                let (blk, q) = (row.add(210 * (g / 8)), g % 8);
                let (h, i) = (q / 4, q % 4);
                let d = f16_at(blk.add(208));
                let ql = blk.add(64 * h + 32 * (i % 2));
                let qh = blk.add(128 + 32 * h);
                let sc = blk.add(192 + 8 * h);
                let lshift = _mm_cvtsi32_si128(4 * (i / 2) as i32);
                let hshift = _mm_cvtsi32_si128(2 * i as i32);
                let (three, bias) = (_mm256_set1_epi32(3), _mm256_set1_epi32(32));
                for (c, w) in w.iter_mut().enumerate() {
                    let l0 = 8 * c;
                    let ds = _mm256_set1_ps(d * (*sc.add(l0 / 16 + 2 * i) as i8) as f32);
                    let lo = _mm256_and_si256(_mm256_srl_epi32(bytes8(ql.add(l0)), lshift), nib);
                    let hi = _mm256_and_si256(_mm256_srl_epi32(bytes8(qh.add(l0)), hshift), three);
                    let v = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), bias);
                    *w = _mm256_mul_ps(ds, _mm256_cvtepi32_ps(v));
                }
            }
            _ => unreachable!("no register decoder for format {F}"),
        }
        w
    }
}

/// `R` activation rows (stride `k`) against `NR` consecutive quantized
/// weight rows (`rb` bytes apart): `y[r·ldy + j] = dot(x[r], w[j])` with the
/// f32 kernel's lanes and tree.
///
/// Each output's eight lane sums are one chain of dependent fused
/// multiply-adds in `k` order; with one activation row, a lone chain would
/// wait out the multiply-add latency at every step. Taking `NR` weight rows
/// together gives the core `R·NR` independent chains to overlap, each in
/// its own order, so the bits do not depend on `NR` (1.5–2.7× faster per
/// weight at one row on Zen 4 with `NR = 4`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `x` must point to `R` rows of `k`
/// floats, `row` to `NR` weight rows of `k` values in `F`'s blocks, `rb`
/// bytes apart, `y` to `R` rows of `NR` writable floats at stride `ldy`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_dot<const F: u8, const R: usize, const NR: usize>(
    x: *const f32,
    k: usize,
    row: *const u8,
    rb: usize,
    y: *mut f32,
    ldy: usize,
) {
    // SAFETY: reads stay inside `R` rows of `x` and the `NR` weight rows
    // (`g < k/32`); writes are the `R·NR` outputs the caller provides.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); R]; NR];
        let groups = k / 32;
        let next = row.wrapping_add(PREFETCH_AHEAD * NR * rb);
        let lines = (NR * rb).div_ceil(64);
        for g in 0..groups {
            for l in g * lines / groups..(g + 1) * lines / groups {
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(64 * l) as *const i8);
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let w = group::<F>(row.add(j * rb), g);
                for (c, w) in w.iter().enumerate() {
                    for (r, a) in acc.iter_mut().enumerate() {
                        let xv = _mm256_loadu_ps(x.add(r * k + 32 * g + 8 * c));
                        *a = _mm256_fmadd_ps(xv, *w, *a);
                    }
                }
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            for (r, a) in acc.iter().enumerate() {
                *y.add(r * ldy + j) = super::matmul::hsum_avx2(*a);
            }
        }
    }
}

/// How many groups of `NR` rows ahead [`rows_dot`] asks for the weight's
/// cache lines. A decode step reads each weight once from memory; with
/// `NR` rows read side by side, the hardware prefetcher alone left
/// SmolLM2's decode slower than one row at a time, and asking one group
/// ahead made it faster than both.
const PREFETCH_AHEAD: usize = 1;

/// Weight rows `n0..n1` against `R` activation rows, `NR` rows at a time
/// and the last `< NR` one by one.
///
/// # Safety
/// As [`rows_dot`] for every row `j` in `n0..n1` (`bytes` the first row).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_block<const F: u8, const R: usize, const NR: usize>(
    x: *const f32,
    k: usize,
    bytes: *const u8,
    rb: usize,
    n0: usize,
    n1: usize,
    y: *mut f32,
    ldy: usize,
) {
    // SAFETY: forwarded contract, row by row.
    unsafe {
        let mut j = n0;
        while j + NR <= n1 {
            rows_dot::<F, R, NR>(x, k, bytes.add(j * rb), rb, y.add(j), ldy);
            j += NR;
        }
        while j < n1 {
            rows_dot::<F, R, 1>(x, k, bytes.add(j * rb), rb, y.add(j), ldy);
            j += 1;
        }
    }
}

/// Weight rows `n0..n1` against all `m ≤ FUSED_ROWS` rows of `x`, taking
/// several weight rows at once while the chains fit the registers: four
/// with one or two activation rows, two with three to five, one above
/// (chosen by measurement on Zen 4: more spills and runs slower).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `x` must hold `m·k` floats, `w` rows
/// `0..n1`, `y` point to `m·n` floats of which no other thread writes
/// columns `n0..n1`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn fused_block<const F: u8>(
    x: &[f32],
    w: QuantRows<'_>,
    m: usize,
    n: usize,
    k: usize,
    n0: usize,
    n1: usize,
    y: *mut f32,
) {
    let rb = w.format.row_bytes(k);
    let (x, b) = (x.as_ptr(), w.bytes.as_ptr());
    // SAFETY: weight row `j < n1` lies in `w.bytes`; output `(i, j)` with
    // `i < m`, `n0 ≤ j < n1` is the caller's to write.
    unsafe {
        match m {
            1 => rows_block::<F, 1, 4>(x, k, b, rb, n0, n1, y, n),
            2 => rows_block::<F, 2, 4>(x, k, b, rb, n0, n1, y, n),
            3 => rows_block::<F, 3, 2>(x, k, b, rb, n0, n1, y, n),
            4 => rows_block::<F, 4, 2>(x, k, b, rb, n0, n1, y, n),
            5 => rows_block::<F, 5, 2>(x, k, b, rb, n0, n1, y, n),
            6 => rows_block::<F, 6, 1>(x, k, b, rb, n0, n1, y, n),
            7 => rows_block::<F, 7, 1>(x, k, b, rb, n0, n1, y, n),
            8 => rows_block::<F, 8, 1>(x, k, b, rb, n0, n1, y, n),
            _ => unreachable!("fused_block takes at most {FUSED_ROWS} rows"),
        }
    }
}

/// Columns `n0..n1` of `y = x·Wᵀ` for `m ≤ FUSED_ROWS` rows, decoding in
/// registers.
///
/// # Safety
/// As [`fused_block`]; the CPU must pass [`available`].
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn fused(
    x: &[f32],
    w: QuantRows<'_>,
    m: usize,
    n: usize,
    k: usize,
    n0: usize,
    n1: usize,
    y: *mut f32,
) {
    // SAFETY: forwarded contract.
    unsafe {
        match w.format {
            QuantFormat::Q8_0 => fused_block::<Q8_0>(x, w, m, n, k, n0, n1, y),
            QuantFormat::Q4_0 => fused_block::<Q4_0>(x, w, m, n, k, n0, n1, y),
            QuantFormat::Q4_1 => fused_block::<Q4_1>(x, w, m, n, k, n0, n1, y),
            QuantFormat::Q5_0 => fused_block::<Q5_0>(x, w, m, n, k, n0, n1, y),
            QuantFormat::Q5_1 => fused_block::<Q5_1>(x, w, m, n, k, n0, n1, y),
            QuantFormat::Q4K => fused_block::<Q4K>(x, w, m, n, k, n0, n1, y),
            QuantFormat::Q5K => fused_block::<Q5K>(x, w, m, n, k, n0, n1, y),
            QuantFormat::Q6K => fused_block::<Q6K>(x, w, m, n, k, n0, n1, y),
        }
    }
}

/// Rows `r0..r1` as f32 into `out` with the register decoders.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `out` must hold `(r1 − r0)·cols` floats.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_rows<const F: u8>(w: QuantRows<'_>, r0: usize, r1: usize, out: &mut [f32]) {
    let (k, rb) = (w.cols, w.format.row_bytes(w.cols));
    assert!(out.len() >= (r1 - r0) * k && w.bytes.len() >= r1 * rb);
    // SAFETY: row `r < r1` lies in `w.bytes`; group `g < k/32` of output
    // row `r − r0` is inside `out` (asserted above).
    unsafe {
        for r in r0..r1 {
            let row = w.bytes.as_ptr().add(r * rb);
            let o = out.as_mut_ptr().add((r - r0) * k);
            for g in 0..k / 32 {
                for (c, v) in group::<F>(row, g).iter().enumerate() {
                    _mm256_storeu_ps(o.add(32 * g + 8 * c), *v);
                }
            }
        }
    }
}

/// Rows `r0..r1` of `w` as f32 into `out` (`(r1 − r0)·cols` floats).
///
/// # Safety
/// The CPU must pass [`available`].
pub(super) unsafe fn dequantize(w: QuantRows<'_>, r0: usize, r1: usize, out: &mut [f32]) {
    // SAFETY: forwarded contract.
    unsafe {
        match w.format {
            QuantFormat::Q8_0 => dequantize_rows::<Q8_0>(w, r0, r1, out),
            QuantFormat::Q4_0 => dequantize_rows::<Q4_0>(w, r0, r1, out),
            QuantFormat::Q4_1 => dequantize_rows::<Q4_1>(w, r0, r1, out),
            QuantFormat::Q5_0 => dequantize_rows::<Q5_0>(w, r0, r1, out),
            QuantFormat::Q5_1 => dequantize_rows::<Q5_1>(w, r0, r1, out),
            QuantFormat::Q4K => dequantize_rows::<Q4K>(w, r0, r1, out),
            QuantFormat::Q5K => dequantize_rows::<Q5K>(w, r0, r1, out),
            QuantFormat::Q6K => dequantize_rows::<Q6K>(w, r0, r1, out),
        }
    }
}
