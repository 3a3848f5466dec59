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
