//! AdamW kernels: one scalar oracle and SIMD variants chosen at run time.
//!
//! Every variant evaluates exactly the same sequence of IEEE operations per
//! element, so they agree bit for bit with the scalar oracle (`scalar.rs`):
//!
//! ```text
//! g     = grad · grad_scale                       (mul; grad_scale = 1 is exact)
//! m     = fma(β1, m, (1−β1)·g)
//! v     = fma(β2, v, ((1−β2)·g)·g)
//! denom = fma(√v, 1/√(1−β2^t), ε)
//! delta = fma(−lr/(1−β1^t), m / denom, (−lr·wd)·p)
//! p     = p + delta
//! copy  = round_to_nearest_even(p)                (optional bf16 / f16 / f32 copy)
//! ```
//!
//! This is `torch.optim.AdamW`'s update, `p·(1 − lr·wd) − step`, arranged so
//! that p is rounded once a step, at the final add: the decay and the Adam
//! step are both small next to p, and summing them first keeps their
//! rounding errors far below p's ulp. (Multiplying by `1 − lr·wd` rounded to
//! f32 would instead carry a systematic error of up to 3e-8 a step.)
//!
//! One pass over memory: each element's grad, param, m and v are read once
//! and param, m, v and the copy written once. Nothing is allocated.

mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;

use half::{bf16, f16};

use crate::OptimError;

/// AdamW hyper-parameters, named and defaulted as `torch.optim.AdamW`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWHyper {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamWHyper {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

impl AdamWHyper {
    /// Rejects values torch would reject (negative lr, betas outside [0, 1), ε < 0).
    pub fn validate(&self) -> Result<(), OptimError> {
        let bad = |name: &'static str, value: f32| OptimError::InvalidHyper { name, value };
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(bad("lr", self.lr));
        }
        if !(0.0..1.0).contains(&self.beta1) {
            return Err(bad("beta1", self.beta1));
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return Err(bad("beta2", self.beta2));
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(bad("eps", self.eps));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(bad("weight_decay", self.weight_decay));
        }
        Ok(())
    }
}

/// The per-step constants of one expert's update, derived once from the
/// hyper-parameters and that expert's own step number `t` (1-based).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScalars {
    pub grad_scale: f32,
    pub neg_lr_wd: f32,
    pub beta1: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub inv_sqrt_bias2: f32,
    pub eps: f32,
    pub neg_step_size: f32,
}

impl StepScalars {
    /// Constants for step `t` (t ≥ 1). `grad_scale` multiplies every gradient
    /// element first (global-norm clipping, accumulation averaging); 1.0 is exact.
    pub fn new(hyper: &AdamWHyper, t: u64, grad_scale: f32) -> Self {
        assert!(t >= 1, "AdamW step numbers start at 1");
        // Bias corrections in f64, then rounded once to f32.
        let t = t as f64;
        let bias1 = 1.0 - (hyper.beta1 as f64).powf(t);
        let bias2 = 1.0 - (hyper.beta2 as f64).powf(t);
        Self {
            grad_scale,
            neg_lr_wd: -(hyper.lr as f64 * hyper.weight_decay as f64) as f32,
            beta1: hyper.beta1,
            one_minus_beta1: (1.0 - hyper.beta1 as f64) as f32,
            beta2: hyper.beta2,
            one_minus_beta2: (1.0 - hyper.beta2 as f64) as f32,
            inv_sqrt_bias2: (1.0 / bias2.sqrt()) as f32,
            eps: hyper.eps,
            neg_step_size: -(hyper.lr as f64 / bias1) as f32,
        }
    }
}

/// A gradient in any of the precisions the device hands back.
#[derive(Clone, Copy, Debug)]
pub enum GradRef<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

impl GradRef<'_> {
    pub fn len(&self) -> usize {
        match self {
            GradRef::F32(g) => g.len(),
            GradRef::Bf16(g) => g.len(),
            GradRef::F16(g) => g.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where the new params' compute copy goes (the copy uploaded to the device).
#[derive(Debug, Default)]
pub enum CopyOut<'a> {
    #[default]
    None,
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

impl CopyOut<'_> {
    /// The copy's length, or `None` when there is no copy.
    pub fn copy_len(&self) -> Option<usize> {
        match self {
            CopyOut::None => None,
            CopyOut::F32(c) => Some(c.len()),
            CopyOut::Bf16(c) => Some(c.len()),
            CopyOut::F16(c) => Some(c.len()),
        }
    }
}

/// Grad element type, as a const-generic tag for the SIMD kernels.
pub(crate) const GRAD_F32: u8 = 0;
pub(crate) const GRAD_BF16: u8 = 1;
pub(crate) const GRAD_F16: u8 = 2;
/// Copy element type, as a const-generic tag for the SIMD kernels.
pub(crate) const COPY_NONE: u8 = 0;
pub(crate) const COPY_F32: u8 = 1;
pub(crate) const COPY_BF16: u8 = 2;
pub(crate) const COPY_F16: u8 = 3;

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

/// The kernel variants, from slowest to fastest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Portable Rust; the oracle every other variant is tested against.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C: 8 lanes.
    Avx2Fma,
    /// x86-64 with AVX-512F: 16 lanes.
    Avx512,
    /// aarch64 with NEON: 4 lanes.
    Neon,
}

impl Kernel {
    pub const ALL: [Kernel; 4] = [
        Kernel::Scalar,
        Kernel::Avx2Fma,
        Kernel::Avx512,
        Kernel::Neon,
    ];

    /// The fastest variant this CPU supports.
    pub fn detect() -> Kernel {
        [Kernel::Avx512, Kernel::Avx2Fma, Kernel::Neon]
            .into_iter()
            .find(|k| k.is_supported())
            .unwrap_or(Kernel::Scalar)
    }

    /// Every variant this CPU can run, the scalar oracle first.
    pub fn supported() -> impl Iterator<Item = Kernel> {
        Kernel::ALL.into_iter().filter(|k| k.is_supported())
    }

    pub fn is_supported(self) -> bool {
        match self {
            Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2Fma => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "aarch64")]
            Kernel::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Avx2Fma => "avx2_fma",
            Kernel::Avx512 => "avx512",
            Kernel::Neon => "neon",
        }
    }

    /// Parses a [`Kernel::name`].
    pub fn from_name(name: &str) -> Option<Kernel> {
        Kernel::ALL.into_iter().find(|k| k.name() == name)
    }

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

/// One AdamW update of `params`, `m` and `v` in place, with an optional fused
/// copy of the new params. `step.t` is this expert's own step number (≥ 1).
///
/// Errors when a buffer's length differs from `params`, or when `kernel` is
/// not supported by this CPU.
pub fn adamw_step(
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
