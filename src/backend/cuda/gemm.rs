//! cuBLAS's GEMMs as the backend asks for them: row-major products
//! (`out = x · wᵀ`, and the backward's `dx += dout · w`, `dw += doutᵀ · x`)
//! turned into column-major `cublasGemmEx` calls with f32 accumulation,
//! the inputs bf16 (the experts; the dense layers by default) or f32, and
//! the operands a [`DenseGemm`] choice reads ([`GemmInput`]).

use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{sys::CUdeviceptr, CudaSlice, CudaStream, DevicePtr, SyncOnDrop};

use super::{gpu_error, CudaBackend, Shape, BF16, F32};
use crate::backend::DenseGemm;
use crate::EngineError;

impl CudaBackend {
    /// Column-major `c (m×n) = op(a)·op(b) + beta·c` (cublasGemmEx), `a`
    /// and `b` of type `inputs` (bf16 for the experts, bf16 or f32 for the
    /// dense layers), f32 accumulation and `c`; `linear_*` below turn the
    /// row-major products into this.
    ///
    /// # Safety
    /// `a`, `b` and `c` address device memory of this context holding the
    /// matrices `dims` and the leading dimensions describe, alive and not
    /// written by another stream until this stream has run the product.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn gemm(
        &self,
        transa: blas_sys::cublasOperation_t,
        transb: blas_sys::cublasOperation_t,
        dims: (usize, usize, usize),
        a: CUdeviceptr,
        lda: usize,
        b: CUdeviceptr,
        ldb: usize,
        beta: f32,
        c: CUdeviceptr,
        ldc: usize,
        inputs: blas_sys::cudaDataType,
    ) -> Result<(), EngineError> {
        let (m, n, k) = dims;
        let alpha = 1.0f32;
        // SAFETY: the pointers are valid per this function's contract;
        // alpha and beta point to host f32s alive for the call.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                transa,
                transb,
                m as i32,
                n as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                a as *const _,
                inputs,
                lda as i32,
                b as *const _,
                inputs,
                ldb as i32,
                (&beta as *const f32).cast(),
                c as *mut _,
                blas_sys::cudaDataType::CUDA_R_32F,
                ldc as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| gpu_error("cublasGemmEx", e))
    }

    /// out (M, N) = x (M, K) · w (N, K)ᵀ at device addresses: out (M·N
    /// f32), x (M·K values of type `inputs`) and the weights (N·K values
    /// of type `inputs`); see [`GemmCall::linear`].
    ///
    /// # Safety
    /// `out`, `x` and `w` address memory of this context of those sizes,
    /// alive and not used by another stream (`w` and `x` not written)
    /// until this stream has run the product.
    pub(super) unsafe fn linear_forward_at(
        &self,
        out: CUdeviceptr,
        x: CUdeviceptr,
        w: CUdeviceptr,
        s: Shape,
        inputs: blas_sys::cudaDataType,
    ) -> Result<(), EngineError> {
        // SAFETY: the pointers per this function's contract.
        unsafe { self.gemm_call(GemmCall::linear(out, x, w, s), inputs) }
    }

    /// One product as [`GemmCall`] describes it (cublasGemmEx).
    ///
    /// # Safety
    /// As [`Self::gemm`], for the call's operands.
    pub(super) unsafe fn gemm_call(
        &self,
        call: GemmCall,
        inputs: blas_sys::cudaDataType,
    ) -> Result<(), EngineError> {
        let GemmCall {
            trans: (transa, transb),
            dims,
            a: (a, lda),
            b: (b, ldb),
            c: (c, ldc),
            beta,
        } = call;
        // SAFETY: the caller's contract.
        unsafe { self.gemm(transa, transb, dims, a, lda, b, ldb, beta, c, ldc, inputs) }
    }

    /// dx (M, K) += dout (M, N) · w (N, K), then dw (N, K) += doutᵀ · x,
    /// at device addresses: `[dx, dw]` (M·K and N·K f32) accumulate from
    /// `[dout, x]` (M·N and M·K values of type `inputs`).
    ///
    /// # Safety
    /// As [`Self::linear_forward_at`], for the four addresses.
    pub(super) unsafe fn linear_backward_at(
        &self,
        [dx, dw]: [CUdeviceptr; 2],
        [dout, x]: [CUdeviceptr; 2],
        w: CUdeviceptr,
        s: Shape,
        inputs: blas_sys::cudaDataType,
    ) -> Result<(), EngineError> {
        // SAFETY: the pointers per this function's contract.
        unsafe {
            self.gemm_call(GemmCall::input_grad(dx, dout, w, s), inputs)?;
            self.gemm_call(GemmCall::weight_grad(dw, dout, x, s), inputs)
        }
    }
}

use blas_sys::cublasOperation_t::{CUBLAS_OP_N as N, CUBLAS_OP_T as T};

/// One column-major product `c (m×n) = op(a)·op(b) + beta·c` as
/// cublasGemmEx takes it: each operand's device address and leading
/// dimension. The row-major products of a linear layer are made into one
/// by [`Self::linear`], [`Self::input_grad`] and [`Self::weight_grad`].
#[derive(Clone, Copy, Debug)]
pub(super) struct GemmCall {
    pub trans: (blas_sys::cublasOperation_t, blas_sys::cublasOperation_t),
    /// (m, n, k).
    pub dims: (usize, usize, usize),
    pub a: (CUdeviceptr, usize),
    pub b: (CUdeviceptr, usize),
    pub c: (CUdeviceptr, usize),
    pub beta: f32,
}

impl GemmCall {
    /// out (M, N) = x (M, K) · w (N, K)ᵀ. Column-major, outᵀ = w·xᵀ:
    /// op(A) = w-stored-as-(K×N) transposed, op(B) = x as (K×M).
    pub fn linear(out: CUdeviceptr, x: CUdeviceptr, w: CUdeviceptr, s: Shape) -> Self {
        Self {
            trans: (T, N),
            dims: (s.n, s.m, s.k),
            a: (w, s.k),
            b: (x, s.k),
            c: (out, s.n),
            beta: 0.0,
        }
    }

    /// dx (M, K) += dout (M, N) · w (N, K): dxᵀ (K×M) = w-as-(K×N) ·
    /// doutᵀ-as-(N×M).
    pub fn input_grad(dx: CUdeviceptr, dout: CUdeviceptr, w: CUdeviceptr, s: Shape) -> Self {
        Self {
            trans: (N, N),
            dims: (s.k, s.m, s.n),
            a: (w, s.k),
            b: (dout, s.n),
            c: (dx, s.k),
            beta: 1.0,
        }
    }

    /// dw (N, K) += doutᵀ · x: dwᵀ (K×N) = x-as-(K×M) · (doutᵀ-as-(N×M))ᵀ.
    pub fn weight_grad(dw: CUdeviceptr, dout: CUdeviceptr, x: CUdeviceptr, s: Shape) -> Self {
        Self {
            trans: (N, T),
            dims: (s.k, s.n, s.m),
            a: (x, s.k),
            b: (dout, s.n),
            c: (dw, s.k),
            beta: 1.0,
        }
    }
}

/// A GEMM's operand as [`DenseGemm`] has it read.
pub(super) enum GemmInput<'a> {
    F32(&'a CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
    HeldF32(Arc<CudaSlice<f32>>),
    HeldBf16(Arc<CudaSlice<u16>>),
}

impl GemmInput<'_> {
    /// Its device address, with the guard that records its use on `stream`.
    pub(super) fn device_ptr<'s>(
        &'s self,
        stream: &'s CudaStream,
    ) -> (CUdeviceptr, SyncOnDrop<'s>) {
        match self {
            GemmInput::F32(x) => x.device_ptr(stream),
            GemmInput::Bf16(x) => x.device_ptr(stream),
            GemmInput::HeldF32(x) => x.device_ptr(stream),
            GemmInput::HeldBf16(x) => x.device_ptr(stream),
        }
    }
}

/// cuBLAS's name for what a GEMM taking `gemm` inputs reads.
pub(super) fn blas_type(gemm: DenseGemm) -> cudarc::cublas::sys::cudaDataType {
    match gemm {
        DenseGemm::F32 => F32,
        DenseGemm::Bf16 => BF16,
    }
}

/// Bytes of one value a GEMM taking `gemm` inputs reads.
pub(super) fn input_bytes(gemm: DenseGemm) -> usize {
    match gemm {
        DenseGemm::F32 => 4,
        DenseGemm::Bf16 => 2,
    }
}
