//! The router after its logits as `src/backend/cuda/router.rs` runs it, on
//! the emulator: the same kernels in the same sequence with the same
//! arguments (a change to the backend's sequence is mirrored here).

use strata::math::{aux_prob_grad, RouterConfig, Routing, Scoring};

use super::{arg, KernelEmulator};
use crate::kernel_checks::RouterResult;
use strata::backend::PERMUTATION_CHUNK;

impl KernelEmulator {
    /// `CudaBackend::route_host`.
    pub(super) fn route_emulated(
        &self,
        cfg: &RouterConfig,
        logits: &[f32],
        bias: Option<&[f32]>,
        t: usize,
    ) -> RouterResult {
        let (e, k) = (cfg.experts, cfg.top_k);
        assert!(logits.len() == t * e && k <= e);
        let mut r = RouterResult {
            probs: vec![0.0; t * e],
            lse: vec![0.0; t],
            experts: vec![0; t * k],
            weights: vec![0.0; t * k],
            order: vec![0; t * k],
            position: vec![0; t * k],
            counts: vec![0; e],
            sums: vec![0.0; e + 1],
            losses: [0.0; 2],
        };
        let pl = logits.as_ptr();
        let (pp, plse, pe, pw) = (
            r.probs.as_mut_ptr(),
            r.lse.as_mut_ptr(),
            r.experts.as_mut_ptr(),
            r.weights.as_mut_ptr(),
        );
        let [t32, e32, k32, r32] = [t, e, k, cfg.renormalize as usize].map(|v| v as u32);
        match cfg.scoring {
            Scoring::Softmax => {
                self.launch(
                    "router_top_k",
                    t,
                    &[
                        arg(&pl),
                        arg(&pp),
                        arg(&plse),
                        arg(&pe),
                        arg(&pw),
                        arg(&t32),
                        arg(&e32),
                        arg(&k32),
                        arg(&r32),
                    ],
                );
            }
            Scoring::SigmoidGrouped {
                groups,
                kept_groups,
                scale,
            } => {
                let zeros = vec![0.0f32; e];
                let pb = bias.unwrap_or(&zeros).as_ptr();
                let mut group_scores = vec![0.0f32; t * groups];
                let pg = group_scores.as_mut_ptr();
                let [g32, kept32] = [groups, kept_groups].map(|v| v as u32);
                self.launch(
                    "router_sigmoid_top_k",
                    t,
                    &[
                        arg(&pl),
                        arg(&pb),
                        arg(&pp),
                        arg(&pg),
                        arg(&pe),
                        arg(&pw),
                        arg(&t32),
                        arg(&e32),
                        arg(&k32),
                        arg(&g32),
                        arg(&kept32),
                        arg(&r32),
                        arg(&scale),
                    ],
                );
            }
        }
        let pe = r.experts.as_ptr();
        let (po, ppos, pc) = (
            r.order.as_mut_ptr(),
            r.position.as_mut_ptr(),
            r.counts.as_mut_ptr(),
        );
        // As `CudaBackend::permute_device`: chunks' counts, the experts'
        // counts, then each (chunk, expert) places its assignments.
        let n = t * k;
        let chunks = n.div_ceil(PERMUTATION_CHUNK);
        let mut chunk_counts = vec![0u32; chunks * e];
        let pcc = chunk_counts.as_mut_ptr();
        let [n32, c32] = [n, PERMUTATION_CHUNK].map(|v| v as u32);
        let sizes = [arg(&n32), arg(&e32), arg(&c32)];
        let args = [&[arg(&pe), arg(&pcc)][..], &sizes].concat();
        self.launch("permutation_chunk_counts", chunks * e, &args);
        let args = [&[arg(&pcc), arg(&pc)][..], &sizes].concat();
        self.launch("permutation_counts", e, &args);
        let places = [arg(&pe), arg(&pcc), arg(&pc), arg(&po), arg(&ppos)];
        self.launch(
            "permutation_place",
            chunks * e,
            &[&places[..], &sizes].concat(),
        );
        let (pp, plse, ps) = (r.probs.as_ptr(), r.lse.as_ptr(), r.sums.as_mut_ptr());
        self.launch(
            "router_sums",
            e + 1,
            &[arg(&pp), arg(&plse), arg(&ps), arg(&t32), arg(&e32)],
        );
        let (pc, ps, pl) = (r.counts.as_ptr(), r.sums.as_ptr(), r.losses.as_mut_ptr());
        let args = [
            arg(&pc),
            arg(&ps),
            arg(&pl),
            arg(&t32),
            arg(&k32),
            arg(&e32),
        ];
        self.launch("router_losses", 1, &args);
        r
    }

    /// `CudaBackend::router_logits_grad_host`.
    pub(super) fn router_logits_grad_emulated(
        &self,
        cfg: &RouterConfig,
        routing: &Routing<f32>,
        dweights: &[f32],
        (daux, dz): (f32, f32),
        t: usize,
    ) -> Vec<f32> {
        let (e, k) = (cfg.experts, cfg.top_k);
        assert!(routing.probs.len() == t * e && dweights.len() == t * k);
        let aux = aux_prob_grad(cfg, daux, routing, t);
        let mut dlogits = vec![0.0f32; t * e];
        let (sigmoid, scale) = match cfg.scoring {
            Scoring::Softmax => (0u32, 1.0f32),
            Scoring::SigmoidGrouped { scale, .. } => (1, scale),
        };
        let [t32, e32, k32, r32] = [t, e, k, cfg.renormalize as usize].map(|v| v as u32);
        let dz2 = dz * 2.0;
        let (pp, plse, pe, pw) = (
            routing.probs.as_ptr(),
            routing.lse.as_ptr(),
            routing.experts.as_ptr(),
            routing.weights.as_ptr(),
        );
        let (pdw, pa, pd) = (dweights.as_ptr(), aux.as_ptr(), dlogits.as_mut_ptr());
        self.launch(
            "router_logits_grad",
            t,
            &[
                arg(&pp),
                arg(&plse),
                arg(&pe),
                arg(&pw),
                arg(&pdw),
                arg(&pa),
                arg(&pd),
                arg(&t32),
                arg(&e32),
                arg(&k32),
                arg(&r32),
                arg(&sigmoid),
                arg(&scale),
                arg(&dz2),
            ],
        );
        dlogits
    }

    /// `CudaBackend::add_prob_sums_host`.
    pub(super) fn add_prob_sums_emulated(&self, probs: &[f32], sums: &mut [f64]) {
        let e = sums.len();
        let t = probs.len() / e;
        assert_eq!(probs.len(), t * e);
        let [t32, e32] = [t, e].map(|v| v as u32);
        let (pp, ps) = (probs.as_ptr(), sums.as_mut_ptr());
        self.launch(
            "add_prob_sums",
            e,
            &[arg(&pp), arg(&ps), arg(&t32), arg(&e32)],
        );
    }
}
