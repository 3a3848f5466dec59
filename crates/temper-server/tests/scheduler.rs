//! The continuous-batching scheduler driven directly (no HTTP): chunked
//! prefill (issue 13 item 2: a long prompt stalled every other request).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use temper_model::{FinishReason, LoadOptions, Pretrained, SamplingParams};
use temper_server::metrics::Metrics;
use temper_server::openai::ServeConfig;
use temper_server::scheduler::{Event, Finished, Job, Scheduler};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

fn load() -> Arc<Pretrained> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-llama");
    Arc::new(Pretrained::load(&dir, &LoadOptions::default()).expect("fixture model"))
}

fn scheduler(model: &Arc<Pretrained>, max_prefill_tokens: usize) -> Scheduler {
    scheduler_with(
        model,
        max_prefill_tokens,
        None,
        Arc::new(Metrics::default()),
    )
}

fn scheduler_with(
    model: &Arc<Pretrained>,
    max_prefill_tokens: usize,
    kv_budget_tokens: Option<usize>,
    metrics: Arc<Metrics>,
) -> Scheduler {
    let mut cfg = ServeConfig::defaults("tiny", model).scheduler;
    cfg.max_model_len = 512;
    cfg.max_prefill_tokens = max_prefill_tokens;
    if let Some(b) = kv_budget_tokens {
        cfg.kv_budget_tokens = b;
    }
    Scheduler::start(model.clone(), cfg, metrics)
}

fn scheduler_with_prefix_cache(
    model: &Arc<Pretrained>,
    tokens: usize,
) -> (Scheduler, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::default());
    let mut cfg = ServeConfig::defaults("tiny", model).scheduler;
    cfg.max_model_len = 512;
    cfg.prefix_cache_tokens = tokens;
    (
        Scheduler::start(model.clone(), cfg, metrics.clone()),
        metrics,
    )
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        temperature: 0.0,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

fn job(prompt: Vec<u32>, index: usize, max_tokens: usize, events: &UnboundedSender<Event>) -> Job {
    Job {
        prompt,
        n: 1,
        first_index: index,
        params: greedy(max_tokens),
        adapter: None,
        stream: false,
        events: events.clone(),
        grammar: None,
        top_logprobs: None,
        cache_salt: None,
    }
}

/// Finished samples in the order the scheduler reported them.
fn collect(rx: &mut UnboundedReceiver<Event>, count: usize) -> Vec<Finished> {
    let mut done = Vec::new();
    while done.len() < count {
        match rx.blocking_recv().expect("engine alive") {
            Event::Done(f) => done.push(f),
            Event::Failed(e) | Event::Rejected(e) => panic!("job failed: {e}"),
            Event::Delta { .. } => {}
        }
    }
    done
}

fn long_prompt(model: &Pretrained, len: usize) -> Vec<u32> {
    let vocab = model.config.vocab_size as u32;
    (0..len as u32)
        .map(|i| 1 + (i * 7919) % (vocab - 1))
        .collect()
}

/// Issue 13 item 2: with chunked prefill, a request queued behind a long
/// prompt is prefilled and decoded to the end while the long prompt is
/// still being prefilled, chunk by chunk, between decode steps.
#[test]
fn a_long_prompt_is_prefilled_in_chunks_without_stalling_other_requests() {
    let model = load();
    let s = scheduler(&model, 16);
    let (tx, mut rx) = unbounded_channel();
    s.submit(job(long_prompt(&model, 400), 0, 2, &tx))
        .expect("submit long");
    s.submit(job(vec![5, 6, 7], 1, 3, &tx))
        .expect("submit short");
    let done = collect(&mut rx, 2);
    assert_eq!(
        done.iter().map(|f| f.index).collect::<Vec<_>>(),
        vec![1, 0],
        "the short request must finish first: 400 prompt tokens take 25 chunks of 16"
    );
    assert!(done.iter().all(|f| f.finish_reason == FinishReason::Length));
}

/// Chunking changes nothing a client sees: a long prompt's greedy tokens are
/// the same whether it is prefilled at once or in chunks of any size
/// (chunk boundaries inside and across the attention kernel's key blocks).
#[test]
fn chunked_prefill_gives_the_same_tokens_as_a_one_shot_prefill() {
    let model = load();
    let prompt = long_prompt(&model, 300);
    let mut outputs = Vec::new();
    for chunk in [4096, 64, 7] {
        let s = scheduler(&model, chunk);
        let (tx, mut rx) = unbounded_channel();
        s.submit(job(prompt.clone(), 0, 12, &tx)).expect("submit");
        outputs.push((chunk, collect(&mut rx, 1).remove(0).tokens));
    }
    for (chunk, tokens) in &outputs[1..] {
        assert_eq!(
            tokens, &outputs[0].1,
            "chunks of {chunk} tokens changed the continuation"
        );
    }
}

/// Issue 11: logprobs and top alternatives come straight from the decode
/// steps (no second forward), and they are the trainer's bits: equal to
/// `Model::score_with_top` on the finished sequence, for sequences decoded
/// in a changing batch, prefilled in odd-sized chunks, several samples per
/// prompt, and evicted and recomputed under a small KV budget.
#[test]
fn decode_scores_are_the_trainers_bit_for_bit() {
    let model = load();
    assert!(
        model.model.decode_logits_are_exact().expect("probe"),
        "the fixture runs on the CPU in f32"
    );
    let metrics = Arc::new(Metrics::default());
    let s = scheduler_with(&model, 7, Some(160), metrics.clone());
    let (tx, mut rx) = unbounded_channel();
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| long_prompt(&model, 3 + 9 * i)[i..].to_vec())
        .collect();
    let (n, k, temperature) = (2, 3, 0.7);
    for (i, prompt) in prompts.iter().enumerate() {
        let mut j = job(prompt.clone(), i * n, 40, &tx);
        j.n = n;
        j.params.temperature = temperature;
        j.params.seed = Some(i as u64);
        j.top_logprobs = Some(k);
        s.submit(j).expect("submit");
    }
    let done = collect(&mut rx, prompts.len() * n);
    assert!(
        metrics.preemptions.load(Ordering::Relaxed) > 0,
        "the budget must force preemption"
    );
    for f in &done {
        let got = f.top_logprobs.as_ref().expect("scores were asked for");
        let prompt = &prompts[f.index / n];
        let full: Vec<u32> = prompt.iter().chain(&f.tokens).copied().collect();
        let mut want = model
            .model
            .score_with_top(&full[..full.len() - 1], &full[1..], None, temperature, k)
            .expect("score");
        let skip = want.logprobs.len() - f.tokens.len();
        want.logprobs.drain(..skip);
        want.top.drain(..skip);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got.logprobs),
            bits(&want.logprobs),
            "choice {}",
            f.index
        );
        assert_eq!(got.top, want.top, "choice {}", f.index);
    }
    // Not asked for: not computed.
    s.submit(job(vec![5, 6, 7], 0, 3, &tx)).expect("submit");
    assert!(collect(&mut rx, 1)[0].top_logprobs.is_none());
}

/// A choice's tokens, logprob bits and top alternatives.
type Sample = (Vec<u32>, Vec<u32>, Vec<Vec<(u32, f32)>>);

/// Issue 11: a multi-turn conversation resends its history; the second call
/// starts from the first call's KV cache (prompt + completion) and prefills
/// only the new turn, with the very tokens and logprob bits of a server that
/// recomputes everything. Several samples, chunked prefill and T = 0.8.
#[test]
fn a_prompt_extending_a_finished_sequence_starts_from_its_cache_with_identical_results() {
    let model = load();
    let first = long_prompt(&model, 70);
    let run = |cache_tokens: usize| {
        let (s, metrics) = scheduler_with_prefix_cache(&model, cache_tokens);
        let (tx, mut rx) = unbounded_channel();
        let mut a = job(first.clone(), 0, 20, &tx);
        a.params.temperature = 0.8;
        a.params.seed = Some(1);
        a.top_logprobs = Some(2);
        s.submit(a).expect("submit");
        let a = collect(&mut rx, 1).remove(0);
        // The next turn: history (prompt + answer) + a new user message.
        let mut second = first.clone();
        second.extend(&a.tokens);
        second.extend(long_prompt(&model, 9));
        let mut b = job(second.clone(), 0, 16, &tx);
        b.n = 3;
        b.params.temperature = 0.8;
        b.params.seed = Some(2);
        b.top_logprobs = Some(2);
        s.submit(b).expect("submit");
        let mut done = collect(&mut rx, 3);
        done.sort_by_key(|f| f.index);
        let out: Vec<Sample> = done
            .into_iter()
            .map(|f| {
                let sc = f.top_logprobs.expect("scores");
                let bits = sc.logprobs.iter().map(|x| x.to_bits()).collect();
                (f.tokens, bits, sc.top)
            })
            .collect();
        let hits = metrics.prefix_hits.load(Ordering::Relaxed);
        let reused = metrics.prefix_reused_tokens.load(Ordering::Relaxed);
        (out, hits, reused, first.len() + a.tokens.len() - 1)
    };
    let (cold, cold_hits, _, _) = run(0);
    let (warm, warm_hits, reused, cached) = run(4096);
    assert_eq!(cold_hits, 0, "a disabled prefix cache never hits");
    assert_eq!(
        warm_hits, 1,
        "the second call starts from the first's cache"
    );
    assert_eq!(
        reused as usize, cached,
        "every position the first call computed is reused"
    );
    assert_eq!(
        warm, cold,
        "tokens and logprob bits must not depend on the cache"
    );
}
