//! RL and SFT training loops over temper's trainer, environments and
//! samplers.
//!
//! The RL loop ([`rl::run_rl`]) reads top to bottom in one function; each
//! stage of it is a module named after what it does:
//!
//! | stage | module | what it does |
//! |---|---|---|
//! | sample | [`rollout`] | roll out each step's groups against the published policy (inline, or a producer running ahead by at most `max_off_policy_steps`) |
//! | score | [`advantage`] | group-relative advantages; all-equal groups teach nothing |
//! | batch | [`datum`] | model turns' [`TokenTrace`](temper_env::TokenTrace)s → training [`Datum`](temper_engine::Datum)s (a multi-turn episode as one sequence when its turns extend each other) |
//! | distill | [`teacher`] | (with `[distill]`) the teacher's logprobs of the sampled tokens; each token's advantage becomes `logp_teacher − logp_student` |
//! | train | [`step`] | `forward_backward` over micro-batches, then `optim_step` |
//! | publish | [`publish`] | the new weights to the sampler, announced to the producer |
//! | log | [`metrics`] | the step's typed [`StepMetrics`] → a `metrics.jsonl` line |
//! | checkpoint | [`checkpoint`] | trainer state + `latest.json`, for `--resume` |
//!
//! The stages hand each other [`sampled`]'s types (a prompt's scored
//! rollouts, a step's groups) and import only downwards.
//!
//! Around it: [`config`] (the TOML file), [`open_trainer`] (in-process or remote
//! trainer), [`policy`] (policies as chat models), [`eval`] (held-out
//! evaluation), [`runlog`] (`metrics.jsonl`, `plots.html`), [`samples`]
//! (a few rollouts per step as text, `samples.jsonl`), [`sft`]
//! (supervised fine-tuning), [`preset`] (a tiny model written from
//! nothing) and [`quickstart`].
//!
//! Shape suffixes name what a batch is indexed by: `_g` one per group of a
//! step, `_r` one per rollout of a group, `_d` one per datum, `_t` one per
//! token.
//!
//! # Design: what was sampled is what is trained
//!
//! A policy renders and tokenizes the conversation itself and samples from
//! token ids, and every model turn carries its [`TokenTrace`](temper_env::TokenTrace)
//! (prompt ids, completion ids, the sampler's logprobs, the policy version
//! and the sampling temperature) as a type, from the sampler to the loss.
//! Nothing is re-tokenized and nothing is filled in: a turn whose trace is
//! missing or inconsistent is counted (`skipped_turns`) and not trained on,
//! and the trainer scores each turn at the temperature it was sampled at,
//! so on-policy importance ratios are exactly 1.
//!
//! # Example
//!
//! Two rollouts of one prompt; the second lost a logprob on the way, so it
//! is counted and left out rather than trained against a zero.
//!
//! ```
//! use temper_env::{Message, ModelTurn, Rollout, Row, Score, TokenTrace};
//! use temper_rl::advantage::batch_advantages;
//! use temper_rl::datum::TrainTurns;
//! use temper_rl::sampled::Group;
//!
//! let rollout = |logprobs: Vec<f32>| Rollout {
//!     model_turns: vec![ModelTurn {
//!         message: Message::assistant("ab"),
//!         finish_reason: "stop".into(),
//!         usage: Default::default(),
//!         trace: Some(TokenTrace {
//!             prompt_ids: vec![1, 2],
//!             completion_ids: vec![3, 4],
//!             logprobs,
//!             version: 0,
//!             temperature: 1.0,
//!         }),
//!     }],
//!     ..Default::default()
//! };
//! let score = |reward| Score { reward, ..Default::default() };
//! let groups_g = vec![Group {
//!     env: 0,
//!     row: Row { example_id: 0, prompt: vec![], answer: None, info: Default::default() },
//!     rollouts: vec![rollout(vec![-0.5, -0.25]), rollout(vec![-0.5])],
//!     scores: vec![score(1.0), score(0.0)],
//!     version: 0,
//! }];
//!
//! let advantages_g = batch_advantages(&groups_g, false);
//! assert_eq!(advantages_g, vec![vec![0.5, -0.5]]);
//! let turns = TrainTurns::of(&groups_g, &advantages_g);
//! assert_eq!((turns.seqs_d().len(), turns.skipped_turns), (1, 1));
//!
//! let datums_d = turns.datums();
//! assert_eq!(datums_d[0].model_input, vec![1, 2, 3]);
//! let inputs = &datums_d[0].loss_fn_inputs;
//! assert_eq!(inputs.target_tokens, vec![2, 3, 4]);
//! assert_eq!(inputs.logprobs, Some(vec![0.0, -0.5, -0.25]));
//! // The advantage is spread over the batch's 2 completion tokens.
//! assert_eq!(inputs.advantages, Some(vec![0.0, 0.25, 0.25]));
//! ```

#![deny(missing_docs)]

pub mod advantage;
pub mod alerts;
pub mod checkpoint;
pub mod config;
pub mod datum;
pub mod dpo;
pub mod dpo_online;
pub mod error;
pub mod eval;
pub mod metrics;
pub mod open_trainer;
pub mod plan;
pub mod policy;
pub mod pref_pair;
pub mod preset;
pub mod probe;
pub mod publish;
pub mod quickstart;
pub mod rl;
pub mod rollout;
pub mod runlog;
pub mod sampled;
pub mod samples;
pub mod sft;
pub mod step;
pub mod teacher;
pub mod tensorboard;

pub use error::{Result, RlError};
pub use metrics::StepMetrics;
pub use plan::{DpoPlan, RlPlan, SftPlan};
