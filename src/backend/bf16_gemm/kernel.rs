//! The bf16 GEMM's register tiles: MR × NR f32 sums of packed bf16 pairs,
//! on AVX512-BF16 (`vdpbf16ps`) where the CPU has it, else in plain code
//! the compiler vectorizes. Both add a pair's products in the order
//! `vdpbf16ps` does — the odd element's product, then the even one's, each
//! add rounded once (a product of two bf16 values is exact in f32) — so
//! they give the same bits wherever no input, product or sum falls below
//! f32's normal range (`vdpbf16ps` flushes those to zero).

/// Rows of a register tile (of A's packed block).
pub(super) const MR: usize = 8;
/// Columns of a register tile (two 16-lane registers).
pub(super) const NR: usize = 32;

/// The kernel of this process's bf16 GEMMs, once fixed
/// ([`Bf16Kernel::in_use`]).
static CHOSEN: std::sync::OnceLock<Bf16Kernel> = std::sync::OnceLock::new();

/// A tile's sums, row by row.
pub(super) type Tile = [[f32; NR]; MR];

/// Which code computes the tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// Plain code (any CPU).
    Portable,
    /// `vdpbf16ps` on 512-bit registers (x86-64 with AVX512F and AVX512-BF16).
    Avx512,
    /// `tdpbf16ps` on AMX tiles (x86-64 with AMX-TILE, AMX-BF16 and
    /// AVX512F, where the operating system grants the tile data): whole
    /// blocks of 32 × 32 sums (`amx.rs`) rather than this module's tiles;
    /// its last bits differ from the others' (see `amx.rs`).
    Amx,
}

impl Bf16Kernel {
    /// The fastest kernel this CPU runs (detected once).
    pub fn detected() -> Self {
        static KERNEL: std::sync::OnceLock<Bf16Kernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| {
            [Self::Amx, Self::Avx512]
                .into_iter()
                .find(|k| k.supported())
                .unwrap_or(Self::Portable)
        })
    }

    /// The kernel the bf16 GEMMs of this process use: the one
    /// [`choose`](Self::choose) fixed, else [`detected`](Self::detected)
    /// (fixed at the first GEMM).
    pub fn in_use() -> Self {
        *CHOSEN.get_or_init(Self::detected)
    }

    /// Fixes the kernel of this process's bf16 GEMMs, before the first:
    /// the AMX kernel's sums differ from the others' in their last bits,
    /// so a run that must give the bits a machine without AMX gives
    /// chooses `avx512-bf16` (or `portable`, the same bits). Refused for a
    /// kernel this CPU lacks, and once another is in use.
    pub fn choose(self) -> Result<(), String> {
        if !self.supported() {
            let here: Vec<_> = Self::supported_here().iter().map(|k| k.name()).collect();
            return Err(format!(
                "this CPU cannot run the {} kernel (it runs {})",
                self.name(),
                here.join(", ")
            ));
        }
        let fixed = *CHOSEN.get_or_init(|| self);
        if fixed != self {
            return Err(format!(
                "the bf16 GEMMs of this process already use the {} kernel (chosen before \
                 the first GEMM; it cannot change once one has run)",
                fixed.name()
            ));
        }
        Ok(())
    }

    /// The kernel of this name ([`name`](Self::name)).
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Portable, Self::Avx512, Self::Amx]
            .into_iter()
            .find(|k| k.name() == name)
    }

    /// Every kernel this CPU runs, slowest first.
    pub fn supported_here() -> Vec<Self> {
        [Self::Portable, Self::Avx512, Self::Amx]
            .into_iter()
            .filter(|k| k.supported())
            .collect()
    }

    /// Whether this CPU runs it.
    pub fn supported(self) -> bool {
        match self {
            Self::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Amx => std::arch::is_x86_feature_detected!("avx512f") && super::amx::available(),
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx512 | Self::Amx => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx512 => "avx512-bf16",
            Self::Amx => "amx-bf16",
        }
    }

    /// `tile` = Σ over `pairs` pairs of A's block (its row i's pair p at
    /// `a[i · si + p · sp]` for `(si, sp)`) times B's panel (`b`: pairs ×
    /// NR), each element a bf16 pair (even element in the low half).
    pub(super) fn tile(
        self,
        a: &[u32],
        (si, sp): (usize, usize),
        b: &[u32],
        pairs: usize,
        tile: &mut Tile,
    ) {
        if pairs == 0 {
            *tile = [[0.0; NR]; MR];
            return;
        }
        assert!(a.len() > (MR - 1) * si + (pairs - 1) * sp && b.len() >= pairs * NR);
        match self {
            Self::Portable => tile_portable(a, (si, sp), b, pairs, tile),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => {
                assert!(self.supported(), "the CPU lacks AVX512-BF16");
                // SAFETY: the CPU has AVX512F and AVX512-BF16 (asserted);
                // `a` holds the MR rows' `pairs` pairs at these strides and
                // `b` `pairs` rows of NR (asserted).
                unsafe { tile_avx512(a.as_ptr(), (si, sp), b.as_ptr(), pairs, tile) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx512 => unreachable!("AVX-512 is x86-64's"),
            Self::Amx => unreachable!("the AMX kernel computes whole blocks (amx.rs), not tiles"),
        }
    }
}

/// The low (even) and high (odd) bf16 of a pair, widened to f32.
#[inline(always)]
fn halves(pair: u32) -> (f32, f32) {
    (
        f32::from_bits(pair << 16),
        f32::from_bits(pair & 0xffff_0000),
    )
}

fn tile_portable(a: &[u32], (si, sp): (usize, usize), b: &[u32], pairs: usize, tile: &mut Tile) {
    *tile = [[0.0; NR]; MR];
    let (mut even, mut odd) = ([0f32; NR], [0f32; NR]);
    for p in 0..pairs {
        let bp = &b[p * NR..(p + 1) * NR];
        for j in 0..NR {
            (even[j], odd[j]) = halves(bp[j]);
        }
        for (i, row) in tile.iter_mut().enumerate() {
            let (ae, ao) = halves(a[i * si + p * sp]);
            for j in 0..NR {
                row[j] = (row[j] + ao * odd[j]) + ae * even[j];
            }
        }
    }
}

/// 32 bf16 bit patterns as the vector `vdpbf16ps` reads.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn as_bf16(v: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m512bh {
    use std::arch::x86_64::{__m512bh, __m512i};
    // SAFETY: both are 64 bytes of plain data, every bit pattern valid.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// # Safety
/// The CPU has AVX512F and AVX512-BF16; `a` points at MR rows of `pairs`
/// readable pairs at strides (si, sp), and `b` at `pairs` × NR.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_avx512(
    a: *const u32,
    (si, sp): (usize, usize),
    b: *const u32,
    pairs: usize,
    tile: &mut Tile,
) {
    use std::arch::x86_64::*;
    // SAFETY: each row's first pair is in bounds (the contract).
    let rows: [*const u32; MR] = std::array::from_fn(|i| unsafe { a.add(i * si) });
    let mut lo = [_mm512_setzero_ps(); MR];
    let mut hi = [_mm512_setzero_ps(); MR];
    for p in 0..pairs {
        // SAFETY: row `p` of B's panel, NR = 32 pairs, is in bounds (the
        // function's contract); the loads are unaligned.
        let (b0, b1) = unsafe {
            let at = b.add(p * NR);
            (
                _mm512_loadu_si512(at.cast()),
                _mm512_loadu_si512(at.add(16).cast()),
            )
        };
        let (b0, b1) = (as_bf16(b0), as_bf16(b1));
        for i in 0..MR {
            // SAFETY: row i's pair p is in bounds (the contract).
            let ai = as_bf16(_mm512_set1_epi32(unsafe { *rows[i].add(p * sp) } as i32));
            lo[i] = _mm512_dpbf16_ps(lo[i], ai, b0);
            hi[i] = _mm512_dpbf16_ps(hi[i], ai, b1);
        }
    }
    for i in 0..MR {
        // SAFETY: each tile row holds NR = 32 f32; unaligned stores.
        unsafe {
            _mm512_storeu_ps(tile[i].as_mut_ptr(), lo[i]);
            _mm512_storeu_ps(tile[i].as_mut_ptr().add(16), hi[i]);
        }
    }
}
