//! The compute backends against the plain math they implement, written once
//! and stamped per backend: `cpu` always; `cuda` when built with
//! `--features cuda`, skipping with the reason printed when no GPU is
//! present. The CUDA kernels' element-wise references and its AdamW are
//! checked here too.

mod common;
mod kernel_checks;

use common::values;
use strata::backend::CpuBackend;
use strata::math::{expert_ffn_backward, expert_ffn_forward, ExpertKind, ExpertSaved};
use strata::EngineError;

/// The expert FFN on host slices that each backend offers, as these tests
/// drive it (the engine drives `ExpertDevice`, tested below).
trait HostSliceFfn {
    fn name(&self) -> &'static str;
    #[allow(clippy::too_many_arguments)]
    fn expert_ffn_forward(
        &self,
        kind: ExpertKind,
        out: &mut [f32],
        saved: &mut ExpertSaved<f32>,
        x: &[f32],
        params: &[f32],
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError>;
    #[allow(clippy::too_many_arguments)]
    fn expert_ffn_backward(
        &self,
        kind: ExpertKind,
        dx: &mut [f32],
        dparams: &mut [f32],
        dout: &[f32],
        saved: &ExpertSaved<f32>,
        x: &[f32],
        params: &[f32],
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError>;
}

macro_rules! host_slice_ffn {
    ($ty:ty) => {
        impl HostSliceFfn for $ty {
            fn name(&self) -> &'static str {
                <$ty>::name(self)
            }
            fn expert_ffn_forward(
                &self,
                kind: ExpertKind,
                out: &mut [f32],
                saved: &mut ExpertSaved<f32>,
                x: &[f32],
                params: &[f32],
                n: usize,
                d: usize,
                f: usize,
            ) -> Result<(), EngineError> {
                <$ty>::expert_ffn_forward(self, kind, out, saved, x, params, n, d, f)
            }
            fn expert_ffn_backward(
                &self,
                kind: ExpertKind,
                dx: &mut [f32],
                dparams: &mut [f32],
                dout: &[f32],
                saved: &ExpertSaved<f32>,
                x: &[f32],
                params: &[f32],
                n: usize,
                d: usize,
                f: usize,
            ) -> Result<(), EngineError> {
                <$ty>::expert_ffn_backward(self, kind, dx, dparams, dout, saved, x, params, n, d, f)
            }
        }
    };
}

host_slice_ffn!(CpuBackend);
#[cfg(feature = "cuda")]
host_slice_ffn!(strata::backend::cuda::CudaBackend);

fn f32s(n: usize, seed: u64, scale: f64) -> Vec<f32> {
    values(n, seed, scale)
        .into_iter()
        .map(|v| v as f32)
        .collect()
}

/// Largest |a − b| over the largest |b|: a norm-wise relative error.
fn normwise(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-12);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
        / scale
}

/// Rounds to bf16 and back: what a bf16 backend sees of its inputs.
fn bf16_round(x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect()
}

/// An expert's forward and backward through `backend` against the f32
/// reference in `math` (fed the inputs the backend computes with), within
/// `tolerance` norm-wise.
fn expert_matches_reference(backend: &dyn HostSliceFfn, bf16_inputs: bool, tolerance: f32) {
    let (n, d, f) = (37, 48, 80);
    for kind in [ExpertKind::SwiGlu, ExpertKind::Gelu] {
        let x = f32s(n * d, 1, 1.0);
        let params = f32s(kind.params(d, f), 2, 0.15);
        let dout = f32s(n * d, 3, 1.0);
        let (mut out, mut saved) = (vec![0.0; n * d], ExpertSaved::default());
        backend
            .expert_ffn_forward(kind, &mut out, &mut saved, &x, &params, n, d, f)
            .unwrap();
        let mut dx = vec![7.0; n * d]; // overwritten
        let mut dparams = vec![0.5; params.len()]; // accumulated into
        backend
            .expert_ffn_backward(
                kind,
                &mut dx,
                &mut dparams,
                &dout,
                &saved,
                &x,
                &params,
                n,
                d,
                f,
            )
            .unwrap();
        let (rx, rp, rd) = if bf16_inputs {
            (bf16_round(&x), bf16_round(&params), bf16_round(&dout))
        } else {
            (x.clone(), params.clone(), dout.clone())
        };
        let (mut out_ref, mut saved_ref) = (vec![0.0; n * d], ExpertSaved::default());
        expert_ffn_forward(kind, &mut out_ref, &mut saved_ref, &rx, &rp, n, d, f);
        let mut dx_ref = vec![0.0; n * d];
        let mut dparams_ref = vec![0.5; params.len()];
        expert_ffn_backward(
            kind,
            &mut dx_ref,
            &mut dparams_ref,
            &rd,
            &saved_ref,
            &rx,
            &rp,
            n,
            d,
            f,
        );
        // A GPU keeps nothing in `saved` (its backward recomputes the
        // pre-activations); the cpu keeps them, and they must be right.
        let saved_a = [("saved.a", &saved.a, &saved_ref.a)];
        let saved_a = if saved.a.is_empty() && backend.name() == "cuda" {
            &saved_a[..0]
        } else {
            &saved_a[..]
        };
        for &(what, a, b) in [
            ("out", &out, &out_ref),
            ("dx", &dx, &dx_ref),
            ("dparams", &dparams, &dparams_ref),
        ]
        .iter()
        .chain(saved_a)
        {
            let err = normwise(a, b);
            eprintln!(
                "{} {}: {what} norm-wise error {err:.2e}",
                backend.name(),
                kind.name()
            );
            assert!(err < tolerance, "{} {what}: {err}", kind.name());
        }
    }
}

/// Stamps `$body` (a `fn(&dyn HostSliceFfn, is_cuda: bool)`) per backend.
macro_rules! per_backend {
    ($name:ident, $body:expr) => {
        mod $name {
            use super::*;

            #[test]
            fn cpu() {
                let body: fn(&dyn HostSliceFfn, bool) = $body;
                body(&strata::backend::CpuBackend, false);
            }

            #[cfg(feature = "cuda")]
            #[test]
            fn cuda() {
                let body: fn(&dyn HostSliceFfn, bool) = $body;
                match strata::backend::cuda::CudaBackend::new(0, Default::default()) {
                    Err(e) => common::cuda_case_skipped(e),
                    Ok(gpu) => {
                        eprintln!("cuda case on {}", gpu.info.name);
                        body(&gpu, true);
                    }
                }
            }

            #[cfg(not(feature = "cuda"))]
            #[test]
            fn cuda() {
                common::cuda_case_skipped("built without --features cuda");
            }
        }
    };
}

// The cpu backend computes in f32 like the reference, in another summation
// order: a few ulps of each output, 1e-5 norm-wise with a wide margin. The
// cuda backend rounds x, the params, dout and the hidden activations to
// bf16 (2⁻⁹ relative each) and accumulates in f32; against a reference fed
// the same bf16 inputs the hidden rounding dominates: ~2⁻⁹ of the largest
// output, so 1e-2 norm-wise.
per_backend!(expert_ffn_matches_the_math, |backend, is_cuda| {
    let tolerance = if is_cuda { 1e-2 } else { 1e-5 };
    expert_matches_reference(backend, is_cuda, tolerance);
});

/// An engine device computes each expert from the bf16 params in its slot:
/// two experts uploaded into two slots through the device's own tier, each
/// computed from its slot and checked against the reference fed the same
/// bf16 params (so a wrong slot address or layout fails), within the
/// tolerances above. The cpu's f32 GEMMs on the widened params differ from
/// the reference by f32 rounding alone (1e-5); bf16 GEMMs (a GPU's, and
/// the cpu's under `ExpertGemm::Bf16`) round each GEMM's activation or
/// output-gradient input to bf16 (2⁻⁹ relative an element), so that the
/// outputs differ by about 2⁻⁹ norm-wise (1.5–2.1e-3 measured on the cpu):
/// 4e-3 on the cpu, 1e-2 on a GPU (whose GEMMs also sum in another order).
fn device_computes_from_its_slots(
    kind_of_backend: strata::backend::BackendKind,
    gemm: strata::backend::ExpertGemm,
) {
    use strata::backend::{ExpertGemm, SlotParams};
    use strata_tiers::{Dtype, Layout};
    let (n, d, f) = (29, 48, 80);
    let is_cuda = kind_of_backend == strata::backend::BackendKind::Cuda;
    let tolerance = match (is_cuda, gemm) {
        (true, _) => 1e-2,
        (false, ExpertGemm::Bf16) => 4e-3,
        (false, ExpertGemm::F32) => 1e-5,
    };
    for kind in [ExpertKind::SwiGlu, ExpertKind::Gelu] {
        let count = kind.params(d, f);
        let layout = Layout {
            layers: 1,
            experts_per_layer: 2,
            params_per_expert: count as u64,
            compute_dtype: Dtype::Bf16,
            moments: true,
        };
        let budget = 2 * layout.compute_payload_bytes();
        let gemms = (Default::default(), gemm);
        let mut device = match kind_of_backend.open_device(0, budget, &layout, gemms) {
            Ok(device) => device,
            Err(e) => {
                common::cuda_case_skipped(e);
                return;
            }
        };
        assert_eq!(device.arena().slot_count(), 2);
        let experts: Vec<Vec<f32>> = (0..2)
            .map(|e| bf16_round(&f32s(count, 10 + e, 0.15)))
            .collect();
        for (slot, params) in experts.iter().enumerate() {
            let bytes: Vec<u8> = params
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect();
            device
                .arena()
                .upload_htod(slot, Box::new(bytes))
                .unwrap()
                .wait()
                .unwrap();
        }
        let x = bf16_round(&f32s(n * d, 1, 1.0));
        let dout = bf16_round(&f32s(n * d, 3, 1.0));
        for slot in [1, 0] {
            let p = SlotParams::new(&layout, slot);
            let (mut out, mut saved) = (vec![0.0; n * d], ExpertSaved::default());
            device
                .expert_forward(kind, &mut out, &mut saved, &x, p, n, d, f)
                .unwrap();
            let (mut dx, mut dparams) = (vec![0.0; n * d], vec![0.0; count]);
            device
                .expert_backward(kind, &mut dx, &mut dparams, &dout, &saved, &x, p, n, d, f)
                .unwrap();
            let rp = &experts[slot];
            let (mut out_ref, mut saved_ref) = (vec![0.0; n * d], ExpertSaved::default());
            expert_ffn_forward(kind, &mut out_ref, &mut saved_ref, &x, rp, n, d, f);
            let (mut dx_ref, mut dparams_ref) = (vec![0.0; n * d], vec![0.0; count]);
            expert_ffn_backward(
                kind,
                &mut dx_ref,
                &mut dparams_ref,
                &dout,
                &saved_ref,
                &x,
                rp,
                n,
                d,
                f,
            );
            for (what, a, b) in [
                ("out", &out, &out_ref),
                ("dx", &dx, &dx_ref),
                ("dparams", &dparams, &dparams_ref),
            ] {
                let err = normwise(a, b);
                eprintln!(
                    "{} device ({gemm:?}) {} slot {slot}: {what} norm-wise error {err:.2e}",
                    device.name(),
                    kind.name()
                );
                assert!(err < tolerance, "{} slot {slot} {what}: {err}", kind.name());
            }
        }
    }
}

mod device_computes_from_its_slots {
    use strata::backend::{BackendKind, ExpertGemm};

    #[test]
    fn cpu() {
        super::device_computes_from_its_slots(BackendKind::Cpu, ExpertGemm::F32);
    }

    #[test]
    fn cpu_bf16() {
        super::device_computes_from_its_slots(BackendKind::Cpu, ExpertGemm::Bf16);
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn cuda() {
        super::device_computes_from_its_slots(BackendKind::Cuda, ExpertGemm::Bf16);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda() {
        super::common::cuda_case_skipped("built without --features cuda");
    }
}

/// A GPU's dense kernels, their GEMMs taking `gemm` inputs; `None` (the
/// case skipped) without a GPU.
#[cfg(feature = "cuda")]
fn gpu_dense_kernels(
    gemm: strata::backend::DenseGemm,
) -> Option<std::sync::Arc<dyn strata::model::DenseKernels + Send + Sync>> {
    let layout = strata_tiers::Layout {
        layers: 1,
        experts_per_layer: 1,
        params_per_expert: 64,
        compute_dtype: strata_tiers::Dtype::Bf16,
        moments: true,
    };
    match strata::backend::BackendKind::Cuda.open_device(
        0,
        1 << 20,
        &layout,
        (gemm, Default::default()),
    ) {
        Ok(device) => Some(device.dense_kernels()),
        Err(e) => {
            common::cuda_case_skipped(e);
            None
        }
    }
}

/// `v` as a GEMM taking `gemm` inputs reads it.
#[cfg(feature = "cuda")]
fn rounded_for(gemm: strata::backend::DenseGemm, v: &[f32]) -> Vec<f32> {
    match gemm {
        strata::backend::DenseGemm::F32 => v.to_vec(),
        strata::backend::DenseGemm::Bf16 => bf16_round(v),
    }
}

/// The dense layers' GEMMs on the GPU against the cpu's, forward and
/// backward (dx and dw accumulating into what they held).
///
/// f32 inputs: the same products summed in another order, so a few f32
/// ulps of sums of ~100 terms of order one: 1e-5 norm-wise.
///
/// bf16 inputs: x, w and dout rounded to bf16 (round to nearest even),
/// products summed in f32. Two checks. (1) Against the cpu fed the
/// rounded operands: the same products again, so 1e-5 norm-wise; an
/// operand left unrounded, or rounded twice to a coarser type, is 2⁻⁹
/// relative off or more. (2) Against the cpu on the unrounded operands,
/// element by element: rounding a and b to bf16 (unit roundoff u = 2⁻⁸)
/// changes a·b by at most (2u + u²)·|a||b|, so a sum of products by at
/// most (2u + u²)·Σ|a||b|, plus f32's accumulation error (K·2⁻²⁴ ≤ 1e-5
/// of Σ|a||b| at K = 96) on either side: (2u + u² + 2e-5)·Σ|a||b|,
/// Σ|a||b| being the cpu's GEMM of the absolute values.
#[cfg(feature = "cuda")]
#[test]
fn dense_gemms_on_the_gpu_match_the_cpu() {
    use strata::backend::{CpuBackend, DenseGemm};
    use strata::model::DenseKernels;
    let (m, k, n) = (37, 96, 53);
    let (x, w, dout) = (
        f32s(m * k, 50, 1.0),
        f32s(n * k, 51, 0.3),
        f32s(m * n, 52, 1.0),
    );
    let (dx0, dw0) = (vec![0.5; m * k], vec![-0.25; n * k]);
    // out, and the backward's dx and dw on their starting values.
    let pass = |linear: &dyn DenseKernels, x: &[f32], w: &[f32], dout: &[f32]| {
        let mut out = vec![0.0; m * n];
        linear.forward(&mut out, x, w, m, k, n).unwrap();
        let (mut dx, mut dw) = (dx0.clone(), dw0.clone());
        linear
            .backward(&mut dx, &mut dw, dout, x, w, m, k, n)
            .unwrap();
        [out, dx, dw]
    };
    let names = ["out", "dx", "dw"];
    for gemm in [DenseGemm::F32, DenseGemm::Bf16] {
        let Some(gpu) = gpu_dense_kernels(gemm) else {
            return;
        };
        let got = pass(&*gpu, &x, &w, &dout);
        let rounded = |v: &[f32]| rounded_for(gemm, v);
        let same_operands = pass(&CpuBackend, &rounded(&x), &rounded(&w), &rounded(&dout));
        for ((what, a), b) in names.iter().zip(&got).zip(&same_operands) {
            let err = normwise(a, b);
            eprintln!(
                "cuda dense {what}, {} inputs: norm-wise error {err:.2e}",
                gemm.name()
            );
            assert!(err < 1e-5, "{} {what}: {err}", gemm.name());
        }
        if gemm == DenseGemm::F32 {
            continue;
        }
        let exact = pass(&CpuBackend, &x, &w, &dout);
        let abs = |v: &[f32]| v.iter().map(|x| x.abs()).collect::<Vec<_>>();
        let (dx_zero, dw_zero) = (dx0.iter().map(|_| 0.0), dw0.iter().map(|_| 0.0));
        let magnitudes = {
            // Σ|a||b| of each output: the GEMMs of the absolute values, from zero.
            let mut out = vec![0.0; m * n];
            CpuBackend
                .forward(&mut out, &abs(&x), &abs(&w), m, k, n)
                .unwrap();
            let (mut dx, mut dw): (Vec<f32>, Vec<f32>) = (dx_zero.collect(), dw_zero.collect());
            CpuBackend
                .backward(&mut dx, &mut dw, &abs(&dout), &abs(&x), &abs(&w), m, k, n)
                .unwrap();
            [out, dx, dw]
        };
        let u = 2f64.powi(-8);
        let factor = 2.0 * u + u * u + 2e-5;
        for (((what, g), e), mag) in names.iter().zip(&got).zip(&exact).zip(&magnitudes) {
            let worst = g
                .iter()
                .zip(e)
                .zip(mag)
                .map(|((&g, &e), &mag)| (g as f64 - e as f64).abs() / (factor * mag as f64 + 1e-30))
                .fold(0.0f64, f64::max);
            eprintln!("cuda dense {what}, bf16 inputs: worst error {worst:.2} of its bound");
            assert!(worst <= 1.0, "bf16 {what}: {worst} of the bound");
        }
    }
}

/// The LM head and its loss on the GPU in blocks of rows (3 rows, so 10
/// tokens go in 4 blocks, the last one short; one ignored target) against
/// the plain sequence of the cpu's GEMM, cross-entropy and GEMM. And what
/// crosses between host and GPU is the rows and targets up, d rows and
/// the loss shares down, and the head and its gradient (neither of them
/// slices of registered dense params here): never the logits.
///
/// f32 inputs: the same sums in f32, so 1e-5 norm-wise (the loss to 1e-5
/// relative). bf16 inputs, against the cpu fed x and the head rounded to
/// bf16: the logits and the loss are the same sums again (1e-5); the
/// backward's GEMMs also round d logits (unit roundoff u = 2⁻⁸, one
/// operand of each product), so dx and d head differ from the cpu's by at
/// most (u + 2e-5)·Σ|d logits||b| element by element (b the rounded head
/// or x; 2e-5 for f32's sums), Σ|d logits||b| from the cpu's d logits.
#[cfg(feature = "cuda")]
#[test]
fn the_head_and_its_loss_on_the_gpu_match_the_cpu_in_blocks() {
    use strata::backend::cuda::CudaBackend;
    use strata::backend::{BackendKind, CpuBackend, DenseGemm};
    use strata::model::{DenseKernels, HeadShape};
    if let Err(e) = BackendKind::Cuda.check(0..1, strata_tiers::Dtype::Bf16) {
        common::cuda_case_skipped(e);
        return;
    }
    let (t, d, v) = (10, 24, 41);
    let s = HeadShape {
        t,
        d,
        v,
        denominator: 9,
    };
    let (x, head) = (f32s(t * d, 60, 1.0), f32s(v * d, 61, 0.3));
    let mut targets: Vec<u32> = (0..t as u32).map(|i| (i * 7 + 3) % v as u32).collect();
    targets[4] = strata::math::IGNORED_TARGET;
    for gemm in [DenseGemm::F32, DenseGemm::Bf16] {
        let gpu = CudaBackend::new(0, gemm).unwrap();
        let (x_in, head_in) = (rounded_for(gemm, &x), rounded_for(gemm, &head));
        let mut outs = Vec::new();
        for on_gpu in [true, false] {
            // dx is overwritten, dhead accumulates into what it held.
            let (mut dx, mut dhead) = (vec![7.0; t * d], vec![-0.25; v * d]);
            let before = gpu.pcie_other_bytes();
            let loss = if on_gpu {
                gpu.head_loss_in_blocks(&mut dx, &mut dhead, &x, &head, &targets, s, 3)
            } else {
                CpuBackend.head_loss(&mut dx, &mut dhead, &x_in, &head_in, &targets, s)
            }
            .unwrap();
            if on_gpu {
                let crossed = gpu.pcie_other_bytes() - before;
                // The head up, its gradient up and down, x up and dx down, the
                // targets up and the loss (summed on the GPU) down.
                let expected = 4 * (3 * v * d + 2 * t * d + t + 1) as u64;
                assert_eq!(crossed, expected, "bytes between host and GPU");
            }
            outs.push((loss, dx, dhead));
        }
        let (g, c) = (&outs[0], &outs[1]);
        let name = gemm.name();
        assert!(
            (g.0 - c.0).abs() <= 1e-5 * c.0.abs(),
            "{name}: loss {} vs {}",
            g.0,
            c.0
        );
        // The loss alone (evaluation): in the same blocks, the same
        // products and shares summed in the same order, so the training
        // pass's bits; in others, cuBLAS may take a row's sums in another
        // order for another block height, a few ulps.
        for block in [3, 4, 10] {
            let alone = gpu
                .head_loss_forward_in_blocks(&x, &head, &targets, s, block)
                .unwrap();
            if block == 3 {
                assert_eq!(alone.to_bits(), g.0.to_bits(), "{name}: blocks of 3");
            }
            assert!(
                (alone - g.0).abs() <= 1e-6 * g.0.abs(),
                "{name}: blocks of {block}"
            );
        }
        if gemm == DenseGemm::F32 {
            for (what, a, b) in [("dx", &g.1, &c.1), ("dhead", &g.2, &c.2)] {
                let err = normwise(a, b);
                eprintln!("cuda head in blocks, {what}: norm-wise error {err:.2e}");
                assert!(err < 1e-5, "{what}: {err}");
            }
            continue;
        }
        // The cpu's d logits, and Σ|d logits||b| for dx and d head.
        let mut logits = vec![0.0; t * v];
        CpuBackend
            .forward(&mut logits, &x_in, &head_in, t, d, v)
            .unwrap();
        let mut dlogits = vec![0.0; t * v];
        CpuBackend
            .cross_entropy(&mut dlogits, &logits, &targets, v, s.denominator)
            .unwrap();
        let abs = |v: &[f32]| v.iter().map(|x| x.abs()).collect::<Vec<_>>();
        let (mut dx_mag, mut dhead_mag) = (vec![0.0; t * d], vec![0.0; v * d]);
        CpuBackend
            .backward(
                &mut dx_mag,
                &mut dhead_mag,
                &abs(&dlogits),
                &abs(&x_in),
                &abs(&head_in),
                t,
                d,
                v,
            )
            .unwrap();
        let factor = 2f64.powi(-8) + 2e-5;
        for (what, a, b, mag) in [
            ("dx", &g.1, &c.1, &dx_mag),
            ("dhead", &g.2, &c.2, &dhead_mag),
        ] {
            let worst = a
                .iter()
                .zip(b)
                .zip(mag)
                .map(|((&a, &b), &m)| (a as f64 - b as f64).abs() / (factor * m as f64 + 1e-30))
                .fold(0.0f64, f64::max);
            eprintln!("cuda head in blocks, bf16 {what}: worst error {worst:.2} of its bound");
            assert!(worst <= 1.0, "bf16 {what}: {worst} of the bound");
        }
    }
}

/// A weight that is a slice of the registered dense params is uploaded
/// once and read in place until the params change: a GEMM after the host
/// copy changed (without `weights_changed`) still sees the uploaded
/// weight, and after `weights_changed` the new one. With bf16 inputs the
/// weight's bf16 copy follows it (each product the cpu's on the rounded
/// operands, 1e-5 norm-wise as in `dense_gemms_on_the_gpu_match_the_cpu`).
#[cfg(feature = "cuda")]
#[test]
fn dense_weights_stay_on_the_gpu_until_they_change() {
    use strata::backend::{CpuBackend, DenseGemm};
    use strata::model::DenseKernels;
    let (m, k, n) = (9, 32, 24);
    let x = f32s(m * k, 60, 1.0);
    let w = 100..100 + n * k;
    for gemm in [DenseGemm::F32, DenseGemm::Bf16] {
        let Some(gpu) = gpu_dense_kernels(gemm) else {
            return;
        };
        let rounded = |v: &[f32]| rounded_for(gemm, v);
        let mut dense = f32s(100 + n * k, 61, 0.3);
        let product = |kernels: &dyn DenseKernels, x: &[f32], dense: &[f32]| {
            let mut out = vec![0.0; m * n];
            kernels
                .forward(&mut out, x, &dense[w.clone()], m, k, n)
                .unwrap();
            out
        };
        let cpu = |dense: &[f32]| product(&CpuBackend, &rounded(&x), &rounded(dense));
        gpu.weights_changed(&dense);
        let before = product(&*gpu, &x, &dense);
        assert!(normwise(&before, &cpu(&dense)) < 1e-5);
        dense[w.clone()].iter_mut().for_each(|v| *v = -*v);
        assert_eq!(
            product(&*gpu, &x, &dense),
            before,
            "the uploaded weight is read"
        );
        gpu.weights_changed(&dense);
        let after = product(&*gpu, &x, &dense);
        assert!(normwise(&after, &cpu(&dense)) < 1e-5, "{}", gemm.name());
        assert!(normwise(&after, &before) > 1.0, "the new weight is read");
    }
}

/// Between `grads_begin` and `grads_flush`, weight gradients that are
/// slices of the registered gradient sum on the GPU: the host slice keeps
/// what it held (and what the cpu adds to it) until the flush adds the
/// GPU's sum, and the result is the cpu's (fed the rounded operands with
/// bf16 inputs, as in `dense_gemms_on_the_gpu_match_the_cpu`).
#[cfg(feature = "cuda")]
#[test]
fn dense_gradients_sum_on_the_gpu_until_the_flush() {
    use strata::backend::{CpuBackend, DenseGemm};
    use strata::model::DenseKernels;
    let (m, k, n) = (11, 32, 24);
    let (x, w, dout) = (
        f32s(m * k, 70, 1.0),
        f32s(n * k, 71, 0.3),
        f32s(m * n, 72, 1.0),
    );
    let slot = 40..40 + n * k;
    let held = f32s(40 + n * k + 8, 73, 0.5);
    for gemm in [DenseGemm::F32, DenseGemm::Bf16] {
        let Some(gpu) = gpu_dense_kernels(gemm) else {
            return;
        };
        let rounded = |v: &[f32]| rounded_for(gemm, v);
        let backward_twice =
            |kernels: &dyn DenseKernels, grad: &mut Vec<f32>, [x, w, dout]: [&[f32]; 3]| {
                let mut dx = vec![0.0; m * k];
                for _ in 0..2 {
                    kernels
                        .backward(&mut dx, &mut grad[slot.clone()], dout, x, w, m, k, n)
                        .unwrap();
                }
                dx
            };
        let mut cpu = held.clone();
        let (xr, wr, doutr) = (rounded(&x), rounded(&w), rounded(&dout));
        let cpu_dx = backward_twice(&CpuBackend, &mut cpu, [&xr, &wr, &doutr]);
        let mut grad = held.clone();
        gpu.grads_begin(&grad);
        let gpu_dx = backward_twice(&*gpu, &mut grad, [&x, &w, &dout]);
        assert_eq!(grad, held, "the host slice waits for the flush");
        grad[slot.start] += 1.0; // as the cpu part of a step would add
        gpu.grads_flush(&mut grad).unwrap();
        grad[slot.start] -= 1.0;
        assert!(normwise(&gpu_dx, &cpu_dx) < 1e-5);
        let err = normwise(&grad, &cpu);
        eprintln!(
            "cuda dense gradient summed on the GPU, {} inputs: norm-wise error {err:.2e}",
            gemm.name()
        );
        assert!(err < 1e-5, "{err}");
    }
}

/// One engine step on the GPU against the same on the cpu (both with bf16
/// compute copies of the experts), gradients compared tensor by tensor.
/// The optimizer is set so that the update is the gradient's image
/// (β1 = β2 = 0, ε = 1, no weight decay: the first update is
/// −lr·g/(|g| + 1), lr·g to within |g| ≤ 0.05), so a param's move shows its
/// gradient's size, not only its sign.
///
/// Bound: on the GPU the experts' GEMMs also round their activations and
/// output gradients to bf16 (2⁻⁹ relative each, so a product to 2⁻⁸ and a
/// sum of products with random signs norm-wise to about the same). An
/// expert weight's gradient ends a chain of three such GEMMs (dout →
/// dhidden → da → dW1): ≈ √3 · 2⁻⁸ ≈ 7e-3 norm-wise. The dense GEMMs
/// take bf16 inputs too (the default, `DenseGemm::Bf16`): the head's
/// gradient rounds d logits and x (≈ √2 · 2⁻⁸ ≈ 5.5e-3), and the norms'
/// and routers' gradients see that rounding and the experts' through
/// their inputs' gradients, a chain no longer than the experts'. 3e-2
/// norm-wise per tensor leaves a 4× margin, and a gradient lost (1.0) or
/// doubled (≈ 1.0) in any tensor fails it.
#[cfg(feature = "cuda")]
#[test]
fn one_engine_step_on_the_gpu_computes_the_gradients_of_the_cpu() {
    use strata::backend::BackendKind;
    use strata::engine::{Engine, EngineConfig};
    if let Err(e) = BackendKind::Cuda.check(0..1, strata_tiers::Dtype::Bf16) {
        common::cuda_case_skipped(e);
        return;
    }
    let model = common::model(2, ExpertKind::SwiGlu);
    let hyper = strata_optim::AdamWHyper {
        lr: 16.0,
        beta1: 0.0,
        beta2: 0.0,
        eps: 1.0,
        weight_decay: 0.0,
    };
    // The moves of every tensor: the dense ones by range, then each expert.
    let run = |backend| {
        let mut engine = Engine::new(
            model.clone(),
            EngineConfig {
                backend,
                hyper,
                compute_dtype: strata_tiers::Dtype::Bf16,
                ..EngineConfig::default()
            },
        )
        .unwrap();
        let params = |engine: &mut Engine| {
            let mut p = vec![engine.dense_params().unwrap().to_vec()];
            for l in 0..model.layers {
                for e in 0..model.experts {
                    p.push(engine.expert_params(l, e).unwrap());
                }
            }
            p
        };
        let before = params(&mut engine);
        engine.step(&common::batch(&model, 0)).unwrap();
        let after = params(&mut engine);
        let moves = |a: &[f32], b: &[f32]| -> Vec<f64> {
            a.iter()
                .zip(b)
                .map(|(x, y)| *x as f64 - *y as f64)
                .collect()
        };
        let mut tensors = vec![(
            "head".to_string(),
            moves(
                &after[0][model.head_range()],
                &before[0][model.head_range()],
            ),
        )];
        for l in 0..model.layers {
            for (what, r) in [
                ("norm", model.norm_range(l)),
                ("router", model.router_range(l)),
            ] {
                tensors.push((
                    format!("layer {l} {what}"),
                    moves(&after[0][r.clone()], &before[0][r]),
                ));
            }
        }
        for (i, (a, b)) in after[1..].iter().zip(&before[1..]).enumerate() {
            let (l, e) = (i / model.experts, i % model.experts);
            tensors.push((format!("expert {l}.{e}"), moves(a, b)));
        }
        tensors
    };
    let gpu = run(BackendKind::Cuda);
    let cpu = run(BackendKind::Cpu);
    let mut worst = (0.0f64, String::new());
    for ((name, g), (_, c)) in gpu.iter().zip(&cpu) {
        let norm = c.iter().map(|x| x * x).sum::<f64>().sqrt();
        let diff = g
            .iter()
            .zip(c)
            .map(|(x, y)| (x - y).powi(2))
            .sum::<f64>()
            .sqrt();
        if norm == 0.0 {
            assert_eq!(diff, 0.0, "{name}: moved on the GPU only");
            continue;
        }
        let rel = diff / norm;
        assert!(
            rel < 3e-2,
            "{name}: the GPU's gradient is {rel:.2e} (norm-wise) from the cpu's"
        );
        if rel > worst.0 {
            worst = (rel, name.clone());
        }
    }
    eprintln!(
        "one step's gradients, gpu vs cpu: {} tensors, worst norm-wise difference {:.2e} ({})",
        gpu.len(),
        worst.0,
        worst.1
    );
}

/// Five engine steps with the experts on the GPU against the same on the
/// cpu (both with bf16 compute copies). The GPU also rounds the GEMMs'
/// activations and gradients to bf16, so the gradients differ by ~1e-2
/// norm-wise (the test above). The optimizer keeps the gradient's scale
/// (`common::hyper`): a step moves a param by lr·m̂ ≤ 0.5 × 0.05, so
/// gradients 1e-2 apart move it at most 2.5e-4 apart a step, 1.25e-3
/// after 5 steps; 5e-3 bounds it with a 4× margin. The losses, which see
/// the params only through those small moves, agree to 1 %.
#[cfg(feature = "cuda")]
#[test]
fn five_engine_steps_on_the_gpu_match_the_cpu() {
    use strata::backend::BackendKind;
    use strata::engine::{Engine, EngineConfig};
    if let Err(e) = BackendKind::Cuda.check(0..1, strata_tiers::Dtype::Bf16) {
        common::cuda_case_skipped(e);
        return;
    }
    let model = common::model(2, ExpertKind::SwiGlu);
    let run = |backend| {
        let mut engine = Engine::new(
            model.clone(),
            EngineConfig {
                backend,
                hyper: common::hyper(),
                compute_dtype: strata_tiers::Dtype::Bf16,
                optimizer_threads: 2,
                ..EngineConfig::default()
            },
        )
        .unwrap();
        // The CPU model of CUDA (tests/fake_cuda) refuses page-locking
        // when asked to, as the OS does past the memlock limit: uploads
        // are then staged, and the engine says so.
        if backend == BackendKind::Cuda && std::env::var_os("STRATA_FAKE_CUDA_REFUSE_PIN").is_some()
        {
            assert!(
                engine.notes().iter().any(|n| n.contains("staged")),
                "{:?}",
                engine.notes()
            );
            eprintln!("gpu notes: {:?}", engine.notes());
        }
        let losses: Vec<f32> = (0..5)
            .map(|s| engine.step(&common::batch(&model, s)).unwrap().loss)
            .collect();
        let mut params = engine.dense_params().unwrap().to_vec();
        for l in 0..model.layers {
            for e in 0..model.experts {
                params.extend(engine.expert_params(l, e).unwrap());
            }
        }
        (losses, params)
    };
    let (gpu_losses, gpu) = run(BackendKind::Cuda);
    let (cpu_losses, cpu) = run(BackendKind::Cpu);
    for (g, c) in gpu_losses.iter().zip(&cpu_losses) {
        assert!(
            (g - c).abs() <= 0.01 * c.abs(),
            "loss {g} on the GPU, {c} on the cpu"
        );
    }
    let worst = gpu
        .iter()
        .zip(&cpu)
        .map(|(g, c)| (g - c).abs())
        .fold(0.0f32, f32::max);
    eprintln!("gpu vs cpu after 5 steps: losses {gpu_losses:?} vs {cpu_losses:?}, worst param difference {worst:.2e}");
    assert!(worst < 5e-3, "{worst}");
}

/// `StepMetrics::bytes_pcie_other` counts what crosses between host and
/// GPU besides expert params and gradients: the cpu backend copies none;
/// the GPU step, its activations and routing on the GPU, copies each
/// layer's counts and losses, the batch's ids (and its loss mask's bits)
/// and the loss every step, and the dense params either once (kept
/// and stepped on the GPU, the default) or up and their gradient down
/// every step (`dense_on_device: false`). The steady state copies the same
/// bytes every step at one shape.
#[cfg(feature = "cuda")]
#[test]
fn a_step_counts_the_bytes_that_cross_besides_experts() {
    use common::tiny_lm::tiny_config;
    use strata::backend::BackendKind;
    use strata::engine::{Engine, EngineConfig};
    use strata::lm::{AuxLoss, LmConfig, MoeLm, TokenBatch};
    if let Err(e) = BackendKind::Cuda.check(0..1, strata_tiers::Dtype::Bf16) {
        common::cuda_case_skipped(e);
        return;
    }
    let lm = MoeLm::new(tiny_config()).unwrap();
    let c = lm.config().clone();
    let batch = TokenBatch {
        seq_len: 8,
        tokens: (0..4 * 9u32).map(|i| (i * 37 + 5) % 250).collect(),
        loss_mask: None,
        doc_starts: None,
    };
    let run = |backend, dense_on_device, batch: &TokenBatch| {
        let config = EngineConfig {
            backend,
            optimizer_threads: 2,
            dense_on_device,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new_network(&lm, config).unwrap();
        (0..3)
            .map(|_| engine.step_network(&lm, batch).unwrap().bytes_pcie_other)
            .collect::<Vec<u64>>()
    };
    let cpu = run(BackendKind::Cpu, true, &batch);
    assert_eq!(cpu, vec![0, 0, 0]);
    let kept = run(BackendKind::Cuda, true, &batch);
    let moved = run(BackendKind::Cuda, false, &batch);
    // Each layer's routing stays on the GPU: the experts' counts and its
    // two losses come down (E + 2 values); its load-balancing loss's
    // gradient is made there from the counts.
    let routing = (4 * c.layers * (c.experts + 2)) as u64;
    let dense = 4 * c.dense_params() as u64;
    eprintln!(
        "bytes_pcie_other a step on the gpu: {kept:?} with the dense params kept there, \
         {moved:?} moved each step; routing {routing}, dense params {dense}"
    );
    // Kept: the params (and their moments, zero at the start) go up with
    // the first step alone.
    assert!(
        kept[0] >= dense && kept[0] <= 3 * dense + routing + 4096,
        "{kept:?}"
    );
    // What the GPU step promises: the routing, the batch's ids and the
    // loss, and nothing else (the inputs and targets split on the GPU, the
    // loss's shares summed there, the embedding's tokens ordered there).
    let ids = 4 * batch.tokens.len() as u64;
    assert_eq!(kept[1], routing + ids + 4, "{kept:?}");
    // A loss mask adds its bits: a u32 a 32 positions.
    let masked = TokenBatch {
        loss_mask: Some((0..batch.tokens.len()).map(|p| p % 3 != 0).collect()),
        ..batch.clone()
    };
    let with_mask = run(BackendKind::Cuda, true, &masked);
    let words = 4 * batch.tokens.len().div_ceil(32) as u64;
    assert_eq!(with_mask[1], kept[1] + words, "{with_mask:?}");
    // Documents packed apart (a fine-tuning batch) add their starts: a bit
    // a token, where the starts differ from the last step's (two batches
    // taking turns here).
    let apart = |first: usize| TokenBatch {
        doc_starts: Some(
            (0..batch.tokens.len())
                .map(|p| p % 9 == 0 || p % 9 == first)
                .collect(),
        ),
        ..batch.clone()
    };
    let turns = [apart(3), apart(5), apart(3)];
    let config = EngineConfig {
        backend: BackendKind::Cuda,
        optimizer_threads: 2,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new_network(&lm, config.clone()).unwrap();
    let packed: Vec<u64> = turns
        .iter()
        .map(|b| engine.step_network(&lm, b).unwrap().bytes_pcie_other)
        .collect();
    let t = 4 * batch.seq_len;
    let begins = 4 * t.div_ceil(32) as u64;
    assert_eq!(packed[1..], [kept[1] + begins; 2], "{packed:?}");
    // The load-balancing loss over every layer (transformers' form, a Hub
    // model's): each expert's probabilities summed over every layer come
    // down once (E f64), and its gradient, the same for every layer, goes
    // up once (E f32), instead of one a layer.
    let all_layers = MoeLm::new(LmConfig {
        aux_loss: AuxLoss::AllLayers,
        ..tiny_config()
    })
    .unwrap();
    let mut engine = Engine::new_network(&all_layers, config).unwrap();
    let steps: Vec<u64> = (0..2)
        .map(|_| {
            engine
                .step_network(&all_layers, &batch)
                .unwrap()
                .bytes_pcie_other
        })
        .collect();
    let once = (8 + 4) * c.experts as u64;
    assert_eq!(steps[1], routing + once + ids + 4, "{steps:?}");
    // Moved: the params up and their gradient down, every step.
    for &b in &moved {
        assert!(
            b >= 2 * dense && b <= 2 * dense + routing + 4096,
            "{moved:?}"
        );
    }
    assert_eq!(kept[1], kept[2], "the same step copies the same bytes");
    assert_eq!(moved[1], moved[2], "the same step copies the same bytes");
}

/// `kernels.cu` compiles with NVRTC and its PTX assembles for Hopper
/// (sm_90) with ptxas, neither of which needs a GPU: wherever the NVRTC
/// library is on the library path and ptxas on the PATH (CI fetches CUDA
/// 13.0's, see `.ci/cuda-tools`).
#[cfg(feature = "cuda")]
#[test]
fn the_kernels_compile_with_nvrtc_and_assemble_for_hopper() {
    let ptx = match strata::backend::cuda::compile_kernels() {
        Err(strata::EngineError::Device { why, .. }) if why.starts_with("no NVRTC") => {
            common::case_skipped("nvrtc", why);
            return;
        }
        Err(e) => panic!("{e}"),
        Ok(ptx) => ptx.to_src(),
    };
    let kernels = [
        "swiglu_forward",
        "swiglu_backward",
        "gelu_forward",
        "gelu_backward",
        "f32_to_bf16",
        "adamw",
        "rmsnorm_forward",
        "rmsnorm_backward_dx",
        "column_partials",
        "add_column_partials",
        "rope",
        "cross_entropy",
        "router_top_k",
        "router_sigmoid_top_k",
        "permutation_chunk_counts",
        "permutation_counts",
        "permutation_place",
        "router_sums",
        "router_losses",
        "aux_prob_grad",
        "add_prob_sums",
        "router_logits_grad",
        "gather_rows",
        "scatter_rows",
        "attn_to_heads",
        "attn_from_heads",
        "attn_softmax",
        "attn_softmax_backward",
        "add_into",
        "add_bias",
        "clamp_values",
        "clamp_grad",
        "combine_rows",
        "combine_weights_grad",
        "weighted_rows",
        "gather_rows_backward",
        "split_token_rows",
        "document_starts",
        "token_order_runs",
        "token_order_merge",
        "embedding_backward",
        "sum_in_order",
        "square_sums",
        "sigmoid_values",
        "add_scaled_rows",
        "gate_backward",
    ];
    for kernel in kernels {
        assert!(
            ptx.contains(&format!(".entry {kernel}(")),
            "{kernel} missing from the PTX"
        );
    }
    eprintln!("nvrtc: kernels.cu compiled to {} bytes of PTX", ptx.len());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kernels.ptx");
    std::fs::write(&path, &ptx).unwrap();
    match std::process::Command::new("ptxas")
        .args(["--gpu-name", "sm_90", "-O3", "--verbose", "-o"])
        .arg(dir.path().join("kernels.cubin"))
        .arg(&path)
        .output()
    {
        Err(e) => common::case_skipped("ptxas", format!("ptxas not on the PATH ({e})")),
        Ok(out) => {
            let log = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "ptxas refused the PTX:\n{log}");
            let spills = log
                .lines()
                .filter(|l| {
                    l.contains("bytes spill")
                        && !l.contains(" 0 bytes spill stores, 0 bytes spill loads")
                })
                .count();
            eprintln!("{log}");
            eprintln!("ptxas: every kernel assembles for sm_90 ({spills} with register spills)");
        }
    }
}

/// The kernels against their CPU references on the GPU (the same checks
/// run on the CPU in `tests/kernels_emulated.rs`).
#[cfg(feature = "cuda")]
mod cuda_kernels {
    use strata::backend::cuda::CudaBackend;

    use super::kernel_checks;

    fn gpu() -> Option<CudaBackend> {
        match CudaBackend::new(0, Default::default()) {
            Ok(g) => Some(g),
            Err(e) => {
                super::common::cuda_case_skipped(e);
                None
            }
        }
    }

    #[test]
    fn activation_kernels_match_their_cpu_references() {
        if let Some(gpu) = gpu() {
            kernel_checks::activations(&gpu);
        }
    }

    #[test]
    fn rmsnorm_and_rope_kernels_match_the_cpu() {
        if let Some(gpu) = gpu() {
            kernel_checks::rmsnorm_and_rope(&gpu);
        }
    }

    #[test]
    fn loss_router_and_permutation_kernels_match_the_cpu() {
        if let Some(gpu) = gpu() {
            kernel_checks::loss_router_and_permutation(&gpu);
        }
    }

    #[test]
    fn token_ids_embedding_and_loss_sum_kernels_match_the_cpu() {
        if let Some(gpu) = gpu() {
            kernel_checks::token_ids_embedding_and_loss_sum(&gpu);
        }
    }

    #[test]
    fn document_starts_match_the_cpu() {
        if let Some(gpu) = gpu() {
            kernel_checks::document_starts(&gpu);
        }
    }

    #[test]
    fn router_kernels_match_the_cpu() {
        if let Some(gpu) = gpu() {
            kernel_checks::router::router_kernels(&gpu);
        }
    }

    /// With f32 GEMMs, whose sums the check's 1e-5 bounds;
    /// `tests/gpu_attention.rs` holds the bf16 GEMMs (the default) to the
    /// rounding of their operands.
    #[test]
    fn attention_kernels_match_the_cpu() {
        if gpu().is_some() {
            let gpu = CudaBackend::new(0, strata::backend::DenseGemm::F32).unwrap();
            kernel_checks::attention(&gpu);
        }
    }

    #[test]
    fn the_gpu_adamw_equals_the_scalar_oracle_bit_for_bit() {
        if let Some(gpu) = gpu() {
            kernel_checks::adamw_bit_for_bit(&gpu);
        }
    }
}
