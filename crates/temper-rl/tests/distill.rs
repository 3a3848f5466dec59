//! On-policy distillation on the fixture models: the advantages are the
//! teacher's minus the student's logprob of each sampled token, a student
//! distilled from a teacher moves toward it, and a teacher with another
//! tokenizer is refused. (The endpoint teacher, against a real `temper
//! serve`, is tested in crates/temper/tests/distill_cli.rs.)

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use temper_engine::Trainer;
use temper_env::{Message, ModelTurn, Rollout, Row, Score, TokenTrace};
use temper_model::{LoadOptions, Pretrained, SamplingParams};
use temper_rl::advantage::batch_advantages;
use temper_rl::config::{self, RlConfig};
use temper_rl::datum::TrainTurns;
use temper_rl::plan::TeacherSource;
use temper_rl::rl::{run_rl, RunOptions};
use temper_rl::sampled::Group;
use temper_rl::teacher::Teacher;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/models")
        .join(name)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn local(name: &str) -> TeacherSource {
    TeacherSource::Local {
        path: fixture(name),
        adapter: None,
        precision: temper_model::Precision::F32,
    }
}

/// A graded environment (LCS of the completion with the answer).
fn graded_env(dir: &Path) -> String {
    let env = dir.join("graded-env");
    std::fs::create_dir_all(&env).unwrap();
    let rows: String = (0..40)
        .map(|i| format!("{{\"question\": \"echo {i}\", \"answer\": \"aaaa{i}\"}}\n"))
        .collect();
    std::fs::write(env.join("train.jsonl"), rows).unwrap();
    std::fs::write(
        env.join("env.toml"),
        "name = \"graded\"\n[dataset]\ntrain = \"train.jsonl\"\n[parser]\ntype = \"plain\"\n\
         [[rubric]]\nfunction = \"lcs\"\nweight = 1.0\n",
    )
    .unwrap();
    env.display().to_string()
}

fn distill_config(dir: &Path, student: &str, teacher: &str, extra: &str) -> RlConfig {
    let text = format!(
        r#"
        seed = 3
        [model]
        path = "{student}"
        [lora]
        rank = 8
        alpha = 16.0
        [[env]]
        id = "{env}"
        [sampling]
        max_tokens = 12
        group_size = 4
        [trainer]
        lr = 2e-2
        batch_size = 4
        max_steps = 12
        [async]
        max_off_policy_steps = 0
        [eval]
        num_examples = 0
        [ckpt]
        interval = 0
        [log]
        dir = "{run}"
        progress = false
        [distill]
        teacher = {{ path = "{teacher}" }}
        {extra}
        "#,
        student = fixture(student).display(),
        teacher = fixture(teacher).display(),
        env = graded_env(dir),
        run = dir.join("run").display(),
    );
    config::resolve(&text, &[]).unwrap()
}

/// The student (tiny-qwen2) samples; the teacher (tiny-qwen3, same
/// tokenizer) scores. Each sampled token's advantage must be
/// `kl_coef·(logp_teacher − logp_student) + reward_coef·A_reward`, over the
/// batch's token count, with both logprobs recomputed here from the models'
/// own forward passes.
#[test]
fn advantages_are_the_teachers_minus_the_students_logprob_of_each_sampled_token() {
    let d = tempfile::tempdir().unwrap();
    let rt = rt();
    let model = temper_rl::config::ModelSection {
        path: Some(fixture("tiny-qwen2")),
        ..Default::default()
    };
    let (student, trainer) =
        temper_rl::rl::local_trainer(&model, &Default::default(), 0, d.path()).unwrap();
    let prompt = student.tokenizer.encode("echo 7", true).unwrap();
    let sampler = rt.block_on(trainer.save_weights_for_sampler("s")).unwrap();
    let params = SamplingParams {
        max_tokens: 10,
        temperature: 1.0,
        seed: Some(11),
        ..Default::default()
    };
    let samples = rt
        .block_on(trainer.sample(&sampler, prompt.clone(), 4, params))
        .unwrap();
    let rollout = |s: &temper_engine::Sample| Rollout {
        model_turns: vec![ModelTurn {
            message: Message::assistant("x"),
            finish_reason: "stop".into(),
            usage: Default::default(),
            trace: Some(TokenTrace {
                prompt_ids: prompt.clone(),
                completion_ids: s.tokens.clone(),
                logprobs: s.logprobs.clone(),
                version: 0,
                temperature: 1.0,
            }),
        }],
        ..Default::default()
    };
    let rewards = [1.0, 0.0, 0.0, 0.0];
    let groups_g = vec![Group {
        env: 0,
        row: Row {
            example_id: 0,
            prompt: vec![],
            answer: None,
            info: Value::Null,
        },
        rollouts: samples.iter().map(rollout).collect(),
        scores: rewards
            .iter()
            .map(|&reward| Score {
                reward,
                ..Default::default()
            })
            .collect(),
        version: 0,
    }];
    let advantages_g = batch_advantages(&groups_g, false);
    let turns = TrainTurns::of_all(&groups_g, &advantages_g);
    assert_eq!(turns.seqs_d().len(), 4);

    let teacher = rt
        .block_on(Teacher::load(&local("tiny-qwen3"), &student.tokenizer))
        .unwrap();
    let teacher_d = rt.block_on(teacher.score(turns.seqs_d())).unwrap();
    let (kl_coef, reward_coef) = (1.5, 0.5);
    let (datums_d, kl) = turns
        .distill_datums(&teacher_d, kl_coef, reward_coef)
        .unwrap();

    // Independently: each model's own forward over the sampled sequence.
    let load = |n: &str| Pretrained::load(&fixture(n), &LoadOptions::default()).unwrap();
    let (t_model, s_model) = (load("tiny-qwen3"), load("tiny-qwen2"));
    let n_tokens: usize = samples.iter().map(|s| s.tokens.len()).sum();
    assert!(n_tokens > 4, "the student sampled tokens");
    assert_eq!(kl.tokens, n_tokens);
    let (mut kl_sum, mut checked) = (0.0f64, 0usize);
    for ((datum, s), a_r) in datums_d.iter().zip(&samples).zip(&advantages_g[0]) {
        let seq: Vec<u32> = prompt.iter().chain(&s.tokens).copied().collect();
        let score = |m: &Pretrained| {
            m.model
                .score(&seq[..seq.len() - 1], &seq[1..], None, 1.0)
                .unwrap()
                .logprobs
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let (lp_t, lp_s) = (score(&t_model), score(&s_model));
        let adv = datum.loss_fn_inputs.advantages.as_ref().unwrap();
        assert_eq!(adv.len(), seq.len() - 1);
        for i in 0..seq.len() - 1 {
            if i + 1 < prompt.len() {
                assert_eq!(adv[i], 0.0, "prompt target {i} carries no advantage");
                continue;
            }
            let (t, st) = (f64::from(lp_t[i]), f64::from(lp_s[i]));
            // The sampler's logprob is the student's own (a fresh LoRA is the base).
            let q = f64::from(s.logprobs[i + 1 - prompt.len()]);
            assert!((q - st).abs() < 1e-4, "sampler {q} vs student {st}");
            let want = (kl_coef * (t - st) + reward_coef * a_r) / n_tokens as f64;
            assert!(
                (f64::from(adv[i]) - want).abs() < 1e-5 * (1.0 + want.abs() * n_tokens as f64),
                "target {i}: advantage {} vs (teacher {t} − student {st}) → {want}",
                adv[i]
            );
            kl_sum += st - t;
            checked += 1;
        }
    }
    assert_eq!(checked, n_tokens);
    assert!(
        (kl.sum - kl_sum).abs() < 1e-3,
        "reverse KL {} vs {kl_sum}",
        kl.sum
    );
    // Different random models: the teacher disagrees with the student.
    assert!(kl_sum.abs() > 1e-3, "{kl_sum}");
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// `temper train rl` with `[distill]`: the reverse KL to the teacher falls
/// as the student trains on it, every step trains (groups with equal
/// rewards too: the teacher has something to say about every token), and
/// the loop is on-policy as in RL (mismatch 0).
#[test]
fn a_distilled_student_moves_toward_its_teacher() {
    let d = tempfile::tempdir().unwrap();
    let mut cfg = distill_config(d.path(), "tiny-qwen2", "tiny-qwen3", "");
    // Two random tiny models are nearly uniform over ~1000 tokens at
    // temperature 1, where a few hundred sampled tokens per step barely
    // show the teacher's preferences; at 0.4 (the teacher scores at the
    // sampling temperature too) the KL is larger and falls within steps.
    cfg.sampling.temperature = 0.4;
    cfg.trainer.lr = 5e-2;
    cfg.trainer.max_steps = 16;
    let out = rt().block_on(run_rl(cfg, RunOptions::default())).unwrap();
    let recs: Vec<_> = out.metrics.iter().map(|m| m.to_record().unwrap()).collect();
    let kl: Vec<f64> = recs
        .iter()
        .map(|m| m["distill/reverse_kl"].as_f64().unwrap())
        .collect();
    eprintln!("reverse KL per step: {kl:?}");
    for m in &recs {
        assert!(m["trained_sequences"].as_u64().unwrap() > 0, "{m:?}");
        assert!(m["distill/tokens"].as_u64().unwrap() > 0, "{m:?}");
        assert_eq!(m["mismatch/max"], json!(0.0), "{m:?}");
    }
    let (first, last) = (mean(&kl[..4]), mean(&kl[kl.len() - 4..]));
    assert!(
        last < 0.8 * first,
        "reverse KL did not fall: first steps {first}, last steps {last} ({kl:?})"
    );
    // The metrics.jsonl line carries it, and reads back.
    let text = std::fs::read_to_string(d.path().join("run/metrics.jsonl")).unwrap();
    assert!(text.lines().all(|l| l.contains("\"distill/reverse_kl\"")));
}

/// A teacher with another tokenizer (tiny-llama's) is refused before the
/// first step, with an error saying why.
#[test]
fn a_teacher_with_another_tokenizer_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let cfg = distill_config(d.path(), "tiny-qwen2", "tiny-llama", "");
    let e = rt()
        .block_on(run_rl(cfg, RunOptions::default()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the teacher's tokenizer differs from the student's")
            && e.contains("tiny-llama"),
        "{e}"
    );
    assert!(
        !d.path().join("run/metrics.jsonl").exists() || {
            std::fs::read_to_string(d.path().join("run/metrics.jsonl"))
                .unwrap()
                .is_empty()
        }
    );
}
