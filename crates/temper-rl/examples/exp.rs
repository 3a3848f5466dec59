use rand::{Rng, SeedableRng};
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;
use temper_engine::*;
use temper_model::*;
use temper_rl::preset::TinyPreset;
use temper_rl::sft::tokenize_chat;

fn q(rng: &mut impl Rng, digits: u32) -> (String, String) {
    let hi = 10u64.pow(digits);
    let a = rng.random_range(0..hi);
    let b = rng.random_range(0..hi);
    (format!("What is {a} + {b}?"), format!("{}", a + b))
}

fn main() {
    temper_model::set_num_threads(None);
    let args: Vec<String> = std::env::args().collect();
    let hidden: usize = args.get(1).map(|s| s.parse().unwrap()).unwrap_or(128);
    let steps: usize = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(200);
    let bs: usize = args.get(3).map(|s| s.parse().unwrap()).unwrap_or(32);
    let lr: f64 = args.get(4).map(|s| s.parse().unwrap()).unwrap_or(1e-3);
    let digits: u32 = args.get(5).map(|s| s.parse().unwrap()).unwrap_or(2);
    let dir = std::path::PathBuf::from("/tmp/exp-tiny");
    TinyPreset {
        hidden_size: hidden,
        intermediate_size: hidden * 3,
        ..Default::default()
    }
    .write(&dir, 0)
    .unwrap();
    let p = Arc::new(Pretrained::load(&dir, &LoadOptions::default()).unwrap());
    let tpl = p.chat_template.as_ref().unwrap();
    let eng = Engine::new();
    eng.add_base_model("b", p.clone()).wait().unwrap();
    let run = eng.create_full_run("b").wait().unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let t0 = Instant::now();
    let mut evrng = rand_chacha::ChaCha8Rng::seed_from_u64(99);
    let evals: Vec<(String, String)> = (0..64).map(|_| q(&mut evrng, digits)).collect();
    for step in 0..steps {
        let exs: Vec<_> = (0..bs)
            .map(|_| {
                let (qq, a) = q(&mut rng, digits);
                tokenize_chat(
                    tpl,
                    &p.tokenizer,
                    &[
                        json!({"role":"user","content":qq}),
                        json!({"role":"assistant","content":format!("<answer>{a}</answer>")}),
                    ],
                    512,
                )
                .unwrap()
            })
            .collect();
        let tot: usize = exs.iter().map(|e| e.trained_tokens()).sum();
        let data: Vec<Datum> = exs.iter().map(|e| e.datum(1.0 / tot as f32)).collect();
        let out = eng
            .forward_backward(&run, data, Loss::CrossEntropy)
            .wait()
            .unwrap();
        let lr_t = lr * ((step + 1) as f64 / 10.0).min(1.0);
        eng.optim_step(
            &run,
            AdamParams {
                learning_rate: lr_t,
                weight_decay: 0.0,
                grad_clip_norm: 1.0,
                ..Default::default()
            },
        )
        .wait()
        .unwrap();
        if step % 25 == 24 || step + 1 == steps {
            eng.save_weights_for_sampler(&run, "s").wait().unwrap();
            let mut res = vec![];
            for temp in [0.0, 1.0] {
                let reqs: Vec<GenerationRequest> = evals
                    .iter()
                    .enumerate()
                    .map(|(i, (qq, _))| {
                        let text = tpl
                            .render(
                                &json!([{"role":"user","content":qq}]),
                                None,
                                true,
                                &Default::default(),
                            )
                            .unwrap();
                        GenerationRequest {
                            prompt: p.tokenizer.encode(&text, false).unwrap(),
                            n: 1,
                            params: SamplingParams {
                                max_tokens: 24,
                                temperature: temp,
                                seed: Some(i as u64),
                                logprobs: false,
                                ..Default::default()
                            },
                        }
                    })
                    .collect();
                let ts = Instant::now();
                let outs = eng.generate("s", reqs).wait().unwrap();
                let correct = outs
                    .iter()
                    .zip(&evals)
                    .filter(|(o, (_, a))| o[0].text.trim() == format!("<answer>{a}</answer>"))
                    .count();
                res.push(format!(
                    "T={temp}: {:.0}% ({:.2}s) ex={:?}",
                    100.0 * correct as f64 / evals.len() as f64,
                    ts.elapsed().as_secs_f64(),
                    outs[0][0].text
                ));
            }
            println!(
                "step {} loss {:.3} t={:.1}s {}",
                step + 1,
                out.metrics.get("loss:sum").copied().unwrap_or(0.0),
                t0.elapsed().as_secs_f64(),
                res.join(" | ")
            );
        }
    }
}
