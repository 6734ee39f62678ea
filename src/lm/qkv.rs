//! One layer's q, k and v as its attention reads them: the three
//! projections, then what each family adds before RoPE — Qwen2-MoE's and
//! GLM-4.5's biases, Qwen3-MoE's and GLM-4.5's per-head and OLMoE's
//! whole-projection RMSNorms of
//! q and k, OLMoE's clamp (`clip_qkv`) — and their backward.

// Numeric code takes its shapes as arguments, as llm.c does.
#![allow(clippy::too_many_arguments)]

use std::ops::Range;

use super::config::{LmConfig, QkNorm};
use crate::math::attention::{AttnShape, RopeTable};
use crate::model::DenseOps;
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
/// backward needs, in buffers of a [`DenseOps`].
pub(super) struct Qkv<B> {
    /// q, k after their norms, clamp and rotation; v after its clamp.
    pub q: B,
    pub k: B,
    pub v: B,
    /// The q and k projections before their norms, with each row's 1/rms.
    normed: Option<NormSaved<B>>,
    /// q, k and v before the clamp.
    unclipped: Option<[B; 3]>,
}

struct NormSaved<B> {
    raw: [B; 2],
    inv: [B; 2],
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
pub(super) fn forward<O: DenseOps>(
    ops: &O,
    c: &LmConfig,
    dense: &[f32],
    r: &QkvRanges,
    n1: &O::Buf,
    shape: &AttnShape,
    rope: &RopeTable<f32>,
) -> Result<Qkv<O::Buf>, EngineError> {
    let (t, d) = (shape.seqs * shape.seq_len, c.d_model);
    let (qw, kw) = (shape.q_width(), shape.kv_width());
    let mut q = ops.zeros(t * qw)?;
    let mut k = ops.zeros(t * kw)?;
    let mut v = ops.zeros(t * kw)?;
    ops.linear_forward(&mut q, n1, &dense[r.wq.clone()], t, d, qw)?;
    ops.linear_forward(&mut k, n1, &dense[r.wk.clone()], t, d, kw)?;
    ops.linear_forward(&mut v, n1, &dense[r.wv.clone()], t, d, kw)?;
    let _span = ops.kernels().host_span("q, k, v: biases, norms, rope");
    if let Some(bias) = &r.bias {
        for (x, b) in [&mut q, &mut k, &mut v].into_iter().zip(bias) {
            ops.add_bias(x, &dense[b.clone()])?;
        }
    }
    let normed = match r.norm.as_ref() {
        None => None,
        Some(gains) => {
            let rows = norm_rows(c, shape);
            let raw = [ops.duplicate(&q)?, ops.duplicate(&k)?];
            let mut inv = [ops.zeros(rows[0].0)?, ops.zeros(rows[1].0)?];
            for (i, out) in [&mut q, &mut k].into_iter().enumerate() {
                let (n, width) = rows[i];
                let g = &dense[gains[i].clone()];
                ops.rmsnorm_forward(out, &mut inv[i], &raw[i], g, n, width, c.rms_eps)?;
            }
            Some(NormSaved { raw, inv })
        }
    };
    let unclipped = match c.clip_qkv {
        None => None,
        Some(clip) => {
            let before = [ops.duplicate(&q)?, ops.duplicate(&k)?, ops.duplicate(&v)?];
            for x in [&mut q, &mut k, &mut v] {
                ops.clamp(x, clip)?;
            }
            Some(before)
        }
    };
    ops.rope(&mut q, rope, shape.seq_len, c.heads, false)?;
    ops.rope(&mut k, rope, shape.seq_len, c.kv_heads, false)?;
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
pub(super) fn backward<O: DenseOps>(
    ops: &O,
    c: &LmConfig,
    dense: &[f32],
    dense_grad: &mut [f32],
    r: &QkvRanges,
    saved: &Qkv<O::Buf>,
    n1: &O::Buf,
    dn1: &mut O::Buf,
    mut grads: [O::Buf; 3],
    shape: &AttnShape,
    rope: &RopeTable<f32>,
) -> Result<(), EngineError> {
    let span = ops
        .kernels()
        .host_span("q, k, v backward: rope, norms, biases");
    let [dq, dk, dv] = &mut grads;
    ops.rope(dq, rope, shape.seq_len, c.heads, true)?;
    ops.rope(dk, rope, shape.seq_len, c.kv_heads, true)?;
    if let (Some(clip), Some(before)) = (c.clip_qkv, &saved.unclipped) {
        for (grad, x) in [&mut *dq, &mut *dk, &mut *dv].into_iter().zip(before) {
            ops.clamp_grad(grad, x, clip)?;
        }
    }
    if let (Some(gains), Some(n)) = (&r.norm, &saved.normed) {
        let rows = norm_rows(c, shape);
        for (i, grad) in [dq, dk].into_iter().enumerate() {
            let (count, width) = rows[i];
            let mut d_raw = ops.zeros(count * width)?;
            ops.rmsnorm_backward(
                &mut d_raw,
                &mut dense_grad[gains[i].clone()],
                grad,
                &n.raw[i],
                &dense[gains[i].clone()],
                &n.inv[i],
                count,
                width,
            )?;
            *grad = d_raw;
        }
    }
    if let Some(bias) = &r.bias {
        for (grad, b) in grads.iter().zip(bias) {
            ops.bias_grad(&mut dense_grad[b.clone()], grad)?;
        }
    }
    drop(span);
    let (t, d) = (shape.seqs * shape.seq_len, c.d_model);
    let widths = [shape.q_width(), shape.kv_width(), shape.kv_width()];
    for ((w, grad), width) in [&r.wq, &r.wk, &r.wv].into_iter().zip(&grads).zip(widths) {
        ops.linear_backward(
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
