//! Alerts for an RL run going wrong, computed from each step's metrics
//! while it trains: the completion length growing fast together with the
//! reward (length hacking), entropy collapsing, many truncated rollouts,
//! training reward rising while the held-out score falls, most groups with
//! zero advantage (nothing learned), and a sampler/learner mismatch where
//! the in-process engine promises none. Each alert names its rule and the
//! thresholds of `[alerts]`; it is shown in the progress line, written in
//! `metrics.jsonl` (`alerts`) and on `temper view`'s page, and stops the
//! run only when `[alerts] stop_on` names its rule.
//!
//! An alert is raised when its rule starts to hold, and again only after
//! the rule stopped holding for a step.

use crate::config::AlertsSection;
use crate::error::{Result, RlError};
use crate::metrics::{mean, StepMetrics};

/// The rules, by name.
pub const RULES: &[&str] = &[
    "length_growth",
    "entropy_collapse",
    "truncation",
    "heldout_divergence",
    "zero_advantage",
    "mismatch",
];

/// One raised alert.
#[derive(Debug, Clone, PartialEq)]
pub struct Alert {
    /// Its rule (one of [`RULES`]).
    pub rule: &'static str,
    /// What was seen, with the threshold.
    pub message: String,
}

impl std::fmt::Display for Alert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.rule, self.message)
    }
}

#[derive(Debug, Clone, Default)]
struct Obs {
    step: u64,
    reward: f64,
    len: f64,
    entropy: Option<f64>,
    truncation: f64,
    zero_adv: f64,
    mismatch: Option<f64>,
    heldout: Option<f64>,
}

/// Watches a run's steps and raises [`Alert`]s.
pub struct AlertMonitor {
    cfg: AlertsSection,
    exact_sampler: bool,
    seen: Vec<Obs>,
    /// The held-out pass@1 before training (step 0), when evaluated.
    baseline: Option<f64>,
    holding: Vec<&'static str>,
}

impl AlertMonitor {
    /// A monitor with `cfg`'s thresholds; `exact_sampler` when rollouts
    /// come from the in-process engine (mismatch 0 promised). Unknown
    /// `stop_on` rules are an error.
    pub fn new(cfg: &AlertsSection, exact_sampler: bool) -> Result<Self> {
        if let Some(bad) = cfg.stop_on.iter().find(|r| !RULES.contains(&r.as_str())) {
            return Err(RlError::Config(format!(
                "alerts.stop_on: unknown rule {bad:?} (rules: {})",
                RULES.join(", ")
            )));
        }
        if cfg.window == 0 {
            return Err(RlError::Config("alerts.window must be at least 1".into()));
        }
        Ok(Self {
            cfg: cfg.clone(),
            exact_sampler,
            seen: Vec::new(),
            baseline: None,
            holding: Vec::new(),
        })
    }

    /// The held-out pass@1 before training.
    pub fn set_baseline(&mut self, pass_at_1: f64) {
        self.baseline = Some(pass_at_1);
    }

    /// Record step `m` (of `groups` groups); the alerts it raises.
    pub fn observe(&mut self, m: &StepMetrics, groups: usize) -> Vec<Alert> {
        self.seen.push(Obs {
            step: m.step,
            reward: m.rollouts.reward_mean,
            len: m.rollouts.seq_len_mean,
            entropy: (m.train.entropy > 0.0).then_some(m.train.entropy),
            truncation: m.rollouts.truncation_rate,
            zero_adv: if groups == 0 {
                0.0
            } else {
                m.data.zero_advantage_groups as f64 / groups as f64
            },
            // On-policy tokens and the probe of off-policy ones: the larger
            // of what was measured, none when nothing was.
            mismatch: [m.train.mismatch_max, m.train.probe_max]
                .into_iter()
                .flatten()
                .reduce(f64::max),
            heldout: m.time.eval_pass_at_1,
        });
        if !self.cfg.enabled {
            return Vec::new();
        }
        let now: Vec<Alert> = [
            self.length_growth(),
            self.entropy_collapse(),
            self.truncation(),
            self.heldout_divergence(),
            self.zero_advantage(),
            self.mismatch(),
        ]
        .into_iter()
        .flatten()
        .collect();
        let raised = now
            .iter()
            .filter(|a| !self.holding.contains(&a.rule))
            .cloned()
            .collect();
        self.holding = now.iter().map(|a| a.rule).collect();
        raised
    }

    /// The first of `alerts` whose rule `stop_on` names.
    pub fn stopping<'a>(&self, alerts: &'a [Alert]) -> Option<&'a Alert> {
        alerts
            .iter()
            .find(|a| self.cfg.stop_on.iter().any(|r| r == a.rule))
    }

    fn last(&self, n: usize) -> Option<&[Obs]> {
        self.seen.len().checked_sub(n).map(|s| &self.seen[s..])
    }

    fn length_growth(&self) -> Option<Alert> {
        let w = self.cfg.window;
        let both = self.last(2 * w)?;
        let (before, now) = both.split_at(w);
        let len = |o: &[Obs]| mean(&o.iter().map(|o| o.len).collect::<Vec<_>>());
        let reward = |o: &[Obs]| mean(&o.iter().map(|o| o.reward).collect::<Vec<_>>());
        let (l0, l1, r0, r1) = (len(before), len(now), reward(before), reward(now));
        (l0 > 0.0 && l1 >= (1.0 + self.cfg.length_growth) * l0 && r1 > r0).then(|| Alert {
            rule: "length_growth",
            message: format!(
                "mean completion length {l0:.1} → {l1:.1} tokens (+{:.0}%, threshold +{:.0}%) over the last {w} steps while the reward rose {r0:.3} → {r1:.3}: is the policy padding its answers?",
                100.0 * (l1 / l0 - 1.0),
                100.0 * self.cfg.length_growth
            ),
        })
    }

    fn entropy_collapse(&self) -> Option<Alert> {
        let w = self.cfg.window;
        let ent: Vec<f64> = self.seen.iter().filter_map(|o| o.entropy).collect();
        if ent.len() < 2 * w {
            return None;
        }
        let (first, now) = (mean(&ent[..w]), mean(&ent[ent.len() - w..]));
        (now <= self.cfg.entropy_collapse * first).then(|| Alert {
            rule: "entropy_collapse",
            message: format!(
                "mean entropy of the last {w} steps {now:.4} is {:.0}% of the first {w} steps' {first:.4} (threshold {:.0}%): the policy stopped exploring",
                100.0 * now / first,
                100.0 * self.cfg.entropy_collapse
            ),
        })
    }

    fn truncation(&self) -> Option<Alert> {
        let w = self.cfg.window;
        let t = mean(
            &self
                .last(w)?
                .iter()
                .map(|o| o.truncation)
                .collect::<Vec<_>>(),
        );
        (t >= self.cfg.truncation_rate).then(|| Alert {
            rule: "truncation",
            message: format!(
                "{:.0}% of the last {w} steps' rollouts hit the token limit (threshold {:.0}%): raise [sampling] max_tokens or reward shorter answers",
                100.0 * t,
                100.0 * self.cfg.truncation_rate
            ),
        })
    }

    fn heldout_divergence(&self) -> Option<Alert> {
        let w = self.cfg.window;
        let n = self.seen.len();
        let now = self.seen.last()?;
        let h1 = now.heldout?;
        // The previous evaluation: an earlier step's, else the baseline.
        let prev = self.seen[..n - 1].iter().rposition(|o| o.heldout.is_some());
        let (h0, prev_end) = match prev {
            Some(i) => (self.seen[i].heldout?, i + 1),
            None => (self.baseline?, 0),
        };
        let reward_before = |end: usize| {
            let start = end.saturating_sub(w);
            let r: Vec<f64> = self.seen[start..end].iter().map(|o| o.reward).collect();
            (!r.is_empty()).then(|| mean(&r))
        };
        // Before any step, the first window's reward stands for the start.
        let r0 = reward_before(prev_end).or_else(|| reward_before(w.min(n)))?;
        let r1 = reward_before(n)?;
        (h0 - h1 >= self.cfg.heldout_drop && r1 > r0).then(|| Alert {
            rule: "heldout_divergence",
            message: format!(
                "held-out pass@1 fell {h0:.3} → {h1:.3} (threshold −{:.3}) by step {} while the training reward rose {r0:.3} → {r1:.3}: overfitting or reward hacking",
                self.cfg.heldout_drop, now.step
            ),
        })
    }

    fn zero_advantage(&self) -> Option<Alert> {
        let w = self.cfg.window;
        let z = mean(&self.last(w)?.iter().map(|o| o.zero_adv).collect::<Vec<_>>());
        (z >= self.cfg.zero_advantage).then(|| Alert {
            rule: "zero_advantage",
            message: format!(
                "{:.0}% of the last {w} steps' groups had all-equal rewards (threshold {:.0}%): little is being learned (raise [sampling] temperature or group_size, or give partial credit)",
                100.0 * z,
                100.0 * self.cfg.zero_advantage
            ),
        })
    }

    fn mismatch(&self) -> Option<Alert> {
        if !self.exact_sampler {
            return None;
        }
        let m = self.seen.last()?.mismatch?;
        (m > self.cfg.mismatch).then(|| Alert {
            rule: "mismatch",
            message: format!(
                "learner and sampler logprobs differ by up to {m:.2e} (threshold {:.1e}) though the in-process engine samples with the trained weights: a bug worth reporting",
                self.cfg.mismatch
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(i: u64, f: impl Fn(&mut StepMetrics)) -> StepMetrics {
        let mut m = StepMetrics {
            step: i,
            ..Default::default()
        };
        m.rollouts.reward_mean = 0.5;
        m.rollouts.seq_len_mean = 20.0;
        m.train.entropy = 1.0;
        m.train.mismatch_tokens = 10;
        f(&mut m);
        m
    }

    fn cfg() -> AlertsSection {
        AlertsSection {
            window: 2,
            ..Default::default()
        }
    }

    /// Runs `steps` through a monitor; the rules raised at each step.
    fn rules(cfg: &AlertsSection, exact: bool, steps: &[StepMetrics]) -> Vec<Vec<&'static str>> {
        let mut m = AlertMonitor::new(cfg, exact).unwrap();
        steps
            .iter()
            .map(|s| m.observe(s, 4).iter().map(|a| a.rule).collect())
            .collect()
    }

    fn flat(r: &[Vec<&'static str>]) -> Vec<&'static str> {
        r.iter().flatten().copied().collect()
    }

    #[test]
    fn length_growth_fires_when_length_and_reward_grow_together() {
        let grow = |i: u64, len: f64, reward: f64| {
            step(i, |m| {
                m.rollouts.seq_len_mean = len;
                m.rollouts.reward_mean = reward;
            })
        };
        let hacking = [
            grow(1, 20.0, 0.2),
            grow(2, 20.0, 0.2),
            grow(3, 40.0, 0.6),
            grow(4, 40.0, 0.6),
        ];
        let r = rules(&cfg(), true, &hacking);
        assert_eq!(r[3], ["length_growth"], "{r:?}");
        // Longer but no better: not this rule.
        let longer = [
            grow(1, 20.0, 0.6),
            grow(2, 20.0, 0.6),
            grow(3, 40.0, 0.2),
            grow(4, 40.0, 0.2),
        ];
        assert!(!flat(&rules(&cfg(), true, &longer)).contains(&"length_growth"));
        // Growth under the threshold (+25% < +50%).
        let mild = [
            grow(1, 20.0, 0.2),
            grow(2, 20.0, 0.2),
            grow(3, 25.0, 0.6),
            grow(4, 25.0, 0.6),
        ];
        assert!(!flat(&rules(&cfg(), true, &mild)).contains(&"length_growth"));
    }

    #[test]
    fn entropy_collapse_fires_below_the_fraction_of_the_start() {
        let e = |i: u64, ent: f64| step(i, |m| m.train.entropy = ent);
        let r = rules(&cfg(), true, &[e(1, 1.0), e(2, 1.0), e(3, 0.1), e(4, 0.1)]);
        assert_eq!(r[3], ["entropy_collapse"], "{r:?}");
        let r = rules(&cfg(), true, &[e(1, 1.0), e(2, 1.0), e(3, 0.5), e(4, 0.5)]);
        assert!(flat(&r).is_empty(), "{r:?}");
    }

    #[test]
    fn truncation_fires_at_the_rate_and_once_while_it_holds() {
        let t = |i: u64, rate: f64| step(i, |m| m.rollouts.truncation_rate = rate);
        let r = rules(
            &cfg(),
            true,
            &[
                t(1, 0.5),
                t(2, 0.5),
                t(3, 0.5),
                t(4, 0.0),
                t(5, 0.0),
                t(6, 0.5),
                t(7, 0.6),
            ],
        );
        // Raised at step 2 and held at 3; from step 4 (mean 0.25) it stops
        // holding, and at step 7 it is raised again.
        assert_eq!(r[1], ["truncation"]);
        assert!(r[2].is_empty() && r[3].is_empty(), "{r:?}");
        assert_eq!(r[6], ["truncation"], "{r:?}");
        let r = rules(&cfg(), true, &[t(1, 0.1), t(2, 0.2), t(3, 0.1)]);
        assert!(flat(&r).is_empty(), "{r:?}");
    }

    #[test]
    fn heldout_divergence_fires_when_train_rises_and_heldout_falls() {
        let s = |i: u64, reward: f64, held: Option<f64>| {
            step(i, |m| {
                m.rollouts.reward_mean = reward;
                m.time.eval_pass_at_1 = held;
            })
        };
        let bad = [
            s(1, 0.2, None),
            s(2, 0.2, Some(0.5)),
            s(3, 0.6, None),
            s(4, 0.6, Some(0.3)),
        ];
        assert_eq!(rules(&cfg(), true, &bad)[3], ["heldout_divergence"]);
        // Both rise: fine.
        let good = [
            s(1, 0.2, None),
            s(2, 0.2, Some(0.5)),
            s(3, 0.6, None),
            s(4, 0.6, Some(0.6)),
        ];
        assert!(flat(&rules(&cfg(), true, &good)).is_empty());
        // Against the baseline evaluation before training.
        let mut m = AlertMonitor::new(&cfg(), true).unwrap();
        m.set_baseline(0.5);
        m.observe(&s(1, 0.2, None), 4);
        m.observe(&s(2, 0.2, None), 4);
        m.observe(&s(3, 0.7, None), 4);
        let a = m.observe(&s(4, 0.7, Some(0.25)), 4);
        assert_eq!(a.len(), 1, "{a:?}");
        assert!(a[0].message.contains("0.500 → 0.250"), "{}", a[0]);
    }

    #[test]
    fn zero_advantage_fires_when_most_groups_teach_nothing() {
        let z = |i: u64, n: u64| step(i, |m| m.data.zero_advantage_groups = n);
        // 4 groups a step: 4/4 and 3/4 average 87.5% ≥ 80%.
        assert_eq!(
            rules(&cfg(), true, &[z(1, 4), z(2, 3)])[1],
            ["zero_advantage"]
        );
        assert!(flat(&rules(&cfg(), true, &[z(1, 2), z(2, 3)])).is_empty());
    }

    #[test]
    fn mismatch_fires_only_where_the_engine_promises_zero() {
        let mm = |i: u64, v: f64| step(i, |m| m.train.mismatch_max = Some(v));
        assert_eq!(
            rules(&cfg(), true, &[mm(1, 0.0), mm(2, 1e-3)])[1],
            ["mismatch"]
        );
        assert!(flat(&rules(&cfg(), true, &[mm(1, 0.0), mm(2, 0.0)])).is_empty());
        // An external sampler (other kernels): expected, no alert.
        assert!(flat(&rules(&cfg(), false, &[mm(1, 1e-3)])).is_empty());
    }

    /// A step of off-policy rollouts only: the probe's measure alone raises
    /// it, and a step where nothing was measured raises nothing.
    #[test]
    fn a_nonzero_probe_is_a_mismatch_alert() {
        let probe = |i: u64, v: Option<f64>| {
            step(i, |m| {
                m.train.mismatch_tokens = 0;
                m.train.mismatch_max = None;
                m.train.probe_max = v;
            })
        };
        assert_eq!(
            rules(&cfg(), true, &[probe(1, Some(0.0)), probe(2, Some(1e-3))])[1],
            ["mismatch"]
        );
        assert!(flat(&rules(&cfg(), true, &[probe(1, None), probe(2, Some(0.0))])).is_empty());
    }

    #[test]
    fn stop_on_names_known_rules_and_picks_the_alert_that_stops() {
        let mut c = cfg();
        c.stop_on = vec!["nonsense".into()];
        let e = AlertMonitor::new(&c, true).err().unwrap();
        assert!(e.to_string().contains("length_growth"), "{e}");
        c.stop_on = vec!["mismatch".into()];
        let mut m = AlertMonitor::new(&c, true).unwrap();
        let a = m.observe(&step(1, |m| m.train.mismatch_max = Some(0.1)), 4);
        assert_eq!(m.stopping(&a).map(|a| a.rule), Some("mismatch"));
        let m = AlertMonitor::new(&cfg(), true).unwrap();
        assert!(m.stopping(&a).is_none(), "without stop_on nothing stops");
        // Disabled: nothing raised.
        let off = AlertsSection {
            enabled: false,
            ..cfg()
        };
        assert!(flat(&rules(
            &off,
            true,
            &[step(1, |m| m.train.mismatch_max = Some(0.1))]
        ))
        .is_empty());
    }
}
