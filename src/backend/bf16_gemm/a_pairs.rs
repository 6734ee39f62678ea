//! A, the left operand of the bf16 GEMM, rounded to bf16 pairs as the
//! tiles read it: packed two to a u32 (`vdpbf16ps`, the portable code) or
//! widened to two f32 (the FMA kernels), in one streaming pass either way.

use super::kernel::{ABlock, MR};
use super::{Bf16Bits, Bf16Kernel, Operand, Values};
use bytemuck::Zeroable;

/// A pair of bf16 values as a kernel reads it.
pub(super) trait Pair: bytemuck::Pod {
    /// One of the pair's values.
    type Half: bytemuck::Pod;
    /// The value of these bf16 bits.
    fn half(bits: u32) -> Self::Half;
    /// The pair of these bf16 bits, the even element first.
    fn of(even: u32, odd: u32) -> Self;
}

/// Packed: the even element in the low half.
impl Pair for u32 {
    type Half = u16;
    #[inline(always)]
    fn half(bits: u32) -> u16 {
        bits as u16
    }
    #[inline(always)]
    fn of(even: u32, odd: u32) -> u32 {
        even | odd << 16
    }
}

/// Widened to f32, the even element first.
impl Pair for [f32; 2] {
    type Half = f32;
    #[inline(always)]
    fn half(bits: u32) -> f32 {
        f32::from_bits(bits << 16)
    }
    #[inline(always)]
    fn of(even: u32, odd: u32) -> [f32; 2] {
        [Self::half(even), Self::half(odd)]
    }
}

/// A's bf16 pairs as the tiles read them, A(i, pair p) at `i · si + p ·
/// sp` for `strides` = (si, sp): packed, or widened for a kernel that
/// [widens A](Bf16Kernel::widens_a).
#[derive(Clone, Copy)]
pub(super) struct APairs<'a> {
    pub pairs: &'a [u32],
    pub wide: &'a [[f32; 2]],
    pub strides: (usize, usize),
}

impl<'a> APairs<'a> {
    /// The index of pair `p0` of the block of MR rows from row `r0` (a
    /// multiple of MR) in an A of `kp` pairs a row.
    pub fn block_at(&self, r0: usize, p0: usize, kp: usize) -> usize {
        r0 * kp + p0 * self.strides.1
    }

    /// The pairs from pair `at` on, as `kernel` reads them.
    pub fn from(&self, kernel: Bf16Kernel, at: usize) -> ABlock<'a> {
        if kernel.widens_a() {
            ABlock::Wide(&self.wide[at..])
        } else {
            ABlock::Pairs(&self.pairs[at..])
        }
    }
}

/// Writes A (M × K) as bf16 pairs into `buf`, its rows padded with zeros to
/// whole blocks of MR (and a last odd k with a zero), and returns the
/// strides (si, sp) it reads with within a block of MR rows; block b
/// starts at b · MR · ⌈K/2⌉ (see [`APairs::block_at`]). Where A is stored
/// by rows, its rows of pairs (each element rounded where it lies); where
/// A is stored k-major, each block's MR pairs of a k side by side (two
/// rows of k interleaved), so that a tile reads its pairs from one line
/// after another. Either is one streaming pass over A.
#[inline(always)]
pub(super) fn a_pairs<P: Pair>(a: Operand, m: usize, k: usize, buf: &mut Vec<P>) -> (usize, usize) {
    let (kp, mp) = (k.div_ceil(2), m.div_ceil(MR) * MR);
    // Every element is written below (`pairs_of` writes the padding), so
    // the old contents need no zeroing.
    buf.resize(mp * kp, P::zeroed());
    match a.values {
        Values::F32(v) => pairs_of(v, a.k_major, m, k, buf),
        Values::Bf16(v) => pairs_of(v, a.k_major, m, k, buf),
    }
    if a.k_major {
        (1, MR)
    } else {
        (kp, 1)
    }
}

/// [`a_pairs`] compiled for AVX-512 (the same bits: the rounding to bf16
/// is integer arithmetic on the f32 bits).
///
/// # Safety
/// The CPU has AVX512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn a_pairs_avx512<P: Pair>(
    a: Operand,
    m: usize,
    k: usize,
    buf: &mut Vec<P>,
) -> (usize, usize) {
    a_pairs(a, m, k, buf)
}

/// [`a_pairs`] compiled for AVX2, likewise.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn a_pairs_avx2<P: Pair>(
    a: Operand,
    m: usize,
    k: usize,
    buf: &mut Vec<P>,
) -> (usize, usize) {
    a_pairs(a, m, k, buf)
}

#[inline(always)]
fn pairs_of<T: Bf16Bits, P: Pair>(v: &[T], k_major: bool, m: usize, k: usize, buf: &mut [P]) {
    let (kp, mp) = (k.div_ceil(2), m.div_ceil(MR) * MR);
    if k_major {
        // Each block's MR pairs of a k written together at the block's
        // place.
        let blocks = buf[..mp * kp].chunks_exact_mut(MR * kp);
        for (b, block) in blocks.enumerate() {
            let rows = MR.min(m - b * MR);
            for p in 0..kp {
                let out = &mut block[p * MR..][..MR];
                let (out, padding) = out.split_at_mut(rows);
                padding.fill(P::zeroed());
                let even = &v[2 * p * m + b * MR..][..rows];
                if 2 * p + 1 < k {
                    let odd = &v[(2 * p + 1) * m + b * MR..][..rows];
                    for ((o, e), d) in out.iter_mut().zip(even).zip(odd) {
                        *o = P::of(e.bf16(), d.bf16());
                    }
                } else {
                    out.iter_mut()
                        .zip(even)
                        .for_each(|(o, e)| *o = P::of(e.bf16(), 0));
                }
            }
        }
    } else {
        let (rows, padding) = buf[..mp * kp].split_at_mut(m * kp);
        padding.fill(P::zeroed());
        rows_as_pairs(v, k, kp, rows);
    }
}

/// Writes the rows of `v` (K elements each) into `rows`, `width` bf16
/// pairs a row: a row's pairs, read as halves, are its elements in order,
/// then zeros (a zero after an odd K's last, and whole zero pairs up to
/// `width`).
#[inline(always)]
pub(super) fn rows_as_pairs<T: Bf16Bits, P: Pair>(v: &[T], k: usize, width: usize, rows: &mut [P]) {
    let halves: &mut [P::Half] = bytemuck::cast_slice_mut(rows);
    for (row, out) in v.chunks_exact(k).zip(halves.chunks_exact_mut(2 * width)) {
        let (values, zeros) = out.split_at_mut(k);
        values
            .iter_mut()
            .zip(row)
            .for_each(|(o, x)| *o = P::half(x.bf16()));
        // A few elements: no call to memset a row.
        zeros.iter_mut().for_each(|z| *z = P::Half::zeroed());
    }
}
