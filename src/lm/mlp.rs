//! A SwiGLU MLP on dense tensors, `W_down (silu(W_gate_proj x) ⊙ W_up x)`:
//! Qwen2-MoE's shared expert, which every token goes through beside its
//! routed experts, scaled by a sigmoid gate of the token
//! (`σ(x · w_gate)`), and the Qwen families' dense layers, ungated. Its
//! weights stay on the device with the rest of the dense params, and its
//! GEMMs run through the dense kernels.

// Numeric code takes its shapes as arguments, as llm.c does.
#![allow(clippy::too_many_arguments)]

use std::ops::Range;

use crate::math::{sigmoid, silu, silu_grad};
use crate::model::DenseKernels;
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

/// What the forward keeps for the backward.
pub(super) struct MlpSaved {
    a: Vec<f32>,
    b: Vec<f32>,
    h: Vec<f32>,
    /// The ungated output, kept where a gate scales it; empty when ungated.
    out: Vec<f32>,
    /// Each token's gate, σ(x · w_gate); empty when ungated.
    sig: Vec<f32>,
}

/// Adds the MLP's output for the `t` rows of `x` (t, d) to `y`.
pub(super) fn forward(
    dense: &[f32],
    r: &MlpRanges,
    x: &[f32],
    y: &mut [f32],
    t: usize,
    d: usize,
    f: usize,
    kernels: &dyn DenseKernels,
) -> Result<MlpSaved, EngineError> {
    let mut a = vec![0.0f32; t * f];
    let mut b = vec![0.0f32; t * f];
    kernels.forward(&mut a, x, &dense[r.gate.clone()], t, d, f)?;
    kernels.forward(&mut b, x, &dense[r.up.clone()], t, d, f)?;
    let h: Vec<f32> = a.iter().zip(&b).map(|(&a, &b)| silu(a) * b).collect();
    let mut out = vec![0.0f32; t * d];
    kernels.forward(&mut out, &h, &dense[r.down.clone()], t, f, d)?;
    let sig = match &r.scale {
        Some(scale) => {
            let mut sig = vec![0.0f32; t];
            kernels.forward(&mut sig, x, &dense[scale.clone()], t, d, 1)?;
            sig.iter_mut().for_each(|s| *s = sigmoid(*s));
            for ((y, o), &s) in y.chunks_exact_mut(d).zip(out.chunks_exact(d)).zip(&sig) {
                y.iter_mut().zip(o).for_each(|(y, o)| *y += s * o);
            }
            sig
        }
        None => {
            y.iter_mut().zip(&out).for_each(|(y, o)| *y += o);
            Vec::new()
        }
    };
    // The output is the gate's backward's alone.
    let out = if sig.is_empty() { Vec::new() } else { out };
    Ok(MlpSaved { a, b, h, out, sig })
}

/// The backward from `dy` (t, d): adds to `dx` and to the four tensors'
/// dense gradients.
pub(super) fn backward(
    dense: &[f32],
    dense_grad: &mut [f32],
    r: &MlpRanges,
    saved: &MlpSaved,
    x: &[f32],
    dx: &mut [f32],
    dy: &[f32],
    t: usize,
    d: usize,
    f: usize,
    kernels: &dyn DenseKernels,
) -> Result<(), EngineError> {
    let s = saved;
    // Gated, y = σ(z) · out: dz = σ(1 − σ) · ⟨dy, out⟩, dout = σ · dy.
    let mut dz = vec![0.0f32; t];
    let mut gated = Vec::new();
    let dout = match r.scale {
        None => dy,
        Some(_) => {
            gated.resize(t * d, 0.0f32);
            for i in 0..t {
                let (dyi, oi) = (&dy[i * d..(i + 1) * d], &s.out[i * d..(i + 1) * d]);
                let dot: f32 = dyi.iter().zip(oi).map(|(g, o)| g * o).sum();
                let sig = s.sig[i];
                dz[i] = sig * (1.0 - sig) * dot;
                gated[i * d..(i + 1) * d]
                    .iter_mut()
                    .zip(dyi)
                    .for_each(|(o, g)| *o = sig * g);
            }
            &gated[..]
        }
    };
    let mut dh = vec![0.0f32; t * f];
    let down = r.down.clone();
    kernels.backward(
        &mut dh,
        &mut dense_grad[down.clone()],
        dout,
        &s.h,
        &dense[down],
        t,
        f,
        d,
    )?;
    let da: Vec<f32> = (0..t * f)
        .map(|i| dh[i] * s.b[i] * silu_grad(s.a[i]))
        .collect();
    let db: Vec<f32> = (0..t * f).map(|i| dh[i] * silu(s.a[i])).collect();
    let gate = r.scale.as_ref().map(|scale| (scale, &dz, 1));
    for (w, grad, width) in [(&r.gate, &da, f), (&r.up, &db, f)].into_iter().chain(gate) {
        kernels.backward(
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
