//! The bf16 GEMM's register tiles on x86-64's vector units (`kernel.rs`
//! chooses among them): `vdpbf16ps` on the pairs as they are packed, and
//! f32 FMAs on the pairs widened — A's once, by the caller, B's in
//! registers — on 512-bit or 256-bit registers. Each adds a pair's odd
//! product, then its even one, into its sum, so all give the same bits.

use super::kernel::{Tile, MR, NR};
use std::arch::x86_64::*;

/// 32 bf16 bit patterns as the vector `vdpbf16ps` reads.
#[inline(always)]
fn as_bf16(v: __m512i) -> __m512bh {
    // SAFETY: both are 64 bytes of plain data, every bit pattern valid.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// Row `p` of B's panel: its NR = 32 pairs in two registers.
///
/// # Safety
/// The CPU has AVX512F; `b` points at a panel of more than `p` rows of NR.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn b_row(b: *const u32, p: usize) -> (__m512i, __m512i) {
    // SAFETY: the row's NR u32 are in bounds (the contract); unaligned
    // loads.
    unsafe {
        let at = b.add(p * NR);
        (
            _mm512_loadu_si512(at.cast()),
            _mm512_loadu_si512(at.add(16).cast()),
        )
    }
}

/// Writes the MR rows of sums, each row's first 16 in `lo` and last 16 in
/// `hi`, into `tile`.
#[inline]
#[target_feature(enable = "avx512f")]
fn store_tile(tile: &mut Tile, lo: &[__m512; MR], hi: &[__m512; MR]) {
    for i in 0..MR {
        // SAFETY: each tile row holds NR = 32 f32; unaligned stores.
        unsafe {
            _mm512_storeu_ps(tile[i].as_mut_ptr(), lo[i]);
            _mm512_storeu_ps(tile[i].as_mut_ptr().add(16), hi[i]);
        }
    }
}

/// # Safety
/// The CPU has AVX512F and AVX512-BF16; `a` points at MR rows of `pairs`
/// readable pairs at strides (si, sp), and `b` at `pairs` × NR.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn tile_avx512(
    a: *const u32,
    (si, sp): (usize, usize),
    b: *const u32,
    pairs: usize,
    tile: &mut Tile,
) {
    // SAFETY: each row's first pair is in bounds (the contract).
    let rows: [*const u32; MR] = std::array::from_fn(|i| unsafe { a.add(i * si) });
    let mut lo = [_mm512_setzero_ps(); MR];
    let mut hi = [_mm512_setzero_ps(); MR];
    for p in 0..pairs {
        // SAFETY: row `p` of B's panel is in bounds (the function's
        // contract).
        let (b0, b1) = unsafe { b_row(b, p) };
        let (b0, b1) = (as_bf16(b0), as_bf16(b1));
        for i in 0..MR {
            // SAFETY: row i's pair p is in bounds (the contract).
            let ai = as_bf16(_mm512_set1_epi32(unsafe { *rows[i].add(p * sp) } as i32));
            lo[i] = _mm512_dpbf16_ps(lo[i], ai, b0);
            hi[i] = _mm512_dpbf16_ps(hi[i], ai, b1);
        }
    }
    store_tile(tile, &lo, &hi);
}

/// # Safety
/// The CPU has AVX512F; `a` points at MR rows of `pairs` readable widened
/// pairs (two f32 each) at strides (si, sp) counted in pairs, and `b` at
/// `pairs` × NR.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn tile_avx512_fma(
    a: *const f32,
    (si, sp): (usize, usize),
    b: *const u32,
    pairs: usize,
    tile: &mut Tile,
) {
    // SAFETY: each row's first pair is in bounds (the contract).
    let rows: [*const f32; MR] = std::array::from_fn(|i| unsafe { a.add(2 * i * si) });
    let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    let mut lo = [_mm512_setzero_ps(); MR];
    let mut hi = [_mm512_setzero_ps(); MR];
    for p in 0..pairs {
        // SAFETY: row `p` of B's panel is in bounds (the function's
        // contract).
        let (b0, b1) = unsafe { b_row(b, p) };
        // Each pair's even element is its low half, its odd one the high.
        let (even0, odd0) = (
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(b0)),
            _mm512_castsi512_ps(_mm512_and_si512(b0, high)),
        );
        let (even1, odd1) = (
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(b1)),
            _mm512_castsi512_ps(_mm512_and_si512(b1, high)),
        );
        for i in 0..MR {
            // SAFETY: row i's pair p, two f32, is in bounds (the contract).
            let (ae, ao) = unsafe {
                let at = rows[i].add(2 * p * sp);
                (_mm512_set1_ps(*at), _mm512_set1_ps(*at.add(1)))
            };
            // The odd product first, then the even one, as `vdpbf16ps`.
            lo[i] = _mm512_fmadd_ps(ao, odd0, lo[i]);
            hi[i] = _mm512_fmadd_ps(ao, odd1, hi[i]);
            lo[i] = _mm512_fmadd_ps(ae, even0, lo[i]);
            hi[i] = _mm512_fmadd_ps(ae, even1, hi[i]);
        }
    }
    store_tile(tile, &lo, &hi);
}

/// # Safety
/// The CPU has AVX2 and FMA; `a` points at MR rows of `pairs` readable
/// widened pairs (two f32 each) at strides (si, sp) counted in pairs, and
/// `b` at `pairs` × NR.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile_avx2_fma(
    a: *const f32,
    (si, sp): (usize, usize),
    b: *const u32,
    pairs: usize,
    tile: &mut Tile,
) {
    // SAFETY: each row's first pair is in bounds (the contract).
    let rows: [*const f32; MR] = std::array::from_fn(|i| unsafe { a.add(2 * i * si) });
    let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    // Sixteen 8-lane registers hold a quarter of the tile's columns at a
    // time (8 sums, B's two halves, A's two elements); each column's sum is
    // the same sequence of FMAs whichever quarter holds it.
    for quarter in 0..NR / 8 {
        let mut sums = [_mm256_setzero_ps(); MR];
        for p in 0..pairs {
            // SAFETY: row `p` of B's panel, NR pairs, holds this quarter's
            // 8 (the contract); the load is unaligned.
            let bq = unsafe { _mm256_loadu_si256(b.add(p * NR + quarter * 8).cast()) };
            let even = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bq));
            let odd = _mm256_castsi256_ps(_mm256_and_si256(bq, high));
            for i in 0..MR {
                // SAFETY: row i's pair p, two f32, is in bounds (the
                // contract).
                let (ae, ao) = unsafe {
                    let at = rows[i].add(2 * p * sp);
                    (_mm256_set1_ps(*at), _mm256_set1_ps(*at.add(1)))
                };
                // The odd product first, then the even one, as `vdpbf16ps`.
                sums[i] = _mm256_fmadd_ps(ae, even, _mm256_fmadd_ps(ao, odd, sums[i]));
            }
        }
        for (row, sum) in tile.iter_mut().zip(sums) {
            // SAFETY: a tile row holds NR f32, this quarter's 8 among them;
            // an unaligned store.
            unsafe { _mm256_storeu_ps(row.as_mut_ptr().add(quarter * 8), sum) };
        }
    }
}
