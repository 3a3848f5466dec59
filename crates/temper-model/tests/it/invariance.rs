//! The invariance contract (`docs/kernels.md`) on whole models: a token's
//! logprob has the same bits however its sequence was computed — scored
//! alone by the trainer's `Model::score`, packed with up to 63 other
//! sequences at any position (as `Model::score_batch` packs a training
//! batch), prefilled in chunks against a KV cache,
//! decoded one token at a time (the sampler's steps) or in the server's
//! batched `Model::forward_decode` beside sequences of other lengths, and
//! on 1, 2 or 3 threads — with f32 weights and with bf16 ones. That is what lets the sampler and the server take
//! logprobs straight from decode logits with zero mismatch.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use temper_model::candle_core::Tensor;
use temper_model::kernels::row_logprob;
use temper_model::{KvCache, LoraAdapter, Model, Precision, Segment};

use crate::common::*;

const TEMPERATURE: f64 = 0.7;

/// Random sequences of 2..=90 tokens (longer than the attention kernel's
/// 64-key block and the LM head's 64-row block).
fn sequences(vocab: usize, count: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..count)
        .map(|_| {
            let len = rng.random_range(2..=90);
            (0..len)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect()
        })
        .collect()
}

/// Groups of sequences that share a prompt, as an RL batch holds them: 4
/// completions of 1..=40 tokens after each of prompts of 70, 5 and 30 tokens
/// (5 is too short to share).
fn prompt_groups(vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    for prompt_len in [70, 5, 30] {
        let prompt: Vec<u32> = (0..prompt_len)
            .map(|_| rng.random_range(0..vocab as u32))
            .collect();
        for _ in 0..4 {
            let len = rng.random_range(1..=40);
            let mut s = prompt.clone();
            s.extend((0..len).map(|_| rng.random_range(0..vocab as u32)));
            out.push(s);
        }
    }
    out
}

/// The trainer's logprobs of `seq[1..]`, as bits.
fn scored(m: &Model, seq: &[u32], lora: Option<&LoraAdapter>) -> Vec<u32> {
    let s = m
        .score(&seq[..seq.len() - 1], &seq[1..], lora, TEMPERATURE)
        .expect("score");
    bits(&s.logprobs.to_vec1::<f32>().expect("logprobs"))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Logprobs of `targets` from final hidden rows, as a decode step takes
/// them: the LM head's logits, then `row_logprob`.
fn from_hidden(m: &Model, hidden: &Tensor, targets: &[u32]) -> Vec<f32> {
    let logits = m
        .logits(hidden)
        .expect("logits")
        .to_vec2::<f32>()
        .expect("rows");
    logits
        .iter()
        .zip(targets)
        .map(|(row, &t)| row_logprob(row, t as usize, TEMPERATURE))
        .collect()
}

/// Every sequence's input packed into one forward (no caches), in `order`.
fn packed(
    m: &Model,
    seqs: &[Vec<u32>],
    order: &[usize],
    lora: Option<&LoraAdapter>,
) -> Vec<Vec<u32>> {
    let ids: Vec<u32> = order
        .iter()
        .flat_map(|&i| seqs[i][..seqs[i].len() - 1].iter().copied())
        .collect();
    let mut segs: Vec<Segment<'_>> = order
        .iter()
        .map(|&i| Segment {
            len: seqs[i].len() - 1,
            cache: None,
        })
        .collect();
    let hidden = m.forward_hidden(&ids, &mut segs, lora).expect("packed");
    let mut out = vec![Vec::new(); seqs.len()];
    let mut start = 0;
    for &i in order {
        let len = seqs[i].len() - 1;
        let rows = hidden.narrow(0, start, len).expect("rows");
        out[i] = bits(&from_hidden(m, &rows, &seqs[i][1..]));
        start += len;
    }
    out
}

/// One sequence prefilled `chunk` tokens at a time against a KV cache
/// (`chunk == 1`: the sampler's decode steps).
fn chunked(m: &Model, seq: &[u32], chunk: usize, lora: Option<&LoraAdapter>) -> Vec<u32> {
    let input = &seq[..seq.len() - 1];
    let mut cache = KvCache::new(m.config().num_layers);
    let mut out = Vec::new();
    for (c, part) in input.chunks(chunk).enumerate() {
        let mut segs = [Segment {
            len: part.len(),
            cache: Some(&mut cache),
        }];
        let hidden = m.forward_hidden(part, &mut segs, lora).expect("chunk");
        let start = c * chunk;
        out.extend(from_hidden(
            m,
            &hidden,
            &seq[start + 1..start + 1 + part.len()],
        ));
    }
    bits(&out)
}

/// Every sequence decoded together by the server's batched step: the first
/// token prefilled, then one token per live sequence per step, sequences
/// dropping out as they end.
fn batched_decode(m: &Model, seqs: &[Vec<u32>], lora: Option<&LoraAdapter>) -> Vec<Vec<u32>> {
    let layers = m.config().num_layers;
    let mut caches: Vec<KvCache> = seqs.iter().map(|_| KvCache::new(layers)).collect();
    let mut out: Vec<Vec<f32>> = vec![Vec::new(); seqs.len()];
    for (i, s) in seqs.iter().enumerate() {
        let mut segs = [Segment {
            len: 1,
            cache: Some(&mut caches[i]),
        }];
        let hidden = m.forward_hidden(&s[..1], &mut segs, lora).expect("prefill");
        out[i].extend(from_hidden(m, &hidden, &s[1..2]));
    }
    for pos in 1.. {
        let live: Vec<usize> = (0..seqs.len())
            .filter(|&i| pos < seqs[i].len() - 1)
            .collect();
        if live.is_empty() {
            break;
        }
        let ids: Vec<u32> = live.iter().map(|&i| seqs[i][pos]).collect();
        let targets: Vec<u32> = live.iter().map(|&i| seqs[i][pos + 1]).collect();
        let mut refs: Vec<&mut KvCache> = caches
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| live.contains(i))
            .map(|(_, c)| c)
            .collect();
        let hidden = m.forward_decode(&ids, &mut refs, lora).expect("decode");
        for (&i, lp) in live.iter().zip(from_hidden(m, &hidden, &targets)) {
            out[i].push(lp);
        }
    }
    out.iter().map(|v| bits(v)).collect()
}

/// `Model::score_batch` gives every sequence of `seqs` the logprob and
/// entropy bits of `Model::score` on it alone.
fn batch_matches_alone(m: &Model, seqs: &[Vec<u32>], lora: Option<&LoraAdapter>, what: &str) {
    let batch = m
        .score_batch(&next_token_inputs(seqs), lora, TEMPERATURE)
        .expect("score_batch");
    for (i, (got, s)) in batch.iter().zip(seqs).enumerate() {
        let alone = m
            .score(&s[..s.len() - 1], &s[1..], lora, TEMPERATURE)
            .expect("score");
        let b = |t: &Tensor| bits(&t.to_vec1::<f32>().expect("values"));
        assert!(
            b(&got.logprobs) == b(&alone.logprobs) && b(&got.entropy) == b(&alone.entropy),
            "{what}: sequence {i}"
        );
    }
}

fn on_threads<T: Send>(n: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .expect("thread pool")
        .install(f)
}

#[test]
fn a_tokens_logprob_does_not_depend_on_how_its_sequence_was_computed() {
    for precision in [Precision::F32, Precision::Bf16] {
        for family in FAMILIES {
            check_invariance(family, precision);
        }
    }
}

/// The same contract on GGUF bases kept quantized (`--dtype gguf`): every
/// path through the quantized matmul gives a token the same bits.
#[test]
fn a_tokens_logprob_does_not_depend_on_how_its_sequence_was_computed_on_quantized_bases() {
    let tmp = tempfile::tempdir().expect("tmp");
    for (family, quant) in QUANT_CASES {
        let p = load_quantized(family, quant, tmp.path(), Precision::Gguf);
        check_model(&p, family, &format!("{family} {quant:?}"));
    }
}

fn check_invariance(family: &str, precision: Precision) {
    let p = load_as(family, precision);
    assert_eq!(p.model.precision(), precision);
    check_model(&p, family, &format!("{family} {precision}"));
}

fn check_model(p: &temper_model::Pretrained, family: &str, label: &str) {
    {
        let m = &p.model;
        assert!(m.decode_logits_are_exact().expect("probe"), "{label}");
        let lora = adapter(p, family);
        for l in [None, Some(&lora)] {
            let what = format!("{label} lora={}", l.is_some());
            let seqs = sequences(m.config().vocab_size, 64, 7);
            let want: Vec<Vec<u32>> = seqs.iter().map(|s| scored(m, s, l)).collect();

            // Packs of 1, 3, 16 and 64 sequences, each sequence at several
            // positions (forward and reversed order).
            for size in [1, 3, 16, 64] {
                for reversed in [false, true] {
                    for pack in (0..seqs.len()).collect::<Vec<_>>().chunks(size) {
                        let mut order = pack.to_vec();
                        if reversed {
                            order.reverse();
                        }
                        let got = packed(m, &seqs, &order, l);
                        for &i in &order {
                            assert!(
                                got[i] == want[i],
                                "{what}: sequence {i} in a pack of {size}"
                            );
                        }
                    }
                }
            }
            // The trainer's packed scoring (`Model::score_batch`, one forward
            // for the whole batch), logprobs and entropies: random sequences,
            // then sequences that share a prompt (run once).
            batch_matches_alone(m, &seqs, l, &format!("{what}: score_batch"));
            let groups = prompt_groups(m.config().vocab_size, 13);
            batch_matches_alone(m, &groups, l, &format!("{what}: after a shared prompt"));
            // Prefill chunks, decode steps, and the server's batched decode.
            for (i, s) in seqs.iter().enumerate().take(8) {
                for chunk in [1, 7, 64] {
                    assert!(
                        chunked(m, s, chunk, l) == want[i],
                        "{what}: sequence {i} in chunks of {chunk}"
                    );
                }
            }
            let got = batched_decode(m, &seqs[..12], l);
            for (i, g) in got.iter().enumerate() {
                assert!(*g == want[i], "{what}: sequence {i} in batched decode");
            }
            // Thread counts.
            for threads in [1, 2, 3] {
                let got: Vec<Vec<u32>> = on_threads(threads, || {
                    seqs[..6].iter().map(|s| scored(m, s, l)).collect()
                });
                assert!(got == want[..6], "{what}: on {threads} threads");
            }
        }
    }
}

/// bf16 weights (and bf16-rounded matmul inputs, f32 sums) move a token's
/// logprob by little against the f32 model: on the tiny fixtures the mean
/// absolute difference stays under 0.02 nats and the worst under 0.25.
#[test]
fn bf16_weights_stay_close_to_f32() {
    for family in FAMILIES {
        let f = load(family);
        let b = load_as(family, Precision::Bf16);
        let seqs = sequences(f.config.vocab_size, 16, 11);
        let (mut sum, mut worst, mut count) = (0f64, 0f64, 0usize);
        for s in &seqs {
            let score = |m: &Model| {
                m.score(&s[..s.len() - 1], &s[1..], None, 1.0)
                    .expect("score")
                    .logprobs
                    .to_vec1::<f32>()
                    .expect("logprobs")
            };
            for (x, y) in score(&f.model).iter().zip(score(&b.model)) {
                let d = (x - y).abs() as f64;
                sum += d;
                worst = worst.max(d);
                count += 1;
            }
        }
        let mean = sum / count as f64;
        assert!(
            mean < 0.02 && worst < 0.25,
            "{family}: mean {mean}, worst {worst}"
        );
        assert!(
            worst > 0.0,
            "{family}: bf16 gave the f32 bits: not rounded?"
        );
    }
}

/// A DPO batch (one system prompt, each pair's question, two completions)
/// runs as a tree of shared prefixes; every position keeps the bits of
/// scoring its sequence alone, with f32 and bf16 weights, with and without
/// LoRA.
#[test]
fn pairs_after_a_common_system_prompt_keep_the_bits_of_scoring_alone() {
    for precision in [Precision::F32, Precision::Bf16] {
        for family in FAMILIES {
            let p = load_as(family, precision);
            let lora = adapter(&p, family);
            let (seqs, _) = preference_pairs(p.config.vocab_size as u32);
            for l in [None, Some(&lora)] {
                let what = format!("{family} {precision} lora={}", l.is_some());
                batch_matches_alone(&p.model, &seqs, l, &what);
            }
        }
    }
}
