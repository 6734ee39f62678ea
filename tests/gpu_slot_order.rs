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
//! is taken from the GPU one expert late, and none is left behind. Cases skip
//! without a CUDA device (fail under `STRATA_REQUIRE_CUDA=1`), and contain
//! only that skip without `--features cuda`.

mod common;

#[cfg(feature = "cuda")]
mod on_the_gpu {
    use super::common;
    use common::tiny_lm::{tiny_batch as batch, tiny_config};
    use strata::backend::BackendKind;
    use strata::engine::{Engine, EngineConfig};
    use strata::lm::{LmConfig, MoeLm};
    use strata_tiers::Dtype;

    fn available() -> bool {
        match BackendKind::Cuda.check(0..1, Dtype::Bf16) {
            Ok(()) => true,
            Err(e) => {
                common::cuda_case_skipped(e);
                false
            }
        }
    }

    /// Sets the driver model's delays (microseconds an upload, a kernel);
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

    /// Losses, then every expert's params, after 3 steps with `slots`
    /// device slots of `dtype` compute params, and every record in host
    /// memory or, with `host_records`, that many (the rest streaming).
    fn run(
        lm: &MoeLm,
        dtype: Dtype,
        slots: u64,
        host_records: Option<u64>,
    ) -> (Vec<f32>, Vec<f32>) {
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
            micro_batches: 2,
            optimizer_threads: 2,
            ..defaults
        };
        let mut engine = Engine::new_network(lm, config).unwrap();
        assert_eq!(engine.device_slots() as u64, slots, "{dtype:?}");
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
        (losses, experts)
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

    fn slot_order_runs() {
        let lm = MoeLm::new(config()).unwrap();
        let all = (config().layers * config().experts) as u64;
        for dtype in [Dtype::Bf16, Dtype::F32] {
            set_delays(0, 0);
            let own = run(&lm, dtype, all, None);
            let mut cases = vec![
                ("two slots", run(&lm, dtype, 2, None)),
                // The least a plan allows: one device slot, refilled for
                // every expert, and two host records, the rest streaming
                // (an update's record then needs the slot an upload in
                // flight pins, until the host has waited for it).
                ("one slot, two host records", run(&lm, dtype, 1, Some(2))),
                ("two slots, two host records", run(&lm, dtype, 2, Some(2))),
            ];
            // Slow uploads: a compute that does not wait reads the slot's
            // last expert (or, in a slot of its own, nothing yet).
            if set_delays(3000, 0) {
                cases.push(("two slots, slow uploads", run(&lm, dtype, 2, None)));
                cases.push(("own slots, slow uploads", run(&lm, dtype, all, None)));
                let one = run(&lm, dtype, 1, Some(2));
                cases.push(("one slot, two host records, slow uploads", one));
                // Slow kernels: an upload that does not wait for the
                // compute still reading its slot overwrites that expert.
                set_delays(0, 300);
                cases.push(("two slots, slow kernels", run(&lm, dtype, 2, None)));
                let one = run(&lm, dtype, 1, Some(2));
                cases.push(("one slot, two host records, slow kernels", one));
                set_delays(0, 0);
            }
            for (name, (losses, experts)) in &cases {
                assert_eq!(losses, &own.0, "{dtype:?}, {name}: the losses differ");
                assert!(experts == &own.1, "{dtype:?}, {name}: the experts differ");
            }
            eprintln!(
                "gpu slot order, {dtype:?}: {} runs the same bits as slots of their own",
                cases.len()
            );
        }
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_cases() {
    common::cuda_case_skipped("built without --features cuda");
}
