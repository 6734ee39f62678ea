//! The bf16 GEMM on AMX tiles (x86-64 with AMX-TILE and AMX-BF16, where
//! Linux grants the process the tile data): `tdpbf16ps` multiplies a tile
//! of A's 16 rows × 16 pairs by B's 16 pairs × 16 columns into 16 × 16 f32
//! sums, 16 times the products of a `vdpbf16ps` a cycle.
//!
//! It computes what the other kernels compute — each block of `KC_PAIRS`
//! pairs summed in f32 from zero, then the blocks added to the output in
//! K's order, each output column's panel on one thread — but the tile adds
//! a step's 32 products in an order and with roundings of its own (no
//! sequence of f32 adds reproduces them), so its sums differ from the
//! `vdpbf16ps` kernels' in the last bits. They stay within the same bound
//! (`tests.rs`: γ(K + blocks)·Σ|a||b|), and are the same bits whatever the
//! threads and however the operands are stored.
//!
//! A is written as rows of bf16 pairs, `stride` (a multiple of 16) pairs a
//! row and its rows padded with zeros to whole blocks of `ROWS`, so that a
//! tile is one strided load; B's panel is the one the other kernels pack
//! (pairs × NR, which is the pair-interleaved layout the tile reads), with
//! zero pairs to a whole step.

use std::arch::asm;

use super::kernel::NR;
use super::{
    a_pairs::rows_as_pairs, pack, write_rows, Bf16Bits, Block, Operand, OutPtr, Shape, Values,
    KC_PAIRS,
};
use crate::backend::gemm::Write;

/// Rows of the output a block computes (two tiles of 16).
pub(super) const ROWS: usize = 32;
/// Pairs of K a tile step takes (its 64 bytes a row).
const STEP_PAIRS: usize = 16;

/// Whether this CPU has AMX-TILE and AMX-BF16 and the kernel lets this
/// process use the tile data (asked once; the grant is the process's).
pub(super) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| cpu_has_amx_bf16() && sys::request_tile_data())
}

/// CPUID leaf 7's AMX-BF16 (EDX bit 22) and AMX-TILE (bit 24) flags.
fn cpu_has_amx_bf16() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // Leaf 7 is read only where the highest leaf reaches it.
    if __cpuid(0).eax < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    edx & (1 << 22) != 0 && edx & (1 << 24) != 0
}

/// The operating system's side: the tile data is a feature Linux hands
/// out per process, on request.
mod sys {
    /// `arch_prctl` asking for an extended state component.
    const ARCH_REQ_XCOMP_PERM: libc::c_int = 0x1023;
    /// The AMX tile data's state component.
    const XFEATURE_XTILEDATA: libc::c_ulong = 18;

    /// Asks Linux for the tile data; whether it was granted (never on
    /// another system, nor on a kernel without AMX support).
    #[cfg(target_os = "linux")]
    pub(super) fn request_tile_data() -> bool {
        // SAFETY: arch_prctl with this code reads no memory; it fails
        // (EINVAL, ENOSYS) where the kernel has no such feature.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    }

    #[cfg(not(target_os = "linux"))]
    pub(super) fn request_tile_data() -> bool {
        false
    }
}

/// The tiles' shapes (`ldtilecfg`'s 64 bytes, palette 1): tmm0–3 the
/// 2 × 2 tiles of sums, tmm4–5 A's two row tiles, tmm6–7 B's two column
/// tiles; every one 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new() -> Self {
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..8 {
            // Bytes a row (u16, little-endian) at 16 + 2t, rows at 48 + t.
            c[16 + 2 * t] = 64;
            c[48 + t] = 16;
        }
        Self(c)
    }
}

/// This thread's tiles, configured while it lives and released (their
/// state back to its initial, empty one) when it drops.
struct Tiles(());

impl Tiles {
    /// # Safety
    /// [`available`] is true.
    unsafe fn configure() -> Self {
        let config = TileConfig::new();
        // SAFETY: the process holds the tile data (the caller's contract);
        // `ldtilecfg` reads the 64 bytes of `config`.
        unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly)) };
        Tiles(())
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured (`configure`); `tilerelease`
        // touches no memory.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// Writes A (M × K) into `buf` as rows of `stride` bf16 pairs (K's pairs
/// rounded up to whole steps; a last odd k's pair and the pairs past K
/// zero), rows padded with zeros to whole blocks of [`ROWS`]; returns
/// `stride`.
#[inline(always)]
pub(super) fn a_rows(a: Operand, m: usize, k: usize, buf: &mut Vec<u32>) -> usize {
    let stride = k.div_ceil(2).next_multiple_of(STEP_PAIRS);
    buf.resize(m.next_multiple_of(ROWS) * stride, 0);
    match a.values {
        Values::F32(v) => rows_of(v, a.k_major, m, k, stride, buf),
        Values::Bf16(v) => rows_of(v, a.k_major, m, k, stride, buf),
    }
    stride
}

/// [`a_rows`]'s writing, `stride` pairs a row.
#[inline(always)]
fn rows_of<T: Bf16Bits>(
    v: &[T],
    k_major: bool,
    m: usize,
    k: usize,
    stride: usize,
    buf: &mut [u32],
) {
    let (rows, padding) = buf.split_at_mut(m * stride);
    padding.fill(0);
    if k_major {
        for row in rows.chunks_exact_mut(stride) {
            row[k / 2..].fill(0);
        }
        transposed_rows_of(v, m, k, stride, rows);
    } else {
        rows_as_pairs(v, k, stride, rows);
    }
}

/// Rows and pairs a block of [`transposed_rows_of`] takes.
const BLOCK: usize = 16;

/// [`rows_of`] for A stored k-major (A(i, l) at `v[l · M + i]`): a block
/// of 16 rows × 16 pairs at a time, its pairs formed along M (two of A's
/// stored rows side by side) and then written along K.
#[inline(always)]
fn transposed_rows_of<T: Bf16Bits>(
    v: &[T],
    m: usize,
    k: usize,
    stride: usize,
    pair_rows: &mut [u32],
) {
    let pairs = k.div_ceil(2);
    let mut block = [[0u32; BLOCK]; BLOCK];
    for i0 in (0..m).step_by(BLOCK) {
        let ni = BLOCK.min(m - i0);
        for p0 in (0..pairs).step_by(BLOCK) {
            let np = BLOCK.min(pairs - p0);
            for (p, lanes) in block.iter_mut().enumerate().take(np) {
                let l = 2 * (p0 + p);
                let even = &v[l * m + i0..][..ni];
                if l + 1 < k {
                    let odd = &v[(l + 1) * m + i0..][..ni];
                    for ((o, e), d) in lanes.iter_mut().zip(even).zip(odd) {
                        *o = e.bf16() | d.bf16() << 16;
                    }
                } else {
                    lanes.iter_mut().zip(even).for_each(|(o, e)| *o = e.bf16());
                }
            }
            for i in 0..ni {
                let out = &mut pair_rows[(i0 + i) * stride + p0..][..np];
                for (p, o) in out.iter_mut().enumerate() {
                    *o = block[p][i];
                }
            }
        }
    }
}

/// [`a_rows`] compiled for AVX-512 (the same bits: the rounding to bf16 is
/// integer arithmetic on the f32 bits).
///
/// # Safety
/// The CPU has AVX512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn a_rows_avx512(a: Operand, m: usize, k: usize, buf: &mut Vec<u32>) -> usize {
    a_rows(a, m, k, buf)
}

/// A's rows as [`a_rows`] wrote them.
#[derive(Clone, Copy)]
pub(super) struct ARows<'a> {
    pub rows: &'a [u32],
    /// Pairs a row.
    pub stride: usize,
}

/// The output's columns of each panel in `panels` (`panel * NR ..`, NR
/// a panel), on this thread's tiles.
///
/// # Safety
/// [`available`] is true and the CPU has AVX512F; `dst` points at the
/// M × N output, whose columns of these panels no other thread reads or
/// writes meanwhile; `a` holds A's rows for `s` ([`a_rows`]).
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn panels_product(
    s: Shape,
    a: ARows,
    b_packed: &mut Vec<u32>,
    b: Operand,
    panels: std::ops::Range<usize>,
    dst: OutPtr,
    write: Write,
) {
    let block_pairs = KC_PAIRS.min(s.kp).next_multiple_of(STEP_PAIRS);
    b_packed.resize(block_pairs * NR, 0);
    assert!(a.rows.len() >= s.m.next_multiple_of(ROWS) * a.stride && a.stride >= s.kp);
    // SAFETY: the caller's contract: the process holds the tile data.
    let _tiles = unsafe { Tiles::configure() };
    let mut sums = [[0f32; NR]; ROWS];
    for panel in panels {
        let c0 = panel * NR;
        let cols = NR.min(s.n - c0);
        for p0 in (0..s.kp).step_by(KC_PAIRS) {
            let pairs = KC_PAIRS.min(s.kp - p0);
            let steps = pairs.div_ceil(STEP_PAIRS);
            let block = Block {
                r0: c0,
                nr: cols,
                p0,
                pairs,
            };
            pack(b, s.n, s.k, block, b_packed);
            b_packed[pairs * NR..steps * STEP_PAIRS * NR].fill(0);
            let add = p0 > 0 || write == Write::Add;
            for r0 in (0..s.m).step_by(ROWS) {
                // SAFETY: rows r0..r0 + ROWS of A's padded rows and pairs
                // p0..p0 + steps · 16 ≤ stride are in `a.rows` (asserted
                // above); `b_packed` holds steps · 16 pairs × NR; the tiles
                // are configured.
                let a_block = unsafe { a.rows.as_ptr().add(r0 * a.stride + p0) };
                let b_block = b_packed.as_ptr();
                if !add && cols == NR && r0 + ROWS <= s.m {
                    // A whole block that sets its outputs: the tiles store
                    // it in place. SAFETY: as above; its 32 rows × NR
                    // columns are in the output (whole) and this thread's
                    // alone (the caller's contract).
                    unsafe {
                        let out = dst.0.add(r0 * s.n + c0);
                        block_product(a_block, a.stride, b_block, steps, out, s.n);
                    }
                    continue;
                }
                // SAFETY: as above; `sums` holds 32 rows of NR.
                unsafe {
                    let out = sums.as_mut_ptr().cast::<f32>();
                    block_product(a_block, a.stride, b_block, steps, out, NR);
                }
                let rows = &sums[..ROWS.min(s.m - r0)];
                // SAFETY: these rows and the panel's columns are in the
                // output and this thread's alone (the caller's contract).
                unsafe { write_rows(dst, s.n, (r0, c0), cols, rows, add) };
            }
        }
    }
}

/// The 32 × 32 sums of A's 32 rows (at `a`, `stride` pairs a row) times
/// B's panel (at `b`, pairs × NR), over `steps` steps of 16 pairs, on
/// tiles, written to `out`'s 32 rows of NR values, `out_row` values apart.
///
/// # Safety
/// The tiles are configured ([`Tiles`]); `a` points at 32 rows of at
/// least `steps` · 16 readable pairs, `stride` pairs apart, and `b` at
/// `steps` · 16 × NR readable pairs; `out` at 32 rows of NR writable f32,
/// `out_row` ≥ NR apart, that nothing else reads or writes meanwhile.
unsafe fn block_product(
    a: *const u32,
    stride: usize,
    b: *const u32,
    steps: usize,
    out: *mut f32,
    out_row: usize,
) {
    debug_assert!(steps > 0 && out_row >= NR);
    let row_bytes = 4 * stride;
    // SAFETY: the loads read what the contract says is readable: A's
    // rows 0..16 and 16..32 at `a` and `a + 16 rows`, 64 bytes each a
    // step; B's 16 pairs × 32 columns a step (two tiles of 16 columns,
    // the second 64 bytes in); the stores write 32 rows × 32 f32 at `out`
    // (the right tiles 64 bytes in, the lower ones 16 rows down), as the
    // contract allows. The tile
    // registers are used within this block alone; their shapes were set
    // by `Tiles::configure` on this thread, and no code the compiler
    // emits touches tiles (nothing in this crate enables AMX).
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{a0} + {row_bytes}*1]",
            "tileloadd tmm5, [{a1} + {row_bytes}*1]",
            "tileloadd tmm6, [{b} + {b_row}*1]",
            "tileloadd tmm7, [{b} + {b_row}*1 + 64]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, 64",
            "add {a1}, 64",
            "add {b}, {b_step}",
            "dec {steps}",
            "jnz 2b",
            "tilestored [{out} + {out_row}*1], tmm0",
            "tilestored [{out} + {out_row}*1 + 64], tmm1",
            "tilestored [{lower} + {out_row}*1], tmm2",
            "tilestored [{lower} + {out_row}*1 + 64], tmm3",
            a0 = inout(reg) a => _,
            a1 = inout(reg) a.add(16 * stride) => _,
            b = inout(reg) b => _,
            steps = inout(reg) steps => _,
            row_bytes = in(reg) row_bytes,
            b_row = in(reg) 4 * NR,
            b_step = in(reg) 4 * NR * STEP_PAIRS,
            out = in(reg) out,
            lower = in(reg) out.add(16 * out_row),
            out_row = in(reg) 4 * out_row,
            options(nostack),
        );
    }
}

/// bf16 products (each counted as a multiply and an add) of one round of
/// [`dot_loop`]: four tiles of 16 × 16 sums of 32 products.
pub const DOT_LOOP_FLOPS: f64 = 4.0 * 16.0 * 16.0 * 32.0 * 2.0;

/// `rounds` rounds of four independent `tdpbf16ps` (the tile's
/// throughput, which no GEMM on it beats); the sum of one tile's first
/// row, so that the loop is not discarded. `None` where the CPU lacks
/// AMX-BF16 or the process was refused the tile data (where
/// `Bf16Kernel::Amx` is not supported).
pub fn dot_loop(rounds: u64) -> Option<f32> {
    if !available() || rounds == 0 {
        return None;
    }
    // Pairs of (0.996, 1e-7) as bf16: the sums stay finite.
    let operand = [0x33d6_3f7fu32; 16 * STEP_PAIRS];
    let mut sums = [[0f32; NR]; ROWS];
    // SAFETY: the process holds the tile data (`available`).
    let _tiles = unsafe { Tiles::configure() };
    // SAFETY: the loads read `operand`'s 16 rows of 64 bytes; the store
    // writes 16 rows of 64 bytes of `sums` (rows of 128 bytes); the tiles
    // are configured, and used within this block alone (as in
    // `block_product`).
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "tileloadd tmm4, [{a} + {row}*1]",
            "tileloadd tmm5, [{a} + {row}*1]",
            "tileloadd tmm6, [{a} + {row}*1]",
            "tileloadd tmm7, [{a} + {row}*1]",
            "2:",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "dec {rounds}",
            "jnz 2b",
            "tilestored [{out} + {out_row}*1], tmm0",
            a = in(reg) operand.as_ptr(),
            row = in(reg) 64usize,
            rounds = inout(reg) rounds => _,
            out = in(reg) sums.as_mut_ptr(),
            out_row = in(reg) 4 * NR,
            options(nostack),
        );
    }
    Some(sums[0][..16].iter().sum())
}
