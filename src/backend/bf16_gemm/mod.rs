//! The cpu's bf16 GEMM: out (M, N) (+)= A (M, K) · B (N, K)ᵀ with both
//! operands rounded to bf16 (round to nearest even) and the products
//! summed in f32, for the expert FFN when its compute params are bf16
//! (`ExpertGemm::Bf16`): the weights are read as they are stored, not
//! widened, and the activations are rounded once as they are packed.
//!
//! Blocked as BLIS is: A is packed once into blocks of MR rows, K's pairs
//! innermost; each thread takes a range of N's panels of NR columns and, a
//! block of `KC_PAIRS` pairs at a time, packs up to `B_PANELS_BYTES` of
//! its panels (which then stay in L2 while every block of A passes them)
//! and computes their MR × NR tiles (`kernel.rs`). Each output element is
//! the same sum in the same order whatever the threads (they split N,
//! never K), and the same on every CPU (see `kernel.rs`): the sum of each
//! block of K, then the blocks added
//! to the output in K's order. Where the CPU has AMX, its tiles compute
//! the blocks instead (`amx.rs`, [`Bf16Kernel::Amx`]): the same blocks in
//! the same order, each block's sum rounded the tile's way, so the same
//! bits whatever the threads but not those of the other kernels;
//! [`Bf16Kernel::choose`] picks another for a process.

mod a_pairs;
#[cfg(target_arch = "x86_64")]
mod amx;
mod kernel;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86_pack;
#[cfg(target_arch = "x86_64")]
mod x86_tiles;

use a_pairs::APairs;
#[cfg(target_arch = "x86_64")]
use a_pairs::{a_pairs_avx2, a_pairs_avx512};
#[cfg(target_arch = "x86_64")]
pub use amx::{dot_loop as amx_dot_loop, DOT_LOOP_FLOPS as AMX_DOT_LOOP_FLOPS};
pub use kernel::Bf16Kernel;
use kernel::{Tile, MR, NR};

use super::gemm::{threads_for, Write};
use crate::parallel::{compute_threads, run_all};

/// Pairs of K in a block: a panel's block is NR × 2 × `KC_PAIRS` bf16 =
/// 16 KiB, half of a small L1.
const KC_PAIRS: usize = 128;

/// The most bytes of B's packed panels a thread keeps for one block of K
/// (`panel_product`): 64 panels of `KC_PAIRS` pairs, within this
/// machine's 2 MiB L2 beside A's rows.
pub const B_PANELS_BYTES: usize = 1 << 20;

/// A GEMM operand's values.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Values<'a> {
    /// Rounded to bf16 as they are packed.
    F32(&'a [f32]),
    /// bf16 bit patterns, read as they are.
    Bf16(&'a [u16]),
}

/// An operand X of R rows and K columns (A: R = M, B: R = N), stored
/// either way.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operand<'a> {
    pub values: Values<'a>,
    /// X(r, k) at `k * R + r` (a matrix stored transposed: a weight read
    /// along its output dimension, or activations summed over tokens);
    /// else at `r * K + k`.
    pub k_major: bool,
}

impl<'a> Operand<'a> {
    pub fn rows(values: Values<'a>) -> Self {
        Self {
            values,
            k_major: false,
        }
    }

    pub fn k_major(values: Values<'a>) -> Self {
        Self {
            values,
            k_major: true,
        }
    }

    fn len(&self) -> usize {
        match self.values {
            Values::F32(v) => v.len(),
            Values::Bf16(v) => v.len(),
        }
    }
}

/// `x` rounded to the nearest bf16 (ties to even), as bits; a NaN stays a
/// NaN.
#[inline(always)]
pub(crate) fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// A value read as a bf16 bit pattern.
trait Bf16Bits: Copy {
    fn bf16(self) -> u32;
}

impl Bf16Bits for f32 {
    #[inline(always)]
    fn bf16(self) -> u32 {
        bf16_bits(self) as u32
    }
}

impl Bf16Bits for u16 {
    #[inline(always)]
    fn bf16(self) -> u32 {
        self as u32
    }
}

/// A block of an operand to pack: rows `r0..r0 + nr` of R, pairs
/// `p0..p0 + pairs` of K, into NR lanes a pair (B's panel; A is read in
/// place, see [`a_pairs`]).
#[derive(Clone, Copy)]
struct Block {
    r0: usize,
    nr: usize,
    p0: usize,
    pairs: usize,
}

/// Packs `block` of X (R × K) into `out` (pairs × NR u32, the even k
/// in the low half); lanes past the rows, and a last k past K, are zero.
#[inline(always)]
fn pack(x: Operand, r: usize, k: usize, block: Block, out: &mut [u32]) {
    match x.values {
        Values::F32(v) => pack_values(v, x.k_major, r, k, block, out),
        Values::Bf16(v) => {
            // Rows of bf16 whose pairs are whole u32 (an even K, a 4-byte
            // aligned start): each lane one load.
            match bytemuck::try_cast_slice::<u16, u32>(v) {
                Ok(pairs) if !x.k_major && k.is_multiple_of(2) => {
                    pack_pairs(pairs, k / 2, block, out)
                }
                _ => pack_values(v, x.k_major, r, k, block, out),
            }
        }
    }
}

/// [`pack_values`] for rows of `kp` whole pairs each.
#[inline(always)]
fn pack_pairs(v: &[u32], kp: usize, b: Block, out: &mut [u32]) {
    let out = &mut out[..b.pairs * NR];
    #[cfg(target_arch = "x86_64")]
    if b.nr == NR && std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX512F (checked).
        unsafe { x86_pack::pack_pairs_avx512(v, kp, (b.r0, b.p0, b.pairs), out) };
        return;
    }
    if b.nr < NR {
        out.fill(0);
    }
    for i in 0..b.nr {
        let row = &v[(b.r0 + i) * kp + b.p0..][..b.pairs];
        for (p, &pair) in row.iter().enumerate() {
            out[p * NR + i] = pair;
        }
    }
}

#[inline(always)]
fn pack_values<T: Bf16Bits>(v: &[T], k_major: bool, r: usize, k: usize, b: Block, out: &mut [u32]) {
    let out = &mut out[..b.pairs * NR];
    if b.nr < NR {
        out.fill(0);
    }
    if k_major {
        for p in 0..b.pairs {
            let k0 = 2 * (b.p0 + p);
            let even = &v[k0 * r + b.r0..][..b.nr];
            let lanes = &mut out[p * NR..][..b.nr];
            if k0 + 1 < k {
                let odd = &v[(k0 + 1) * r + b.r0..][..b.nr];
                for ((o, e), d) in lanes.iter_mut().zip(even).zip(odd) {
                    *o = e.bf16() | d.bf16() << 16;
                }
            } else {
                for (o, e) in lanes.iter_mut().zip(even) {
                    *o = e.bf16();
                }
            }
        }
    } else {
        for i in 0..b.nr {
            let row = &v[(b.r0 + i) * k..][..k];
            for p in 0..b.pairs {
                let k0 = 2 * (b.p0 + p);
                let odd = if k0 + 1 < k { row[k0 + 1].bf16() } else { 0 };
                out[p * NR + i] = row[k0].bf16() | odd << 16;
            }
        }
    }
}

/// out (M, N) (+)= A (M, K) · B (N, K)ᵀ on bf16-rounded operands, as
/// `write` says, on the compute threads with this CPU's kernel.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_bf16(
    out: &mut [f32],
    write: Write,
    a: Operand,
    b: Operand,
    m: usize,
    k: usize,
    n: usize,
) {
    gemm_bf16_on(compute_threads(), out, write, a, b, (m, k, n));
}

/// [`gemm_bf16`] on at most `threads` threads (one of GEMMs that run side
/// by side).
pub(crate) fn gemm_bf16_on(
    threads: usize,
    out: &mut [f32],
    write: Write,
    a: Operand,
    b: Operand,
    (m, k, n): (usize, usize, usize),
) {
    let parts = threads_for(bf16_work(m * k * n), threads);
    gemm_bf16_with(Bf16Kernel::in_use(), parts, out, write, a, b, (m, k, n));
}

/// `macs` bf16 multiply-adds as the f32 multiply-adds `threads_for`
/// weighs: `vdpbf16ps` and AMX's tiles do at least twice as many a cycle
/// as an f32 FMA, so with them a split pays only past twice as many; the
/// FMA and portable kernels do f32's.
pub(crate) fn bf16_work(macs: usize) -> usize {
    match Bf16Kernel::in_use() {
        Bf16Kernel::Avx512 | Bf16Kernel::Amx => macs / 2,
        Bf16Kernel::Avx512Fma | Bf16Kernel::Avx2Fma | Bf16Kernel::Portable => macs,
    }
}

/// The output's address, shared by the threads that write its disjoint
/// column ranges.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: each thread writes only the columns of its own panels (see
// `panel_product`), so no element is written by two threads or read by
// another.
unsafe impl Send for OutPtr {}
// SAFETY: as for `Send`.
unsafe impl Sync for OutPtr {}

/// [`gemm_bf16`] with `kernel` over `parts` threads.
pub(crate) fn gemm_bf16_with(
    kernel: Bf16Kernel,
    parts: usize,
    out: &mut [f32],
    write: Write,
    a: Operand,
    b: Operand,
    (m, k, n): (usize, usize, usize),
) {
    assert_eq!(out.len(), m * n, "the output is M × N");
    assert!(
        a.len() == m * k && b.len() == n * k,
        "A is M × K, B is N × K"
    );
    if m * n == 0 {
        return;
    }
    if k == 0 {
        if write == Write::Set {
            out.fill(0.0);
        }
        return;
    }
    let shape = Shape {
        m,
        k,
        n,
        kp: k.div_ceil(2),
    };
    let panels = n.div_ceil(NR);
    let parts = parts.clamp(1, panels);
    let dst = OutPtr(out.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    if kernel == Bf16Kernel::Amx {
        return gemm_amx(shape, parts, dst, write, a, b);
    }
    gemm_on_pairs(kernel, shape, parts, dst, write, a, b);
}

/// [`gemm_bf16_with`] on AMX's tiles: A's rows laid out for the tiles
/// once, B's panels packed and multiplied a part of them a thread.
#[cfg(target_arch = "x86_64")]
fn gemm_amx(shape: Shape, parts: usize, dst: OutPtr, write: Write, a: Operand, b: Operand) {
    let (m, k, panels) = (shape.m, shape.k, shape.n.div_ceil(NR));
    assert!(Bf16Kernel::Amx.supported(), "the CPU lacks AMX-BF16");
    let mut a_buf = A_ROWS.take();
    // SAFETY: the CPU has AVX512F (the AMX kernel needs it).
    let stride = unsafe { amx::a_rows_avx512(a, m, k, &mut a_buf) };
    let a = amx::ARows {
        rows: &a_buf,
        stride,
    };
    on_panels(parts, panels, |range| {
        let mut b_packed = B_PACKED.take();
        // SAFETY: the process holds the tile data and the CPU has
        // AVX512F (the kernel is supported); the panels are split among
        // the threads, so this one alone writes their columns; `a` is
        // A's rows for this shape.
        unsafe { amx::panels_product(shape, a, &mut b_packed, b, range, dst, write) };
        B_PACKED.set(b_packed);
    });
    A_ROWS.set(a_buf);
}

/// [`gemm_bf16_with`] on A's pairs (bf16, or widened to f32 for the FMA
/// kernels) and B's packed panels, a part of the panels a thread.
fn gemm_on_pairs(
    kernel: Bf16Kernel,
    shape: Shape,
    parts: usize,
    dst: OutPtr,
    write: Write,
    a: Operand,
    b: Operand,
) {
    let (m, k, panels) = (shape.m, shape.k, shape.n.div_ceil(NR));
    // Reused from call to call on this thread.
    let (mut a_buf, mut a_wide) = (A_PAIRS.take(), A_WIDE.take());
    let strides = match kernel {
        #[cfg(target_arch = "x86_64")]
        Bf16Kernel::Avx512 => {
            assert!(kernel.supported(), "the CPU lacks {}", kernel.name());
            // SAFETY: the CPU has AVX512F (asserted: the kernel needs it).
            unsafe { a_pairs_avx512(a, m, k, &mut a_buf) }
        }
        #[cfg(target_arch = "x86_64")]
        Bf16Kernel::Avx512Fma => {
            assert!(kernel.supported(), "the CPU lacks {}", kernel.name());
            // SAFETY: the CPU has AVX512F (asserted: the kernel needs it).
            unsafe { a_pairs_avx512(a, m, k, &mut a_wide) }
        }
        #[cfg(target_arch = "x86_64")]
        Bf16Kernel::Avx2Fma => {
            assert!(kernel.supported(), "the CPU lacks {}", kernel.name());
            // SAFETY: the CPU has AVX2 (asserted: the kernel needs it).
            unsafe { a_pairs_avx2(a, m, k, &mut a_wide) }
        }
        _ => a_pairs::a_pairs(a, m, k, &mut a_buf),
    };
    let a = APairs {
        pairs: &a_buf,
        wide: &a_wide,
        strides,
    };
    on_panels(parts, panels, |range| {
        let mut b_packed = B_PACKED.take();
        // A panel's block of K, in u32s.
        let block = NR * KC_PAIRS.min(shape.kp);
        let chunk = (B_PANELS_BYTES / (4 * block)).clamp(1, range.len().max(1));
        b_packed.resize(chunk * block, 0);
        for first in range.clone().step_by(chunk) {
            let panels = first..(first + chunk).min(range.end);
            // SAFETY: panels are split among the threads, so this one
            // alone writes these panels' columns (`OutPtr`).
            unsafe { panel_product(kernel, shape, a, &mut b_packed, b, panels, dst, write) };
        }
        B_PACKED.set(b_packed);
    });
    A_PAIRS.set(a_buf);
    A_WIDE.set(a_wide);
}

/// Runs `job` on `parts` threads, each over its own range of the
/// `panels`.
fn on_panels(parts: usize, panels: usize, job: impl Fn(std::ops::Range<usize>) + Copy + Send) {
    let per_part = panels.div_ceil(parts);
    let range = move |first: usize| first..(first + per_part).min(panels);
    if parts == 1 {
        job(range(0));
    } else {
        run_all(
            (0..parts)
                .map(|i| move || job(range(i * per_part)))
                .collect(),
        );
    }
}

/// Writes (or, with `add`, adds) `rows` of sums into the output's rows
/// from `r0`, columns `c0..c0 + cols`.
///
/// # Safety
/// `dst` points at the M × N output (`n` columns) holding these rows and
/// columns, which no other thread reads or writes meanwhile.
#[inline(always)]
unsafe fn write_rows(
    dst: OutPtr,
    n: usize,
    (r0, c0): (usize, usize),
    cols: usize,
    rows: &[[f32; NR]],
    add: bool,
) {
    for (i, sums) in rows.iter().enumerate() {
        // SAFETY: row r0 + i and columns c0..c0 + cols are in the output
        // and the caller's alone (the contract).
        let row = unsafe { std::slice::from_raw_parts_mut(dst.0.add((r0 + i) * n + c0), cols) };
        match (add, <&mut [f32; NR]>::try_from(&mut *row)) {
            // A whole row of the tile: fixed-size, so registers rather than
            // a call to memcpy.
            (false, Ok(whole)) => *whole = *sums,
            (false, Err(_)) => row.copy_from_slice(&sums[..cols]),
            (true, _) => row.iter_mut().zip(sums).for_each(|(o, v)| *o += v),
        }
    }
}

thread_local! {
    /// A's pairs (`a_pairs`), kept for the thread's next call.
    static A_PAIRS: std::cell::Cell<Vec<u32>> = const { std::cell::Cell::new(Vec::new()) };
    /// A's pairs widened, likewise.
    static A_WIDE: std::cell::Cell<Vec<[f32; 2]>> = const { std::cell::Cell::new(Vec::new()) };
    /// A's rows for the AMX kernel (`amx::a_rows`), likewise.
    static A_ROWS: std::cell::Cell<Vec<u32>> = const { std::cell::Cell::new(Vec::new()) };
    /// Blocks of B's panels, likewise.
    static B_PACKED: std::cell::Cell<Vec<u32>> = const { std::cell::Cell::new(Vec::new()) };
}

#[derive(Clone, Copy)]
struct Shape {
    m: usize,
    k: usize,
    n: usize,
    /// Pairs of K.
    kp: usize,
}

/// The output's columns of `panels`, block of K by block of K: each
/// block's panels of B packed first (reading B along its rows where it is
/// stored k-major, as the backward's weights are), then each block of
/// A's rows passed over every panel, so that the output is written a
/// block of rows at a time. `b_packed` holds the panels' blocks.
///
/// # Safety
/// `dst` points at the M × N output, whose columns of `panels` no other
/// thread reads or writes meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn panel_product(
    kernel: Bf16Kernel,
    s: Shape,
    a: APairs,
    b_packed: &mut [u32],
    b: Operand,
    panels: std::ops::Range<usize>,
    dst: OutPtr,
    write: Write,
) {
    #[cfg(target_arch = "x86_64")]
    if matches!(kernel, Bf16Kernel::Avx512 | Bf16Kernel::Avx512Fma) {
        assert!(kernel.supported(), "the CPU lacks {}", kernel.name());
        // SAFETY: the CPU has AVX512F (asserted: the kernel needs it); the
        // output's columns are the caller's (its contract, passed on).
        return unsafe { panel_product_avx512(kernel, s, a, b_packed, b, panels, dst, write) };
    }
    #[cfg(target_arch = "x86_64")]
    if kernel == Bf16Kernel::Avx2Fma {
        assert!(kernel.supported(), "the CPU lacks {}", kernel.name());
        // SAFETY: the CPU has AVX2 (asserted: the kernel needs it); the
        // output's columns are the caller's (its contract, passed on).
        return unsafe { panel_product_avx2(kernel, s, a, b_packed, b, panels, dst, write) };
    }
    // SAFETY: the caller's contract, passed on.
    unsafe { panel_product_body(kernel, s, a, b_packed, b, panels, dst, write) }
}

/// [`panel_product`] compiled for AVX-512, so that the packing of B and
/// the tile's write into the output (plain loops, the same bits on any
/// target) use 512-bit registers beside the AVX-512 tiles.
///
/// # Safety
/// The CPU has AVX512F; the caller's contract of [`panel_product`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn panel_product_avx512(
    kernel: Bf16Kernel,
    s: Shape,
    a: APairs,
    b_packed: &mut [u32],
    b: Operand,
    panels: std::ops::Range<usize>,
    dst: OutPtr,
    write: Write,
) {
    // SAFETY: the caller's contract, passed on.
    unsafe { panel_product_body(kernel, s, a, b_packed, b, panels, dst, write) }
}

/// [`panel_product`] compiled for AVX2, likewise.
///
/// # Safety
/// The CPU has AVX2; the caller's contract of [`panel_product`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn panel_product_avx2(
    kernel: Bf16Kernel,
    s: Shape,
    a: APairs,
    b_packed: &mut [u32],
    b: Operand,
    panels: std::ops::Range<usize>,
    dst: OutPtr,
    write: Write,
) {
    // SAFETY: the caller's contract, passed on.
    unsafe { panel_product_body(kernel, s, a, b_packed, b, panels, dst, write) }
}

/// # Safety
/// As [`panel_product`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn panel_product_body(
    kernel: Bf16Kernel,
    s: Shape,
    a: APairs,
    b_packed: &mut [u32],
    b: Operand,
    panels: std::ops::Range<usize>,
    dst: OutPtr,
    write: Write,
) {
    let mut tile: Tile = [[0.0; NR]; MR];
    for p0 in (0..s.kp).step_by(KC_PAIRS) {
        let pairs = KC_PAIRS.min(s.kp - p0);
        // Every panel's block of this K block, packed first: B is read
        // along its rows, and each row block of A then passes every panel.
        for (i, panel) in panels.clone().enumerate() {
            let c0 = panel * NR;
            let block = Block {
                r0: c0,
                nr: NR.min(s.n - c0),
                p0,
                pairs,
            };
            pack(b, s.n, s.k, block, &mut b_packed[i * pairs * NR..]);
        }
        let add = p0 > 0 || write == Write::Add;
        for r0 in (0..s.m).step_by(MR) {
            let a_block = a.from(kernel, a.block_at(r0, p0, s.kp));
            for (i, panel) in panels.clone().enumerate() {
                let c0 = panel * NR;
                let cols = NR.min(s.n - c0);
                let b_block = &b_packed[i * pairs * NR..];
                kernel.tile(a_block, a.strides, b_block, pairs, &mut tile);
                let rows = &tile[..MR.min(s.m - r0)];
                // SAFETY: these rows and the panel's columns are in the
                // output and this thread's alone (the caller's contract).
                unsafe { write_rows(dst, s.n, (r0, c0), cols, rows, add) };
            }
        }
    }
}
