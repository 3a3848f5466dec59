//! `Model::score_with_top` is `Model::score` plus alternatives: its target
//! logprobs are bit-identical, and its top lists are the true top-k.

use crate::common::*;

#[test]
fn score_with_top_matches_score_bit_for_bit() {
    for family in FAMILIES {
        let p = load(family);
        let lora = adapter(&p, family);
        let input: Vec<u32> = (0..40u32).map(|i| (i * 37 + 5) % 900).collect();
        let targets: Vec<u32> = (0..40u32).map(|i| (i * 53 + 11) % 900).collect();
        for (t, l) in [(1.0, None), (0.7, Some(&lora))] {
            let want: Vec<f32> = p
                .model
                .score(&input, &targets, l, t)
                .expect("score")
                .logprobs
                .to_vec1()
                .expect("vec");
            for k in [0, 1, 5] {
                let got = p
                    .model
                    .score_with_top(&input, &targets, l, t, k)
                    .expect("score_with_top");
                let same = got
                    .logprobs
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{family} t={t} k={k}: logprobs differ from score");
                assert_eq!(got.top.len(), input.len());
                for (pos, row) in got.top.iter().enumerate() {
                    assert_eq!(row.len(), k);
                    assert!(row.windows(2).all(|w| w[0].1 >= w[1].1));
                    if let Some(&(_, best)) = row.first() {
                        assert!(best >= got.logprobs[pos], "{family}: top-1 below target");
                        let mass: f32 = row.iter().map(|(_, lp)| lp.exp()).sum();
                        assert!(mass <= 1.0 + 1e-5);
                    }
                }
            }
        }
    }
}
