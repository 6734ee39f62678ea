//! `strata bench migrate`: sequence migration (LUFFY §IV,
//! `strata::migration`) on the routing of the language model trained on
//! real text. It trains a preset on the built-in corpus (exactly, tracing
//! its routing), runs one more batch forward, and on that batch's routing
//! follows the sequences through the MoE layers: each starts on its home
//! device (the batch split in order), at each layer dispatches its tokens'
//! rows to the devices of their experts, and after the experts is rebuilt
//! where a planner says. Per device count, expert placement and planner,
//! summed over the layers (the forward; the backward sends the same rows
//! back the other way):
//! - the rows dispatched to other devices, the expert outputs pulled in
//!   the combine, and the residual rows a moved sequence takes with it
//!   (and in the backward, their gradient rows back);
//! - the sequences moved, and the attention's balance after each layer
//!   (the busiest device's cost over the mean, the worst layer's);
//! - the planners' time over every layer;
//! - the step over a modeled link: the measured training step (one
//!   device, this machine) plus every row's bytes (f32) at the link's
//!   rate.
//!
//! Beside the planners, each placement's `coherent` row counts ExFlow's
//! context-coherent exchange on the same routing (`bench::coherent`):
//! tokens rebuilt one by one, never returning home, with the keys and
//! values their attention then needs from other devices.
//!
//! Placements: round-robin; each layer by LPT on the batch's counts (the
//! engine's); and ExFlow's affinity placement from the training's trace
//! (`strata::placement::affinity`), so that migration and affinity are
//! measured together.

use std::time::Instant;

use serde::Serialize;
use strata::migration::{
    attention_loads, plan, Accounting, AttentionCost, MigrationConfig, SequenceRoutes,
};
use strata::model::Network;
use strata::placement::affinity::{place, AffinityProblem};
use strata::placement::{CostModel, LptPlacer};

use super::captured::{train_and_capture, CaptureSpec, Captured, Trained};
use super::coherent::{assignment_devices, follow_tokens, Rebuild};

/// What to train, the device counts, and the planners' cap.
#[derive(Clone, Debug)]
pub struct MigrateBench {
    pub capture: CaptureSpec,
    pub devices: Vec<usize>,
    /// How far a device's attention may go over the balanced share.
    pub slack: f64,
    /// Timed repetitions of each plan (median).
    pub reps: usize,
    /// The modeled link between devices, GB/s.
    pub link_gb_per_s: f64,
}

#[derive(Serialize, Debug, Clone)]
pub struct MigrateRow {
    pub bench: &'static str,
    pub preset: String,
    pub train_steps: u64,
    pub devices: usize,
    /// `round-robin`, `lpt` or `affinity`.
    pub placement: &'static str,
    /// `stay` (no migration), `luffy` (the paper's count of what a rebuild
    /// pulls: the expert outputs), `exact` (the residual rows as well, as
    /// the engine's layer moves them) or `dispatch-h` (a layer that
    /// dispatches the residual and normalizes it where the expert runs).
    /// `luffy`'s plan is costed as the engine's layer moves it. Or one
    /// of ExFlow's context-coherent exchange (`bench::coherent`), tokens
    /// rebuilt one by one: `coherent` choosing by the rows alone,
    /// `coherent-kv` weighing the keys and values a move sends as well.
    pub planner: &'static str,
    /// `q`, the candidate devices a sequence.
    pub candidates: usize,
    pub slack: f64,
    /// Rows (of d_model) a forward step sends between devices, every
    /// layer: the dispatch, the combine's expert outputs, and the residual
    /// rows of moved sequences. The backward sends as many dispatch and
    /// combine rows the other way.
    pub dispatch_rows: u64,
    pub combine_rows: u64,
    pub residual_rows: u64,
    /// The backward's gradient rows of moved sequences' residuals.
    pub residual_grad_rows: u64,
    /// Every row's bytes, forward and backward (K and V rows at their
    /// width), over `stay`'s.
    pub rows_vs_stay: f64,
    /// The combines' rows and the residual rows over `stay`'s combines.
    pub combine_vs_stay: f64,
    /// `coherent` alone: K and V rows (2 · kv_heads · head_dim values) a
    /// forward step sends to the devices holding later tokens of their
    /// sequence (`bench::coherent`); the backward sends their gradients
    /// back.
    pub kv_rows: u64,
    /// Sequences (for `coherent`, tokens) rebuilt away from where they
    /// were, summed over layers.
    pub moved: u64,
    /// The worst layer's busiest device's attention cost over the mean.
    pub attention_max_over_mean: f64,
    /// The plans of every layer, median of the repetitions.
    pub plan_s: f64,
    /// Every row's bytes, forward and backward, at the link's rate.
    pub link_s: f64,
    /// The measured step plus `link_s`.
    pub modeled_step_s: f64,
    pub link_gb_per_s: f64,
}

impl MigrateRow {
    /// A row of `planner` on `n` devices, its counts and times still zero
    /// (the placement and the link's figures are filled in by `run`).
    fn named(spec: &CaptureSpec, n: usize, planner: &'static str) -> Self {
        Self {
            bench: "migrate",
            preset: spec.preset.clone(),
            train_steps: spec.train_steps,
            devices: n,
            placement: "",
            planner,
            candidates: 0,
            slack: 0.0,
            dispatch_rows: 0,
            combine_rows: 0,
            residual_rows: 0,
            residual_grad_rows: 0,
            rows_vs_stay: 0.0,
            combine_vs_stay: 0.0,
            kv_rows: 0,
            moved: 0,
            attention_max_over_mean: 1.0,
            plan_s: 0.0,
            link_s: 0.0,
            modeled_step_s: 0.0,
            link_gb_per_s: 0.0,
        }
    }
}

/// `[layer][expert]`: the device computing each expert.
type Placement = Vec<Vec<u16>>;

fn placements(t: &Trained, n: usize) -> Result<Vec<(&'static str, Placement)>, String> {
    let moe = t.lm.moe();
    let experts = moe.experts;
    let round_robin = (0..moe.layers)
        .map(|_| (0..experts).map(|e| (e % n) as u16).collect())
        .collect();
    let mut lpt = LptPlacer::new(experts, n);
    let by_count = CostModel {
        upload_s: 0.0,
        per_token_s: 1.0,
        fixed_s: 0.0,
    };
    let lpt = t
        .layers
        .iter()
        .map(|c| {
            let counts: Vec<u32> = (0..experts).map(|e| c.perm.rows(e).len() as u32).collect();
            let mut owner = vec![0u16; experts];
            lpt.place(&counts, &vec![None; experts], &by_count, &mut owner);
            owner
        })
        .collect();
    let affinity = place(&AffinityProblem {
        layers: moe.layers,
        experts,
        devices: n,
        transitions: &t.trace.transitions,
        load_slack: 0.1,
    })
    .map_err(|e| format!("affinity placement on {n} devices: {e}"))?;
    Ok(vec![
        ("round-robin", round_robin),
        ("lpt", lpt),
        ("affinity", affinity),
    ])
}

/// Each sequence's rows on each device at one layer, from where it is.
fn routes(
    c: &Captured,
    owner: &[u16],
    at: &[u16],
    k: usize,
    seq_len: usize,
    n: usize,
) -> Vec<SequenceRoutes> {
    let mut seqs: Vec<SequenceRoutes> = at
        .iter()
        .map(|&at| SequenceRoutes {
            at,
            len: seq_len,
            rows_on: vec![0; n],
            tokens_on: vec![0; n],
        })
        .collect();
    // [token × device]: whether one of its experts is there.
    let mut has = vec![false; c.perm.order.len() / k * n];
    for (e, &dev) in owner.iter().enumerate() {
        let dev = dev as usize;
        for &a in c.perm.rows(e) {
            let token = a as usize / k;
            let s = &mut seqs[token / seq_len];
            s.rows_on[dev] += 1;
            if !std::mem::replace(&mut has[token * n + dev], true) {
                s.tokens_on[dev] += 1;
            }
        }
    }
    seqs
}

/// `cfg`'s plan for one layer, and the median of `reps` timings of it.
fn timed_plan(
    seqs: &[SequenceRoutes],
    n: usize,
    cost: AttentionCost,
    cfg: &MigrationConfig,
    reps: usize,
) -> (Vec<u16>, f64) {
    let mut times = Vec::new();
    let mut dest = Vec::new();
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        dest = plan(seqs, n, cost, cfg);
        times.push(t0.elapsed().as_secs_f64());
    }
    (dest, super::median(times))
}

/// The busiest device's load over the mean (1 where nothing is loaded).
fn busiest_over_mean(loads: &[f64]) -> f64 {
    let mean = loads.iter().sum::<f64>() / loads.len().max(1) as f64;
    let max = loads.iter().copied().fold(0.0, f64::max);
    if mean > 0.0 {
        max / mean
    } else {
        1.0
    }
}

/// Each captured sequence's home device: the batch split in order.
fn homes(t: &Trained, spec: &CaptureSpec, n: usize) -> Vec<u16> {
    let k = t.lm.moe().top_k;
    let batch = t
        .layers
        .first()
        .map_or(0, |c| c.perm.order.len() / k / spec.seq_len);
    (0..batch).map(|s| (s * n / batch) as u16).collect()
}

/// The context-coherent exchange over every layer (`bench::coherent`),
/// choosing by the rows alone or weighing the keys and values too, and
/// its bytes forward and backward.
fn follow_coherent(
    t: &Trained,
    spec: &CaptureSpec,
    n: usize,
    placement: &Placement,
    weigh_kv: bool,
) -> (MigrateRow, f64) {
    let config = t.lm.config();
    let k = config.top_k;
    let kv_width = 2 * config.kv_heads * config.head_dim;
    let rebuild = if weigh_kv {
        Rebuild::CoherentKv {
            kv_over_row: kv_width as f64 / config.d_model as f64,
        }
    } else {
        Rebuild::Coherent
    };
    let devices = assignment_devices(&t.layers, placement);
    let home = homes(t, spec, n);
    let c = follow_tokens(&devices, k, spec.seq_len, &home, n, rebuild);
    let rows = 2 * (c.dispatch + c.combine + c.residual);
    let values = rows as f64 * config.d_model as f64 + (2 * c.kv) as f64 * kv_width as f64;
    let row = MigrateRow {
        dispatch_rows: c.dispatch,
        combine_rows: c.combine,
        residual_rows: c.residual,
        residual_grad_rows: c.residual,
        kv_rows: c.kv,
        moved: c.moved,
        attention_max_over_mean: c.attention_max_over_mean,
        ..MigrateRow::named(spec, n, if weigh_kv { "coherent-kv" } else { "coherent" })
    };
    (row, values * 4.0)
}

/// What one planner does over every layer (`None`: no migration).
fn follow(
    t: &Trained,
    spec: &CaptureSpec,
    n: usize,
    placement: &Placement,
    planner: Option<&MigrationConfig>,
    reps: usize,
) -> (MigrateRow, f64) {
    let moe = t.lm.moe();
    let (k, len) = (moe.top_k, spec.seq_len);
    let cost = AttentionCost {
        d_model: moe.d_model,
    };
    let mut at = homes(t, spec, n);
    let (mut dispatch, mut combine, mut moved) = (0u64, 0u64, 0u64);
    let mut residual = [0u64; 2];
    // What the plan's moves cost: LUFFY's as the engine's layer moves them.
    let costed = match planner.map(|p| p.accounting) {
        Some(Accounting::ExpertOutputs) | None => Accounting::WithResidual,
        Some(other) => other,
    };
    let (mut worst, mut plan_s) = (1.0f64, 0.0f64);
    for (l, c) in t.layers.iter().enumerate() {
        let seqs = routes(c, &placement[l], &at, k, len, n);
        dispatch += seqs.iter().map(|s| s.outputs_pulled(s.at)).sum::<u64>();
        let dest = match planner {
            Some(cfg) => {
                let (dest, secs) = timed_plan(&seqs, n, cost, cfg, reps);
                plan_s += secs;
                dest
            }
            None => at.clone(),
        };
        for (s, &j) in seqs.iter().zip(&dest) {
            combine += s.outputs_pulled(j);
            let [forward, backward] = s.residual_moved(j, costed);
            residual[0] += forward;
            residual[1] += backward;
            moved += u64::from(j != s.at);
        }
        worst = worst.max(busiest_over_mean(&attention_loads(&seqs, &dest, n, cost)));
        at = dest;
    }
    let name = match planner.map(|p| p.accounting) {
        None => "stay",
        Some(Accounting::ExpertOutputs) => "luffy",
        Some(Accounting::WithResidual) => "exact",
        Some(Accounting::ResidualWithDispatch) => "dispatch-h",
    };
    let row = MigrateRow {
        candidates: planner.map_or(0, |p| p.candidates),
        slack: planner.map_or(0.0, |p| p.slack),
        dispatch_rows: dispatch,
        combine_rows: combine,
        residual_rows: residual[0],
        residual_grad_rows: residual[1],
        moved,
        attention_max_over_mean: worst,
        plan_s,
        ..MigrateRow::named(spec, n, name)
    };
    let total = 2 * (dispatch + combine) + residual[0] + residual[1];
    (row, total as f64 * moe.d_model as f64 * 4.0)
}

/// Trains, captures, and follows the sequences (see the module).
pub fn run(cfg: &MigrateBench) -> Result<Vec<MigrateRow>, String> {
    let batch = cfg.capture.batch;
    if let Some(n) = cfg.devices.iter().find(|&&n| n == 0 || n > batch) {
        return Err(format!(
            "{n} devices for a batch of {batch} sequences: need 1 to {batch}"
        ));
    }
    let config = strata::lm::LmConfig::preset(&cfg.capture.preset).map_err(|e| e.to_string())?;
    if !config.dense_layers.is_empty() {
        return Err(format!(
            "{}: the coherent rows count an attention in front of each MoE layer, \
             and this model has dense layers between them",
            cfg.capture.preset
        ));
    }
    let t = train_and_capture(&cfg.capture)?;
    let mut rows = Vec::new();
    for &n in &cfg.devices {
        let planners: Vec<Option<MigrationConfig>> = [None]
            .into_iter()
            .chain(
                [
                    Accounting::ExpertOutputs,
                    Accounting::WithResidual,
                    Accounting::ResidualWithDispatch,
                ]
                .into_iter()
                .flat_map(|accounting| {
                    [1, 2].map(|candidates| {
                        Some(MigrationConfig {
                            candidates,
                            slack: cfg.slack,
                            accounting,
                        })
                    })
                }),
            )
            .collect();
        for (name, placement) in placements(&t, n)? {
            let mut stay: Option<(f64, u64)> = None;
            let followed = planners
                .iter()
                .map(|planner| follow(&t, &cfg.capture, n, &placement, planner.as_ref(), cfg.reps))
                .chain(
                    [false, true].map(|kv| follow_coherent(&t, &cfg.capture, n, &placement, kv)),
                );
            for (mut row, bytes) in followed {
                row.placement = name;
                row.link_gb_per_s = cfg.link_gb_per_s;
                row.link_s = bytes / (cfg.link_gb_per_s * 1e9);
                row.modeled_step_s = t.step_s + row.link_s;
                let (stay_bytes, stay_combine) = *stay.get_or_insert((bytes, row.combine_rows));
                row.rows_vs_stay = bytes / stay_bytes.max(1.0);
                let combines = 2 * row.combine_rows + row.residual_rows + row.residual_grad_rows;
                row.combine_vs_stay = combines as f64 / (2 * stay_combine).max(1) as f64;
                rows.push(row);
            }
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_run_follows_every_placement_and_planner() {
        let cfg = MigrateBench {
            capture: CaptureSpec {
                preset: "tiny".into(),
                train_steps: 2,
                seq_len: 16,
                batch: 8,
            },
            devices: vec![2, 4],
            slack: 0.0,
            reps: 1,
            link_gb_per_s: 10.0,
        };
        let rows = run(&cfg).unwrap();
        // devices × placements × (stay + 3 accountings × 2 candidates +
        // coherent by rows and weighing K and V)
        assert_eq!(rows.len(), 2 * 3 * 9);
        let layers = strata::lm::LmConfig::preset("tiny").unwrap().layers as u64;
        for r in &rows {
            // Every assignment is dispatched from, and combined to, one
            // device; those already there do not cross.
            assert!(r.dispatch_rows <= layers * 8 * 16 * 2, "{r:?}");
            if r.planner.starts_with("coherent") {
                // A token's residual crosses at most once a layer, and
                // only when it moves.
                assert_eq!(r.residual_grad_rows, r.residual_rows, "{r:?}");
                assert!(r.residual_rows <= r.moved, "{r:?}");
                continue;
            }
            assert_eq!(
                (r.kv_rows, r.residual_grad_rows),
                (0, r.moved * 16),
                "{r:?}"
            );
            if r.planner == "dispatch-h" {
                assert!(r.residual_rows <= r.moved * 16, "{r:?}");
            } else {
                assert_eq!(r.residual_rows, r.moved * 16, "{r:?}");
            }
            // Sequences of one length and no slack: never over ⌈B / N⌉.
            assert!(r.attention_max_over_mean <= 1.0 + 1e-9, "{r:?}");
            if r.planner == "stay" {
                assert_eq!((r.moved, r.combine_rows), (0, r.dispatch_rows), "{r:?}");
                assert_eq!(r.rows_vs_stay, 1.0);
                // Dispatch and combine, forward and backward, of 64 f32s.
                let bytes = 4.0 * r.dispatch_rows as f64 * 64.0 * 4.0;
                assert!((r.link_s - bytes / 10e9).abs() < 1e-12, "{r:?}");
            }
        }
    }

    #[test]
    fn tokens_rebuilt_at_home_are_the_sequences_that_stay() {
        let spec = CaptureSpec {
            preset: "tiny".into(),
            train_steps: 2,
            seq_len: 16,
            batch: 8,
        };
        let t = train_and_capture(&spec).unwrap();
        let k = t.lm.moe().top_k;
        for n in [2, 4] {
            for (name, placement) in placements(&t, n).unwrap() {
                let (stay, _) = follow(&t, &spec, n, &placement, None, 1);
                let devices = assignment_devices(&t.layers, &placement);
                let home = homes(&t, &spec, n);
                let c = follow_tokens(&devices, k, spec.seq_len, &home, n, Rebuild::Home);
                assert_eq!(
                    (c.dispatch, c.combine, c.residual, c.kv, c.moved),
                    (stay.dispatch_rows, stay.combine_rows, 0, 0, 0),
                    "{name} on {n}"
                );
            }
        }
    }

    #[test]
    fn more_devices_than_sequences_is_refused() {
        let cfg = MigrateBench {
            capture: CaptureSpec {
                preset: "tiny".into(),
                train_steps: 1,
                seq_len: 8,
                batch: 2,
            },
            devices: vec![4],
            slack: 0.0,
            reps: 1,
            link_gb_per_s: 10.0,
        };
        assert!(run(&cfg).unwrap_err().contains("need 1 to 2"));
    }
}
