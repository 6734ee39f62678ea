//! The attention on host slices (`DenseKernels`' attention, and what the
//! tests compare with the cpu): q, k, v (and d out, the statistics, the
//! gradients) uploaded, the device functions of `attention.rs`, the
//! results downloaded.

use super::attention::{attention_stats_len, ATTENTION_BLOCK_BYTES};
use super::expert::GradStart;
use super::CudaBackend;
use crate::math::attention::AttnShape;
use crate::EngineError;

impl CudaBackend {
    /// `math::attention::attention_forward` on the GPU, into `out` and the
    /// rows' softmax statistics (`attention_stats_len` values).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_forward_host(
        &self,
        out_host: &mut [f32],
        stats_host: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        self.attention_forward_blocks(
            out_host,
            stats_host,
            [q, k, v],
            starts,
            shape,
            ATTENTION_BLOCK_BYTES,
        )
    }

    /// As `attention_forward_host`, blocks of query rows whose scores fit
    /// in `block_bytes`.
    pub fn attention_forward_blocks(
        &self,
        out_host: &mut [f32],
        stats_host: &mut [f32],
        [q, k, v]: [&[f32]; 3],
        starts: Option<&[u32]>,
        shape: &AttnShape,
        block_bytes: usize,
    ) -> Result<(), EngineError> {
        assert_eq!(stats_host.len(), attention_stats_len(shape));
        assert_eq!(out_host.len(), shape.tokens() * shape.q_width());
        self.bind()?;
        let qkv = [self.upload(q)?, self.upload(k)?, self.upload(v)?];
        let mut out = self.zeros(out_host.len())?;
        let mut stats = self.zeros(stats_host.len())?;
        let [q, k, v] = &qkv;
        let starts = self.attention_starts(starts, shape)?;
        self.attention_forward_device(
            &mut out,
            &mut stats,
            [q, k, v],
            &starts,
            shape,
            block_bytes,
        )?;
        self.download(&out, out_host)?;
        self.download(&stats, stats_host)
    }

    /// `math::attention::attention_backward` on the GPU from the forward's
    /// statistics and the same `starts`: dq, dk, dv accumulate.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward_host(
        &self,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        dout: &[f32],
        stats: &[f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        let grads = [dq, dk, dv];
        let inputs = [dout, stats, q, k, v];
        self.attention_backward_blocks(grads, inputs, starts, shape, ATTENTION_BLOCK_BYTES)
    }

    /// As `attention_backward_host` (the gradients accumulate), in blocks
    /// of query rows whose scores fit in `block_bytes`. `inputs`: dout,
    /// stats, q, k, v.
    pub fn attention_backward_blocks(
        &self,
        grads: [&mut [f32]; 3],
        inputs: [&[f32]; 5],
        starts: Option<&[u32]>,
        shape: &AttnShape,
        block_bytes: usize,
    ) -> Result<(), EngineError> {
        self.attention_backward_from(grads, inputs, starts, shape, GradStart::Held, block_bytes)
    }

    /// As `attention_backward_host`, the gradients overwritten
    /// (`GradStart::Zero`: the caller's buffers are not uploaded) or added
    /// to what they held, in blocks whose scores fit in `block_bytes`.
    /// `inputs`: dout, stats, q, k, v.
    pub(super) fn attention_backward_from(
        &self,
        [dq, dk, dv]: [&mut [f32]; 3],
        [dout, stats, q, k, v]: [&[f32]; 5],
        starts: Option<&[u32]>,
        shape: &AttnShape,
        grad_from: GradStart,
        block_bytes: usize,
    ) -> Result<(), EngineError> {
        assert_eq!(stats.len(), attention_stats_len(shape));
        self.bind()?;
        let inputs = [dout, stats, q, k, v].map(|x| self.upload(x));
        let [dout, stats, q, k, v] = inputs;
        let (dout, mut stats, q, k, v) = (dout?, stats?, q?, k?, v?);
        let mut grads = Vec::with_capacity(3);
        for g in [&*dq, &*dk, &*dv] {
            grads.push(match grad_from {
                GradStart::Held => self.upload(g)?,
                GradStart::Zero => self.zeros(g.len())?,
            });
        }
        let [gq, gk, gv] = &mut grads[..] else {
            unreachable!("three gradients")
        };
        let starts = self.attention_starts(starts, shape)?;
        self.attention_backward_device(
            [gq, gk, gv],
            &dout,
            &mut stats,
            [&q, &k, &v],
            &starts,
            shape,
            block_bytes,
        )?;
        for (dev, host) in grads.iter().zip([dq, dk, dv]) {
            self.download(dev, host)?;
        }
        Ok(())
    }
}
