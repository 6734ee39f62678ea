use super::*;

/// A deterministic stream of values in [-1, 1).
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn widen(bits: u16) -> f64 {
    f32::from_bits((bits as u32) << 16) as f64
}

/// X (R × K) stored as `op` says, from its row-major values.
fn stored(rows: &[f32], r: usize, k: usize, k_major: bool) -> Vec<f32> {
    if !k_major {
        return rows.to_vec();
    }
    let mut t = vec![0.0; r * k];
    for i in 0..r {
        for j in 0..k {
            t[j * r + i] = rows[i * k + j];
        }
    }
    t
}

fn f32_op(v: &[f32], k_major: bool) -> Operand<'_> {
    Operand {
        values: Values::F32(v),
        k_major,
    }
}

fn kernels() -> Vec<Bf16Kernel> {
    Bf16Kernel::supported_here()
}

/// Shapes with ragged tiles, an odd K, and K over one block.
const SHAPES: [(usize, usize, usize); 6] = [
    (1, 1, 1),
    (8, 2, 32),
    (13, 7, 45),
    (17, 300, 70),
    (40, 513, 9),
    // Whole 32 × 32 blocks (which the AMX kernel stores in place) beside
    // ragged ones, over two blocks of K.
    (70, 300, 72),
];

#[test]
fn rounding_to_bf16_is_to_nearest_even() {
    assert_eq!(bf16_bits(1.0), 0x3f80);
    // Halfway between 1.0 and the next bf16 (1 + 2^-7): ties to even (1.0).
    assert_eq!(bf16_bits(f32::from_bits(0x3f80_8000)), 0x3f80);
    // Halfway above an odd mantissa rounds up to the even one.
    assert_eq!(bf16_bits(f32::from_bits(0x3f81_8000)), 0x3f82);
    assert_eq!(bf16_bits(f32::from_bits(0x3f80_8001)), 0x3f81);
    assert_eq!(bf16_bits(-2.5), 0xc020);
    assert_eq!(bf16_bits(f32::MAX), 0x7f80, "past bf16's largest: infinity");
    assert_eq!(bf16_bits(f32::INFINITY), 0x7f80);
    assert!(widen(bf16_bits(f32::NAN)).is_nan());
    for x in values(1000, 3) {
        let h = half::bf16::from_f32(x).to_bits();
        assert_eq!(bf16_bits(x), h, "{x}");
    }
}

/// Each kernel, each storage of A and B, against the f64 product of the
/// rounded operands: every element within γ(K + blocks)·Σ|a||b| (u =
/// 2⁻²⁴; each pair's two products are exact and added with one rounding
/// each, then each block's sum once more).
#[test]
fn every_kernel_and_storage_matches_the_rounded_operands_product() {
    for kernel in kernels() {
        for (m, k, n) in SHAPES {
            let (a, b) = (values(m * k, 1), values(n * k, 2));
            for (ak, bk) in [(false, false), (true, false), (false, true), (true, true)] {
                let (sa, sb) = (stored(&a, m, k, ak), stored(&b, n, k, bk));
                let mut out = vec![f32::NAN; m * n];
                let shape = (m, k, n);
                gemm_bf16_with(
                    kernel,
                    1,
                    &mut out,
                    Write::Set,
                    f32_op(&sa, ak),
                    f32_op(&sb, bk),
                    shape,
                );
                let adds = (k + k.div_ceil(2 * KC_PAIRS)) as f64;
                let gamma = adds * 2f64.powi(-24) / (1.0 - adds * 2f64.powi(-24));
                for i in 0..m {
                    for j in 0..n {
                        let (mut exact, mut mag) = (0.0f64, 0.0f64);
                        for l in 0..k {
                            let p = widen(bf16_bits(a[i * k + l])) * widen(bf16_bits(b[j * k + l]));
                            exact += p;
                            mag += p.abs();
                        }
                        let err = (out[i * n + j] as f64 - exact).abs();
                        assert!(
                            err <= gamma * mag,
                            "{kernel:?} {m}×{k}×{n} A k-major {ak} B k-major {bk} at ({i}, {j}): \
                             {} against {exact}",
                            out[i * n + j]
                        );
                    }
                }
            }
        }
    }
}

/// The sums' order is fixed (see the module): one thread or four, the
/// portable, the `vdpbf16ps` or the FMA kernel, bf16 operands given as f32 or as bits,
/// the same bits; the AMX kernel, whose tile rounds its own way, the same
/// bits as itself likewise.
#[test]
fn threads_kernels_and_operand_types_give_the_same_bits() {
    let families = [
        vec![
            Bf16Kernel::Portable,
            Bf16Kernel::Avx512,
            Bf16Kernel::Avx512Fma,
            Bf16Kernel::Avx2Fma,
        ],
        vec![Bf16Kernel::Amx],
    ];
    for family in families {
        let family: Vec<_> = family.into_iter().filter(|k| k.supported()).collect();
        same_bits_across(&family);
    }
}

fn same_bits_across(family: &[Bf16Kernel]) {
    for (m, k, n) in SHAPES {
        let (a, b) = (values(m * k, 5), values(n * k, 6));
        let b_bits: Vec<u16> = b.iter().map(|&x| bf16_bits(x)).collect();
        let mut first: Option<Vec<f32>> = None;
        for &kernel in family {
            for parts in [1, 2, 4] {
                for b_op in [Values::F32(&b), Values::Bf16(&b_bits)] {
                    let mut out = vec![0.0; m * n];
                    let (a_op, b_op) = (Operand::rows(Values::F32(&a)), Operand::rows(b_op));
                    gemm_bf16_with(kernel, parts, &mut out, Write::Set, a_op, b_op, (m, k, n));
                    match &first {
                        None => first = Some(out),
                        Some(f) => assert!(
                            f.iter().zip(&out).all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{kernel:?} on {parts} threads, {m}×{k}×{n}"
                        ),
                    }
                }
            }
        }
    }
}

#[test]
fn add_sums_into_the_output_and_set_replaces_it() {
    let (m, k, n) = (9, 600, 33);
    let (a, b) = (values(m * k, 7), values(n * k, 8));
    let (a, b) = (
        Operand::rows(Values::F32(&a)),
        Operand::rows(Values::F32(&b)),
    );
    for kernel in kernels() {
        let mut set = vec![f32::NAN; m * n];
        gemm_bf16_with(kernel, 2, &mut set, Write::Set, a, b, (m, k, n));
        let mut added = vec![0.5; m * n];
        gemm_bf16_with(kernel, 2, &mut added, Write::Add, a, b, (m, k, n));
        for (s, x) in set.iter().zip(&added) {
            assert!(
                (x - (s + 0.5)).abs() <= 1e-5 * (1.0 + s.abs()),
                "{kernel:?}: {x} against {s} + 0.5"
            );
        }
    }
    let mut empty = vec![3.0; m * n];
    let none: [f32; 0] = [];
    let (a0, b0) = (
        Operand::rows(Values::F32(&none)),
        Operand::rows(Values::F32(&none)),
    );
    gemm_bf16_with(
        Bf16Kernel::Portable,
        1,
        &mut empty,
        Write::Add,
        a0,
        b0,
        (m, 0, n),
    );
    assert!(empty.iter().all(|&x| x == 3.0), "an empty sum adds nothing");
    gemm_bf16_with(
        Bf16Kernel::Portable,
        1,
        &mut empty,
        Write::Set,
        a0,
        b0,
        (m, 0, n),
    );
    assert!(empty.iter().all(|&x| x == 0.0), "and sets zero");
}

/// Which kernels this CPU runs, asked of the kernel's own record of the
/// CPU's flags (`/proc/cpuinfo`, where there is one) rather than of the
/// instructions' detection the code uses; the fastest is the one picked
/// (of the two AVX-512 kernels, the one a timing chose); the names are
/// the ones the first line and `bench kernels` print.
#[test]
fn the_cpu_s_flags_choose_the_kernel() {
    assert!(Bf16Kernel::Portable.supported());
    if let Some(flags) = crate::math::vector_isa::cpuinfo_flags() {
        let has = |f: &str| flags.iter().any(|g| g == f);
        let fma = has("avx512f");
        let avx512 = fma && has("avx512_bf16");
        let avx2 = has("avx2") && has("fma");
        assert_eq!(Bf16Kernel::Avx2Fma.supported(), avx2, "{flags:?}");
        assert_eq!(Bf16Kernel::Avx512.supported(), avx512, "{flags:?}");
        assert_eq!(Bf16Kernel::Avx512Fma.supported(), fma, "{flags:?}");
        // Linux lists AMX's flags where it hands out the tile data.
        let amx = fma && has("amx_tile") && has("amx_bf16");
        assert_eq!(Bf16Kernel::Amx.supported(), amx, "{flags:?}");
        let fastest: &[Bf16Kernel] = if amx {
            &[Bf16Kernel::Amx]
        } else if avx512 {
            &[Bf16Kernel::Avx512, Bf16Kernel::Avx512Fma]
        } else if fma {
            &[Bf16Kernel::Avx512Fma]
        } else if avx2 {
            &[Bf16Kernel::Avx2Fma]
        } else {
            &[Bf16Kernel::Portable]
        };
        assert!(fastest.contains(&Bf16Kernel::detected()), "{fastest:?}");
    }
    let names = Bf16Kernel::ALL.map(Bf16Kernel::name);
    assert_eq!(
        names,
        [
            "portable",
            "avx2-fma",
            "avx512-fma",
            "avx512-bf16",
            "amx-bf16"
        ]
    );
}

/// The timing that chooses between two kernels of the same bits takes
/// the faster: AVX-512's FMAs over the plain code, compiled for any
/// x86-64 (128-bit registers), a tile at a time.
#[test]
fn the_faster_of_two_kernels_is_timed() {
    if !Bf16Kernel::Avx512Fma.supported() {
        return;
    }
    let (plain, fma) = (Bf16Kernel::Portable, Bf16Kernel::Avx512Fma);
    assert_eq!(kernel::faster_tile(plain, fma), fma);
    assert_eq!(kernel::faster_tile(fma, plain), fma);
}

/// A process's kernel is fixed once: the one in use may be chosen again,
/// another is refused, and so is one this CPU lacks, each naming why.
#[test]
fn a_chosen_kernel_holds_for_the_process() {
    let in_use = Bf16Kernel::in_use();
    assert_eq!(in_use.choose(), Ok(()));
    for kernel in Bf16Kernel::ALL {
        assert_eq!(Bf16Kernel::from_name(kernel.name()), Some(kernel));
        if kernel == in_use {
            continue;
        }
        let err = kernel.choose().unwrap_err();
        let why = if kernel.supported() {
            "already use"
        } else {
            "cannot run"
        };
        assert!(err.contains(why), "{kernel:?}: {err}");
    }
    assert_eq!(Bf16Kernel::from_name("avx2"), None);
}

/// A thread packs its panels `B_PANELS_BYTES` at a time: a GEMM whose
/// panels take several such chunks (130 panels of 150 pairs: two chunks a
/// thread on two threads, three on one) gives each column the bits of the
/// same GEMM on that column's panel alone.
#[test]
fn panels_packed_in_chunks_give_each_panel_s_bits() {
    let (m, k, n) = (9, 300, 130 * NR - 5);
    assert!(n.div_ceil(NR) * NR * 4 * KC_PAIRS > 2 * B_PANELS_BYTES);
    let (a, b) = (values(m * k, 7), values(n * k, 8));
    for kernel in kernels().into_iter().filter(|&k| k != Bf16Kernel::Amx) {
        for parts in [1, 2] {
            let mut whole = vec![0.0; m * n];
            let (a_op, b_op) = (f32_op(&a, false), f32_op(&b, false));
            gemm_bf16_with(kernel, parts, &mut whole, Write::Set, a_op, b_op, (m, k, n));
            for c0 in (0..n).step_by(NR) {
                let cols = NR.min(n - c0);
                let mut one = vec![0.0; m * cols];
                let b_rows = f32_op(&b[c0 * k..(c0 + cols) * k], false);
                gemm_bf16_with(kernel, 1, &mut one, Write::Set, a_op, b_rows, (m, k, cols));
                for i in 0..m {
                    for j in 0..cols {
                        assert_eq!(
                            whole[i * n + c0 + j].to_bits(),
                            one[i * cols + j].to_bits(),
                            "{kernel:?} on {parts} threads at ({i}, {})",
                            c0 + j
                        );
                    }
                }
            }
        }
    }
}
