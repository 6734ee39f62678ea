//! One layer's q, k and v as its attention reads them: the three
//! projections, then what each family adds before RoPE — Qwen2-MoE's and
//! GLM-4.5's biases, Qwen3-MoE's and GLM-4.5's per-head and OLMoE's
//! whole-projection RMSNorms of
//! q and k, OLMoE's clamp (`clip_qkv`) — and their backward.

// Numeric code takes its shapes as arguments, as llm.c does.
#![allow(clippy::too_many_arguments)]

use std::ops::Range;

use super::config::{LmConfig, QkNorm};
use crate::math::attention::{rope_backward, rope_forward, AttnShape, RopeTable};
use crate::math::{rmsnorm_backward, rmsnorm_forward};
use crate::model::DenseKernels;
use crate::EngineError;

/// Where one layer's q/k/v tensors are in the dense vector.
#[derive(Clone, Debug)]
pub(super) struct QkvRanges {
    pub wq: Range<usize>,
    pub wk: Range<usize>,
    pub wv: Range<usize>,
    /// The q, k and v biases (Qwen2-MoE).
    pub bias: Option<[Range<usize>; 3]>,
    /// The q and k norms' gains (Qwen3-MoE, OLMoE).
    pub norm: Option<[Range<usize>; 2]>,
}

/// One layer's q, k and v as its attention reads them, and what their
/// backward needs.
pub(super) struct Qkv {
    /// q, k after their norms, clamp and rotation; v after its clamp.
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// The q and k projections before their norms, with each row's 1/rms.
    normed: Option<NormSaved>,
    /// q, k and v before the clamp.
    unclipped: Option<[Vec<f32>; 3]>,
}

struct NormSaved {
    raw: [Vec<f32>; 2],
    inv: [Vec<f32>; 2],
}

/// (rows, width) of the q norm and of the k norm: a row a head
/// (Qwen3-MoE), or a row a token over the whole projection (OLMoE).
fn norm_rows(c: &LmConfig, shape: &AttnShape) -> [(usize, usize); 2] {
    let t = shape.seqs * shape.seq_len;
    match c.qk_norm {
        QkNorm::PerHead => [(t * c.heads, c.head_dim), (t * c.kv_heads, c.head_dim)],
        QkNorm::Whole | QkNorm::None => [(t, shape.q_width()), (t, shape.kv_width())],
    }
}

/// q, k and v from the layer's normed input `n1`.
pub(super) fn forward(
    c: &LmConfig,
    dense: &[f32],
    r: &QkvRanges,
    n1: &[f32],
    shape: &AttnShape,
    rope: &RopeTable<f32>,
    kernels: &dyn DenseKernels,
) -> Result<Qkv, EngineError> {
    let (t, d) = (shape.seqs * shape.seq_len, c.d_model);
    let (qw, kw) = (shape.q_width(), shape.kv_width());
    let mut q = vec![0.0f32; t * qw];
    let mut k = vec![0.0f32; t * kw];
    let mut v = vec![0.0f32; t * kw];
    kernels.forward(&mut q, n1, &dense[r.wq.clone()], t, d, qw)?;
    kernels.forward(&mut k, n1, &dense[r.wk.clone()], t, d, kw)?;
    kernels.forward(&mut v, n1, &dense[r.wv.clone()], t, d, kw)?;
    let _span = kernels.host_span("q, k, v: biases, norms, rope");
    if let Some(bias) = &r.bias {
        for (x, b) in [&mut q, &mut k, &mut v].into_iter().zip(bias) {
            let b = &dense[b.clone()];
            for row in x.chunks_exact_mut(b.len()) {
                row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
            }
        }
    }
    let normed = r.norm.as_ref().map(|gains| {
        let rows = norm_rows(c, shape);
        let raw = [q.clone(), k.clone()];
        let mut inv = [vec![0.0f32; rows[0].0], vec![0.0f32; rows[1].0]];
        for (i, out) in [&mut q, &mut k].into_iter().enumerate() {
            let (n, width) = rows[i];
            let g = &dense[gains[i].clone()];
            rmsnorm_forward(out, &mut inv[i], &raw[i], g, n, width, c.rms_eps);
        }
        NormSaved { raw, inv }
    });
    let unclipped = c.clip_qkv.map(|clip| {
        let before = [q.clone(), k.clone(), v.clone()];
        for x in [&mut q, &mut k, &mut v] {
            x.iter_mut().for_each(|x| *x = x.clamp(-clip, clip));
        }
        before
    });
    rope_forward(&mut q, rope, shape.seq_len, c.heads);
    rope_forward(&mut k, rope, shape.seq_len, c.kv_heads);
    Ok(Qkv {
        q,
        k,
        v,
        normed,
        unclipped,
    })
}

/// The backward of `forward` from the attention's `dq`, `dk`, `dv` (the
/// gradients of what it read) to `dn1`, which it adds to, and the dense
/// gradients of the projections, biases and norms. A clamped element
/// passes no gradient (as torch's clamp, whose bounds pass it).
pub(super) fn backward(
    c: &LmConfig,
    dense: &[f32],
    dense_grad: &mut [f32],
    r: &QkvRanges,
    saved: &Qkv,
    n1: &[f32],
    dn1: &mut [f32],
    mut grads: [Vec<f32>; 3],
    shape: &AttnShape,
    rope: &RopeTable<f32>,
    kernels: &dyn DenseKernels,
) -> Result<(), EngineError> {
    let span = kernels.host_span("q, k, v backward: rope, norms, biases");
    let [dq, dk, dv] = &mut grads;
    rope_backward(dq, rope, shape.seq_len, c.heads);
    rope_backward(dk, rope, shape.seq_len, c.kv_heads);
    if let (Some(clip), Some(before)) = (c.clip_qkv, &saved.unclipped) {
        for (grad, x) in [&mut *dq, &mut *dk, &mut *dv].into_iter().zip(before) {
            for (g, &x) in grad.iter_mut().zip(x) {
                if !(-clip..=clip).contains(&x) {
                    *g = 0.0;
                }
            }
        }
    }
    if let (Some(gains), Some(n)) = (&r.norm, &saved.normed) {
        let rows = norm_rows(c, shape);
        for (i, grad) in [dq, dk].into_iter().enumerate() {
            let (count, width) = rows[i];
            let mut d_raw = vec![0.0f32; grad.len()];
            rmsnorm_backward(
                &mut d_raw,
                &mut dense_grad[gains[i].clone()],
                grad,
                &n.raw[i],
                &dense[gains[i].clone()],
                &n.inv[i],
                count,
                width,
            );
            *grad = d_raw;
        }
    }
    if let Some(bias) = &r.bias {
        for (grad, b) in grads.iter().zip(bias) {
            let db = &mut dense_grad[b.clone()];
            for row in grad.chunks_exact(db.len()) {
                db.iter_mut().zip(row).for_each(|(d, g)| *d += g);
            }
        }
    }
    drop(span);
    let (t, d) = (shape.seqs * shape.seq_len, c.d_model);
    for (w, grad) in [&r.wq, &r.wk, &r.wv].into_iter().zip(&grads) {
        let width = grad.len() / t.max(1);
        kernels.backward(
            dn1,
            &mut dense_grad[w.clone()],
            grad,
            n1,
            &dense[w.clone()],
            t,
            d,
            width,
        )?;
    }
    Ok(())
}
