//! The CPU's peak multiply-add rate, measured: a loop of independent
//! multiply-add instructions on registers only (no memory traffic), with
//! enough accumulators to hide the instruction's latency. `temper bench
//! kernels` divides a kernel's GFLOP/s by it to say how far the kernel is
//! from what the core can do at all.

use std::time::Instant;

/// Which instruction the probe runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeakInstr {
    /// `vdpbf16ps` on zmm (`avx512_bf16`): 16 lanes × 2 bf16 products.
    Bf16Zmm,
    /// `vfmadd231ps` on ymm (AVX2 + FMA): 8 lanes.
    F32FmaYmm,
    /// `vfmadd231ps` on zmm (AVX-512F): 16 lanes.
    F32FmaZmm,
}

impl PeakInstr {
    /// The instruction's name as the bench prints it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16Zmm => "bf16 vdpbf16ps zmm",
            Self::F32FmaYmm => "f32 fma ymm",
            Self::F32FmaZmm => "f32 fma zmm",
        }
    }

    /// Whether this CPU can run it.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Self::Bf16Zmm => super::bf16_dot_available(),
                Self::F32FmaYmm => {
                    std::arch::is_x86_feature_detected!("avx2")
                        && std::arch::is_x86_feature_detected!("fma")
                }
                Self::F32FmaZmm => std::arch::is_x86_feature_detected!("avx512f"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Floating-point operations per instruction (a multiply-add is 2).
    fn flops_per_instr(self) -> f64 {
        match self {
            Self::Bf16Zmm => 64.0,
            Self::F32FmaYmm => 16.0,
            Self::F32FmaZmm => 32.0,
        }
    }
}

/// Instructions per timed chunk: ~10 ms at a few per cycle.
const CHUNK_ITERS: u64 = 1 << 20;

/// Independent accumulators per loop iteration: at least latency ×
/// throughput (Zen 4 FMA: 2 per cycle at 4 cycles; Intel: 2 at 4), and with
/// the two inputs within AVX2's 16 ymm registers (16 accumulators spill).
const ACCS: u64 = 12;

/// Peak GFLOP/s of `instr` on `threads` threads at once (the sum of each
/// thread's best timed chunk over about `seconds`), or `None` when this CPU
/// lacks the instruction. Wall time: run it on an idle machine.
pub fn peak_gflops(instr: PeakInstr, threads: usize, seconds: f64) -> Option<f64> {
    if !instr.available() {
        return None;
    }
    let threads = threads.max(1);
    let per_thread: Vec<f64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| s.spawn(move || thread_peak(instr, seconds)))
            .collect();
        handles
            .into_iter()
            // A probe thread that panicked re-raises here: a lost thread
            // must not read as a lower peak.
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    Some(per_thread.iter().sum())
}

/// One thread's best rate over chunks filling `seconds` (at least 3).
fn thread_peak(instr: PeakInstr, seconds: f64) -> f64 {
    let start = Instant::now();
    let mut best = 0f64;
    let mut chunks = 0;
    while chunks < 3 || start.elapsed().as_secs_f64() < seconds {
        let t = Instant::now();
        let sink = run_chunk(instr, CHUNK_ITERS);
        let dt = t.elapsed().as_secs_f64();
        std::hint::black_box(sink);
        let flops = (CHUNK_ITERS * ACCS) as f64 * instr.flops_per_instr();
        best = best.max(flops / dt / 1e9);
        chunks += 1;
    }
    best
}

/// `iters × ACCS` instructions of `instr`; returns a value that depends on
/// every accumulator so the loop cannot be removed.
fn run_chunk(instr: PeakInstr, iters: u64) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `peak_gflops` only gets here when `instr.available()`,
        // i.e. the CPU has each function's target features.
        unsafe {
            match instr {
                PeakInstr::Bf16Zmm => x86::bf16_zmm(iters),
                PeakInstr::F32FmaYmm => x86::fma_ymm(iters),
                PeakInstr::F32FmaZmm => x86::fma_zmm(iters),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (instr, iters);
        0.0
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::ACCS;

    const N: usize = ACCS as usize;

    /// # Safety
    /// The CPU must have `avx512f`, `avx512bw` and `avx512bf16`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn bf16_zmm(iters: u64) -> f32 {
        // Small inputs through `black_box` so the compiler cannot fold
        // them; the accumulators stay far from overflow and subnormals.
        let a = _mm512_set1_ps(std::hint::black_box(1.0 / 128.0));
        let b = _mm512_set1_ps(std::hint::black_box(1.0));
        let (a, b) = (_mm512_cvtne2ps_pbh(a, a), _mm512_cvtne2ps_pbh(b, b));
        let mut acc = [_mm512_setzero_ps(); N];
        for _ in 0..iters {
            for r in acc.iter_mut() {
                *r = _mm512_dpbf16_ps(*r, a, b);
            }
        }
        let mut s = _mm512_setzero_ps();
        for r in acc {
            s = _mm512_add_ps(s, r);
        }
        _mm512_reduce_add_ps(s)
    }

    /// # Safety
    /// The CPU must have `avx2` and `fma`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fma_ymm(iters: u64) -> f32 {
        let a = _mm256_set1_ps(std::hint::black_box(1e-3));
        let b = _mm256_set1_ps(std::hint::black_box(1.0));
        let mut acc = [_mm256_setzero_ps(); N];
        for _ in 0..iters {
            for r in acc.iter_mut() {
                *r = _mm256_fmadd_ps(a, b, *r);
            }
        }
        let mut s = _mm256_setzero_ps();
        for r in acc {
            s = _mm256_add_ps(s, r);
        }
        // SAFETY: AVX2 is this function's own contract.
        unsafe { super::super::matmul::hsum_avx2(s) }
    }

    /// # Safety
    /// The CPU must have `avx512f`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fma_zmm(iters: u64) -> f32 {
        let a = _mm512_set1_ps(std::hint::black_box(1e-3));
        let b = _mm512_set1_ps(std::hint::black_box(1.0));
        let mut acc = [_mm512_setzero_ps(); N];
        for _ in 0..iters {
            for r in acc.iter_mut() {
                *r = _mm512_fmadd_ps(a, b, *r);
            }
        }
        _mm512_reduce_add_ps(
            acc.into_iter()
                .fold(_mm512_setzero_ps(), |s, r| _mm512_add_ps(s, r)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each probe this CPU supports returns a positive, finite rate; the
    /// others return `None` (not a zero that would read as a measurement).
    #[test]
    fn peak_probe_measures_what_the_cpu_has() {
        for instr in [
            PeakInstr::Bf16Zmm,
            PeakInstr::F32FmaYmm,
            PeakInstr::F32FmaZmm,
        ] {
            match peak_gflops(instr, 1, 0.0) {
                Some(g) => {
                    assert!(g.is_finite() && g > 0.0, "{}: {g}", instr.name());
                    eprintln!("{}: {g:.1} GFLOP/s on one core", instr.name());
                }
                None => {
                    assert!(!instr.available());
                    eprintln!("skipped {}: this CPU lacks the instruction", instr.name());
                }
            }
        }
        // The `--threads N` path (probes running side by side) measures too.
        if PeakInstr::Bf16Zmm.available() {
            let two = peak_gflops(PeakInstr::Bf16Zmm, 2, 0.0).unwrap_or(0.0);
            assert!(two.is_finite() && two > 0.0);
        } else {
            eprintln!("skipped the bf16 peak: this CPU lacks avx512_bf16");
        }
    }
}
