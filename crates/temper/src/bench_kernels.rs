//! `temper bench kernels`: GFLOP/s of temper's matmul kernels against
//! candle's `gemm` on a decoder's linear-layer shapes, forward (`x·Wᵀ`) and
//! the input gradient (`g·W`), at the row counts of decode, prefill and
//! training, with the weight in f32 and in bf16 (`--dtype bf16`). `scripts/bench_kernels_torch.py` runs the same shapes in
//! PyTorch and prints the ratio.
//!
//! First it measures the CPU's peak multiply-add rate (register-only loops
//! of `vdpbf16ps` and of f32 FMAs, one per thread), and each bf16 row says
//! what fraction of the bf16 peak it reaches.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use temper_model::candle_core::{DType, Device, Tensor};
use temper_model::kernels::{
    grad_times_packed, matmul_nn, matmul_nn_isa, matmul_nt, matmul_nt_packed, peak_gflops,
    PackedBf16, PeakInstr,
};

/// Arguments of `temper bench kernels`.
#[derive(Args)]
pub struct KernelBenchArgs {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Hidden size (SmolLM2-135M's by default).
    #[arg(long, default_value_t = 576)]
    hidden: usize,
    /// MLP intermediate size.
    #[arg(long, default_value_t = 1536)]
    intermediate: usize,
    /// Rows per call (tokens): comma-separated.
    #[arg(long, default_value = "1,32,128,1024", value_delimiter = ',')]
    rows: Vec<usize>,
    /// Seconds to spend on each measurement (at least 3 calls).
    #[arg(long, default_value_t = 0.5)]
    seconds: f64,
    /// `wall` time, or the calling thread's `cpu` time: with `--threads 1`,
    /// CPU time is what a kernel costs even while other processes share the
    /// cores (a busy machine inflates wall time, not CPU time).
    #[arg(long, default_value = "wall", value_parser = ["wall", "cpu"])]
    clock: String,
}

/// The calling thread's CPU time in seconds.
fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Median seconds of `f` over enough calls to fill `budget` seconds.
fn time(budget: f64, cpu: bool, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut v = Vec::new();
    let start = Instant::now();
    let now = || {
        if cpu {
            thread_cpu_seconds()
        } else {
            start.elapsed().as_secs_f64()
        }
    };
    while v.len() < 3 || (start.elapsed().as_secs_f64() < budget && v.len() < 1000) {
        let t = now();
        f()?;
        v.push(now() - t);
    }
    v.sort_by(f64::total_cmp);
    Ok(v[v.len() / 2])
}

pub fn run(args: KernelBenchArgs) -> Result<()> {
    let dev = Device::Cpu;
    let threads = temper_model::candle_core::utils::get_num_threads();
    let cpu = args.clock == "cpu";
    if cpu && threads != 1 {
        anyhow::bail!("--clock cpu measures the calling thread: run with --threads 1");
    }
    let (h, i) = (args.hidden, args.intermediate);
    // (name, out, in) of the linear layers a decoder runs.
    let shapes = [("qo", h, h), ("gate_up", i, h), ("down", h, i)];
    let mut rows_out = Vec::new();
    // The peak, measured in this run: per core and on `threads` cores at once.
    let mut peaks = serde_json::Map::new();
    let mut bf16_peak = None;
    if !args.json {
        println!(
            "temper bench kernels: GFLOP/s ({} time), {threads} threads, matmul_nn on {}",
            args.clock,
            matmul_nn_isa()
        );
    }
    for instr in [
        PeakInstr::Bf16Zmm,
        PeakInstr::F32FmaYmm,
        PeakInstr::F32FmaZmm,
    ] {
        let one = peak_gflops(instr, 1, args.seconds);
        let all = if threads > 1 {
            peak_gflops(instr, threads, args.seconds)
        } else {
            one
        };
        if instr == PeakInstr::Bf16Zmm {
            // Kernel rows run on `threads` threads: compare with that peak.
            bf16_peak = all;
        }
        if !args.json {
            match (one, all) {
                (Some(one), Some(all)) => println!(
                    "peak {:<20} {one:>8.1} GFLOP/s per core, {all:>8.1} on {threads} threads",
                    instr.name()
                ),
                _ => println!(
                    "peak {:<20} not measured: this CPU lacks the instruction",
                    instr.name()
                ),
            }
        }
        peaks.insert(
            instr.name().to_string(),
            serde_json::json!({ "per_core_gflops": one, "threads_gflops": all }),
        );
    }
    let of_peak = |g: f64| bf16_peak.map(|p| g / p);
    if !args.json {
        println!(
            "{:<8} {:>6} {:>6} {:>5} | {:>9} {:>9} {:>6} | {:>9} {:>9} {:>6} | {:>9} {:>9} {:>11}",
            "layer",
            "out",
            "in",
            "rows",
            "fwd nt",
            "fwd gemm",
            "ratio",
            "bwd nn",
            "bwd gemm",
            "ratio",
            "fwd bf16",
            "bwd bf16",
            "bf16 % peak"
        );
    }
    for &(name, n, k) in &shapes {
        let w = Tensor::randn(0f32, 0.05, (n, k), &dev)?;
        let wb = w.to_dtype(DType::BF16)?;
        let wp = std::sync::Arc::new(PackedBf16::from_tensor(&wb)?);
        for &m in &args.rows {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
            let g = Tensor::randn(0f32, 1.0, (m, n), &dev)?;
            let wt = w.t()?;
            let flop = 2.0 * (m * n * k) as f64;
            let gf = |s: f64| flop / s / 1e9;
            let fwd_nt = time(args.seconds, cpu, || {
                std::hint::black_box(matmul_nt(&x, &w)?);
                Ok(())
            })
            .context("matmul_nt")?;
            let fwd_gemm = time(args.seconds, cpu, || {
                std::hint::black_box(x.matmul(&wt)?);
                Ok(())
            })?;
            let bwd_nn = time(args.seconds, cpu, || {
                std::hint::black_box(matmul_nn(&g, &w)?);
                Ok(())
            })?;
            let bwd_gemm = time(args.seconds, cpu, || {
                std::hint::black_box(g.matmul(&w)?);
                Ok(())
            })?;
            let fwd_bf16 = time(args.seconds, cpu, || {
                std::hint::black_box(matmul_nt_packed(&x, &wp)?);
                Ok(())
            })?;
            let bwd_bf16 = time(args.seconds, cpu, || {
                std::hint::black_box(grad_times_packed(&g, &wp)?);
                Ok(())
            })?;
            let pct = match (of_peak(gf(fwd_bf16)), of_peak(gf(bwd_bf16))) {
                (Some(f), Some(b)) => format!("{:>4.0}/{:<4.0}", f * 100.0, b * 100.0),
                _ => "-".to_string(),
            };
            if !args.json {
                println!(
                    "{name:<8} {n:>6} {k:>6} {m:>5} | {:>9.1} {:>9.1} {:>5.2}x | {:>9.1} {:>9.1} {:>5.2}x | {:>9.1} {:>9.1} {pct:>11}",
                    gf(fwd_nt),
                    gf(fwd_gemm),
                    fwd_gemm / fwd_nt,
                    gf(bwd_nn),
                    gf(bwd_gemm),
                    bwd_gemm / bwd_nn,
                    gf(fwd_bf16),
                    gf(bwd_bf16)
                );
            }
            rows_out.push(serde_json::json!({
                "layer": name, "out": n, "in": k, "rows": m,
                "fwd_nt_gflops": gf(fwd_nt), "fwd_candle_gflops": gf(fwd_gemm),
                "bwd_nn_gflops": gf(bwd_nn), "bwd_candle_gflops": gf(bwd_gemm),
                "fwd_bf16_gflops": gf(fwd_bf16), "bwd_bf16_gflops": gf(bwd_bf16),
                "fwd_bf16_of_peak": of_peak(gf(fwd_bf16)),
                "bwd_bf16_of_peak": of_peak(gf(bwd_bf16)),
            }));
        }
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "threads": threads, "clock": args.clock,
                "isa": matmul_nn_isa(),
                "peak": peaks,
                "results": rows_out,
            })
        );
    }
    Ok(())
}
