//! `strata bench attention`: the cpu's causal attention as the engine runs
//! it past `KEPT_PROBABILITIES_MAX_BYTES` of probabilities
//! (`math::attention_rows`: each query row's softmax max and sum kept, the
//! probabilities recomputed in the backward), or as it runs below that
//! bound (`--kept probabilities`: every probability kept, no recompute),
//! against the plain one that keeps every probability (`math::attention`,
//! its oracle), at one shape. Per variant: the forward's and the
//! backward's time (medians over repetitions that alternate the variants)
//! and the bytes each keeps for its backward; run alone (`--variant`),
//! also the process's peak resident memory, which then holds that
//! variant's alone.

use std::time::{Duration, Instant};

use serde::Serialize;
use strata::math::attention::{attention_backward, attention_forward, AttnShape};
use strata::math::attention_rows::{attention_rows_backward_on, attention_rows_forward_on, Kept};
use strata::math::vector_isa::VectorIsa;

use super::Timing;

/// Settings of one `strata bench attention` run.
#[derive(Clone, Debug)]
pub struct AttentionBenchConfig {
    pub shape: AttnShape,
    /// Threads the engine's attention splits its sequences over (the
    /// plain one runs on one, as its oracle does).
    pub threads: usize,
    /// Timed repetitions of each variant; one untimed warm-up first.
    pub steps: usize,
    /// What the engine's attention keeps for its backward.
    pub kept: Kept,
    /// Only this variant; `None`: the plain one and the engine's in every
    /// vector instruction set this CPU has, alternated.
    pub only: Option<Variant>,
}

/// One line of output.
#[derive(Clone, Debug, Serialize)]
pub struct AttentionBenchRecord {
    pub bench: &'static str,
    pub variant: String,
    pub seqs: usize,
    pub seq_len: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub threads: usize,
    pub steps: usize,
    pub forward_median_s: f64,
    pub backward_median_s: f64,
    /// What the forward keeps for the backward: `probabilities` or
    /// `row_stats` (the plain one: always `probabilities`).
    pub kept: &'static str,
    /// What the forward keeps for the backward, in bytes.
    pub saved_bytes: u64,
    /// The process's peak resident memory at the end, where this variant
    /// ran alone (`None` beside the other, or where the OS does not say).
    pub peak_rss_bytes: Option<u64>,
}

/// Which attention a run measures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Variant {
    /// Every probability kept (B, H, S, S), on one thread.
    Plain,
    /// Each row's max and sum kept (B, H, S, 2): the engine's, its loops
    /// compiled for these vectors (the same bits in each).
    Rows(VectorIsa),
}

impl Variant {
    pub fn name(self) -> String {
        match self {
            Variant::Plain => "plain".into(),
            Variant::Rows(isa) => format!("rows-{}", isa.name()),
        }
    }

    /// `plain`, `rows` (the engine's, in the vectors this CPU has) or
    /// `rows-ISA` (`baseline`, `avx2` or `avx512`).
    pub fn from_name(name: &str) -> Result<Self, String> {
        let isas = [VectorIsa::Baseline, VectorIsa::Avx2, VectorIsa::Avx512];
        match name {
            "plain" => Ok(Variant::Plain),
            "rows" => Ok(Variant::Rows(VectorIsa::detected())),
            other => isas
                .into_iter()
                .find(|isa| other.strip_prefix("rows-") == Some(isa.name()))
                .map(Variant::Rows)
                .ok_or_else(|| {
                    format!(
                        "unknown variant `{other}`; one of: plain, rows, rows-baseline, \
                         rows-avx2, rows-avx512"
                    )
                }),
        }
    }

    /// The default comparison: the plain one, then the engine's in every
    /// vector instruction set this CPU runs, widest first.
    fn all_here() -> Vec<Self> {
        let rows = VectorIsa::supported_here()
            .into_iter()
            .rev()
            .map(Variant::Rows);
        std::iter::once(Variant::Plain).chain(rows).collect()
    }
}

struct Samples {
    forward: Vec<Duration>,
    backward: Vec<Duration>,
}

/// Runs the bench; `progress` hears a line a repetition.
pub fn run(
    config: &AttentionBenchConfig,
    mut progress: impl FnMut(String),
) -> Result<Vec<AttentionBenchRecord>, String> {
    let shape = &config.shape;
    if shape.seqs == 0 || shape.seq_len == 0 || shape.head_dim == 0 {
        return Err("the attention shape is empty".into());
    }
    if shape.kv_heads == 0 || !shape.heads.is_multiple_of(shape.kv_heads) {
        return Err(format!(
            "--heads {} must be a multiple of --kv-heads {}",
            shape.heads, shape.kv_heads
        ));
    }
    let t = shape.tokens();
    let fill = |n: usize, seed: u32| -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    };
    let (q, k, v) = (
        fill(t * shape.q_width(), 1),
        fill(t * shape.kv_width(), 2),
        fill(t * shape.kv_width(), 3),
    );
    let dout = fill(t * shape.q_width(), 4);
    let inputs = Inputs {
        q: &q,
        k: &k,
        v: &v,
        dout: &dout,
    };
    if let Some(Variant::Rows(isa)) = config.only {
        if !isa.supported() {
            return Err(format!("this CPU does not run {}", isa.name()));
        }
    }
    let variants: Vec<Variant> = match config.only {
        Some(v) => vec![v],
        None => Variant::all_here(),
    };
    let mut samples: Vec<Samples> = variants.iter().map(|_| Samples::new()).collect();
    for step in 0..=config.steps {
        let mut line = format!("repetition {step}/{}:", config.steps);
        for (&variant, samples) in variants.iter().zip(&mut samples) {
            let (f, b) = once(variant, &inputs, config);
            line += &format!(
                " {} {:.1} + {:.1} ms",
                variant.name(),
                f.as_secs_f64() * 1e3,
                b.as_secs_f64() * 1e3
            );
            if step > 0 {
                samples.forward.push(f);
                samples.backward.push(b);
            }
        }
        if step > 0 {
            progress(line);
        }
    }
    let peak = config.only.and_then(|_| crate::sys::peak_resident_bytes());
    Ok(variants
        .iter()
        .zip(&samples)
        .map(|(&v, s)| record(v, s, config, peak))
        .collect())
}

struct Inputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    dout: &'a [f32],
}

impl Samples {
    fn new() -> Self {
        Self {
            forward: Vec::new(),
            backward: Vec::new(),
        }
    }
}

fn saved_len(variant: Variant, kept: Kept, shape: &AttnShape) -> usize {
    match variant {
        Variant::Plain => shape.probs_len(),
        Variant::Rows(_) => kept.len(shape),
    }
}

/// One forward and backward of `variant`: their times.
fn once(variant: Variant, x: &Inputs<'_>, config: &AttentionBenchConfig) -> (Duration, Duration) {
    let shape = &config.shape;
    let t = shape.tokens();
    let mut out = vec![0.0f32; t * shape.q_width()];
    let (mut dq, mut dk, mut dv) = (
        vec![0.0f32; t * shape.q_width()],
        vec![0.0f32; t * shape.kv_width()],
        vec![0.0f32; t * shape.kv_width()],
    );
    let (kept, threads) = (config.kept, config.threads);
    let mut saved = vec![0.0f32; saved_len(variant, kept, shape)];
    let qkv = (x.q, x.k, x.v);
    let start = Instant::now();
    match variant {
        Variant::Plain => attention_forward(&mut out, &mut saved, x.q, x.k, x.v, None, shape),
        Variant::Rows(isa) => {
            attention_rows_forward_on(isa, &mut out, &mut saved, kept, qkv, None, shape, threads)
        }
    }
    let forward = start.elapsed();
    let start = Instant::now();
    match variant {
        Variant::Plain => attention_backward(
            &mut dq, &mut dk, &mut dv, x.dout, &saved, x.q, x.k, x.v, shape,
        ),
        Variant::Rows(isa) => attention_rows_backward_on(
            isa,
            [&mut dq, &mut dk, &mut dv],
            x.dout,
            &saved,
            kept,
            qkv,
            None,
            shape,
            threads,
        ),
    }
    let backward = start.elapsed();
    std::hint::black_box((&out, &dq, &dk, &dv));
    (forward, backward)
}

fn record(
    variant: Variant,
    samples: &Samples,
    config: &AttentionBenchConfig,
    peak_rss_bytes: Option<u64>,
) -> AttentionBenchRecord {
    let shape = &config.shape;
    AttentionBenchRecord {
        bench: "attention",
        variant: variant.name(),
        seqs: shape.seqs,
        seq_len: shape.seq_len,
        heads: shape.heads,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        threads: match variant {
            Variant::Plain => 1,
            Variant::Rows(_) => config.threads,
        },
        steps: config.steps,
        forward_median_s: Timing::of(&samples.forward).median_s,
        backward_median_s: Timing::of(&samples.backward).median_s,
        kept: match (variant, config.kept) {
            (Variant::Rows(_), Kept::RowStats) => "row_stats",
            _ => "probabilities",
        },
        saved_bytes: 4 * saved_len(variant, config.kept, shape) as u64,
        peak_rss_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rows_variant_keeps_two_values_a_row_and_the_plain_one_every_probability() {
        let config = AttentionBenchConfig {
            shape: AttnShape {
                seqs: 1,
                seq_len: 64,
                heads: 2,
                kv_heads: 1,
                head_dim: 8,
            },
            threads: 1,
            steps: 1,
            kept: Kept::RowStats,
            only: None,
        };
        let records = run(&config, |_| {}).unwrap();
        let here = VectorIsa::supported_here();
        assert_eq!(records.len(), 1 + here.len(), "plain and each vector set");
        assert_eq!(records[0].saved_bytes, 4 * 2 * 64 * 64);
        assert!(records[1..].iter().all(|r| r.saved_bytes == 4 * 2 * 2 * 64));
        let names: Vec<_> = records.iter().map(|r| r.variant.clone()).collect();
        assert_eq!(names[0], "plain");
        assert_eq!(names[1], format!("rows-{}", VectorIsa::detected().name()));
        assert_eq!(names.last().unwrap(), "rows-baseline");
        assert!(records.iter().all(|r| r.forward_median_s > 0.0));
        assert!(records.iter().all(|r| r.peak_rss_bytes.is_none()));
        let alone = AttentionBenchConfig {
            only: Some(Variant::from_name("rows-baseline").unwrap()),
            ..config.clone()
        };
        let records = run(&alone, |_| {}).unwrap();
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].variant, "rows-baseline");
        assert!(Variant::from_name("rows-sse9")
            .unwrap_err()
            .contains("rows-avx512"));
        let bad = AttentionBenchConfig {
            shape: AttnShape {
                kv_heads: 3,
                ..config.shape
            },
            ..config
        };
        assert!(run(&bad, |_| {}).unwrap_err().contains("--kv-heads 3"));
    }
}
