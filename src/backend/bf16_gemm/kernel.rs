//! The bf16 GEMM's register tiles: MR × NR f32 sums of packed bf16 pairs,
//! on AVX512-BF16 (`vdpbf16ps`), on AVX-512's f32 FMAs over the pairs
//! widened, or in plain code the compiler vectorizes. All three add a
//! pair's products in the order `vdpbf16ps` does — the odd element's
//! product, then the even one's, each add rounded once (a product of two
//! bf16 values is exact in f32, so an FMA of it rounds as that add does) —
//! so they give the same bits wherever no input, product or sum falls
//! below f32's normal range (`vdpbf16ps` flushes those to zero).

#[cfg(target_arch = "x86_64")]
use super::x86_tiles;

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
    /// f32 FMAs on 512-bit registers (x86-64 with AVX512F), over A's pairs
    /// widened once and B's widened in registers: the bits of the two
    /// above, at the FMA units' rate, which on cores that issue
    /// `vdpbf16ps` at half the FMAs' (measured by `strata bench kernels`)
    /// is twice the products a cycle.
    Avx512Fma,
    /// The same FMAs on 256-bit registers (x86-64 with AVX2 and FMA), for
    /// CPUs without AVX-512: the same bits again.
    Avx2Fma,
    /// `tdpbf16ps` on AMX tiles (x86-64 with AMX-TILE, AMX-BF16 and
    /// AVX512F, where the operating system grants the tile data): whole
    /// blocks of 32 × 32 sums (`amx.rs`) rather than this module's tiles;
    /// its last bits differ from the others' (see `amx.rs`).
    Amx,
}

impl Bf16Kernel {
    /// The fastest kernel this CPU runs (detected once): AMX where the
    /// CPU has it; else, where it runs both `vdpbf16ps` and AVX-512's FMAs,
    /// whichever computed a tile faster, timed here (their bits are the
    /// same, so the choice changes only the time); else the FMAs on the
    /// widest registers it has (AVX-512's, else AVX2's); else the portable
    /// code.
    pub fn detected() -> Self {
        static KERNEL: std::sync::OnceLock<Bf16Kernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| {
            if Self::Amx.supported() {
                return Self::Amx;
            }
            match (Self::Avx512.supported(), Self::Avx512Fma.supported()) {
                (true, true) => faster_tile(Self::Avx512, Self::Avx512Fma),
                (false, true) => Self::Avx512Fma,
                (true, false) => Self::Avx512,
                (false, false) if Self::Avx2Fma.supported() => Self::Avx2Fma,
                (false, false) => Self::Portable,
            }
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
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Every kernel, the portable one first.
    pub const ALL: [Self; 5] = [
        Self::Portable,
        Self::Avx2Fma,
        Self::Avx512Fma,
        Self::Avx512,
        Self::Amx,
    ];

    /// Every kernel this CPU runs, the portable one first.
    pub fn supported_here() -> Vec<Self> {
        Self::ALL.into_iter().filter(|k| k.supported()).collect()
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
            Self::Avx512Fma => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Self::Avx2Fma => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Amx => std::arch::is_x86_feature_detected!("avx512f") && super::amx::available(),
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx512 | Self::Avx512Fma | Self::Avx2Fma | Self::Amx => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx512 => "avx512-bf16",
            Self::Avx512Fma => "avx512-fma",
            Self::Avx2Fma => "avx2-fma",
            Self::Amx => "amx-bf16",
        }
    }

    /// `tile` = Σ over `pairs` pairs of A's block (its row i's pair p at
    /// index `i · si + p · sp` for `(si, sp)`, packed or widened as
    /// [`widens_a`](Self::widens_a) says) times B's panel (`b`: pairs ×
    /// NR), each element a bf16 pair (even element in the low half).
    pub(super) fn tile(
        self,
        a: ABlock,
        (si, sp): (usize, usize),
        b: &[u32],
        pairs: usize,
        tile: &mut Tile,
    ) {
        if pairs == 0 {
            *tile = [[0.0; NR]; MR];
            return;
        }
        let last = (MR - 1) * si + (pairs - 1) * sp;
        assert!(b.len() >= pairs * NR);
        match (self, a) {
            (Self::Portable, ABlock::Pairs(a)) => {
                assert!(a.len() > last);
                tile_portable(a, (si, sp), b, pairs, tile)
            }
            #[cfg(target_arch = "x86_64")]
            (Self::Avx512, ABlock::Pairs(a)) => {
                assert!(self.supported(), "the CPU lacks AVX512-BF16");
                assert!(a.len() > last);
                // SAFETY: the CPU has AVX512F and AVX512-BF16 (asserted);
                // `a` holds the MR rows' `pairs` pairs at these strides and
                // `b` `pairs` rows of NR (asserted).
                unsafe { x86_tiles::tile_avx512(a.as_ptr(), (si, sp), b.as_ptr(), pairs, tile) }
            }
            #[cfg(target_arch = "x86_64")]
            (Self::Avx512Fma, ABlock::Wide(a)) => {
                assert!(self.supported(), "the CPU lacks AVX512F");
                assert!(a.len() > last);
                // SAFETY: the CPU has AVX512F (asserted); `a` holds the MR
                // rows' `pairs` widened pairs at these strides and `b`
                // `pairs` rows of NR (asserted).
                unsafe {
                    x86_tiles::tile_avx512_fma(a.as_ptr().cast(), (si, sp), b.as_ptr(), pairs, tile)
                }
            }
            #[cfg(target_arch = "x86_64")]
            (Self::Avx2Fma, ABlock::Wide(a)) => {
                assert!(self.supported(), "the CPU lacks AVX2 or FMA");
                assert!(a.len() > last);
                // SAFETY: the CPU has AVX2 and FMA (asserted); `a` holds
                // the MR rows' `pairs` widened pairs at these strides and
                // `b` `pairs` rows of NR (asserted).
                unsafe {
                    x86_tiles::tile_avx2_fma(a.as_ptr().cast(), (si, sp), b.as_ptr(), pairs, tile)
                }
            }
            (Self::Amx, _) => {
                unreachable!("the AMX kernel computes whole blocks (amx.rs), not tiles")
            }
            (kernel, _) => unreachable!("{kernel:?} was handed A's pairs in another form"),
        }
    }

    /// Whether the kernel reads A's pairs widened to f32 ([`ABlock::Wide`]).
    pub(super) fn widens_a(self) -> bool {
        matches!(self, Self::Avx512Fma | Self::Avx2Fma)
    }
}

/// A block of A's pairs, as a kernel reads them.
#[derive(Clone, Copy)]
pub(super) enum ABlock<'a> {
    /// bf16 pairs, the even element in the low half.
    Pairs(&'a [u32]),
    /// Each pair as two f32, the even element first.
    Wide(&'a [[f32; 2]]),
}

/// Of two kernels that give the same bits, the one that computed a tile of
/// a whole block of pairs faster: each timed 8 times over 5 rounds, taken
/// in turn, the best round of each compared.
pub(super) fn faster_tile(x: Bf16Kernel, y: Bf16Kernel) -> Bf16Kernel {
    const PAIRS: usize = 128;
    let pairs: Vec<u32> = (0..MR * PAIRS)
        .map(|i| 0x3f80_3f80 ^ (i as u32 & 0x007f_007f))
        .collect();
    let wide: Vec<[f32; 2]> = pairs
        .iter()
        .map(|&p| {
            let (even, odd) = halves(p);
            [even, odd]
        })
        .collect();
    let b: Vec<u32> = (0..PAIRS * NR)
        .map(|i| 0x3f00_3f00 ^ (i as u32 & 0x7f))
        .collect();
    let mut tile: Tile = [[0.0; NR]; MR];
    let mut time = |k: Bf16Kernel| {
        let a = if k.widens_a() {
            ABlock::Wide(&wide)
        } else {
            ABlock::Pairs(&pairs)
        };
        let t0 = std::time::Instant::now();
        for _ in 0..8 {
            k.tile(a, (PAIRS, 1), &b, PAIRS, &mut tile);
            std::hint::black_box(&mut tile);
        }
        t0.elapsed()
    };
    let (mut best_x, mut best_y) = (std::time::Duration::MAX, std::time::Duration::MAX);
    for _ in 0..5 {
        best_x = best_x.min(time(x));
        best_y = best_y.min(time(y));
    }
    if best_y < best_x {
        y
    } else {
        x
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
