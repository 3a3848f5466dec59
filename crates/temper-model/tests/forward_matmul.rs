//! The batch-invariant matmul against candle's on whole models: the same
//! logprobs and LoRA gradients up to f32 rounding. The matmul is each
//! model's own setting (`Model::set_forward_matmul`), not the process's.

#[path = "it/common.rs"]
mod common;

use std::collections::HashMap;

use temper_model::candle_core::{DType, Tensor};
use temper_model::kernels::ForwardMatmul;
use temper_model::{LoraAdapter, Pretrained};

use common::*;

/// Per-token logprobs and every LoRA tensor's gradient of −Σ logprob.
fn logprobs_and_grads(
    p: &Pretrained,
    seq: &[u32],
    lora: &LoraAdapter,
) -> (Vec<f32>, HashMap<String, Tensor>) {
    let s = p
        .model
        .score(&seq[..seq.len() - 1], &seq[1..], Some(lora), 0.7)
        .expect("score");
    let lp = s.logprobs.to_vec1::<f32>().expect("logprobs");
    let grads = s
        .logprobs
        .sum_all()
        .and_then(|t| t.neg())
        .and_then(|t| t.backward())
        .expect("backward");
    let named = lora
        .named_vars()
        .into_iter()
        .map(|(n, v)| (n, grads.get(v.as_tensor()).expect("grad").clone()))
        .collect();
    (lp, named)
}

fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a - b)
        .and_then(|d| d.to_dtype(DType::F64))
        .and_then(|d| d.sqr())
        .and_then(|d| d.sum_all())
        .and_then(|d| d.to_scalar::<f64>())
        .expect("diff");
    let n = b
        .to_dtype(DType::F64)
        .and_then(|d| d.sqr())
        .and_then(|d| d.sum_all())
        .and_then(|d| d.to_scalar::<f64>())
        .expect("norm");
    (d / n.max(1e-30)).sqrt()
}

#[test]
fn invariant_and_candle_matmuls_agree_on_logprobs_and_lora_gradients() {
    for name in FAMILIES {
        let mut p = load(name);
        let m = p.model.forward_matmul();
        assert_eq!(m, ForwardMatmul::BatchInvariant, "default");
        // The fixture adapter's B is non-zero: every LoRA matmul contributes.
        let a = adapter(&p, name);
        let (g, _) = golden(name);
        let seq: Vec<u32> = g["inputs"].as_array().expect("inputs")[0]
            .as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect();
        p.model.set_forward_matmul(ForwardMatmul::BatchInvariant);
        let (lp_nt, g_nt) = logprobs_and_grads(&p, &seq, &a);
        p.model.set_forward_matmul(ForwardMatmul::Candle);
        let (lp_c, g_c) = logprobs_and_grads(&p, &seq, &a);
        p.model.set_forward_matmul(ForwardMatmul::BatchInvariant);

        let worst_lp = lp_nt
            .iter()
            .zip(&lp_c)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst_lp < 1e-4, "{name}: logprobs differ by {worst_lp}");
        assert_eq!(g_nt.len(), g_c.len());
        assert!(!g_nt.is_empty(), "{name}: no LoRA tensors");
        for (k, gn) in &g_nt {
            let r = rel_diff(gn, &g_c[k]);
            assert!(
                r < 1e-4,
                "{name}: gradient of {k} differs by {r:.2e} (relative)"
            );
        }
    }
}
