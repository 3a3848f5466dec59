//! Weights to the sampler, beside the loop: after each optimizer step the
//! [`Publisher`] makes the new policy version samplable — a sampler handle
//! of the in-process engine, or a PEFT adapter hot-loaded into an external
//! `temper serve` — and announces it on a watch channel that the rollout
//! producer follows.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use temper_engine::Trainer;
use temper_env::ChatModel;
use temper_model::Pretrained;
use tokio::sync::watch;

use crate::error::Result;
use crate::plan::RlPlan;
use crate::policy::{Batcher, EnginePolicy, HttpPolicy, Renderer};

/// Where a published policy can be sampled.
#[derive(Clone)]
pub struct Published {
    /// Its version: optimizer steps taken.
    pub version: u64,
    /// The policy as a chat model.
    pub model: Arc<dyn ChatModel>,
}

/// How new weights reach the sampler.
enum Target {
    Engine {
        batcher: Batcher,
        /// Handles still published with their versions, oldest first.
        live: VecDeque<(u64, String)>,
        /// How many to keep: every version a producer may still sample from.
        keep: usize,
    },
    Http {
        policy: HttpPolicy,
        dir: PathBuf,
        versions: VersionMap,
    },
}

/// The server's adapter version → our policy version. Publishing holds the
/// lock while the server swaps adapters, so a turn that reports a new
/// server version finds its mapping (it waits for the insert).
type VersionMap = Arc<tokio::sync::Mutex<BTreeMap<u64, u64>>>;

/// Publishes each new policy version to the sampler.
pub struct Publisher {
    trainer: Arc<dyn Trainer>,
    renderer: Renderer,
    target: Target,
    announce: watch::Sender<Option<Published>>,
}

impl Publisher {
    /// For `cfg.sampler`: the in-process engine (sampled through a
    /// [`Batcher`] started here) or the external server at `sampler.url`;
    /// `base` gives the chat template and tokenizer.
    pub fn new(
        cfg: &RlPlan,
        trainer: Arc<dyn Trainer>,
        base: Arc<Pretrained>,
        run_dir: &Path,
    ) -> Result<Self> {
        let renderer = Renderer::new(base)?;
        let target = match &cfg.sampler.url {
            None => Target::Engine {
                batcher: Batcher::spawn(trainer.clone()),
                live: VecDeque::new(),
                // The producer may hold version j − max_off while j + 1 is
                // published; one more for the batch being handed over.
                keep: cfg.async_.max_off_policy_steps as usize + 3,
            },
            // The plan checked an external sampler comes with LoRA enabled.
            Some(url) => {
                let key = cfg
                    .sampler
                    .api_key_env
                    .as_ref()
                    .and_then(|v| std::env::var(v).ok());
                let name = if cfg.sampler.adapter_name.is_empty() {
                    "policy".to_string()
                } else {
                    cfg.sampler.adapter_name.clone()
                };
                Target::Http {
                    policy: HttpPolicy::new(renderer.clone(), url, &name, key),
                    dir: run_dir.join("published"),
                    versions: Default::default(),
                }
            }
        };
        Ok(Self {
            trainer,
            renderer,
            target,
            announce: watch::channel(None).0,
        })
    }

    /// The in-process sampler's batcher (none for an external sampler).
    pub fn batcher(&self) -> Option<Batcher> {
        match &self.target {
            Target::Engine { batcher, .. } => Some(batcher.clone()),
            Target::Http { .. } => None,
        }
    }

    /// The in-process sampler handle of policy `version`, while it is still
    /// published (none for an external sampler): the weights that sampled
    /// that version's rollouts, for the mismatch probe.
    pub fn sampler_of(&self, version: u64) -> Option<String> {
        match &self.target {
            Target::Engine { live, .. } => live
                .iter()
                .find(|(v, _)| *v == version)
                .map(|(_, h)| h.clone()),
            Target::Http { .. } => None,
        }
    }

    /// Follow the published policies (`None` until the first).
    pub fn subscribe(&self) -> watch::Receiver<Option<Published>> {
        self.announce.subscribe()
    }

    /// Make the trainer's current weights samplable as `version`, and
    /// announce them.
    pub async fn publish(&mut self, version: u64) -> Result<Published> {
        let trainer = &self.trainer;
        let published = match &mut self.target {
            Target::Engine {
                batcher,
                live,
                keep,
            } => {
                let handle = trainer
                    .save_weights_for_sampler(&format!("policy-{version}"))
                    .await?;
                live.push_back((version, handle.clone()));
                // A long run would otherwise keep one weight snapshot per step.
                while live.len() > *keep {
                    if let Some((_, old)) = live.pop_front() {
                        trainer.release_sampler(&old).await?;
                    }
                }
                let model =
                    EnginePolicy::new(self.renderer.clone(), batcher.clone(), handle, version);
                Published {
                    version,
                    model: Arc::new(model),
                }
            }
            Target::Http {
                policy,
                dir,
                versions,
            } => {
                // Two alternating directories: the server may still be
                // reading the previous one.
                let d = dir.join(format!("v{}", version % 2));
                trainer.export_peft(&d).await?;
                let mut map = versions.lock().await;
                let server_version = policy.load_adapter(&d).await?;
                map.insert(server_version, version);
                drop(map);
                Published {
                    version,
                    model: Arc::new(VersionMapped {
                        inner: policy.clone(),
                        versions: versions.clone(),
                    }),
                }
            }
        };
        // Nobody listening (the synchronous loop's sampler reads the
        // latest value) is fine.
        self.announce.send_replace(Some(published.clone()));
        Ok(published)
    }
}

/// An HTTP policy whose turns report our policy version, mapped from the
/// server's adapter version.
struct VersionMapped {
    inner: HttpPolicy,
    versions: VersionMap,
}

#[async_trait::async_trait]
impl ChatModel for VersionMapped {
    async fn chat(
        &self,
        req: temper_env::ChatRequest,
    ) -> std::result::Result<temper_env::ModelTurn, temper_env::ModelCallError> {
        let mut turn = self.inner.chat(req).await?;
        if let Some(t) = turn.trace.as_mut() {
            // A version the server made that we never published (someone
            // else loaded an adapter, or the base model answered) is an
            // error on the rollout — counted, never trained on — rather
            // than a guessed version.
            let server_version = t.version;
            t.version = *self.versions.lock().await.get(&server_version).ok_or_else(|| {
                temper_env::ModelCallError::Other(format!(
                    "the sampler answered with adapter version {server_version}, which this run never published"
                ))
            })?;
        }
        Ok(turn)
    }
}
