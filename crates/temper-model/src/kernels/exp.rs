//! `eˣ` in f32 as plain arithmetic the compiler vectorizes, for the softmax
//! and SiLU loops (libm's `expf` is a call per element: 4–6% of a SmolLM2
//! training step went to it).
//!
//! Cephes' `expf`: `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2`, a degree-7
//! polynomial for `eʳ` and `2ⁿ` built from its exponent bits; within 2 ulp
//! of the true value. Only IEEE multiplies, adds, conversions and comparisons —
//! Rust never fuses them — so the scalar, SSE and AVX2 compilations of a loop
//! give the same bits, and a row's softmax is the same whichever runs it.

/// Below this `eˣ` is under f32's smallest normal: 0.
const LO: f32 = -87.336_55;
/// Above this `2ⁿ` would overflow: +∞.
const HI: f32 = 88.376_26;

/// `eˣ` (see the module docs); NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so `n·C1` is exact.
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // Adding 1.5·2²³ rounds to an integer, which lands in the low mantissa
    // bits: `n` as a float and as an integer without a conversion (the
    // saturating `as i32` does not vectorize).
    const MAGIC: f32 = 12_582_912.0;
    let xc = x.clamp(LO, HI);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let ni = t.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    let r = (xc - n * C1) - n * C2;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = (p * (r * r) + r) + 1.0;
    let two_n = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    let y = e * two_n;
    let y = if x < LO { 0.0 } else { y };
    let y = if x > HI { f32::INFINITY } else { y };
    if x.is_nan() {
        x
    } else {
        y
    }
}

twice_compiled! {
    /// `out[i] = e^((x[i] − shift)·scale)` (a sampling distribution's
    /// unnormalised weights); returns their sum in f64, eight interleaved
    /// lanes added in a fixed order.
    fn exp_scaled / exp_scaled_body(x: &[f32], shift: f32, scale: f32, out: &mut [f32]) -> f64
}

#[inline(always)]
fn exp_scaled_body(x: &[f32], shift: f32, scale: f32, out: &mut [f32]) -> f64 {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = exp((v - shift) * scale);
    }
    let mut lanes = [0f64; 8];
    let chunks = out.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += v as f64;
        }
    }
    for (l, &v) in lanes.iter_mut().zip(rest) {
        *l += v as f64;
    }
    ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6]))
        + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))
}

/// [`exp_scaled`] for callers outside the kernels.
pub(crate) fn exp_weights(x: &[f32], shift: f32, scale: f32, out: &mut [f32]) -> f64 {
    exp_scaled(x, shift, scale, out)
}

#[cfg(test)]
mod tests {
    use super::exp;

    #[test]
    fn exp_is_within_two_ulp_of_the_true_value() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            let ulp = (want as f32).abs() * f32::EPSILON;
            worst = worst.max((got - want).abs() / ulp as f64);
            x += 0.0137;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
    }

    #[test]
    fn exp_weights_match_f64_and_sum_them() {
        let x: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.37).sin() * 20.0).collect();
        let mut out = vec![0f32; x.len()];
        let total = super::exp_weights(&x, 20.0, 0.7, &mut out);
        let mut want_total = 0f64;
        for (&v, &o) in x.iter().zip(&out) {
            let want = ((v as f64 - 20.0) * 0.7).exp();
            want_total += want;
            // The f32 argument `(v − 20)·0.7` is within half an ulp of 28.
            assert!((o as f64 - want).abs() <= want * 5e-6, "{v}: {o} vs {want}");
        }
        assert!((total - want_total).abs() <= want_total * 5e-6);
    }

    #[test]
    fn exp_handles_the_edges() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        // The largest finite and the smallest normal results.
        assert!(exp(88.3).is_finite() && exp(88.3) > 2e38);
        assert!(exp(-87.3) > 0.0);
    }
}
