//! The input gradient through a weight kept quantized (`--dtype gguf`)
//! never holds the whole weight in f32: a real vocabulary's tied LM head
//! (152k × 1024, Qwen3-0.6B's) would be 622 MB of f32 on top of a 400 MB
//! Q4_K_M file. Its own test binary, so the process's peak RSS is this
//! test's.
#![cfg(target_os = "linux")]

mod rss;
use rss::status_mb;

use temper_model::candle_core::{Device, Tensor, Var};
use temper_model::kernels::{
    lm_head_logprobs, matmul_nt_quant_op, HeadKernel, QuantFormat, QuantWeight,
};
use temper_model::ForwardMatmul;

/// A 128 MB matrix in f32.
const ROWS: usize = 65_536;
const COLS: usize = 512;
/// Tokens through it.
const N: usize = 8;

/// `block_q8_0` rows (f16 scale, 32 signed bytes) with varied values.
fn q8_weight() -> QuantWeight {
    let per_row = COLS / 32;
    let mut bytes = Vec::with_capacity(ROWS * per_row * 34);
    for r in 0..ROWS {
        for b in 0..per_row {
            let scale = half::f16::from_f32(0.001 * (1 + (r + b) % 7) as f32);
            bytes.extend_from_slice(&scale.to_le_bytes());
            bytes.extend((0..32).map(|i| ((r * 31 + b * 7 + i * 13) % 255) as u8));
        }
    }
    let blocks = Tensor::from_vec(bytes, (ROWS, per_row * 34), &Device::Cpu).unwrap();
    QuantWeight::new(blocks, QuantFormat::Q8_0, COLS).unwrap()
}

/// Peak RSS growth (MB) while `f` runs.
fn peak_growth(f: impl FnOnce()) -> f64 {
    std::fs::write("/proc/self/clear_refs", "5").expect("reset peak RSS");
    let before = status_mb("VmHWM");
    f();
    status_mb("VmHWM") - before
}

#[test]
fn gradients_through_a_quantized_weight_stay_within_a_slab_of_f32() {
    let w = q8_weight();
    let dense_mb = (ROWS * COLS * 4) as f64 / 1e6;
    let x = Var::from_tensor(
        &Tensor::randn(0f32, 1.0, (N, COLS), &Device::Cpu)
            .unwrap()
            .contiguous()
            .unwrap(),
    )
    .unwrap();

    // A linear layer's `x·Wᵀ` and its backward.
    let grew = peak_growth(|| {
        let y = matmul_nt_quant_op(x.as_tensor(), &w).unwrap();
        let g = y.sum_all().unwrap().backward().unwrap();
        let dx = g.get(x.as_tensor()).expect("gradient of x");
        assert_eq!(dx.dims(), &[N, COLS]);
    });
    eprintln!(
        "quantized matmul backward: peak RSS grew by {grew:.1} MB (f32 weight: {dense_mb:.0} MB)"
    );
    assert!(
        grew < dense_mb / 3.0,
        "quantized matmul backward grew peak RSS by {grew:.0} MB"
    );

    // The fused LM head (tied or not, the model's `--dtype gguf` head).
    let head = HeadKernel::Quant(w.clone());
    let placeholder = Tensor::new(f32::NAN, &Device::Cpu)
        .unwrap()
        .broadcast_as((ROWS, COLS))
        .unwrap();
    let targets: Vec<u32> = (0..N as u32).map(|i| i * 4099 % ROWS as u32).collect();
    let grew = peak_growth(|| {
        let (lp, _ent) = lm_head_logprobs(
            x.as_tensor(),
            &placeholder,
            &targets,
            1.0,
            Some(&head),
            ForwardMatmul::default(),
        )
        .unwrap();
        let g = lp.sum_all().unwrap().backward().unwrap();
        let dx = g.get(x.as_tensor()).expect("gradient of x");
        let v: Vec<f32> = dx.flatten_all().unwrap().to_vec1().unwrap();
        assert!(v.iter().all(|x| x.is_finite()) && v.iter().any(|&x| x != 0.0));
    });
    eprintln!(
        "quantized LM head backward: peak RSS grew by {grew:.1} MB (f32 weight: {dense_mb:.0} MB)"
    );
    assert!(
        grew < dense_mb / 3.0,
        "quantized LM head backward grew peak RSS by {grew:.0} MB"
    );
}
