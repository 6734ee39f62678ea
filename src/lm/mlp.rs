//! A SwiGLU MLP on dense tensors, `W_down (silu(W_gate_proj x) ⊙ W_up x)`:
//! Qwen2-MoE's shared expert, which every token goes through beside its
//! routed experts, scaled by a sigmoid gate of the token
//! (`σ(x · w_gate)`), and the Qwen families' dense layers, ungated. It
//! runs on the network's [`DenseOps`], its activations where the others
//! are (in GPU memory on a GPU).

// Numeric code takes its shapes as arguments, as llm.c does.
#![allow(clippy::too_many_arguments)]

use std::ops::Range;

use crate::model::DenseOps;
use crate::EngineError;

/// Where one MLP is in the dense vector.
#[derive(Clone, Debug)]
pub(super) struct MlpRanges {
    /// `gate_proj`, `up_proj` (F, D) and `down_proj` (D, F).
    pub gate: Range<usize>,
    pub up: Range<usize>,
    pub down: Range<usize>,
    /// A shared expert's `shared_expert_gate` (1, D); `None`: ungated.
    pub scale: Option<Range<usize>>,
}

/// What the forward keeps for the backward, in buffers of a [`DenseOps`].
pub(super) struct MlpSaved<B> {
    a: B,
    b: B,
    h: B,
    /// Where a gate scales the output: the ungated output and each
    /// token's gate, σ(x · w_gate).
    gated: Option<(B, B)>,
}

/// Adds the MLP's output for the `t` rows of `x` (t, d) to `y`.
pub(super) fn forward<O: DenseOps>(
    ops: &O,
    dense: &[f32],
    r: &MlpRanges,
    x: &O::Buf,
    y: &mut O::Buf,
    (t, d, f): (usize, usize, usize),
) -> Result<MlpSaved<O::Buf>, EngineError> {
    let mut a = ops.zeros(t * f)?;
    let mut b = ops.zeros(t * f)?;
    ops.linear_forward(&mut a, x, &dense[r.gate.clone()], t, d, f)?;
    ops.linear_forward(&mut b, x, &dense[r.up.clone()], t, d, f)?;
    let h = ops.swiglu(&a, &b)?;
    let mut out = ops.zeros(t * d)?;
    ops.linear_forward(&mut out, &h, &dense[r.down.clone()], t, f, d)?;
    let gated = match &r.scale {
        Some(scale) => {
            let mut sig = ops.zeros(t)?;
            ops.linear_forward(&mut sig, x, &dense[scale.clone()], t, d, 1)?;
            ops.sigmoid(&mut sig)?;
            ops.add_scaled_rows(y, &out, &sig)?;
            Some((out, sig))
        }
        None => {
            ops.add_assign(y, &out)?;
            None
        }
    };
    Ok(MlpSaved { a, b, h, gated })
}

/// The backward from `dy` (t, d): adds to `dx` and to the four tensors'
/// dense gradients.
pub(super) fn backward<O: DenseOps>(
    ops: &O,
    (dense, dense_grad): (&[f32], &mut [f32]),
    r: &MlpRanges,
    s: &MlpSaved<O::Buf>,
    (x, dx, dy): (&O::Buf, &mut O::Buf, &O::Buf),
    (t, d, f): (usize, usize, usize),
) -> Result<(), EngineError> {
    // Gated, y = σ(z) · out: dz = σ(1 − σ) · ⟨dy, out⟩, dout = σ · dy.
    let gate_grads = match &s.gated {
        Some((out, sig)) => Some(ops.gate_backward(dy, out, sig)?),
        None => None,
    };
    let dout = gate_grads.as_ref().map_or(dy, |(_, dout)| dout);
    let mut dh = ops.zeros(t * f)?;
    let down = r.down.clone();
    ops.linear_backward(
        &mut dh,
        &mut dense_grad[down.clone()],
        dout,
        &s.h,
        &dense[down],
        t,
        f,
        d,
    )?;
    let (da, db) = ops.swiglu_backward(&dh, &s.a, &s.b)?;
    let gate = r
        .scale
        .as_ref()
        .zip(gate_grads.as_ref())
        .map(|(scale, (dz, _))| (scale, dz, 1));
    for (w, grad, width) in [(&r.gate, &da, f), (&r.up, &db, f)].into_iter().chain(gate) {
        ops.linear_backward(
            dx,
            &mut dense_grad[w.clone()],
            grad,
            x,
            &dense[w.clone()],
            t,
            d,
            width,
        )?;
    }
    Ok(())
}
