//! The AdamW kernels and the raw buffers they run over: the scalar oracle,
//! the AVX2, AVX-512 and NEON variants, the run-time dispatch between them,
//! and the memory sweep that is their bandwidth ceiling. All of the
//! optimizer's SIMD and pointer arithmetic is in this module (each
//! variant in a file of its own).

use super::{CopyOut, GradRef, Kernel, StepScalars};
use crate::OptimError;

/// Grad element type, as a const-generic tag for the SIMD kernels.
const GRAD_F32: u8 = 0;
const GRAD_BF16: u8 = 1;
const GRAD_F16: u8 = 2;
/// Copy element type, as a const-generic tag for the SIMD kernels.
const COPY_NONE: u8 = 0;
const COPY_F32: u8 = 1;
const COPY_BF16: u8 = 2;
const COPY_F16: u8 = 3;

/// One update's buffers as raw pointers, so a large expert can be cut into
/// disjoint ranges and stepped by several threads.
///
/// Invariant (upheld by [`RawStep::from_slices`] and [`RawStep::range`]):
/// every pointer is valid for `len` elements of its type, the ranges do not
/// overlap one another, and nothing else accesses them while a kernel runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawStep {
    pub params: *mut f32,
    pub m: *mut f32,
    pub v: *mut f32,
    pub grad: *const u8,
    pub grad_kind: u8,
    pub copy: *mut u8,
    pub copy_kind: u8,
    pub len: usize,
}

// SAFETY: a RawStep is a set of exclusive borrows turned into pointers; it is
// moved to the thread that runs it and used by that thread alone (see the
// invariant above), exactly as the `&mut [f32]` it came from could be.
unsafe impl Send for RawStep {}

impl RawStep {
    /// Checks every length against `params` and captures the buffers.
    pub fn from_slices(
        params: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        grad: GradRef<'_>,
        copy: &mut CopyOut<'_>,
    ) -> Result<RawStep, OptimError> {
        let len = params.len();
        let check = |what: &'static str, got: usize| {
            if got == len {
                Ok(())
            } else {
                Err(OptimError::LengthMismatch {
                    what,
                    expected: len,
                    got,
                })
            }
        };
        check("m", m.len())?;
        check("v", v.len())?;
        check("grad", grad.len())?;
        if let Some(copy_len) = copy.copy_len() {
            check("copy", copy_len)?;
        }
        let (grad_ptr, grad_kind) = match grad {
            GradRef::F32(g) => (g.as_ptr().cast::<u8>(), GRAD_F32),
            GradRef::Bf16(g) => (g.as_ptr().cast::<u8>(), GRAD_BF16),
            GradRef::F16(g) => (g.as_ptr().cast::<u8>(), GRAD_F16),
        };
        let (copy_ptr, copy_kind) = match copy {
            CopyOut::None => (core::ptr::null_mut(), COPY_NONE),
            CopyOut::F32(c) => (c.as_mut_ptr().cast::<u8>(), COPY_F32),
            CopyOut::Bf16(c) => (c.as_mut_ptr().cast::<u8>(), COPY_BF16),
            CopyOut::F16(c) => (c.as_mut_ptr().cast::<u8>(), COPY_F16),
        };
        Ok(RawStep {
            params: params.as_mut_ptr(),
            m: m.as_mut_ptr(),
            v: v.as_mut_ptr(),
            grad: grad_ptr,
            grad_kind,
            copy: copy_ptr,
            copy_kind,
            len,
        })
    }

    /// The elements `start..start + len` of this step, as a step of their own.
    pub fn range(&self, start: usize, len: usize) -> RawStep {
        assert!(start <= self.len, "range start {start} past {}", self.len);
        assert!(len <= self.len - start, "range end past {}", self.len);
        let grad_elem = if self.grad_kind == GRAD_F32 { 4 } else { 2 };
        let copy_elem = match self.copy_kind {
            COPY_NONE => 0,
            COPY_F32 => 4,
            _ => 2,
        };
        // SAFETY: start + len <= self.len (asserted above), so each offset
        // pointer stays inside the buffer it was derived from; a null copy
        // pointer is never offset (copy_elem = 0 gives offset 0).
        unsafe {
            RawStep {
                params: self.params.add(start),
                m: self.m.add(start),
                v: self.v.add(start),
                grad: self.grad.add(start * grad_elem),
                grad_kind: self.grad_kind,
                copy: if self.copy.is_null() {
                    self.copy
                } else {
                    self.copy.add(start * copy_elem)
                },
                copy_kind: self.copy_kind,
                len,
            }
        }
    }
}

impl Kernel {
    /// Runs one AdamW update over the buffers.
    ///
    /// # Safety
    /// 1. `step` satisfies the [`RawStep`] invariant: every pointer is valid
    ///    for `step.len` elements and nothing else touches them meanwhile.
    /// 2. `self.is_supported()` on this CPU.
    pub(crate) unsafe fn run(self, scalars: &StepScalars, step: &RawStep) {
        debug_assert!(self.is_supported(), "{} not supported here", self.name());
        match self {
            // SAFETY: (1) is the caller's; scalar code needs no CPU feature.
            Kernel::Scalar => unsafe { scalar::step(scalars, step) },
            // SAFETY: (1) is the caller's; (2) AVX2+FMA+F16C checked by the caller.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2Fma => unsafe { avx2::step(scalars, step) },
            // SAFETY: (1) is the caller's; (2) AVX-512F checked by the caller.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { avx512::step(scalars, step) },
            // SAFETY: (1) is the caller's; (2) NEON checked by the caller.
            #[cfg(target_arch = "aarch64")]
            Kernel::Neon => unsafe { neon::step(scalars, step) },
            #[allow(unreachable_patterns)]
            other => unreachable!("kernel {} is not built for this target", other.name()),
        }
    }
}

/// [`adamw_step`](super::adamw_step) over checked slices.
pub(super) fn step_slices(
    kernel: Kernel,
    scalars: &StepScalars,
    params: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grad: GradRef<'_>,
    mut copy: CopyOut<'_>,
) -> Result<(), OptimError> {
    if !kernel.is_supported() {
        return Err(OptimError::KernelUnsupported {
            kernel: kernel.name(),
        });
    }
    let step = RawStep::from_slices(params, m, v, grad, &mut copy)?;
    // SAFETY: (1) `step` was built from exclusive borrows of matching length
    // (checked by from_slices) that outlive this call; (2) checked above.
    unsafe { kernel.run(scalars, &step) };
    Ok(())
}

/// AdamW's memory traffic with trivial arithmetic (`rmw4r3w` of
/// `shared/bench/membw.c`): reads p, m, v and g, writes p, m and v once. It
/// is compiled for the widest vectors this CPU has, as `membw.c` is with
/// `-march=native`, so the ceiling it measures is not held back by baseline
/// (SSE2) code generation.
pub fn memory_sweep(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected on this CPU just above.
            return unsafe { sweep_avx512(p, m, v, g) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected on this CPU just above.
            return unsafe { sweep_avx2(p, m, v, g) };
        }
    }
    sweep(p, m, v, g)
}

/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sweep_avx512(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
    sweep(p, m, v, g)
}

/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sweep_avx2(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
    sweep(p, m, v, g)
}

#[inline(always)]
fn sweep(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
    const B1: f32 = 0.9;
    const B2: f32 = 0.999;
    const K: f32 = -1e-7;
    for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
        let mi = *m * B1 + g;
        let vi = *v * B2 + g * g;
        *m = mi;
        *v = vi;
        *p += K * (mi + vi);
    }
}

mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "aarch64")]
mod neon;
