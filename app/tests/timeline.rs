//! An engine given a timeline (`EngineConfig::timeline`) records its step,
//! each layer's expert loops in order, the SSD calls that stream its
//! records and each expert's update; `bench step` reads where the SSD sat
//! idle from it.

mod common;

use std::sync::Arc;

use common::{batch, hyper, model, record_bytes};
use strata::engine::{Engine, EngineConfig, ScheduleKind};
use strata::math::ExpertKind;
use strata_cli::bench::step::StepPhases;
use strata_tiers::{Dtype, ExpertId, Timeline, TimelineEvent};

fn engine(dir: &std::path::Path, schedule: ScheduleKind, timeline: Arc<Timeline>) -> Engine {
    let model = model(2, ExpertKind::SwiGlu);
    let expert_bytes = (model.expert_params() * 4) as u64;
    Engine::new(
        model.clone(),
        EngineConfig {
            store_path: Some(dir.join(format!("{schedule:?}.strata"))),
            device_budget_bytes: 2 * expert_bytes,
            // 4 of the 16 records: every step streams most of them.
            host_budget_bytes: 4 * record_bytes(&model),
            compute_dtype: Dtype::F32,
            hyper: hyper(),
            optimizer_threads: 2,
            schedule,
            timeline: Some(timeline),
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

fn named<'a>(events: &'a [TimelineEvent], category: &str, name: &str) -> Vec<&'a TimelineEvent> {
    events
        .iter()
        .filter(|e| e.category == category && e.name == name)
        .collect()
}

#[test]
fn a_step_records_its_loops_its_ssd_calls_and_its_updates() {
    let dir = tempfile::tempdir().unwrap();
    for schedule in [ScheduleKind::ExpertWise, ScheduleKind::Naive] {
        let timeline = Arc::new(Timeline::new(4096));
        let mut engine = engine(dir.path(), schedule, Arc::clone(&timeline));
        let model = model(2, ExpertKind::SwiGlu);
        engine.step(&batch(&model, 0)).unwrap();
        engine.drain().unwrap();
        timeline.take(); // the first step's
        let metrics = engine.step(&batch(&model, 1)).unwrap();
        engine.drain().unwrap(); // its last updates
        let record = timeline.take();
        assert_eq!(record.dropped, 0);
        let events = &record.events;

        let steps = named(events, "step", "step");
        assert_eq!(steps.len(), 1, "{schedule:?}");
        let step = steps[0];
        assert!((step.duration.as_secs_f64() - metrics.wall_s).abs() < 0.05);

        // One loop a layer each way: forward 0..L-1, then backward L-1..0.
        let loops: Vec<&TimelineEvent> =
            events.iter().filter(|e| e.category == "experts").collect();
        let order: Vec<String> = loops
            .iter()
            .map(|e| format!("{} {}", e.name, &e.detail[..7]))
            .collect();
        assert_eq!(
            order,
            [
                "forward layer 0",
                "forward layer 1",
                "backward layer 1",
                "backward layer 0"
            ],
            "{schedule:?}"
        );
        for pair in loops.windows(2) {
            assert!(pair[0].end() <= pair[1].start, "{pair:?}");
        }
        assert!(loops
            .iter()
            .all(|e| step.start <= e.start && e.end() <= step.end()));

        // Records stream through 4 host slots, so the SSD is read and
        // written, and what it moved adds up to the step's counters.
        let reads = named(events, "ssd", "read");
        let writes = named(events, "ssd", "write");
        assert!(!reads.is_empty() && !writes.is_empty(), "{schedule:?}");
        assert!(metrics.bytes_ssd_to_host > 0 && metrics.bytes_host_to_ssd > 0);

        // Every update names an expert of the model.
        let updates = named(events, "optimizer", "update");
        assert!(!updates.is_empty(), "{schedule:?}");
        for u in &updates {
            let (layer, index) = u.detail.split_once('.').unwrap();
            let id = ExpertId::new(layer.parse().unwrap(), index.parse().unwrap());
            assert!(id.layer < 2 && id.index < model.experts as u32, "{id}");
        }

        // The phases cover the step, and the SSD idles at most all of each.
        let phases = StepPhases::of(events).unwrap();
        let total = phases.forward_s + phases.turn_s + phases.backward_s;
        assert!(
            (total - step.duration.as_secs_f64()).abs() < 1e-6,
            "{phases:?}"
        );
        assert!(phases.ssd_idle_forward_s <= phases.forward_s + 1e-9);
        assert!(phases.ssd_idle_turn_s <= phases.turn_s + 1e-9);
        assert!(phases.ssd_idle_backward_s <= phases.backward_s + 1e-9);
        let idle = phases.ssd_idle_forward_s + phases.ssd_idle_turn_s + phases.ssd_idle_backward_s;
        assert!(
            idle < total,
            "the SSD was busy some of the step: {phases:?}"
        );
    }
}

/// A language model's step records its dense kernels too (category
/// "dense"): every GEMM, attention each way and the head with its loss, on
/// the thread that runs them, inside the step.
#[test]
fn a_language_model_step_records_its_dense_kernels() {
    use strata::lm::{LmConfig, MoeLm, TokenBatch};
    let lm = MoeLm::new(LmConfig::preset("tiny").unwrap()).unwrap();
    let timeline = Arc::new(Timeline::new(4096));
    let config = EngineConfig {
        optimizer_threads: 2,
        timeline: Some(Arc::clone(&timeline)),
        ..EngineConfig::default()
    };
    let mut engine = Engine::new_network(&lm, config).unwrap();
    let batch = TokenBatch {
        seq_len: 16,
        tokens: (0..4 * 17u32).map(|i| (i * 37 + 5) % 250).collect(),
        loss_mask: None,
        doc_starts: None,
    };
    engine.step_network(&lm, &batch).unwrap();
    let events = timeline.take().events;
    let layers = lm.config().layers;
    let count = |name: &str| named(&events, "dense", name).len();
    // Per layer: the q, k, v and o projections (the router's small GEMM
    // is the host's own), and their backwards.
    assert_eq!(count("gemm"), 4 * layers, "{events:#?}");
    assert_eq!(count("gemm backward"), 4 * layers);
    assert_eq!(count("attention"), layers);
    assert_eq!(count("attention backward"), layers);
    assert_eq!(count("head and loss"), 1);
    let step = &named(&events, "step", "step")[0];
    for e in events.iter().filter(|e| e.category == "dense") {
        assert!(e.start >= step.start && e.end() <= step.end(), "{e:?}");
        assert_eq!(e.thread, step.thread);
    }
    assert_eq!(
        named(&events, "dense", "head and loss")[0].detail,
        "64×64×256"
    );
}
