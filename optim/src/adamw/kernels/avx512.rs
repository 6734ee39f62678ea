//! AVX-512F AdamW: 16 lanes, the same operation sequence as `scalar.rs`.
//! The tail (len mod 16) runs through the scalar oracle.

use core::arch::x86_64::*;

use super::{
    scalar, RawStep, StepScalars, COPY_BF16, COPY_F16, COPY_F32, COPY_NONE, GRAD_BF16, GRAD_F16,
    GRAD_F32,
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
