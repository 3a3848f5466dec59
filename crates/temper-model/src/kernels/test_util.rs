//! Helpers shared by the kernels' unit tests.

use candle_core::Tensor;

/// Largest absolute elementwise difference of two f32 tensors.
pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// `len` values uniform in [-1, 1), reproducible from `seed`.
pub(crate) fn rand_vec(len: usize, seed: u64) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}
