//! Helpers shared by the kernels' unit tests.

use candle_core::{DType, Device, Tensor};

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

/// A tensor of `dims` with values uniform in [-1, 1) (see [`rand_vec`]).
pub(crate) fn rand_tensor(dims: &[usize], seed: u64) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(rand_vec(n, seed), dims, &Device::Cpu).unwrap()
}

/// Every element of `t` as f64, flattened.
pub(crate) fn v64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Largest absolute difference of `a` and `b`, relative to `b`'s largest
/// magnitude (at least 1e-3).
pub(crate) fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(1e-3f64, |s, x| s.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
        / scale
}

/// The bits of every element of an f32 slice.
pub(crate) fn slice_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The bits of every element of an f32 tensor, flattened.
pub(crate) fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}
