//! Rotary embedding and causal attention for every sequence of a packed
//! batch in one op: the training forward's attention.
//!
//! A packed batch holds several whole sequences back to back in one row
//! dimension (`[tokens, heads·hd]`, the layout the q/k/v projections
//! produce). Splitting it with candle ops costs, per sequence and layer, a
//! narrow, reshape, transpose, copy and seven rotary ops for each of q, k and
//! v — and in the backward each narrow pads its gradient back to the whole
//! batch, so the work grows with sequences × tokens. This op reads the packed
//! rows in place, rotates them into per-sequence `[heads, len, hd]` scratch,
//! runs the row loops of [`super::causal_attention`] and writes its output
//! back in the packed layout: one graph node per layer whatever the batch.
//!
//! # Same bits as the per-sequence path
//! The rotation is [`crate::arch::rope::Rope::apply`]'s formula with the same
//! operations in the same order (`x·cos + rot(x)·sin`), and each query row
//! runs the same `row_forward` over the same key blocks, so a token's output
//! is bit-identical to rotating its sequence alone and calling
//! [`super::causal_attention`] — and so to a prefill chunk or a decode step
//! against a KV cache (see `attention.rs`).
//!
//! # Shared prefixes
//! A sequence may continue an earlier sequence of the call
//! ([`PackedSeq::after`]), which may itself continue another: a tree of
//! prefixes. Its rows are the positions after its chain of prefixes', and
//! its queries see the chain's keys and values first (root first), then its
//! own. An RL group's completions of one prompt then carry the prompt once,
//! and a DPO batch carries its common system prompt once and each pair's
//! prompt once for the chosen and the rejected side. The keys are gathered
//! into one `[kv_heads, prefixes + len, hd]` buffer, exactly what the whole
//! sequence would have had, so every row gets the bits of the unshared
//! sequence. The backward adds each continuation's key and value gradients
//! of the prefix rows into every prefix of its chain, in call order.
//!
//! # Backward
//! The forward keeps only the per-row log-sum-exp. The backward rotates q
//! and k again, runs the `dQ`/`dK`/`dV` row loops per sequence and rotates
//! `dQ`/`dK` back (the rotation's transpose).

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::attention::{dkv_row, dot, dq_row, row_forward, Bwd, Dims};
use super::{f32_slice, transposed, with_f32s};
use crate::error::{ModelError, Result};

/// The rotary tables for positions `0..len`: `cos`, `sin`, each
/// `[len, head_dim]` row-major (both halves of a row hold the same angles).
#[derive(Debug, Clone)]
pub struct RopeTables {
    /// `cos(angle)` per position and dimension.
    pub cos: Vec<f32>,
    /// `sin(angle)` per position and dimension.
    pub sin: Vec<f32>,
}

/// Shapes of a packed attention call.
#[derive(Debug, Clone, Copy)]
pub struct PackedHeads {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (query head `h` uses kv head `h / (heads / kv_heads)`).
    pub kv_heads: usize,
    /// Dimensions per head (even).
    pub head_dim: usize,
}

/// One sequence of a packed call: `len` rows, which either start at
/// position 0 or continue an earlier sequence of the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedSeq {
    /// Rows of this sequence in the packed input.
    pub len: usize,
    /// The index of an earlier sequence of the call whose positions precede
    /// these (it may continue another in turn): this sequence's rows are the
    /// positions after its chain of prefixes ([`PackedSeq::start`]).
    pub after: Option<usize>,
}

impl PackedSeq {
    /// A whole sequence of `len` rows from position 0.
    pub fn whole(len: usize) -> Self {
        Self { len, after: None }
    }

    /// The position of sequence `s`'s first row in `seqs`: the rows of its
    /// chain of prefixes (0 for a whole sequence). `None` where the chain
    /// does not lead back to earlier sequences of `seqs`.
    pub fn start(seqs: &[PackedSeq], s: usize) -> Option<usize> {
        let mut at = s;
        let mut pos = 0;
        while let Some(p) = seqs.get(at)?.after {
            if p >= at {
                return None;
            }
            pos += seqs[p].len;
            at = p;
        }
        Some(pos)
    }

    /// The chain of sequence `s`'s prefixes, root first (empty for a whole
    /// sequence); `seqs` is valid ([`PackedSeq::start`] is `Some`).
    fn chain(seqs: &[PackedSeq], s: usize) -> Vec<usize> {
        let mut out = Vec::new();
        let mut at = s;
        while let Some(p) = seqs[at].after {
            out.push(p);
            at = p;
        }
        out.reverse();
        out
    }
}

/// Causal GQA attention with rotary embeddings over packed sequences.
/// `q`: `[n, heads·hd]`, `k`, `v`: `[n, kv_heads·hd]`, not yet rotated; the
/// rows hold the sequences of `seqs` back to back. Returns `[n, heads·hd]`,
/// differentiable w.r.t. q, k and v.
pub fn packed_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqs: &[PackedSeq],
    shape: PackedHeads,
    rope: Arc<RopeTables>,
    scale: f64,
) -> Result<Tensor> {
    let PackedHeads {
        heads,
        kv_heads,
        head_dim: hd,
    } = shape;
    let n: usize = seqs.iter().map(|s| s.len).sum();
    let starts: Option<Vec<usize>> = (0..seqs.len()).map(|s| PackedSeq::start(seqs, s)).collect();
    let bad_prefix = starts.is_none();
    let longest = starts
        .iter()
        .flatten()
        .zip(seqs)
        .map(|(start, s)| start + s.len)
        .max()
        .unwrap_or(0);
    let bad = kv_heads == 0
        || heads % kv_heads != 0
        || hd % 2 != 0
        || bad_prefix
        || seqs.iter().any(|s| s.len == 0)
        || q.dims2()? != (n, heads * hd)
        || k.dims2()? != (n, kv_heads * hd)
        || v.dims2()? != (n, kv_heads * hd)
        || rope.cos.len() < longest * hd
        || rope.sin.len() < longest * hd;
    if bad {
        return Err(ModelError::InvalidInput(format!(
            "packed_attention: q {:?}, k {:?}, v {:?}, sequences {seqs:?} (a prefix must be an earlier sequence), {heads}/{kv_heads} heads of {hd}, rope tables for {} positions",
            q.dims(),
            k.dims(),
            v.dims(),
            rope.cos.len() / hd.max(1),
        )));
    }
    let chains = (0..seqs.len()).map(|s| PackedSeq::chain(seqs, s)).collect();
    let op = PackedAttention {
        seqs: seqs.to_vec(),
        chains,
        shape,
        scale: scale as f32,
        rope,
        lse: Arc::new(Mutex::new(None)),
    };
    Ok(q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, op)?)
}

struct PackedAttention {
    seqs: Vec<PackedSeq>,
    /// Each sequence's chain of prefixes, root first.
    chains: Vec<Vec<usize>>,
    shape: PackedHeads,
    scale: f32,
    rope: Arc<RopeTables>,
    /// Log-sum-exp per (token, head), token-major, from the forward.
    lse: Arc<Mutex<Option<Vec<f32>>>>,
}

/// The rows of `parts` (each `(first row, rows)` of the packed `[n,
/// heads·hd]` buffer `x`), one after the other, as `[heads, rows, hd]`;
/// rotated for positions `first_pos..` when `rope` is given.
fn gather_heads(
    x: &[f32],
    parts: &[(usize, usize)],
    first_pos: usize,
    heads: usize,
    hd: usize,
    rope: Option<&RopeTables>,
) -> Vec<f32> {
    let width = heads * hd;
    let len: usize = parts.iter().map(|p| p.1).sum();
    let mut rows = Vec::with_capacity(len);
    for &(off, n) in parts {
        rows.extend(off..off + n);
    }
    let mut out = vec![0f32; heads * len * hd];
    out.par_chunks_mut(hd).enumerate().for_each(|(r, o)| {
        let (h, i) = (r / len, r % len);
        let row = rows[i];
        let src = &x[row * width + h * hd..row * width + (h + 1) * hd];
        let p = first_pos + i;
        match rope {
            Some(t) => rotate(
                src,
                &t.cos[p * hd..(p + 1) * hd],
                &t.sin[p * hd..(p + 1) * hd],
                o,
            ),
            None => o.copy_from_slice(src),
        }
    });
    out
}

/// `x·cos + rot(x)·sin` with `rot(x) = (−x₂, x₁)`: `Rope::apply`'s
/// operations in its order, so the bits are the same.
#[inline]
fn rotate(x: &[f32], cos: &[f32], sin: &[f32], out: &mut [f32]) {
    let half = x.len() / 2;
    for j in 0..x.len() {
        let rot = if j < half { -x[j + half] } else { x[j - half] };
        out[j] = x[j] * cos[j] + rot * sin[j];
    }
}

/// The rotation's transpose: the gradient of [`rotate`]'s input from its
/// output's gradient `dy`.
#[inline]
fn unrotate(dy: &[f32], cos: &[f32], sin: &[f32], out: &mut [f32]) {
    let half = dy.len() / 2;
    for j in 0..dy.len() {
        let back = if j < half {
            dy[j + half] * sin[j + half]
        } else {
            -(dy[j - half] * sin[j - half])
        };
        out[j] = dy[j] * cos[j] + back;
    }
}

/// Rows `from..from + len` of `[heads, rows, hd]` (`rows` per head) into
/// rows `off..off+len` of a packed `[n, heads·hd]` buffer, un-rotated for
/// positions `first_pos..` when `rope` is given; added to what the rows
/// hold when `add`, else written.
#[allow(clippy::too_many_arguments)]
fn scatter_heads(
    src: &[f32],
    (rows, from): (usize, usize),
    dst: &mut [f32],
    (off, len, first_pos): (usize, usize, usize),
    heads: usize,
    hd: usize,
    rope: Option<&RopeTables>,
    add: bool,
) {
    let width = heads * hd;
    dst[off * width..(off + len) * width]
        .par_chunks_mut(width)
        .enumerate()
        .for_each(|(i, row)| {
            // Added rows go through a scratch row; written ones in place.
            let mut tmp = if add { vec![0f32; hd] } else { Vec::new() };
            for h in 0..heads {
                let at = (h * rows + from + i) * hd;
                let s = &src[at..at + hd];
                let o = &mut row[h * hd..(h + 1) * hd];
                let p = first_pos + i;
                let t = if add { &mut tmp[..] } else { &mut *o };
                match rope {
                    Some(r) => unrotate(
                        s,
                        &r.cos[p * hd..(p + 1) * hd],
                        &r.sin[p * hd..(p + 1) * hd],
                        t,
                    ),
                    None => t.copy_from_slice(s),
                }
                if add {
                    o.iter_mut().zip(&tmp).for_each(|(o, t)| *o += t);
                }
            }
        });
}

impl PackedAttention {
    /// Each sequence's first row in the packed buffer.
    fn offsets(&self) -> Vec<usize> {
        self.seqs
            .iter()
            .scan(0, |acc, s| {
                let o = *acc;
                *acc += s.len;
                Some(o)
            })
            .collect()
    }

    /// Positions before sequence `s`'s rows (its prefixes' lengths).
    fn start(&self, s: usize) -> usize {
        self.chains[s].iter().map(|&p| self.seqs[p].len).sum()
    }

    /// The rows whose keys sequence `s` sees, in position order.
    fn key_parts(&self, s: usize, offsets: &[usize]) -> Vec<(usize, usize)> {
        self.chains[s]
            .iter()
            .chain(std::iter::once(&s))
            .map(|&p| (offsets[p], self.seqs[p].len))
            .collect()
    }

    fn dims(&self, s: usize) -> Dims {
        let PackedHeads {
            heads,
            kv_heads,
            head_dim: hd,
        } = self.shape;
        let (lq, lk) = (self.seqs[s].len, self.start(s) + self.seqs[s].len);
        Dims {
            scale: self.scale,
            lq,
            hd,
            lk,
            groups: heads / kv_heads,
            k_stride: lk * hd,
            v_stride: lk * hd,
        }
    }
}

/// Sequences up to this long take [`dense_backward`]: its `[groups·len,
/// len]` score matrices (3 × 1,024² floats, 12 MB, per kv head in flight)
/// stay small; longer ones run the per-row loops of `attention.rs`.
const DENSE_BACKWARD_MAX_LEN: usize = 1024;

/// The attention backward of one sequence through matmuls: per kv head, the
/// scores `S = Q·Kᵀ` and `dP = dO·Vᵀ` of its query heads, `P = exp(S·scale −
/// lse)` and `dS = P∘(dP − D)` under the causal mask, then `dQ = dS·K`,
/// `dK = dSᵀ·Q`, `dV = Pᵀ·dO` (times the scale where due). The per-row
/// loops compute each (query, key) pair's two dot products twice (once for
/// `dQ`, once for `dK`/`dV`), a horizontal sum each; here the batch-invariant
/// matmul kernels do the arithmetic (`temper bench model` on SmolLM2 spent
/// 15% of a bf16 step in the row loops). Deterministic: each kv head's
/// gradients depend only on its inputs. Inputs are head-major `[heads, len,
/// hd]` (q, dO) and `[kv_heads, len, hd]` (k, v), rotated as in the forward;
/// `lse` and `dsum` are per query row, head-major.
#[allow(clippy::too_many_arguments)]
fn dense_backward(
    d: &Dims,
    kv_heads: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    go: &[f32],
    lse: &[f32],
    dsum: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    use super::matmul_nn::matmul_nn_rows;
    use super::WeightRows::F32;
    let (lq, lk, hd, groups, scale) = (d.lq, d.lk, d.hd, d.groups, d.scale);
    let rows = groups * lq;
    let mut dq = vec![0f32; kv_heads * rows * hd];
    let mut dk = vec![0f32; kv_heads * lk * hd];
    let mut dv = vec![0f32; kv_heads * lk * hd];
    dq.par_chunks_mut(rows * hd)
        .zip(dk.par_chunks_mut(lk * hd))
        .zip(dv.par_chunks_mut(lk * hd))
        .enumerate()
        .for_each(|(g, ((dq, dk), dv))| {
            let qg = &q[g * rows * hd..(g + 1) * rows * hd];
            let gog = &go[g * rows * hd..(g + 1) * rows * hd];
            let kg = &k[g * lk * hd..(g + 1) * lk * hd];
            let vg = &v[g * lk * hd..(g + 1) * lk * hd];
            let mut p = vec![0f32; rows * lk];
            let mut ds = vec![0f32; rows * lk];
            // Q·Kᵀ and dO·Vᵀ as products with Kᵀ and Vᵀ: a 64-term dot per
            // output is mostly horizontal sum; broadcast-and-multiply is not.
            let (kt, vt) = (
                transposed(kg, lk, hd, 1.0, lk),
                transposed(vg, lk, hd, 1.0, lk),
            );
            matmul_nn_rows(qg, F32(&kt), rows, hd, lk, &mut p);
            matmul_nn_rows(gog, F32(&vt), rows, hd, lk, &mut ds);
            p.chunks_mut(lk)
                .zip(ds.chunks_mut(lk))
                .enumerate()
                .for_each(|(rr, (pr, dr))| {
                    let r = g * rows + rr;
                    probs_and_grads(pr, dr, d.pos(rr % lq), scale, lse[r], dsum[r]);
                });
            matmul_nn_rows(&ds, F32(kg), rows, lk, hd, dq);
            dq.iter_mut().for_each(|x| *x *= scale);
            let (dst, pt) = (
                transposed(&ds, rows, lk, 1.0, rows),
                transposed(&p, rows, lk, 1.0, rows),
            );
            matmul_nn_rows(&dst, F32(qg), lk, rows, hd, dk);
            dk.iter_mut().for_each(|x| *x *= scale);
            matmul_nn_rows(&pt, F32(gog), lk, rows, hd, dv);
        });
    (dq, dk, dv)
}

twice_compiled! {
    /// One query row `i` of [`dense_backward`]: `p` holds its scores and
    /// becomes `P`, `dp` holds `dO·vⱼ` and becomes `dS`; keys after position
    /// `i` are 0.
    fn probs_and_grads / probs_and_grads_body(p: &mut [f32], dp: &mut [f32], i: usize, scale: f32, lse: f32, dsum: f32)
}

#[inline(always)]
fn probs_and_grads_body(p: &mut [f32], dp: &mut [f32], i: usize, scale: f32, lse: f32, dsum: f32) {
    let seen = (i + 1).min(p.len());
    for (s, g) in p[..seen].iter_mut().zip(&mut dp[..seen]) {
        *s = super::exp::exp(*s * scale - lse);
        *g = *s * (*g - dsum);
    }
    p[seen..].fill(0.0);
    dp[seen..].fill(0.0);
}

impl CustomOp3 for PackedAttention {
    fn name(&self) -> &'static str {
        "packed-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let q = f32_slice("packed_attention", qs, ql, "q")?;
        let k = f32_slice("packed_attention", ks, kl, "k")?;
        let v = f32_slice("packed_attention", vs, vl, "v")?;
        let PackedHeads {
            heads,
            kv_heads,
            head_dim: hd,
        } = self.shape;
        let n: usize = self.seqs.iter().map(|s| s.len).sum();
        let rope = Some(self.rope.as_ref());
        let offsets = self.offsets();
        // Rotated per-sequence operands (keys and values from position 0,
        // a prefix's rows included), then every (token, head) row at once.
        let per_seq: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..self.seqs.len())
            .map(|s| {
                let kp = self.key_parts(s, &offsets);
                (
                    gather_heads(
                        q,
                        &[(offsets[s], self.seqs[s].len)],
                        self.start(s),
                        heads,
                        hd,
                        rope,
                    ),
                    gather_heads(k, &kp, 0, kv_heads, hd, rope),
                    gather_heads(v, &kp, 0, kv_heads, hd, None),
                )
            })
            .collect();
        let mut seq_of = Vec::with_capacity(n);
        for (s, seq) in self.seqs.iter().enumerate() {
            seq_of.extend((0..seq.len).map(|i| (s, i)));
        }
        let dims: Vec<Dims> = (0..self.seqs.len()).map(|s| self.dims(s)).collect();
        let mut out = vec![0f32; n * heads * hd];
        let mut lse = vec![0f32; n * heads];
        out.par_chunks_mut(hd)
            .zip(lse.par_iter_mut())
            .enumerate()
            .for_each(|(r, (o, lse))| {
                let (t, h) = (r / heads, r % heads);
                let (s, i) = seq_of[t];
                let (qh, kh, vh) = &per_seq[s];
                let len = self.seqs[s].len;
                let qr = &qh[(h * len + i) * hd..(h * len + i + 1) * hd];
                *lse = row_forward(&dims[s], qr, kh, vh, h, i, o);
            });
        *self.lse.lock().unwrap_or_else(PoisonError::into_inner) = Some(lse);
        Ok((CpuStorage::F32(out), Shape::from((n, heads * hd))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let PackedHeads {
            heads,
            kv_heads,
            head_dim: hd,
        } = self.shape;
        let n: usize = self.seqs.iter().map(|s| s.len).sum();
        let lse = self
            .lse
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| {
                candle_core::Error::Msg("packed_attention: backward before forward".into())
            })?;
        let (dq, dk, dv) = with_f32s(
            "packed_attention",
            [q, k, v, res, grad],
            |[qv, kv, vv, ov, gv]| {
                let rope = Some(self.rope.as_ref());
                let offsets = self.offsets();
                let mut dq = vec![0f32; n * heads * hd];
                let mut dk = vec![0f32; n * kv_heads * hd];
                let mut dv = vec![0f32; n * kv_heads * hd];
                // In call order: a prefix's own gradients are written before
                // its continuations add theirs (a prefix comes first).
                for (s, seq) in self.seqs.iter().enumerate() {
                    let (off, len, start) = (offsets[s], seq.len, self.start(s));
                    let d = self.dims(s);
                    let kp = self.key_parts(s, &offsets);
                    let own = [(off, len)];
                    let qh = gather_heads(qv, &own, start, heads, hd, rope);
                    let kh = gather_heads(kv, &kp, 0, kv_heads, hd, rope);
                    let vh = gather_heads(vv, &kp, 0, kv_heads, hd, None);
                    let go = gather_heads(gv, &own, 0, heads, hd, None);
                    let oh = gather_heads(ov, &own, 0, heads, hd, None);
                    let lse_h: Vec<f32> = (0..heads * len)
                        .map(|r| lse[(off + r % len) * heads + r / len])
                        .collect();
                    let dsum: Vec<f32> = (0..heads * len)
                        .map(|r| dot(&go[r * hd..(r + 1) * hd], &oh[r * hd..(r + 1) * hd]))
                        .collect();
                    let (dqh, dkh, dvh) = if d.lk <= DENSE_BACKWARD_MAX_LEN {
                        dense_backward(&d, kv_heads, &qh, &kh, &vh, &go, &lse_h, &dsum)
                    } else {
                        let b = Bwd {
                            d: &d,
                            q: &qh,
                            k: &kh,
                            v: &vh,
                            go: &go,
                            lse: &lse_h,
                            dsum: &dsum,
                        };
                        let mut dqh = vec![0f32; heads * len * hd];
                        dqh.par_chunks_mut(hd)
                            .enumerate()
                            .for_each(|(r, dqr)| dq_row(&b, r, dqr));
                        let mut dkh = vec![0f32; kv_heads * d.lk * hd];
                        let mut dvh = vec![0f32; kv_heads * d.lk * hd];
                        dkh.par_chunks_mut(hd)
                            .zip(dvh.par_chunks_mut(hd))
                            .enumerate()
                            .for_each(|(kr, (dkr, dvr))| dkv_row(&b, kr, dkr, dvr));
                        (dqh, dkh, dvh)
                    };
                    let lk = d.lk;
                    scatter_heads(
                        &dqh,
                        (len, 0),
                        &mut dq,
                        (off, len, start),
                        heads,
                        hd,
                        rope,
                        false,
                    );
                    scatter_heads(
                        &dkh,
                        (lk, start),
                        &mut dk,
                        (off, len, start),
                        kv_heads,
                        hd,
                        rope,
                        false,
                    );
                    scatter_heads(
                        &dvh,
                        (lk, start),
                        &mut dv,
                        (off, len, start),
                        kv_heads,
                        hd,
                        None,
                        false,
                    );
                    let mut pos = 0;
                    for &p in &self.chains[s] {
                        let (from, to) = ((lk, pos), (offsets[p], self.seqs[p].len, pos));
                        scatter_heads(&dkh, from, &mut dk, to, kv_heads, hd, rope, true);
                        scatter_heads(&dvh, from, &mut dv, to, kv_heads, hd, None, true);
                        pos += self.seqs[p].len;
                    }
                }
                Ok((dq, dk, dv))
            },
        )?;
        let dev = q.device();
        Ok((
            Some(Tensor::from_vec(dq, (n, heads * hd), dev)?),
            Some(Tensor::from_vec(dk, (n, kv_heads * hd), dev)?),
            Some(Tensor::from_vec(dv, (n, kv_heads * hd), dev)?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::{bits, rel_err, v64};
    use candle_core::{Device, Var};

    fn rand(shape: (usize, usize), seed: u64) -> Tensor {
        crate::kernels::test_util::rand_tensor(&[shape.0, shape.1], seed)
    }

    const NH: usize = 6;
    const NKV: usize = 2;
    const HD: usize = 12;

    /// Tables as `Rope::new` builds them (angles `p·f`, both halves equal).
    fn tables(len: usize) -> (RopeTables, Tensor, Tensor) {
        let half = HD / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0f32 / 10000f32.powf((2 * i) as f32 / HD as f32))
            .collect();
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        for p in 0..len {
            for j in 0..HD {
                let a = p as f32 * inv[j % half];
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let ct = Tensor::from_vec(cos.clone(), (len, HD), &Device::Cpu).unwrap();
        let st = Tensor::from_vec(sin.clone(), (len, HD), &Device::Cpu).unwrap();
        (RopeTables { cos, sin }, ct, st)
    }

    /// The per-sequence candle path the model used: narrow, reshape,
    /// transpose, rotate with candle ops, [`super::super::causal_attention`].
    fn per_sequence(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        lens: &[usize],
        cos: &Tensor,
        sin: &Tensor,
        scale: f64,
    ) -> Tensor {
        let rope = |x: &Tensor| -> Tensor {
            let (_, len, hd) = x.dims3().unwrap();
            let c = cos.narrow(0, 0, len).unwrap();
            let s = sin.narrow(0, 0, len).unwrap();
            let x1 = x.narrow(2, 0, hd / 2).unwrap();
            let x2 = x.narrow(2, hd / 2, hd / 2).unwrap();
            let rot = Tensor::cat(&[&x2.neg().unwrap(), &x1], 2).unwrap();
            (x.broadcast_mul(&c).unwrap() + rot.broadcast_mul(&s).unwrap()).unwrap()
        };
        let heads = |x: &Tensor, off: usize, len: usize, h: usize| -> Tensor {
            x.narrow(0, off, len)
                .unwrap()
                .reshape((len, h, HD))
                .unwrap()
                .transpose(0, 1)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let mut outs = Vec::new();
        let mut off = 0;
        for &len in lens {
            let qs = rope(&heads(q, off, len, NH));
            let ks = rope(&heads(k, off, len, NKV));
            let vs = heads(v, off, len, NKV);
            let o = super::super::causal_attention(&qs, &ks, &vs, scale).unwrap();
            outs.push(o.transpose(0, 1).unwrap().reshape((len, NH * HD)).unwrap());
            off += len;
        }
        Tensor::cat(&outs, 0).unwrap()
    }

    /// `ours` and `theirs` are bit-identical, and the gradients of
    /// `Σ w·out` with respect to q, k and v agree within 1e-5 (relative).
    fn same_bits_and_grads(ours: Tensor, theirs: Tensor, w: &Tensor, qkv: [&Var; 3], what: &str) {
        assert_eq!(bits(&ours), bits(&theirs), "{what}outputs");
        let ga = (ours * w).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (theirs * w).unwrap().sum_all().unwrap().backward().unwrap();
        for (name, x) in ["q", "k", "v"].into_iter().zip(qkv) {
            let err = rel_err(
                &v64(ga.get(x.as_tensor()).unwrap()),
                &v64(gb.get(x.as_tensor()).unwrap()),
            );
            assert!(err < 1e-5, "{what}d{name} relative error {err}");
        }
    }

    fn whole(lens: &[usize]) -> Vec<PackedSeq> {
        lens.iter().map(|&l| PackedSeq::whole(l)).collect()
    }

    fn shape() -> PackedHeads {
        PackedHeads {
            heads: NH,
            kv_heads: NKV,
            head_dim: HD,
        }
    }

    #[test]
    fn packed_attention_gives_the_per_sequence_bits_and_gradients() {
        // Sequences across a key-block boundary, a one-token sequence, the
        // same sequence alone, and one too long for the dense backward.
        for lens in [
            vec![70usize, 1, 130, 9],
            vec![130],
            vec![5, DENSE_BACKWARD_MAX_LEN + 3],
        ] {
            let n: usize = lens.iter().sum();
            let longest = *lens.iter().max().unwrap();
            let q = Var::from_tensor(&rand((n, NH * HD), 1)).unwrap();
            let k = Var::from_tensor(&rand((n, NKV * HD), 2)).unwrap();
            let v = Var::from_tensor(&rand((n, NKV * HD), 3)).unwrap();
            let w = rand((n, NH * HD), 4);
            let (t, cos, sin) = tables(longest);
            let scale = 1.0 / (HD as f64).sqrt();
            let ours = packed_attention(
                q.as_tensor(),
                k.as_tensor(),
                v.as_tensor(),
                &whole(&lens),
                shape(),
                Arc::new(t),
                scale,
            )
            .unwrap();
            let theirs = per_sequence(
                q.as_tensor(),
                k.as_tensor(),
                v.as_tensor(),
                &lens,
                &cos,
                &sin,
                scale,
            );
            same_bits_and_grads(ours, theirs, &w, [&q, &k, &v], &format!("{lens:?}: "));
        }
    }

    #[test]
    fn a_shared_prefix_gives_the_whole_sequences_bits_and_gradients() {
        // Sequence 0 is a prefix of 70 rows (across a key-block boundary);
        // 1 and 3 continue it, 2 is whole. Compared with the unshared batch
        // [prefix + 1, 2, prefix + 3]: the same bits for every row, and the
        // prefix's gradients are the sum of both copies'.
        let after = |len| PackedSeq {
            len,
            after: Some(0),
        };
        for (cont, last) in [(9usize, 130usize), (1, DENSE_BACKWARD_MAX_LEN)] {
            let seqs = [
                PackedSeq::whole(70),
                after(cont),
                PackedSeq::whole(20),
                after(last),
            ];
            let n = 70 + cont + 20 + last;
            let q = Var::from_tensor(&rand((n, NH * HD), 21)).unwrap();
            let k = Var::from_tensor(&rand((n, NKV * HD), 22)).unwrap();
            let v = Var::from_tensor(&rand((n, NKV * HD), 23)).unwrap();
            let w = rand((n, NH * HD), 24);
            let (t, cos, sin) = tables(70 + last);
            let scale = 1.0 / (HD as f64).sqrt();
            let ours = packed_attention(
                q.as_tensor(),
                k.as_tensor(),
                v.as_tensor(),
                &seqs,
                shape(),
                Arc::new(t),
                scale,
            )
            .unwrap();
            // The unshared rows, as indices into the shared ones; the second
            // copy of the prefix carries no loss.
            let (a, b, c) = (70 + cont, 70 + cont + 20, n);
            let mut rows: Vec<u32> = (0..a as u32).collect();
            rows.extend(a as u32..b as u32);
            rows.extend(0..70u32);
            rows.extend(b as u32..c as u32);
            let idx = Tensor::new(rows.as_slice(), &Device::Cpu).unwrap();
            let pick = |x: &Tensor| x.index_select(&idx, 0).unwrap();
            let lens = [70 + cont, 20, 70 + last];
            let theirs = per_sequence(
                &pick(q.as_tensor()),
                &pick(k.as_tensor()),
                &pick(v.as_tensor()),
                &lens,
                &cos,
                &sin,
                scale,
            );
            let keep: Vec<u32> = (0..a + 20)
                .chain(a + 20 + 70..a + 20 + 70 + last)
                .map(|r| r as u32)
                .collect();
            let kept = theirs
                .index_select(&Tensor::new(keep.as_slice(), &Device::Cpu).unwrap(), 0)
                .unwrap();
            same_bits_and_grads(ours, kept, &w, [&q, &k, &v], &format!("{seqs:?}: "));
        }
    }

    #[test]
    fn a_tree_of_shared_prefixes_gives_the_whole_sequences_bits_and_gradients() {
        // A DPO batch's shape: a common root (across a key-block boundary),
        // then each pair's prompt after it, then both sides of the pair after
        // that; beside them a whole sequence, a sequence right after the
        // root, and a chain long enough for the per-row backward. Compared
        // with every sequence computed whole (its chain's rows, then its
        // own): the same bits for its own rows, and the gradients of the
        // unshared batch, where the copies of a prefix carry no loss.
        let after = |len, p| PackedSeq {
            len,
            after: Some(p),
        };
        let seqs = [
            PackedSeq::whole(70),
            after(12, 0),
            after(9, 1),
            after(1, 1),
            PackedSeq::whole(20),
            after(5, 0),
            after(3, 5),
            after(7, 5),
            after(3, 0),
            after(DENSE_BACKWARD_MAX_LEN, 7),
        ];
        let n: usize = seqs.iter().map(|s| s.len).sum();
        let offsets: Vec<usize> = seqs
            .iter()
            .scan(0, |acc, s| {
                let o = *acc;
                *acc += s.len;
                Some(o)
            })
            .collect();
        let q = Var::from_tensor(&rand((n, NH * HD), 31)).unwrap();
        let k = Var::from_tensor(&rand((n, NKV * HD), 32)).unwrap();
        let v = Var::from_tensor(&rand((n, NKV * HD), 33)).unwrap();
        let w = rand((n, NH * HD), 34);
        let starts: Vec<usize> = (0..seqs.len())
            .map(|s| PackedSeq::start(&seqs, s).unwrap())
            .collect();
        assert_eq!(starts, [0, 70, 82, 82, 0, 70, 75, 75, 70, 82]);
        let longest = starts.iter().zip(&seqs).map(|(a, s)| a + s.len).max();
        let (t, cos, sin) = tables(longest.unwrap());
        let scale = 1.0 / (HD as f64).sqrt();
        let ours = packed_attention(
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            &seqs,
            shape(),
            Arc::new(t),
            scale,
        )
        .unwrap();
        // Each sequence whole: the rows of its chain, root first, then its own.
        let (mut rows, mut keep, mut lens) = (Vec::new(), Vec::new(), Vec::new());
        for s in 0..seqs.len() {
            let mut chain = PackedSeq::chain(&seqs, s);
            chain.push(s);
            for &p in &chain {
                if p == s {
                    keep.extend(rows.len() as u32..(rows.len() + seqs[s].len) as u32);
                }
                rows.extend((offsets[p]..offsets[p] + seqs[p].len).map(|r| r as u32));
            }
            lens.push(starts[s] + seqs[s].len);
        }
        let idx = Tensor::new(rows.as_slice(), &Device::Cpu).unwrap();
        let pick = |x: &Tensor| x.index_select(&idx, 0).unwrap();
        let theirs = per_sequence(
            &pick(q.as_tensor()),
            &pick(k.as_tensor()),
            &pick(v.as_tensor()),
            &lens,
            &cos,
            &sin,
            scale,
        );
        let kept = theirs
            .index_select(&Tensor::new(keep.as_slice(), &Device::Cpu).unwrap(), 0)
            .unwrap();
        same_bits_and_grads(ours, kept, &w, [&q, &k, &v], "");
    }

    #[test]
    fn packed_attention_gradient_matches_finite_differences() {
        let lens = [20usize, 33];
        let n = 53;
        let q = rand((n, NH * HD), 5);
        let k = rand((n, NKV * HD), 6);
        let v = rand((n, NKV * HD), 7);
        let w = rand((n, NH * HD), 8);
        let f = |q: &Tensor, k: &Tensor, v: &Tensor| -> Tensor {
            let o = packed_attention(q, k, v, &whole(&lens), shape(), Arc::new(tables(33).0), 0.3)
                .unwrap();
            (o * &w).unwrap().sum_all().unwrap()
        };
        let vars = [
            Var::from_tensor(&q).unwrap(),
            Var::from_tensor(&k).unwrap(),
            Var::from_tensor(&v).unwrap(),
        ];
        let g = f(
            vars[0].as_tensor(),
            vars[1].as_tensor(),
            vars[2].as_tensor(),
        )
        .backward()
        .unwrap();
        let eps = 1e-2f32;
        for (which, var) in vars.iter().enumerate() {
            let grad = v64(g.get(var.as_tensor()).unwrap());
            let base: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            for idx in [0usize, 7, base.len() / 2 + 5, base.len() - 1] {
                let eval = |delta: f32| -> f64 {
                    let mut x = base.clone();
                    x[idx] += delta;
                    let t = Tensor::from_vec(x, var.as_tensor().dims(), &Device::Cpu).unwrap();
                    let mut args = [q.clone(), k.clone(), v.clone()];
                    args[which] = t;
                    v64(&f(&args[0], &args[1], &args[2]))[0]
                };
                let fd = (eval(eps) - eval(-eps)) / (2.0 * eps as f64);
                let rel = (fd - grad[idx]).abs() / grad[idx].abs().max(1e-2);
                assert!(
                    rel < 2e-2,
                    "input {which} element {idx}: fd {fd} vs grad {}",
                    grad[idx]
                );
            }
        }
    }

    #[test]
    fn packed_attention_is_bit_identical_across_thread_counts() {
        let lens = [40usize, 90, 3];
        let n = 133;
        let q = rand((n, NH * HD), 12);
        let k = rand((n, NKV * HD), 13);
        let v = rand((n, NKV * HD), 14);
        let run = |threads: usize| -> Vec<u32> {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                bits(
                    &packed_attention(
                        &q,
                        &k,
                        &v,
                        &whole(&lens),
                        shape(),
                        Arc::new(tables(90).0),
                        0.25,
                    )
                    .unwrap(),
                )
            })
        };
        let one = run(1);
        assert_eq!(one, run(2));
        assert_eq!(one, run(3));
    }

    #[test]
    fn packed_attention_rejects_inconsistent_inputs() {
        let q = rand((10, NH * HD), 1);
        let k = rand((10, NKV * HD), 2);
        // Lengths that do not add up to the rows, an empty sequence, short
        // rope tables.
        let call = |seqs: &[PackedSeq], positions: usize| {
            packed_attention(
                &q,
                &k,
                &k,
                seqs,
                shape(),
                Arc::new(tables(positions).0),
                1.0,
            )
        };
        assert!(call(&whole(&[4, 5]), 10).is_err());
        assert!(call(&whole(&[10, 0]), 10).is_err());
        assert!(call(&whole(&[10]), 9).is_err());
        assert!(call(&whole(&[4, 6]), 6).is_ok());
        // A prefix must be an earlier whole sequence, and the tables must
        // reach the end of its continuations.
        let after = |len, p| PackedSeq {
            len,
            after: Some(p),
        };
        assert!(call(&[after(4, 1), PackedSeq::whole(6)], 10).is_err());
        assert!(call(&[PackedSeq::whole(4), after(6, 7)], 10).is_err());
        assert!(call(&[PackedSeq::whole(4), after(3, 2), after(3, 1)], 10).is_err());
        assert!(call(&[PackedSeq::whole(4), after(6, 0)], 9).is_err());
        assert!(call(&[PackedSeq::whole(4), after(6, 0)], 10).is_ok());
        // A chain: the tables must reach the end of the whole chain.
        assert!(call(&[PackedSeq::whole(4), after(3, 0), after(3, 1)], 9).is_err());
        assert!(call(&[PackedSeq::whole(4), after(3, 0), after(3, 1)], 10).is_ok());
    }
}
