//! Golden tests against Hugging Face transformers. The fixtures (tiny random
//! models, a PEFT adapter each, reference logits, greedy continuations and
//! rendered chat templates) are made by `scripts/make_fixtures.py`; see
//! `fixtures/README.md`.

use crate::common::*;
use temper_model::{GenerationRequest, Sampler, SamplingParams};

#[test]
fn logits_match_transformers() {
    for name in FAMILIES {
        let p = load(name);
        let (g, t) = golden(name);
        for (i, input) in g["inputs"].as_array().expect("inputs").iter().enumerate() {
            let ours = logits_of(&p, &ids(input), None);
            let theirs = &t[&format!("logits.{i}")];
            let e = rel_err(&ours, theirs);
            eprintln!("{name} input {i}: logits relative error {e:.2e}");
            assert!(e <= 1e-4, "{name} input {i}: relative error {e}");
        }
    }
}

#[test]
fn peft_adapter_gives_transformers_logits() {
    for name in FAMILIES {
        let p = load(name);
        let (g, t) = golden(name);
        let a = adapter(&p, name);
        for (i, input) in g["inputs"].as_array().expect("inputs").iter().enumerate() {
            let ours = logits_of(&p, &ids(input), Some(&a));
            let e = rel_err(&ours, &t[&format!("lora_logits.{i}")]);
            eprintln!("{name} input {i}: PEFT-adapter logits relative error {e:.2e}");
            assert!(e <= 1e-4, "{name} input {i}: relative error {e}");
        }
        // Merging the adapter into the base weights gives the same function.
        let merged = p.model.merge_lora(&a).expect("merge");
        let input = ids(&g["inputs"][2]);
        let mut segs = [temper_model::Segment {
            len: input.len(),
            cache: None,
        }];
        let h = merged
            .forward_hidden(&input, &mut segs, None)
            .expect("forward");
        let e = rel_err(&merged.logits(&h).unwrap(), &t["lora_logits.2"]);
        assert!(e <= 1e-4, "{name} merged: relative error {e}");
    }
}

#[test]
fn greedy_tokens_match_transformers_generate() {
    for name in FAMILIES {
        let p = load(name);
        let (g, _) = golden(name);
        let sampler = Sampler::new(&p.model, &p.tokenizer, p.generation.eos_token_ids.clone());
        let cases = g["greedy"].as_array().expect("greedy");
        // All prompts in one batch: exercises packed prefill and batched decode.
        let reqs: Vec<GenerationRequest> = cases
            .iter()
            .map(|c| GenerationRequest {
                prompt: ids(&c["prompt_ids"]),
                n: 1,
                params: SamplingParams {
                    max_tokens: ids(&c["new_ids"]).len(),
                    temperature: 0.0,
                    ignore_eos: true,
                    ..Default::default()
                },
            })
            .collect();
        let out = sampler.generate(&reqs, None).expect("generate");
        for (c, o) in cases.iter().zip(out) {
            assert_eq!(
                o[0].tokens,
                ids(&c["new_ids"]),
                "{name}: {}",
                c["prompt_text"]
            );
        }
    }
}

#[test]
fn chat_templates_render_like_apply_chat_template() {
    for name in FAMILIES {
        let p = load(name);
        let (g, _) = golden(name);
        let tmpl = p
            .chat_template
            .as_ref()
            .expect("fixture has a chat template");
        for (i, c) in g["chat"].as_array().expect("chat").iter().enumerate() {
            let tools = c.get("tools").filter(|t| !t.is_null());
            let extra = c["extra"].as_object().cloned().unwrap_or_default();
            let text = tmpl
                .render(
                    &c["messages"],
                    tools,
                    c["add_generation_prompt"].as_bool().expect("bool"),
                    &extra,
                )
                .unwrap_or_else(|e| panic!("{name} case {i}: {e}"));
            assert_eq!(text, c["text"].as_str().expect("text"), "{name} case {i}");
            let toks = p.tokenizer.encode(&text, false).expect("encode");
            assert_eq!(toks, ids(&c["ids"]), "{name} case {i} ids");
        }
    }
}

#[test]
fn tokenizer_encodes_and_decodes_like_transformers() {
    for name in FAMILIES {
        let p = load(name);
        let (g, _) = golden(name);
        for c in g["encode"].as_array().expect("encode") {
            let got = p
                .tokenizer
                .encode(
                    c["text"].as_str().expect("text"),
                    c["add_special_tokens"].as_bool().expect("bool"),
                )
                .expect("encode");
            assert_eq!(got, ids(&c["ids"]), "{name}: {}", c["text"]);
        }
        for c in g["decode"].as_array().expect("decode") {
            let got = p
                .tokenizer
                .decode(
                    &ids(&c["ids"]),
                    c["skip_special_tokens"].as_bool().expect("bool"),
                )
                .expect("decode");
            assert_eq!(got, c["text"].as_str().expect("text"), "{name}");
        }
    }
}
