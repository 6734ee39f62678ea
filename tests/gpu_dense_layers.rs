//! The language model's dense layers with their activations in GPU memory
//! (`CudaOps`) against the same layers on the host (`HostOps`, the plain
//! loops), one forward and backward each, the experts computed on the host
//! in f32 by the same runner on both sides, so that only the dense layers'
//! operations differ. Each family's variant of q, k and v (biases, per-head
//! and whole-projection norms, the clamp, a partial rotary) runs its own
//! kernels. Cases skip without a CUDA device (fail under
//! `STRATA_REQUIRE_CUDA=1`), and contain only that skip without
//! `--features cuda`.

mod common;

/// Norm-wise relative difference of `got` from `want`.
#[cfg(feature = "cuda")]
fn relative(got: &[f32], want: &[f32]) -> f64 {
    let norm = want.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    let diff = got
        .iter()
        .zip(want)
        .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    if norm == 0.0 {
        diff
    } else {
        diff / norm
    }
}

/// Every dense tensor's gradient, every expert's gradient and the loss
/// agree within 1e-4 norm-wise. Both sides compute in f32: the kernels
/// sum in the cpu's order with fused multiply-adds off, and the GEMMs (f32
/// in, f32 accumulation) differ from the plain loops only in the order of
/// their sums over K ≤ 64 terms, a few f32 ulps (6e-8 each) a value that
/// grow through two layers' backward to ~1e-6 norm-wise. A wrong factor
/// or a dropped term is O(1); 1e-4 leaves a 100× margin above rounding.
#[cfg(feature = "cuda")]
#[test]
fn the_dense_layers_on_the_gpu_compute_the_gradients_of_the_host() {
    use common::tiny_lm::tiny_config;
    use strata::backend::cuda::CudaBackend;
    use strata::backend::BackendKind;
    use strata::lm::{Family, LmConfig, MoeLm, QkNorm, TokenBatch};
    use strata::model::{DenseKernels, Network, PlainKernels};
    use strata::reference::{MemoryRunner, ReferenceTrainer};

    if let Err(e) = BackendKind::Cuda.check(0..1, strata_tiers::Dtype::Bf16) {
        common::cuda_case_skipped(e);
        return;
    }
    let gpu = CudaBackend::new(0, strata::backend::DenseGemm::F32).unwrap();
    let variants: Vec<(&str, LmConfig)> = vec![
        ("mixtral", tiny_config()),
        (
            "qwen2-moe's q, k, v biases and shared expert",
            LmConfig {
                family: Family::Qwen2Moe,
                qkv_bias: true,
                shared_expert_ff: 8,
                ..tiny_config()
            },
        ),
        (
            "qwen3-moe's per-head q, k norms and a dense layer",
            LmConfig {
                family: Family::Qwen3Moe,
                qk_norm: QkNorm::PerHead,
                dense_layers: vec![0],
                dense_ff: 20,
                ..tiny_config()
            },
        ),
        (
            "olmoe's whole q, k norms and clamp",
            LmConfig {
                family: Family::Olmoe,
                qk_norm: QkNorm::Whole,
                clip_qkv: Some(0.4),
                ..tiny_config()
            },
        ),
        (
            "a partial rotary",
            LmConfig {
                partial_rotary: 0.5,
                ..tiny_config()
            },
        ),
    ];
    // Ids repeat (the embedding's gradient sums several rows into one),
    // a loss mask leaves a few targets out (split on the GPU), and each
    // row packs two documents apart (their starts found on the GPU).
    let batch = TokenBatch {
        seq_len: 8,
        tokens: (0..3 * 9u32).map(|i| (i * 37 + 5) % 250 % 11).collect(),
        loss_mask: Some((0..3 * 9).map(|p| p % 4 != 2).collect()),
        doc_starts: Some((0..3 * 9).map(|p| p % 9 == 0 || p % 9 == 4).collect()),
    };
    for (name, config) in variants {
        let lm = MoeLm::new(config).unwrap();
        let trainer = ReferenceTrainer::new_network(&lm, Default::default()).unwrap();
        let dense = trainer.dense.clone();
        let tokens = lm.batch_tokens(&batch);
        let run = |kernels: &dyn DenseKernels| {
            let mut experts = trainer.experts.clone();
            let mut grad = vec![0.0f32; dense.len()];
            kernels.weights_changed(&dense);
            kernels.grads_begin(&grad);
            let mut runner = MemoryRunner::new(lm.moe(), &mut experts);
            let losses = lm
                .forward_backward(
                    &dense,
                    &mut grad,
                    &batch,
                    tokens,
                    1,
                    true,
                    &mut runner,
                    kernels,
                )
                .unwrap();
            kernels.grads_flush(&mut grad).unwrap();
            let expert_grads: Vec<Vec<f32>> =
                experts.iter().flatten().map(|e| e.grad.clone()).collect();
            (losses.total, grad, expert_grads)
        };
        let (host_loss, host_grad, host_experts) = run(&PlainKernels);
        let before = gpu.pcie_other_bytes();
        let (gpu_loss, gpu_grad, gpu_experts) = run(&gpu);
        let copied = gpu.pcie_other_bytes() - before;
        // The same kernels with the activations on the host, copied up
        // and down around each call.
        let before = gpu.pcie_other_bytes();
        let (resident_loss, ..) = run(&HostResident(&gpu as &dyn DenseKernels));
        let copied_host_resident = gpu.pcie_other_bytes() - before;
        assert!(((resident_loss - host_loss) / host_loss).abs() < 1e-5);
        assert!(
            copied < copied_host_resident,
            "{name}: {copied} bytes crossed, {copied_host_resident} with activations on the host"
        );
        let loss_diff = ((gpu_loss - host_loss) / host_loss).abs() as f64;
        assert!(
            loss_diff < 1e-5,
            "{name}: loss {gpu_loss} against {host_loss}"
        );
        let mut worst = (0.0f64, String::new());
        for t in lm.tensors() {
            let (g, h) = (&gpu_grad[t.range.clone()], &host_grad[t.range.clone()]);
            let rel = relative(g, h);
            assert!(
                rel < 1e-4,
                "{name}: {} is {rel:.2e} from the host's",
                t.name
            );
            assert!(
                h.iter().any(|&x| x != 0.0) || t.name.contains("correction_bias"),
                "{name}: {} has no gradient on the host",
                t.name
            );
            if rel > worst.0 {
                worst = (rel, t.name.clone());
            }
        }
        for (i, (g, h)) in gpu_experts.iter().zip(&host_experts).enumerate() {
            let rel = relative(g, h);
            assert!(
                rel < 1e-4,
                "{name}: expert {i} is {rel:.2e} from the host's"
            );
        }
        eprintln!(
            "dense layers on the gpu vs the host, {name}: worst {:.2e} ({}); \
             {copied} bytes crossed PCIe, {copied_host_resident} with the activations on the host",
            worst.0, worst.1
        );
    }
}

/// The engine on a GPU, its MoE blocks on the device (the router's
/// logits, the permutation, the experts reading and writing rows in GPU
/// memory, the combine), against the same engine with every activation
/// on the host: one batch's gradients, every dense tensor and every
/// expert's, within 1e-4 norm-wise. Both run the same bf16 expert GEMMs
/// on the same inputs, so they differ only where f32 sums run in another
/// order (the router's logits on cuBLAS rather than the host's cores);
/// a wrong row, weight or factor in the device path is O(1). Fewer bytes
/// cross PCIe a step. The dense GEMMs take f32 here: with bf16 inputs a
/// value one f32 ulp apart on the two sides can round to neighbouring
/// bf16 values, a 2⁻⁸ change the backward carries into every gradient
/// below it (up to 1.9e-3 on layer 0 with top-3 routing, against 3.3e-7
/// with f32 inputs), which would hide a small wrong term. The bf16 dense
/// GEMMs have their own tests (`tests/backend.rs`, `tests/gpu_attention.rs`).
#[cfg(feature = "cuda")]
#[test]
fn the_engine_s_moe_blocks_on_the_gpu_compute_the_gradients_of_the_host() {
    use common::tiny_lm::tiny_config;
    use strata::backend::BackendKind;
    use strata::engine::{Engine, EngineConfig};
    use strata::lm::{AuxLoss, Family, LmConfig, MoeLm, TokenBatch};
    use strata::math::Scoring;

    if let Err(e) = BackendKind::Cuda.check(0..1, strata_tiers::Dtype::Bf16) {
        common::cuda_case_skipped(e);
        return;
    }
    let batch = TokenBatch {
        seq_len: 8,
        tokens: (0..4 * 9u32).map(|i| (i * 37 + 5) % 250).collect(),
        loss_mask: None,
        doc_starts: None,
    };
    let variants = [
        ("mixtral, top-2", tiny_config()),
        (
            "qwen2-moe's shared expert, top-1",
            LmConfig {
                family: Family::Qwen2Moe,
                qkv_bias: true,
                shared_expert_ff: 8,
                top_k: 1,
                ..tiny_config()
            },
        ),
        (
            "a load-balancing loss over every layer, and a z-loss, top-3",
            LmConfig {
                top_k: 3,
                aux_loss: AuxLoss::AllLayers,
                aux_loss_coef: 0.05,
                z_loss_coef: 0.01,
                ..tiny_config()
            },
        ),
        (
            "glm-4.5's sigmoid router, groups of 2, one kept",
            LmConfig {
                family: Family::Glm4Moe,
                scoring: Scoring::SigmoidGrouped {
                    groups: 2,
                    kept_groups: 1,
                    scale: 2.5,
                },
                aux_loss_coef: 0.0,
                ..tiny_config()
            },
        ),
    ];
    for (name, config) in variants {
        let lm = MoeLm::new(config).unwrap();
        let config = EngineConfig {
            backend: BackendKind::Cuda,
            micro_batches: 2,
            optimizer_threads: 2,
            dense_gemm: strata::backend::DenseGemm::F32,
            ..EngineConfig::default()
        };
        let mut device = Engine::new_network(&lm, config.clone()).unwrap();
        let mut host = Engine::new_network(&lm, config).unwrap();
        let on_device = device.gradients(&lm, &batch).unwrap();
        let on_host = host.gradients(&HostActivations(&lm), &batch).unwrap();
        let loss_diff = ((on_device.loss - on_host.loss) / on_host.loss).abs();
        assert!(
            loss_diff < 1e-5,
            "{name}: loss {} against {}",
            on_device.loss,
            on_host.loss
        );
        let mut worst = (0.0f64, String::new());
        for t in lm.tensors() {
            let rel = relative(
                &on_device.dense[t.range.clone()],
                &on_host.dense[t.range.clone()],
            );
            assert!(
                rel < 1e-4,
                "{name}: {} is {rel:.2e} from the host's",
                t.name
            );
            if rel > worst.0 {
                worst = (rel, t.name.clone());
            }
        }
        let mut experts = 0;
        for (l, layer) in on_device.experts.iter().enumerate() {
            for (e, g) in layer.iter().enumerate() {
                let h = &on_host.experts[l][e];
                assert_eq!(
                    g.is_some(),
                    h.is_some(),
                    "{name}: expert {l}.{e} routed on one side only"
                );
                if let (Some(g), Some(h)) = (g, h) {
                    let rel = relative(g, h);
                    assert!(
                        rel < 1e-4,
                        "{name}: expert {l}.{e} is {rel:.2e} from the host's"
                    );
                    experts += 1;
                }
            }
        }
        assert!(experts > 0);
        let step_device = device.step_network(&lm, &batch).unwrap().bytes_pcie_other;
        let step_host = host
            .step_network(&HostActivations(&lm), &batch)
            .unwrap()
            .bytes_pcie_other;
        assert!(
            step_device < step_host,
            "{name}: {step_device} bytes crossed a step, {step_host} with activations on the host"
        );
        eprintln!(
            "the engine's moe blocks on the gpu vs the host, {name}: worst {:.2e} ({}), \
             {experts} experts; {step_device} bytes crossed a step, {step_host} with the \
             activations on the host",
            worst.0, worst.1
        );
    }
}

/// A GPU's dense kernels with the activations on the host: each call
/// uploads its operands and downloads its results (the network runs on
/// `HostOps`, as it does for any kernels that name no GPU).
#[cfg(feature = "cuda")]
struct HostResident<'a>(&'a dyn strata::model::DenseKernels);

/// The language model with its activations on the host whatever the
/// engine's kernels: every call goes through [`HostResident`].
#[cfg(feature = "cuda")]
struct HostActivations<'a>(&'a strata::lm::MoeLm);

#[cfg(feature = "cuda")]
mod host_resident {
    use super::{HostActivations, HostResident};
    use strata::lm::TokenBatch;
    use strata::math::attention::AttnShape;
    use strata::model::{DenseKernels, Evaluation, ExpertRunner, HeadShape, Losses};
    use strata::model::{ModelConfig, Network};
    use strata::EngineError;

    impl Network for HostActivations<'_> {
        type Batch = TokenBatch;
        fn moe(&self) -> &ModelConfig {
            self.0.moe()
        }
        fn dense_params(&self) -> usize {
            self.0.dense_params()
        }
        fn init_dense(&self) -> Vec<f32> {
            self.0.init_dense()
        }
        fn validate_batch(&self, batch: &TokenBatch) -> Result<(), EngineError> {
            self.0.validate_batch(batch)
        }
        fn batch_tokens(&self, batch: &TokenBatch) -> usize {
            self.0.batch_tokens(batch)
        }
        fn processed_tokens(&self, batch: &TokenBatch) -> usize {
            self.0.processed_tokens(batch)
        }
        fn split_batch(&self, batch: &TokenBatch, n: usize) -> Vec<TokenBatch> {
            self.0.split_batch(batch, n)
        }
        fn frozen_dense(&self) -> Vec<std::ops::Range<usize>> {
            self.0.frozen_dense()
        }
        fn forward_backward(
            &self,
            dense: &[f32],
            dense_grad: &mut [f32],
            batch: &TokenBatch,
            tokens_total: usize,
            micro_batches: usize,
            last_micro_batch: bool,
            runner: &mut dyn ExpertRunner,
            kernels: &dyn DenseKernels,
        ) -> Result<Losses, EngineError> {
            self.0.forward_backward(
                dense,
                dense_grad,
                batch,
                tokens_total,
                micro_batches,
                last_micro_batch,
                runner,
                &HostResident(kernels),
            )
        }
        fn forward_eval(
            &self,
            dense: &[f32],
            batch: &TokenBatch,
            runner: &mut dyn ExpertRunner,
            kernels: &dyn DenseKernels,
        ) -> Result<Evaluation, EngineError> {
            self.0
                .forward_eval(dense, batch, runner, &HostResident(kernels))
        }
    }

    impl DenseKernels for HostResident<'_> {
        fn narrow_kernels(&self) -> &dyn DenseKernels {
            self.0.narrow_kernels()
        }
        fn forward(
            &self,
            out: &mut [f32],
            x: &[f32],
            w: &[f32],
            m: usize,
            k: usize,
            n: usize,
        ) -> Result<(), EngineError> {
            self.0.forward(out, x, w, m, k, n)
        }
        fn backward(
            &self,
            dx: &mut [f32],
            dw: &mut [f32],
            dout: &[f32],
            x: &[f32],
            w: &[f32],
            m: usize,
            k: usize,
            n: usize,
        ) -> Result<(), EngineError> {
            self.0.backward(dx, dw, dout, x, w, m, k, n)
        }
        fn weights_changed(&self, dense: &[f32]) {
            self.0.weights_changed(dense)
        }
        fn grads_begin(&self, grad: &[f32]) {
            self.0.grads_begin(grad)
        }
        fn grads_flush(&self, grad: &mut [f32]) -> Result<(), EngineError> {
            self.0.grads_flush(grad)
        }
        fn attention_saved_len(&self, shape: &AttnShape) -> usize {
            self.0.attention_saved_len(shape)
        }
        fn attention_forward(
            &self,
            out: &mut [f32],
            saved: &mut [f32],
            q: &[f32],
            k: &[f32],
            v: &[f32],
            starts: Option<&[u32]>,
            shape: &AttnShape,
        ) -> Result<(), EngineError> {
            self.0.attention_forward(out, saved, q, k, v, starts, shape)
        }
        fn attention_backward(
            &self,
            dq: &mut [f32],
            dk: &mut [f32],
            dv: &mut [f32],
            dout: &[f32],
            saved: &[f32],
            q: &[f32],
            k: &[f32],
            v: &[f32],
            starts: Option<&[u32]>,
            shape: &AttnShape,
        ) -> Result<(), EngineError> {
            self.0
                .attention_backward(dq, dk, dv, dout, saved, q, k, v, starts, shape)
        }
        fn head_loss(
            &self,
            dx: &mut [f32],
            dhead: &mut [f32],
            x: &[f32],
            head: &[f32],
            targets: &[u32],
            s: HeadShape,
        ) -> Result<f32, EngineError> {
            self.0.head_loss(dx, dhead, x, head, targets, s)
        }
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn the_dense_layers_on_the_gpu_compute_the_gradients_of_the_host() {
    common::cuda_case_skipped("built without --features cuda");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn the_engine_s_moe_blocks_on_the_gpu_compute_the_gradients_of_the_host() {
    common::cuda_case_skipped("built without --features cuda");
}
