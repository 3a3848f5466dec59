//! What a reward function sees of one rollout, and the shapes of reward
//! functions.

use std::sync::Arc;

use serde_json::Value;

use crate::{Message, Parser, Rollout};

/// What a reward function sees of one rollout.
#[derive(Debug, Clone, Copy)]
pub struct RewardCtx<'a> {
    /// The prompt messages.
    pub prompt: &'a [Message],
    /// The completion messages.
    pub completion: &'a [Message],
    /// The reference answer.
    pub answer: Option<&'a str>,
    /// The row's task data.
    pub info: &'a Value,
    /// The environment's parser.
    pub parser: &'a Parser,
    /// The whole rollout (stop condition, usage, state).
    pub rollout: &'a Rollout,
}

impl RewardCtx<'_> {
    /// The parsed answer of the completion.
    pub fn parsed(&self) -> Option<String> {
        self.parser.parse_answer(self.completion)
    }
}

/// A reward function over one rollout.
pub type RewardFn = Arc<dyn Fn(&RewardCtx<'_>) -> f64 + Send + Sync>;
/// A reward function over the rollouts of one prompt: one score each.
pub type GroupFn = Arc<dyn Fn(&[RewardCtx<'_>]) -> Vec<f64> + Send + Sync>;
