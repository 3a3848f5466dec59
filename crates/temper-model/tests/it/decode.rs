//! `Model::forward_decode` (batched decode attention for serving) gives the
//! bits of the per-sequence decode of `Model::forward_hidden`, with and
//! without an adapter, for sequences of different lengths.

use temper_model::{KvCache, Segment};

use crate::common::*;

#[test]
fn batched_decode_matches_per_sequence_decode() {
    for family in FAMILIES {
        let p = load(family);
        let lora = adapter(&p, family);
        for l in [None, Some(&lora)] {
            let m = &p.model;
            let prompts: [Vec<u32>; 3] = [vec![5, 6, 7, 8, 9], vec![11], vec![20, 21, 22]];
            let layers = m.config().num_layers;
            let mut a: Vec<KvCache> = prompts.iter().map(|_| KvCache::new(layers)).collect();
            let ids: Vec<u32> = prompts.iter().flatten().copied().collect();
            {
                let mut segs: Vec<Segment<'_>> = prompts
                    .iter()
                    .zip(a.iter_mut())
                    .map(|(pr, c)| Segment {
                        len: pr.len(),
                        cache: Some(c),
                    })
                    .collect();
                m.forward_hidden(&ids, &mut segs, l).expect("prefill");
            }
            let mut b = a.clone();
            let mut next: Vec<u32> = vec![3, 4, 5];
            for step in 0..6 {
                let want = {
                    let mut segs: Vec<Segment<'_>> = a
                        .iter_mut()
                        .map(|c| Segment {
                            len: 1,
                            cache: Some(c),
                        })
                        .collect();
                    let h = m.forward_hidden(&next, &mut segs, l).expect("per-seq");
                    m.logits(&h).expect("logits").to_vec2::<f32>().expect("vec")
                };
                let got = {
                    let mut caches: Vec<&mut KvCache> = b.iter_mut().collect();
                    let h = m.forward_decode(&next, &mut caches, l).expect("batched");
                    m.logits(&h).expect("logits").to_vec2::<f32>().expect("vec")
                };
                // The CPU in f32: every kernel is batch-invariant, so the
                // batched step gives each sequence its own decode's bits.
                assert!(m.decode_logits_are_exact().expect("probe"));
                for (i, (rw, rg)) in want.iter().zip(&got).enumerate() {
                    let bits = |r: &[f32]| r.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert!(bits(rw) == bits(rg), "{family} step {step} sequence {i}");
                }
                for (ca, cb) in a.iter().zip(&b) {
                    assert_eq!(ca.len(), cb.len());
                }
                next = want
                    .iter()
                    .map(|row| {
                        (0..row.len())
                            .max_by(|&i, &j| row[i].total_cmp(&row[j]))
                            .unwrap_or(0) as u32
                    })
                    .collect();
            }
        }
    }
}
