//! Llama / Qwen2 / Qwen3 decoders with LoRA on candle — one forward path for
//! sampling and training.
//!
//! - [`Pretrained::load`] reads a Hugging Face model directory: `config.json`,
//!   `model.safetensors` or a sharded index (memory-mapped), `tokenizer.json`,
//!   `tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`
//!   — or a GGUF file (llama.cpp / Ollama), whose config, weights (any common
//!   quantisation, dequantised), tokenizer and chat template it rebuilds as
//!   transformers' GGUF loader does ([`GgufFile`]).
//! - [`Model::forward_hidden`] is the only forward. Training
//!   ([`Model::score`]: per-token logprobs and entropy of target tokens;
//!   [`Model::score_batch`]: a batch as one packed forward),
//!   prefill and KV-cached decode ([`Sampler`]) all go through it, and it is
//!   built from differentiable ops only (candle's, and [`kernels`] with their
//!   own backward).
//! - [`Model::forward_decode`] is the server's batched decode step (one token
//!   per sequence, attention batched over the caches); inference only, and
//!   on the CPU in f32 bit-identical per token to `forward_hidden`.
//! - [`LoraAdapter`] holds trainable low-rank updates for a frozen base and
//!   saves/loads the PEFT layout; [`Model::make_trainable`] switches to
//!   full-parameter training instead.
//! - [`ChatTemplate`] renders the model's Jinja chat template exactly as
//!   transformers' `apply_chat_template` does.
//!
//! **Zero train–inference mismatch.** On the CPU in f32 every kernel is
//! batch-invariant, so a decode step's logits are bit-identical to the
//! trainer's for the same token and the [`Sampler`] (and the server) take
//! logprobs straight from them; elsewhere they re-score each finished
//! sequence with [`Model::score`], the trainer's own function. Either way the
//! reported logprobs equal what the trainer computes. See [`logprobs`].
//!
//! ```no_run
//! use temper_model::{GenerationRequest, LoadOptions, Pretrained, Sampler, SamplingParams};
//! let p = Pretrained::load("path/to/Qwen3-0.6B".as_ref(), &LoadOptions::default())?;
//! let prompt = p.tokenizer.encode("The capital of France is", true)?;
//! let sampler = Sampler::new(&p.model, &p.tokenizer, p.generation.eos_token_ids.clone());
//! let params = SamplingParams { max_tokens: 8, temperature: 0.0, ..Default::default() };
//! let out = sampler.generate(&[GenerationRequest { prompt, n: 1, params }], None)?;
//! println!("{}", out[0][0].text);
//! # Ok::<(), temper_model::ModelError>(())
//! ```
#![deny(missing_docs)]

mod arch;
mod chat;
mod error;
mod formats;
mod generation;
pub mod kernels;
mod lora;
mod precision;
mod pretrained;
mod random;
mod tokenizer;

pub use arch::config::{Family, HfConfig, ModelConfig, RopeScaling};
pub use arch::model::{KvCache, Model, Segment};
pub use arch::rope::{inv_freq, Rope};
pub use chat::ChatTemplate;
pub use error::{ModelError, Result};
pub use formats::export::{hf_config_json, model_name, path_name, save_gguf, save_hf, GgufQuant};
pub use formats::gguf::{gguf_tensor_name, is_gguf, GgufFile};
pub use formats::weights::Checkpoint;
pub use generation::decode::{FinishReason, SamplingParams};
pub use generation::logprobs::{
    pack_batch, ScoreInput, TokenScores, MIN_SHARED_PREFIX, PACK_TOKENS,
};
pub use generation::sampling::{Completion, GenerationRequest, Sampler};
pub use generation::top_logprobs::{top_k, TopLogprobs};
pub use generation::{decode, logprobs, sampling};
pub use kernels::ForwardMatmul;
pub use lora::{LoraAdapter, LoraConfig, LoraPair, Target};
pub use precision::Precision;
pub use pretrained::{GenerationDefaults, LoadOptions, Numerics, Pretrained};
pub use random::{random_weights, write_random_model, RandomInit};
pub use tokenizer::{chat_template_source, load_chat_template, Tokenizer};

/// Re-exported so callers can name devices, dtypes and tensors.
pub use candle_core;

/// Hand memory the allocator keeps after freeing (a training step's
/// activations) back to the operating system, so a process's RSS after a
/// step returns to where it was, when more than [`KEEP_FREE_BYTES`] of it
/// is free: a small step's buffers stay for the next step (handing them back
/// costs the next step a page fault per page, 6% of a tiny-config step).
/// glibc keeps freed heap memory for reuse; elsewhere this does nothing.
pub fn release_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallinfo2 reads glibc's arena statistics and malloc_trim only
    // returns unused pages of its heap to the kernel; neither has
    // preconditions or touches a live allocation.
    unsafe {
        if libc::mallinfo2().fordblks > KEEP_FREE_BYTES {
            libc::malloc_trim(0);
        }
    }
}

/// Free heap that [`release_memory`] leaves with the allocator.
pub const KEEP_FREE_BYTES: usize = 32 << 20;

/// Keep the allocator from handing memory back to the operating system in
/// the middle of a step. A training step allocates and frees hundreds of
/// activation and gradient buffers of 0.1–10 MB. glibc serves each one above
/// its mmap threshold with a fresh `mmap` (every page faulted in and zeroed
/// by the kernel, then unmapped on free), and trims the heap's top whenever
/// a free leaves more than its trim threshold there. On the tiny config that
/// was 12% of a step's samples in page faults; with both thresholds raised
/// the buffers are reused within the step, and [`release_memory`] still
/// returns them after it. Call it once, at startup (glibc only;
/// elsewhere it does nothing).
pub fn keep_heap_within_steps() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's allocation thresholds; it has no
    // preconditions and touches no live allocation.
    unsafe {
        // 32 MB is glibc's largest mmap threshold on 64-bit targets. A
        // heap still shrinks by itself once 256 MB at its top is free (a
        // server after a long prompt), beyond any tiny-config step.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

/// Run `f` on a thread of the current rayon pool (the global one when the
/// caller is outside every pool) and wait for it; inside a pool it runs in
/// place. A decode step issues a few hundred short parallel kernels: from a
/// thread outside the pool each one is handed to the pool and the caller
/// sleeps until it is done, two thread wake-ups per kernel; from a pool
/// thread the caller works on its own kernel and only the other threads
/// are woken. SmolLM2 Q4_1 greedy decode on 2 threads: 50 → 63 tokens/s.
/// Where the work runs changes no result (the kernels split the same way
/// on any thread).
///
/// ```
/// let on_pool = temper_model::on_pool(|| rayon::current_thread_index().is_some());
/// assert!(on_pool);
/// ```
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

/// `TEMPER_MATMUL` (`invariant`, the default, or `candle`): the forward
/// matmul a command's models use on the CPU in f32 (see
/// [`kernels::ForwardMatmul`]). The binary reads it once and passes the
/// value down in [`Numerics`]; unset is the default, anything else an error.
pub fn forward_matmul_from_env() -> Result<ForwardMatmul> {
    match std::env::var("TEMPER_MATMUL") {
        Ok(v) => v.parse().map_err(|e| match e {
            ModelError::InvalidInput(m) => ModelError::InvalidInput(format!("TEMPER_MATMUL: {m}")),
            other => other,
        }),
        Err(std::env::VarError::NotPresent) => Ok(ForwardMatmul::default()),
        Err(std::env::VarError::NotUnicode(v)) => Err(ModelError::InvalidInput(format!(
            "TEMPER_MATMUL={v:?} is not valid UTF-8"
        ))),
    }
}

/// Set the number of CPU threads the tensor kernels use (`None`: keep
/// `RAYON_NUM_THREADS` if set, else all cores). Call it before the first
/// tensor operation, while the process has one thread.
///
/// Always worth calling: candle reads the thread count on every matmul, and
/// without `RAYON_NUM_THREADS` it re-parses `/proc/cpuinfo` each time (~10% of
/// a training step on a tiny model).
pub fn set_num_threads(n: Option<usize>) {
    let n = match n.filter(|&n| n > 0) {
        Some(n) => n,
        None => match std::env::var("RAYON_NUM_THREADS")
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
        {
            Some(n) if n > 0 => {
                single_threaded_elementwise();
                return;
            }
            _ => std::thread::available_parallelism().map_or(1, |n| n.get()),
        },
    };
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    single_threaded_elementwise();
}

/// candle 0.11 runs element-wise ops on its own thread pool whose caller
/// spin-waits for the workers. When the cores are shared (the RL loop
/// samples and trains at once; anything else running on a laptop) a
/// descheduled worker leaves the caller spinning for a whole time slice:
/// measured on SmolLM2 with a busy 2-core machine, 60% of a training step
/// went to that spin. Element-wise ops are memory-bound, so one thread does
/// them at nearly the same speed; matmuls and temper's own kernels keep
/// every thread. `CANDLE_NUM_THREADS`, when set, wins.
fn single_threaded_elementwise() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
}

/// The compute device: CUDA device 0 when built with the `cuda` feature and a
/// GPU is present, else the CPU.
pub fn default_device() -> Result<candle_core::Device> {
    #[cfg(feature = "cuda")]
    {
        if let Ok(d) = candle_core::Device::new_cuda(0) {
            return Ok(d);
        }
    }
    Ok(candle_core::Device::Cpu)
}

/// f32 on CPU, bf16 on CUDA.
pub fn default_dtype(device: &candle_core::Device) -> candle_core::DType {
    if device.is_cuda() {
        candle_core::DType::BF16
    } else {
        candle_core::DType::F32
    }
}

/// Run `f` on a worker of the kernels' thread pool (see [`set_num_threads`])
/// and return its result; on a worker already, just run it. A training step
/// is hundreds of parallel kernels with serial work between them: called
/// from outside the pool, each kernel wakes the workers and blocks the
/// caller on a latch, and while the caller does the serial part the workers
/// spin, all on the same cores. From inside, the worker splits its own work
/// and the other workers steal it. Measured with `temper bench model
/// --train-only`, 2 threads: SmolLM2 f32 203 → 215–225 tokens/s, bf16 281–296
/// → 330–336, the tiny model 3,950–4,160 → 4,860–5,000.
pub fn in_pool<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    let mut out = None;
    rayon::scope(|s| s.spawn(|_| out = Some(f())));
    match out {
        Some(v) => v,
        // rayon::scope returns only after its spawned job has run (a panic
        // in the job resumes here instead).
        None => unreachable!("rayon::scope returned before its job ran"),
    }
}
