//! A decoder layer's first half, `h ← h + Wo·Attn(RoPE(q), RoPE(k), v)`
//! of `RMSNorm(h)`, forward and backward, on the activations of a
//! [`DenseOps`] (host memory on the cpu, GPU memory on a GPU): the
//! layer's RMSNorm, its q, k and v (`qkv`), causal grouped-query
//! attention, the output projection and the residual add.

// Numeric code takes its shapes as arguments, as llm.c does.
#![allow(clippy::too_many_arguments)]

use std::ops::Range;

use super::config::LmConfig;
use super::qkv::{self, Qkv, QkvRanges};
use crate::math::attention::{AttnShape, RopeTable};
use crate::model::DenseOps;
use crate::EngineError;

/// Where one layer's attention half is in the dense vector.
#[derive(Clone, Debug)]
pub(super) struct AttentionRanges {
    /// The input RMSNorm's gain.
    pub norm: Range<usize>,
    pub qkv: QkvRanges,
    pub wo: Range<usize>,
}

/// What the forward keeps for the backward.
pub(super) struct AttentionSaved<B> {
    h_in: B,
    n1: B,
    inv1: B,
    qkv: Qkv<B>,
    /// What the attention kernels keep for the backward (the
    /// probabilities on the cpu, each row's softmax statistics on a GPU).
    attn_saved: B,
    attn: B,
}

/// `h += Wo·Attn(…)` of `RMSNorm(h)`, each token attending within its
/// document where `starts` says where documents begin.
pub(super) fn forward<O: DenseOps>(
    ops: &O,
    c: &LmConfig,
    dense: &[f32],
    r: &AttentionRanges,
    h: &mut O::Buf,
    starts: Option<&[u32]>,
    shape: &AttnShape,
    rope: &RopeTable<f32>,
) -> Result<AttentionSaved<O::Buf>, EngineError> {
    let (t, d, qw) = (shape.tokens(), c.d_model, shape.q_width());
    let span = ops.kernels().host_span("rmsnorm");
    let mut n1 = ops.zeros(t * d)?;
    let mut inv1 = ops.zeros(t)?;
    let g1 = &dense[r.norm.clone()];
    ops.rmsnorm_forward(&mut n1, &mut inv1, h, g1, t, d, c.rms_eps)?;
    drop(span);
    let qkv = qkv::forward(ops, c, dense, &r.qkv, &n1, shape, rope)?;
    let mut attn = ops.zeros(t * qw)?;
    let mut attn_saved = ops.zeros(ops.attention_saved_len(shape))?;
    let [q, k, v] = [&qkv.q, &qkv.k, &qkv.v];
    ops.attention_forward(&mut attn, &mut attn_saved, q, k, v, starts, shape)?;
    let mut o = ops.zeros(t * d)?;
    ops.linear_forward(&mut o, &attn, &dense[r.wo.clone()], t, qw, d)?;
    let _span = ops.kernels().host_span("residual");
    let h_in = ops.duplicate(h)?;
    ops.add_assign(h, &o)?;
    Ok(AttentionSaved {
        h_in,
        n1,
        inv1,
        qkv,
        attn_saved,
        attn,
    })
}

/// The backward of [`forward`]: dh (the gradient of its output) += the
/// gradient of its input, and the dense gradients (`dense_grad`, laid out
/// as `dense`) of its norm, projections and q, k, v extras.
pub(super) fn backward<O: DenseOps>(
    ops: &O,
    c: &LmConfig,
    (dense, dense_grad): (&[f32], &mut [f32]),
    r: &AttentionRanges,
    s: &AttentionSaved<O::Buf>,
    dh: &mut O::Buf,
    starts: Option<&[u32]>,
    shape: &AttnShape,
    rope: &RopeTable<f32>,
) -> Result<(), EngineError> {
    let (t, d) = (shape.tokens(), c.d_model);
    let (qw, kw) = (shape.q_width(), shape.kv_width());
    let mut dattn = ops.zeros(t * qw)?;
    let wo = r.wo.clone();
    ops.linear_backward(
        &mut dattn,
        &mut dense_grad[wo.clone()],
        dh,
        &s.attn,
        &dense[wo],
        t,
        qw,
        d,
    )?;
    let mut dq = ops.zeros(t * qw)?;
    let mut dk = ops.zeros(t * kw)?;
    let mut dv = ops.zeros(t * kw)?;
    let qkv = &s.qkv;
    ops.attention_backward(
        [&mut dq, &mut dk, &mut dv],
        &dattn,
        &s.attn_saved,
        [&qkv.q, &qkv.k, &qkv.v],
        starts,
        shape,
    )?;
    drop(dattn);
    let mut dn1 = ops.zeros(t * d)?;
    qkv::backward(
        ops,
        c,
        dense,
        dense_grad,
        &r.qkv,
        qkv,
        &s.n1,
        &mut dn1,
        [dq, dk, dv],
        shape,
        rope,
    )?;
    let _span = ops.kernels().host_span("rmsnorm backward");
    let g = r.norm.clone();
    ops.rmsnorm_backward(
        dh,
        &mut dense_grad[g.clone()],
        &dn1,
        &s.h_in,
        &dense[g],
        &s.inv1,
        t,
        d,
    )
}
