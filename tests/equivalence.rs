//! The engine against the plain reference trainer, and against itself
//! under every tier configuration (DESIGN.md, "Correctness principle").

mod common;

use common::{batch, hyper, max_rel, model, record_bytes};
use strata::backend::BackendKind;
use strata::engine::{Engine, EngineConfig, ScheduleKind};
use strata::math::ExpertKind;
use strata::model::ModelConfig;
use strata::reference::ReferenceTrainer;
use strata_tiers::Dtype;

const STEPS: usize = 20;

/// The learning rate of step `s`: one that changes every step, as a
/// schedule's does, never above `hyper().lr`, so that an update applied
/// with another step's rate (a held one, say) shows.
fn lr_of_step(s: usize) -> f32 {
    hyper().lr * (1 + s % 4) as f32 / 4.0
}

/// What a run leaves: dense params, every expert's params flattened,
/// each expert's step count, and the loss of every step.
type Trained = (Vec<f32>, Vec<f32>, Vec<u64>, Vec<f32>);

/// Every parameter of the engine after training, flattened.
fn train_engine(model: &ModelConfig, config: EngineConfig) -> Trained {
    let keeps = config.host_stream_slots == Some(3) && config.host_cell_slots == 0;
    let cells = config.host_cell_slots > 0;
    let mut engine = Engine::new(model.clone(), config).unwrap();
    // The configuration that streams through 3 host slots keeps the rest.
    if keeps {
        assert!(engine.host_kept() > 0);
        assert_eq!(engine.host_kept(), engine.host_slots() - 3);
    }
    if cells {
        assert!(engine.host_cells() > 0);
    }
    let mut demotions = 0;
    let mut losses = Vec::new();
    for s in 0..STEPS {
        engine.set_lr(lr_of_step(s)).unwrap();
        let m = engine.step(&batch(model, s)).unwrap();
        losses.push(m.loss);
        demotions += m.host_demotions;
        // The SSD's busy time is the union of its I/O calls within the step.
        assert!(m.ssd_busy_s >= 0.0 && m.ssd_busy_s <= m.wall_s, "{m:?}");
        assert!(m.ssd_busy_s > 0.0 || m.bytes_ssd_to_host + m.bytes_host_to_ssd == 0);
    }
    if cells {
        eprintln!("{demotions} records moved into compute cells in {STEPS} steps");
    }
    let mut experts = Vec::new();
    let mut steps = Vec::new();
    for l in 0..model.layers {
        for e in 0..model.experts {
            experts.extend(engine.expert_params(l, e).unwrap());
            steps.push(engine.expert_step(l, e).unwrap());
        }
    }
    (
        engine.dense_params().unwrap().to_vec(),
        experts,
        steps,
        losses,
    )
}

fn train_reference(model: &ModelConfig, micro_batches: usize) -> Trained {
    let mut r = ReferenceTrainer::new(model.clone(), hyper()).unwrap();
    let mut losses = Vec::new();
    for s in 0..STEPS {
        r.hyper.lr = lr_of_step(s);
        losses.push(r.step(&batch(model, s), micro_batches).unwrap().total);
    }
    let experts = r
        .experts
        .iter()
        .flatten()
        .flat_map(|e| e.params.clone())
        .collect();
    let steps = r.experts.iter().flatten().map(|e| e.step).collect();
    (r.dense.clone(), experts, steps, losses)
}

fn configs(
    backend: BackendKind,
    model: &ModelConfig,
    micro_batches: usize,
    dir: &std::path::Path,
) -> Vec<(&'static str, EngineConfig)> {
    let expert_bytes = (model.expert_params() * 4) as u64;
    let record_bytes = record_bytes(model);
    let all = (model.layers * model.experts) as u64;
    let base = EngineConfig {
        backend,
        hyper: hyper(),
        micro_batches,
        compute_dtype: Dtype::F32,
        optimizer_threads: 2,
        ..EngineConfig::default()
    };
    vec![
        (
            "everything resident",
            EngineConfig {
                device_budget_bytes: all * expert_bytes,
                host_budget_bytes: all * record_bytes,
                ..base.clone()
            },
        ),
        (
            "device budget of 2 experts",
            EngineConfig {
                device_budget_bytes: 2 * expert_bytes,
                host_budget_bytes: all * record_bytes,
                ..base.clone()
            },
        ),
        (
            "host budget of 25% of the experts, records on SSD",
            EngineConfig {
                device_budget_bytes: 2 * expert_bytes,
                host_budget_bytes: all / 4 * record_bytes,
                store_path: Some(dir.join(format!("store-{micro_batches}-{}.strata", model.top_k))),
                ..base.clone()
            },
        ),
        (
            "host budget of 25%, streaming through 3 of its slots",
            EngineConfig {
                device_budget_bytes: 2 * expert_bytes,
                host_budget_bytes: all / 4 * record_bytes,
                host_stream_slots: Some(3),
                store_path: Some(dir.join(format!("kept-{micro_batches}-{}.strata", model.top_k))),
                ..base.clone()
            },
        ),
        (
            "host budget of 25%, a slot split into compute cells",
            EngineConfig {
                device_budget_bytes: 2 * expert_bytes,
                host_budget_bytes: all / 4 * record_bytes,
                host_stream_slots: Some(3),
                host_cell_slots: 1,
                store_path: Some(dir.join(format!("cells-{micro_batches}-{}.strata", model.top_k))),
                ..base.clone()
            },
        ),
        (
            "naive schedule",
            EngineConfig {
                device_budget_bytes: 2 * expert_bytes,
                host_budget_bytes: all / 4 * record_bytes,
                schedule: ScheduleKind::Naive,
                ..base.clone()
            },
        ),
        (
            "recomputed activations",
            EngineConfig {
                device_budget_bytes: 3 * expert_bytes,
                host_budget_bytes: all / 2 * record_bytes,
                recompute_hidden: true,
                ..base
            },
        ),
    ]
}

fn case(backend: BackendKind, top_k: usize, micro_batches: usize, kind: ExpertKind) {
    case_in(backend, Dtype::F32, top_k, micro_batches, kind);
}

/// [`case`] with the experts' compute params stored as `dtype`: bf16 on
/// the cpu computes its expert GEMMs in bf16 (`ExpertGemm::Bf16`).
fn case_in(
    backend: BackendKind,
    dtype: Dtype,
    top_k: usize,
    micro_batches: usize,
    kind: ExpertKind,
) {
    let model = model(top_k, kind);
    let dir = tempfile::tempdir().unwrap();
    let (ref_dense, ref_experts, ref_steps, ref_losses) = train_reference(&model, micro_batches);
    let mut first: Option<Trained> = None;
    for (name, mut config) in configs(backend, &model, micro_batches, dir.path()) {
        config.compute_dtype = dtype;
        let got = train_engine(&model, config);
        // Whatever the tiers do, the engine computes the same thing:
        // bit-identical params and identical per-expert step counts.
        match &first {
            None => first = Some(got.clone()),
            Some(f) => {
                assert!(
                    got.0 == f.0,
                    "{name}: dense params differ from the first configuration"
                );
                assert!(
                    got.1 == f.1,
                    "{name}: expert params differ from the first configuration"
                );
                assert_eq!(got.2, f.2, "{name}: expert step counts differ");
                assert!(got.3 == f.3, "{name}: losses differ");
            }
        }
        // Against the plain reference, on the cpu: only the experts' GEMMs
        // sum in another order (blocked sgemm vs plain loops), a few f32
        // ulps a product, ~1e-6 of a gradient. The optimizer keeps the
        // gradient's scale (`common::hyper`): a step moves a param by
        // lr·m̂ ≤ 0.5 × 0.05, so 1e-6 of gradient error moves it by
        // ≤ 2.5e-8 a step, ≤ 5e-7 after 20 steps: 1e-6 bounds params and
        // losses, while a gradient off by a factor of 2 anywhere moves
        // params by up to ~1e-2. On the GPU the GEMMs round their operands
        // to bf16 (2⁻⁹ relative each, so a product to 2⁻⁸ and a sum of
        // products with random signs norm-wise to about the same); a
        // backward chains three such GEMMs to a weight's gradient, ~1e-2
        // of it, which moves a param by ≤ 20 × 0.5 × 0.05 × 1e-2 = 5e-3
        // over the run: 1e-2 bounds it, and a factor of 2 (1.0 of a
        // gradient) still fails it.
        // The cpu's bf16 expert GEMMs round as a GPU's do, and its bf16
        // params are the f32 ones rounded (2⁻⁹ relative): the same bound.
        let tolerance = match (backend, dtype) {
            (BackendKind::Cpu, Dtype::F32) => 1e-6,
            _ => 1e-2,
        };
        assert_eq!(
            got.2, ref_steps,
            "{name}: per-expert step counts differ from the reference"
        );
        for (s, (a, b)) in got.3.iter().zip(&ref_losses).enumerate() {
            assert!(
                (a - b).abs() <= tolerance * b.abs(),
                "{name}: step {s}'s loss {a} against the reference's {b}"
            );
        }
        let dense = max_rel(&got.0, &ref_dense);
        let experts = max_rel(&got.1, &ref_experts);
        eprintln!("{backend:?} {dtype:?}, top-{top_k}, {micro_batches} micro-batches, {}: {name}: max rel diff vs reference dense {dense:.2e} experts {experts:.2e}", kind.name());
        assert!(
            dense < tolerance && experts < tolerance,
            "{name}: dense {dense}, experts {experts}"
        );
    }
    // With top-1 routing some experts go untouched in some steps, so the
    // per-expert step counts compared above are not all equal to STEPS.
    let steps = first.unwrap().2;
    if top_k == 1 {
        assert!(steps.iter().any(|&s| s < STEPS as u64), "{steps:?}");
    }
}

#[test]
fn top1_one_micro_batch() {
    case(BackendKind::Cpu, 1, 1, ExpertKind::SwiGlu);
}

#[test]
fn top2_one_micro_batch() {
    case(BackendKind::Cpu, 2, 1, ExpertKind::SwiGlu);
}

#[test]
fn top1_four_micro_batches() {
    case(BackendKind::Cpu, 1, 4, ExpertKind::SwiGlu);
}

#[test]
fn top2_four_micro_batches() {
    case(BackendKind::Cpu, 2, 4, ExpertKind::SwiGlu);
}

/// bf16 expert GEMMs on the cpu (the trainer's default): the same bits
/// whatever the tiers, budgets and schedule, near the f32 reference.
#[test]
fn bf16_expert_gemms_top2_four_micro_batches() {
    case_in(BackendKind::Cpu, Dtype::Bf16, 2, 4, ExpertKind::SwiGlu);
}

#[test]
fn gelu_experts_top2() {
    case(BackendKind::Cpu, 2, 1, ExpertKind::Gelu);
}

/// The same cases with the experts on the GPU (`--features cuda` and a
/// GPU, or the CPU model of one in CI): bit-identical params whatever the
/// tiers do, and the reference within bf16's bound.
#[cfg(feature = "cuda")]
mod on_the_gpu {
    use super::*;

    fn gpu_case(top_k: usize, micro_batches: usize, kind: ExpertKind) {
        if let Err(e) = BackendKind::Cuda.check(0..1, Dtype::F32) {
            common::cuda_case_skipped(e);
            return;
        }
        case(BackendKind::Cuda, top_k, micro_batches, kind);
    }

    #[test]
    fn top1_one_micro_batch() {
        gpu_case(1, 1, ExpertKind::SwiGlu);
    }

    #[test]
    fn top2_four_micro_batches() {
        gpu_case(2, 4, ExpertKind::SwiGlu);
    }

    #[test]
    fn gelu_experts_top2() {
        gpu_case(2, 1, ExpertKind::Gelu);
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_cases() {
    common::cuda_case_skipped("built without --features cuda");
}

#[test]
fn the_loss_falls() {
    let model = model(2, ExpertKind::SwiGlu);
    let mut engine = Engine::new(
        model.clone(),
        EngineConfig {
            hyper: hyper(),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let first = engine.step(&batch(&model, 0)).unwrap().loss;
    let mut last = first;
    for _ in 0..60 {
        last = engine.step(&batch(&model, 0)).unwrap().loss;
    }
    assert!(last < 0.7 * first, "loss {first} -> {last}");
}

/// The Mixtral-architecture LM (attention, RoPE, GQA around the MoE
/// layers) trained by the engine with its records streaming from a store
/// file, against the reference with everything in memory: the engine's
/// dense linears run on the backend's GEMM where the reference keeps plain
/// loops, so the two differ by f32 summation order only: ~1e-6 of a
/// gradient a step. Compared element by element (relative, floored at
/// 1e-3, so the params nearest zero weigh most), 10 steps of the
/// scale-keeping optimizer keep them within 1e-4 (2.5e-5 measured). The
/// engine's
/// runs under every tier configuration above are bit-identical, at a
/// learning rate that changes every step.
#[test]
fn the_language_model_matches_the_reference_and_ignores_the_tiers() {
    use strata::lm::{LmConfig, MoeLm, TokenBatch};
    use strata::model::Network;
    let lm = MoeLm::new(LmConfig {
        vocab: 40,
        d_model: 16,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
        d_ff: 24,
        experts: 8,
        top_k: 2,
        max_seq: 32,
        seed: 5,
        ..LmConfig::default()
    })
    .unwrap();
    let batch = |s: u64| TokenBatch {
        seq_len: 12,
        tokens: (0..4 * 13u64)
            .map(|i| ((i * 7 + s * 3) % 40) as u32)
            .collect(),
        loss_mask: None,
        doc_starts: None,
    };
    let steps = 10;
    let mut reference = ReferenceTrainer::new_network(&lm, hyper()).unwrap();
    for s in 0..steps {
        reference.hyper.lr = lr_of_step(s as usize);
        reference.step_network(&lm, &batch(s), 2).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let moe = lm.moe().clone();
    let run = |config: EngineConfig| {
        let mut engine = Engine::new_network(&lm, config).unwrap();
        for s in 0..steps {
            engine.set_lr(lr_of_step(s as usize)).unwrap();
            engine.step_network(&lm, &batch(s)).unwrap();
        }
        let mut experts = Vec::new();
        for l in 0..moe.layers {
            for e in 0..moe.experts {
                experts.extend(engine.expert_params(l, e).unwrap());
            }
        }
        (engine.dense_params().unwrap().to_vec(), experts)
    };
    let configs = configs(BackendKind::Cpu, &moe, 2, dir.path());
    let (dense, experts) = run(configs[0].1.clone());
    for (name, config) in &configs[1..] {
        let other = run(config.clone());
        assert!((&dense, &experts) == (&other.0, &other.1), "{name}");
    }
    let ref_experts: Vec<f32> = reference
        .experts
        .iter()
        .flatten()
        .flat_map(|e| e.params.clone())
        .collect();
    for (what, a, b) in [
        ("dense", &dense, &reference.dense),
        ("experts", &experts, &ref_experts),
    ] {
        let worst = a
            .iter()
            .zip(b.iter())
            .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1e-3))
            .fold(0.0f32, f32::max);
        eprintln!("language model {what}: worst relative difference {worst:.2e}");
        assert!(worst < 1e-4, "{what}: {worst}");
    }
}
