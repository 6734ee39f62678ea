//! Several cpu devices against one (ES-MoE §4.2–4.3 under the correctness
//! principle): N devices with pinning on or off, experts resident or
//! streaming from a store file, train the same model as one device, and
//! every configuration of N devices is bit-identical to every other and to
//! itself run again.

mod common;

use common::{batch, hyper, max_rel, model, record_bytes};
use strata::engine::{Engine, EngineConfig, ScheduleKind, StepMetrics};
use strata::math::ExpertKind;
use strata::model::{Batch, ModelConfig};
use strata::EngineError;
use strata_tiers::Dtype;

const STEPS: usize = 12;

struct Trained {
    dense: Vec<f32>,
    experts: Vec<f32>,
    steps: Vec<u64>,
    metrics: Vec<StepMetrics>,
    pinned_per_device: Vec<usize>,
}

fn train(model: &ModelConfig, config: EngineConfig) -> Trained {
    let mut engine = Engine::new(model.clone(), config).unwrap();
    let metrics = (0..STEPS)
        .map(|s| engine.step(&batch(model, s)).unwrap())
        .collect();
    let pinned_per_device = engine.pinned_per_device();
    let mut experts = Vec::new();
    let mut steps = Vec::new();
    for l in 0..model.layers {
        for e in 0..model.experts {
            experts.extend(engine.expert_params(l, e).unwrap());
            steps.push(engine.expert_step(l, e).unwrap());
        }
    }
    Trained {
        dense: engine.dense_params().unwrap().to_vec(),
        experts,
        steps,
        metrics,
        pinned_per_device,
    }
}

fn base(model: &ModelConfig, devices: usize, micro_batches: usize) -> EngineConfig {
    let all = (model.layers * model.experts) as u64;
    EngineConfig {
        hyper: hyper(),
        devices,
        micro_batches,
        compute_dtype: Dtype::F32,
        optimizer_threads: 2,
        device_budget_bytes: all * (model.expert_params() * 4) as u64,
        host_budget_bytes: all * record_bytes(model),
        ..EngineConfig::default()
    }
}

/// N devices, each with `micro_batches`, in four tier/pinning settings;
/// against one device running the same global batch as N·micro_batches
/// micro-batches.
fn case(top_k: usize, devices: usize, micro_batches: usize) {
    let model = model(top_k, ExpertKind::SwiGlu);
    let dir = tempfile::tempdir().unwrap();
    let all = (model.layers * model.experts) as u64;
    let expert_bytes = (model.expert_params() * 4) as u64;
    let one = train(&model, base(&model, 1, devices * micro_batches));
    let configs = [
        (
            "resident, pinning off",
            EngineConfig {
                pin_fraction: 0.0,
                ..base(&model, devices, micro_batches)
            },
        ),
        (
            "resident, pinning 25 %",
            base(&model, devices, micro_batches),
        ),
        // 6 device slots a device: 4 may be pinned, 2 stream.
        (
            "records on SSD, host budget 25 %, pinning 25 %",
            EngineConfig {
                device_budget_bytes: 6 * expert_bytes,
                host_budget_bytes: all / 4 * record_bytes(&model),
                store_path: Some(dir.path().join("pinned.store")),
                ..base(&model, devices, micro_batches)
            },
        ),
        (
            "records on SSD, device budget 2 experts, pinning off",
            EngineConfig {
                device_budget_bytes: 2 * expert_bytes,
                host_budget_bytes: all / 4 * record_bytes(&model),
                store_path: Some(dir.path().join("unpinned.store")),
                pin_fraction: 0.0,
                ..base(&model, devices, micro_batches)
            },
        ),
        (
            "naive schedule, recomputed activations, host budget 25 %",
            EngineConfig {
                schedule: ScheduleKind::Naive,
                recompute_hidden: true,
                device_budget_bytes: 3 * expert_bytes,
                host_budget_bytes: all / 4 * record_bytes(&model),
                ..base(&model, devices, micro_batches)
            },
        ),
        (
            "resident, pinning 25 %, run again",
            base(&model, devices, micro_batches),
        ),
    ];
    let mut first: Option<Trained> = None;
    for (name, config) in configs {
        let pin = config.pin_fraction > 0.0;
        let got = train(&model, config);
        let last = got.metrics.last().unwrap();
        assert_eq!(last.assignments_per_device.len(), devices);
        eprintln!(
            "top-{top_k}, {devices} devices × {micro_batches} micro-batches, {name}: \
             computed assignments per device {:?} (gap {:.1} %), pinned {:?}",
            last.assignments_per_device,
            100.0 * last.device_load_gap(),
            got.pinned_per_device
        );
        // Placement gives every device work over the run (the cost model is
        // calibrated from measured times, so one step's split may vary), and
        // pinning pins.
        let work: Vec<u64> = (0..devices)
            .map(|d| {
                got.metrics
                    .iter()
                    .map(|m| m.assignments_per_device[d])
                    .sum()
            })
            .collect();
        assert!(work.iter().all(|&a| a > 0), "{name}: {work:?}");
        assert_eq!(
            got.pinned_per_device.iter().any(|&p| p > 0),
            pin,
            "{name}: pinned {:?}",
            got.pinned_per_device
        );
        // Where experts run and what the tiers hold never changes a bit.
        match &first {
            None => first = Some(got),
            Some(f) => {
                assert!(got.dense == f.dense, "{name}: dense params differ");
                assert!(got.experts == f.experts, "{name}: expert params differ");
                assert_eq!(got.steps, f.steps, "{name}: expert step counts differ");
                let losses = |t: &Trained| {
                    t.metrics
                        .iter()
                        .map(|m| m.loss.to_bits())
                        .collect::<Vec<_>>()
                };
                assert_eq!(losses(&got), losses(f), "{name}: losses differ");
            }
        }
    }
    let got = first.unwrap();
    // Against one device with N·m micro-batches: the same tokens through
    // the same arithmetic, except that an expert's weight gradient is one
    // GEMM over the rows of all devices instead of a sum of per-micro-batch
    // GEMMs, and the dense gradient is a rank-ordered sum of per-device
    // sums instead of one running sum: f32 reassociation, ~1e-7 relative a
    // step. The optimizer keeps the gradient's scale (`common::hyper`): a
    // step moves a param by lr·m̂ ≤ 0.5 × 0.05, so 1e-6 of gradient error
    // moves it by ≤ 2.5e-8 a step, ≤ 3e-7 after 12 steps: 1e-6 bounds it,
    // while a dense all-reduce or an expert sum off by a factor of 2 moves
    // params by up to ~1e-2.
    assert_eq!(got.steps, one.steps, "per-expert step counts");
    let dense = max_rel(&got.dense, &one.dense);
    let experts = max_rel(&got.experts, &one.experts);
    eprintln!(
        "top-{top_k}, {devices} devices × {micro_batches}: max rel diff vs one device dense {dense:.2e} experts {experts:.2e}"
    );
    assert!(
        dense < 1e-6 && experts < 1e-6,
        "dense {dense}, experts {experts}"
    );
    for (a, b) in got.metrics.iter().zip(&one.metrics) {
        assert_eq!(a.tokens_per_expert, b.tokens_per_expert, "step {}", a.step);
        assert!(
            (a.loss - b.loss).abs() <= 1e-6 * b.loss.abs(),
            "{} vs {}",
            a.loss,
            b.loss
        );
    }
}

#[test]
fn two_devices_top2_match_one_device() {
    case(2, 2, 1);
}

#[test]
fn four_devices_top1_match_one_device() {
    case(1, 4, 1);
}

#[test]
fn two_devices_with_two_micro_batches_each_match_one_device() {
    case(2, 2, 2);
}

#[test]
fn a_batch_too_small_for_the_devices_is_a_clear_error() {
    let model = model(2, ExpertKind::SwiGlu);
    let mut engine = Engine::new(model.clone(), base(&model, 4, 2)).unwrap();
    let b = batch(&model, 0);
    let small = Batch {
        inputs: b.inputs[..5 * model.d_model].to_vec(),
        targets: b.targets[..5].to_vec(),
    };
    let err = engine.step(&small).unwrap_err().to_string();
    assert!(err.contains("4 devices × 2 micro-batches need 8"), "{err}");
    // The engine still trains afterwards.
    engine.step(&b).unwrap();
}

#[test]
fn zero_devices_are_refused() {
    let model = model(2, ExpertKind::SwiGlu);
    let err = Engine::new(model.clone(), base(&model, 0, 1))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("devices must be at least 1"), "{err}");
}

/// A loss that overflows on one device only: that device's error is the
/// one reported, and its peers, waiting in the token exchange, stop
/// instead of hanging.
#[test]
fn a_failure_on_one_device_stops_the_others_and_names_the_cause() {
    let model = model(2, ExpertKind::SwiGlu);
    let mut engine = Engine::new(model.clone(), base(&model, 2, 1)).unwrap();
    let mut b = batch(&model, 0);
    let half = b.inputs.len() / 2;
    b.inputs[half..].iter_mut().for_each(|x| *x = 3e38);
    let err = engine.step(&b).unwrap_err();
    assert!(matches!(err, EngineError::NonFiniteLoss { .. }), "{err}");
}

/// A modeled link (`EngineConfig::link`) changes no bit, and each step's
/// collectives take at least its latency each.
#[test]
fn a_modeled_link_changes_no_bit_and_takes_its_time() {
    let model = model(2, ExpertKind::SwiGlu);
    let plain = train(&model, base(&model, 2, 1));
    let link = strata::comm::Link::new(1.0, 10_000.0).unwrap();
    let slow = train(
        &model,
        EngineConfig {
            link: Some(link),
            ..base(&model, 2, 1)
        },
    );
    assert_eq!(plain.dense, slow.dense);
    assert_eq!(plain.experts, slow.experts);
    for (a, b) in plain.metrics.iter().zip(&slow.metrics) {
        assert_eq!(a.loss.to_bits(), b.loss.to_bits());
        // Per layer the counts and two exchanges each pass, then the
        // dense all-reduce and the loss's: at least 10 collectives of
        // 10 ms a step.
        assert!(b.comm_s >= 0.1, "{} s in collectives", b.comm_s);
    }
}
