//! A 16k-token prefill runs in memory linear in its length: attention never
//! builds a `T×T` score matrix (the composed version needed 1 GiB per head
//! for the scores alone at this length). Its own test binary, so the
//! process's peak RSS is this test's.
#![cfg(target_os = "linux")]

mod rss;
use rss::status_mb;

use std::collections::HashMap;

use temper_model::candle_core::{DType, Device, Tensor};
use temper_model::{Checkpoint, HfConfig, Model, Segment, Target};

const T: usize = 16_384;
const HIDDEN: usize = 32;
const VOCAB: usize = 64;

fn tiny_model() -> Model {
    let hf: HfConfig = serde_json::from_value(serde_json::json!({
        "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": VOCAB, "max_position_embeddings": T, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": true
    }))
    .unwrap();
    let cfg = hf.validate().unwrap();
    let dev = Device::Cpu;
    let mut ts: HashMap<String, Tensor> = HashMap::new();
    let rand = |shape: &[usize]| Tensor::randn(0f32, 0.2, shape, &dev).unwrap();
    ts.insert("model.embed_tokens.weight".into(), rand(&[VOCAB, HIDDEN]));
    ts.insert(
        "model.norm.weight".into(),
        Tensor::ones(HIDDEN, DType::F32, &dev).unwrap(),
    );
    for n in ["input_layernorm", "post_attention_layernorm"] {
        ts.insert(
            format!("model.layers.0.{n}.weight"),
            Tensor::ones(HIDDEN, DType::F32, &dev).unwrap(),
        );
    }
    for t in Target::ALL {
        let (o, i) = t.shape(&cfg);
        ts.insert(format!("model.layers.0.{}.weight", t.path()), rand(&[o, i]));
    }
    let dir = tempfile::tempdir().unwrap();
    temper_model::candle_core::safetensors::save(&ts, dir.path().join("model.safetensors"))
        .unwrap();
    let ck = Checkpoint::open(dir.path(), DType::F32, &dev).unwrap();
    Model::load(&cfg, &ck, DType::F32, &dev).unwrap()
}

#[test]
fn prefill_of_16k_tokens_stays_in_linear_memory() {
    let model = tiny_model();
    let ids: Vec<u32> = (0..T).map(|i| ((i * 7 + 3) % VOCAB) as u32).collect();
    std::fs::write("/proc/self/clear_refs", "5").expect("reset peak RSS");
    let before = status_mb("VmHWM");
    let mut segs = [Segment {
        len: T,
        cache: None,
    }];
    let hidden = model.forward_hidden(&ids, &mut segs, None).unwrap();
    assert_eq!(hidden.dims(), &[T, HIDDEN]);
    let values: Vec<f32> = hidden.flatten_all().unwrap().to_vec1().unwrap();
    assert!(values.iter().all(|x| x.is_finite()));
    let grew = status_mb("VmHWM") - before;
    eprintln!("{T}-token prefill: peak RSS grew by {grew:.1} MB");
    // Activations here are a few MB per [T, hidden] tensor; one T×T f32
    // score matrix alone would be 1024 MB.
    assert!(
        grew < 256.0,
        "peak RSS grew by {grew:.0} MB for a {T}-token prefill"
    );
}
