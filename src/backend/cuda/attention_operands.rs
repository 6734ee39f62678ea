//! The operands of the attention's batched GEMMs: a (sequence, head)
//! batch's device addresses and types, q, k and v laid out head by head
//! (rounded to bf16 where [`DenseGemm`] says), a block's probabilities or
//! d scores as the GEMMs read them, and the strided-batched GEMM itself.

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{sys::CUdeviceptr, CudaSlice, CudaStream, DevicePtr, SyncOnDrop};

use super::{gpu_error, CudaBackend, BF16, F32};
use crate::backend::DenseGemm;
use crate::math::attention::AttnShape;
use crate::EngineError;

/// One operand of a strided-batched GEMM: a device address, the type of
/// its values (f32 or bf16), its leading dimension and the distance
/// between batch items, both in values.
#[derive(Clone, Copy)]
pub(super) struct Operand {
    pub(super) ptr: CUdeviceptr,
    pub(super) dtype: blas_sys::cudaDataType,
    pub(super) ld: usize,
    pub(super) stride: usize,
}

impl Operand {
    /// Every head's (S × hd) rows from row `row` on, in a (B, H, S, hd)
    /// buffer at `base` of `dtype` values.
    pub(super) fn heads(
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
    pub(super) fn scores(
        base: CUdeviceptr,
        dtype: blas_sys::cudaDataType,
        rows: usize,
        keys: usize,
    ) -> Self {
        Self {
            ptr: base,
            dtype,
            ld: keys,
            stride: rows * keys,
        }
    }
}

/// A block of query rows [q0, q0 + rows), against keys [0, q0 + rows).
#[derive(Clone, Copy)]
pub(super) struct Block {
    pub(super) q0: usize,
    pub(super) rows: usize,
}

impl Block {
    pub(super) fn keys(&self) -> usize {
        self.q0 + self.rows
    }

    pub(super) fn all(shape: &AttnShape, bytes: usize) -> impl Iterator<Item = Block> {
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
pub(super) enum GemmValues {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

impl GemmValues {
    pub(super) fn view(&self) -> Values<'_> {
        match self {
            GemmValues::F32(x) => Values::F32(x),
            GemmValues::Bf16(x) => Values::Bf16(x),
        }
    }
}

/// A borrowed [`GemmValues`]: the f32 values a kernel wrote, or their
/// bf16 copy.
#[derive(Clone, Copy)]
pub(super) enum Values<'a> {
    F32(&'a CudaSlice<f32>),
    Bf16(&'a CudaSlice<u16>),
}

impl<'a> Values<'a> {
    /// The device address (with the guard that records its use on
    /// `stream`) and cuBLAS's name for the values' type.
    pub(super) fn device_ptr(
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
pub(super) struct Heads {
    pub(super) q: GemmValues,
    pub(super) k: GemmValues,
    pub(super) v: GemmValues,
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
    pub(super) unsafe fn gemm_heads(
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

    /// q, k and v laid out head by head, as the GEMMs read them.
    pub(super) fn heads(
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
    pub(super) fn gemm_heads_of(
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
    pub(super) fn block_copy(&self, len: usize) -> Result<Option<CudaSlice<u16>>, EngineError> {
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
    pub(super) fn block_operand<'a>(
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
}
