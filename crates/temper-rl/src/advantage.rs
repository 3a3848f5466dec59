//! Scoring a group: each rollout's advantage is its reward relative to the
//! other rollouts of the same prompt (GRPO-style), so no value model is
//! needed. A group whose rewards are all equal has nothing to teach and is
//! skipped downstream.

use crate::sampled::Group;

/// Advantages of one group: reward minus the group mean, optionally over
/// the group's standard deviation. All zero when every reward is equal.
///
/// ```
/// use temper_rl::advantage::group_advantages;
///
/// let rewards_r = [1.0, 0.0, 0.0, 1.0];
/// assert_eq!(group_advantages(&rewards_r, false), vec![0.5, -0.5, -0.5, 0.5]);
/// assert!(group_advantages(&[0.3; 4], true).iter().all(|a| *a == 0.0));
/// ```
pub fn group_advantages(rewards_r: &[f64], normalize_std: bool) -> Vec<f64> {
    let n = rewards_r.len().max(1) as f64;
    let mean = rewards_r.iter().sum::<f64>() / n;
    let var = rewards_r.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n;
    let std = var.sqrt();
    rewards_r
        .iter()
        .map(|r| {
            let a = r - mean;
            if normalize_std {
                a / (std + 1e-6)
            } else {
                a
            }
        })
        .collect()
}

/// The advantages of every group of a batch, `advantages_g[g][r]`.
pub fn batch_advantages(groups_g: &[Group], normalize_std: bool) -> Vec<Vec<f64>> {
    groups_g
        .iter()
        .map(|g| group_advantages(&g.rewards_r(), normalize_std))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advantages_are_centred_and_optionally_scaled() {
        assert_eq!(
            group_advantages(&[1.0, 0.0, 0.0, 1.0], false),
            vec![0.5, -0.5, -0.5, 0.5]
        );
        let a = group_advantages(&[1.0, 0.0, 0.0, 1.0], true);
        assert!((a[0] - 1.0).abs() < 1e-5 && (a[1] + 1.0).abs() < 1e-5);
        assert!(group_advantages(&[0.3; 4], true).iter().all(|x| *x == 0.0));
    }
}
