//! Every training-API loss and its gradient against torch: the cases in
//! fixtures/golden/losses.json are computed in float64 from each loss's
//! definition by scripts/make_loss_goldens.py.

use std::path::PathBuf;

use serde_json::Value;
use temper_engine::{Loss, LossInputs};
use temper_model::candle_core::{Device, Var};

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

fn close(got: f64, want: f64) -> bool {
    (got - want).abs() <= 1e-4 * want.abs().max(1.0)
}

#[test]
fn every_loss_matches_its_torch_reference() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden/losses.json");
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("golden file")).unwrap();
    let cases = golden["cases"].as_array().expect("cases");
    let mut seen = std::collections::BTreeSet::new();
    for (i, c) in cases.iter().enumerate() {
        let name = c["loss"].as_str().unwrap();
        seen.insert(name.to_string());
        let config = c["config"].as_object().unwrap();
        let loss = Loss::from_name(name, config).expect("a known loss");
        let p = floats(&c["p"]);
        let get = |k: &str| c["inputs"].get(k).map(floats);
        let inputs = LossInputs {
            target_tokens: vec![0; p.len()],
            weights: get("weights"),
            logprobs: get("logprobs"),
            advantages: get("advantages"),
            sequence_ratio_mask: get("sequence_ratio_mask"),
            temperature: None,
        };
        loss.validate(&inputs, p.len())
            .expect("inputs are complete");
        let pv = Var::new(p.as_slice(), &Device::Cpu).unwrap();
        let l = loss.compute(pv.as_tensor(), &inputs).expect("compute");
        let got = l.to_scalar::<f32>().unwrap() as f64;
        let want = c["want_loss"].as_f64().unwrap();
        assert!(
            close(got, want),
            "case {i} {loss:?}: loss {got} vs torch {want}"
        );
        let grad: Vec<f32> = l
            .backward()
            .unwrap()
            .get(pv.as_tensor())
            .expect("a gradient")
            .to_vec1()
            .unwrap();
        let want_grad = floats(&c["want_grad"]);
        for (g, w) in grad.iter().zip(&want_grad) {
            assert!(
                close(*g as f64, *w as f64),
                "case {i} {loss:?}: grad {grad:?} vs torch {want_grad:?}"
            );
        }
    }
    // Every loss the training API takes by name has a reference.
    let names: std::collections::BTreeSet<String> =
        Loss::NAMES.iter().map(|s| s.to_string()).collect();
    assert_eq!(seen, names);
}

#[test]
fn gspo_needs_its_mask_and_unlisted_losses_and_keys_are_refused() {
    let none = serde_json::Map::new();
    let gspo = Loss::from_name("gspo", &none).unwrap();
    let inputs = LossInputs {
        target_tokens: vec![0, 0],
        logprobs: Some(vec![-1.0, -1.0]),
        advantages: Some(vec![1.0, 1.0]),
        ..Default::default()
    };
    let e = gspo.validate(&inputs, 2).unwrap_err().to_string();
    assert!(e.contains("sequence_ratio_mask"), "{e}");
    let empty = LossInputs {
        sequence_ratio_mask: Some(vec![0.0, 0.0]),
        ..inputs
    };
    let e = gspo.validate(&empty, 2).unwrap_err().to_string();
    assert!(e.contains("marks no position"), "{e}");
    for name in ["stable_reinforce", "custom"] {
        let e = Loss::from_name(name, &none).unwrap_err().to_string();
        assert!(e.contains(name) && e.contains("not supported"), "{e}");
    }
    let mut cfg = serde_json::Map::new();
    cfg.insert("kl_coeff".into(), serde_json::json!(0.1));
    let e = Loss::from_name("ppo", &cfg).unwrap_err().to_string();
    assert!(e.contains("kl_coeff"), "{e}");
    let mut cfg = serde_json::Map::new();
    cfg.insert("beta".into(), serde_json::json!("big"));
    let e = Loss::from_name("dro", &cfg).unwrap_err().to_string();
    assert!(e.contains("beta"), "{e}");
}
