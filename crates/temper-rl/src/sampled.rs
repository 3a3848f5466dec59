//! What sampling hands training: one prompt's scored rollouts ([`Group`])
//! and one step's groups ([`Batch`]). Defined apart from the stages
//! (sample, score, batch, train, log), which all read them, so that each
//! stage imports them from below.

use temper_env::{Rollout, Row, Score};

/// One prompt's rollouts, scored.
#[derive(Debug, Clone)]
pub struct Group {
    /// Index of the environment in the config's `[[env]]` list.
    pub env: usize,
    /// The row.
    pub row: Row,
    /// Its rollouts.
    pub rollouts: Vec<Rollout>,
    /// Their scores.
    pub scores: Vec<Score>,
    /// Oldest policy version among the rollouts' model turns.
    pub version: u64,
}

impl Group {
    /// The reward of each rollout.
    pub fn rewards_r(&self) -> Vec<f64> {
        self.scores.iter().map(|s| s.reward).collect()
    }
}

/// One step's groups.
#[derive(Debug, Clone)]
pub struct Batch {
    /// The step that trains on it.
    pub step: u64,
    /// Its groups, one per prompt.
    pub groups_g: Vec<Group>,
    /// Seconds spent generating it (scoring included).
    pub generate_s: f64,
    /// Seconds of `generate_s` during which some group was being scored.
    pub reward_s: f64,
}

impl Batch {
    /// Split off the groups whose policy lags `step` by more than
    /// `max_off` versions: (the groups to train on, how many were dropped).
    /// A stale group is never trained on (it can happen with an external
    /// sampler that swaps adapters late).
    pub fn drop_stale(self, step: u64, max_off: u64) -> (Vec<Group>, u64) {
        let total = self.groups_g.len();
        let fresh_g: Vec<Group> = self
            .groups_g
            .into_iter()
            .filter(|g| step.saturating_sub(g.version) <= max_off)
            .collect();
        let dropped = (total - fresh_g.len()) as u64;
        (fresh_g, dropped)
    }
}
