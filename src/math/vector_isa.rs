//! The vector instructions a plain loop is compiled for. The build targets
//! baseline x86-64 (SSE2: four f32 lanes), so a hot loop written plainly
//! runs at a quarter of what an AVX-512 core offers. Compiling the same
//! code again under `#[target_feature]` and choosing the copy at run time
//! changes no result: Rust forms no fused multiply-add from `a * b + c`
//! and reorders no float sum, whatever the target, so every copy computes
//! the same IEEE operations in the same order — the same bits — and the
//! choice is one of speed only (held by the attention's tests, which run
//! every copy this CPU has against the plain oracle).

/// The widest vectors a loop's copy uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VectorIsa {
    /// The build's target (SSE2 on x86-64).
    Baseline,
    /// 256-bit AVX2, with FMA (x86-64; the loops form no fused
    /// multiply-add themselves, but the copy is compiled with it enabled).
    Avx2,
    /// 512-bit AVX-512 F, VL, BW and DQ, with AVX2 and FMA (x86-64).
    Avx512,
}

impl VectorIsa {
    /// The widest this CPU runs (detected once).
    pub fn detected() -> Self {
        static ISA: std::sync::OnceLock<VectorIsa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            [Self::Avx512, Self::Avx2]
                .into_iter()
                .find(|isa| isa.supported())
                .unwrap_or(Self::Baseline)
        })
    }

    /// Every one this CPU runs, narrowest first.
    pub fn supported_here() -> Vec<Self> {
        [Self::Baseline, Self::Avx2, Self::Avx512]
            .into_iter()
            .filter(|isa| isa.supported())
            .collect()
    }

    /// Whether this CPU runs it.
    pub fn supported(self) -> bool {
        match self {
            Self::Baseline => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => {
                use std::arch::is_x86_feature_detected as has;
                has!("avx2") && has!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => {
                use std::arch::is_x86_feature_detected as has;
                let avx512 = has!("avx512f") && has!("avx512vl") && has!("avx512bw");
                avx512 && has!("avx512dq") && has!("avx2") && has!("fma")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx2 | Self::Avx512 => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Baseline => "baseline",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
        }
    }
}

/// Defines `$name`, which runs `$body` (an `#[inline(always)]` function
/// taking the same arguments, generic over one type or not) compiled for
/// the [`VectorIsa`] it is given, falling back to the baseline copy for
/// one this CPU lacks.
macro_rules! multiversioned {
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident $(<$r:ident: $bound:path>)? (
            $($arg:ident: $ty:ty),* $(,)?
        ) => $body:ident;
    ) => {
        $(#[$meta])*
        $vis fn $name $(<$r: $bound>)? (
            isa: $crate::math::vector_isa::VectorIsa,
            $($arg: $ty),*
        ) {
            use $crate::math::vector_isa::VectorIsa;
            // Safety: called only where `supported` detected these features.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
            unsafe fn avx512 $(<$r: $bound>)? ($($arg: $ty),*) {
                $body($($arg),*)
            }
            // Safety: called only where `supported` detected these features.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2 $(<$r: $bound>)? ($($arg: $ty),*) {
                $body($($arg),*)
            }
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `supported` detected AVX-512 F, VL, BW and DQ,
                // AVX2 and FMA on this CPU.
                VectorIsa::Avx512 if isa.supported() => unsafe { avx512($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `supported` detected AVX2 and FMA on this CPU.
                VectorIsa::Avx2 if isa.supported() => unsafe { avx2($($arg),*) },
                _ => $body($($arg),*),
            }
        }
    };
}

pub(crate) use multiversioned;

/// The CPU's flags as the kernel lists them in `/proc/cpuinfo` (its first
/// `flags` line), where there is one: what the tests of a kernel's choice
/// compare the run-time detection with.
#[cfg(test)]
pub(crate) fn cpuinfo_flags() -> Option<Vec<String>> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("flags"))?;
    let flags: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
    (!flags.is_empty()).then_some(flags)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The detected one is the widest supported, and the baseline is
    /// always there.
    #[test]
    fn the_detected_isa_is_the_widest_this_cpu_runs() {
        let here = VectorIsa::supported_here();
        assert_eq!(here[0], VectorIsa::Baseline);
        assert_eq!(Some(&VectorIsa::detected()), here.last());
    }

    /// Which sets this CPU runs, asked of the kernel's record of its flags
    /// (`/proc/cpuinfo`, where there is one) rather than of the detection
    /// the code uses; the names are the ones `bench attention` prints.
    #[test]
    fn the_cpu_s_flags_choose_the_vector_set() {
        if let Some(flags) = cpuinfo_flags().filter(|_| cfg!(target_arch = "x86_64")) {
            let has = |f: &str| flags.iter().any(|g| g == f);
            let avx2 = has("avx2") && has("fma");
            let avx512 = ["avx512f", "avx512vl", "avx512bw", "avx512dq"]
                .iter()
                .all(|f| has(f))
                && avx2;
            assert_eq!(VectorIsa::Avx2.supported(), avx2, "{flags:?}");
            assert_eq!(VectorIsa::Avx512.supported(), avx512, "{flags:?}");
            let want = [(avx512, VectorIsa::Avx512), (avx2, VectorIsa::Avx2)]
                .into_iter()
                .find(|(here, _)| *here)
                .map_or(VectorIsa::Baseline, |(_, isa)| isa);
            assert_eq!(VectorIsa::detected(), want);
        }
        let names = [VectorIsa::Baseline, VectorIsa::Avx2, VectorIsa::Avx512].map(VectorIsa::name);
        assert_eq!(names, ["baseline", "avx2", "avx512"]);
    }
}
