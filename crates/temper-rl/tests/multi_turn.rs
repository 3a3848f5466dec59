//! Issue 12: a multi-turn episode trained as ONE sequence (model tokens
//! trained, environment tokens masked) gives the same loss and the same
//! trained weights as its per-turn form, with fewer tokens processed.

use std::sync::Arc;

use temper_engine::{Datum, Loss, LossInputs, Trainer};
use temper_env::{Message, ModelTurn, Rollout, Row, Score, TokenTrace};
use temper_rl::advantage::batch_advantages;
use temper_rl::config::{self, RlConfig};
use temper_rl::datum::TrainTurns;
use temper_rl::plan::Optim;
use temper_rl::rl::{local_trainer, Group};
use temper_rl::step::train_step;

fn tiny(dir: &std::path::Path) -> Arc<dyn Trainer> {
    let cfg: RlConfig = config::resolve(
        "seed = 5\n[model]\npreset = \"tiny\"\n[model.tiny]\nhidden_size = 32\nnum_layers = 2\n\
         num_heads = 2\nnum_kv_heads = 1\nintermediate_size = 64\n[lora]\nrank = 4\nalpha = 8.0\n",
        &[],
    )
    .unwrap();
    let (_base, trainer) = local_trainer(&cfg.model, &cfg.lora, 5, dir).unwrap();
    trainer
}

fn turn(prompt_ids: Vec<u32>, completion_ids: Vec<u32>, lp: f32) -> ModelTurn {
    let logprobs = completion_ids.iter().map(|_| lp).collect();
    ModelTurn {
        message: Message::assistant("x"),
        finish_reason: "stop".into(),
        usage: Default::default(),
        trace: Some(TokenTrace {
            prompt_ids,
            completion_ids,
            logprobs,
            version: 0,
            temperature: 1.0,
        }),
    }
}

/// A 3-turn episode on a template that does not rewrite history: each
/// turn's prompt is the previous prompt + completion + the environment's
/// reply.
fn episode(offset: u32, lp: f32) -> Rollout {
    let p1 = vec![1, 5 + offset, 6, 7, 8];
    let c1 = vec![9 + offset, 10, 11, 2];
    let mut p2 = [p1.clone(), c1.clone()].concat();
    p2.extend([12, 13, 14 + offset, 15]);
    let c2 = vec![16, 17 + offset, 2];
    let mut p3 = [p2.clone(), c2.clone()].concat();
    p3.extend([18 + offset, 19, 20]);
    let c3 = vec![21, 22, 23 + offset, 2];
    Rollout {
        model_turns: vec![
            turn(p1, c1, lp),
            turn(p2, c2, lp - 0.5),
            turn(p3, c3, lp - 1.0),
        ],
        ..Default::default()
    }
}

fn groups() -> Vec<Group> {
    let score = |reward| Score {
        reward,
        ..Default::default()
    };
    vec![Group {
        env: 0,
        row: Row {
            example_id: 0,
            prompt: vec![],
            answer: None,
            info: Default::default(),
        },
        rollouts: vec![episode(0, -3.0), episode(3, -2.5), episode(7, -4.0)],
        scores: vec![score(1.0), score(0.0), score(0.25)],
        version: 0,
    }]
}

/// A fixed datum to read the trained weights through.
fn probe() -> Datum {
    let tokens: Vec<u32> = (1..30).collect();
    Datum {
        model_input: tokens[..tokens.len() - 1].to_vec(),
        loss_fn_inputs: LossInputs {
            target_tokens: tokens[1..].to_vec(),
            ..Default::default()
        },
    }
}

#[test]
fn a_three_turn_episode_as_one_sequence_trains_like_its_turns_with_fewer_tokens() {
    let groups_g = groups();
    let advantages_g = batch_advantages(&groups_g, false);
    let merged = TrainTurns::of(&groups_g, &advantages_g);
    let per_turn = TrainTurns::per_turn(&groups_g, &advantages_g);
    assert_eq!(
        (merged.multi_turn_merged, merged.multi_turn_fallbacks),
        (3, 0)
    );
    assert_eq!((merged.seqs_d().len(), per_turn.seqs_d().len()), (3, 9));
    assert_eq!(merged.tokens(), per_turn.tokens(), "same trained tokens");
    // Each episode is 23 tokens: one datum of 22 inputs instead of three of
    // 8 + 15 + 22 (the history re-sent every turn).
    assert_eq!(merged.input_tokens(), 3 * 22);
    assert_eq!(per_turn.input_tokens(), 3 * (8 + 15 + 22));

    let rt = tokio::runtime::Runtime::new().unwrap();
    let optim = Optim {
        lr: 1e-3,
        warmup_steps: 0,
        batch_size: 1,
        micro_batch: 0,
        grad_clip: 0.0,
        weight_decay: 0.0,
        max_steps: 1,
    };
    let train = |turns: &TrainTurns| {
        let dir = tempfile::tempdir().unwrap();
        let trainer = tiny(dir.path());
        rt.block_on(async {
            let out = train_step(
                &*trainer,
                &optim,
                &Loss::ImportanceSampling,
                0,
                turns.datums(),
                turns.seqs_d(),
            )
            .await
            .unwrap();
            let after = trainer
                .forward(vec![probe()], Loss::CrossEntropy)
                .await
                .unwrap();
            (out, after.loss_fn_outputs[0].logprobs.clone())
        })
    };
    let (a, probe_a) = train(&merged);
    let (b, probe_b) = train(&per_turn);
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-5 * (1.0 + y.abs());
    assert!(a.loss_sum != 0.0 && a.grad_norm > 0.0, "{a:?}");
    assert!(
        close(a.loss_sum, b.loss_sum),
        "loss {} vs {}",
        a.loss_sum,
        b.loss_sum
    );
    assert!(
        close(a.grad_norm, b.grad_norm),
        "|g| {} vs {}",
        a.grad_norm,
        b.grad_norm
    );
    assert!(close(a.entropy_sum, b.entropy_sum));
    assert_eq!(a.entropy_tokens, b.entropy_tokens);
    assert!(close(a.mismatch_sum, b.mismatch_sum));
    assert_eq!(a.mismatch_tokens, b.mismatch_tokens);
    // The trained LoRA weights agree: the probe scores the same after the step.
    let worst = probe_a
        .iter()
        .zip(&probe_b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= 1e-5,
        "trained weights differ: max |Δ logprob| {worst}"
    );
    // ... and the step changed them (the comparison is not vacuous).
    let untrained = {
        let dir = tempfile::tempdir().unwrap();
        let t = tiny(dir.path());
        rt.block_on(t.forward(vec![probe()], Loss::CrossEntropy))
            .unwrap()
            .loss_fn_outputs[0]
            .logprobs
            .clone()
    };
    let moved = untrained
        .iter()
        .zip(&probe_a)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(
        moved > 1e-4,
        "the step did not change the weights ({moved})"
    );
    eprintln!(
        "loss {} vs {}; |g| {} vs {}; probe max |Δ| {worst:e} after a step that moved it {moved:e}",
        a.loss_sum, b.loss_sum, a.grad_norm, b.grad_norm
    );
}
