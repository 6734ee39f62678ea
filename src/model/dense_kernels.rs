//! [`DenseKernels`]: the heavy kernels of a network's dense layers (its
//! linear layers' GEMMs, causal attention, the cross-entropy), which a
//! backend may run on its device; [`PlainKernels`] runs them as `math`
//! writes them.

#![allow(clippy::too_many_arguments)]

use crate::math::attention::AttnShape;
use crate::math::attention_rows::{self, attention_rows_backward, attention_rows_forward, Kept};
use crate::math::{cross_entropy_forward_backward_split, linear_backward, linear_forward};
use crate::parallel::compute_threads;
use crate::EngineError;
use strata_tiers::TimelineSpan;

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

    /// The kernels for GEMMs with a narrow output (the router's logits,
    /// (T × E) for a handful of experts): here these kernels; a GPU leaves
    /// them to the host's cpu GEMMs, whose product costs less than the
    /// copies of its (T × D) input and gradient would.
    fn narrow_kernels(&self) -> &dyn DenseKernels;

    /// A span of the host's own work between kernel calls (a norm, the
    /// residual adds, the routing, the permutation), named `name` on the
    /// engine's timeline (category `"host"`) until dropped, where the
    /// kernels record one ([`super::TimedKernels`]); here nothing.
    fn host_span(&self, name: &'static str) -> TimelineSpan<'_> {
        TimelineSpan::start(None, "host", name)
    }

    /// The timeline these kernels record on, where they record one
    /// ([`super::TimedKernels`]): a GPU's operations put their own times
    /// there too. Here none.
    fn timeline(&self) -> Option<&std::sync::Arc<strata_tiers::Timeline>> {
        None
    }

    /// The GPU these kernels run on, whose [`crate::backend::cuda::CudaOps`]
    /// keep a network's dense activations in its memory; `None` where a
    /// network keeps them in host memory ([`super::HostOps`]).
    #[cfg(feature = "cuda")]
    fn cuda(&self) -> Option<&crate::backend::cuda::CudaBackend> {
        None
    }

    /// The engine's dense params (every weight later GEMMs are given as a
    /// slice of) are `dense`, just written: a backend that keeps weights
    /// on its device drops what it holds and may keep slices of `dense`
    /// until the next call.
    fn weights_changed(&self, _dense: &[f32]) {}

    /// A step's dense gradient is `grad`: until `grads_flush(grad)`, a
    /// backend may sum the weight gradients of GEMMs whose `dw` is a slice
    /// of it on its device rather than into the slice.
    fn grads_begin(&self, _grad: &[f32]) {}

    /// Whether, after `grads_begin`, this backend sums weight gradients on
    /// its device: the host's slice of one is then not its sum before
    /// `grads_flush`, whatever the backward has passed.
    fn grads_on_device(&self) -> bool {
        false
    }

    /// Adds into `grad` (the vector given to `grads_begin`) every weight
    /// gradient summed on the device since; `grad` is complete after it.
    fn grads_flush(&self, _grad: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }

    /// The dense params these kernels keep and step in their device's
    /// memory, where they do (a GPU's); `None`: the engine keeps and
    /// steps them all on the host.
    fn residence(&self) -> Option<&dyn super::DenseResidence> {
        None
    }

    /// Bytes this backend copied between host and device memory other
    /// than expert params and gradients (activations, dense weights and
    /// their gradients, indices), since it was opened; 0 where compute and
    /// memory are the host's.
    fn pcie_other_bytes(&self) -> u64 {
        0
    }

    /// The f32 values [`DenseKernels::attention_forward`] keeps for the
    /// backward at `shape`: the probabilities (B, H, S, S) where they take
    /// at most `attention_rows::KEPT_PROBABILITIES_MAX_BYTES`, else each
    /// query row's softmax max and sum (2·B·H·S), from which the backward
    /// recomputes them (`math::attention_rows`; a GPU keeps the latter).
    fn attention_saved_len(&self, shape: &AttnShape) -> usize {
        attention_rows::saved_len(shape)
    }

    /// out (T, H·hd) = causal attention of q, k, v, each token within its
    /// document where `starts` says where documents begin (see
    /// [`attention_forward`](crate::math::attention::attention_forward));
    /// `saved` (`attention_saved_len` values) keeps what the backward needs.
    #[allow(clippy::too_many_arguments)]
    fn attention_forward(
        &self,
        out: &mut [f32],
        saved: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        let kept = Kept::at(shape);
        let threads = compute_threads();
        attention_rows_forward(out, saved, kept, (q, k, v), starts, shape, threads);
        Ok(())
    }

    /// dq, dk, dv (zeroed by the caller) = the gradients of
    /// `attention_forward` from dout, given what it saved and the same
    /// `starts`.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        dout: &[f32],
        saved: &[f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        let (kept, threads) = (Kept::at(shape), compute_threads());
        let grads = [dq, dk, dv];
        attention_rows_backward(grads, dout, saved, kept, (q, k, v), starts, shape, threads);
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

    /// A language model's head and loss, forward and backward in one:
    /// logits (T, V) = x (T, D) · headᵀ, their cross-entropy against
    /// `targets` as [`DenseKernels::cross_entropy`] computes it (the
    /// returned loss), dx (T, D) = d logits · head (overwritten) and
    /// dhead (V, D) += d logitsᵀ · x. Here the plain sequence of those three calls, the
    /// oracle; a backend may go a block of rows at a time so that the
    /// (T × V) logits never exist whole, nor leave its device.
    fn head_loss(
        &self,
        dx: &mut [f32],
        dhead: &mut [f32],
        x: &[f32],
        head: &[f32],
        targets: &[u32],
        s: HeadShape,
    ) -> Result<f32, EngineError> {
        let HeadShape { t, d, v, .. } = s;
        let mut logits = vec![0.0f32; t * v];
        self.forward(&mut logits, x, head, t, d, v)?;
        let mut dlogits = vec![0.0f32; t * v];
        let loss = self.cross_entropy(&mut dlogits, &logits, targets, v, s.denominator)?;
        drop(logits);
        dx.fill(0.0);
        self.backward(dx, dhead, &dlogits, x, head, t, d, v)?;
        Ok(loss)
    }
}

/// The shape of [`DenseKernels::head_loss`]: T tokens of width D, a
/// vocabulary of V, the loss summed over rows and divided by `denominator`.
#[derive(Clone, Copy, Debug)]
pub struct HeadShape {
    pub t: usize,
    pub d: usize,
    pub v: usize,
    pub denominator: usize,
}

/// `math::linear_forward` / `linear_backward`, as written.
pub struct PlainKernels;

impl DenseKernels for PlainKernels {
    fn narrow_kernels(&self) -> &dyn DenseKernels {
        self
    }

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
