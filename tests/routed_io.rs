//! A step's I/O follows its routing: an expert that gets no token is not
//! read for its backward, updated or written back, and the metrics show
//! what moved against the least the routing needed (`bytes_ssd_min`).

mod common;

use common::{hyper, model, record_bytes};
use strata::engine::{Engine, EngineConfig, StepMetrics};
use strata::math::ExpertKind;
use strata::model::{fill_uniform, Batch, ModelConfig};
use strata_tiers::Dtype;

const STEPS: usize = 8;

/// 6 tokens a step, top-1, over 2 layers of 8 experts: at most 6 of a
/// layer's 8 experts get a token, most steps fewer.
fn sparse_batch(model: &ModelConfig, step: usize) -> Batch {
    let t = 6;
    let mut inputs = vec![0.0f32; t * model.d_model];
    fill_uniform(&mut inputs, 300 + step as u64, 1, 1.0);
    let targets = (0..t).map(|i| (i % model.classes) as u32).collect();
    Batch { inputs, targets }
}

/// An engine's configuration whose host tier holds `host_records` of the
/// 16 records (and whose device, 2 experts' compute params).
fn config(dir: &std::path::Path, host_records: u64, train: bool) -> EngineConfig {
    config_on_device(dir, host_records, 2, train)
}

/// `config`, with a device that holds `device_experts` experts' compute
/// params.
fn config_on_device(
    dir: &std::path::Path,
    host_records: u64,
    device_experts: u64,
    train: bool,
) -> EngineConfig {
    let model = model(1, ExpertKind::SwiGlu);
    let expert_bytes = (model.expert_params() * 4) as u64;
    EngineConfig {
        store_path: Some(dir.join(format!("{host_records}-{device_experts}-{train}.strata"))),
        device_budget_bytes: device_experts * expert_bytes,
        host_budget_bytes: host_records * record_bytes(&model),
        compute_dtype: Dtype::F32,
        hyper: hyper(),
        optimizer_threads: 2,
        train_experts: train,
        ..EngineConfig::default()
    }
}

fn engine(dir: &std::path::Path, host_records: u64, train: bool) -> (Engine, ModelConfig) {
    let model = model(1, ExpertKind::SwiGlu);
    let engine = Engine::new(model.clone(), config(dir, host_records, train)).unwrap();
    (engine, model)
}

fn run(host_records: u64, dir: &std::path::Path) -> (Vec<StepMetrics>, Vec<Vec<f32>>) {
    let (metrics, params, kept) = run_training(host_records, true, dir);
    assert_eq!(kept, 0, "no record kept resident: every routed one streams");
    (metrics, params)
}

fn run_training(
    host_records: u64,
    train: bool,
    dir: &std::path::Path,
) -> (Vec<StepMetrics>, Vec<Vec<f32>>, usize) {
    let (mut engine, model) = engine(dir, host_records, train);
    let metrics = (0..STEPS)
        .map(|s| engine.step(&sparse_batch(&model, s)).unwrap())
        .collect();
    let params = (0..model.layers)
        .flat_map(|l| (0..model.experts).map(move |e| (l, e)))
        .map(|(l, e)| engine.expert_params(l, e).unwrap())
        .collect();
    (metrics, params, engine.host_kept())
}

/// The experts of `layer` with tokens in a step.
fn routed(m: &StepMetrics, layer: usize) -> Vec<usize> {
    (0..m.tokens_per_expert[layer].len())
        .filter(|&e| m.tokens_per_expert[layer][e] > 0)
        .collect()
}

#[test]
fn a_step_moves_about_the_bytes_its_routing_needs() {
    let dir = tempfile::tempdir().unwrap();
    let record = record_bytes(&model(1, ExpertKind::SwiGlu));
    let (metrics, _) = run(4, dir.path());
    let (mut moved, mut least) = (0, 0);
    for m in &metrics {
        let routed_count: usize = (0..2).map(|l| routed(m, l).len()).sum();
        eprintln!(
            "step {}: {routed_count} experts routed, {} B read, {} B written, least {} \
             (records of {record} B); prediction missed {}, unused {}",
            m.step,
            m.bytes_ssd_to_host,
            m.bytes_host_to_ssd,
            m.bytes_ssd_min,
            m.prediction_missed,
            m.prediction_unused
        );
        // Each routed expert's record read once and written back once.
        assert_eq!(m.bytes_ssd_min, 2 * record * routed_count as u64);
        assert!(
            routed_count < 16,
            "every expert routed: a batch too big to test this"
        );
        if m.step > 1 {
            moved += m.bytes_ssd_to_host + m.bytes_host_to_ssd;
            least += m.bytes_ssd_min;
        }
    }
    // Reading every expert (its compute params in the forward, its state
    // for an update in the backward) moved 2.3× the least here. Now an
    // expert the prediction names for nothing costs its compute part (a
    // quarter of a record here), and so does a compute part the 4-record
    // host tier cannot keep from the forward to the backward: 1.13–1.19×
    // in three runs, less what stays in the host tier from the step before.
    assert!(
        moved as f64 <= 1.35 * least as f64,
        "{moved} B moved for {least} B needed"
    );
}

/// By default every layer is predicted from its previous routing.
#[test]
fn the_prediction_is_the_previous_steps_routing() {
    let dir = tempfile::tempdir().unwrap();
    let (metrics, _) = run(4, dir.path());
    let experts = 8;
    // Before the first routing every expert is expected: nothing missed.
    let first = &metrics[0];
    let routed_first: usize = (0..2).map(|l| routed(first, l).len()).sum();
    assert_eq!(first.prediction_missed, 0);
    assert_eq!(first.prediction_unused as usize, 2 * experts - routed_first);
    for w in metrics.windows(2) {
        let (before, now) = (&w[0], &w[1]);
        let (mut missed, mut unused) = (0, 0);
        for l in 0..2 {
            let (p, r) = (routed(before, l), routed(now, l));
            missed += r.iter().filter(|e| !p.contains(e)).count() as u64;
            unused += p.iter().filter(|e| !r.contains(e)).count() as u64;
        }
        assert_eq!(
            (now.prediction_missed, now.prediction_unused),
            (missed, unused),
            "step {}",
            now.step
        );
    }
}

/// With `affinity_prefetch`, layer 0 is predicted from its previous
/// routing; layer 1 from layer 0's routing in this step and the pairs
/// traced in the steps before, each step's weighing half the next one's:
/// expert b where Σ_a (tokens at a) × P(b | a) reaches half a token.
#[test]
fn the_prediction_follows_the_last_routing_and_the_traced_affinity() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(1, ExpertKind::SwiGlu);
    let mut engine = Engine::new(
        model.clone(),
        EngineConfig {
            trace_routing: true,
            affinity_prefetch: true,
            ..config(dir.path(), 4, true)
        },
    )
    .unwrap();
    let e = model.experts;
    let mut before: Option<(StepMetrics, Vec<f64>)> = None;
    let mut traced = vec![0u64; e * e];
    for s in 0..STEPS {
        let m = engine.step(&sparse_batch(&model, s)).unwrap();
        let (r0, r1) = (routed(&m, 0), routed(&m, 1));
        let (p0, p1): (Vec<usize>, Vec<usize>) = match &before {
            None => ((0..e).collect(), (0..e).collect()),
            Some((last, pairs)) => {
                let expected = |b: usize| -> f64 {
                    (0..e)
                        .map(|a| {
                            let row = &pairs[a * e..(a + 1) * e];
                            let total: f64 = row.iter().sum();
                            match total {
                                0.0 => 0.0,
                                _ => m.tokens_per_expert[0][a] as f64 * row[b] / total,
                            }
                        })
                        .sum()
                };
                (
                    routed(last, 0),
                    (0..e).filter(|&b| expected(b) >= 0.5).collect(),
                )
            }
        };
        let count = |routed: &[usize], predicted: &[usize]| {
            let missed = routed.iter().filter(|x| !predicted.contains(x)).count();
            let unused = predicted.iter().filter(|x| !routed.contains(x)).count();
            (missed as u64, unused as u64)
        };
        let ((m0, u0), (m1, u1)) = (count(&r0, &p0), count(&r1, &p1));
        assert_eq!(
            (m.prediction_missed, m.prediction_unused),
            (m0 + m1, u0 + u1),
            "step {}",
            m.step
        );
        // This step's pairs: the trace's growth.
        let now = &engine.routing_trace().unwrap().transitions[0];
        let mut pairs = before.map_or(vec![0.0; e * e], |b| b.1);
        for ((p, &n), t) in pairs.iter_mut().zip(now).zip(&mut traced) {
            *p = 0.5 * *p + (n - *t) as f64;
            *t = n;
        }
        before = Some((m, pairs));
    }
}

/// Where the device holds every expert's compute params, an expert's
/// backward finds them there from its forward, so its update reads its
/// optimizer state alone: each routed expert's compute part is read once
/// (for its forward) and its state part once (for its update). Without
/// the prefetcher that is all a step reads (updates that read whole
/// records read each compute part twice); with it, the prediction's
/// names add what they cost (a compute part, and a state part where the
/// prefetcher reaches an unrouted layer's backward), and timing may cost
/// a compute part again. Results are the bits of a run whose updates read
/// whole records (the device holding 2 experts).
#[test]
fn an_update_of_an_expert_still_on_the_device_reads_its_state_alone() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(1, ExpertKind::SwiGlu);
    let part = |bytes: usize| (bytes as u64 + 64).div_ceil(4096) * 4096;
    let compute_part = part(model.expert_params() * 4);
    let state_part = part(model.expert_params() * 12);
    let (whole, params_whole) = run(4, dir.path());
    for prefetch in [0, EngineConfig::default().prefetch_ahead_max] {
        let config = EngineConfig {
            prefetch_ahead_max: prefetch,
            store_path: Some(dir.path().join(format!("device-{prefetch}.strata"))),
            ..config_on_device(dir.path(), 4, 16, true)
        };
        let mut engine = Engine::new(model.clone(), config).unwrap();
        let metrics: Vec<StepMetrics> = (0..STEPS)
            .map(|s| engine.step(&sparse_batch(&model, s)).unwrap())
            .collect();
        let (mut moved, mut least) = (0, 0);
        for m in &metrics[1..] {
            let routed_count = (0..2).map(|l| routed(m, l).len() as u64).sum::<u64>();
            // With the prefetcher, a wrong guess of what the device holds,
            // or a record evicted before its use, reads a compute part
            // again: at most what whole-record updates read.
            let (named, again) = match prefetch {
                0 => (routed_count, 0),
                _ => (routed_count + m.prediction_unused, routed_count),
            };
            eprintln!(
                "prefetch {prefetch}, step {}: {routed_count} experts routed, {} named for \
                 nothing, {} B read, {} B least",
                m.step, m.prediction_unused, m.bytes_ssd_to_host, m.bytes_ssd_min
            );
            assert!(
                m.bytes_ssd_to_host <= (compute_part + state_part) * named + compute_part * again,
                "prefetch {prefetch}, step {}: {} B read",
                m.step,
                m.bytes_ssd_to_host
            );
            moved += m.bytes_ssd_to_host + m.bytes_host_to_ssd;
            least += m.bytes_ssd_min;
        }
        // Whole records moved 1.11 and 1.14× the least with the prefetcher.
        eprintln!("prefetch {prefetch}: moved {moved} B for {least} B needed");
        if prefetch == 0 {
            assert!(moved <= least, "{moved} B moved for {least} B needed");
        }
        for (a, b) in metrics.iter().zip(&whole) {
            assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "step {}", a.step);
        }
        let params: Vec<Vec<f32>> = (0..model.layers)
            .flat_map(|l| (0..model.experts).map(move |e| (l, e)))
            .map(|(l, e)| engine.expert_params(l, e).unwrap())
            .collect();
        assert_eq!(params, params_whole);
    }
}

#[test]
fn the_bytes_a_step_moves_change_no_bit() {
    let dir = tempfile::tempdir().unwrap();
    let (streamed, params_streamed) = run(4, dir.path());
    // Every record in the host tier: nothing has to move.
    let (resident, params_resident) = run(16, dir.path());
    assert!(resident.iter().all(|m| m.bytes_ssd_min == 0));
    assert!(streamed.iter().all(|m| m.bytes_ssd_min > 0));
    for (a, b) in streamed.iter().zip(&resident) {
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "step {}", a.step);
        assert_eq!(a.tokens_per_expert, b.tokens_per_expert);
    }
    assert_eq!(params_streamed, params_resident);
}

#[test]
fn frozen_experts_are_read_for_their_compute_params_alone() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(1, ExpertKind::SwiGlu);
    let compute_part = ((model.expert_params() * 4) as u64 + 64).div_ceil(4096) * 4096;
    // Records without moments are smaller: the same budget holds 6, and
    // 2 of them (layer 1's experts 0 and 1) are kept resident.
    let (metrics, _, kept) = run_training(4, false, dir.path());
    assert_eq!(kept, 2);
    for m in &metrics[1..] {
        let routed_count: usize = (0..2).map(|l| routed(m, l).len()).sum();
        let streamed = routed(m, 0).len() + routed(m, 1).iter().filter(|&&e| e >= kept).count();
        assert_eq!(m.bytes_ssd_min, compute_part * streamed as u64);
        assert_eq!(m.bytes_host_to_ssd, 0, "frozen records are never written");
        // The compute params of each routed expert for its forward and its
        // backward, and of those the prediction named for nothing; no
        // optimizer state (three times a compute part here).
        let named = routed_count as u64 + m.prediction_unused;
        assert!(
            m.bytes_ssd_to_host <= 2 * compute_part * named,
            "step {}: {} B read, {routed_count} experts routed, {} named for nothing",
            m.step,
            m.bytes_ssd_to_host,
            m.prediction_unused
        );
    }
}
