//! [`Engine`]: training runs and sampler weights behind one worker thread.
//! Every call returns a [`Pending`] result at once and the worker executes
//! calls strictly in submission order, so `forward_backward` and
//! `optim_step` can be submitted back to back (pipelined) and complete in
//! order — Tinker's futures, without its ~10 s clock cycle.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll, Waker};

use temper_model::{Completion, GenerationRequest, LoraConfig, Pretrained, SamplingParams};

use crate::error::{EngineError, Result};
use crate::loss::Loss;
use crate::optim::{AdamParams, StepStats};
use crate::run::{Datum, ForwardOutput, SamplerWeights, TrainingRun};

struct Slot<T> {
    value: Option<Result<T>>,
    waker: Option<Waker>,
}

/// The result of a submitted call: `.wait()` blocks, `.await` suspends.
pub struct Pending<T> {
    shared: Arc<(Mutex<Slot<T>>, Condvar)>,
}

struct Promise<T> {
    shared: Arc<(Mutex<Slot<T>>, Condvar)>,
    fulfilled: bool,
}

fn pending<T>() -> (Promise<T>, Pending<T>) {
    let shared = Arc::new((
        Mutex::new(Slot {
            value: None,
            waker: None,
        }),
        Condvar::new(),
    ));
    (
        Promise {
            shared: shared.clone(),
            fulfilled: false,
        },
        Pending { shared },
    )
}

impl<T> Promise<T> {
    fn fulfil(mut self, v: Result<T>) {
        self.set(v);
        self.fulfilled = true;
    }

    fn set(&self, v: Result<T>) {
        let (lock, cv) = &*self.shared;
        let mut slot = lock.lock().unwrap_or_else(PoisonError::into_inner);
        slot.value = Some(v);
        if let Some(w) = slot.waker.take() {
            w.wake();
        }
        cv.notify_all();
    }
}

/// A promise dropped unfulfilled (a job that never ran to its end) answers
/// its caller with an error instead of leaving it waiting forever.
impl<T> Drop for Promise<T> {
    fn drop(&mut self) {
        if !self.fulfilled {
            self.set(Err(EngineError::Dead(
                "the engine dropped this call unanswered".into(),
            )));
        }
    }
}

impl<T> Pending<T> {
    /// Block until the call has run.
    pub fn wait(self) -> Result<T> {
        let (lock, cv) = &*self.shared;
        let mut slot = lock.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(v) = slot.value.take() {
                return v;
            }
            slot = cv.wait(slot).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Whether the result is ready.
    pub fn is_ready(&self) -> bool {
        let (lock, _) = &*self.shared;
        lock.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .value
            .is_some()
    }
}

impl<T> Future for Pending<T> {
    type Output = Result<T>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let (lock, _) = &*self.shared;
        let mut slot = lock.lock().unwrap_or_else(PoisonError::into_inner);
        match slot.value.take() {
            Some(v) => Poll::Ready(v),
            None => {
                slot.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// What the worker owns.
#[derive(Default)]
struct State {
    bases: HashMap<String, Arc<Pretrained>>,
    runs: HashMap<String, TrainingRun>,
    samplers: HashMap<String, Arc<SamplerWeights>>,
    next_id: u64,
}

impl State {
    fn base(&self, name: &str) -> Result<Arc<Pretrained>> {
        self.bases
            .get(name)
            .cloned()
            .ok_or_else(|| EngineError::NotFound(format!("base model {name:?}")))
    }

    fn sampler(&self, key: &str) -> Result<&SamplerWeights> {
        self.samplers
            .get(key)
            .map(|w| &**w)
            .ok_or_else(|| EngineError::NotFound(format!("sampler weights {key:?}")))
    }

    fn run(&mut self, id: &str) -> Result<&mut TrainingRun> {
        self.runs
            .get_mut(id)
            .ok_or_else(|| EngineError::NotFound(format!("training run {id:?}")))
    }
}

type Job = Box<dyn FnOnce(&mut State) + Send>;

/// Training runs on named base models, driven through an ordered queue.
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::Sender<Job>,
    /// Why the worker is gone, once it is.
    dead: Arc<OnceLock<String>>,
}

impl Default for Engine {
    fn default() -> Self {
        Self::new()
    }
}

impl Engine {
    /// Start the worker thread; kernels run on the process's (global)
    /// thread pool.
    pub fn new() -> Self {
        Self::start(None)
    }

    /// Start the worker thread with every call run inside `pool`
    /// (`ThreadPool::install`): the kernels' parallel work then uses only
    /// `pool`'s threads, and whatever those threads are (how many, their OS
    /// priority) bounds this engine's share of the CPU. Results do not
    /// depend on the pool: the kernels split work the same way for any
    /// thread count.
    pub fn on_pool(pool: Arc<rayon::ThreadPool>) -> Self {
        Self::start(Some(pool))
    }

    fn start(pool: Option<Arc<rayon::ThreadPool>>) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let dead = Arc::new(OnceLock::new());
        let died = dead.clone();
        std::thread::Builder::new()
            .name("temper-engine".into())
            .spawn(move || {
                let mut state = State::default();
                while let Ok(job) = rx.recv() {
                    match &pool {
                        Some(pool) => pool.install(|| job(&mut state)),
                        None => job(&mut state),
                    }
                    // A job that panicked (see `submit`) may have left a
                    // run half updated (weights stepped, moments not): the
                    // state cannot be trusted, so the engine stops.
                    if died.get().is_some() {
                        return;
                    }
                }
            })
            .map(|_| ())
            .unwrap_or_else(|e| {
                let _ = dead.set(format!("cannot start the engine worker: {e}"));
                tracing::error!("cannot start the engine worker: {e}");
            });
        Self { tx, dead }
    }

    /// Why the engine's worker is gone, or `None` while it runs. Every call
    /// after that fails with [`EngineError::Dead`].
    pub fn dead(&self) -> Option<String> {
        self.dead.get().cloned()
    }

    fn submit<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut State) -> Result<T> + Send + 'static,
    ) -> Pending<T> {
        let (promise, pending) = pending();
        if let Some(why) = self.dead() {
            promise.fulfil(Err(EngineError::Dead(why)));
            return pending;
        }
        let dead = self.dead.clone();
        let job: Job = Box::new(move |s| {
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                #[cfg(feature = "fault-hooks")]
                fault::check();
                f(s)
            }));
            match ran {
                Ok(v) => promise.fulfil(v),
                Err(payload) => {
                    // The engine is marked dead before the caller hears
                    // back, so whoever it tells sees `dead()` say why.
                    let why = format!("the engine thread panicked: {}", panic_text(&*payload));
                    tracing::error!("{why}");
                    let _ = dead.set(why.clone());
                    promise.fulfil(Err(EngineError::Dead(why)));
                }
            }
        });
        if let Err(mpsc::SendError(job)) = self.tx.send(job) {
            // The worker is gone; run the job here so the caller gets an answer.
            let mut dead = State::default();
            job(&mut dead);
        }
        pending
    }

    /// Make `model` available as base model `name`.
    pub fn add_base_model(&self, name: &str, model: Arc<Pretrained>) -> Pending<()> {
        let name = name.to_string();
        self.submit(move |s| {
            s.bases.insert(name, model);
            Ok(())
        })
    }

    /// Names of the base models.
    pub fn base_models(&self) -> Pending<Vec<String>> {
        self.submit(|s| {
            let mut v: Vec<String> = s.bases.keys().cloned().collect();
            v.sort();
            Ok(v)
        })
    }

    /// A new LoRA training run on base `base`; returns its id.
    pub fn create_lora_run(&self, base: &str, config: LoraConfig, seed: u64) -> Pending<String> {
        let base = base.to_string();
        self.submit(move |s| {
            let b = s.base(&base)?;
            let run = TrainingRun::lora(b, config, seed)?;
            s.next_id += 1;
            let id = format!("run-{}", s.next_id);
            s.runs.insert(id.clone(), run);
            Ok(id)
        })
    }

    /// A new LoRA training run on base `base` that starts from the PEFT
    /// adapter in `dir` (its rank, alpha, targets and weights); returns its id.
    pub fn create_lora_run_from_peft(&self, base: &str, dir: PathBuf) -> Pending<String> {
        let base = base.to_string();
        self.submit(move |s| {
            let b = s.base(&base)?;
            let adapter = temper_model::LoraAdapter::load_peft(
                &dir,
                &b.config,
                b.model.dtype(),
                b.model.device(),
            )?;
            let run = TrainingRun::lora_from(b, adapter);
            s.next_id += 1;
            let id = format!("run-{}", s.next_id);
            s.runs.insert(id.clone(), run);
            Ok(id)
        })
    }

    /// A new full-parameter training run on base `base`; returns its id.
    pub fn create_full_run(&self, base: &str) -> Pending<String> {
        let base = base.to_string();
        self.submit(move |s| {
            let b = s.base(&base)?;
            let run = TrainingRun::full(b)?;
            s.next_id += 1;
            let id = format!("run-{}", s.next_id);
            s.runs.insert(id.clone(), run);
            Ok(id)
        })
    }

    /// [`TrainingRun::forward`].
    pub fn forward(&self, run: &str, data: Vec<Datum>, loss: Loss) -> Pending<ForwardOutput> {
        let run = run.to_string();
        self.submit(move |s| s.run(&run)?.forward(&data, &loss))
    }

    /// [`TrainingRun::forward_backward`].
    pub fn forward_backward(
        &self,
        run: &str,
        data: Vec<Datum>,
        loss: Loss,
    ) -> Pending<ForwardOutput> {
        let run = run.to_string();
        self.submit(move |s| s.run(&run)?.forward_backward(&data, &loss))
    }

    /// [`TrainingRun::accumulated_grads`], flattened to f32 and sorted by
    /// name (what a test compares with another framework's gradients).
    pub fn accumulated_grads(&self, run: &str) -> Pending<Vec<(String, Vec<f32>)>> {
        let run = run.to_string();
        self.submit(move |s| {
            let mut out = Vec::new();
            for (name, g) in s.run(&run)?.accumulated_grads() {
                let g = g
                    .to_dtype(temper_model::candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                out.push((name.clone(), g));
            }
            out.sort_by(|a, b| a.0.cmp(&b.0));
            Ok(out)
        })
    }

    /// [`TrainingRun::optim_step`].
    pub fn optim_step(&self, run: &str, params: AdamParams) -> Pending<StepStats> {
        let run = run.to_string();
        self.submit(move |s| s.run(&run)?.optim_step(&params))
    }

    /// Freeze the run's current weights for sampling, under `key`.
    pub fn save_weights_for_sampler(&self, run: &str, key: &str) -> Pending<()> {
        let (run, key) = (run.to_string(), key.to_string());
        self.submit(move |s| {
            let w = s.run(&run)?.sampler_weights()?;
            s.samplers.insert(key, Arc::new(w));
            Ok(())
        })
    }

    /// Register the plain base model `base` as sampler weights `key`.
    pub fn add_base_sampler(&self, base: &str, key: &str) -> Pending<()> {
        let (base, key) = (base.to_string(), key.to_string());
        self.submit(move |s| {
            let b = s.base(&base)?;
            s.samplers.insert(key, Arc::new(SamplerWeights::of_base(b)));
            Ok(())
        })
    }

    /// Sample from saved sampler weights.
    pub fn sample(
        &self,
        sampler: &str,
        prompt: Vec<u32>,
        n: usize,
        params: SamplingParams,
    ) -> Pending<Vec<Completion>> {
        let sampler = sampler.to_string();
        self.submit(move |s| {
            let w = s.sampler(&sampler)?;
            w.sample(&prompt, n, params)
        })
    }

    /// Generate for several prompts at once from saved sampler weights
    /// ([`SamplerWeights::generate`]): one list of completions per request.
    pub fn generate(
        &self,
        sampler: &str,
        requests: Vec<GenerationRequest>,
    ) -> Pending<Vec<Vec<Completion>>> {
        let sampler = sampler.to_string();
        self.submit(move |s| s.sampler(&sampler)?.generate(&requests))
    }

    /// Drop saved sampler weights (e.g. a policy no sampler uses any more).
    pub fn drop_sampler(&self, sampler: &str) -> Pending<()> {
        let sampler = sampler.to_string();
        self.submit(move |s| {
            s.samplers.remove(&sampler);
            Ok(())
        })
    }

    /// [`TrainingRun::export_peft`] into `dir`.
    pub fn export_peft(&self, run: &str, dir: PathBuf) -> Pending<()> {
        let run = run.to_string();
        self.submit(move |s| s.run(&run)?.export_peft(&dir))
    }

    /// [`TrainingRun::export_model`] into `dir`.
    pub fn export_model(&self, run: &str, dir: PathBuf) -> Pending<()> {
        let run = run.to_string();
        self.submit(move |s| s.run(&run)?.export_model(&dir))
    }

    /// Logprobs of `tokens[1..]` under saved sampler weights.
    pub fn compute_logprobs(
        &self,
        sampler: &str,
        tokens: Vec<u32>,
        temperature: f64,
    ) -> Pending<Vec<f32>> {
        let sampler = sampler.to_string();
        self.submit(move |s| {
            let w = s.sampler(&sampler)?;
            w.compute_logprobs(&tokens, temperature)
        })
    }

    /// [`TrainingRun::save_state`] into `dir`.
    pub fn save_state(&self, run: &str, dir: PathBuf) -> Pending<()> {
        let run = run.to_string();
        self.submit(move |s| s.run(&run)?.save_state(&dir))
    }

    /// [`TrainingRun::load_state`] from `dir`.
    pub fn load_state(&self, run: &str, dir: PathBuf, with_optimizer: bool) -> Pending<()> {
        let run = run.to_string();
        self.submit(move |s| s.run(&run)?.load_state(&dir, with_optimizer))
    }
}

/// A panic's message (`&str` or `String` payloads; others are unnamed).
fn panic_text(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

/// Test hooks that make the worker panic on a real call (feature
/// `fault-hooks`, for tests of what callers see when the engine dies).
#[cfg(feature = "fault-hooks")]
pub mod fault {
    use std::sync::atomic::{AtomicBool, Ordering};

    static PANIC_NEXT_JOB: AtomicBool = AtomicBool::new(false);

    /// The next call the worker runs panics (once, process-wide).
    pub fn panic_next_job() {
        PANIC_NEXT_JOB.store(true, Ordering::SeqCst);
    }

    pub(super) fn check() {
        if PANIC_NEXT_JOB.swap(false, Ordering::SeqCst) {
            panic!("fault hook: a training call panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every call of an engine on a pool runs inside that pool, so the
    /// kernels' `par_iter`s use its threads and no others.
    #[test]
    fn calls_run_inside_the_engines_pool() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(5)
            .thread_name(|i| format!("test-pool-{i}"))
            .build()
            .unwrap();
        let engine = Engine::on_pool(Arc::new(pool));
        let seen = engine
            .submit(|_| {
                let name = std::thread::current().name().map(str::to_string);
                Ok((rayon::current_num_threads(), name))
            })
            .wait()
            .unwrap();
        assert_eq!(seen.0, 5);
        assert!(
            seen.1
                .as_deref()
                .is_some_and(|n| n.starts_with("test-pool-")),
            "{seen:?}"
        );
    }
}
