//! [`DenseKernels`]: the heavy kernels of a network's dense layers (its
//! linear layers' GEMMs, causal attention, the cross-entropy), which a
//! backend may run on its device; [`PlainKernels`] runs them as `math`
//! writes them.

#![allow(clippy::too_many_arguments)]

use crate::math::attention::{attention_backward_split, attention_forward_split, AttnShape};
use crate::math::{cross_entropy_forward_backward_split, linear_backward, linear_forward};
use crate::parallel::compute_threads;
use crate::EngineError;

/// The dense layers' heavy kernels: the linear layers' GEMM (plain loops
/// for the reference, the backend's GEMM for the engine) and causal
/// attention (on the cpu split over sequences, unless a backend brings its
/// own: the GPU's runs it on the device).
pub trait DenseKernels {
    /// out (M, N) = x (M, K) · w (N, K)ᵀ
    fn forward(
        &self,
        out: &mut [f32],
        x: &[f32],
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError>;
    /// dx (M, K) += dout · w;  dw (N, K) += doutᵀ · x
    fn backward(
        &self,
        dx: &mut [f32],
        dw: &mut [f32],
        dout: &[f32],
        x: &[f32],
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError>;

    /// The engine's dense params (every weight later GEMMs are given as a
    /// slice of) are `dense`, just written: a backend that keeps weights
    /// on its device drops what it holds and may keep slices of `dense`
    /// until the next call.
    fn weights_changed(&self, _dense: &[f32]) {}

    /// A step's dense gradient is `grad`: until `grads_flush(grad)`, a
    /// backend may sum the weight gradients of GEMMs whose `dw` is a slice
    /// of it on its device rather than into the slice.
    fn grads_begin(&self, _grad: &[f32]) {}

    /// Adds into `grad` (the vector given to `grads_begin`) every weight
    /// gradient summed on the device since; `grad` is complete after it.
    fn grads_flush(&self, _grad: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }

    /// out (T, H·hd) = causal attention of q, k, v, each token within its
    /// document where `starts` says where documents begin (see
    /// [`attention_forward`](crate::math::attention::attention_forward));
    /// `probs` (B, H, S, S) keeps the probabilities for the backward.
    #[allow(clippy::too_many_arguments)]
    fn attention_forward(
        &self,
        out: &mut [f32],
        probs: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        attention_forward_split(out, probs, q, k, v, starts, shape, compute_threads());
        Ok(())
    }

    /// dq, dk, dv (zeroed by the caller) = the gradients of
    /// `attention_forward` from dout.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        dout: &[f32],
        probs: &[f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        attention_backward_split(dq, dk, dv, dout, probs, q, k, v, shape, compute_threads());
        Ok(())
    }

    /// Cross-entropy of `logits` (T, V) against `targets`, summed over
    /// rows and divided by `denominator`; writes d logits.
    fn cross_entropy(
        &self,
        dlogits: &mut [f32],
        logits: &[f32],
        targets: &[u32],
        v: usize,
        denominator: usize,
    ) -> Result<f32, EngineError> {
        Ok(cross_entropy_forward_backward_split(
            dlogits,
            logits,
            targets,
            v,
            denominator,
            compute_threads(),
        ))
    }
}

/// `math::linear_forward` / `linear_backward`, as written.
pub struct PlainKernels;

impl DenseKernels for PlainKernels {
    fn forward(
        &self,
        out: &mut [f32],
        x: &[f32],
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        linear_forward(out, x, w, m, k, n);
        Ok(())
    }

    fn backward(
        &self,
        dx: &mut [f32],
        dw: &mut [f32],
        dout: &[f32],
        x: &[f32],
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        linear_backward(dx, dw, dout, x, w, m, k, n);
        Ok(())
    }
}
