//! A frozen linear layer with its LoRA update, `x·Wᵀ + s·(x·Aᵀ)·Bᵀ`, as one
//! op with its own backward.
//!
//! Composed from candle ops the update is four graph nodes (two matmuls, a
//! scale, an add), each keeping a `[tokens, out]` tensor alive until the
//! backward and each costing candle's backward a zero-filled gradient buffer
//! and an add on one thread: on SmolLM2 that was most of a packed training
//! step's activation memory (3.1 of 3.6 GB at 1,024 tokens) and a fifth of
//! its time. This op keeps only `x·Aᵀ` (`[tokens, rank]`) and runs the
//! backward's matmuls directly: `dx = g·W + s·(g·B)·A`, `dA = s·(g·B)ᵀ·x`,
//! `dB = s·gᵀ·(x·Aᵀ)`.
//!
//! # Numbers
//! Every product runs a batch-invariant kernel, so a token's output depends
//! only on its own row:
//! - `x·Aᵀ` (and in the backward `g·B`, `dA`, `dB`) runs `matmul_nn` on
//!   rank-wide rows;
//! - with a bf16 weight, the update `(x·Aᵀ)·(s·B)ᵀ` joins each output's
//!   accumulator after its bf16 sum inside the packed kernel (no `[tokens,
//!   out]` buffer for it, no second pass), and the input gradient's
//!   `(s·g·B)·A` joins `g·W` the same way;
//! - with an f32 weight, `x·Wᵀ` runs `matmul_nt` and the update continues
//!   each output's sum in place (`matmul_nn`'s accumulate form).
//!
//! Every path of the model (training, prefill, decode, the server's batched
//! decode) computes a LoRA layer through this op, so they agree bit for bit.

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor};

use super::matmul::matmul_nt_rows;
use super::matmul_bf16::{packed_product, padded_cols, LowRank, PackedBf16};
use super::matmul_nn::{matmul_nn_rows, matmul_nn_rows_add};
use super::quant::QuantWeight;
use super::{f32_slice, transposed, weight_rows, with_f32s, WeightRows};
use crate::error::{ModelError, Result};

/// Whether [`lora_linear`] handles these operands: f32 input and adapter on
/// the CPU, a frozen f32 or bf16 weight, and the batch-invariant forward
/// matmul in use.
pub fn lora_linear_supported(
    m: super::ForwardMatmul,
    x: &Tensor,
    weight: &Tensor,
    a: &Tensor,
    b: &Tensor,
) -> bool {
    super::use_matmul_nt(m, x, weight)
        && !weight.is_variable()
        && [a, b]
            .iter()
            .all(|t| t.device().is_cpu() && t.dtype() == DType::F32)
}

/// `x·Wᵀ + scale·(x·Aᵀ)·Bᵀ`: `x` `[n, in]`, `weight` `[out, in]` (frozen;
/// `packed` its bf16 packing when it is bf16), `a` `[rank, in]`, `b`
/// `[out, rank]`. Differentiable w.r.t. `x`, `a` and `b`.
pub fn lora_linear(
    x: &Tensor,
    weight: &Tensor,
    packed: Option<&Arc<PackedBf16>>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    let (out, wk) = weight.dims2()?;
    let (rank, ak) = a.dims2()?;
    if wk != k || ak != k || b.dims2()? != (out, rank) {
        return Err(ModelError::InvalidInput(format!(
            "lora_linear: x {:?}, weight {:?}, a {:?}, b {:?}",
            x.dims(),
            weight.dims(),
            a.dims(),
            b.dims()
        )));
    }
    let op = LoraLinear {
        weight: weight.detach().contiguous()?,
        packed: packed.cloned(),
        quant: None,
        scale: scale as f32,
        down: Arc::new(Mutex::new(None)),
    };
    Ok(x.contiguous()?
        .apply_op3(&a.contiguous()?, &b.contiguous()?, op)?)
}

/// [`lora_linear`] on a frozen quantized base weight (QLoRA): the base
/// product is the quantized matmul the sampler runs, the input gradient
/// goes through the same dequantized rows; the adapter stays f32.
pub fn lora_linear_quant(
    x: &Tensor,
    weight: &QuantWeight,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    let (out, wk) = weight.dims();
    let (rank, ak) = a.dims2()?;
    if wk != k || ak != k || b.dims2()? != (out, rank) || x.dtype() != DType::F32 {
        return Err(ModelError::InvalidInput(format!(
            "lora_linear: x {:?}, {} weight {:?}, a {:?}, b {:?}",
            x.dims(),
            weight.format.as_str(),
            weight.dims(),
            a.dims(),
            b.dims()
        )));
    }
    let op = LoraLinear {
        weight: weight.blocks.clone(),
        packed: None,
        quant: Some(weight.clone()),
        scale: scale as f32,
        down: Arc::new(Mutex::new(None)),
    };
    Ok(x.contiguous()?
        .apply_op3(&a.contiguous()?, &b.contiguous()?, op)?)
}

struct LoraLinear {
    weight: Tensor,
    packed: Option<Arc<PackedBf16>>,
    /// The base weight's GGUF blocks, when it is kept quantized (`weight`
    /// then holds the same bytes).
    quant: Option<QuantWeight>,
    scale: f32,
    /// `x·Aᵀ` from the forward, for the backward.
    down: Arc<Mutex<Option<Vec<f32>>>>,
}

impl LoraLinear {
    /// Run `f` on the frozen weight's rows.
    fn with_weight<T>(
        &self,
        f: impl FnOnce(WeightRows<'_>) -> candle_core::Result<T>,
    ) -> candle_core::Result<T> {
        if let Some(q) = &self.quant {
            return q.with_rows(|r| f(WeightRows::Quant(r)));
        }
        let (storage, layout) = self.weight.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            return Err(candle_core::Error::Msg(
                "lora_linear: weight not on the CPU".into(),
            ));
        };
        f(weight_rows("lora_linear", cpu, layout)?)
    }
}

impl CustomOp3 for LoraLinear {
    fn name(&self) -> &'static str {
        "lora-linear"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        as_: &CpuStorage,
        al: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice("lora_linear", xs, xl, "x")?;
        let a = f32_slice("lora_linear", as_, al, "a")?;
        let b = f32_slice("lora_linear", bs, bl, "b")?;
        let (n, k) = xl.shape().dims2()?;
        let (rank, _) = al.shape().dims2()?;
        let (out, _) = bl.shape().dims2()?;
        // x·Aᵀ as x times Aᵀ `[in, rank]`: rank-wide rows, one vector each.
        let mut down = vec![0f32; n * rank];
        matmul_nn_rows(
            x,
            WeightRows::F32(&transposed(a, rank, k, 1.0, rank)),
            n,
            k,
            rank,
            &mut down,
        );
        let y = match &self.packed {
            // The update joins each output's accumulator after its bf16 sum.
            Some(p) => {
                let ft = transposed(b, out, rank, self.scale, padded_cols(out));
                let low = LowRank {
                    e: &down,
                    ft: &ft,
                    rank,
                };
                packed_product(x, p, n, Some(low))
            }
            None => {
                let mut y = vec![0f32; n * out];
                self.with_weight(|w| {
                    matmul_nt_rows(x, w, n, out, k, &mut y);
                    Ok(())
                })?;
                // y += (x·Aᵀ)·(s·Bᵀ), continuing each output's sum.
                let sbt = transposed(b, out, rank, self.scale, out);
                matmul_nn_rows_add(&down, WeightRows::F32(&sbt), n, rank, out, &mut y);
                y
            }
        };
        *self.down.lock().unwrap_or_else(PoisonError::into_inner) = Some(down);
        Ok((CpuStorage::F32(y), Shape::from((n, out))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, k) = x.dims2()?;
        let (rank, _) = a.dims2()?;
        let (out, _) = b.dims2()?;
        let down = self
            .down
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| {
                candle_core::Error::Msg("lora_linear: backward before forward".into())
            })?;
        let dev = Device::Cpu;
        with_f32s("lora_linear", [grad, x, a, b], |[g, xv, av, bv]| {
            // d(x·Aᵀ) = s·(g·B), [n, rank].
            let mut gd = vec![0f32; n * rank];
            matmul_nn_rows(g, WeightRows::F32(bv), n, out, rank, &mut gd);
            gd.iter_mut().for_each(|v| *v *= self.scale);
            let dx = if x.track_op() {
                let dx = match &self.packed {
                    // bf16: `g` rounded to bf16 like the forward's inputs;
                    // the update's `(s·g·B)·A` joins each accumulator.
                    Some(p) => {
                        let ft = padded(av, rank, k);
                        let low = LowRank {
                            e: &gd,
                            ft: &ft,
                            rank,
                        };
                        packed_product(g, p.transposed(), n, Some(low))
                    }
                    None => {
                        let mut dx = vec![0f32; n * k];
                        self.with_weight(|w| {
                            matmul_nn_rows(g, w, n, out, k, &mut dx);
                            Ok(())
                        })?;
                        matmul_nn_rows_add(&gd, WeightRows::F32(av), n, rank, k, &mut dx);
                        dx
                    }
                };
                Some(Tensor::from_vec(dx, (n, k), &dev)?)
            } else {
                None
            };
            // dA = (s·g·B)ᵀ·x, [rank, in].
            let da = if a.track_op() {
                let gdt = transposed(&gd, n, rank, 1.0, n);
                let mut da = vec![0f32; rank * k];
                matmul_nn_rows(&gdt, WeightRows::F32(xv), rank, n, k, &mut da);
                Some(Tensor::from_vec(da, (rank, k), &dev)?)
            } else {
                None
            };
            // dB = s·gᵀ·(x·Aᵀ), [out, rank]: computed as its transpose
            // (s·(x·Aᵀ))ᵀ·g, rank-row products like dA.
            let db = if b.track_op() {
                let downt = transposed(&down, n, rank, self.scale, n);
                let mut dbt = vec![0f32; rank * out];
                matmul_nn_rows(&downt, WeightRows::F32(g), rank, n, out, &mut dbt);
                Some(Tensor::from_vec(
                    transposed(&dbt, rank, out, 1.0, rank),
                    (out, rank),
                    &dev,
                )?)
            } else {
                None
            };
            Ok((dx, da, db))
        })
    }
}

/// A row-major `[rows, cols]` matrix with each row zero-padded to
/// [`padded_cols`]`(cols)`: a [`LowRank`] factor.
fn padded(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let ld = padded_cols(cols);
    if ld == cols {
        return m[..rows * cols].to_vec();
    }
    let mut t = vec![0f32; rows * ld];
    for (d, s) in t.chunks_exact_mut(ld).zip(m.chunks_exact(cols)) {
        d[..cols].copy_from_slice(s);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::{bits, rel_err, v64};
    use candle_core::Var;

    fn rand(shape: (usize, usize), seed: u64) -> Tensor {
        crate::kernels::test_util::rand_tensor(&[shape.0, shape.1], seed)
    }

    const N: usize = 37;
    const IN: usize = 40;
    const OUT: usize = 70;
    const R: usize = 4;

    /// Values and all three gradients against the composed f64 version.
    #[test]
    fn lora_linear_matches_composed_values_and_gradients() {
        let w = rand((OUT, IN), 1);
        for bf16 in [false, true] {
            let (weight, packed) = if bf16 {
                let wb = w.to_dtype(DType::BF16).unwrap();
                let p = Arc::new(PackedBf16::from_tensor(&wb).unwrap());
                (wb, Some(p))
            } else {
                (w.clone(), None)
            };
            let x = Var::from_tensor(&rand((N, IN), 2)).unwrap();
            let a = Var::from_tensor(&rand((R, IN), 3)).unwrap();
            let b = Var::from_tensor(&rand((OUT, R), 4)).unwrap();
            let probe = rand((N, OUT), 5);
            let y = lora_linear(
                x.as_tensor(),
                &weight,
                packed.as_ref(),
                a.as_tensor(),
                b.as_tensor(),
                0.5,
            )
            .unwrap();
            let to64 = |t: &Tensor| Var::from_tensor(&t.to_dtype(DType::F64).unwrap()).unwrap();
            let (x6, a6, b6) = (
                to64(x.as_tensor()),
                to64(a.as_tensor()),
                to64(b.as_tensor()),
            );
            let w6 = weight.to_dtype(DType::F64).unwrap();
            let r = (x6.as_tensor().matmul(&w6.t().unwrap()).unwrap()
                + x6.as_tensor()
                    .matmul(&a6.as_tensor().t().unwrap())
                    .unwrap()
                    .matmul(&b6.as_tensor().t().unwrap())
                    .unwrap()
                    .affine(0.5, 0.0)
                    .unwrap())
            .unwrap();
            // bf16 rounds each input row: compare loosely there.
            let tol = if bf16 { 2e-2 } else { 1e-5 };
            let e = rel_err(&v64(&y), &v64(&r));
            assert!(e < tol, "bf16={bf16}: values, relative error {e}");
            let g = (y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            let p6 = probe.to_dtype(DType::F64).unwrap();
            let rg = (r * &p6).unwrap().sum_all().unwrap().backward().unwrap();
            for (name, ours, theirs) in [("x", &x, &x6), ("a", &a, &a6), ("b", &b, &b6)] {
                let e = rel_err(
                    &v64(g.get(ours.as_tensor()).unwrap()),
                    &v64(rg.get(theirs.as_tensor()).unwrap()),
                );
                // With bf16 weights `dx = g·W` rounds `g` to bf16 (as the
                // forward rounds `x`); the adapter's gradients stay f32.
                let tol = if bf16 && name == "x" { 2e-2 } else { 1e-5 };
                assert!(e < tol, "bf16={bf16}: d{name} relative error {e}");
                if bf16 && name == "x" {
                    assert!(e > 1e-6, "dx with bf16 weights was not rounded");
                }
            }
        }
    }

    #[test]
    fn lora_linear_rows_do_not_depend_on_the_batch() {
        let w = rand((OUT, IN), 11);
        let x = rand((N, IN), 12);
        let a = rand((R, IN), 13);
        let b = rand((OUT, R), 14);
        let all = bits(&lora_linear(&x, &w, None, &a, &b, 2.0).unwrap());
        for (start, len) in [(0usize, 1usize), (5, 9), (36, 1)] {
            let part = bits(
                &lora_linear(&x.narrow(0, start, len).unwrap(), &w, None, &a, &b, 2.0).unwrap(),
            );
            assert_eq!(
                part,
                all[start * OUT..(start + len) * OUT],
                "rows {start}..+{len}"
            );
        }
    }

    #[test]
    fn lora_linear_rejects_mismatched_shapes() {
        let w = rand((OUT, IN), 1);
        let x = rand((N, IN), 2);
        assert!(lora_linear(&x, &w, None, &rand((R, IN + 1), 3), &rand((OUT, R), 4), 1.0).is_err());
        assert!(lora_linear(&x, &w, None, &rand((R, IN), 3), &rand((OUT, R + 1), 4), 1.0).is_err());
    }
}
