//! Causal grouped-query attention on the GPU (`kernels.cu`), keeping
//! O(S) a head for the backward: each query row's softmax max and sum,
//! from which the backward kernels recompute every probability bit for
//! bit, instead of the (B, H, S, S) probabilities — which at 16 × 512
//! tokens and 12 heads were 201 MB a layer to keep on the host and to
//! copy down and up again. Each wrapper takes host slices (uploads,
//! launches, downloads), as the engine's activations still live there.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::dense::threads;
use super::expert::GradStart;
use super::{gpu_error, CudaBackend};
use crate::math::attention::AttnShape;
use crate::EngineError;

/// f32 values the forward keeps for the backward: a max and a sum a row.
pub fn attention_stats_len(shape: &AttnShape) -> usize {
    2 * shape.seqs * shape.heads * shape.seq_len
}

/// The kernels' shape arguments, in their order.
fn dims(shape: &AttnShape) -> [u32; 5] {
    [
        shape.seqs,
        shape.seq_len,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
    ]
    .map(|x| x as u32)
}

impl CudaBackend {
    /// Every token's document start: `starts`, or 0 (one document a
    /// sequence), uploaded.
    fn attention_starts(
        &self,
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<CudaSlice<u32>, EngineError> {
        match starts {
            Some(s) => self.upload_u32(s),
            None => self.upload_u32(&vec![0u32; shape.tokens()]),
        }
    }

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
        assert_eq!(stats_host.len(), attention_stats_len(shape));
        self.bind()?;
        let (dq, dk, dv) = (self.upload(q)?, self.upload(k)?, self.upload(v)?);
        let dstarts = self.attention_starts(starts, shape)?;
        let mut out = self.zeros(shape.tokens() * shape.q_width())?;
        let mut stats = self.zeros(attention_stats_len(shape))?;
        let mut launch = self.stream.launch_builder(&self.dense.attention_forward);
        launch
            .arg(&dq)
            .arg(&dk)
            .arg(&dv)
            .arg(&dstarts)
            .arg(&mut out)
            .arg(&mut stats);
        let dims = dims(shape);
        for x in &dims {
            launch.arg(x);
        }
        // SAFETY: q and out hold T·H·hd f32, k and v T·KV·hd, starts T u32,
        // stats 2·B·H·S; one thread a (sequence, head, query).
        unsafe { launch.launch(threads(shape.seqs * shape.heads * shape.seq_len)) }
            .map_err(|e| gpu_error("attention_forward", e))?;
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
        self.attention_backward_from(grads, inputs, starts, shape, GradStart::Held)
    }

    /// As `attention_backward_host`, the gradients starting from zero on
    /// the GPU (`GradStart::Zero`: the caller's buffers hold zeros, and
    /// are not uploaded) or from what they held. `inputs`: dout, stats,
    /// q, k, v.
    pub(super) fn attention_backward_from(
        &self,
        [dq, dk, dv]: [&mut [f32]; 3],
        [dout, stats, q, k, v]: [&[f32]; 5],
        starts: Option<&[u32]>,
        shape: &AttnShape,
        grad_from: GradStart,
    ) -> Result<(), EngineError> {
        assert_eq!(stats.len(), attention_stats_len(shape));
        self.bind()?;
        let (ddout, dstats) = (self.upload(dout)?, self.upload(stats)?);
        let (dqin, dkin, dvin) = (self.upload(q)?, self.upload(k)?, self.upload(v)?);
        let dstarts = self.attention_starts(starts, shape)?;
        let start = |host: &[f32]| match grad_from {
            GradStart::Zero => self.zeros(host.len()),
            GradStart::Held => self.upload(host),
        };
        let (mut ddq, mut ddk, mut ddv) = (start(dq)?, start(dk)?, start(dv)?);
        let rows = shape.seqs * shape.heads * shape.seq_len;
        let mut weighted = self.zeros(rows)?;
        let dims = dims(shape);
        let mut launch = self
            .stream
            .launch_builder(&self.dense.attention_backward_dq);
        launch
            .arg(&ddout)
            .arg(&dstats)
            .arg(&dqin)
            .arg(&dkin)
            .arg(&dvin)
            .arg(&dstarts)
            .arg(&mut ddq)
            .arg(&mut weighted);
        for x in &dims {
            launch.arg(x);
        }
        // SAFETY: shapes as in the forward; weighted holds B·H·S f32; one
        // thread a (sequence, head, query).
        unsafe { launch.launch(threads(rows)) }
            .map_err(|e| gpu_error("attention_backward_dq", e))?;
        let mut launch = self
            .stream
            .launch_builder(&self.dense.attention_backward_dkv);
        launch
            .arg(&ddout)
            .arg(&dstats)
            .arg(&dqin)
            .arg(&dkin)
            .arg(&dvin)
            .arg(&dstarts)
            .arg(&weighted)
            .arg(&mut ddk)
            .arg(&mut ddv);
        for x in &dims {
            launch.arg(x);
        }
        // SAFETY: as above; one thread a (sequence, kv head, key), each
        // writing only its own key's rows of dk and dv.
        unsafe { launch.launch(threads(shape.seqs * shape.kv_heads * shape.seq_len)) }
            .map_err(|e| gpu_error("attention_backward_dkv", e))?;
        self.download(&ddq, dq)?;
        self.download(&ddk, dk)?;
        self.download(&ddv, dv)
    }
}
