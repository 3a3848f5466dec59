//! SwiGLU, `silu(gate) · up`, as one element-wise op with its own backward:
//! one pass each way across threads, and nothing kept for the backward but
//! its two inputs (the composed version keeps `silu(gate)` too, and runs
//! four passes backward on one thread).

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::{f32_slice, with_f32};
use crate::error::{ModelError, Result};

/// Elements per parallel chunk.
const CHUNK: usize = 1 << 14;

/// Whether [`swiglu`] handles these operands (f32 on the CPU).
pub fn fused_swiglu_supported(gate: &Tensor, up: &Tensor) -> bool {
    gate.device().is_cpu() && gate.dtype() == DType::F32 && up.dtype() == DType::F32
}

/// `silu(gate) · up` for two tensors of one shape, differentiable w.r.t. both.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.shape() != up.shape() {
        return Err(ModelError::InvalidInput(format!(
            "swiglu: gate {:?} and up {:?}",
            gate.dims(),
            up.dims()
        )));
    }
    Ok(gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)?)
}

struct SwiGlu;

#[inline(always)]
fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + super::exp::exp(-g))
}

twice_compiled! {
    /// `out = silu(g)·u` element-wise.
    fn forward_chunk / forward_body(g: &[f32], u: &[f32], out: &mut [f32])
}

#[inline(always)]
fn forward_body(g: &[f32], u: &[f32], out: &mut [f32]) {
    for ((v, &a), &b) in out.iter_mut().zip(g).zip(u) {
        *v = a * sigmoid(a) * b;
    }
}

twice_compiled! {
    /// The gradients of gate and up given the output's, `d`.
    fn backward_chunk / backward_body(g: &[f32], u: &[f32], d: &[f32], dg: &mut [f32], du: &mut [f32])
}

#[inline(always)]
fn backward_body(g: &[f32], u: &[f32], d: &[f32], dg: &mut [f32], du: &mut [f32]) {
    for i in 0..dg.len().min(du.len()) {
        let (a, s) = (g[i], sigmoid(g[i]));
        // d silu(a)/da = s·(1 + a·(1 − s)).
        dg[i] = d[i] * u[i] * s * (1.0 + a * (1.0 - s));
        du[i] = d[i] * a * s;
    }
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let g = f32_slice("swiglu", gs, gl, "gate")?;
        let u = f32_slice("swiglu", us, ul, "up")?;
        let mut y = vec![0f32; g.len()];
        y.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
            let o = c * CHUNK;
            forward_chunk(&g[o..o + out.len()], &u[o..o + out.len()], out);
        });
        Ok((CpuStorage::F32(y), gl.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let n = gate.elem_count();
        let mut dg = vec![0f32; n];
        let mut du = vec![0f32; n];
        with_f32("swiglu", gate, |g| {
            with_f32("swiglu", up, |u| {
                with_f32("swiglu", grad, |d| {
                    dg.par_chunks_mut(CHUNK)
                        .zip(du.par_chunks_mut(CHUNK))
                        .enumerate()
                        .for_each(|(c, (dgc, duc))| {
                            let (o, len) = (c * CHUNK, dgc.len());
                            backward_chunk(
                                &g[o..o + len],
                                &u[o..o + len],
                                &d[o..o + len],
                                dgc,
                                duc,
                            );
                        });
                    Ok(())
                })
            })
        })?;
        Ok((
            Some(Tensor::from_vec(dg, gate.shape(), gate.device())?),
            Some(Tensor::from_vec(du, up.shape(), up.device())?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::max_diff;
    use candle_core::{Device, Var};

    fn rand(n: usize, seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-4.0f32..4.0)).collect();
        Tensor::from_vec(v, (n / 40, 40), &Device::Cpu).unwrap()
    }

    #[test]
    fn matches_the_composed_version_in_values_and_gradients() {
        // More than one parallel chunk.
        let n = 40 * 1000;
        let g = Var::from_tensor(&rand(n, 1)).unwrap();
        let u = Var::from_tensor(&rand(n, 2)).unwrap();
        let w = rand(n, 3);
        let ours = swiglu(g.as_tensor(), u.as_tensor()).unwrap();
        let theirs = (g.as_tensor().silu().unwrap() * u.as_tensor()).unwrap();
        assert!(max_diff(&ours, &theirs) < 1e-5);
        let go = (ours * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let gt = (theirs * &w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for v in [&g, &u] {
            let d = max_diff(
                go.get(v.as_tensor()).unwrap(),
                gt.get(v.as_tensor()).unwrap(),
            );
            assert!(d < 1e-4, "gradient differs by {d}");
        }
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let g0: Vec<f32> = rand(80, 4).flatten_all().unwrap().to_vec1().unwrap();
        let u = rand(80, 5);
        let loss = |g: &[f32]| -> f64 {
            let g = Tensor::from_slice(g, (2, 40), &Device::Cpu).unwrap();
            swiglu(&g, &u)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64
        };
        let gv =
            Var::from_tensor(&Tensor::from_slice(&g0, (2, 40), &Device::Cpu).unwrap()).unwrap();
        let grads = swiglu(gv.as_tensor(), &u)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let analytic: Vec<f32> = grads
            .get(gv.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for i in [0, 17, 41, 79] {
            let h = 1e-2f32;
            let (mut p, mut m) = (g0.clone(), g0.clone());
            p[i] += h;
            m[i] -= h;
            let fd = (loss(&p) - loss(&m)) / (2.0 * h as f64);
            assert!(
                (fd - analytic[i] as f64).abs() < 2e-2,
                "element {i}: {fd} vs {}",
                analytic[i]
            );
        }
    }

    #[test]
    fn rejects_mismatched_shapes() {
        assert!(swiglu(&rand(80, 1), &rand(40, 2)).is_err());
    }
}
