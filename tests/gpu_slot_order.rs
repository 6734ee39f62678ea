//! On a GPU the expert slots are ordered on the device, not by the host:
//! an expert's compute waits there for its slot's upload, and the next
//! upload into the slot waits there for that compute's reads, so the host
//! queues expert after expert without joining any. Experts computed from
//! two slots, refilled all through the step, must give the same bits as
//! experts that stay in slots of their own, and so must one slot refilled
//! for every expert with two host records. The CPU model of the driver
//! can delay every upload, or every kernel, in its stream's turn: a
//! compute that does not wait for its upload then reads the slot's
//! previous expert, and an upload that does not wait for the compute
//! overwrites the expert under it, every time rather than by chance. (On a
//! GPU, which has no such delays, the cases run as they are.) Every expert
//! that got tokens in a step is stepped once for it: an expert's gradient
//! is taken from the GPU one expert late, and none is left behind. An
//! expert's gradient of the last micro-batch comes down into a page-locked
//! buffer while the optimizer's worker waits for it (and adds it onto the
//! earlier micro-batches' sum): slow copies make a worker that does not
//! wait read the buffer's last gradient. Experts computed a group at a
//! time (each product of the group one grouped GEMM, the group's uploads
//! all waited for by its compute) give the same bits as one at a time.
//! Cases skip
//! without a CUDA device (fail under `STRATA_REQUIRE_CUDA=1`), and contain
//! only that skip without `--features cuda`.

mod common;

#[cfg(feature = "cuda")]
mod on_the_gpu {
    use super::common;
    use common::tiny_lm::{tiny_batch as batch, tiny_config};
    use std::sync::Arc;
    use strata::backend::BackendKind;
    use strata::engine::{Engine, EngineConfig};
    use strata::lm::{LmConfig, MoeLm};
    use strata_optim::AdamWHyper;
    use strata_tiers::{Dtype, Timeline};

    fn available() -> bool {
        match BackendKind::Cuda.check(0..1, Dtype::Bf16) {
            Ok(()) => true,
            Err(e) => {
                common::cuda_case_skipped(e);
                false
            }
        }
    }

    /// Sets the driver model's delays (microseconds a copy, a kernel);
    /// false on a GPU, whose driver has no such call.
    fn set_delays(copies_us: u32, compute_us: u32) -> bool {
        // SAFETY: opens the CUDA driver library the engine has loaded (the
        // same object, by the same name); the function looked up takes two
        // unsigned ints and returns nothing, as tests/fake_cuda declares it.
        unsafe {
            let Ok(lib) = libloading::Library::new("libcuda.so") else {
                return false;
            };
            let Ok(set) = lib.get::<unsafe extern "C" fn(u32, u32)>(b"strata_fake_cuda_set_delays")
            else {
                return false;
            };
            set(copies_us, compute_us);
        }
        true
    }

    /// 8 experts a layer, so that two slots are refilled many times a pass.
    fn config() -> LmConfig {
        LmConfig {
            experts: 8,
            ..tiny_config()
        }
    }

    /// What a case's 3 steps gave.
    struct Ran {
        losses: Vec<f32>,
        /// Every expert's params at the end.
        experts: Vec<f32>,
        /// Updates whose worker waited for their gradient to come down.
        arrivals: usize,
    }

    /// 3 steps with `slots` device slots of `dtype` compute params, every
    /// record in host memory or, with `host_records`, that many (the rest
    /// streaming), in `micro_batches`, the experts computed one at a time.
    fn run(
        lm: &MoeLm,
        dtype: Dtype,
        slots: u64,
        host_records: Option<u64>,
        micro_batches: usize,
    ) -> Ran {
        run_grouped(lm, dtype, (slots, 1), host_records, micro_batches)
    }

    /// [`run`] with the experts computed `group` at a time (each of their
    /// products one grouped GEMM), which the engine must take.
    fn run_grouped(
        lm: &MoeLm,
        dtype: Dtype,
        (slots, group): (u64, usize),
        host_records: Option<u64>,
        micro_batches: usize,
    ) -> Ran {
        let c = lm.config();
        let expert_bytes = (3 * c.d_model * c.d_ff) as u64 * dtype.bytes();
        let record = strata_tiers::Layout {
            layers: c.layers as u32,
            experts_per_layer: c.experts as u32,
            params_per_expert: c.expert_params() as u64,
            compute_dtype: dtype,
            moments: true,
        }
        .record_bytes();
        let defaults = EngineConfig::default();
        let config = EngineConfig {
            backend: BackendKind::Cuda,
            compute_dtype: dtype,
            device_budget_bytes: slots * expert_bytes,
            host_budget_bytes: host_records.map_or(defaults.host_budget_bytes, |n| n * record),
            micro_batches,
            optimizer_threads: 2,
            timeline: Some(Arc::new(Timeline::new(1 << 16))),
            expert_group: Some(group),
            ..defaults
        };
        let timeline = config.timeline.clone().unwrap();
        let mut engine = Engine::new_network(lm, config).unwrap();
        assert_eq!(engine.device_slots() as u64, slots, "{dtype:?}");
        assert_eq!(engine.expert_group(), group, "{dtype:?}, {slots} slots");
        let mut losses = Vec::new();
        // Steps in which each expert got tokens: each is one update of it.
        let mut routed = vec![vec![0u64; c.experts]; c.layers];
        for step in 0..3 {
            let m = engine.step_network(lm, &batch(step)).unwrap();
            losses.push(m.loss);
            // Two slots are refilled every pass, so the host waits for
            // uploads (the pass's last, the one before each staged) and
            // for the experts' compute: each a positive share of the step.
            if slots == 2 {
                let (upload, compute) = (m.stall_upload_s, m.expert_compute_s_per_device[0]);
                assert!(upload > 0.0 && upload < m.wall_s, "{m:?}");
                assert!(compute > 0.0 && compute < m.wall_s, "{m:?}");
            }
            for (row, tokens) in routed.iter_mut().zip(&m.tokens_per_expert) {
                for (n, &t) in row.iter_mut().zip(tokens) {
                    *n += u64::from(t > 0);
                }
            }
        }
        let mut experts = Vec::new();
        for (l, row) in routed.iter().enumerate() {
            for (e, &times) in row.iter().enumerate() {
                let steps = engine.expert_step(l, e).unwrap();
                assert_eq!(steps, times, "{dtype:?}, {slots} slots: expert {l}.{e}");
                experts.extend(engine.expert_params(l, e).unwrap());
            }
        }
        let events = timeline.take().events;
        let arrivals = events.iter().filter(|e| e.name == "gradient lands").count();
        Ran {
            losses,
            experts,
            arrivals,
        }
    }

    #[test]
    fn experts_from_two_refilled_slots_are_the_bits_of_experts_in_slots_of_their_own() {
        if !available() {
            return;
        }
        // A missing wait may as well hang as read the wrong bytes.
        let bound = std::time::Duration::from_secs(600);
        common::bounded("the slot-order runs", bound, slot_order_runs);
    }

    /// A step with AdamW's ε far above every gradient element keeps the
    /// gradient's scale (the first step moves each param by
    /// lr · g / (|g| + ε)), so the params it leaves show the gradient it
    /// applied: each expert's, summed over its micro-batches, as the
    /// gradient-only pass computes it. A micro-batch's gradient dropped or
    /// counted twice fails it.
    #[test]
    fn a_step_applies_each_experts_gradient_summed_over_its_micro_batches() {
        if !available() {
            return;
        }
        let bound = std::time::Duration::from_secs(600);
        common::bounded("the micro-batch sums", bound, micro_batch_sums);
    }

    fn micro_batch_sums() {
        let lm = MoeLm::new(config()).unwrap();
        let c = lm.config();
        let expert_bytes = (3 * c.d_model * c.d_ff) as u64 * 2;
        let hyper = AdamWHyper {
            lr: 1.0,
            eps: 1.0,
            weight_decay: 0.0,
            ..AdamWHyper::default()
        };
        for micro_batches in [1, 2, 4] {
            let config = EngineConfig {
                backend: BackendKind::Cuda,
                device_budget_bytes: 2 * expert_bytes,
                micro_batches,
                hyper,
                ..EngineConfig::default()
            };
            let mut engine = Engine::new_network(&lm, config).unwrap();
            let grads = engine.gradients(&lm, &batch(0)).unwrap();
            let mut before = Vec::new();
            for (l, row) in grads.experts.iter().enumerate() {
                for e in 0..row.len() {
                    before.push(engine.expert_params(l, e).unwrap());
                }
            }
            engine.step_network(&lm, &batch(0)).unwrap();
            let mut stepped = 0;
            for (l, row) in grads.experts.iter().enumerate() {
                for (e, g) in row.iter().enumerate() {
                    let Some(g) = g else { continue };
                    let after = engine.expert_params(l, e).unwrap();
                    let was = &before[l * row.len() + e];
                    let (mut err, mut norm) = (0.0f64, 0.0f64);
                    for ((a, b), g) in after.iter().zip(was).zip(g) {
                        let want = -(hyper.lr * g / (g.abs() + hyper.eps)) as f64;
                        err += (f64::from(a - b) - want).powi(2);
                        norm += want * want;
                    }
                    // f32 params near 0.1 round each move to ~1e-8, against
                    // moves summing to a norm above 1e-4.
                    let rel = (err / norm).sqrt();
                    let at = format!("{micro_batches} micro-batches, expert {l}.{e}");
                    assert!(norm.sqrt() > 1e-4, "{at}: a gradient too small to see");
                    assert!(rel < 1e-3, "{at}: moved {rel:.2e} off its gradient");
                    stepped += 1;
                }
            }
            assert!(
                stepped >= 3,
                "{micro_batches} micro-batches: {stepped} experts"
            );
        }
    }

    fn slot_order_runs() {
        let lm = MoeLm::new(config()).unwrap();
        let all = (config().layers * config().experts) as u64;
        for dtype in [Dtype::Bf16, Dtype::F32] {
            set_delays(0, 0);
            let own = run(&lm, dtype, all, None, 2);
            let mut cases = vec![
                ("two slots", run(&lm, dtype, 2, None, 2)),
                // Groups of 3 of a layer's 8 experts (3, 3, 2 a pass), each
                // product one grouped GEMM, from 6 slots refilled all
                // through the step; all 8 of a layer in one group; groups
                // of 2 with 4 host records, the rest streaming.
                ("groups of 3", run_grouped(&lm, dtype, (6, 3), None, 2)),
                ("groups of 8", run_grouped(&lm, dtype, (all, 8), None, 2)),
                (
                    "groups of 2, four host records",
                    run_grouped(&lm, dtype, (4, 2), Some(4), 2),
                ),
                // The least a plan allows: one device slot, refilled for
                // every expert, and two host records, the rest streaming
                // (an update's record then needs the slot an upload in
                // flight pins, until the host has waited for it).
                ("one slot, two host records", run(&lm, dtype, 1, Some(2), 2)),
                (
                    "two slots, two host records",
                    run(&lm, dtype, 2, Some(2), 2),
                ),
            ];
            // Slow copies: a compute that does not wait reads the slot's
            // last expert (or, in a slot of its own, nothing yet).
            if set_delays(3000, 0) {
                cases.push(("two slots, slow copies", run(&lm, dtype, 2, None, 2)));
                let groups = run_grouped(&lm, dtype, (6, 3), None, 2);
                cases.push(("groups of 3, slow copies", groups));
                cases.push(("own slots, slow copies", run(&lm, dtype, all, None, 2)));
                let one = run(&lm, dtype, 1, Some(2), 2);
                cases.push(("one slot, two host records, slow copies", one));
                // Slow kernels: an upload that does not wait for the
                // compute still reading its slot overwrites that expert.
                set_delays(0, 300);
                cases.push(("two slots, slow kernels", run(&lm, dtype, 2, None, 2)));
                let groups = run_grouped(&lm, dtype, (6, 3), None, 2);
                cases.push(("groups of 3, slow kernels", groups));
                let one = run(&lm, dtype, 1, Some(2), 2);
                cases.push(("one slot, two host records, slow kernels", one));
                set_delays(0, 0);
            }
            let two = same_bits(dtype, &own, &cases);
            let one = one_micro_batch(&lm, dtype);
            eprintln!(
                "gpu slot order, {dtype:?}: {} runs in two micro-batches and {} in one \
                 the same bits as slots of their own; gradients waited for by their \
                 updates {two:?} and {one:?}",
                two.len(),
                one.len()
            );
        }
    }

    /// Checks each case against `own`; returns each case's count of
    /// updates that waited for their gradient.
    fn same_bits(dtype: Dtype, own: &Ran, cases: &[(&str, Ran)]) -> Vec<usize> {
        for (name, ran) in cases {
            assert_eq!(
                ran.losses, own.losses,
                "{dtype:?}, {name}: the losses differ"
            );
            assert!(
                ran.experts == own.experts,
                "{dtype:?}, {name}: the experts differ"
            );
            // Three steps route to at least one expert each.
            assert!(
                ran.arrivals >= 3,
                "{dtype:?}, {name}: {} waited",
                ran.arrivals
            );
        }
        cases.iter().map(|(_, ran)| ran.arrivals).collect()
    }

    /// One micro-batch, where no sum waits for a gradient (slow copies and
    /// slow kernels each delay its landing). Returns each case's count of
    /// updates that waited for their gradient.
    fn one_micro_batch(lm: &MoeLm, dtype: Dtype) -> Vec<usize> {
        let all = (config().layers * config().experts) as u64;
        set_delays(0, 0);
        let own = run(lm, dtype, all, None, 1);
        let mut cases = vec![("one micro-batch, two slots", run(lm, dtype, 2, None, 1))];
        if set_delays(3000, 0) {
            let slow = run(lm, dtype, 2, None, 1);
            cases.push(("one micro-batch, two slots, slow copies", slow));
            set_delays(0, 300);
            let slow = run(lm, dtype, 1, Some(2), 1);
            cases.push((
                "one micro-batch, one slot, two host records, slow kernels",
                slow,
            ));
            set_delays(0, 0);
        }
        same_bits(dtype, &own, &cases)
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_cases() {
    common::cuda_case_skipped("built without --features cuda");
}
