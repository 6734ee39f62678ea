//! Causal grouped-query attention on the GPU: the products through cuBLAS
//! (batched GEMMs over every (sequence, head)), the masked softmax and its
//! backward in `kernels.cu`, a block of query rows at a time.
//!
//! The GEMMs read what the backend's [`DenseGemm`] says, as the dense
//! layers' do: bf16 (the default) rounds q, k, v and d out head by head,
//! and each block's probabilities and d scores, to bf16 before they enter
//! a product, which accumulates into f32 scores, outputs and gradients;
//! the softmax and its backward read and write f32 (flash attention's
//! choice). f32 reads every operand unrounded.
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

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{
    sys::CUdeviceptr, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg, SyncOnDrop,
};

use super::dense::threads;
use super::{gpu_error, CudaBackend, BF16, F32};
use crate::backend::DenseGemm;
use crate::backend::ROW_PARTS;
use crate::math::attention::AttnShape;
use crate::EngineError;

pub use crate::backend::ATTENTION_BLOCK_BYTES;

/// f32 values the forward keeps for the backward: a max and a sum a row.
pub fn attention_stats_len(shape: &AttnShape) -> usize {
    2 * shape.seqs * shape.heads * shape.seq_len
}

/// One operand of a strided-batched GEMM: a device address, the type of
/// its values (f32 or bf16), its leading dimension and the distance
/// between batch items, both in values.
#[derive(Clone, Copy)]
struct Operand {
    ptr: CUdeviceptr,
    dtype: blas_sys::cudaDataType,
    ld: usize,
    stride: usize,
}

impl Operand {
    /// Every head's (S × hd) rows from row `row` on, in a (B, H, S, hd)
    /// buffer at `base` of `dtype` values.
    fn heads(
        base: CUdeviceptr,
        dtype: blas_sys::cudaDataType,
        shape: &AttnShape,
        row: usize,
    ) -> Self {
        let hd = shape.head_dim;
        let bytes = if dtype == F32 { 4 } else { 2 };
        Self {
            ptr: base + (row * hd * bytes) as CUdeviceptr,
            dtype,
            ld: hd,
            stride: shape.seq_len * hd,
        }
    }

    /// Every head's block of `rows` score rows of `keys` each, in a block
    /// buffer at `base` of `dtype` values.
    fn scores(base: CUdeviceptr, dtype: blas_sys::cudaDataType, rows: usize, keys: usize) -> Self {
        Self {
            ptr: base,
            dtype,
            ld: keys,
            stride: rows * keys,
        }
    }
}

use blas_sys::cublasOperation_t::{CUBLAS_OP_N as N, CUBLAS_OP_T as T};

/// A block of query rows [q0, q0 + rows), against keys [0, q0 + rows).
#[derive(Clone, Copy)]
struct Block {
    q0: usize,
    rows: usize,
}

impl Block {
    fn keys(&self) -> usize {
        self.q0 + self.rows
    }

    fn all(shape: &AttnShape, bytes: usize) -> impl Iterator<Item = Block> {
        let s = shape.seq_len;
        let rows = shape.query_block_rows(bytes);
        (0..s).step_by(rows).map(move |q0| Block {
            q0,
            rows: rows.min(s - q0),
        })
    }
}

/// Values a GEMM of the attention reads, in the type [`DenseGemm`] gives
/// its inputs.
enum GemmValues {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

impl GemmValues {
    fn view(&self) -> Values<'_> {
        match self {
            GemmValues::F32(x) => Values::F32(x),
            GemmValues::Bf16(x) => Values::Bf16(x),
        }
    }
}

/// A borrowed [`GemmValues`]: the f32 values a kernel wrote, or their
/// bf16 copy.
#[derive(Clone, Copy)]
enum Values<'a> {
    F32(&'a CudaSlice<f32>),
    Bf16(&'a CudaSlice<u16>),
}

impl<'a> Values<'a> {
    /// The device address (with the guard that records its use on
    /// `stream`) and cuBLAS's name for the values' type.
    fn device_ptr(
        self,
        stream: &'a CudaStream,
    ) -> (CUdeviceptr, SyncOnDrop<'a>, blas_sys::cudaDataType) {
        match self {
            Values::F32(x) => {
                let (ptr, guard) = x.device_ptr(stream);
                (ptr, guard, F32)
            }
            Values::Bf16(x) => {
                let (ptr, guard) = x.device_ptr(stream);
                (ptr, guard, BF16)
            }
        }
    }
}

/// The device buffers of q, k and v head by head (B, H, S, hd), as the
/// GEMMs read them.
struct Heads {
    q: GemmValues,
    k: GemmValues,
    v: GemmValues,
}

impl CudaBackend {
    /// Column-major `c = op(a)·op(b) + beta·c` over every (sequence, head)
    /// (cublasGemmStridedBatchedEx, `a` and `b` of one type, f32 or bf16
    /// as [`DenseGemm`] gives them, f32 accumulation and `c`).
    ///
    /// # Safety
    /// Each operand addresses device memory of this context holding
    /// B·H matrices of its type as `dims`, its leading dimension and stride
    /// describe, alive and not written by another stream until this stream
    /// has run the product.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm_heads(
        &self,
        shape: &AttnShape,
        (transa, transb): (blas_sys::cublasOperation_t, blas_sys::cublasOperation_t),
        (m, n, k): (usize, usize, usize),
        a: Operand,
        b: Operand,
        beta: f32,
        c: Operand,
    ) -> Result<(), EngineError> {
        let alpha = 1.0f32;
        let batch = shape.seqs * shape.heads;
        assert!(
            a.dtype == b.dtype && c.dtype == F32,
            "the attention's GEMM types"
        );
        // SAFETY: the operands are valid per this function's contract;
        // alpha and beta point to host f32s alive for the call.
        unsafe {
            blas::gemm_strided_batched_ex(
                *self.blas.handle(),
                transa,
                transb,
                m as i32,
                n as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                a.ptr as *const _,
                a.dtype,
                a.ld as i32,
                a.stride as i64,
                b.ptr as *const _,
                b.dtype,
                b.ld as i32,
                b.stride as i64,
                (&beta as *const f32).cast(),
                c.ptr as *mut _,
                F32,
                c.ld as i32,
                c.stride as i64,
                batch as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| gpu_error("cublasGemmStridedBatchedEx", e))
    }

    /// `x` (T, heads_in·hd) laid out head by head, each of the H heads
    /// reading head h / (H / heads_in).
    fn tokens_to_heads(
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

    /// q, k and v laid out head by head, as the GEMMs read them.
    fn heads(
        &self,
        [q, k, v]: [&CudaSlice<f32>; 3],
        shape: &AttnShape,
    ) -> Result<Heads, EngineError> {
        Ok(Heads {
            q: self.gemm_heads_of(q, shape.heads, shape)?,
            k: self.gemm_heads_of(k, shape.kv_heads, shape)?,
            v: self.gemm_heads_of(v, shape.kv_heads, shape)?,
        })
    }

    /// `tokens_to_heads`, rounded to bf16 where the GEMMs read bf16.
    fn gemm_heads_of(
        &self,
        src: &CudaSlice<f32>,
        heads_in: usize,
        shape: &AttnShape,
    ) -> Result<GemmValues, EngineError> {
        let heads = self.tokens_to_heads(src, heads_in, shape)?;
        Ok(match self.dense_gemm {
            DenseGemm::F32 => GemmValues::F32(heads),
            // The f32 heads are freed in stream order, after the copy.
            DenseGemm::Bf16 => GemmValues::Bf16(self.to_bf16(&heads)?),
        })
    }

    /// A buffer for a block's probabilities (or d scores) rounded to bf16,
    /// `len` values, where the GEMMs read bf16.
    fn block_copy(&self, len: usize) -> Result<Option<CudaSlice<u16>>, EngineError> {
        match self.dense_gemm {
            DenseGemm::F32 => Ok(None),
            DenseGemm::Bf16 => self
                .stream
                .alloc_zeros::<u16>(len)
                .map(Some)
                .map_err(|e| self.memory_error("allocating GPU memory", e)),
        }
    }

    /// The block's f32 probabilities (or d scores) `x` as the GEMMs read
    /// them: `x` itself, or its first (B·H·rows·keys) values rounded
    /// into `copy`.
    fn block_operand<'a>(
        &self,
        x: &'a CudaSlice<f32>,
        copy: &'a mut Option<CudaSlice<u16>>,
        block: Block,
        shape: &AttnShape,
    ) -> Result<Values<'a>, EngineError> {
        let Some(copy) = copy else {
            return Ok(Values::F32(x));
        };
        let n = shape.seqs * shape.heads * block.rows * block.keys();
        assert!(n <= x.len() && n <= copy.len());
        let (x_ptr, _rx) = x.device_ptr(&self.stream);
        // SAFETY: x holds at least n f32 (asserted), read in stream order
        // before anything on this stream writes it again.
        unsafe { self.to_bf16_into(copy, x_ptr, n)? };
        Ok(Values::Bf16(copy))
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
