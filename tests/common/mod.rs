//! Helpers shared by the finite-difference tests.

// Each test binary uses its own subset.
#![allow(dead_code)]

pub fn values(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Central differences of `loss` at `x` against `analytic`. The step 1e-6
/// leaves a truncation error of ~1e-12·|f'''| and a rounding error of
/// ~1e-16/1e-6 = 1e-10, so 1e-6 relative (floored at 1e-8) is a safe bound
/// for smooth functions of O(1) inputs.
pub fn check(name: &str, x: &[f64], analytic: &[f64], mut loss: impl FnMut(&[f64]) -> f64) {
    assert_eq!(x.len(), analytic.len());
    let h = 1e-6;
    let mut worst = 0.0f64;
    for i in 0..x.len() {
        let mut xp = x.to_vec();
        xp[i] += h;
        let mut xm = x.to_vec();
        xm[i] -= h;
        let numeric = (loss(&xp) - loss(&xm)) / (2.0 * h);
        let err = (numeric - analytic[i]).abs() / numeric.abs().max(analytic[i].abs()).max(1e-2);
        worst = worst.max(err);
        assert!(
            err < 1e-6,
            "{name}[{i}]: numeric {numeric} analytic {}",
            analytic[i]
        );
    }
    eprintln!(
        "{name}: worst relative error {worst:.2e} over {} inputs",
        x.len()
    );
}

pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
