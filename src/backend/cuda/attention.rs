//! Causal grouped-query attention on the GPU: the products through cuBLAS
//! (batched GEMMs over every (sequence, head)), the masked softmax and its
//! backward in `kernels.cu`, a block of query rows at a time.
//!
//! The GEMMs read what the backend's
//! [`DenseGemm`](crate::backend::DenseGemm) says, as the dense layers' do:
//! bf16 (the default) rounds q, k, v and d out head by head, and each
//! block's probabilities and d scores, to bf16 before they enter a
//! product, which accumulates into f32 scores, outputs and gradients; the
//! softmax and its backward read and write f32 (flash attention's choice).
//! f32 reads every operand unrounded. The GEMMs' operands and the
//! strided-batched GEMM are in `attention_operands.rs`.
//!
//! q, k and v are first laid out head by head (`attn_to_heads`; a kv head
//! copied to each query head of its group), so that every head's (S × hd)
//! rows are one strided-batched operand. A block of query rows [q0, q1)
//! takes its scores against keys [0, q1) only (the causal past), so the
//! scores of one block, (B·H) × rows × q1, are the only buffer larger
//! than the activations; blocks are as tall as [`ATTENTION_BLOCK_BYTES`]
//! allows, so the buffer stays bounded at any sequence length. For its
//! backward the forward keeps O(S) a head: each query row's softmax max
//! and sum, from which the backward recomputes the forward's probabilities
//! bit for bit (the same scores, from the same GEMM, through the same
//! kernel), instead of the (B, H, S, S) probabilities the cpu keeps. The
//! `_device` functions work on GPU memory (the network's `CudaOps`); the
//! wrappers on host slices (`attention_host.rs`) upload, launch and
//! download, what the tests compare with the cpu.

use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{CudaSlice, DevicePtrMut, PushKernelArg};

use super::attention_operands::{Block, Operand, Values};
use super::dense::threads;
use super::{gpu_error, CudaBackend, F32};
use crate::backend::ROW_PARTS;
use crate::math::attention::AttnShape;
use crate::EngineError;

pub use crate::backend::ATTENTION_BLOCK_BYTES;

use blas_sys::cublasOperation_t::{CUBLAS_OP_N as N, CUBLAS_OP_T as T};

/// f32 values the forward keeps for the backward: a max and a sum a row.
pub fn attention_stats_len(shape: &AttnShape) -> usize {
    2 * shape.seqs * shape.heads * shape.seq_len
}

impl CudaBackend {
    /// `x` (T, heads_in·hd) laid out head by head, each of the H heads
    /// reading head h / (H / heads_in).
    pub(super) fn tokens_to_heads(
        &self,
        src: &CudaSlice<f32>,
        heads_in: usize,
        shape: &AttnShape,
    ) -> Result<CudaSlice<f32>, EngineError> {
        assert_eq!(src.len(), shape.tokens() * heads_in * shape.head_dim);
        let n = shape.tokens() * shape.heads * shape.head_dim;
        let mut dst = self.zeros(n)?;
        let dims = [
            shape.seqs,
            shape.seq_len,
            shape.heads,
            heads_in,
            shape.head_dim,
        ];
        let mut launch = self.stream.launch_builder(&self.dense.attn_to_heads);
        launch.arg(src).arg(&mut dst);
        let dims = dims.map(|x| x as u32);
        for x in &dims {
            launch.arg(x);
        }
        // SAFETY: src holds T·heads_in·hd f32 (asserted), dst T·H·hd; one
        // thread an element of dst.
        unsafe { launch.launch(threads(n)) }.map_err(|e| gpu_error("attn_to_heads", e))?;
        Ok(dst)
    }

    /// `dst` (T, heads_out·hd) += `src`'s heads (B, H, S, hd), each head
    /// of `dst` the sum of its group's.
    fn heads_to_tokens(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        heads_out: usize,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        let n = shape.tokens() * heads_out * shape.head_dim;
        assert_eq!(dst.len(), n);
        let dims = [
            shape.seqs,
            shape.seq_len,
            shape.heads,
            heads_out,
            shape.head_dim,
        ];
        let dims = dims.map(|x| x as u32);
        let accumulate = 1u32;
        let mut launch = self.stream.launch_builder(&self.dense.attn_from_heads);
        launch.arg(src).arg(dst);
        for x in &dims {
            launch.arg(x);
        }
        launch.arg(&accumulate);
        // SAFETY: src holds T·H·hd f32, dst T·heads_out·hd (asserted); one
        // thread an element of dst.
        unsafe { launch.launch(threads(n)) }.map_err(|e| gpu_error("attn_from_heads", e))?;
        Ok(())
    }

    /// The block's scores, q·kᵀ for its query rows against its keys, into
    /// `scores` (then turned into probabilities by `attn_softmax`).
    fn block_scores(
        &self,
        scores: &mut CudaSlice<f32>,
        q: Values<'_>,
        k: Values<'_>,
        block: Block,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        let (rows, keys) = (block.rows, block.keys());
        let (q_ptr, _rq, qt) = q.device_ptr(&self.stream);
        let (k_ptr, _rk, kt) = k.device_ptr(&self.stream);
        let (s_ptr, _ws) = scores.device_ptr_mut(&self.stream);
        // SAFETY: q and k hold B·H·S·hd values of the GEMMs' input type
        // and `scores` at least B·H·rows·keys f32 (sized for the tallest
        // block); column-major, scoresᵀ (keys × rows) = k-as-(hd × keys)ᵀ
        // · q-as-(hd × rows).
        unsafe {
            self.gemm_heads(
                shape,
                (T, N),
                (keys, rows, shape.head_dim),
                Operand::heads(k_ptr, kt, shape, 0),
                Operand::heads(q_ptr, qt, shape, block.q0),
                0.0,
                Operand::scores(s_ptr, F32, rows, keys),
            )
        }
    }

    /// `attn_softmax` over the block: the scores become probabilities,
    /// with the rows' statistics written (`from_stats` false) or read.
    fn block_softmax(
        &self,
        scores: &mut CudaSlice<f32>,
        stats: &mut CudaSlice<f32>,
        starts: &CudaSlice<u32>,
        block: Block,
        shape: &AttnShape,
        from_stats: bool,
    ) -> Result<(), EngineError> {
        let rows = shape.seqs * shape.heads * block.rows;
        let keys = block.q0 + block.rows;
        let dims = [
            shape.seqs,
            shape.seq_len,
            shape.heads,
            shape.head_dim,
            block.q0,
            block.rows,
        ]
        .map(|x| x as u32);
        let [seqs, s, heads, _, q0, block_rows] = &dims;
        if !from_stats {
            let mut partials = self.zeros(rows * 2 * ROW_PARTS)?;
            for sums in [0u32, 1] {
                let mut launch = self
                    .stream
                    .launch_builder(&self.dense.attn_softmax_partials);
                launch.arg(&*scores).arg(&mut partials).arg(starts);
                for x in &dims {
                    launch.arg(x);
                }
                launch.arg(&sums);
                // SAFETY: scores holds the block's B·H·rows·keys f32,
                // partials two parts' values for each of its rows, starts
                // T; one thread a (row, part).
                unsafe { launch.launch(threads(rows * ROW_PARTS)) }
                    .map_err(|e| gpu_error("attn_softmax_partials", e))?;
            }
            let mut launch = self.stream.launch_builder(&self.dense.attn_softmax_stats);
            launch.arg(&partials).arg(&mut *stats);
            launch.arg(seqs).arg(s).arg(heads).arg(q0).arg(block_rows);
            // SAFETY: partials as above, stats 2·B·H·S f32; one thread a
            // row of the block.
            unsafe { launch.launch(threads(rows)) }
                .map_err(|e| gpu_error("attn_softmax_stats", e))?;
        }
        let mut launch = self.stream.launch_builder(&self.dense.attn_softmax);
        launch.arg(scores).arg(&*stats).arg(starts);
        for x in &dims {
            launch.arg(x);
        }
        // SAFETY: scores holds the block's B·H·rows·keys f32, stats
        // 2·B·H·S, starts T; one thread an element of the block.
        unsafe { launch.launch(threads(rows * keys)) }
            .map(|_| ())
            .map_err(|e| gpu_error("attn_softmax", e))
    }

    /// out = P·v for the block's rows into `out` (B, H, S, hd), or, with
    /// `ds` and `k` in their place, the block's rows of dq = dS·k.
    fn block_times_keys(
        &self,
        out: &mut CudaSlice<f32>,
        probs: Values<'_>,
        v: Values<'_>,
        block: Block,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        let (rows, keys) = (block.rows, block.keys());
        let (p_ptr, _rp, pt) = probs.device_ptr(&self.stream);
        let (v_ptr, _rv, vt) = v.device_ptr(&self.stream);
        let (o_ptr, _wo) = out.device_ptr_mut(&self.stream);
        // SAFETY: sizes as in `block_scores`, `out` f32; column-major,
        // outᵀ (hd × rows) = v-as-(hd × keys) · P-as-(keys × rows).
        unsafe {
            self.gemm_heads(
                shape,
                (N, N),
                (shape.head_dim, rows, keys),
                Operand::heads(v_ptr, vt, shape, 0),
                Operand::scores(p_ptr, pt, rows, keys),
                0.0,
                Operand::heads(o_ptr, F32, shape, block.q0),
            )
        }
    }

    /// grad (B, H, S, hd) rows [0, keys) += Pᵀ·x for the block: dv from
    /// the probabilities and d out, or dk from d scores and q.
    fn block_keys_grad(
        &self,
        grad: &mut CudaSlice<f32>,
        probs: Values<'_>,
        x: Values<'_>,
        block: Block,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        let (rows, keys) = (block.rows, block.keys());
        let (p_ptr, _rp, pt) = probs.device_ptr(&self.stream);
        let (x_ptr, _rx, xt) = x.device_ptr(&self.stream);
        let (g_ptr, _wg) = grad.device_ptr_mut(&self.stream);
        // SAFETY: sizes as in `block_scores`, `grad` f32; column-major,
        // gradᵀ (hd × keys) += x-as-(hd × rows) · (P-as-(keys × rows))ᵀ.
        unsafe {
            self.gemm_heads(
                shape,
                (N, T),
                (shape.head_dim, keys, rows),
                Operand::heads(x_ptr, xt, shape, block.q0),
                Operand::scores(p_ptr, pt, rows, keys),
                1.0,
                Operand::heads(g_ptr, F32, shape, 0),
            )
        }
    }

    /// The attention forward on q, k, v (T, heads·hd and T, kv_heads·hd)
    /// in GPU memory: `out` (T, heads·hd) and each query row's softmax
    /// statistics, a block of query rows (whose scores fit in
    /// `block_bytes`) at a time.
    pub(super) fn attention_forward_device(
        &self,
        out: &mut CudaSlice<f32>,
        stats: &mut CudaSlice<f32>,
        qkv: [&CudaSlice<f32>; 3],
        dstarts: &CudaSlice<u32>,
        shape: &AttnShape,
        block_bytes: usize,
    ) -> Result<(), EngineError> {
        assert_eq!(stats.len(), attention_stats_len(shape));
        assert_eq!(out.len(), shape.tokens() * shape.q_width());
        assert_eq!(dstarts.len(), shape.tokens());
        let heads = self.heads(qkv, shape)?;
        let mut out_heads = self.zeros(shape.tokens() * shape.q_width())?;
        let rows = shape.query_block_rows(block_bytes);
        let block_len = shape.seqs * shape.heads * rows * shape.seq_len;
        let mut scores = self.zeros(block_len)?;
        let mut rounded = self.block_copy(block_len)?;
        let (q, k, v) = (heads.q.view(), heads.k.view(), heads.v.view());
        for block in Block::all(shape, block_bytes) {
            self.block_scores(&mut scores, q, k, block, shape)?;
            self.block_softmax(&mut scores, stats, dstarts, block, shape, false)?;
            let probs = self.block_operand(&scores, &mut rounded, block, shape)?;
            self.block_times_keys(&mut out_heads, probs, v, block, shape)?;
        }
        self.memset_zeros(out)?;
        self.heads_to_tokens(&out_heads, out, shape.heads, shape)
    }

    /// The attention backward in GPU memory from dout (T, heads·hd), the
    /// forward's statistics and q, k, v: dq, dk, dv accumulate. A block of
    /// query rows (whose scores fit in `block_bytes`) at a time.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_backward_device(
        &self,
        [dq, dk, dv]: [&mut CudaSlice<f32>; 3],
        dout: &CudaSlice<f32>,
        stats: &mut CudaSlice<f32>,
        qkv: [&CudaSlice<f32>; 3],
        dstarts: &CudaSlice<u32>,
        shape: &AttnShape,
        block_bytes: usize,
    ) -> Result<(), EngineError> {
        assert_eq!(stats.len(), attention_stats_len(shape));
        assert_eq!(dstarts.len(), shape.tokens());
        let heads = self.heads(qkv, shape)?;
        let dout = self.gemm_heads_of(dout, shape.heads, shape)?;
        let n = shape.tokens() * shape.q_width();
        let (mut gq, mut gk, mut gv) = (self.zeros(n)?, self.zeros(n)?, self.zeros(n)?);
        let rows = shape.query_block_rows(block_bytes);
        let block_len = shape.seqs * shape.heads * rows * shape.seq_len;
        let (mut probs, mut dprobs) = (self.zeros(block_len)?, self.zeros(block_len)?);
        let mut rounded = self.block_copy(block_len)?;
        let (q, k, v, dout) = (heads.q.view(), heads.k.view(), heads.v.view(), dout.view());
        for block in Block::all(shape, block_bytes) {
            self.block_scores(&mut probs, q, k, block, shape)?;
            self.block_softmax(&mut probs, stats, dstarts, block, shape, true)?;
            let p = self.block_operand(&probs, &mut rounded, block, shape)?;
            self.block_keys_grad(&mut gv, p, dout, block, shape)?;
            self.block_scores(&mut dprobs, dout, v, block, shape)?;
            self.block_softmax_backward(&probs, &mut dprobs, block, shape)?;
            let ds = self.block_operand(&dprobs, &mut rounded, block, shape)?;
            self.block_times_keys(&mut gq, ds, k, block, shape)?;
            self.block_keys_grad(&mut gk, ds, q, block, shape)?;
        }
        self.heads_to_tokens(&gq, dq, shape.heads, shape)?;
        self.heads_to_tokens(&gk, dk, shape.kv_heads, shape)?;
        self.heads_to_tokens(&gv, dv, shape.kv_heads, shape)
    }

    /// `attn_softmax_backward` over the block: d probabilities become d
    /// scores.
    fn block_softmax_backward(
        &self,
        probs: &CudaSlice<f32>,
        dprobs: &mut CudaSlice<f32>,
        block: Block,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        let rows = shape.seqs * shape.heads * block.rows;
        let keys = block.q0 + block.rows;
        let [seqs, heads, hd, q0, block_rows] = [
            shape.seqs,
            shape.heads,
            shape.head_dim,
            block.q0,
            block.rows,
        ]
        .map(|x| x as u32);
        let mut partials = self.zeros(rows * ROW_PARTS)?;
        let mut launch = self
            .stream
            .launch_builder(&self.dense.attn_softmax_backward_partials);
        launch.arg(probs).arg(&*dprobs).arg(&mut partials);
        launch.arg(&seqs).arg(&heads).arg(&q0).arg(&block_rows);
        // SAFETY: probs and dprobs hold the block's B·H·rows·keys f32,
        // partials a row's parts for each row; one thread a (row, part).
        unsafe { launch.launch(threads(rows * ROW_PARTS)) }
            .map_err(|e| gpu_error("attn_softmax_backward_partials", e))?;
        let mut launch = self
            .stream
            .launch_builder(&self.dense.attn_softmax_backward);
        launch.arg(probs).arg(dprobs).arg(&partials);
        launch
            .arg(&seqs)
            .arg(&heads)
            .arg(&hd)
            .arg(&q0)
            .arg(&block_rows);
        // SAFETY: as above; one thread an element of the block.
        unsafe { launch.launch(threads(rows * keys)) }
            .map(|_| ())
            .map_err(|e| gpu_error("attn_softmax_backward", e))
    }
}
