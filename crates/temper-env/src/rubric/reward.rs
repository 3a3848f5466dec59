//! A named, weighted reward function ([`Reward`]) of any kind — a plain
//! function, a judge, code tests, a test suite, a program — and a group
//! function ([`GroupReward`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use super::code_tests::CodeTests;
use super::context::{GroupFn, RewardCtx, RewardFn};
use super::judge::Judge;
use super::program::{ProgramReward, Runner};
use super::relative_judge::RelativeJudge;
use super::suite::Suite;

#[derive(Clone)]
pub(super) enum Kind {
    Sync(RewardFn),
    Judge(Arc<Judge>),
    CodeTests(Arc<CodeTests>),
    Suite(Arc<Suite>),
    Program(Arc<ProgramReward>),
    RelativeJudge(Arc<RelativeJudge>),
}

/// A named, weighted reward function.
#[derive(Clone)]
pub struct Reward {
    pub(super) name: String,
    pub(super) weight: f64,
    pub(super) kind: Kind,
    /// The largest raw score the function gives, when known (built-ins);
    /// a program's range is unknown.
    pub(super) max_score: Option<f64>,
}

impl std::fmt::Debug for Reward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reward({} × {})", self.name, self.weight)
    }
}

impl Reward {
    /// A reward from a plain function.
    pub fn new(
        name: impl Into<String>,
        weight: f64,
        f: impl Fn(&RewardCtx<'_>) -> f64 + Send + Sync + 'static,
    ) -> Self {
        Reward {
            name: name.into(),
            weight,
            kind: Kind::Sync(Arc::new(f)),
            max_score: None,
        }
    }

    /// The metric name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// An LLM judge.
    pub fn judge(weight: f64, judge: Judge) -> Self {
        Reward {
            name: "judge".into(),
            weight,
            kind: Kind::Judge(Arc::new(judge)),
            max_score: None,
        }
    }

    /// A relative LLM judge: one call scores the whole group
    /// ([`RelativeJudge`]).
    pub fn relative_judge(weight: f64, judge: RelativeJudge) -> Self {
        Reward {
            name: "relative_judge".into(),
            weight,
            kind: Kind::RelativeJudge(Arc::new(judge)),
            max_score: None,
        }
    }

    /// Unit tests in the sandbox service.
    pub fn code_tests(weight: f64, tests: CodeTests) -> Self {
        Reward {
            name: "code_tests".into(),
            weight,
            kind: Kind::CodeTests(Arc::new(tests)),
            max_score: None,
        }
    }

    /// A model's tests run against the row's code and its mutants in the
    /// sandbox ([`crate::rubric::suite`]): `mutation_score` or `coverage`, by the
    /// suite's mode.
    pub fn suite(weight: f64, suite: Suite) -> Self {
        Reward {
            name: suite.name().into(),
            weight,
            kind: Kind::Suite(Arc::new(suite)),
            max_score: None,
        }
    }

    /// Run sandboxed code with these Python packages (`[sandbox]
    /// requirements` of `env.toml`); other rewards are unchanged. Call it
    /// on a new reward (its runner not yet shared).
    pub fn with_requirements(mut self, requirements: &[String]) -> Self {
        let reqs = requirements.to_vec();
        match &mut self.kind {
            Kind::CodeTests(t) => {
                if let Some(t) = Arc::get_mut(t) {
                    t.requirements = reqs;
                }
            }
            Kind::Suite(s) => {
                if let Some(s) = Arc::get_mut(s) {
                    s.set_requirements(reqs);
                }
            }
            Kind::Program(p) => {
                if let Some(Runner::Sandbox { requirements, .. }) =
                    Arc::get_mut(p).map(|p| &mut p.runner)
                {
                    *requirements = reqs;
                }
            }
            Kind::Sync(_) | Kind::Judge(_) | Kind::RelativeJudge(_) => {}
        }
        self
    }

    /// Rename (the metric key).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// A reward program (see [`ProgramReward`]).
    pub fn program(weight: f64, name: impl Into<String>, program: ProgramReward) -> Self {
        Reward {
            name: name.into(),
            weight,
            kind: Kind::Program(Arc::new(program)),
            max_score: None,
        }
    }

    /// Declare the largest raw score this function gives.
    pub fn bounded(mut self, max_score: f64) -> Self {
        self.max_score = Some(max_score);
        self
    }

    /// The service it calls, if any.
    pub(super) fn service(&self) -> Option<Arc<dyn crate::Service>> {
        match &self.kind {
            Kind::Sync(_) => None,
            Kind::Judge(j) => j.endpoint.clone().map(|model| {
                Arc::new(crate::service::EndpointService {
                    model,
                    what: "judge",
                }) as Arc<dyn crate::Service>
            }),
            Kind::RelativeJudge(j) => j.endpoint.clone().map(|model| {
                Arc::new(crate::service::EndpointService {
                    model,
                    what: "judge",
                }) as Arc<dyn crate::Service>
            }),
            Kind::CodeTests(t) => Some(Arc::new(t.sandbox.clone())),
            Kind::Suite(s) => Some(Arc::new(s.sandbox().clone())),
            Kind::Program(p) => match &p.runner {
                Runner::Sandbox { sandbox, .. } => Some(Arc::new(sandbox.clone())),
                Runner::Process(_) => None,
            },
        }
    }

    /// One rollout's score and metrics reported as `NAME/metric`, or why
    /// the function could not give one.
    pub(super) async fn score(
        &self,
        ctx: &RewardCtx<'_>,
    ) -> Result<(f64, BTreeMap<String, f64>), String> {
        let plain = |v| (v, BTreeMap::new());
        match &self.kind {
            Kind::Sync(f) => Ok(plain(f(ctx))),
            Kind::Judge(j) => j.score(ctx).await.map(plain),
            Kind::CodeTests(t) => t.score(ctx).await.map(plain),
            Kind::Suite(s) => s.score(ctx).await,
            // Scored per group in `Rubric::score_group`.
            Kind::Program(_) | Kind::RelativeJudge(_) => Ok(plain(0.0)),
        }
    }
}

/// A named, weighted group function.
#[derive(Clone)]
pub struct GroupReward {
    pub(super) name: String,
    pub(super) weight: f64,
    pub(super) f: GroupFn,
}

impl GroupReward {
    /// A group function: one score per rollout of the group.
    pub fn new(
        name: impl Into<String>,
        weight: f64,
        f: impl Fn(&[RewardCtx<'_>]) -> Vec<f64> + Send + Sync + 'static,
    ) -> Self {
        GroupReward {
            name: name.into(),
            weight,
            f: Arc::new(f),
        }
    }
}
