//! The dense params kept and stepped on the GPU
//! (`EngineConfig::dense_on_device`, the default with one GPU) against the
//! same engine stepping them on the host (`false`, which downloads the
//! gradient and uploads the params every step). Both start from the
//! gradient the GPU summed, and the GPU's AdamW is the cpu's element
//! update, so every param is the same bits, frozen tensors among them.
//! With clipping the norm's f64 sum runs in another order (in chunks on
//! the GPU), which may move the clip factor by an ulp: within 1e-6. A
//! checkpoint taken with the params on the GPU resumes to the same bits as
//! the run that went on. Where the engine records a timeline, each of
//! the GPU's operations puts its time there (thread `gpu`), within the
//! step and without changing it. Cases skip without a CUDA device (fail under
//! `STRATA_REQUIRE_CUDA=1`), and contain only that skip without
//! `--features cuda`.

mod common;

#[cfg(feature = "cuda")]
mod on_the_gpu {
    use super::common;
    use common::tiny_lm::{tiny_batch as batch, tiny_config};
    use strata::backend::BackendKind;
    use strata::engine::{Engine, EngineConfig, ScheduleKind};
    use strata::lm::{MoeLm, TensorGroup};

    fn config(dense_on_device: bool) -> EngineConfig {
        EngineConfig {
            backend: BackendKind::Cuda,
            micro_batches: 2,
            optimizer_threads: 2,
            dense_on_device,
            ..EngineConfig::default()
        }
    }

    struct Run {
        dense: Vec<f32>,
        experts: Vec<f32>,
        losses: Vec<f32>,
        norms: Vec<Option<f64>>,
    }

    fn steps(engine: &mut Engine, lm: &MoeLm, range: std::ops::Range<u32>) -> Run {
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for step in range {
            let m = engine.step_network(lm, &batch(step)).unwrap();
            losses.push(m.loss);
            norms.push(m.grad_norm);
        }
        let c = lm.config();
        let mut experts = Vec::new();
        for l in 0..c.layers {
            for e in 0..c.experts {
                experts.extend(engine.expert_params(l, e).unwrap());
            }
        }
        Run {
            dense: engine.dense_params().unwrap().to_vec(),
            experts,
            losses,
            norms,
        }
    }

    fn run(lm: &MoeLm, config: EngineConfig, n: u32) -> Run {
        let mut engine = Engine::new_network(lm, config).unwrap();
        steps(&mut engine, lm, 0..n)
    }

    /// The held-out loss on the GPU (`Engine::evaluate`: the head's loss a
    /// block of rows at a time, the shares summed on the device) against
    /// `Engine::forward`'s, from every logit brought to the host: the same
    /// cross-entropy summed in another precision, within 1e-5.
    #[test]
    fn the_held_out_loss_is_the_whole_forward_s() {
        if !available() {
            return;
        }
        let lm = MoeLm::new(tiny_config()).unwrap();
        let mut engine = Engine::new_network(&lm, config(true)).unwrap();
        steps(&mut engine, &lm, 0..2);
        let b = batch(9);
        let whole = engine.forward(&lm, &b).unwrap().loss;
        let held_out = engine.evaluate(&lm, &b).unwrap();
        assert!(
            (held_out - whole).abs() <= 1e-5 * whole.abs(),
            "{held_out} vs {whole}"
        );
    }

    fn available() -> bool {
        match BackendKind::Cuda.check(0..1, strata_tiers::Dtype::Bf16) {
            Ok(()) => true,
            Err(e) => {
                common::cuda_case_skipped(e);
                false
            }
        }
    }

    #[test]
    fn the_gpu_steps_the_dense_params_as_the_host_does() {
        if !available() {
            return;
        }
        let all = MoeLm::new(tiny_config()).unwrap();
        let some = MoeLm::new(tiny_config())
            .unwrap()
            .with_trained(&[TensorGroup::Experts, TensorGroup::Attention]);
        for (name, lm) in [("every tensor trained", all), ("attention alone", some)] {
            let init = Engine::new_network(&lm, config(true))
                .unwrap()
                .dense_params()
                .unwrap()
                .to_vec();
            let kept = run(&lm, config(true), 3);
            let moved = run(&lm, config(false), 3);
            assert_eq!(kept.losses, moved.losses, "{name}");
            assert!(kept.dense == moved.dense, "{name}: the dense params differ");
            assert!(kept.experts == moved.experts, "{name}: the experts differ");
            let changed = kept.dense.iter().zip(&init).filter(|(a, b)| a != b).count();
            let frozen: usize = strata::model::Network::frozen_dense(&lm)
                .iter()
                .map(|r| r.len())
                .sum();
            for r in strata::model::Network::frozen_dense(&lm) {
                assert!(
                    kept.dense[r.clone()] == init[r],
                    "{name}: a frozen tensor moved"
                );
            }
            eprintln!(
                "dense step on the gpu, {name}: {changed} of {} params moved, {frozen} frozen, \
                 the same bits as on the host",
                init.len()
            );
            assert!(changed > 0);
        }
    }

    #[test]
    fn clipping_on_the_gpu_clips_as_the_host_does() {
        if !available() {
            return;
        }
        let lm = MoeLm::new(tiny_config()).unwrap();
        let clipped = |dense_on_device| EngineConfig {
            clip_grad_norm: Some(0.05),
            schedule: ScheduleKind::Naive,
            ..config(dense_on_device)
        };
        let kept = run(&lm, clipped(true), 3);
        let moved = run(&lm, clipped(false), 3);
        // The GPU's norm sums its partials in one order: every run the
        // same bits.
        let again = run(&lm, clipped(true), 3);
        assert_eq!(kept.norms, again.norms);
        assert!(kept.dense == again.dense, "a second run differs");
        let mut worst = 0.0f64;
        for (a, b) in kept.norms.iter().zip(&moved.norms) {
            let (a, b) = (a.unwrap(), b.unwrap());
            assert!(b > 0.05, "the norm {b} is not clipped");
            worst = worst.max((a - b).abs() / b);
        }
        for (a, b) in kept.dense.iter().zip(&moved.dense) {
            worst = worst.max(((a - b).abs() / b.abs().max(1e-3)) as f64);
        }
        eprintln!("clipped dense step on the gpu vs the host: worst {worst:.2e}");
        assert!(worst < 1e-6, "{worst}");
    }

    #[test]
    fn a_checkpoint_of_params_on_the_gpu_resumes_to_the_same_bits() {
        if !available() {
            return;
        }
        let lm = MoeLm::new(tiny_config()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let stored = EngineConfig {
            store_path: Some(dir.path().join("experts.strata")),
            ..config(true)
        };
        let mut on = Engine::new_network(&lm, stored.clone()).unwrap();
        steps(&mut on, &lm, 0..2);
        on.checkpoint().unwrap();
        let went_on = steps(&mut on, &lm, 2..4);
        drop(on);
        let mut resumed = Engine::resume_network(&lm, stored).unwrap();
        let again = steps(&mut resumed, &lm, 2..4);
        assert_eq!(went_on.losses, again.losses);
        assert!(went_on.dense == again.dense, "the dense params differ");
        assert!(went_on.experts == again.experts, "the experts differ");
    }

    #[test]
    fn a_timeline_shows_the_gpu_s_own_time_for_each_operation() {
        if !available() {
            return;
        }
        let lm = MoeLm::new(tiny_config()).unwrap();
        let timeline = std::sync::Arc::new(strata_tiers::Timeline::new(1 << 14));
        let timed = EngineConfig {
            timeline: Some(std::sync::Arc::clone(&timeline)),
            ..config(true)
        };
        let mut engine = Engine::new_network(&lm, timed).unwrap();
        steps(&mut engine, &lm, 0..1);
        timeline.take();
        let with = steps(&mut engine, &lm, 1..2);
        let events = timeline.take().events;
        drop(engine);
        let without = run(&lm, config(true), 2);
        assert_eq!(with.losses, without.losses[1..]);
        assert!(with.dense == without.dense, "a timeline changed the step");

        let step = events.iter().find(|e| e.category == "step").unwrap();
        let gpu: Vec<_> = events.iter().filter(|e| e.thread == "gpu").collect();
        for name in [
            "embedding",
            "rmsnorm",
            "gemm",
            "rope",
            "attention",
            "router",
            "experts",
            "combine",
            "head and loss",
            "experts backward",
            "attention backward",
            "gemm backward",
            "embedding backward",
        ] {
            // Two micro-batches a step: each operation at least twice.
            let n = gpu.iter().filter(|e| e.name == name).count();
            assert!(n >= 2, "{name}: {n} gpu spans");
        }
        for e in &gpu {
            assert_eq!(e.category, "gpu");
            assert!(
                e.start >= step.start && e.end() <= step.end(),
                "{} ({:?} from {:?}) outside the step ({:?} from {:?})",
                e.name,
                e.duration,
                e.start,
                step.duration,
                step.start
            );
        }
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn the_gpu_steps_the_dense_params_as_the_host_does() {
    common::cuda_case_skipped("built without --features cuda");
}
