//! Causal grouped-query attention with an online softmax over fixed key
//! blocks: memory linear in the sequence length (never a `T×T` score
//! matrix), and one query's result independent of how it is computed.
//!
//! # Invariance
//! Query `i` of a call sits at absolute position `P = kv_len − q_len + i` and
//! attends to keys `0..=P`. Its output is computed by one loop over the key
//! blocks `[0, KEY_BLOCK)`, `[KEY_BLOCK, 2·KEY_BLOCK)`, … up to `P`, with dot
//! products summed in a fixed lane order — nothing depends on `q_len`, on
//! the other queries, or on the thread count (threads split queries, never a
//! reduction). So a token's attention output is bit-identical whether it is
//! computed in a full-sequence pass, in a prefill chunk against a KV cache,
//! or in one decode step.
//!
//! # Backward
//! FlashAttention-2 style: the forward keeps only the per-row log-sum-exp;
//! the backward recomputes scores. `dQ` is computed per query row, `dK`/`dV`
//! per key row (each a fixed-order sum over the queries that see it), so the
//! gradients are deterministic too.

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use rayon::prelude::*;

use super::exp::exp;
use super::f32_slice;
use crate::error::{ModelError, Result};

/// Keys per online-softmax block.
pub const KEY_BLOCK: usize = 64;

/// Below this many multiply-adds a forward runs on the calling thread.
const SEQUENTIAL_WORK: usize = 1 << 18;

/// Causal GQA attention. `q`: `[heads, q_len, hd]`; `k`, `v`:
/// `[kv_heads, kv_len, hd]` with `kv_len ≥ q_len` (the queries are the last
/// `q_len` positions); query head `h` uses kv head `h / (heads / kv_heads)`.
/// Returns `[heads, q_len, hd]`, differentiable w.r.t. `q`, `k` and `v`.
/// `k` and `v` may be the first `kv_len` positions of larger buffers
/// (`narrow(1, 0, kv_len)` of `[kv_heads, capacity, hd]`: a KV cache): they
/// are read in place, not copied.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (nh, lq, hd) = q.dims3()?;
    let (nkv, lk, khd) = k.dims3()?;
    if v.dims3()? != (nkv, lk, khd) || khd != hd || nkv == 0 || nh % nkv != 0 || lk < lq {
        return Err(ModelError::InvalidInput(format!(
            "causal_attention: q {:?}, k {:?}, v {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    let op = CausalAttention {
        scale: scale as f32,
        lse: Arc::new(Mutex::new(None)),
    };
    let in_place = |t: &Tensor| -> Result<Tensor> {
        Ok(if head_strided(t.layout()).is_some() {
            t.clone()
        } else {
            t.contiguous()?
        })
    };
    Ok(q.contiguous()?
        .apply_op3(&in_place(k)?, &in_place(v)?, op)?)
}

/// For a `[heads, len, hd]` layout whose rows are contiguous within each
/// head (a contiguous tensor, or a prefix of a longer buffer along `len`):
/// the distance between heads, in elements.
fn head_strided(l: &Layout) -> Option<usize> {
    let (_, len, hd) = l.shape().dims3().ok()?;
    // A stride along a dimension of size 1 is never used (candle leaves
    // whatever the tensor came from there).
    match l.stride() {
        [hs, row, unit] if (*row == hd || len <= 1) && (*unit == 1 || hd <= 1) => Some(*hs),
        _ => None,
    }
}

/// The elements of a [`head_strided`] f32 input, from its first element to
/// its last, and its head stride.
fn strided_slice<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<(&'a [f32], usize)> {
    let msg = |m: &str| candle_core::Error::Msg(format!("attention: {what} {m}"));
    let hs = head_strided(l).ok_or_else(|| msg("rows must be contiguous within a head"))?;
    let (heads, len, hd) = l.shape().dims3()?;
    let start = l.start_offset();
    let end = if heads == 0 || len == 0 {
        start
    } else {
        start + (heads - 1) * hs + len * hd
    };
    match s {
        CpuStorage::F32(v) if end <= v.len() => Ok((&v[start..end], hs)),
        CpuStorage::F32(_) => Err(msg("is out of its storage's bounds")),
        _ => Err(msg("must be f32")),
    }
}

/// Whether [`causal_attention`] handles these inputs (f32 on the CPU).
pub fn fused_attention_supported(q: &Tensor) -> bool {
    q.device().is_cpu() && q.dtype() == DType::F32
}

struct CausalAttention {
    scale: f32,
    /// Per-row log-sum-exp of the scaled scores, `[heads·q_len]`, from the
    /// forward, for the backward.
    lse: Arc<Mutex<Option<Vec<f32>>>>,
}

/// `Σ a_i b_i` in a fixed order: 8 lane sums, then the lanes pairwise
/// (also `matmul_nt`'s portable path).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[l] += x * y;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

#[inline(always)]
pub(super) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

pub(super) struct Dims {
    pub(super) scale: f32,
    pub(super) lq: usize,
    pub(super) hd: usize,
    pub(super) lk: usize,
    pub(super) groups: usize,
    /// Elements between kv heads in `k` and in `v` (`lk·hd` when
    /// contiguous; a KV cache buffer's capacity·hd).
    pub(super) k_stride: usize,
    pub(super) v_stride: usize,
}

impl Dims {
    /// Offset in `k` of key row `j` of the kv head serving query head `h`.
    fn k_at(&self, h: usize, j: usize) -> usize {
        (h / self.groups) * self.k_stride + j * self.hd
    }
    /// Offset in `v` of value row `j` of the kv head serving query head `h`.
    fn v_at(&self, h: usize, j: usize) -> usize {
        (h / self.groups) * self.v_stride + j * self.hd
    }
    /// Absolute position of query `i`.
    pub(super) fn pos(&self, i: usize) -> usize {
        self.lk - self.lq + i
    }
}

/// One query row: output into `o`, returns the log-sum-exp. With AVX2 and
/// a head size of 32, 64, 96 or 128, explicit vectors ([`avx2_rows`]); otherwise the
/// loops below, compiled twice. Both give the same bits.
pub(super) fn row_forward(
    d: &Dims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    h: usize,
    i: usize,
    o: &mut [f32],
) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::use_avx2() {
        // Each arm: the CPU has AVX2 (checked at run time), and
        // `row_forward::<V>` asserts the lengths it reads for `d.hd = 8·V`.
        match d.hd {
            // SAFETY: see above.
            32 => return unsafe { avx2_rows::row_forward::<4>(d, q, k, v, h, i, o) },
            // SAFETY: see above.
            64 => return unsafe { avx2_rows::row_forward::<8>(d, q, k, v, h, i, o) },
            // SAFETY: see above.
            96 => return unsafe { avx2_rows::row_forward::<12>(d, q, k, v, h, i, o) },
            // SAFETY: see above.
            128 => return unsafe { avx2_rows::row_forward::<16>(d, q, k, v, h, i, o) },
            _ => {}
        }
    }
    row_forward_loops(d, q, k, v, h, i, o)
}

twice_compiled! {
    /// [`row_forward`] as plain loops.
    fn row_forward_loops / row_forward_body(d: &Dims, q: &[f32], k: &[f32], v: &[f32], h: usize, i: usize, o: &mut [f32]) -> f32
}

/// [`row_forward_body`] in AVX2 vectors for head sizes of `8·V`: the
/// query and the output row live in registers, a score is [`dot`]'s eight
/// lane sums (a multiply, then an add, per term) reduced by its tree, and
/// the output update is a multiply then an add per element — the loops'
/// operations in their order, so the same bits.
#[cfg(target_arch = "x86_64")]
mod avx2_rows {
    use std::arch::x86_64::*;

    use super::{exp, Dims, KEY_BLOCK};

    /// `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`, [`super::dot`]'s tree.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn tree(a: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)))
    }

    /// # Safety
    /// The CPU must have AVX2; `q` and `o` hold `8·V` floats and `k`, `v`
    /// the rows `d` addresses.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn row_forward<const V: usize>(
        d: &Dims,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        h: usize,
        i: usize,
        o: &mut [f32],
    ) -> f32 {
        // SAFETY: AVX2 is the caller's contract. The asserts keep every access in
        // bounds: `q` and `o` hold `hd = 8·V` floats; key (value) row `j` starts
        // at `d.k_at(h, j)` (`d.v_at(h, j)`), which grows with `j`, and the last
        // row read, `p_end - 1`, ends inside `k` (`v`).
        unsafe {
            let hd = 8 * V;
            assert!(d.hd == hd && q.len() >= hd && o.len() >= hd);
            let p_end = d.pos(i) + 1;
            assert!(d.k_at(h, p_end - 1) + hd <= k.len() && d.v_at(h, p_end - 1) + hd <= v.len());
            let qv: [__m256; V] = std::array::from_fn(|c| _mm256_loadu_ps(q.as_ptr().add(8 * c)));
            let mut acc = [_mm256_setzero_ps(); V];
            let mut m = f32::NEG_INFINITY;
            let mut l = 0f32;
            let mut s = [0f32; KEY_BLOCK];
            for b0 in (0..p_end).step_by(KEY_BLOCK) {
                let b1 = (b0 + KEY_BLOCK).min(p_end);
                let mut bm = f32::NEG_INFINITY;
                for j in b0..b1 {
                    let kp = k.as_ptr().add(d.k_at(h, j));
                    let mut a = _mm256_setzero_ps();
                    for (c, qc) in qv.iter().enumerate() {
                        a = _mm256_add_ps(a, _mm256_mul_ps(*qc, _mm256_loadu_ps(kp.add(8 * c))));
                    }
                    let x = tree(a) * d.scale;
                    s[j - b0] = x;
                    bm = bm.max(x);
                }
                let m_new = m.max(bm);
                let c = exp(m - m_new);
                l *= c;
                let cv = _mm256_set1_ps(c);
                for a in acc.iter_mut() {
                    *a = _mm256_mul_ps(*a, cv);
                }
                let s = &mut s[..b1 - b0];
                s.iter_mut().for_each(|x| *x = exp(*x - m_new));
                for (j, &p) in (b0..b1).zip(s.iter()) {
                    l += p;
                    let (pv, vp) = (_mm256_set1_ps(p), v.as_ptr().add(d.v_at(h, j)));
                    for (c, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(pv, _mm256_loadu_ps(vp.add(8 * c))));
                    }
                }
                m = m_new;
            }
            let inv = _mm256_set1_ps(1.0 / l);
            for (c, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.as_mut_ptr().add(8 * c), _mm256_mul_ps(*a, inv));
            }
            m + l.ln()
        }
    }
}

/// The online softmax of one query row over its key blocks into `o`;
/// returns the log-sum-exp.
#[inline(always)]
fn row_forward_body(
    d: &Dims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    h: usize,
    i: usize,
    o: &mut [f32],
) -> f32 {
    o.iter_mut().for_each(|x| *x = 0.0);
    let p_end = d.pos(i) + 1;
    let mut m = f32::NEG_INFINITY;
    let mut l = 0f32;
    let mut s = [0f32; KEY_BLOCK];
    for b0 in (0..p_end).step_by(KEY_BLOCK) {
        let b1 = (b0 + KEY_BLOCK).min(p_end);
        let mut bm = f32::NEG_INFINITY;
        for j in b0..b1 {
            let kj = &k[d.k_at(h, j)..d.k_at(h, j) + d.hd];
            let x = dot(q, kj) * d.scale;
            s[j - b0] = x;
            bm = bm.max(x);
        }
        let m_new = m.max(bm);
        let c = exp(m - m_new);
        l *= c;
        o.iter_mut().for_each(|x| *x *= c);
        let s = &mut s[..b1 - b0];
        s.iter_mut().for_each(|x| *x = exp(*x - m_new));
        for (j, &p) in (b0..b1).zip(s.iter()) {
            l += p;
            axpy(o, p, &v[d.v_at(h, j)..d.v_at(h, j) + d.hd]);
        }
        m = m_new;
    }
    let inv = 1.0 / l;
    o.iter_mut().for_each(|x| *x *= inv);
    m + l.ln()
}

/// What the backward's row loops read.
pub(super) struct Bwd<'a> {
    pub(super) d: &'a Dims,
    pub(super) q: &'a [f32],
    pub(super) k: &'a [f32],
    pub(super) v: &'a [f32],
    /// Upstream gradient of the output.
    pub(super) go: &'a [f32],
    pub(super) lse: &'a [f32],
    /// `D_r = dO_r · O_r`.
    pub(super) dsum: &'a [f32],
}

impl Bwd<'_> {
    /// For row `r` and keys `keys` (at most [`KEY_BLOCK`]): `p_j = exp(s_j −
    /// lse_r)` into `p` and `p_j·(dO_r·v_j − D_r)` into `g`. The scores
    /// first, then the exponentials of the whole block, so they vectorize.
    #[inline(always)]
    fn ds_block(
        &self,
        r: usize,
        keys: std::ops::Range<usize>,
        p: &mut [f32; KEY_BLOCK],
        g: &mut [f32; KEY_BLOCK],
    ) {
        let (d, hd) = (self.d, self.d.hd);
        let h = r / d.lq;
        let (qr, gor) = (
            &self.q[r * hd..(r + 1) * hd],
            &self.go[r * hd..(r + 1) * hd],
        );
        let n = keys.len();
        for (t, j) in keys.enumerate() {
            let (kj, vj) = (d.k_at(h, j), d.v_at(h, j));
            p[t] = dot(qr, &self.k[kj..kj + hd]) * d.scale - self.lse[r];
            g[t] = dot(gor, &self.v[vj..vj + hd]);
        }
        let dsum = self.dsum[r];
        for (p, g) in p[..n].iter_mut().zip(&mut g[..n]) {
            *p = exp(*p);
            *g = *p * (*g - dsum);
        }
    }

    /// [`Bwd::ds_block`] for key `j` and the rows `rows` (at most
    /// [`KEY_BLOCK`], all of one head).
    #[inline(always)]
    fn ds_rows(
        &self,
        rows: std::ops::Range<usize>,
        j: usize,
        p: &mut [f32; KEY_BLOCK],
        g: &mut [f32; KEY_BLOCK],
    ) {
        let (d, hd) = (self.d, self.d.hd);
        let n = rows.len();
        let r0 = rows.start;
        let h = r0 / d.lq;
        let (kj, vj) = (d.k_at(h, j), d.v_at(h, j));
        let (k, v) = (&self.k[kj..kj + hd], &self.v[vj..vj + hd]);
        for (t, r) in rows.enumerate() {
            p[t] = dot(&self.q[r * hd..(r + 1) * hd], k) * d.scale - self.lse[r];
            g[t] = dot(&self.go[r * hd..(r + 1) * hd], v);
        }
        let dsum = &self.dsum[r0..r0 + n];
        for ((p, g), &ds) in p[..n].iter_mut().zip(&mut g[..n]).zip(dsum) {
            *p = exp(*p);
            *g = *p * (*g - ds);
        }
    }
}

twice_compiled! {
    /// `dQ` of one query row.
    fn dq_row / dq_row_body(b: &Bwd<'_>, r: usize, dqr: &mut [f32])
}

#[inline(always)]
fn dq_row_body(b: &Bwd<'_>, r: usize, dqr: &mut [f32]) {
    let (d, hd) = (b.d, b.d.hd);
    let (h, i) = (r / d.lq, r % d.lq);
    let (mut p, mut g) = ([0f32; KEY_BLOCK], [0f32; KEY_BLOCK]);
    let end = d.pos(i) + 1;
    for b0 in (0..end).step_by(KEY_BLOCK) {
        let b1 = (b0 + KEY_BLOCK).min(end);
        b.ds_block(r, b0..b1, &mut p, &mut g);
        for (j, &gj) in (b0..b1).zip(g.iter()) {
            let kj = d.k_at(h, j);
            axpy(dqr, gj * d.scale, &b.k[kj..kj + hd]);
        }
    }
}

twice_compiled! {
    /// `dK` and `dV` of one key row.
    fn dkv_row / dkv_row_body(b: &Bwd<'_>, kr: usize, dkr: &mut [f32], dvr: &mut [f32])
}

#[inline(always)]
fn dkv_row_body(b: &Bwd<'_>, kr: usize, dkr: &mut [f32], dvr: &mut [f32]) {
    let (d, hd) = (b.d, b.d.hd);
    let (kvh, j) = (kr / d.lk, kr % d.lk);
    // Queries that see key j: absolute position ≥ j.
    let first = j.saturating_sub(d.lk - d.lq);
    let (mut p, mut g) = ([0f32; KEY_BLOCK], [0f32; KEY_BLOCK]);
    for h in kvh * d.groups..(kvh + 1) * d.groups {
        for i0 in (first..d.lq).step_by(KEY_BLOCK) {
            let i1 = (i0 + KEY_BLOCK).min(d.lq);
            let rows = h * d.lq + i0..h * d.lq + i1;
            b.ds_rows(rows.clone(), j, &mut p, &mut g);
            for (t, r) in rows.enumerate() {
                axpy(dvr, p[t], &b.go[r * hd..(r + 1) * hd]);
                axpy(dkr, g[t] * d.scale, &b.q[r * hd..(r + 1) * hd]);
            }
        }
    }
}

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "causal-attention"
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
        let q = f32_slice("attention", qs, ql, "q")?;
        let (k, k_stride) = strided_slice(ks, kl, "k")?;
        let (v, v_stride) = strided_slice(vs, vl, "v")?;
        let (nh, lq, hd) = ql.shape().dims3()?;
        let (nkv, lk, _) = kl.shape().dims3()?;
        let d = Dims {
            scale: self.scale,
            lq,
            hd,
            lk,
            groups: nh / nkv,
            k_stride,
            v_stride,
        };
        let mut out = vec![0f32; nh * lq * hd];
        let mut lse = vec![0f32; nh * lq];
        let row = |(r, (o, lse)): (usize, (&mut [f32], &mut f32))| {
            let (h, i) = (r / lq, r % lq);
            *lse = row_forward(&d, &q[r * hd..(r + 1) * hd], k, v, h, i, o);
        };
        // A decode step's few rows are not worth waking the thread pool for;
        // either way each row runs the same code, so the bits are the same.
        if nh * lq * lk * hd < SEQUENTIAL_WORK {
            out.chunks_mut(hd)
                .zip(lse.iter_mut())
                .enumerate()
                .for_each(row);
        } else {
            out.par_chunks_mut(hd)
                .zip(lse.par_iter_mut())
                .enumerate()
                .for_each(row);
        }
        *self.lse.lock().unwrap_or_else(PoisonError::into_inner) = Some(lse);
        Ok((CpuStorage::F32(out), Shape::from((nh, lq, hd))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (nh, lq, hd) = q.dims3()?;
        let (nkv, lk, _) = k.dims3()?;
        // `flat` below makes every input contiguous.
        let d = Dims {
            scale: self.scale,
            lq,
            hd,
            lk,
            groups: nh / nkv,
            k_stride: lk * hd,
            v_stride: lk * hd,
        };
        let lse = self
            .lse
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| candle_core::Error::Msg("attention: backward before forward".into()))?;
        let flat =
            |t: &Tensor| -> candle_core::Result<Vec<f32>> { t.flatten_all()?.to_vec1::<f32>() };
        let (qv, kv, vv, ov, go) = (
            flat(q)?,
            flat(k)?,
            flat(v)?,
            flat(res)?,
            flat(&grad.contiguous()?)?,
        );
        let b = Bwd {
            d: &d,
            q: &qv,
            k: &kv,
            v: &vv,
            go: &go,
            lse: &lse,
            dsum: &(0..nh * lq)
                .map(|r| dot(&go[r * hd..(r + 1) * hd], &ov[r * hd..(r + 1) * hd]))
                .collect::<Vec<f32>>(),
        };
        let mut dq = vec![0f32; nh * lq * hd];
        dq.par_chunks_mut(hd)
            .enumerate()
            .for_each(|(r, dqr)| dq_row(&b, r, dqr));
        let mut dk = vec![0f32; nkv * lk * hd];
        let mut dv = vec![0f32; nkv * lk * hd];
        dk.par_chunks_mut(hd)
            .zip(dv.par_chunks_mut(hd))
            .enumerate()
            .for_each(|(kr, (dkr, dvr))| dkv_row(&b, kr, dkr, dvr));
        let dev = q.device();
        Ok((
            Some(Tensor::from_vec(dq, (nh, lq, hd), dev)?),
            Some(Tensor::from_vec(dk, (nkv, lk, hd), dev)?),
            Some(Tensor::from_vec(dv, (nkv, lk, hd), dev)?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::{rel_err, v64};
    use candle_core::{Device, Var};

    fn rand(shape: (usize, usize, usize), seed: u64) -> Tensor {
        crate::kernels::test_util::rand_tensor(&[shape.0, shape.1, shape.2], seed)
    }

    /// The composed candle version (as `Model::attention` had it): full
    /// scores, additive causal mask, softmax, weighted values.
    fn composed(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Tensor {
        let (nh, lq, hd) = q.dims3().unwrap();
        let (nkv, lk, _) = k.dims3().unwrap();
        let g = nh / nkv;
        let pos = lk - lq;
        let qg = q.reshape((nkv, g * lq, hd)).unwrap();
        let s = qg
            .matmul(&k.t().unwrap())
            .unwrap()
            .affine(scale, 0.0)
            .unwrap();
        let mask: Vec<f64> = (0..lq)
            .flat_map(|i| (0..lk).map(move |j| if j > pos + i { f64::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (lq, lk), &Device::Cpu)
            .unwrap()
            .to_dtype(q.dtype())
            .unwrap();
        let s = s
            .reshape((nkv, g, lq, lk))
            .unwrap()
            .broadcast_add(&mask)
            .unwrap()
            .reshape((nkv, g * lq, lk))
            .unwrap();
        let p = crate::arch::model::softmax_last(&s).unwrap();
        p.matmul(v).unwrap().reshape((nh, lq, hd)).unwrap()
    }

    const NH: usize = 6;
    const NKV: usize = 2;
    const HD: usize = 12; // not a multiple of 8: exercises the remainder lanes

    #[test]
    fn causal_attention_matches_composed_values_and_gradients() {
        // 150 keys: two full key blocks and a partial one; full and chunk form.
        for (lq, lk) in [(150usize, 150usize), (37, 150), (1, 130)] {
            let q = Var::from_tensor(&rand((NH, lq, HD), 1)).unwrap();
            let k = Var::from_tensor(&rand((NKV, lk, HD), 2)).unwrap();
            let v = Var::from_tensor(&rand((NKV, lk, HD), 3)).unwrap();
            let w = rand((NH, lq, HD), 4);
            let scale = 1.0 / (HD as f64).sqrt();
            let o = causal_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), scale).unwrap();
            let to64 = |t: &Tensor| Var::from_tensor(&t.to_dtype(DType::F64).unwrap()).unwrap();
            let (q6, k6, v6) = (
                to64(q.as_tensor()),
                to64(k.as_tensor()),
                to64(v.as_tensor()),
            );
            let r = composed(q6.as_tensor(), k6.as_tensor(), v6.as_tensor(), scale);
            assert!(rel_err(&v64(&o), &v64(&r)) < 1e-5, "{lq}/{lk}: values");
            let g = (o * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let w6 = w.to_dtype(DType::F64).unwrap();
            let rg = (r * &w6).unwrap().sum_all().unwrap().backward().unwrap();
            for (name, a, b) in [("q", &q, &q6), ("k", &k, &k6), ("v", &v, &v6)] {
                let ga = v64(g.get(a.as_tensor()).unwrap());
                let gb = v64(rg.get(b.as_tensor()).unwrap());
                let e = rel_err(&ga, &gb);
                assert!(e < 1e-5, "{lq}/{lk}: d{name} relative error {e}");
            }
        }
    }

    #[test]
    fn causal_attention_gradient_matches_finite_differences() {
        let (lq, lk) = (70, 70);
        let q = Var::from_tensor(&rand((NH, lq, HD), 5)).unwrap();
        let k = Var::from_tensor(&rand((NKV, lk, HD), 6)).unwrap();
        let v = Var::from_tensor(&rand((NKV, lk, HD), 7)).unwrap();
        let w = rand((NH, lq, HD), 8);
        let f = |q: &Tensor, k: &Tensor, v: &Tensor| -> Tensor {
            let o = causal_attention(q, k, v, 0.3).unwrap();
            (o * &w).unwrap().sum_all().unwrap()
        };
        let g = f(q.as_tensor(), k.as_tensor(), v.as_tensor())
            .backward()
            .unwrap();
        let eps = 1e-2f32;
        for (which, var) in [(0, &q), (1, &k), (2, &v)] {
            let grad = v64(g.get(var.as_tensor()).unwrap());
            let base: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            for idx in [0usize, 13, base.len() / 2 + 5, base.len() - 1] {
                let eval = |delta: f32| -> f64 {
                    let mut x = base.clone();
                    x[idx] += delta;
                    let t = Tensor::from_vec(x, var.as_tensor().dims(), &Device::Cpu).unwrap();
                    let (a, b, c) = match which {
                        0 => (t, k.as_tensor().clone(), v.as_tensor().clone()),
                        1 => (q.as_tensor().clone(), t, v.as_tensor().clone()),
                        _ => (q.as_tensor().clone(), k.as_tensor().clone(), t),
                    };
                    v64(&f(&a, &b, &c))[0]
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
    fn attention_of_a_query_is_bit_identical_in_full_chunk_and_decode_form() {
        let lk = 200;
        let q = rand((NH, lk, HD), 9);
        let k = rand((NKV, lk, HD), 10);
        let v = rand((NKV, lk, HD), 11);
        let full: Vec<f32> = causal_attention(&q, &k, &v, 0.25)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let at = |o: &[f32], len: usize, h: usize, i: usize| {
            o[(h * len + i) * HD..(h * len + i + 1) * HD].to_vec()
        };
        // Prefill chunks [0,70), [70,135), [135,200) against the growing cache,
        // and single-token decode steps.
        for (start, end) in [
            (0usize, 70usize),
            (70, 135),
            (135, 200),
            (150, 151),
            (199, 200),
        ] {
            let len = end - start;
            let qc = q.narrow(1, start, len).unwrap();
            let kc = k.narrow(1, 0, end).unwrap();
            let vc = v.narrow(1, 0, end).unwrap();
            let o: Vec<f32> = causal_attention(&qc, &kc, &vc, 0.25)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            for h in 0..NH {
                for i in 0..len {
                    let a = at(&o, len, h, i);
                    let b = at(&full, lk, h, start + i);
                    assert!(
                        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "head {h} position {}: chunk [{start},{end}) differs from full",
                        start + i
                    );
                }
            }
        }
    }

    #[test]
    fn attention_is_bit_identical_across_thread_counts() {
        let q = rand((NH, 90, HD), 12);
        let k = rand((NKV, 90, HD), 13);
        let v = rand((NKV, 90, HD), 14);
        let run = |threads: usize| -> Vec<u32> {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                crate::kernels::test_util::bits(&causal_attention(&q, &k, &v, 0.25).unwrap())
            })
        };
        let one = run(1);
        assert_eq!(one, run(2));
        assert_eq!(one, run(3));
    }

    /// The explicit vectors (head sizes 32, 64, 96, 128) give the loops'
    /// bits, in both of their compilations, over more than one key block.
    #[test]
    fn the_avx2_rows_give_the_loops_bits() {
        let bits = crate::kernels::test_util::slice_bits;
        for hd in [32, 64, 96, 128] {
            let (lq, lk) = (5, 150);
            let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let q = flat(rand((2, lq, hd), 31));
            let k = flat(rand((1, lk, hd), 32));
            let v = flat(rand((1, lk, hd), 33));
            let d = Dims {
                scale: 0.125,
                lq,
                hd,
                lk,
                groups: 2,
                k_stride: lk * hd,
                v_stride: lk * hd,
            };
            for r in 0..2 * lq {
                let (h, i) = (r / lq, r % lq);
                let qr = &q[r * hd..(r + 1) * hd];
                let mut general = vec![0f32; hd];
                let a = row_forward_loops(&d, qr, &k, &v, h, i, &mut general);
                let (mut wide, mut base) = (vec![0f32; hd], vec![0f32; hd]);
                let b = row_forward(&d, qr, &k, &v, h, i, &mut wide);
                let c = row_forward_body(&d, qr, &k, &v, h, i, &mut base);
                assert_eq!(
                    (a.to_bits(), bits(&general)),
                    (b.to_bits(), bits(&wide)),
                    "hd {hd} row {r}"
                );
                assert_eq!(
                    (a.to_bits(), bits(&general)),
                    (c.to_bits(), bits(&base)),
                    "hd {hd} row {r}"
                );
            }
        }
    }

    /// The AVX2 copies of the row loops give the baseline copies' bits.
    #[test]
    fn wide_and_baseline_compilations_agree_bit_for_bit() {
        let (lq, lk) = (40, 70);
        let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let q = flat(rand((NH, lq, HD), 21));
        let k = flat(rand((NKV, lk, HD), 22));
        let v = flat(rand((NKV, lk, HD), 23));
        let go = flat(rand((NH, lq, HD), 24));
        let d = Dims {
            scale: 0.3,
            lq,
            hd: HD,
            lk,
            groups: NH / NKV,
            k_stride: lk * HD,
            v_stride: lk * HD,
        };
        let bits = crate::kernels::test_util::slice_bits;
        let (mut o1, mut o2) = (vec![0f32; HD], vec![0f32; HD]);
        let mut lse = Vec::new();
        for r in 0..NH * lq {
            let (h, i) = (r / lq, r % lq);
            let qr = &q[r * HD..(r + 1) * HD];
            // `row_forward` dispatches (AVX2 here when the CPU has it); the
            // body called directly is this test's baseline compilation.
            let a = row_forward(&d, qr, &k, &v, h, i, &mut o1);
            let b = row_forward_body(&d, qr, &k, &v, h, i, &mut o2);
            assert_eq!(
                (a.to_bits(), bits(&o1)),
                (b.to_bits(), bits(&o2)),
                "row {r}"
            );
            lse.push(a);
        }
        let b = Bwd {
            d: &d,
            q: &q,
            k: &k,
            v: &v,
            go: &go,
            lse: &lse,
            dsum: &vec![0.1; NH * lq],
        };
        for r in 0..NH * lq {
            let (mut x, mut y) = (vec![0f32; HD], vec![0f32; HD]);
            dq_row(&b, r, &mut x);
            dq_row_body(&b, r, &mut y);
            assert_eq!(bits(&x), bits(&y), "dq row {r}");
        }
        for kr in 0..NKV * lk {
            let (mut x1, mut x2) = (vec![0f32; HD], vec![0f32; HD]);
            let (mut y1, mut y2) = (vec![0f32; HD], vec![0f32; HD]);
            dkv_row(&b, kr, &mut x1, &mut y1);
            dkv_row_body(&b, kr, &mut x2, &mut y2);
            assert_eq!(
                (bits(&x1), bits(&y1)),
                (bits(&x2), bits(&y2)),
                "dk/dv row {kr}"
            );
        }
    }

    #[test]
    fn attention_rejects_mismatched_shapes() {
        let q = rand((NH, 10, HD), 1);
        let k = rand((NKV, 5, HD), 2);
        assert!(causal_attention(&q, &k, &k, 1.0).is_err());
        let k = rand((4, 10, HD), 2);
        assert!(causal_attention(&q, &k, &k, 1.0).is_err());
    }
}
