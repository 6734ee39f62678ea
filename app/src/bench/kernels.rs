//! `strata bench kernels`: the cpu backend's expert FFN, and the GEMM it
//! is made of, at the presets' expert shapes, in f32 and in bf16 (the
//! params as stored, `ExpertGemm`), against this machine's peaks measured
//! in the same run: loops of independent f32 fused multiply-adds, of bf16
//! pair dot products (`vdpbf16ps`), and of AMX tile products
//! (`tdpbf16ps`), on every compute thread, which nothing can beat. Each
//! repetition times the peak loops, then every shape: a shape's time is
//! its median repetition's, a peak the highest repetition's (another
//! tenant's work can only lower what the loop reaches). The f32 peak needs
//! AVX2 and FMA, the bf16 one AVX512-BF16, the tiles' AMX-BF16 (x86-64);
//! elsewhere a peak is reported as unknown and no share of it is given. A
//! bf16 line's share is of the peak of its kernel's instruction.

use std::time::{Duration, Instant};

use serde::Serialize;
use strata::backend::{gemm_forward, gemm_forward_bf16, Bf16Kernel, CpuBackend};
use strata::lm::LmConfig;
use strata::math::{ExpertKind, ExpertSaved};

use super::median;

/// Settings of one `strata bench kernels` run.
#[derive(Clone, Debug)]
pub struct KernelsBenchConfig {
    /// Presets whose expert shapes to time.
    pub presets: Vec<String>,
    /// Tokens a step: each expert gets its even share of the assignments
    /// (tokens × top-k / experts rows).
    pub tokens: usize,
    /// Timed repetitions of everything; one untimed warm-up first.
    pub steps: usize,
    /// How long the peak loop runs in each repetition.
    pub peak_time: Duration,
}

/// One line of output: a shape of a preset, or the peak itself.
#[derive(Clone, Debug, Serialize)]
pub struct KernelsBenchRecord {
    pub bench: &'static str,
    /// `fma_peak`, `bf16_peak`, `amx_peak`, `gemm` (the up projection, x · w1ᵀ) or
    /// `ffn_forward` / `ffn_backward` (the expert as the engine computes
    /// it), the last three in f32 and with `_bf16` (bf16 params, bf16
    /// products).
    pub what: &'static str,
    /// The bf16 GEMM's kernel (`amx-bf16`, `avx512-bf16` or `portable`),
    /// on bf16 lines.
    pub kernel: Option<&'static str>,
    pub preset: Option<String>,
    /// Rows (the expert's tokens), model width, hidden width.
    pub rows: usize,
    pub d_model: usize,
    pub d_ff: usize,
    /// The threads the cpu backend's compute splits over.
    pub threads: usize,
    pub steps: usize,
    pub median_s: f64,
    /// Multiply-adds × 2 a second, the median repetition's.
    pub gflop_per_s: f64,
    /// Of the peak of its type measured in the same run (f32; bf16: its
    /// kernel's, `vdpbf16ps` or the tiles'), the peak's highest repetition
    /// (`None` where there is none).
    pub share_of_peak: Option<f64>,
}

/// What a shape times.
#[derive(Clone, Copy, PartialEq)]
enum Timed {
    Gemm,
    FfnForward,
    FfnBackward,
}

impl Timed {
    fn name(self, bf16: bool) -> &'static str {
        match (self, bf16) {
            (Timed::Gemm, false) => "gemm",
            (Timed::FfnForward, false) => "ffn_forward",
            (Timed::FfnBackward, false) => "ffn_backward",
            (Timed::Gemm, true) => "gemm_bf16",
            (Timed::FfnForward, true) => "ffn_forward_bf16",
            (Timed::FfnBackward, true) => "ffn_backward_bf16",
        }
    }
}

/// A shape timed each repetition.
struct Shape {
    what: Timed,
    /// bf16 params and products (else f32).
    bf16: bool,
    preset: String,
    rows: usize,
    d: usize,
    f: usize,
}

impl Shape {
    fn flops(&self) -> f64 {
        let gemm = 2.0 * (self.rows * self.d * self.f) as f64;
        match self.what {
            Timed::Gemm => gemm,
            Timed::FfnForward => 3.0 * gemm,
            // dW and dx for each of three GEMMs.
            Timed::FfnBackward => 6.0 * gemm,
        }
    }
}

/// Runs the bench; `progress` hears a line a repetition.
pub fn run(
    config: &KernelsBenchConfig,
    progress: impl FnMut(String),
) -> Result<Vec<KernelsBenchRecord>, String> {
    if config.tokens == 0 {
        return Err("--tokens must be at least 1".into());
    }
    let shapes = shapes_of(config)?;
    let measured = measure(config, &shapes, progress);
    Ok(records(config, &shapes, measured))
}

/// Every shape the bench times: each preset's expert GEMM, FFN forward and
/// FFN backward, in f32 and in bf16.
fn shapes_of(config: &KernelsBenchConfig) -> Result<Vec<Shape>, String> {
    let mut shapes = Vec::new();
    for name in &config.presets {
        // The language model's experts are SwiGLU.
        let m = LmConfig::preset(name).map_err(|e| e.to_string())?;
        let rows = (config.tokens * m.top_k).div_ceil(m.experts).max(1);
        for (bf16, what) in [false, true]
            .into_iter()
            .flat_map(|b| [Timed::Gemm, Timed::FfnForward, Timed::FfnBackward].map(|w| (b, w)))
        {
            shapes.push(Shape {
                what,
                bf16,
                preset: name.clone(),
                rows,
                d: m.d_model,
                f: m.d_ff,
            });
        }
    }
    Ok(shapes)
}

/// What the repetitions measured: the peaks (FLOP/s; `None` where the
/// CPU lacks the instruction) and each shape's times.
struct Measured {
    peak: Option<f64>,
    bf16_peak: Option<f64>,
    amx_peak: Option<f64>,
    times: Vec<Vec<Duration>>,
}

/// One warm-up and `config.steps` repetitions, each timing the peaks and
/// then every shape, so that a tenant's load touches both alike.
fn measure(
    config: &KernelsBenchConfig,
    shapes: &[Shape],
    mut progress: impl FnMut(String),
) -> Measured {
    let threads = strata::compute_threads();
    let (mut peak, mut bf16_peak, mut amx_peak) = (Vec::new(), Vec::new(), Vec::new());
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); shapes.len()];
    for step in 0..=config.steps {
        let flops = fma_peak(threads, config.peak_time);
        let bf16_flops = bf16_dot_peak(threads, config.peak_time);
        let amx_flops = amx_tile_peak(threads, config.peak_time);
        for (shape, t) in shapes.iter().zip(&mut times) {
            let took = time_shape(shape);
            if step > 0 {
                t.push(took);
            }
        }
        if step > 0 {
            peak.extend(flops);
            bf16_peak.extend(bf16_flops);
            amx_peak.extend(amx_flops);
            progress(format!("repetition {step} of {}", config.steps));
        }
    }
    // Every repetition's peak is a lower bound of the machine's (another
    // tenant's work only lowers it): the highest is kept.
    Measured {
        peak: peak.into_iter().reduce(f64::max),
        bf16_peak: bf16_peak.into_iter().reduce(f64::max),
        amx_peak: amx_peak.into_iter().reduce(f64::max),
        times,
    }
}

/// The bench's records: the peaks, then each shape's median time and its
/// share of the peak its products run at.
fn records(
    config: &KernelsBenchConfig,
    shapes: &[Shape],
    measured: Measured,
) -> Vec<KernelsBenchRecord> {
    let Measured {
        peak,
        bf16_peak,
        amx_peak,
        times,
    } = measured;
    let threads = strata::compute_threads();
    let kernel = Bf16Kernel::in_use();
    let kernel_peak = match kernel {
        Bf16Kernel::Amx => amx_peak,
        Bf16Kernel::Avx512 => bf16_peak,
        // Their products are f32 FMAs.
        Bf16Kernel::Avx512Fma | Bf16Kernel::Avx2Fma => peak,
        Bf16Kernel::Portable => None,
    };
    let record = |what: &'static str, peak: Option<f64>, preset, (rows, d, f), median_s, gflop| {
        // A shape timed with bf16 products (not a peak).
        let bf16 = what.ends_with("_bf16");
        KernelsBenchRecord {
            bench: "kernels",
            what,
            kernel: bf16.then_some(kernel.name()),
            preset,
            rows,
            d_model: d,
            d_ff: f,
            threads,
            steps: config.steps,
            median_s,
            gflop_per_s: gflop,
            share_of_peak: peak.map(|p| gflop * 1e9 / p),
        }
    };
    let secs = config.peak_time.as_secs_f64();
    let peak_record = |what, peak: Option<f64>| {
        record(what, peak, None, (0, 0, 0), secs, peak.unwrap_or(0.0) / 1e9)
    };
    let mut records = vec![
        peak_record("fma_peak", peak),
        peak_record("bf16_peak", bf16_peak),
    ];
    if amx_peak.is_some() {
        records.push(peak_record("amx_peak", amx_peak));
    }
    for (shape, t) in shapes.iter().zip(times) {
        let s = median(t.iter().map(Duration::as_secs_f64).collect());
        let gflop = shape.flops() / s / 1e9;
        let dims = (shape.rows, shape.d, shape.f);
        let what = shape.what.name(shape.bf16);
        let peak = if shape.bf16 { kernel_peak } else { peak };
        records.push(record(
            what,
            peak,
            Some(shape.preset.clone()),
            dims,
            s,
            gflop,
        ));
    }
    records
}

/// The time of one call of `shape`: calls repeated for at least
/// [`SHAPE_MIN_TIME`], on operands made once.
fn time_shape(shape: &Shape) -> Duration {
    let mut call = shape_call(shape);
    let (mut calls, mut spent) = (0u32, Duration::ZERO);
    while calls == 0 || spent < SHAPE_MIN_TIME {
        spent += call();
        calls += 1;
    }
    spent / calls
}

/// How long each repetition calls a shape, at least.
const SHAPE_MIN_TIME: Duration = Duration::from_millis(20);

/// A closure that runs `shape` once and says how long it took.
fn shape_call(shape: &Shape) -> Box<dyn FnMut() -> Duration> {
    let (n, d, f) = (shape.rows, shape.d, shape.f);
    let fill = |len: usize, seed: u32| -> Vec<f32> {
        (0..len)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001)
            .map(|v| v as f32 / 20_000.0 - 0.05)
            .collect()
    };
    let x = fill(n * d, 1);
    let kind = ExpertKind::SwiGlu;
    // bf16 params hold the f32 ones rounded (both are timed on the same
    // values).
    let bits = |v: &[f32]| -> Vec<u16> {
        v.iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect()
    };
    if shape.what == Timed::Gemm {
        let w = fill(f * d, 2);
        let w16 = bits(&w);
        let mut out = vec![0.0f32; n * f];
        let bf16 = shape.bf16;
        return Box::new(move || {
            let t0 = Instant::now();
            if bf16 {
                gemm_forward_bf16(&mut out, &x, &w16, n, d, f);
            } else {
                gemm_forward(&mut out, &x, &w, n, d, f);
            }
            std::hint::black_box(&out);
            t0.elapsed()
        });
    }
    let backward = shape.what == Timed::FfnBackward;
    let params = fill(kind.params(d, f), 3);
    let params16 = shape.bf16.then(|| bits(&params));
    let (mut out, mut saved) = (vec![0.0f32; n * d], ExpertSaved::default());
    let (mut dx, mut dparams) = (vec![0.0f32; n * d], vec![0.0f32; params.len()]);
    Box::new(move || {
        let cpu = CpuBackend;
        let t0 = Instant::now();
        match &params16 {
            Some(p) => cpu.expert_ffn_forward_bf16(kind, &mut out, &mut saved, &x, p, n, d, f),
            None => cpu
                .expert_ffn_forward(kind, &mut out, &mut saved, &x, &params, n, d, f)
                .expect("the cpu's FFN on matching shapes"),
        }
        if !backward {
            std::hint::black_box(&out);
            return t0.elapsed();
        }
        let (dx, dp) = (&mut dx, &mut dparams);
        let t1 = Instant::now();
        match &params16 {
            Some(p) => cpu.expert_ffn_backward_bf16(kind, dx, dp, &out, &saved, &x, p, n, d, f),
            None => cpu
                .expert_ffn_backward(kind, dx, dp, &out, &saved, &x, &params, n, d, f)
                .expect("the cpu's FFN on matching shapes"),
        }
        std::hint::black_box((&dx, &dparams));
        t1.elapsed()
    })
}

/// f32 flops a second of fused multiply-adds on `threads` threads for
/// about `time`, on the widest registers the CPU has (AVX-512's 16 lanes,
/// else AVX2's 8); `None` without AVX2 and FMA.
fn fma_peak(threads: usize, time: Duration) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX512F was detected.
            let block = || std::hint::black_box(unsafe { fma_block_avx512(FMA_BLOCK) });
            return Some(peak_flops(threads, time, block, 2.0 * FMA_FLOPS_PER_ITER));
        }
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return None;
        }
        // SAFETY: AVX2 and FMA were detected above.
        let block = || std::hint::black_box(unsafe { fma_block(FMA_BLOCK) });
        Some(peak_flops(threads, time, block, FMA_FLOPS_PER_ITER))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (threads, time);
        None
    }
}

/// bf16 flops a second (a pair's two multiply-adds each count two) of
/// `vdpbf16ps` on `threads` threads for about `time`; `None` without
/// AVX512-BF16.
fn bf16_dot_peak(threads: usize, time: Duration) -> Option<f64> {
    if !Bf16Kernel::Avx512.supported() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the detected kernel is AVX-512's, so the CPU has AVX512F
        // and AVX512-BF16.
        let block = || std::hint::black_box(unsafe { bf16_dot_block(FMA_BLOCK) });
        Some(peak_flops(threads, time, block, BF16_FLOPS_PER_ITER))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (threads, time);
        None
    }
}

/// bf16 flops a second of AMX tile products on `threads` threads for
/// about `time`; `None` without AMX-BF16 (or the tile data's grant).
fn amx_tile_peak(threads: usize, time: Duration) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        use strata::backend::{amx_dot_loop, AMX_DOT_LOOP_FLOPS};
        amx_dot_loop(1)?;
        let block = || amx_dot_loop(FMA_BLOCK).expect("AMX, available above");
        Some(peak_flops(threads, time, block, AMX_DOT_LOOP_FLOPS))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (threads, time);
        None
    }
}

/// Flops a second of `block` (`FMA_BLOCK` iterations of
/// `flops_per_iter` each) called over and over on `threads` threads for
/// about `time`.
#[cfg(target_arch = "x86_64")]
fn peak_flops(
    threads: usize,
    time: Duration,
    block: impl Fn() -> f32 + Copy + Send,
    flops_per_iter: f64,
) -> f64 {
    let t0 = Instant::now();
    let blocks: u64 = std::thread::scope(|scope| {
        let runs: Vec<_> = (0..threads.max(1))
            .map(|_| {
                scope.spawn(move || {
                    let mut blocks = 0u64;
                    while t0.elapsed() < time {
                        block();
                        blocks += 1;
                    }
                    blocks
                })
            })
            .collect();
        runs.into_iter()
            .map(|r| r.join().expect("a peak thread"))
            .sum()
    });
    let flops = blocks as f64 * FMA_BLOCK as f64 * flops_per_iter;
    flops / t0.elapsed().as_secs_f64()
}

/// Flops an iteration: 12 chains × 16 lanes × 2 pairs × a multiply and an
/// add.
#[cfg(target_arch = "x86_64")]
const BF16_FLOPS_PER_ITER: f64 = 12.0 * 16.0 * 2.0 * 2.0;

/// `iters` rounds of 12 independent 16-lane `vdpbf16ps` chains.
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn bf16_dot_block(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    // Pairs of (0.996, 1e-7) as bf16: the sums stay finite.
    let pair = _mm512_set1_epi32(0x33d6_3f7f);
    // SAFETY: 64 bytes of plain data read as 32 bf16 values.
    let a = unsafe { std::mem::transmute::<__m512i, __m512bh>(pair) };
    let b = a;
    let one = _mm512_set1_ps(1.0);
    let mut c = [one; 12];
    for _ in 0..iters {
        // Twelve independent chains, unrolled by the compiler.
        for ci in c.iter_mut() {
            *ci = _mm512_dpbf16_ps(*ci, a, b);
        }
    }
    let sum = c[1..].iter().fold(c[0], |s, &x| _mm512_add_ps(s, x));
    _mm512_reduce_add_ps(sum)
}

/// [`fma_block`] on 16-lane registers (where a core has two 512-bit FMA
/// units, twice the 8-lane loop's flops; where it splits them, the same).
///
/// # Safety
/// The CPU has AVX512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_block_avx512(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    let mut c = [_mm512_set1_ps(1.0); 12];
    for _ in 0..iters {
        // Twelve independent chains, unrolled by the compiler.
        for ci in c.iter_mut() {
            *ci = _mm512_fmadd_ps(*ci, a, b);
        }
    }
    let sum = c[1..].iter().fold(c[0], |s, &x| _mm512_add_ps(s, x));
    _mm512_reduce_add_ps(sum)
}

/// Iterations of [`fma_block`]'s loop a call.
#[cfg(target_arch = "x86_64")]
const FMA_BLOCK: u64 = 1 << 16;

/// Flops an iteration: 12 chains × 8 lanes × a multiply and an add.
#[cfg(target_arch = "x86_64")]
const FMA_FLOPS_PER_ITER: f64 = 12.0 * 8.0 * 2.0;

/// `iters` rounds of 12 independent 8-lane fused multiply-add chains,
/// enough to cover the FMA units' latency on current x86 cores.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_block(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    let one = _mm256_set1_ps(1.0);
    // Twelve named chains, so that each stays in a register.
    let (mut c0, mut c1, mut c2, mut c3) = (one, one, one, one);
    let (mut c4, mut c5, mut c6, mut c7) = (one, one, one, one);
    let (mut c8, mut c9, mut c10, mut c11) = (one, one, one, one);
    for _ in 0..iters {
        c0 = _mm256_fmadd_ps(c0, a, b);
        c1 = _mm256_fmadd_ps(c1, a, b);
        c2 = _mm256_fmadd_ps(c2, a, b);
        c3 = _mm256_fmadd_ps(c3, a, b);
        c4 = _mm256_fmadd_ps(c4, a, b);
        c5 = _mm256_fmadd_ps(c5, a, b);
        c6 = _mm256_fmadd_ps(c6, a, b);
        c7 = _mm256_fmadd_ps(c7, a, b);
        c8 = _mm256_fmadd_ps(c8, a, b);
        c9 = _mm256_fmadd_ps(c9, a, b);
        c10 = _mm256_fmadd_ps(c10, a, b);
        c11 = _mm256_fmadd_ps(c11, a, b);
    }
    let sum = [c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11]
        .iter()
        .fold(c0, |s, &x| _mm256_add_ps(s, x));
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds the 8 f32 an unaligned store writes.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
    lanes.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A short run gives the peak and every shape of each preset, each
    /// timed and in flops a second; where there is a peak, no shape
    /// beats it by much (a wrong flop count would).
    #[test]
    fn kernels_bench_times_every_shape_against_the_peak() {
        let config = KernelsBenchConfig {
            presets: vec!["tiny".into()],
            tokens: 64,
            steps: 1,
            peak_time: Duration::from_millis(20),
        };
        let records = run(&config, |_| {}).unwrap();
        let whats: Vec<_> = records.iter().map(|r| r.what).collect();
        let amx = strata::backend::Bf16Kernel::Amx.supported();
        let peaks = if amx { 3 } else { 2 };
        let expected = [
            "fma_peak",
            "bf16_peak",
            "amx_peak",
            "gemm",
            "ffn_forward",
            "ffn_backward",
            "gemm_bf16",
            "ffn_forward_bf16",
            "ffn_backward_bf16",
        ];
        let expected: Vec<_> = expected
            .into_iter()
            .filter(|&w| amx || w != "amx_peak")
            .collect();
        assert_eq!(whats, expected);
        let m = LmConfig::preset("tiny").unwrap();
        for r in &records[peaks..] {
            assert_eq!(r.rows, (64 * m.top_k).div_ceil(m.experts));
            assert!(r.median_s > 0.0 && r.gflop_per_s > 0.0, "{r:?}");
            if let Some(share) = r.share_of_peak {
                assert!(share < 1.5, "{r:?}");
            }
            let bf16 = r.what.ends_with("_bf16");
            assert_eq!(r.kernel.is_some(), bf16, "{r:?}");
        }
        let bad = KernelsBenchConfig {
            presets: vec!["no-such".into()],
            ..config
        };
        assert!(run(&bad, |_| {}).is_err());
    }
}
