//! Sampling behaviour: seeds, n > 1, stop conditions, limits.

use temper_model::{FinishReason, GenerationRequest, Sampler, SamplingParams};

use crate::common::*;

fn req(prompt: Vec<u32>, n: usize, params: SamplingParams) -> GenerationRequest {
    GenerationRequest { prompt, n, params }
}

#[test]
fn same_seed_same_tokens_regardless_of_batch() {
    let p = load("tiny-qwen3");
    let (g, _) = golden("tiny-qwen3");
    let prompt = ids(&g["inputs"][1]);
    let s = Sampler::new(&p.model, &p.tokenizer, vec![]);
    let params = SamplingParams {
        max_tokens: 12,
        seed: Some(42),
        ..Default::default()
    };
    let alone = s
        .generate(&[req(prompt.clone(), 3, params.clone())], None)
        .unwrap();
    let again = s
        .generate(&[req(prompt.clone(), 3, params.clone())], None)
        .unwrap();
    assert_eq!(alone, again);
    // The n samples of one prompt are different draws.
    assert_ne!(alone[0][0].tokens, alone[0][1].tokens);
    // Another seed gives other tokens.
    let other = s
        .generate(
            &[req(
                prompt,
                1,
                SamplingParams {
                    seed: Some(43),
                    ..params
                },
            )],
            None,
        )
        .unwrap();
    assert_ne!(other[0][0].tokens, alone[0][0].tokens);
}

#[test]
fn requests_that_repeat_a_prompt_match_each_request_alone() {
    // The sampler prefills a repeated prompt once (an RL group's rollouts
    // are separate requests with one prompt); every request must still get
    // what it would get on its own, logprobs included.
    let p = load("tiny-qwen3");
    let (g, _) = golden("tiny-qwen3");
    let (a, b) = (ids(&g["inputs"][0]), ids(&g["inputs"][1]));
    let s = Sampler::new(&p.model, &p.tokenizer, vec![]);
    let params = |seed| SamplingParams {
        max_tokens: 10,
        seed: Some(seed),
        logprobs: true,
        temperature: 0.7,
        ..Default::default()
    };
    let reqs = vec![
        req(a.clone(), 2, params(1)),
        req(b.clone(), 1, params(2)),
        req(a.clone(), 1, params(3)),
        req(a, 3, params(4)),
        req(b, 2, params(5)),
    ];
    let together = s.generate(&reqs, None).unwrap();
    for (r, got) in reqs.iter().zip(&together) {
        let alone = s.generate(std::slice::from_ref(r), None).unwrap();
        assert_eq!(&alone[0], got);
    }
}

#[test]
fn stop_token_ids_and_strings_end_generation() {
    let p = load("tiny-qwen2");
    let (g, _) = golden("tiny-qwen2");
    let case = &g["greedy"][0];
    let prompt = ids(&case["prompt_ids"]);
    let expected = ids(&case["new_ids"]);
    let s = Sampler::new(&p.model, &p.tokenizer, vec![]);
    let greedy = SamplingParams {
        max_tokens: 16,
        temperature: 0.0,
        ..Default::default()
    };
    // Stop token id: generation ends at (and includes) its first occurrence.
    let stop_at = expected[4];
    let first = expected.iter().position(|&t| t == stop_at).unwrap();
    let out = s
        .generate(
            &[req(
                prompt.clone(),
                1,
                SamplingParams {
                    stop_token_ids: vec![stop_at],
                    ..greedy.clone()
                },
            )],
            None,
        )
        .unwrap();
    assert_eq!(out[0][0].tokens, expected[..=first].to_vec());
    assert_eq!(out[0][0].finish_reason, FinishReason::Stop);
    // Stop string: the text is cut before it.
    let full_text = p.tokenizer.decode(&expected, true).unwrap();
    let stop: String = full_text
        .chars()
        .skip(full_text.chars().count() / 2)
        .take(3)
        .collect();
    let out = s
        .generate(
            &[req(
                prompt.clone(),
                1,
                SamplingParams {
                    stop: vec![stop.clone()],
                    ..greedy.clone()
                },
            )],
            None,
        )
        .unwrap();
    let c = &out[0][0];
    assert_eq!(c.finish_reason, FinishReason::Stop);
    assert_eq!(c.text, full_text[..full_text.find(&stop).unwrap()]);
    // max_tokens: finish reason "length".
    let out = s
        .generate(
            &[req(
                prompt,
                1,
                SamplingParams {
                    max_tokens: 3,
                    ..greedy
                },
            )],
            None,
        )
        .unwrap();
    assert_eq!(out[0][0].tokens, expected[..3].to_vec());
    assert_eq!(out[0][0].finish_reason, FinishReason::Length);
}

#[test]
fn eos_from_generation_config_stops_and_is_hidden_from_text() {
    let p = load("tiny-qwen3");
    let eos = p.generation.eos_token_ids.clone();
    assert!(eos.contains(&995) && eos.contains(&993), "{eos:?}");
    let s = Sampler::new(&p.model, &p.tokenizer, eos.clone());
    let prompt = p.tokenizer.encode("Hello", false).unwrap();
    let params = SamplingParams {
        max_tokens: 64,
        seed: Some(1),
        temperature: 1.5,
        ..Default::default()
    };
    let out = s.generate(&[req(prompt, 16, params)], None).unwrap();
    for c in &out[0] {
        if c.finish_reason == FinishReason::Stop {
            let last = *c.tokens.last().unwrap();
            assert!(eos.contains(&last));
            assert!(!c.text.contains("<|im_end|>"));
        } else {
            assert_eq!(c.tokens.len(), 64);
            assert!(c.tokens.iter().all(|t| !eos.contains(t)));
        }
    }
}

#[test]
fn bad_parameters_are_rejected() {
    let p = load("tiny-llama");
    let s = Sampler::new(&p.model, &p.tokenizer, vec![]);
    for (params, needle) in [
        (
            SamplingParams {
                max_tokens: 0,
                ..Default::default()
            },
            "max_tokens",
        ),
        (
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            "temperature",
        ),
    ] {
        let err = s.generate(&[req(vec![1, 2], 1, params)], None).unwrap_err();
        assert!(err.to_string().contains(needle), "{err}");
    }
    let err = s
        .generate(&[req(vec![], 1, SamplingParams::default())], None)
        .unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");
    let err = s
        .generate(&[req(vec![5000], 1, SamplingParams::default())], None)
        .unwrap_err();
    assert!(err.to_string().contains("out of range"), "{err}");
}
