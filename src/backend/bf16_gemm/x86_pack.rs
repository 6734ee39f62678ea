//! B's panel packed on AVX-512 where B is stored as rows of whole bf16
//! pairs (the weights of the forward's products): 16 rows × 16 pairs at a
//! time through a 16 × 16 transpose in registers, instead of each pair
//! stored to its lane alone (which compiles to scatters). The packed
//! panel is the same u32s either way.

use super::kernel::NR;
use std::arch::x86_64::*;

/// Lanes (rows of B) and pairs a transpose moves.
const SQUARE: usize = 16;

/// Packs pairs `p0..p0 + pairs` of rows `r0..r0 + NR` of `v` (rows of `kp`
/// pairs) into `out` (pairs × NR, row p of the panel the NR rows' pair
/// p0 + p), as `pack_pairs` does for a whole panel.
///
/// # Safety
/// The CPU has AVX512F.
///
/// # Panics
/// Where the rows or pairs are out of `v`, or `out` is shorter than
/// pairs × NR.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pack_pairs_avx512(
    v: &[u32],
    kp: usize,
    (r0, p0, pairs): (usize, usize, usize),
    out: &mut [u32],
) {
    assert!(pairs == 0 || (r0 + NR - 1) * kp + p0 + pairs <= v.len());
    assert!(out.len() >= pairs * NR);
    let whole = pairs - pairs % SQUARE;
    for half in 0..NR / SQUARE {
        let rows = r0 + half * SQUARE;
        for p in (0..whole).step_by(SQUARE) {
            let mut x: [__m512i; SQUARE] = std::array::from_fn(|i| {
                // SAFETY: row rows + i's pairs p0 + p .. + 16 are in `v`
                // (asserted above); an unaligned load.
                unsafe { _mm512_loadu_si512(v.as_ptr().add((rows + i) * kp + p0 + p).cast()) }
            });
            transpose(&mut x);
            for (j, lanes) in x.iter().enumerate() {
                // SAFETY: panel row p + j holds NR lanes, these 16 among
                // them (asserted above); an unaligned store.
                unsafe {
                    _mm512_storeu_si512(
                        out.as_mut_ptr().add((p + j) * NR + half * SQUARE).cast(),
                        *lanes,
                    )
                }
            }
        }
    }
    for p in whole..pairs {
        for i in 0..NR {
            out[p * NR + i] = v[(r0 + i) * kp + p0 + p];
        }
    }
}

/// Transposes 16 × 16 u32 in place: afterwards x[j]'s lane i is what x[i]'s
/// lane j was.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose(x: &mut [__m512i; SQUARE]) {
    // Pairs of rows interleaved by 32-bit elements, then by 64-bit ones:
    // each 128-bit lane then holds a 4 × 4 square of the result.
    let mut t = [_mm512_setzero_si512(); SQUARE];
    for i in (0..SQUARE).step_by(2) {
        t[i] = _mm512_unpacklo_epi32(x[i], x[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(x[i], x[i + 1]);
    }
    for g in (0..SQUARE).step_by(4) {
        x[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        x[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        x[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        x[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    // Then the 128-bit lanes: of rows 4 apart, then of rows 8 apart.
    for g in [0, 8] {
        for j in 0..4 {
            t[g + j] = _mm512_shuffle_i32x4::<0x88>(x[g + j], x[g + 4 + j]);
            t[g + 4 + j] = _mm512_shuffle_i32x4::<0xdd>(x[g + j], x[g + 4 + j]);
        }
    }
    for j in 0..8 {
        x[j] = _mm512_shuffle_i32x4::<0x88>(t[j], t[8 + j]);
        x[8 + j] = _mm512_shuffle_i32x4::<0xdd>(t[j], t[8 + j]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transposed_panel_is_the_pairs_lane_by_lane() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        // Pairs whole squares and a tail, from a row and pair inside `v`.
        let (kp, r0, p0) = (61, 3, 5);
        let v: Vec<u32> = (0..(r0 + NR + 2) * kp)
            .map(|i| (i as u32).wrapping_mul(0x9e37_79b9))
            .collect();
        for pairs in [0, 1, 15, 16, 17, 33, 56] {
            let mut out = vec![0u32; pairs * NR];
            // SAFETY: the CPU has AVX512F (checked above).
            unsafe { pack_pairs_avx512(&v, kp, (r0, p0, pairs), &mut out) };
            for p in 0..pairs {
                for i in 0..NR {
                    assert_eq!(
                        out[p * NR + i],
                        v[(r0 + i) * kp + p0 + p],
                        "pair {p} lane {i}"
                    );
                }
            }
        }
    }
}
