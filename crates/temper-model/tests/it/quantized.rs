//! GGUF bases kept quantized (`--dtype gguf`): the blocks stay as stored,
//! and every logit is the dequantized f32 model's, bit for bit.

use temper_model::{GenerationRequest, Precision, Sampler, SamplingParams};

use crate::common::*;

#[test]
fn kept_quantized_logits_and_greedy_text_equal_the_dequantized_models() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mut formats = Vec::new();
    for (name, quant) in QUANT_CASES {
        {
            let q = load_quantized(name, quant, tmp.path(), Precision::Gguf);
            let f = load_quantized(name, quant, tmp.path(), Precision::F32);
            assert_eq!(q.model.precision(), Precision::Gguf);
            // The head (tied or not) stays in its blocks too: memory is the
            // file's size, and its logits are still the f32 model's bits.
            assert!(q.model.head_is_quantized(), "{name} {quant:?}: head");
            assert!(!f.model.head_is_quantized());
            formats.extend(q.model.quant_formats());
            let inputs = golden_inputs(name);
            for input in &inputs {
                let (a, b) = (logits_of(&q, input, None), logits_of(&f, input, None));
                let bits = |t: &temper_model::candle_core::Tensor| -> Vec<u32> {
                    let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
                    v.iter().map(|x| x.to_bits()).collect()
                };
                assert_eq!(bits(&a), bits(&b), "{name} {quant:?}: logits");
            }
            let greedy = |p: &temper_model::Pretrained| {
                let s = Sampler::new(&p.model, &p.tokenizer, vec![]);
                let reqs: Vec<GenerationRequest> = inputs
                    .iter()
                    .map(|i| GenerationRequest {
                        prompt: i.clone(),
                        n: 1,
                        params: SamplingParams {
                            max_tokens: 12,
                            temperature: 0.0,
                            ignore_eos: true,
                            ..Default::default()
                        },
                    })
                    .collect();
                s.generate(&reqs, None)
                    .expect("generate")
                    .into_iter()
                    .map(|o| o[0].tokens.clone())
                    .collect::<Vec<_>>()
            };
            assert_eq!(greedy(&q), greedy(&f), "{name} {quant:?}: greedy");
        }
    }
    for f in temper_model::kernels::QuantFormat::ALL {
        assert!(formats.contains(&f), "no case keeps {f:?} matrices");
    }
}

/// Full-parameter training and bf16 need dense weights: refused with the
/// option that gives them; saving dequantizes to the f32 load's weights.
#[test]
fn kept_quantized_models_refuse_what_needs_dense_weights() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mut q = load_quantized(
        "tiny-qwen3",
        temper_model::GgufQuant::Q4_1,
        tmp.path(),
        Precision::Gguf,
    );
    let e = q.model.make_trainable().unwrap_err().to_string();
    assert!(e.contains("--dtype f32"), "{e}");
    let e = q
        .model
        .set_precision(Precision::Bf16)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--dtype bf16"), "{e}");
    // Saving dequantizes: the weights are the f32 load's.
    let f = load_quantized(
        "tiny-qwen3",
        temper_model::GgufQuant::Q4_1,
        tmp.path(),
        Precision::F32,
    );
    let (wq, wf) = (
        q.model.named_weights().expect("weights"),
        f.model.named_weights().expect("weights"),
    );
    assert_eq!(wq.len(), wf.len());
    for ((n, a), (_, b)) in wq.iter().zip(&wf) {
        let (a, b): (Vec<f32>, Vec<f32>) = (
            a.flatten_all().unwrap().to_vec1().unwrap(),
            b.flatten_all().unwrap().to_vec1().unwrap(),
        );
        assert_eq!(a, b, "{n}");
    }
}
