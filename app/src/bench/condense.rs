//! `strata bench condense`: token condensation (LUFFY) on hidden states
//! from training the language model on real text. It trains a preset on
//! the built-in corpus for some steps (exactly), then runs one more batch
//! forward and keeps each MoE layer's expert inputs and routing. On those:
//! - per layer, threshold and search, the share of the rows each device
//!   sends to an expert that condensation folds into another, the search's
//!   time, and for the signature search the rows the exact one condensed
//!   that it did not;
//! - per threshold, over every layer, the expert rows that cross between
//!   devices a step (dispatch and combine, forward and backward) with the
//!   experts placed round-robin, the expert FLOPs, and the step's time
//!   over a modeled link: the measured training step, less the expert
//!   compute that condensation saves, plus the rows' bytes at the link's
//!   rate.

use std::time::Instant;

use serde::Serialize;
use strata::condense::{
    condense_rows, inverse_norms, Search, SignatureTables, Threshold, ADAPTIVE_START,
};
use strata::math::Permutation;
use strata::model::Network;

use super::captured::{train_and_capture, CaptureSpec, Captured, Trained};

/// What to train and how to cut the captured batch.
#[derive(Clone, Debug)]
pub struct CondenseBench {
    pub capture: CaptureSpec,
    /// Device counts the batch's sequences are split over.
    pub devices: Vec<usize>,
    pub link_gb_per_s: f64,
    /// Timed repetitions of each search (median).
    pub reps: usize,
}

#[derive(Serialize, Debug, Clone)]
pub struct ShareRow {
    pub bench: &'static str,
    pub preset: String,
    pub train_steps: u64,
    pub devices: usize,
    pub layer: usize,
    /// `0.9`, …, or `adaptive` (with the value it had after the training).
    pub threshold: String,
    pub threshold_value: f32,
    pub search: &'static str,
    /// Rows the devices send to experts in this layer.
    pub rows: usize,
    pub condensed: usize,
    pub share: f64,
    /// Signature search: rows the exact search condensed that it did not.
    pub missed_vs_exact: Option<usize>,
    /// Median time of the search over the layer's rows, all devices.
    pub search_s: f64,
}

#[derive(Serialize, Debug, Clone)]
pub struct LinkRow {
    pub bench: &'static str,
    pub preset: String,
    pub devices: usize,
    /// `off`, `0.9`, …, `adaptive`.
    pub threshold: String,
    /// Rows that cross between devices a step (every layer; dispatch and
    /// combine, forward and backward), and their bytes (f32 rows).
    pub rows_crossing: u64,
    pub bytes_crossing: u64,
    /// Expert FLOPs a step (forward and backward: 3 × 2 × rows × the
    /// expert's multiply-adds a row).
    pub expert_flops: f64,
    /// The measured step (one device, this machine) less the expert
    /// compute condensation saves, plus the crossing bytes at the link's
    /// rate.
    pub modeled_step_s: f64,
    pub link_gb_per_s: f64,
}

/// Device `i` of `n`'s rows of expert `e`: the assignments of its
/// sequences' tokens.
fn device_rows(
    perm: &Permutation,
    e: usize,
    k: usize,
    tokens: usize,
    i: usize,
    n: usize,
) -> Vec<u32> {
    let (lo, hi) = (i * tokens / n, (i + 1) * tokens / n);
    perm.rows(e)
        .iter()
        .copied()
        .filter(|&a| (lo..hi).contains(&(a as usize / k)))
        .collect()
}

/// `[device][expert]`: the rows a device sends to an expert, and how many
/// of them condense.
type LayerCounts = Vec<Vec<(usize, usize)>>;

/// One layer's [`LayerCounts`], searched as `signatures` says at
/// `threshold`.
fn condense_layer(
    c: &Captured,
    k: usize,
    d: usize,
    devices: usize,
    threshold: f32,
    signatures: Option<&SignatureTables>,
) -> LayerCounts {
    let tokens = c.x.len() / d;
    let inv = inverse_norms(&c.x, tokens, d);
    let signed = signatures.map(|s| (s.sign(&c.x, tokens), s.tables));
    let sigs = signed.as_ref().map(|(s, t)| (&s[..], *t));
    let experts = c.perm.offsets.len() - 1;
    (0..devices)
        .map(|i| {
            (0..experts)
                .map(|e| {
                    let rows = device_rows(&c.perm, e, k, tokens, i, devices);
                    let toks: Vec<u32> = rows.iter().map(|&a| a / k as u32).collect();
                    let g = condense_rows(&toks, &c.x, d, &inv, sigs, threshold, 1.0);
                    (rows.len(), g.condensed)
                })
                .collect()
        })
        .collect()
}

/// The thresholds measured: fixed ones and the adaptive schedule's value
/// after the training.
fn thresholds(first: f32, last: f32) -> Vec<(String, f32)> {
    let adaptive = Threshold::Adaptive {
        start: ADAPTIVE_START,
    }
    .at(Some(first), Some(last));
    vec![
        ("0.9".into(), 0.9),
        ("0.75".into(), 0.75),
        ("0.5".into(), 0.5),
        ("adaptive".into(), adaptive),
    ]
}

/// Trains, captures, and measures (see the module).
pub fn run(cfg: &CondenseBench) -> Result<(Vec<ShareRow>, Vec<LinkRow>), String> {
    let t = train_and_capture(&cfg.capture)?;
    let moe = t.lm.moe().clone();
    let (k, d) = (moe.top_k, moe.d_model);
    let lsh = match Search::LSH {
        Search::Lsh { tables, bits } => SignatureTables::new(tables, bits, d),
        Search::AllPairs => unreachable!("the signature search"),
    };
    let mut shares = Vec::new();
    let mut links = Vec::new();
    for &n in &cfg.devices {
        let mut per_threshold: Vec<(String, Vec<LayerCounts>)> = Vec::new();
        for (name, h) in thresholds(t.first_loss, t.last_loss) {
            let mut exact_layers = Vec::new();
            for (l, c) in t.layers.iter().enumerate() {
                let mut exact = None;
                for search in [None, Some(&lsh)] {
                    let mut times = Vec::new();
                    let mut counts = Vec::new();
                    for _ in 0..cfg.reps.max(1) {
                        let t0 = Instant::now();
                        counts = condense_layer(c, k, d, n, h, search);
                        times.push(t0.elapsed().as_secs_f64());
                    }
                    let rows: usize = counts.iter().flatten().map(|r| r.0).sum();
                    let condensed: usize = counts.iter().flatten().map(|r| r.1).sum();
                    let missed = exact.map(|e: usize| e.saturating_sub(condensed));
                    shares.push(ShareRow {
                        bench: "condense",
                        preset: cfg.capture.preset.clone(),
                        train_steps: cfg.capture.train_steps,
                        devices: n,
                        layer: l,
                        threshold: name.clone(),
                        threshold_value: h,
                        search: if search.is_some() { "lsh" } else { "all-pairs" },
                        rows,
                        condensed,
                        share: condensed as f64 / rows.max(1) as f64,
                        missed_vs_exact: missed,
                        search_s: super::median(times),
                    });
                    if search.is_none() {
                        exact = Some(condensed);
                        exact_layers.push(counts);
                    }
                }
            }
            per_threshold.push((name, exact_layers));
        }
        links.extend(link_rows(cfg, &t, n, &per_threshold));
    }
    Ok((shares, links))
}

/// The link rows of `n` devices: off, then each threshold's exact search.
fn link_rows(
    cfg: &CondenseBench,
    t: &Trained,
    n: usize,
    per_threshold: &[(String, Vec<LayerCounts>)],
) -> Vec<LinkRow> {
    let moe = t.lm.moe();
    let (d, f) = (moe.d_model, moe.d_ff);
    let flops_a_row = 3.0 * 2.0 * 3.0 * (d * f) as f64; // three GEMMs, fwd + bwd
    let all_rows: u64 = t.layers.iter().map(|c| c.perm.order.len() as u64).sum();
    let row = |name: &str, sent: &dyn Fn(usize, usize, usize) -> u64| {
        let (mut crossing, mut computed) = (0u64, 0u64);
        for l in 0..t.layers.len() {
            for dev in 0..n {
                for e in 0..moe.experts {
                    let s = sent(l, dev, e);
                    computed += s;
                    if e % n != dev {
                        crossing += 4 * s; // dispatch, combine; forward, backward
                    }
                }
            }
        }
        let saved_expert_s = t.expert_s * (1.0 - computed as f64 / all_rows.max(1) as f64);
        let bytes = crossing * d as u64 * 4;
        LinkRow {
            bench: "condense-link",
            preset: cfg.capture.preset.clone(),
            devices: n,
            threshold: name.to_string(),
            rows_crossing: crossing,
            bytes_crossing: bytes,
            expert_flops: computed as f64 * flops_a_row,
            modeled_step_s: t.step_s - saved_expert_s + bytes as f64 / (cfg.link_gb_per_s * 1e9),
            link_gb_per_s: cfg.link_gb_per_s,
        }
    };
    let k = moe.top_k;
    let mut rows = vec![row("off", &|l, dev, e| {
        let c = &t.layers[l];
        device_rows(&c.perm, e, k, c.x.len() / moe.d_model, dev, n).len() as u64
    })];
    for (name, layers) in per_threshold {
        rows.push(row(name, &|l, dev, e| {
            let (sent, condensed) = layers[l][dev][e];
            (sent - condensed) as u64
        }));
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_run_measures_every_layer_threshold_and_search() {
        let cfg = CondenseBench {
            capture: CaptureSpec {
                preset: "tiny".into(),
                train_steps: 2,
                seq_len: 16,
                batch: 4,
            },
            devices: vec![1, 2],
            link_gb_per_s: 10.0,
            reps: 1,
        };
        let (shares, links) = run(&cfg).unwrap();
        let layers = strata::lm::LmConfig::preset("tiny").unwrap().layers;
        // devices × thresholds × layers × searches
        assert_eq!(shares.len(), 2 * 4 * layers * 2);
        for s in &shares {
            assert_eq!(s.rows, 16 * 4 * 2, "{s:?}");
            assert!(s.condensed <= s.rows);
            assert_eq!(s.missed_vs_exact.is_some(), s.search == "lsh");
        }
        // A lower threshold condenses at least as much (the exact search).
        let exact = |h: &str, l: usize| {
            shares
                .iter()
                .find(|s| {
                    s.devices == 1 && s.threshold == h && s.layer == l && s.search == "all-pairs"
                })
                .unwrap()
                .condensed
        };
        assert!(exact("0.5", 0) >= exact("0.9", 0));
        // off, then each threshold, for each device count.
        assert_eq!(links.len(), 2 * 5);
        let one = &links[0];
        assert_eq!(
            (one.devices, one.threshold.as_str(), one.rows_crossing),
            (1, "off", 0)
        );
        let two: Vec<&LinkRow> = links.iter().filter(|r| r.devices == 2).collect();
        assert!(two[0].rows_crossing > 0);
        assert!(two.iter().all(|r| r.rows_crossing <= two[0].rows_crossing));
        assert!(two.iter().all(|r| r.expert_flops <= two[0].expert_flops));
    }
}
