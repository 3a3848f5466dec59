//! The continuous-batching scheduler driven directly (no HTTP): chunked
//! prefill (issue 13 item 2: a long prompt stalled every other request).

use std::path::PathBuf;
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
    let mut cfg = ServeConfig::defaults("tiny", model).scheduler;
    cfg.max_model_len = 512;
    cfg.max_prefill_tokens = max_prefill_tokens;
    Scheduler::start(model.clone(), cfg, Arc::new(Metrics::default()))
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
    }
}

/// Finished samples in the order the scheduler reported them.
fn collect(rx: &mut UnboundedReceiver<Event>, count: usize) -> Vec<Finished> {
    let mut done = Vec::new();
    while done.len() < count {
        match rx.blocking_recv().expect("engine alive") {
            Event::Done(f) => done.push(f),
            Event::Failed(e) => panic!("job failed: {e}"),
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
