//! Every SIMD AdamW variant equals the scalar oracle bit for bit; the oracle
//! equals a plain f64 evaluation of torch's AdamW formula closely.

use half::{bf16, f16};
use proptest::prelude::*;
use strata_optim::{adamw_step, AdamWHyper, CopyOut, GradRef, Kernel, StepScalars};

#[derive(Clone, Copy, Debug)]
enum GradKind {
    F32,
    Bf16,
    F16,
}

#[derive(Clone, Copy, Debug)]
enum CopyKind {
    None,
    F32,
    Bf16,
    F16,
}

const GRAD_KINDS: [GradKind; 3] = [GradKind::F32, GradKind::Bf16, GradKind::F16];
const COPY_KINDS: [CopyKind; 4] = [CopyKind::None, CopyKind::F32, CopyKind::Bf16, CopyKind::F16];

/// Params, moments and the copy after `grads.len()` steps, as raw bits.
#[derive(Debug, PartialEq)]
struct Outcome {
    params: Vec<u32>,
    m: Vec<u32>,
    v: Vec<u32>,
    copy: Vec<u32>,
}

fn run(
    kernel: Kernel,
    hyper: &AdamWHyper,
    init: &[f32],
    grads: &[Vec<f32>],
    grad_kind: GradKind,
    copy_kind: CopyKind,
    grad_scale: f32,
) -> Outcome {
    let n = init.len();
    let mut p = init.to_vec();
    let mut m = vec![0.0f32; n];
    let mut v = vec![0.0f32; n];
    let mut c32 = vec![0.0f32; n];
    let mut cb = vec![bf16::ZERO; n];
    let mut ch = vec![f16::ZERO; n];
    for (t, g) in grads.iter().enumerate() {
        let gb: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
        let gh: Vec<f16> = g.iter().map(|&x| f16::from_f32(x)).collect();
        let grad = match grad_kind {
            GradKind::F32 => GradRef::F32(g),
            GradKind::Bf16 => GradRef::Bf16(&gb),
            GradKind::F16 => GradRef::F16(&gh),
        };
        let copy = match copy_kind {
            CopyKind::None => CopyOut::None,
            CopyKind::F32 => CopyOut::F32(&mut c32),
            CopyKind::Bf16 => CopyOut::Bf16(&mut cb),
            CopyKind::F16 => CopyOut::F16(&mut ch),
        };
        let scalars = StepScalars::new(hyper, t as u64 + 1, grad_scale);
        adamw_step(kernel, &scalars, &mut p, &mut m, &mut v, grad, copy).unwrap();
    }
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let copy = match copy_kind {
        CopyKind::None => vec![],
        CopyKind::F32 => bits(&c32),
        CopyKind::Bf16 => cb.iter().map(|x| x.to_bits() as u32).collect(),
        CopyKind::F16 => ch.iter().map(|x| x.to_bits() as u32).collect(),
    };
    Outcome {
        params: bits(&p),
        m: bits(&m),
        v: bits(&v),
        copy,
    }
}

fn values(n: usize, scale: f32) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(-1.0f32..1.0, n).prop_map(move |v| v.iter().map(|x| x * scale).collect())
}

fn case() -> impl Strategy<Value = (Vec<f32>, Vec<Vec<f32>>, AdamWHyper)> {
    // Lengths around the 4/8/16-lane widths, never only multiples of them.
    (0usize..70, 1usize..4).prop_flat_map(|(n, steps)| {
        (
            values(n, 2.0),
            prop::collection::vec(values(n, 5.0), steps),
            (1e-5f32..1e-1, 0.0f32..0.99, 0.9f32..0.9999, 0.0f32..0.2),
        )
            .prop_map(|(init, grads, (lr, beta1, beta2, weight_decay))| {
                let hyper = AdamWHyper {
                    lr,
                    beta1,
                    beta2,
                    eps: 1e-8,
                    weight_decay,
                };
                (init, grads, hyper)
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn simd_variants_equal_the_scalar_oracle_bit_for_bit(
        (init, grads, hyper) in case(),
        grad_scale in prop_oneof![Just(1.0f32), 0.01f32..1.0],
    ) {
        for kernel in Kernel::supported().filter(|&k| k != Kernel::Scalar) {
            for grad_kind in GRAD_KINDS {
                for copy_kind in COPY_KINDS {
                    let oracle = run(Kernel::Scalar, &hyper, &init, &grads, grad_kind, copy_kind, grad_scale);
                    let simd = run(kernel, &hyper, &init, &grads, grad_kind, copy_kind, grad_scale);
                    prop_assert_eq!(
                        &oracle, &simd,
                        "{} differs from scalar: grad {:?}, copy {:?}, n {}",
                        kernel.name(), grad_kind, copy_kind, init.len()
                    );
                }
            }
        }
    }
}

#[test]
fn simd_variants_round_special_values_like_the_oracle() {
    // Large values overflow the f16 copy; tiny ones are f16 subnormals;
    // ties exercise round-to-nearest-even in the bf16 copy.
    let mut init: Vec<f32> = vec![
        70000.0,
        -70000.0,
        1e-6,
        -3e-7,
        1.0 + f32::EPSILON * 128.0,
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        0.0,
        -0.0,
        65504.0,
        65520.0,
        3.4e38,
    ];
    init.extend((0..37).map(|i| (i as f32 - 18.0) * 0.37));
    let grads = vec![init.iter().map(|x| x * 0.5).collect::<Vec<_>>()];
    let hyper = AdamWHyper {
        lr: 0.0,
        weight_decay: 0.0,
        ..AdamWHyper::default()
    };
    for kernel in Kernel::supported() {
        for copy_kind in COPY_KINDS {
            for grad_kind in GRAD_KINDS {
                let oracle = run(
                    Kernel::Scalar,
                    &hyper,
                    &init,
                    &grads,
                    grad_kind,
                    copy_kind,
                    1.0,
                );
                let simd = run(kernel, &hyper, &init, &grads, grad_kind, copy_kind, 1.0);
                assert_eq!(
                    oracle,
                    simd,
                    "{} {grad_kind:?} {copy_kind:?}",
                    kernel.name()
                );
            }
        }
    }
}

#[test]
fn bf16_copy_of_nan_is_a_quiet_nan_in_every_variant() {
    let init = vec![f32::NAN; 40];
    let grads = vec![vec![0.1f32; 40]];
    let hyper = AdamWHyper::default();
    for kernel in Kernel::supported() {
        let out = run(
            kernel,
            &hyper,
            &init,
            &grads,
            GradKind::F32,
            CopyKind::Bf16,
            1.0,
        );
        for bits in out.copy {
            assert!(bf16::from_bits(bits as u16).is_nan(), "{}", kernel.name());
        }
    }
}

/// torch.optim.AdamW written out in f64, its hyper-parameters the
/// decimals written for them (torch's are Python floats).
fn reference_f64(hyper: &AdamWHyper, init: &[f32], grads: &[Vec<f32>]) -> Vec<f64> {
    let decimal = |x: f32| x.to_string().parse::<f64>().unwrap();
    let (lr, b1, b2, eps, wd) = (
        decimal(hyper.lr),
        decimal(hyper.beta1),
        decimal(hyper.beta2),
        hyper.eps as f64,
        decimal(hyper.weight_decay),
    );
    let mut p: Vec<f64> = init.iter().map(|&x| x as f64).collect();
    let mut m = vec![0.0f64; p.len()];
    let mut v = vec![0.0f64; p.len()];
    for (t, g) in grads.iter().enumerate() {
        let t = (t + 1) as i32;
        for i in 0..p.len() {
            let g = g[i] as f64;
            p[i] *= 1.0 - lr * wd;
            m[i] = b1 * m[i] + (1.0 - b1) * g;
            v[i] = b2 * v[i] + (1.0 - b2) * g * g;
            let step_size = lr / (1.0 - b1.powi(t));
            let denom = v[i].sqrt() / (1.0 - b2.powi(t)).sqrt() + eps;
            p[i] -= step_size * m[i] / denom;
        }
    }
    p
}

#[test]
fn scalar_oracle_matches_f64_formula_after_100_steps() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let n = 4099;
    let init: Vec<f32> = (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect();
    let grads: Vec<Vec<f32>> = (0..100)
        .map(|_| (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect())
        .collect();
    let hyper = AdamWHyper::default();
    let reference = reference_f64(&hyper, &init, &grads);
    let ours = run(
        Kernel::Scalar,
        &hyper,
        &init,
        &grads,
        GradKind::F32,
        CopyKind::None,
        1.0,
    );
    // Every step rounds p to f32 once (at the final add; the decay and Adam
    // terms are summed first and their rounding is far below p's ulp). Over
    // 100 steps those half-ulp roundings random-walk to ~10 × ulp/√12 ≈
    // 2e-7 relative: the norm-wise relative error must stay under 1e-6, and
    // no single element may drift past 2e-6 relative (floored at |p| = 1e-2,
    // below which the absolute error, ~1e-8, is what counts).
    let (mut diff_sq, mut ref_sq, mut worst) = (0.0f64, 0.0f64, 0.0f64);
    for (i, (&bits, &r)) in ours.params.iter().zip(&reference).enumerate() {
        let got = f32::from_bits(bits) as f64;
        diff_sq += (got - r) * (got - r);
        ref_sq += r * r;
        let rel = (got - r).abs() / r.abs().max(1e-2);
        assert!(rel <= 2e-6, "param {i}: {got} vs f64 {r} (rel {rel:e})");
        worst = worst.max(rel);
    }
    let norm_rel = (diff_sq / ref_sq).sqrt();
    eprintln!(
        "f32 oracle vs f64 after 100 steps: norm-wise rel {norm_rel:e}, worst element {worst:e}"
    );
    assert!(norm_rel <= 1e-6, "norm-wise relative error {norm_rel:e}");
    assert!(
        norm_rel > 0.0,
        "f32 and f64 cannot agree exactly on every element"
    );
}

#[test]
fn length_mismatches_are_errors_naming_the_buffer() {
    let mut p = vec![0.0f32; 8];
    let mut m = vec![0.0f32; 8];
    let mut v = vec![0.0f32; 7];
    let g = vec![0.0f32; 8];
    let s = StepScalars::new(&AdamWHyper::default(), 1, 1.0);
    let err = adamw_step(
        Kernel::Scalar,
        &s,
        &mut p,
        &mut m,
        &mut v,
        GradRef::F32(&g),
        CopyOut::None,
    )
    .unwrap_err();
    assert_eq!(err.to_string(), "v has 7 elements but params have 8");
    // The copy is checked too: a short one would be written past its end.
    let mut v = vec![0.0f32; 8];
    let mut copy = vec![half::bf16::ZERO; 5];
    let err = adamw_step(
        Kernel::Scalar,
        &s,
        &mut p,
        &mut m,
        &mut v,
        GradRef::F32(&g),
        CopyOut::Bf16(&mut copy),
    )
    .unwrap_err();
    assert_eq!(err.to_string(), "copy has 5 elements but params have 8");
    assert!(GradRef::F32(&[]).is_empty() && !GradRef::F32(&g).is_empty());
}

#[test]
fn hyper_validation_names_the_bad_value() {
    let bad = AdamWHyper {
        beta2: 1.0,
        ..AdamWHyper::default()
    };
    let err = bad.validate().unwrap_err();
    assert!(err.to_string().contains("beta2 = 1"), "{err}");
    assert!(AdamWHyper::default().validate().is_ok());
    // Finite but negative, and not finite: each refused, by name.
    for (name, value) in [
        ("eps", -1.0),
        ("eps", f32::INFINITY),
        ("weight_decay", -1.0),
    ] {
        let bad = match name {
            "eps" => AdamWHyper {
                eps: value,
                ..AdamWHyper::default()
            },
            _ => AdamWHyper {
                weight_decay: value,
                ..AdamWHyper::default()
            },
        };
        let err = bad.validate().unwrap_err();
        assert!(err.to_string().contains(name), "{name} = {value}: {err}");
    }
}

#[test]
fn detect_picks_a_supported_kernel() {
    let k = Kernel::detect();
    assert!(k.is_supported());
    assert_eq!(Kernel::from_name(k.name()), Some(k));
    // Every test over `Kernel::supported()` runs the oracle and, where the
    // CPU has them, the SIMD variants: none is skipped by a wrong answer.
    let supported: Vec<Kernel> = Kernel::supported().collect();
    assert!(supported.contains(&Kernel::Scalar) && supported.contains(&k));
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let avx2 = has!("avx2") && has!("fma") && has!("f16c");
        assert_eq!(Kernel::Avx2Fma.is_supported(), avx2);
        assert_eq!(Kernel::Avx512.is_supported(), has!("avx512f"));
        assert!(!Kernel::Neon.is_supported());
    }
    #[cfg(target_arch = "aarch64")]
    assert_eq!(
        Kernel::Neon.is_supported(),
        std::arch::is_aarch64_feature_detected!("neon")
    );
}

/// The hyper-parameters are the decimals written for them, as torch's
/// Python floats are: 1 − β2 is torch's 0.001 (not 1 − f32(0.999) =
/// 0.00099998713…), so one step from zero moments leaves exactly torch's
/// v = 0.001·g² and m = 0.1·g.
#[test]
fn one_minus_beta_is_formed_from_the_decimal_as_torch_does() {
    let hyper = AdamWHyper::default();
    let s = StepScalars::new(&hyper, 1, 1.0);
    assert_eq!(s.one_minus_beta2, 0.001f32);
    assert_eq!(s.one_minus_beta1, 0.1f32);
    // torch: step_size = lr / (1 − 0.9¹) in f64, then an f32 scalar.
    assert_eq!(s.neg_step_size, -(1e-3f64 / (1.0 - 0.9f64)) as f32);
    assert_eq!(s.inv_sqrt_bias2, (1.0 / (1.0 - 0.999f64).sqrt()) as f32);
    let (p, m, v) = (vec![1.0f32; 3], vec![0.0f32; 3], vec![0.0f32; 3]);
    let g = [1.0f32, -2.0, 0.5];
    for kernel in Kernel::supported() {
        let (mut p, mut m, mut v) = (p.clone(), m.clone(), v.clone());
        adamw_step(
            kernel,
            &s,
            &mut p,
            &mut m,
            &mut v,
            GradRef::F32(&g),
            CopyOut::None,
        )
        .unwrap();
        for i in 0..3 {
            assert_eq!(v[i], 0.001f32 * g[i] * g[i], "{kernel:?} v[{i}]");
            assert_eq!(m[i], 0.1f32 * g[i], "{kernel:?} m[{i}]");
        }
    }
}

/// The bandwidth ceiling's sweep (`strata bench optim`) reads p, m, v and
/// g and writes p, m and v at every element, its vector copy's tail
/// included: each element ends as the plain formula gives it (β 0.9 and
/// 0.999, p moved by −1e-7·(m + v)), none left as it was.
#[test]
fn the_memory_sweep_touches_every_element() {
    use strata_optim::memory_sweep;
    let n = 1037;
    let g: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32).collect();
    let (mut p, mut m, mut v) = (vec![1.0f32; n], vec![0.5f32; n], vec![0.25f32; n]);
    memory_sweep(&mut p, &mut m, &mut v, &g);
    for i in 0..n {
        let mi = 0.5f32 * 0.9 + g[i];
        let vi = 0.25f32 * 0.999 + g[i] * g[i];
        assert_eq!((m[i], v[i]), (mi, vi), "m, v at {i}");
        assert_eq!(p[i], 1.0 + -1e-7f32 * (mi + vi), "p at {i}");
        assert_ne!(p[i], 1.0, "p at {i} unchanged");
    }
}
