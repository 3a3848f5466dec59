//! RMSNorm over the last dimension as one op with its own backward.
//!
//! The composed candle version (`sqr`, `mean`, `+ eps`, `sqrt`, `div`,
//! `mul`) runs six element-wise passes forward and about twice that
//! backward, each allocating a tensor the size of the activations, on one
//! thread (candle's element-wise pool is slower than none on shared cores).
//! Here a row is one pass forward and one backward, rows split across
//! threads, and the backward keeps only the input and one scale per row.
//!
//! Numbers: `y = x · r · w` with `r = 1 / sqrt(Σx² / h + eps)`, the sum in
//! index order in f32; a row's result depends only on that row.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::{f32_slice, with_f32};
use crate::error::Result;

/// Below this many elements a call runs on the calling thread.
const SEQUENTIAL_WORK: usize = 1 << 15;

/// Whether [`rms_norm`] handles these operands (f32 on the CPU).
pub fn fused_rms_norm_supported(x: &Tensor, weight: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32 && weight.dtype() == DType::F32
}

/// RMSNorm of `x` (any shape, normalised over its last dimension `h`) with
/// weight `[h]`; differentiable w.r.t. both.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(x.contiguous()?
        .apply_op2(&weight.contiguous()?, RmsNorm { eps: eps as f32 })?)
}

struct RmsNorm {
    eps: f32,
}

/// `1 / sqrt(Σx² / h + eps)` of one row.
#[inline]
fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let ss: f32 = row.iter().map(|v| v * v).sum();
    1.0 / (ss / row.len() as f32 + eps).sqrt()
}

fn for_rows<T: Send>(out: &mut [T], h: usize, f: impl Fn(usize, &mut [T]) + Send + Sync) {
    if out.len() < SEQUENTIAL_WORK {
        out.chunks_mut(h).enumerate().for_each(|(i, r)| f(i, r));
    } else {
        out.par_chunks_mut(h).enumerate().for_each(|(i, r)| f(i, r));
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice("rms_norm", xs, xl, "x")?;
        let w = f32_slice("rms_norm", ws, wl, "weight")?;
        let h = *xl.shape().dims().last().unwrap_or(&0);
        if h == 0 || w.len() != h {
            return Err(candle_core::Error::Msg(format!(
                "rms_norm: x {:?} and weight {:?}",
                xl.shape(),
                wl.shape()
            )));
        }
        let mut y = vec![0f32; x.len()];
        let eps = self.eps;
        for_rows(&mut y, h, |i, out| {
            let row = &x[i * h..(i + 1) * h];
            let r = inv_rms(row, eps);
            for ((o, v), g) in out.iter_mut().zip(row).zip(w) {
                *o = v * r * g;
            }
        });
        Ok((CpuStorage::F32(y), xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let h = w.elem_count();
        let wv: Vec<f32> = w.flatten_all()?.to_vec1()?;
        let (dx, dw) = with_f32("rms_norm", x, |xv| {
            with_f32("rms_norm", grad, |gv| {
                // Each row's 1/rms once, for dx and dw both.
                let r: Vec<f32> = if xv.len() < SEQUENTIAL_WORK {
                    xv.chunks(h).map(|row| inv_rms(row, self.eps)).collect()
                } else {
                    xv.par_chunks(h).map(|row| inv_rms(row, self.eps)).collect()
                };
                // dx = r·(g·w) − x·r³·Σ(g·w·x)/h, per row.
                let mut dx = vec![0f32; xv.len()];
                for_rows(&mut dx, h, |i, out| {
                    let (row, g, r) = (&xv[i * h..(i + 1) * h], &gv[i * h..(i + 1) * h], r[i]);
                    let dot: f32 = row
                        .iter()
                        .zip(g)
                        .zip(&wv)
                        .map(|((a, b), c)| a * b * c)
                        .sum();
                    let c = r * r * r * dot / h as f32;
                    for (((o, a), b), wc) in out.iter_mut().zip(row).zip(g).zip(&wv) {
                        *o = r * b * wc - a * c;
                    }
                });
                let dw = if w.track_op() {
                    // dw = Σ_rows g·x·r, rows summed in order.
                    let mut dw = vec![0f32; h];
                    for ((row, g), r) in xv.chunks(h).zip(gv.chunks(h)).zip(&r) {
                        for ((d, a), b) in dw.iter_mut().zip(row).zip(g) {
                            *d += b * a * r;
                        }
                    }
                    Some(dw)
                } else {
                    None
                };
                Ok((dx, dw))
            })
        })?;
        let dx = Tensor::from_vec(dx, x.shape(), x.device())?;
        let dw = match dw {
            Some(dw) => Some(Tensor::from_vec(dw, w.shape(), w.device())?),
            None => None,
        };
        Ok((Some(dx), dw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::max_diff;
    use candle_core::{Device, Var, D};

    fn rand(shape: &[usize], seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn composed(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
        let var = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        let denom = (var + eps).unwrap().sqrt().unwrap();
        x.broadcast_div(&denom).unwrap().broadcast_mul(w).unwrap()
    }

    #[test]
    fn matches_the_composed_version_in_values_and_gradients() {
        let x = Var::from_tensor(&rand(&[3, 37, 24], 1)).unwrap();
        let w = Var::from_tensor(&(rand(&[24], 2) + 1.0).unwrap()).unwrap();
        let g = rand(&[3, 37, 24], 3);
        let ours = rms_norm(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
        let theirs = composed(x.as_tensor(), w.as_tensor(), 1e-5);
        assert!(max_diff(&ours, &theirs) < 1e-5);
        let go = (ours * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let gt = (theirs * &g)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for v in [&x, &w] {
            let d = max_diff(
                go.get(v.as_tensor()).unwrap(),
                gt.get(v.as_tensor()).unwrap(),
            );
            assert!(d < 1e-4, "gradient differs by {d}");
        }
        // A frozen weight gets no gradient.
        let frozen = w.as_tensor().detach();
        let grads = rms_norm(x.as_tensor(), &frozen, 1e-5)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert!(grads.get(&frozen).is_none());
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let x0 = rand(&[4, 10], 5).to_dtype(DType::F32).unwrap();
        let w = (rand(&[10], 6) + 1.5).unwrap();
        let g = rand(&[4, 10], 7);
        let loss = |x: &Tensor| -> f64 {
            (rms_norm(x, &w, 1e-5).unwrap() * &g)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64
        };
        let xv = Var::from_tensor(&x0).unwrap();
        let grads = (rms_norm(xv.as_tensor(), &w, 1e-5).unwrap() * &g)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let analytic: Vec<f32> = grads
            .get(xv.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let base: Vec<f32> = x0.flatten_all().unwrap().to_vec1().unwrap();
        let h = 1e-2f32;
        for i in [0, 7, 13, 39] {
            let bump = |d: f32| {
                let mut v = base.clone();
                v[i] += d;
                loss(&Tensor::from_vec(v, (4, 10), &Device::Cpu).unwrap())
            };
            let fd = (bump(h) - bump(-h)) / (2.0 * h as f64);
            assert!(
                (fd - analytic[i] as f64).abs() < 2e-2,
                "element {i}: finite difference {fd}, analytic {}",
                analytic[i]
            );
        }
    }

    /// A row's bits depend only on that row, whatever the call's row count
    /// or the thread count.
    #[test]
    fn a_rows_result_does_not_depend_on_the_call() {
        let x = rand(&[3000, 24], 8);
        let w = rand(&[24], 9);
        let full = rms_norm(&x, &w, 1e-6).unwrap();
        let bits = crate::kernels::test_util::bits;
        for (s, l) in [(0, 1), (1499, 1), (10, 200), (2999, 1)] {
            let part = rms_norm(&x.narrow(0, s, l).unwrap(), &w, 1e-6).unwrap();
            assert_eq!(bits(&part), bits(&full.narrow(0, s, l).unwrap()));
        }
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            assert_eq!(
                bits(&pool.install(|| rms_norm(&x, &w, 1e-6).unwrap())),
                bits(&full)
            );
        }
    }
}
