//! [`TimedKernels`]: a network's dense kernels with each call recorded on
//! the engine's timeline (category `"dense"`), so that a step's timeline
//! shows its GEMMs, attention and head beside the expert loops and waits,
//! and the gaps between them on the main thread are the host's own
//! passes (norms, the router's softmax, the permutation). The engine wraps
//! its kernels in it only when it records a timeline.

use std::sync::Arc;

use strata_tiers::{Timeline, TimelineSpan};

use super::{DenseKernels, HeadShape};
use crate::math::attention::AttnShape;
use crate::EngineError;

pub struct TimedKernels {
    inner: Arc<dyn DenseKernels + Send + Sync>,
    timeline: Arc<Timeline>,
}

impl TimedKernels {
    pub fn new(inner: Arc<dyn DenseKernels + Send + Sync>, timeline: Arc<Timeline>) -> Self {
        Self { inner, timeline }
    }

    fn span(&self, name: &'static str) -> TimelineSpan<'_> {
        TimelineSpan::start(Some(&self.timeline), "dense", name)
    }
}

impl DenseKernels for TimedKernels {
    fn narrow_kernels(&self) -> &dyn DenseKernels {
        self.inner.narrow_kernels()
    }

    fn host_span(&self, name: &'static str) -> TimelineSpan<'_> {
        TimelineSpan::start(Some(&self.timeline), "host", name)
    }

    fn timeline(&self) -> Option<&Arc<Timeline>> {
        Some(&self.timeline)
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
        let _span = self.span("gemm").with_detail(|| format!("{m}×{k}×{n}"));
        self.inner.forward(out, x, w, m, k, n)
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
        let _span = self
            .span("gemm backward")
            .with_detail(|| format!("{m}×{k}×{n}"));
        self.inner.backward(dx, dw, dout, x, w, m, k, n)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self) -> Option<&crate::backend::cuda::CudaBackend> {
        self.inner.cuda()
    }

    fn weights_changed(&self, dense: &[f32]) {
        self.inner.weights_changed(dense)
    }

    fn grads_begin(&self, grad: &[f32]) {
        self.inner.grads_begin(grad)
    }

    fn grads_on_device(&self) -> bool {
        self.inner.grads_on_device()
    }

    fn grads_flush(&self, grad: &mut [f32]) -> Result<(), EngineError> {
        let _span = self.span("dense gradients");
        self.inner.grads_flush(grad)
    }

    fn pcie_other_bytes(&self) -> u64 {
        self.inner.pcie_other_bytes()
    }

    fn residence(&self) -> Option<&dyn super::DenseResidence> {
        self.inner.residence()
    }

    fn attention_saved_len(&self, shape: &AttnShape) -> usize {
        self.inner.attention_saved_len(shape)
    }

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
        let _span = self.span("attention");
        self.inner
            .attention_forward(out, saved, q, k, v, starts, shape)
    }

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
        let _span = self.span("attention backward");
        self.inner
            .attention_backward(dq, dk, dv, dout, saved, q, k, v, starts, shape)
    }

    fn cross_entropy(
        &self,
        dlogits: &mut [f32],
        logits: &[f32],
        targets: &[u32],
        v: usize,
        denominator: usize,
    ) -> Result<f32, EngineError> {
        let _span = self.span("cross-entropy");
        self.inner
            .cross_entropy(dlogits, logits, targets, v, denominator)
    }

    fn head_loss(
        &self,
        dx: &mut [f32],
        dhead: &mut [f32],
        x: &[f32],
        head: &[f32],
        targets: &[u32],
        s: HeadShape,
    ) -> Result<f32, EngineError> {
        let _span = self
            .span("head and loss")
            .with_detail(|| format!("{}×{}×{}", s.t, s.d, s.v));
        self.inner.head_loss(dx, dhead, x, head, targets, s)
    }
}
