//! AdamW kernels: one scalar oracle and SIMD variants chosen at run time.
//!
//! Every variant evaluates exactly the same sequence of IEEE operations per
//! element, so they agree bit for bit with the scalar oracle (`kernels/scalar.rs`):
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

mod kernels;

pub use kernels::memory_sweep;
pub(crate) use kernels::RawStep;

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
    ///
    /// Each hyper-parameter is taken as the decimal written for it (`0.999`,
    /// not the f32 nearest it, 0.99900001287…), as torch takes its Python
    /// floats: 1 − β, the bias corrections and the step size are formed
    /// from those decimals in f64 and rounded once to f32. So 1 − β2 is
    /// exactly torch's 0.001, where 1 − f32(0.999) would put every second
    /// moment 1.3e-5 (relative) below torch's.
    pub fn new(hyper: &AdamWHyper, t: u64, grad_scale: f32) -> Self {
        assert!(t >= 1, "AdamW step numbers start at 1");
        let (lr, beta1, beta2) = (
            decimal(hyper.lr),
            decimal(hyper.beta1),
            decimal(hyper.beta2),
        );
        let t = t as f64;
        let bias1 = 1.0 - beta1.powf(t);
        let bias2 = 1.0 - beta2.powf(t);
        Self {
            grad_scale,
            neg_lr_wd: -(lr * decimal(hyper.weight_decay)) as f32,
            beta1: hyper.beta1,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: hyper.beta2,
            one_minus_beta2: (1.0 - beta2) as f32,
            inv_sqrt_bias2: (1.0 / bias2.sqrt()) as f32,
            eps: hyper.eps,
            neg_step_size: -(lr / bias1) as f32,
        }
    }
}

/// The shortest decimal that reads back as `x` (Rust prints an f32 that
/// way), as f64: the value a user wrote for a hyper-parameter.
fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
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
    copy: CopyOut<'_>,
) -> Result<(), OptimError> {
    kernels::step_slices(kernel, scalars, params, m, v, grad, copy)
}
