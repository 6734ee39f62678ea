//! The scalar AdamW: the oracle every SIMD variant must equal bit for bit.
//!
//! `f32::mul_add` is a correctly rounded fused multiply-add on every target
//! (a hardware FMA, or libm's `fmaf`), so it rounds exactly as `vfmadd` and
//! `fmla` do.

use half::{bf16, f16};

use super::{
    RawStep, StepScalars, COPY_BF16, COPY_F16, COPY_F32, COPY_NONE, GRAD_BF16, GRAD_F16, GRAD_F32,
};

/// The update of one element. Returns the new (p, m, v).
#[inline(always)]
pub(crate) fn adamw_element(s: &StepScalars, g: f32, p: f32, m: f32, v: f32) -> (f32, f32, f32) {
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
