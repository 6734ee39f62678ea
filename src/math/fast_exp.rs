//! A polynomial `exp` for f32 in plain arithmetic (Cephes' `expf`: n =
//! round(x·log₂e), r = x − n·ln 2 in two parts, a degree-6 polynomial
//! in r, scaled by 2ⁿ through the exponent bits) that the compiler
//! vectorizes, unlike a call into libm: f32's `Real::exp`, so the
//! softmaxes, cross-entropy and the sigmoids of SwiGLU and the routers
//! take it. Every operation is an IEEE f32 add or multiply (Rust contracts
//! none into a fused multiply-add), so the results are the same bits on
//! every CPU, and in the CUDA kernels' `strata_exp`, which repeats it
//! operation for operation. Within 2 ulp of the exact exp over f32's normal
//! results (`exp_approx_is_within_two_ulp`); past x ≈ 88.7 it gives 2¹²⁸'s
//! neighbour rather than infinity, and below −87.3 the smallest normal's
//! neighbourhood rather than a subnormal or zero.

/// e^x for x in f32's normal range (clamped outside it).
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 = C1 + C2, C1 exact in few bits (so n·C1 is exact).
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // 1.5 · 2²³: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    // n stays within 2ⁿ's normal exponents, −126..=127.
    let x = x.clamp(-87.3, 88.0);
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = (x - n * C1) - n * C2;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_2e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5; // Cephes 5.0000001201e-1, as an f32
    let y = p * (r * r) + r + 1.0;
    // n sits in `shifted`'s low mantissa bits (its unit there is 1): read
    // it from them, integer arithmetic that vectorizes, where `n as i32`
    // (a saturating conversion) becomes a scalar compare-and-convert per
    // lane. Wrapping, for a NaN's bits (whose y is NaN either way).
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    y * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between two positive finite f32.
    fn ulps(a: f32, b: f32) -> u32 {
        a.to_bits().abs_diff(b.to_bits())
    }

    #[test]
    fn exp_approx_is_within_two_ulp() {
        let mut worst = (0, 0.0f32);
        let steps = 2_000_000;
        for i in 0..=steps {
            let x = -87.0 + 175.0 * i as f32 / steps as f32;
            let exact = (x as f64).exp() as f32;
            let e = ulps(exp_approx(x), exact);
            if e > worst.0 {
                worst = (e, x);
            }
        }
        eprintln!("exp_approx: worst {} ulp, at x = {}", worst.0, worst.1);
        assert!(worst.0 <= 2, "{} ulp at x = {}", worst.0, worst.1);
        assert_eq!(exp_approx(0.0), 1.0);
        assert!(exp_approx(1000.0).is_finite() && exp_approx(1000.0) > 1e38);
        assert!(exp_approx(-1000.0) > 0.0 && exp_approx(-1000.0) < 2e-38);
    }

    /// f32's sigmoid (`math::sigmoid`, from this exp).
    #[test]
    fn the_f32_sigmoid_follows_the_exact_sigmoid() {
        let sigmoid = crate::math::sigmoid::<f32>;
        for i in -2000..=2000 {
            let x = i as f32 / 50.0;
            let exact = 1.0 / (1.0 + (-(x as f64)).exp());
            let got = sigmoid(x) as f64;
            assert!(
                (got - exact).abs() <= 4.0 * f32::EPSILON as f64 * exact,
                "{x}: {got} {exact}"
            );
        }
        assert_eq!(sigmoid(200.0), 1.0);
        assert!(sigmoid(-200.0) < 1e-37);
    }
}
