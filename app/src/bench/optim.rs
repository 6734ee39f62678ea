//! `strata bench optim`: the AdamW step through the [`ExpertOptimizer`]
//! pool, against the memory-bandwidth ceiling of its access pattern.
//!
//! Variants (each one expert of `params` params, split across the pool):
//! - `fp32`: f32 grad in, f32 master/m/v, no copy out — 28 B a param;
//! - `mixed`: bf16 grad in, f32 master/m/v, bf16 copy out — 28 B a param
//!   (2 + 12 read, 12 + 2 written): the per-expert update of the engine.
//!
//! The ceiling is a plain sweep over the same p, g, m, v arrays that reads
//! four f32 streams and writes three (`rmw4r3w` in `shared/bench/membw.c`),
//! run on the same number of threads. Each repetition times the ceiling and
//! every variant back to back, so their ratio is measured under the same
//! conditions on a noisy machine.

use std::time::{Duration, Instant};

use half::bf16;
use serde::Serialize;
use strata_optim::{
    CopyOut, ExpertId, ExpertOptimizer, GradRef, Kernel, OptimError, OptimizerConfig, UpdateTarget,
    UpdateViews,
};

use super::Timing;

/// Settings of one `strata bench optim` run.
#[derive(Clone, Debug)]
pub struct OptimBenchConfig {
    pub params: usize,
    pub threads: usize,
    /// Timed repetitions; two untimed warm-ups come first.
    pub steps: usize,
    pub kernel: Kernel,
}

/// One line of output.
#[derive(Clone, Debug, Serialize)]
pub struct OptimBenchRecord {
    pub bench: &'static str,
    pub variant: &'static str,
    pub kernel: &'static str,
    pub params: usize,
    pub threads: usize,
    pub steps: usize,
    pub median_s: f64,
    pub min_s: f64,
    pub params_per_s: f64,
    pub bytes_per_param: u32,
    pub gb_per_s: f64,
    pub ceiling_params_per_s: f64,
    /// params_per_s / ceiling_params_per_s.
    pub ceiling_ratio: f64,
}

/// The bench's one expert: every buffer both variants need.
struct BenchExpert {
    params: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    grad_f32: Vec<f32>,
    grad_bf16: Vec<bf16>,
    copy_bf16: Vec<bf16>,
    step: u64,
    mixed: bool,
}

impl UpdateTarget for BenchExpert {
    fn views(&mut self) -> UpdateViews<'_> {
        let (grad, copy) = if self.mixed {
            (
                GradRef::Bf16(&self.grad_bf16),
                CopyOut::Bf16(&mut self.copy_bf16),
            )
        } else {
            (GradRef::F32(&self.grad_f32), CopyOut::None)
        };
        UpdateViews {
            params: &mut self.params,
            m: &mut self.m,
            v: &mut self.v,
            grad,
            copy,
            step: &mut self.step,
        }
    }
}

impl BenchExpert {
    fn new(n: usize) -> Self {
        // Deterministic, varied, finite values; writing them also faults
        // every page in before anything is timed.
        let value = |i: usize| ((i.wrapping_mul(2654435761) % 20011) as f32 / 20011.0) - 0.5;
        Self {
            params: (0..n).map(value).collect(),
            m: vec![0.0; n],
            v: vec![0.0; n],
            grad_f32: (0..n).map(|i| value(i + 7) * 0.1).collect(),
            grad_bf16: (0..n).map(|i| bf16::from_f32(value(i + 7) * 0.1)).collect(),
            copy_bf16: vec![bf16::ZERO; n],
            step: 0,
            mixed: false,
        }
    }
}

/// Reads p, g, m, v and writes p, m, v once (28 B a param), split evenly
/// across `threads` scoped threads: the bandwidth ceiling of an AdamW step.
fn ceiling_sweep(e: &mut BenchExpert, threads: usize) {
    let chunk = e.params.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let parts = e
            .params
            .chunks_mut(chunk)
            .zip(e.m.chunks_mut(chunk))
            .zip(e.v.chunks_mut(chunk))
            .zip(e.grad_f32.chunks(chunk));
        for (((p, m), v), g) in parts {
            scope.spawn(move || strata_optim::memory_sweep(p, m, v, g));
        }
    });
}

fn timed(f: impl FnOnce()) -> Duration {
    let start = Instant::now();
    f();
    start.elapsed()
}

/// Runs the bench and returns one record per variant.
pub fn run(
    config: &OptimBenchConfig,
    mut progress: impl FnMut(&str),
) -> Result<Vec<OptimBenchRecord>, OptimError> {
    if config.params == 0 || config.threads == 0 || config.steps == 0 {
        return Err(OptimError::InvalidConfig(
            "--params, --threads and --steps must all be at least 1".to_string(),
        ));
    }
    let pool = ExpertOptimizer::<BenchExpert>::new(OptimizerConfig {
        threads: config.threads,
        kernel: config.kernel,
        in_flight_max: 4,
        ..OptimizerConfig::default()
    })?;
    progress(&format!(
        "allocating {:.2} GiB for {} params",
        (config.params * 24) as f64 / (1u64 << 30) as f64,
        config.params
    ));
    let mut expert = BenchExpert::new(config.params);
    let key = ExpertId::new(0, 0);
    let step_once = |expert: BenchExpert| -> Result<(BenchExpert, Duration), OptimError> {
        let start = Instant::now();
        pool.submit(key, expert)?;
        let (expert, _) = pool.wait(key)?;
        Ok((expert, start.elapsed()))
    };

    let warmups = 2;
    let mut ceiling = Vec::with_capacity(config.steps);
    let mut fp32 = Vec::with_capacity(config.steps);
    let mut mixed = Vec::with_capacity(config.steps);
    for rep in 0..warmups + config.steps {
        let t_ceiling = timed(|| ceiling_sweep(&mut expert, config.threads));
        expert.mixed = false;
        let (e, t_fp32) = step_once(expert)?;
        expert = e;
        expert.mixed = true;
        let (e, t_mixed) = step_once(expert)?;
        expert = e;
        if rep >= warmups {
            ceiling.push(t_ceiling);
            fp32.push(t_fp32);
            mixed.push(t_mixed);
            progress(&format!(
                "step {}/{}: ceiling {:.1} ms, fp32 {:.1} ms, mixed {:.1} ms",
                rep + 1 - warmups,
                config.steps,
                t_ceiling.as_secs_f64() * 1e3,
                t_fp32.as_secs_f64() * 1e3,
                t_mixed.as_secs_f64() * 1e3
            ));
        }
    }
    pool.shutdown()?;

    let ceiling = Timing::of(&ceiling);
    let ceiling_params_per_s = config.params as f64 / ceiling.median_s;
    let record = |variant: &'static str, timing: Timing| {
        let params_per_s = config.params as f64 / timing.median_s;
        OptimBenchRecord {
            bench: "optim",
            variant,
            kernel: config.kernel.name(),
            params: config.params,
            threads: config.threads,
            steps: config.steps,
            median_s: timing.median_s,
            min_s: timing.min_s,
            params_per_s,
            bytes_per_param: 28,
            gb_per_s: params_per_s * 28.0 / 1e9,
            ceiling_params_per_s,
            ceiling_ratio: params_per_s / ceiling_params_per_s,
        }
    };
    Ok(vec![
        record("ceiling_rmw4r3w", ceiling),
        record("fp32", Timing::of(&fp32)),
        record("mixed", Timing::of(&mixed)),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_run_reports_every_variant_with_sane_figures() {
        let config = OptimBenchConfig {
            params: 10_000,
            threads: 2,
            steps: 3,
            kernel: Kernel::detect(),
        };
        let records = run(&config, |_| {}).unwrap();
        let variants: Vec<_> = records.iter().map(|r| r.variant).collect();
        assert_eq!(variants, ["ceiling_rmw4r3w", "fp32", "mixed"]);
        for r in &records {
            assert!(r.median_s > 0.0 && r.min_s <= r.median_s, "{r:?}");
            assert!(r.params_per_s.is_finite() && r.params_per_s > 0.0);
            assert_eq!(r.ceiling_params_per_s, records[0].params_per_s);
        }
        assert_eq!(records[0].ceiling_ratio, 1.0);
    }

    #[test]
    fn zero_sizes_are_refused() {
        let config = OptimBenchConfig {
            params: 0,
            threads: 1,
            steps: 1,
            kernel: Kernel::Scalar,
        };
        assert!(run(&config, |_| {}).is_err());
    }
}
