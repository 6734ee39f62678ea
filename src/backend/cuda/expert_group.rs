//! The expert FFN for a group of experts in one call: the group's rows lie
//! back to back in the layer's permuted buffers (expert after expert), so
//! each conversion to bf16 and each activation runs once over all of them,
//! and each of the FFN's products runs once for the whole group as one
//! grouped GEMM (cublasGemmGroupedBatchedEx): every expert's product on
//! its own rows and its own weights, summed as its product alone is. A
//! group of one is the expert FFN of `expert.rs`, one cublasGemmEx a
//! product, so one expert at a time runs the kernels it always ran.
//!
//! cuBLAS reads a grouped GEMM's operand addresses from GPU memory; they
//! go up as the argument of a kernel (`group_words`) that writes them
//! there, as every kernel's dimensions go up with its launch: no copy. A
//! cuBLAS without the grouped GEMM (before CUDA 12.5) computes one expert
//! at a time ([`grouped_gemm_available`]); one that refuses the call runs
//! each of its products alone, and the backend says so
//! ([`CudaBackend::grouped_gemm_refusal`]).

use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, PushKernelArg};

use super::expert::Weights;
use super::gemm::GemmCall;
use super::{dense, gpu_error, CudaBackend, Shape, BF16, F32};
use crate::backend::DeviceRows;
use crate::math::ExpertKind;
use crate::EngineError;

/// The most experts a grouped GEMM takes here (and so a group the GPU
/// device computes at once): its three addresses an expert fill
/// `group_words`' argument (`STRATA_GROUP_WORDS` in kernels.cu).
pub(super) const GROUP_LIMIT: usize = crate::backend::GPU_GROUP_MAX;

/// `group_words`' argument: as kernels.cu's `strata_group_words`.
#[repr(C)]
#[derive(Clone, Copy)]
struct GroupWords {
    count: u64,
    words: [u64; 3 * GROUP_LIMIT],
}

// SAFETY: plain values (u64s) laid out as the kernel's struct, passed by
// value as a launch argument.
unsafe impl DeviceRepr for GroupWords {}

/// Whether the cuBLAS loaded has the grouped GEMM (CUDA 12.5 on): where
/// it has not, cudarc's binding would panic at its first call.
pub(super) fn grouped_gemm_available() -> bool {
    static FOUND: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // SAFETY: looks a symbol up in the library cudarc has loaded (or
    // fails), without calling it.
    *FOUND.get_or_init(|| unsafe {
        blas_sys::culib()
            .get::<*const ()>(b"cublasGemmGroupedBatchedEx")
            .is_ok()
    })
}

/// One expert of a group: its weights, and how many of the group's rows
/// are its (the group's rows are its experts' in order).
#[derive(Clone, Copy)]
pub(super) struct Member {
    pub w: Weights,
    pub rows: usize,
}

/// Each member's first row in the group's rows.
fn row_starts(members: &[Member]) -> impl Iterator<Item = (usize, &Member)> + '_ {
    members.iter().scan(0, |at, m| {
        let start = *at;
        *at += m.rows;
        Some((start, m))
    })
}

/// The address of row `row` of `width` values of `bytes` each from `base`.
fn row_at(base: u64, row: usize, width: usize, bytes: usize) -> u64 {
    base + (row * width * bytes) as u64
}

impl CudaBackend {
    /// Each of `calls` (f32 outputs, inputs of type `inputs`): one
    /// cublasGemmEx for a single call, else grouped GEMMs of up to
    /// [`GROUP_LIMIT`] products; where cuBLAS has no grouped GEMM, or has
    /// refused one, each product alone.
    ///
    /// # Safety
    /// As [`Self::gemm_call`], for every call's operands.
    pub(super) unsafe fn gemm_calls(
        &self,
        calls: &[GemmCall],
        inputs: blas_sys::cudaDataType,
    ) -> Result<(), EngineError> {
        if calls.len() == 1 || !grouped_gemm_available() || self.grouped_gemm_refusal().is_some() {
            for &call in calls {
                // SAFETY: the caller's contract.
                unsafe { self.gemm_call(call, inputs)? };
            }
            return Ok(());
        }
        for group in calls.chunks(GROUP_LIMIT) {
            // SAFETY: the caller's contract.
            if let Err(status) = unsafe { self.grouped_gemm(group, inputs)? } {
                self.refuse_grouped_gemm(format!("{status:?}"));
                for &call in group {
                    // SAFETY: the caller's contract.
                    unsafe { self.gemm_call(call, inputs)? };
                }
            }
        }
        Ok(())
    }

    /// One cublasGemmGroupedBatchedEx over `calls` (at most
    /// [`GROUP_LIMIT`]), each a group of one product; `Err` with cuBLAS's
    /// status where it refuses.
    ///
    /// # Safety
    /// As [`Self::gemm_calls`].
    unsafe fn grouped_gemm(
        &self,
        calls: &[GemmCall],
        inputs: blas_sys::cudaDataType,
    ) -> Result<Result<(), blas_sys::cublasStatus_t>, EngineError> {
        let g = calls.len();
        assert!(g <= GROUP_LIMIT);
        let mut words = GroupWords {
            count: (3 * g) as u64,
            words: [0; 3 * GROUP_LIMIT],
        };
        for (i, call) in calls.iter().enumerate() {
            words.words[i] = call.a.0;
            words.words[g + i] = call.b.0;
            words.words[2 * g + i] = call.c.0;
        }
        let mut addresses = self.alloc::<u64>(3 * g)?;
        let mut launch = self.stream.launch_builder(&self.f.group_words);
        launch.arg(&words).arg(&mut addresses);
        // SAFETY: `addresses` holds the 3·g words the kernel writes.
        unsafe { launch.launch(dense::threads(3 * g)) }.map_err(|e| gpu_error("group_words", e))?;
        let int =
            |f: fn(&GemmCall) -> usize| -> Vec<i32> { calls.iter().map(|c| f(c) as i32).collect() };
        let (m, n, k) = (int(|c| c.dims.0), int(|c| c.dims.1), int(|c| c.dims.2));
        let (lda, ldb, ldc) = (int(|c| c.a.1), int(|c| c.b.1), int(|c| c.c.1));
        let transa: Vec<_> = calls.iter().map(|c| c.trans.0).collect();
        let transb: Vec<_> = calls.iter().map(|c| c.trans.1).collect();
        let alpha = vec![1.0f32; g];
        let beta: Vec<f32> = calls.iter().map(|c| c.beta).collect();
        let sizes = vec![1i32; g];
        let (base, _written) = addresses.device_ptr_mut(&self.stream);
        let at = |i: usize| base + (i * g * std::mem::size_of::<u64>()) as u64;
        // SAFETY: the host arrays hold g values each and live past the
        // call, which reads them at once; the three address arrays lie in
        // `addresses` (written above, in stream order), which is freed in
        // stream order after the GEMM; the operands per the caller's
        // contract.
        let status = unsafe {
            blas_sys::cublasGemmGroupedBatchedEx(
                *self.blas.handle(),
                transa.as_ptr(),
                transb.as_ptr(),
                m.as_ptr(),
                n.as_ptr(),
                k.as_ptr(),
                alpha.as_ptr().cast(),
                at(0) as *const *const _,
                inputs,
                lda.as_ptr(),
                at(1) as *const *const _,
                inputs,
                ldb.as_ptr(),
                beta.as_ptr().cast(),
                at(2) as *const *mut _,
                F32,
                ldc.as_ptr(),
                g as i32,
                sizes.as_ptr(),
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        };
        Ok(match status {
            blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
            refused => Err(refused),
        })
    }

    /// The up projections a = x·w1ᵀ (and b = x·w3ᵀ for SwiGLU) and the
    /// hidden activation h of every member, from the group's rows `xb`
    /// (bf16): the forward's first half, which the backward recomputes
    /// (the same GEMMs, so the same bits).
    ///
    /// # Safety
    /// Each member's weights address its expert's, unwritten until the
    /// compute stream has run what this queues.
    #[allow(clippy::type_complexity)]
    pub(super) unsafe fn up_and_hidden_group(
        &self,
        kind: ExpertKind,
        xb: &CudaSlice<u16>,
        members: &[Member],
        (d, f): (usize, usize),
    ) -> Result<(CudaSlice<f32>, Option<CudaSlice<f32>>, CudaSlice<f32>), EngineError> {
        let n: usize = members.iter().map(|m| m.rows).sum();
        assert_eq!(xb.len(), n * d);
        let mut a = self.zeros(n * f)?;
        let mut h = self.zeros(n * f)?;
        // SAFETY: the weights per this function's contract; `a` and `xb`
        // hold the group's rows.
        unsafe { self.up_products(&mut a, xb, members, |w| w.w1, (d, f))? };
        let b = match kind {
            ExpertKind::SwiGlu => {
                let mut b = self.zeros(n * f)?;
                // SAFETY: as above.
                unsafe { self.up_products(&mut b, xb, members, |w| w.w3, (d, f))? };
                self.elementwise(
                    &self.f.swiglu_forward,
                    "swiglu_forward",
                    &[&a, &b],
                    &mut [&mut h],
                )?;
                Some(b)
            }
            ExpertKind::Gelu => {
                self.elementwise(&self.f.gelu_forward, "gelu_forward", &[&a], &mut [&mut h])?;
                None
            }
        };
        Ok((a, b, h))
    }

    /// out = x·wᵀ for every member, `weight` picking its up projection.
    ///
    /// # Safety
    /// As [`Self::up_and_hidden_group`].
    unsafe fn up_products(
        &self,
        out: &mut CudaSlice<f32>,
        xb: &CudaSlice<u16>,
        members: &[Member],
        weight: fn(&Weights) -> u64,
        (d, f): (usize, usize),
    ) -> Result<(), EngineError> {
        let (x, _rx) = xb.device_ptr(&self.stream);
        let (o, _wo) = out.device_ptr_mut(&self.stream);
        // SAFETY: `out` and `xb` hold the group's rows of F f32 and D bf16;
        // the weights per the caller's contract.
        unsafe { self.linear_products((o, x), members, |m| weight(&m.w), (d, f)) }
    }

    /// out = x·wᵀ for every member on its rows: `out` (rows of N f32) and
    /// `x` (rows of K bf16) at device addresses, `weight` picking the
    /// member's (N × K) weights.
    ///
    /// # Safety
    /// `out` and `x` address the group's rows in this context's memory,
    /// alive and used by no other stream until this stream has run the
    /// GEMMs; each weight as [`Self::up_and_hidden_group`] says.
    unsafe fn linear_products(
        &self,
        (out, x): (u64, u64),
        members: &[Member],
        weight: impl Fn(&Member) -> u64,
        (k, n): (usize, usize),
    ) -> Result<(), EngineError> {
        let calls: Vec<GemmCall> = row_starts(members)
            .map(|(r, m)| {
                let s = Shape { m: m.rows, k, n };
                GemmCall::linear(row_at(out, r, n, 4), row_at(x, r, k, 2), weight(m), s)
            })
            .collect();
        // SAFETY: each call's rows lie in `out` and `x`, its weights the
        // member's (this function's contract).
        unsafe { self.gemm_calls(&calls, BF16) }
    }

    /// out (the group's rows, n·D f32) = every member's expert on its rows
    /// of `x`, queued on the compute stream.
    ///
    /// # Safety
    /// As [`Self::up_and_hidden_group`], and `out` and `x` address the
    /// group's n·D f32 in this context's memory, alive until the stream
    /// has run the work, `x` not written meanwhile.
    pub(super) unsafe fn ffn_forward_group(
        &self,
        kind: ExpertKind,
        (out, x): (DeviceRows, DeviceRows),
        members: &[Member],
        (d, f): (usize, usize),
    ) -> Result<(), EngineError> {
        let n: usize = members.iter().map(|m| m.rows).sum();
        assert!(out.len == n * d && x.len == n * d);
        // SAFETY: x addresses n·d f32 (the contract, asserted).
        let xb = unsafe { self.to_bf16_raw(x.ptr, n * d)? };
        // SAFETY: the weights per this function's contract.
        let (_, _, h) = unsafe { self.up_and_hidden_group(kind, &xb, members, (d, f))? };
        let hb = self.to_bf16(&h)?;
        let (hb_ptr, _rh) = hb.device_ptr(&self.stream);
        // SAFETY: w2 per the contract; `out` holds the group's n·d f32 and
        // hb its n·f bf16.
        unsafe { self.linear_products((out.ptr, hb_ptr), members, |m| m.w.w2, (f, d)) }
    }

    /// The backward of every member in GPU memory, `[dx, dout, x]` the
    /// group's rows (n·D f32 each), queued on the compute stream: dx
    /// overwritten, and each member's gradient (laid out as its params)
    /// left in GPU memory, summed from zero or, for a group of one, from
    /// `held` (the params' count of f32 in host memory).
    ///
    /// # Safety
    /// As [`Self::ffn_forward_group`], for the three rows.
    pub(super) unsafe fn ffn_backward_group(
        &self,
        kind: ExpertKind,
        [dx, dout, x]: [DeviceRows; 3],
        held: Option<&[f32]>,
        members: &[Member],
        (d, f): (usize, usize),
    ) -> Result<Vec<CudaSlice<f32>>, EngineError> {
        let n: usize = members.iter().map(|m| m.rows).sum();
        assert!(dx.len == n * d && dout.len == n * d && x.len == n * d);
        assert!(
            held.is_none() || members.len() == 1,
            "a held gradient is one expert's"
        );
        // SAFETY: x and dout address n·d f32 (the contract, asserted).
        let (xb, doutb) = unsafe {
            (
                self.to_bf16_raw(x.ptr, n * d)?,
                self.to_bf16_raw(dout.ptr, n * d)?,
            )
        };
        // SAFETY: the weights per this function's contract.
        let (a, b, h) = unsafe { self.up_and_hidden_group(kind, &xb, members, (d, f))? };
        let mut ddx = self.zeros(n * d)?; // dx is overwritten, as on the cpu
        let count = kind.params(d, f);
        let in_len = count - d * f;
        let mut dhidden = self.zeros(n * f)?;
        let mut grads = self.gradient_buffers(count, members.len(), held)?;
        let hb = self.to_bf16(&h)?;
        let mut guards = Vec::with_capacity(grads.len());
        let mut grad_at = Vec::with_capacity(grads.len());
        for g in grads.iter_mut() {
            let (ptr, written) = g.device_ptr_mut(&self.stream);
            grad_at.push(ptr);
            guards.push(written);
        }
        let part = |j: usize, at: usize| grad_at[j] + (at * std::mem::size_of::<f32>()) as u64;
        let down = Shape { m: 0, k: f, n: d };
        // SAFETY: w2 per the contract, its gradient the last D·F of each
        // member's buffer; the rest sized here from n, d, f.
        unsafe {
            let w2 = |m: &Member| m.w.w2;
            let ops = (&mut dhidden, &doutb, &hb);
            self.linear_backward_group(ops, members, w2, &part, in_len, down)?;
        }
        // SAFETY: w1 (and w3) per the contract, their gradients the first
        // F·D (and the next) of each member's buffer; the rest sized here.
        unsafe {
            let hidden = (&a, b.as_ref(), &dhidden);
            self.up_backward_group(kind, hidden, (&mut ddx, &xb), members, &part, (d, f))?;
        }
        // SAFETY: dx addresses n·d f32 (the contract), as ddx holds.
        unsafe { self.copy_to(dx.ptr, &ddx)? };
        drop(guards); // the GEMMs' writes to the gradients, recorded
        Ok(grads)
    }

    /// A zeroed gradient buffer for each of `experts` experts of `count`
    /// params (laid out as its params, w1, w3, w2, so that it comes down in
    /// one copy), or for one, what `held` holds.
    fn gradient_buffers(
        &self,
        count: usize,
        experts: usize,
        held: Option<&[f32]>,
    ) -> Result<Vec<CudaSlice<f32>>, EngineError> {
        (0..experts)
            .map(|_| match held {
                None => self.zeros(count),
                Some(host) => self.upload(&host[..count]),
            })
            .collect()
    }

    /// The backward of the activation and the up projections, from the
    /// forward's `a`, `b` (SwiGLU) and the hidden gradient: `dx` += each
    /// member's input gradients, and its w1 (and w3) gradients into the
    /// first F·D (and the next) of its buffer at `part`.
    ///
    /// # Safety
    /// As [`Self::linear_backward_group`], for w1 and w3.
    unsafe fn up_backward_group(
        &self,
        kind: ExpertKind,
        (a, b, dhidden): (&CudaSlice<f32>, Option<&CudaSlice<f32>>, &CudaSlice<f32>),
        (dx, xb): (&mut CudaSlice<f32>, &CudaSlice<u16>),
        members: &[Member],
        part: &dyn Fn(usize, usize) -> u64,
        (d, f): (usize, usize),
    ) -> Result<(), EngineError> {
        let mut da = self.zeros(a.len())?;
        let up = Shape { m: 0, k: d, n: f };
        let w1 = |m: &Member| m.w.w1;
        match (kind, b) {
            (ExpertKind::SwiGlu, Some(b)) => {
                let mut db = self.zeros(a.len())?;
                self.elementwise(
                    &self.f.swiglu_backward,
                    "swiglu_backward",
                    &[a, b, dhidden],
                    &mut [&mut da, &mut db],
                )?;
                let (dab, dbb) = (self.to_bf16(&da)?, self.to_bf16(&db)?);
                let w3 = |m: &Member| m.w.w3;
                // SAFETY: the caller's contract.
                unsafe {
                    self.linear_backward_group((&mut *dx, &dab, xb), members, w1, part, 0, up)?;
                    self.linear_backward_group((dx, &dbb, xb), members, w3, part, f * d, up)
                }
            }
            _ => {
                self.elementwise(
                    &self.f.gelu_backward,
                    "gelu_backward",
                    &[a, dhidden],
                    &mut [&mut da],
                )?;
                let dab = self.to_bf16(&da)?;
                // SAFETY: the caller's contract.
                unsafe { self.linear_backward_group((dx, &dab, xb), members, w1, part, 0, up) }
            }
        }
    }

    /// For every member, on its rows (`s.m` taken from its count): its
    /// input gradient in `dx` += dout·w, then its weight gradient, at
    /// `part(member, at)`, += doutᵀ·x; the first for the whole group, then
    /// the second. `dout` and `x` are bf16.
    ///
    /// # Safety
    /// Each member's `weight` and gradient part address its expert's
    /// weights (N × K bf16) and f32 gradient, alive and used by no other
    /// stream until this stream has run the GEMMs; `dx`, `dout` and `x`
    /// hold the group's rows.
    unsafe fn linear_backward_group(
        &self,
        (dx, dout, x): (&mut CudaSlice<f32>, &CudaSlice<u16>, &CudaSlice<u16>),
        members: &[Member],
        weight: impl Fn(&Member) -> u64,
        part: &dyn Fn(usize, usize) -> u64,
        at: usize,
        s: Shape,
    ) -> Result<(), EngineError> {
        let (dout_ptr, _rd) = dout.device_ptr(&self.stream);
        let (x_ptr, _rx) = x.device_ptr(&self.stream);
        let (dx_ptr, _wdx) = dx.device_ptr_mut(&self.stream);
        let shape = |m: &Member| Shape { m: m.rows, ..s };
        let inputs: Vec<GemmCall> = row_starts(members)
            .map(|(r, m)| {
                let (dxr, doutr) = (row_at(dx_ptr, r, s.k, 4), row_at(dout_ptr, r, s.n, 2));
                GemmCall::input_grad(dxr, doutr, weight(m), shape(m))
            })
            .collect();
        let weights: Vec<GemmCall> = row_starts(members)
            .enumerate()
            .map(|(j, (r, m))| {
                let (doutr, xr) = (row_at(dout_ptr, r, s.n, 2), row_at(x_ptr, r, s.k, 2));
                GemmCall::weight_grad(part(j, at), doutr, xr, shape(m))
            })
            .collect();
        // SAFETY: each call's rows lie in the group's buffers; the weights
        // and gradients per this function's contract.
        unsafe {
            self.gemm_calls(&inputs, BF16)?;
            self.gemm_calls(&weights, BF16)
        }
    }
}
