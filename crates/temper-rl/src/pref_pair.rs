//! A tokenized preference pair and its datums: what DPO trains on, whether
//! the pairs come from a file (`dpo`) or from sampled answers
//! (`dpo_online`), so both import it from here and neither from the other.

use temper_engine::{Datum, LossInputs};

/// One tokenized preference pair: a prompt and two completions of it.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefPair {
    /// Prompt tokens.
    pub prompt: Vec<u32>,
    /// The preferred completion's tokens.
    pub chosen: Vec<u32>,
    /// The other completion's tokens.
    pub rejected: Vec<u32>,
}

impl PrefPair {
    /// The datum of one side (`chosen` or `rejected`): the completion's
    /// target tokens weighted `weight`, the prompt's 0.
    pub(crate) fn datum(&self, completion: &[u32], weight: f32) -> Datum {
        let mut tokens = self.prompt.clone();
        tokens.extend_from_slice(completion);
        let n = tokens.len();
        let p = self.prompt.len();
        Datum {
            model_input: tokens[..n - 1].to_vec(),
            loss_fn_inputs: LossInputs {
                target_tokens: tokens[1..].to_vec(),
                // Target i predicts token i + 1: completion targets start at p − 1.
                weights: Some((1..n).map(|i| if i >= p { weight } else { 0.0 }).collect()),
                ..Default::default()
            },
        }
    }

    /// Both sides' datums, chosen first.
    pub(crate) fn datums(&self, w_chosen: f32, w_rejected: f32) -> [Datum; 2] {
        [
            self.datum(&self.chosen, w_chosen),
            self.datum(&self.rejected, w_rejected),
        ]
    }

    /// Both sides' datums for the engine's pair loss: weight 1 on the
    /// completion's targets and the reference's summed completion logprob
    /// as the `logprobs` of its last target (the loss takes only their
    /// weighted sum, see [`temper_engine::Loss::Dpo`]).
    pub(crate) fn pair_datums(&self, reference: PairLogps) -> [Datum; 2] {
        let with_ref = |mut d: Datum, r: f64| {
            let n = d.loss_fn_inputs.target_tokens.len();
            let mut q = vec![0.0f32; n];
            q[n - 1] = r as f32;
            d.loss_fn_inputs.logprobs = Some(q);
            d
        };
        [
            with_ref(self.datum(&self.chosen, 1.0), reference.0),
            with_ref(self.datum(&self.rejected, 1.0), reference.1),
        ]
    }
}

/// Summed completion logprobs of a pair: `(chosen, rejected)`.
pub type PairLogps = (f64, f64);
