//! The AdamW kernels and the raw buffers they run over: the scalar oracle,
//! the AVX2, AVX-512 and NEON variants, the run-time dispatch between them,
//! and the memory sweep that is their bandwidth ceiling. All of the
//! optimizer's SIMD and pointer arithmetic is in this file.

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

mod scalar {
    //! The scalar AdamW: the oracle every SIMD variant must equal bit for bit.
    //!
    //! `f32::mul_add` is a correctly rounded fused multiply-add on every target
    //! (a hardware FMA, or libm's `fmaf`), so it rounds exactly as `vfmadd` and
    //! `fmla` do.

    use half::{bf16, f16};

    use super::{
        RawStep, StepScalars, COPY_BF16, COPY_F16, COPY_F32, COPY_NONE, GRAD_BF16, GRAD_F16,
        GRAD_F32,
    };

    /// The update of one element. Returns the new (p, m, v).
    #[inline(always)]
    pub(crate) fn adamw_element(
        s: &StepScalars,
        g: f32,
        p: f32,
        m: f32,
        v: f32,
    ) -> (f32, f32, f32) {
        let g = g * s.grad_scale;
        let m = s.beta1.mul_add(m, s.one_minus_beta1 * g);
        let v = s.beta2.mul_add(v, (s.one_minus_beta2 * g) * g);
        let denom = v.sqrt().mul_add(s.inv_sqrt_bias2, s.eps);
        let delta = s.neg_step_size.mul_add(m / denom, s.neg_lr_wd * p);
        (p + delta, m, v)
    }

    /// # Safety
    /// `step` satisfies the `RawStep` invariant.
    pub(crate) unsafe fn step(s: &StepScalars, step: &RawStep) {
        // SAFETY: forwarded from the caller (RawStep invariant).
        unsafe {
            match step.grad_kind {
                GRAD_F32 => with_grad(s, step, |i| *step.grad.cast::<f32>().add(i)),
                GRAD_BF16 => with_grad(s, step, |i| (*step.grad.cast::<bf16>().add(i)).to_f32()),
                GRAD_F16 => with_grad(s, step, |i| (*step.grad.cast::<f16>().add(i)).to_f32()),
                other => unreachable!("grad kind {other}"),
            }
        }
    }

    /// # Safety
    /// `step` satisfies the `RawStep` invariant and `load(i)` reads grad element i.
    #[inline(always)]
    unsafe fn with_grad(s: &StepScalars, step: &RawStep, load: impl Fn(usize) -> f32) {
        // SAFETY: forwarded from the caller (RawStep invariant).
        unsafe {
            match step.copy_kind {
                COPY_NONE => run(s, step, &load, |_, _| {}),
                COPY_F32 => run(s, step, &load, |i, p| *step.copy.cast::<f32>().add(i) = p),
                COPY_BF16 => run(s, step, &load, |i, p| {
                    *step.copy.cast::<bf16>().add(i) = bf16::from_f32(p)
                }),
                COPY_F16 => run(s, step, &load, |i, p| {
                    *step.copy.cast::<f16>().add(i) = f16::from_f32(p)
                }),
                other => unreachable!("copy kind {other}"),
            }
        }
    }

    /// # Safety
    /// `step` satisfies the `RawStep` invariant; `load` and `store` touch element i only.
    #[inline(always)]
    unsafe fn run(
        s: &StepScalars,
        step: &RawStep,
        load: &impl Fn(usize) -> f32,
        store: impl Fn(usize, f32),
    ) {
        for i in 0..step.len {
            // SAFETY: i < len and every pointer is valid for len elements.
            unsafe {
                let p = step.params.add(i);
                let m = step.m.add(i);
                let v = step.v.add(i);
                let (np, nm, nv) = adamw_element(s, load(i), *p, *m, *v);
                *p = np;
                *m = nm;
                *v = nv;
                store(i, np);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! AVX2 + FMA + F16C AdamW: 8 lanes, the same operation sequence as `scalar.rs`.
    //! The tail (len mod 8) runs through the scalar oracle.

    use core::arch::x86_64::*;

    use super::{
        scalar, RawStep, StepScalars, COPY_BF16, COPY_F16, COPY_F32, COPY_NONE, GRAD_BF16,
        GRAD_F16, GRAD_F32,
    };

    const LANES: usize = 8;

    /// # Safety
    /// `step` satisfies the `RawStep` invariant and the CPU has AVX2, FMA and F16C.
    pub(crate) unsafe fn step(s: &StepScalars, step: &RawStep) {
        // SAFETY: forwarded from the caller; each arm is one monomorphized kernel.
        unsafe {
            match (step.grad_kind, step.copy_kind) {
                (GRAD_F32, COPY_NONE) => kernel::<GRAD_F32, COPY_NONE>(s, step),
                (GRAD_F32, COPY_F32) => kernel::<GRAD_F32, COPY_F32>(s, step),
                (GRAD_F32, COPY_BF16) => kernel::<GRAD_F32, COPY_BF16>(s, step),
                (GRAD_F32, COPY_F16) => kernel::<GRAD_F32, COPY_F16>(s, step),
                (GRAD_BF16, COPY_NONE) => kernel::<GRAD_BF16, COPY_NONE>(s, step),
                (GRAD_BF16, COPY_F32) => kernel::<GRAD_BF16, COPY_F32>(s, step),
                (GRAD_BF16, COPY_BF16) => kernel::<GRAD_BF16, COPY_BF16>(s, step),
                (GRAD_BF16, COPY_F16) => kernel::<GRAD_BF16, COPY_F16>(s, step),
                (GRAD_F16, COPY_NONE) => kernel::<GRAD_F16, COPY_NONE>(s, step),
                (GRAD_F16, COPY_F32) => kernel::<GRAD_F16, COPY_F32>(s, step),
                (GRAD_F16, COPY_BF16) => kernel::<GRAD_F16, COPY_BF16>(s, step),
                (GRAD_F16, COPY_F16) => kernel::<GRAD_F16, COPY_F16>(s, step),
                other => unreachable!("grad/copy kinds {other:?}"),
            }
        }
    }

    /// # Safety
    /// As [`step`], with `G`/`C` equal to the step's grad and copy kinds.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn kernel<const G: u8, const C: u8>(s: &StepScalars, step: &RawStep) {
        let grad_scale = _mm256_set1_ps(s.grad_scale);
        let neg_lr_wd = _mm256_set1_ps(s.neg_lr_wd);
        let beta1 = _mm256_set1_ps(s.beta1);
        let one_minus_beta1 = _mm256_set1_ps(s.one_minus_beta1);
        let beta2 = _mm256_set1_ps(s.beta2);
        let one_minus_beta2 = _mm256_set1_ps(s.one_minus_beta2);
        let inv_sqrt_bias2 = _mm256_set1_ps(s.inv_sqrt_bias2);
        let eps = _mm256_set1_ps(s.eps);
        let neg_step_size = _mm256_set1_ps(s.neg_step_size);

        let body_len = step.len - step.len % LANES;
        let mut i = 0;
        while i < body_len {
            // SAFETY: i + 8 <= len, and every pointer is valid for len elements
            // (RawStep invariant); unaligned loads and stores need no alignment.
            unsafe {
                let g = _mm256_mul_ps(load_grad::<G>(step.grad, i), grad_scale);
                let p = _mm256_loadu_ps(step.params.add(i));
                let m = _mm256_loadu_ps(step.m.add(i));
                let v = _mm256_loadu_ps(step.v.add(i));
                let m = _mm256_fmadd_ps(beta1, m, _mm256_mul_ps(one_minus_beta1, g));
                let v = _mm256_fmadd_ps(
                    beta2,
                    v,
                    _mm256_mul_ps(_mm256_mul_ps(one_minus_beta2, g), g),
                );
                let denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), inv_sqrt_bias2, eps);
                let decay = _mm256_mul_ps(neg_lr_wd, p);
                let delta = _mm256_fmadd_ps(neg_step_size, _mm256_div_ps(m, denom), decay);
                let p = _mm256_add_ps(p, delta);
                _mm256_storeu_ps(step.params.add(i), p);
                _mm256_storeu_ps(step.m.add(i), m);
                _mm256_storeu_ps(step.v.add(i), v);
                store_copy::<C>(step.copy, i, p);
            }
            i += LANES;
        }
        if body_len < step.len {
            // SAFETY: the tail is a sub-range of a valid step.
            unsafe { scalar::step(s, &step.range(body_len, step.len - body_len)) };
        }
    }

    /// # Safety
    /// `grad` is valid for elements i..i+8 of kind `G`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load_grad<const G: u8>(grad: *const u8, i: usize) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements at i.
        unsafe {
            match G {
                GRAD_F32 => _mm256_loadu_ps(grad.cast::<f32>().add(i)),
                GRAD_BF16 => {
                    let h = _mm_loadu_si128(grad.cast::<u16>().add(i).cast::<__m128i>());
                    // bf16 is the top half of an f32: widen and shift (exact).
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
                }
                _ => {
                    let h = _mm_loadu_si128(grad.cast::<u16>().add(i).cast::<__m128i>());
                    _mm256_cvtph_ps(h)
                }
            }
        }
    }

    /// # Safety
    /// For `C` ≠ none, `copy` is valid for elements i..i+8 of kind `C`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn store_copy<const C: u8>(copy: *mut u8, i: usize, p: __m256) {
        // SAFETY: the caller guarantees 8 writable elements at i.
        unsafe {
            match C {
                COPY_NONE => {}
                COPY_F32 => _mm256_storeu_ps(copy.cast::<f32>().add(i), p),
                COPY_BF16 => {
                    let h = f32_to_bf16(p);
                    _mm_storeu_si128(copy.cast::<u16>().add(i).cast::<__m128i>(), h);
                }
                _ => {
                    let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(p);
                    _mm_storeu_si128(copy.cast::<u16>().add(i).cast::<__m128i>(), h);
                }
            }
        }
    }

    /// Round to nearest even, NaNs quieted — exactly `half::bf16::from_f32`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn f32_to_bf16(p: __m256) -> __m128i {
        let bits = _mm256_castps_si256(p);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
        let rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
        let rounded = _mm256_srli_epi32::<16>(rounded);
        let abs = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fff_ffff));
        // No unsigned compare in AVX2; abs ≤ 0x7fffffff, so a signed one is exact.
        let is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80_0000));
        let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(0x0040));
        let out = _mm256_blendv_epi8(rounded, quiet, is_nan);
        // Every lane is ≤ 0xffff, so the unsigned-saturating pack is exact.
        _mm_packus_epi32(
            _mm256_castsi256_si128(out),
            _mm256_extracti128_si256::<1>(out),
        )
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! AVX-512F AdamW: 16 lanes, the same operation sequence as `scalar.rs`.
    //! The tail (len mod 16) runs through the scalar oracle.

    use core::arch::x86_64::*;

    use super::{
        scalar, RawStep, StepScalars, COPY_BF16, COPY_F16, COPY_F32, COPY_NONE, GRAD_BF16,
        GRAD_F16, GRAD_F32,
    };

    const LANES: usize = 16;

    /// # Safety
    /// `step` satisfies the `RawStep` invariant and the CPU has AVX-512F.
    pub(crate) unsafe fn step(s: &StepScalars, step: &RawStep) {
        // SAFETY: forwarded from the caller; each arm is one monomorphized kernel.
        unsafe {
            match (step.grad_kind, step.copy_kind) {
                (GRAD_F32, COPY_NONE) => kernel::<GRAD_F32, COPY_NONE>(s, step),
                (GRAD_F32, COPY_F32) => kernel::<GRAD_F32, COPY_F32>(s, step),
                (GRAD_F32, COPY_BF16) => kernel::<GRAD_F32, COPY_BF16>(s, step),
                (GRAD_F32, COPY_F16) => kernel::<GRAD_F32, COPY_F16>(s, step),
                (GRAD_BF16, COPY_NONE) => kernel::<GRAD_BF16, COPY_NONE>(s, step),
                (GRAD_BF16, COPY_F32) => kernel::<GRAD_BF16, COPY_F32>(s, step),
                (GRAD_BF16, COPY_BF16) => kernel::<GRAD_BF16, COPY_BF16>(s, step),
                (GRAD_BF16, COPY_F16) => kernel::<GRAD_BF16, COPY_F16>(s, step),
                (GRAD_F16, COPY_NONE) => kernel::<GRAD_F16, COPY_NONE>(s, step),
                (GRAD_F16, COPY_F32) => kernel::<GRAD_F16, COPY_F32>(s, step),
                (GRAD_F16, COPY_BF16) => kernel::<GRAD_F16, COPY_BF16>(s, step),
                (GRAD_F16, COPY_F16) => kernel::<GRAD_F16, COPY_F16>(s, step),
                other => unreachable!("grad/copy kinds {other:?}"),
            }
        }
    }

    /// # Safety
    /// As [`step`], with `G`/`C` equal to the step's grad and copy kinds.
    #[target_feature(enable = "avx512f")]
    unsafe fn kernel<const G: u8, const C: u8>(s: &StepScalars, step: &RawStep) {
        let grad_scale = _mm512_set1_ps(s.grad_scale);
        let neg_lr_wd = _mm512_set1_ps(s.neg_lr_wd);
        let beta1 = _mm512_set1_ps(s.beta1);
        let one_minus_beta1 = _mm512_set1_ps(s.one_minus_beta1);
        let beta2 = _mm512_set1_ps(s.beta2);
        let one_minus_beta2 = _mm512_set1_ps(s.one_minus_beta2);
        let inv_sqrt_bias2 = _mm512_set1_ps(s.inv_sqrt_bias2);
        let eps = _mm512_set1_ps(s.eps);
        let neg_step_size = _mm512_set1_ps(s.neg_step_size);

        let body_len = step.len - step.len % LANES;
        let mut i = 0;
        while i < body_len {
            // SAFETY: i + 16 <= len, and every pointer is valid for len elements
            // (RawStep invariant); unaligned loads and stores need no alignment.
            unsafe {
                let g = _mm512_mul_ps(load_grad::<G>(step.grad, i), grad_scale);
                let p = _mm512_loadu_ps(step.params.add(i));
                let m = _mm512_loadu_ps(step.m.add(i));
                let v = _mm512_loadu_ps(step.v.add(i));
                let m = _mm512_fmadd_ps(beta1, m, _mm512_mul_ps(one_minus_beta1, g));
                let v = _mm512_fmadd_ps(
                    beta2,
                    v,
                    _mm512_mul_ps(_mm512_mul_ps(one_minus_beta2, g), g),
                );
                let denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), inv_sqrt_bias2, eps);
                let decay = _mm512_mul_ps(neg_lr_wd, p);
                let delta = _mm512_fmadd_ps(neg_step_size, _mm512_div_ps(m, denom), decay);
                let p = _mm512_add_ps(p, delta);
                _mm512_storeu_ps(step.params.add(i), p);
                _mm512_storeu_ps(step.m.add(i), m);
                _mm512_storeu_ps(step.v.add(i), v);
                store_copy::<C>(step.copy, i, p);
            }
            i += LANES;
        }
        if body_len < step.len {
            // SAFETY: the tail is a sub-range of a valid step.
            unsafe { scalar::step(s, &step.range(body_len, step.len - body_len)) };
        }
    }

    /// # Safety
    /// `grad` is valid for elements i..i+16 of kind `G`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load_grad<const G: u8>(grad: *const u8, i: usize) -> __m512 {
        // SAFETY: the caller guarantees 16 readable elements at i.
        unsafe {
            match G {
                GRAD_F32 => _mm512_loadu_ps(grad.cast::<f32>().add(i)),
                GRAD_BF16 => {
                    let h = _mm256_loadu_si256(grad.cast::<u16>().add(i).cast::<__m256i>());
                    // bf16 is the top half of an f32: widen and shift (exact).
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                }
                _ => {
                    let h = _mm256_loadu_si256(grad.cast::<u16>().add(i).cast::<__m256i>());
                    _mm512_cvtph_ps(h)
                }
            }
        }
    }

    /// # Safety
    /// For `C` ≠ none, `copy` is valid for elements i..i+16 of kind `C`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store_copy<const C: u8>(copy: *mut u8, i: usize, p: __m512) {
        // SAFETY: the caller guarantees 16 writable elements at i.
        unsafe {
            match C {
                COPY_NONE => {}
                COPY_F32 => _mm512_storeu_ps(copy.cast::<f32>().add(i), p),
                COPY_BF16 => {
                    let h = f32_to_bf16(p);
                    _mm256_storeu_si256(copy.cast::<u16>().add(i).cast::<__m256i>(), h);
                }
                _ => {
                    let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(p);
                    _mm256_storeu_si256(copy.cast::<u16>().add(i).cast::<__m256i>(), h);
                }
            }
        }
    }

    /// Round to nearest even, NaNs quieted — exactly `half::bf16::from_f32`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn f32_to_bf16(p: __m512) -> __m256i {
        let bits = _mm512_castps_si512(p);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
        let rounded = _mm512_srli_epi32::<16>(rounded);
        let abs = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fff_ffff));
        let is_nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f80_0000));
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(0x0040));
        let out = _mm512_mask_blend_epi32(is_nan, rounded, quiet);
        _mm512_cvtepi32_epi16(out)
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    //! NEON AdamW (aarch64): 4 lanes, the same operation sequence as `scalar.rs`.
    //! The tail (len mod 4) runs through the scalar oracle. f16 conversions go
    //! through `half` lane by lane (exact), since Rust's f16 NEON types are not
    //! stable; bf16 is integer work and stays in registers.

    use core::arch::aarch64::*;

    use half::f16;

    use super::{
        scalar, RawStep, StepScalars, COPY_BF16, COPY_F16, COPY_F32, COPY_NONE, GRAD_BF16,
        GRAD_F16, GRAD_F32,
    };

    const LANES: usize = 4;

    /// # Safety
    /// `step` satisfies the `RawStep` invariant and the CPU has NEON.
    pub(crate) unsafe fn step(s: &StepScalars, step: &RawStep) {
        // SAFETY: forwarded from the caller; each arm is one monomorphized kernel.
        unsafe {
            match (step.grad_kind, step.copy_kind) {
                (GRAD_F32, COPY_NONE) => kernel::<GRAD_F32, COPY_NONE>(s, step),
                (GRAD_F32, COPY_F32) => kernel::<GRAD_F32, COPY_F32>(s, step),
                (GRAD_F32, COPY_BF16) => kernel::<GRAD_F32, COPY_BF16>(s, step),
                (GRAD_F32, COPY_F16) => kernel::<GRAD_F32, COPY_F16>(s, step),
                (GRAD_BF16, COPY_NONE) => kernel::<GRAD_BF16, COPY_NONE>(s, step),
                (GRAD_BF16, COPY_F32) => kernel::<GRAD_BF16, COPY_F32>(s, step),
                (GRAD_BF16, COPY_BF16) => kernel::<GRAD_BF16, COPY_BF16>(s, step),
                (GRAD_BF16, COPY_F16) => kernel::<GRAD_BF16, COPY_F16>(s, step),
                (GRAD_F16, COPY_NONE) => kernel::<GRAD_F16, COPY_NONE>(s, step),
                (GRAD_F16, COPY_F32) => kernel::<GRAD_F16, COPY_F32>(s, step),
                (GRAD_F16, COPY_BF16) => kernel::<GRAD_F16, COPY_BF16>(s, step),
                (GRAD_F16, COPY_F16) => kernel::<GRAD_F16, COPY_F16>(s, step),
                other => unreachable!("grad/copy kinds {other:?}"),
            }
        }
    }

    /// # Safety
    /// As [`step`], with `G`/`C` equal to the step's grad and copy kinds.
    #[target_feature(enable = "neon")]
    unsafe fn kernel<const G: u8, const C: u8>(s: &StepScalars, step: &RawStep) {
        let grad_scale = vdupq_n_f32(s.grad_scale);
        let neg_lr_wd = vdupq_n_f32(s.neg_lr_wd);
        let beta1 = vdupq_n_f32(s.beta1);
        let one_minus_beta1 = vdupq_n_f32(s.one_minus_beta1);
        let beta2 = vdupq_n_f32(s.beta2);
        let one_minus_beta2 = vdupq_n_f32(s.one_minus_beta2);
        let inv_sqrt_bias2 = vdupq_n_f32(s.inv_sqrt_bias2);
        let eps = vdupq_n_f32(s.eps);
        let neg_step_size = vdupq_n_f32(s.neg_step_size);

        let body_len = step.len - step.len % LANES;
        let mut i = 0;
        while i < body_len {
            // SAFETY: i + 4 <= len, and every pointer is valid for len elements
            // (RawStep invariant). vfmaq_f32(a, b, c) = a + b·c, fused.
            unsafe {
                let g = vmulq_f32(load_grad::<G>(step.grad, i), grad_scale);
                let p = vld1q_f32(step.params.add(i));
                let m = vld1q_f32(step.m.add(i));
                let v = vld1q_f32(step.v.add(i));
                let m = vfmaq_f32(vmulq_f32(one_minus_beta1, g), beta1, m);
                let v = vfmaq_f32(vmulq_f32(vmulq_f32(one_minus_beta2, g), g), beta2, v);
                let denom = vfmaq_f32(eps, vsqrtq_f32(v), inv_sqrt_bias2);
                let decay = vmulq_f32(neg_lr_wd, p);
                let delta = vfmaq_f32(decay, neg_step_size, vdivq_f32(m, denom));
                let p = vaddq_f32(p, delta);
                vst1q_f32(step.params.add(i), p);
                vst1q_f32(step.m.add(i), m);
                vst1q_f32(step.v.add(i), v);
                store_copy::<C>(step.copy, i, p);
            }
            i += LANES;
        }
        if body_len < step.len {
            // SAFETY: the tail is a sub-range of a valid step.
            unsafe { scalar::step(s, &step.range(body_len, step.len - body_len)) };
        }
    }

    /// # Safety
    /// `grad` is valid for elements i..i+4 of kind `G`.
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn load_grad<const G: u8>(grad: *const u8, i: usize) -> float32x4_t {
        // SAFETY: the caller guarantees 4 readable elements at i.
        unsafe {
            match G {
                GRAD_F32 => vld1q_f32(grad.cast::<f32>().add(i)),
                GRAD_BF16 => {
                    let h = vld1_u16(grad.cast::<u16>().add(i));
                    vreinterpretq_f32_u32(vshll_n_u16::<16>(h))
                }
                _ => {
                    let h = grad.cast::<f16>().add(i);
                    let lanes = [
                        (*h).to_f32(),
                        (*h.add(1)).to_f32(),
                        (*h.add(2)).to_f32(),
                        (*h.add(3)).to_f32(),
                    ];
                    vld1q_f32(lanes.as_ptr())
                }
            }
        }
    }

    /// # Safety
    /// For `C` ≠ none, `copy` is valid for elements i..i+4 of kind `C`.
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn store_copy<const C: u8>(copy: *mut u8, i: usize, p: float32x4_t) {
        // SAFETY: the caller guarantees 4 writable elements at i.
        unsafe {
            match C {
                COPY_NONE => {}
                COPY_F32 => vst1q_f32(copy.cast::<f32>().add(i), p),
                COPY_BF16 => vst1_u16(copy.cast::<u16>().add(i), f32_to_bf16(p)),
                _ => {
                    let mut lanes = [0f32; 4];
                    vst1q_f32(lanes.as_mut_ptr(), p);
                    let out = copy.cast::<f16>().add(i);
                    for (k, lane) in lanes.iter().enumerate() {
                        *out.add(k) = f16::from_f32(*lane);
                    }
                }
            }
        }
    }

    /// Round to nearest even, NaNs quieted — exactly `half::bf16::from_f32`.
    #[target_feature(enable = "neon")]
    #[inline]
    fn f32_to_bf16(p: float32x4_t) -> uint16x4_t {
        let bits = vreinterpretq_u32_f32(p);
        let lsb = vandq_u32(vshrq_n_u32::<16>(bits), vdupq_n_u32(1));
        let rounded = vshrq_n_u32::<16>(vaddq_u32(bits, vaddq_u32(vdupq_n_u32(0x7fff), lsb)));
        let abs = vandq_u32(bits, vdupq_n_u32(0x7fff_ffff));
        let is_nan = vcgtq_u32(abs, vdupq_n_u32(0x7f80_0000));
        let quiet = vorrq_u32(vshrq_n_u32::<16>(bits), vdupq_n_u32(0x0040));
        vmovn_u32(vbslq_u32(is_nan, quiet, rounded))
    }
}
