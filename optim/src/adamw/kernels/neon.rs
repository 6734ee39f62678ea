//! NEON AdamW (aarch64): 4 lanes, the same operation sequence as `scalar.rs`.
//! The tail (len mod 4) runs through the scalar oracle. f16 conversions go
//! through `half` lane by lane (exact), since Rust's f16 NEON types are not
//! stable; bf16 is integer work and stays in registers.

use core::arch::aarch64::*;

use half::f16;

use super::{
    scalar, RawStep, StepScalars, COPY_BF16, COPY_F16, COPY_F32, COPY_NONE, GRAD_BF16, GRAD_F16,
    GRAD_F32,
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
