//! cuBLAS's GEMMs as the backend asks for them: row-major products
//! (`out = x · wᵀ`, and the backward's `dx += dout · w`, `dw += doutᵀ · x`)
//! turned into column-major `cublasGemmEx` calls with f32 accumulation,
//! the inputs bf16 (the experts; the dense layers by default) or f32, and
//! the operands a [`DenseGemm`] choice reads ([`GemmInput`]).

use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{
    sys::CUdeviceptr, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop,
};

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

    /// out (M, N) = x (M, K) · w (N, K)ᵀ, `x` and the weights at `w` of
    /// type `inputs` (`T` its Rust type). Column-major, that is outᵀ =
    /// w·xᵀ: op(A) = w-stored-as-(K×N) transposed, op(B) = x as (K×M).
    ///
    /// # Safety
    /// `w` addresses N·K values of type `inputs` that nothing writes until
    /// this stream has run the product; `T` is `inputs`' Rust type.
    pub(super) unsafe fn linear_forward<T>(
        &self,
        out: &mut CudaSlice<f32>,
        x: &CudaSlice<T>,
        w: CUdeviceptr,
        s: Shape,
        inputs: blas_sys::cudaDataType,
    ) -> Result<(), EngineError> {
        assert!(out.len() == s.m * s.n && x.len() == s.m * s.k);
        let (x_ptr, _rx) = x.device_ptr(&self.stream);
        let (out_ptr, _wo) = out.device_ptr_mut(&self.stream);
        // SAFETY: out and x hold the asserted sizes; `w` per the contract.
        unsafe { self.linear_forward_at(out_ptr, x_ptr, w, s, inputs) }
    }

    /// [`Self::linear_forward`] at device addresses: out (M·N f32) and
    /// x (M·K values of type `inputs`).
    ///
    /// # Safety
    /// As [`Self::linear_forward`], and `out` and `x` address memory of
    /// this context of those sizes, alive and not used by another stream
    /// until this stream has run the product.
    pub(super) unsafe fn linear_forward_at(
        &self,
        out: CUdeviceptr,
        x: CUdeviceptr,
        w: CUdeviceptr,
        s: Shape,
        inputs: blas_sys::cudaDataType,
    ) -> Result<(), EngineError> {
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        // SAFETY: the pointers per this function's contract.
        unsafe {
            self.gemm(
                CUBLAS_OP_T,
                CUBLAS_OP_N,
                (s.n, s.m, s.k),
                w,
                s.k,
                x,
                s.k,
                0.0,
                out,
                s.n,
                inputs,
            )
        }
    }

    /// dx (M, K) += dout (M, N) · w (N, K); dw (N, K) += doutᵀ · x, `dout`,
    /// `x` and the weights of type `inputs`; dw at a device address (a
    /// slice's, or a part of an expert's gradient buffer).
    ///
    /// # Safety
    /// As [`Self::linear_forward`] for `w`, `T` and `inputs`; `dw`
    /// addresses N·K f32 of this context's memory, alive and used by no
    /// other stream until this stream has run the GEMMs.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn linear_backward<T>(
        &self,
        dx: &mut CudaSlice<f32>,
        dw: CUdeviceptr,
        dout: &CudaSlice<T>,
        x: &CudaSlice<T>,
        w: CUdeviceptr,
        s: Shape,
        inputs: blas_sys::cudaDataType,
    ) -> Result<(), EngineError> {
        assert!(dx.len() == s.m * s.k);
        assert!(dout.len() == s.m * s.n && x.len() == s.m * s.k);
        let (dout_ptr, _rd) = dout.device_ptr(&self.stream);
        let (x_ptr, _rx) = x.device_ptr(&self.stream);
        let (dx_ptr, _wdx) = dx.device_ptr_mut(&self.stream);
        // SAFETY: every buffer holds the asserted size; `dw` and `w` per
        // the contract.
        unsafe { self.linear_backward_at([dx_ptr, dw], [dout_ptr, x_ptr], w, s, inputs) }
    }

    /// [`Self::linear_backward`] at device addresses: `[dx, dw]` (M·K and
    /// N·K f32) accumulate from `[dout, x]` (M·N and M·K values of type
    /// `inputs`).
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
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        // SAFETY: the pointers per this function's contract.
        // dxᵀ (K×M) = w-as-(K×N) · doutᵀ-as-(N×M), then
        // dwᵀ (K×N) = x-as-(K×M) · (doutᵀ-as-(N×M))ᵀ.
        unsafe {
            self.gemm(
                CUBLAS_OP_N,
                CUBLAS_OP_N,
                (s.k, s.m, s.n),
                w,
                s.k,
                dout,
                s.n,
                1.0,
                dx,
                s.k,
                inputs,
            )?;
            self.gemm(
                CUBLAS_OP_N,
                CUBLAS_OP_T,
                (s.k, s.n, s.m),
                x,
                s.k,
                dout,
                s.n,
                1.0,
                dw,
                s.k,
                inputs,
            )
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
