//! The router after its logits, on the GPU (`router.cu`): the scores and
//! each token's top-k, the permutation that groups a layer's assignments
//! by expert, the sums its losses read, and the logits' gradient, each
//! mirroring `math::router` / `math::permute` in the cpu's order of sums.
//!
//! A routing stays in GPU memory ([`DeviceRouting`]); the host learns
//! each expert's count of assignments (which experts to stream, and their
//! spans), the layer's two loss sums, and, only where the engine reads
//! them (the routing traced, or the next layer predicted from token
//! pairs), each token's experts. The backward sends up one value an
//! expert (the load-balancing loss's part of the gradient).

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, DevicePtrMut, PushKernelArg};

use super::dense::{load_kernel, threads};
use super::{gpu_error, CudaBackend};
use crate::backend::PERMUTATION_CHUNK;
use crate::math::{aux_prob_grad, Permutation, RouterConfig, Routing, Scoring};
use crate::EngineError;

pub(super) struct RouterFunctions {
    top_k: CudaFunction,
    sigmoid_top_k: CudaFunction,
    permutation_chunk_counts: CudaFunction,
    permutation_counts: CudaFunction,
    permutation_place: CudaFunction,
    sums: CudaFunction,
    losses: CudaFunction,
    aux_grad: CudaFunction,
    add_prob_sums: CudaFunction,
    logits_grad: CudaFunction,
}

impl RouterFunctions {
    pub(super) fn load(module: &Arc<CudaModule>) -> Result<Self, EngineError> {
        let load = |name: &str| load_kernel(module, name);
        Ok(Self {
            top_k: load("router_top_k")?,
            sigmoid_top_k: load("router_sigmoid_top_k")?,
            permutation_chunk_counts: load("permutation_chunk_counts")?,
            permutation_counts: load("permutation_counts")?,
            permutation_place: load("permutation_place")?,
            sums: load("router_sums")?,
            losses: load("router_losses")?,
            aux_grad: load("aux_prob_grad")?,
            add_prob_sums: load("add_prob_sums")?,
            logits_grad: load("router_logits_grad")?,
        })
    }
}

/// A routing's scores and choice in GPU memory: the fields of
/// `math::Routing` its backward reads.
pub(super) struct Scored {
    /// (T, E) probabilities (a sigmoid router's scores).
    probs: CudaSlice<f32>,
    /// (T) each token's log-sum-exp (zeros for a sigmoid router).
    lse: CudaSlice<f32>,
    /// (T·K) each token's experts, best first.
    experts: CudaSlice<u32>,
    /// (T·K) the combine weights.
    pub weights: CudaSlice<f32>,
}

/// A layer's routing in GPU memory, with its `Permutation`'s order and
/// position.
pub(super) struct DeviceRouting {
    pub scored: Scored,
    /// (T·K) the assignments in expert order, and each one's place there.
    pub order: CudaSlice<u32>,
    pub position: CudaSlice<u32>,
    /// (E) each expert's count of assignments.
    pub counts: CudaSlice<u32>,
}

impl DeviceRouting {
    /// (T, E) the router's probabilities.
    pub(super) fn probs(&self) -> &CudaSlice<f32> {
        &self.scored.probs
    }
}

/// Everything a routing holds, brought to the host: what the tests
/// compare with `math::route_logits` and `Permutation::from_routing`.
#[derive(Clone, Debug)]
pub struct RouterOut {
    pub probs: Vec<f32>,
    pub lse: Vec<f32>,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
    pub order: Vec<u32>,
    pub position: Vec<u32>,
    pub counts: Vec<u32>,
    /// Each expert's probabilities summed over the tokens, then Σ lse².
    pub sums: Vec<f32>,
    /// The load-balancing loss and the z-loss, from the counts and sums
    /// on the GPU.
    pub losses: [f32; 2],
}

impl CudaBackend {
    /// The experts' counts and the layer's two losses, side by side in
    /// one buffer on the GPU (two copies there) and then in one download:
    /// one host join a layer rather than two.
    fn download_counts_and_losses(
        &self,
        counts: &CudaSlice<u32>,
        losses: &CudaSlice<f32>,
    ) -> Result<(Vec<u32>, Vec<f32>), EngineError> {
        let (n_counts, n_losses) = (counts.len(), losses.len());
        let mut both = self
            .stream
            .alloc_zeros::<u32>(n_counts + n_losses)
            .map_err(|e| gpu_error("allocating GPU memory", e))?;
        {
            let (dst, _written) = both.device_ptr_mut(&self.stream);
            let at = dst + (n_counts * std::mem::size_of::<u32>()) as u64;
            // SAFETY: `both` holds n_counts + n_losses 4-byte words: the
            // counts fill its first n_counts and the losses (f32, 4
            // bytes each) the rest; `_written` keeps it alive and records its
            // use until the copies are queued on this stream.
            unsafe {
                self.copy_to(dst, counts)?;
                self.copy_to(at, losses)?;
            }
        }
        let mut host = vec![0u32; n_counts + n_losses];
        self.download_values(&both, &mut host)?;
        let losses = host[n_counts..]
            .iter()
            .map(|&b| f32::from_bits(b))
            .collect();
        host.truncate(n_counts);
        Ok((host, losses))
    }

    /// Routes the logits (T, E) on the GPU, `bias` being a sigmoid
    /// router's correction bias: the routing in GPU memory, and what the
    /// host keeps of it (counts, losses, and each token's experts where
    /// `assignments`) with its permutation (whole where `assignments`,
    /// else its spans: `Permutation::from_counts`).
    pub(super) fn route_device(
        &self,
        cfg: &RouterConfig,
        logits: &CudaSlice<f32>,
        bias: Option<&[f32]>,
        t: usize,
        assignments: bool,
    ) -> Result<(DeviceRouting, Routing<f32>, Permutation), EngineError> {
        cfg.check().map_err(EngineError::Config)?;
        let (e, k) = (cfg.experts, cfg.top_k);
        assert_eq!(logits.len(), t * e, "logits (T, E)");
        let scored = self.route_kernels(cfg, logits, bias, t)?;
        let (order, position, counts_dev) = self.permute_device(&scored.experts, e)?;
        let sums_dev = self.router_sums_device(&scored.probs, &scored.lse, t, e)?;
        let losses_dev = self.router_losses_device(&counts_dev, &sums_dev, t, k)?;
        let (counts, losses) = self.download_counts_and_losses(&counts_dev, &losses_dev)?;
        let mut routing = Routing::default();
        let perm = if assignments {
            routing.experts = vec![0; t * k];
            self.download_values(&scored.experts, &mut routing.experts)?;
            Permutation::from_routing(&routing.experts, e)
        } else {
            Permutation::from_counts(&counts)
        };
        (routing.aux_loss, routing.z_loss) = (losses[0], losses[1]);
        routing.counts = counts;
        let dev = DeviceRouting {
            scored,
            order,
            position,
            counts: counts_dev,
        };
        Ok((dev, routing, perm))
    }

    /// The scoring and top-k kernels.
    fn route_kernels(
        &self,
        cfg: &RouterConfig,
        logits: &CudaSlice<f32>,
        bias: Option<&[f32]>,
        t: usize,
    ) -> Result<Scored, EngineError> {
        let (e, k) = (cfg.experts, cfg.top_k);
        let mut r = Scored {
            probs: self.zeros(t * e)?,
            lse: self.zeros(t)?,
            experts: self.alloc::<u32>(t * k)?,
            weights: self.zeros(t * k)?,
        };
        let [t32, e32, k32, r32] = [t, e, k, cfg.renormalize as usize].map(|v| v as u32);
        match cfg.scoring {
            Scoring::Softmax => {
                let mut launch = self.stream.launch_builder(&self.router.top_k);
                launch.arg(logits).arg(&mut r.probs).arg(&mut r.lse);
                launch.arg(&mut r.experts).arg(&mut r.weights);
                launch.arg(&t32).arg(&e32).arg(&k32).arg(&r32);
                // SAFETY: logits and probs hold t·e f32, lse t, experts
                // and weights t·k (k ≤ e, checked); one thread a token.
                unsafe { launch.launch(threads(t)) }
                    .map_err(|err| gpu_error("router_top_k", err))?;
            }
            Scoring::SigmoidGrouped {
                groups,
                kept_groups,
                scale,
            } => {
                let bias = match bias {
                    Some(b) => {
                        assert_eq!(b.len(), e, "a correction bias an expert");
                        self.weight(b)?
                    }
                    None => Arc::new(self.zeros(e)?),
                };
                let mut group_scores = self.zeros(t * groups)?;
                let [g32, kept32] = [groups, kept_groups].map(|v| v as u32);
                let mut launch = self.stream.launch_builder(&self.router.sigmoid_top_k);
                launch.arg(logits).arg(bias.as_ref()).arg(&mut r.probs);
                launch
                    .arg(&mut group_scores)
                    .arg(&mut r.experts)
                    .arg(&mut r.weights);
                launch.arg(&t32).arg(&e32).arg(&k32).arg(&g32).arg(&kept32);
                launch.arg(&r32).arg(&scale);
                // SAFETY: logits and probs hold t·e f32, bias e,
                // group_scores t·groups, experts and weights t·k; the
                // groups divide e into groups of 2 or more and keep at
                // least k experts (checked); one thread a token.
                unsafe { launch.launch(threads(t)) }
                    .map_err(|err| gpu_error("router_sigmoid_top_k", err))?;
            }
        }
        Ok(r)
    }

    /// `Permutation::from_routing` of each token's experts (n = T·K) on
    /// the GPU: its order, position and counts.
    #[allow(clippy::type_complexity)]
    fn permute_device(
        &self,
        experts: &CudaSlice<u32>,
        e: usize,
    ) -> Result<(CudaSlice<u32>, CudaSlice<u32>, CudaSlice<u32>), EngineError> {
        let n = experts.len();
        let (mut order, mut position) = (self.alloc::<u32>(n)?, self.alloc::<u32>(n)?);
        let mut counts = self.alloc::<u32>(e)?;
        let chunks = n.div_ceil(PERMUTATION_CHUNK);
        let mut chunk_counts = self.alloc::<u32>(chunks * e)?;
        let [n32, e32, c32] = [n, e, PERMUTATION_CHUNK].map(|v| v as u32);
        let f = &self.router;
        let mut launch = self.stream.launch_builder(&f.permutation_chunk_counts);
        launch.arg(experts).arg(&mut chunk_counts);
        launch.arg(&n32).arg(&e32).arg(&c32);
        // SAFETY: experts hold n u32, chunk_counts one a (chunk, expert);
        // one thread a (chunk, expert).
        unsafe { launch.launch(threads(chunks * e)) }
            .map_err(|err| gpu_error("permutation_chunk_counts", err))?;
        let mut launch = self.stream.launch_builder(&f.permutation_counts);
        launch.arg(&chunk_counts).arg(&mut counts);
        launch.arg(&n32).arg(&e32).arg(&c32);
        // SAFETY: as above, counts e u32; one thread an expert.
        unsafe { launch.launch(threads(e)) }.map_err(|err| gpu_error("permutation_counts", err))?;
        let mut launch = self.stream.launch_builder(&f.permutation_place);
        launch.arg(experts).arg(&chunk_counts).arg(&counts);
        launch.arg(&mut order).arg(&mut position);
        launch.arg(&n32).arg(&e32).arg(&c32);
        // SAFETY: as above; order and position hold n u32, and every
        // expert < e (as the top-k kernels write them), so each cursor
        // stays below n; one thread a (chunk, expert).
        unsafe { launch.launch(threads(chunks * e)) }
            .map_err(|err| gpu_error("permutation_place", err))?;
        Ok((order, position, counts))
    }

    /// The load-balancing loss and the z-loss of a layer's counts (E)
    /// and sums (E + 1), on the GPU.
    fn router_losses_device(
        &self,
        counts: &CudaSlice<u32>,
        sums: &CudaSlice<f32>,
        t: usize,
        k: usize,
    ) -> Result<CudaSlice<f32>, EngineError> {
        let e = counts.len();
        assert_eq!(sums.len(), e + 1, "a sum an expert and Σ lse²");
        let mut losses = self.zeros(2)?;
        let [t32, k32, e32] = [t, k, e].map(|v| v as u32);
        let mut launch = self.stream.launch_builder(&self.router.losses);
        launch.arg(counts).arg(sums).arg(&mut losses);
        launch.arg(&t32).arg(&k32).arg(&e32);
        // SAFETY: counts hold e u32, sums e + 1 f32 (asserted), losses 2;
        // one thread.
        unsafe { launch.launch(threads(1)) }.map_err(|err| gpu_error("router_losses", err))?;
        Ok(losses)
    }

    /// (E + 1): each expert's probabilities summed over the tokens, then
    /// the tokens' Σ lse².
    fn router_sums_device(
        &self,
        probs: &CudaSlice<f32>,
        lse: &CudaSlice<f32>,
        t: usize,
        e: usize,
    ) -> Result<CudaSlice<f32>, EngineError> {
        let mut sums = self.zeros(e + 1)?;
        let [t32, e32] = [t, e].map(|v| v as u32);
        let mut launch = self.stream.launch_builder(&self.router.sums);
        launch
            .arg(probs)
            .arg(lse)
            .arg(&mut sums)
            .arg(&t32)
            .arg(&e32);
        // SAFETY: probs holds t·e f32, lse t, sums e + 1; one thread a sum.
        unsafe { launch.launch(threads(e + 1)) }.map_err(|err| gpu_error("router_sums", err))?;
        Ok(sums)
    }

    /// `sums` (E, in GPU memory) += each expert's probabilities over the
    /// routing's tokens, in f64 and token order (the load-balancing loss
    /// over every layer).
    pub(super) fn add_prob_sums_on(
        &self,
        probs: &CudaSlice<f32>,
        sums: &mut CudaSlice<f64>,
    ) -> Result<(), EngineError> {
        let e = sums.len();
        let t = probs.len() / e.max(1);
        assert_eq!(probs.len(), t * e, "a sum an expert");
        let [t32, e32] = [t, e].map(|v| v as u32);
        let mut launch = self.stream.launch_builder(&self.router.add_prob_sums);
        launch.arg(probs).arg(sums).arg(&t32).arg(&e32);
        // SAFETY: probs holds t·e f32 (asserted), the sums e f64; one
        // thread a sum.
        unsafe { launch.launch(threads(e)) }.map_err(|err| gpu_error("add_prob_sums", err))?;
        Ok(())
    }

    /// `math::aux_prob_grad` of a layer's own load-balancing loss, from its
    /// counts (E) on the GPU.
    pub(super) fn aux_prob_grad_device(
        &self,
        counts: &CudaSlice<u32>,
        daux: f32,
        t: usize,
        k: usize,
    ) -> Result<CudaSlice<f32>, EngineError> {
        let e = counts.len();
        let mut aux = self.zeros(e)?;
        let [t32, k32, e32] = [t, k, e].map(|v| v as u32);
        let mut launch = self.stream.launch_builder(&self.router.aux_grad);
        launch.arg(counts).arg(&mut aux).arg(&daux);
        launch.arg(&t32).arg(&k32).arg(&e32);
        // SAFETY: counts and aux hold e values; one thread an expert.
        unsafe { launch.launch(threads(e)) }.map_err(|err| gpu_error("aux_prob_grad", err))?;
        Ok(aux)
    }

    /// `math::router_logits_grad` on the GPU: dlogits (T, E) from the
    /// combine weights' gradient, the load-balancing loss's gradient of
    /// the probabilities (`aux`, E: `math::aux_prob_grad`) and the
    /// z-loss's weight.
    pub(super) fn router_logits_grad_device(
        &self,
        cfg: &RouterConfig,
        routing: &Scored,
        aux: &CudaSlice<f32>,
        dweights: &CudaSlice<f32>,
        dz: f32,
        t: usize,
    ) -> Result<CudaSlice<f32>, EngineError> {
        let (e, k) = (cfg.experts, cfg.top_k);
        assert!(routing.probs.len() == t * e && dweights.len() == t * k && aux.len() == e);
        let mut dlogits = self.zeros(t * e)?;
        let (sigmoid, scale) = match cfg.scoring {
            Scoring::Softmax => (0u32, 1.0f32),
            Scoring::SigmoidGrouped { scale, .. } => (1, scale),
        };
        let [t32, e32, k32, r32] = [t, e, k, cfg.renormalize as usize].map(|v| v as u32);
        let dz2 = dz * 2.0;
        let mut launch = self.stream.launch_builder(&self.router.logits_grad);
        launch
            .arg(&routing.probs)
            .arg(&routing.lse)
            .arg(&routing.experts);
        launch
            .arg(&routing.weights)
            .arg(dweights)
            .arg(aux)
            .arg(&mut dlogits);
        launch.arg(&t32).arg(&e32).arg(&k32).arg(&r32).arg(&sigmoid);
        launch.arg(&scale).arg(&dz2);
        // SAFETY: probs and dlogits hold t·e f32, lse t, experts, weights
        // and dweights t·k (asserted), aux e; one thread a token.
        unsafe { launch.launch(threads(t)) }.map_err(|err| gpu_error("router_logits_grad", err))?;
        Ok(dlogits)
    }

    /// `route_device` from host logits, everything brought back:
    /// what the tests compare with `math::route_logits`.
    pub fn route_host(
        &self,
        cfg: &RouterConfig,
        logits: &[f32],
        bias: Option<&[f32]>,
        t: usize,
    ) -> Result<RouterOut, EngineError> {
        self.bind()?;
        let (e, k) = (cfg.experts, cfg.top_k);
        let dl = self.upload(logits)?;
        let bias = bias.map(|b| b.to_vec());
        let (dev, routing, _) = self.route_device(cfg, &dl, bias.as_deref(), t, true)?;
        let s = &dev.scored;
        let sums_dev = self.router_sums_device(&s.probs, &s.lse, t, e)?;
        let mut h = RouterOut {
            probs: vec![0.0; t * e],
            lse: vec![0.0; t],
            experts: routing.experts,
            weights: vec![0.0; t * k],
            order: vec![0; t * k],
            position: vec![0; t * k],
            counts: routing.counts,
            sums: vec![0.0; e + 1],
            losses: [routing.aux_loss, routing.z_loss],
        };
        self.download(&s.probs, &mut h.probs)?;
        self.download(&s.lse, &mut h.lse)?;
        self.download(&s.weights, &mut h.weights)?;
        self.download_values(&dev.order, &mut h.order)?;
        self.download_values(&dev.position, &mut h.position)?;
        self.download_values(&sums_dev, &mut h.sums)?;
        Ok(h)
    }

    /// `router_logits_grad_device` on a host routing (its probs,
    /// lse, experts, weights and counts or `aux_grad`).
    #[allow(clippy::too_many_arguments)]
    pub fn router_logits_grad_host(
        &self,
        cfg: &RouterConfig,
        routing: &Routing<f32>,
        dweights: &[f32],
        losses: (f32, f32),
        t: usize,
    ) -> Result<Vec<f32>, EngineError> {
        self.bind()?;
        let dev = Scored {
            probs: self.upload(&routing.probs)?,
            lse: self.upload(&routing.lse)?,
            experts: self.upload_values(&routing.experts)?,
            weights: self.upload(&routing.weights)?,
        };
        let dw = self.upload(dweights)?;
        let aux = self.upload(&aux_prob_grad(cfg, losses.0, routing, t))?;
        let dlogits = self.router_logits_grad_device(cfg, &dev, &aux, &dw, losses.1, t)?;
        let mut out = vec![0.0; dlogits.len()];
        self.download(&dlogits, &mut out)?;
        Ok(out)
    }

    /// `aux_prob_grad_device` on host counts, for the kernel checks.
    pub fn aux_prob_grad_host(
        &self,
        counts: &[u32],
        daux: f32,
        t: usize,
        k: usize,
    ) -> Result<Vec<f32>, EngineError> {
        self.bind()?;
        let counts = self.upload_values(counts)?;
        let aux = self.aux_prob_grad_device(&counts, daux, t, k)?;
        let mut host = vec![0.0f32; aux.len()];
        self.download(&aux, &mut host)?;
        Ok(host)
    }

    /// `add_prob_sums_on` on host probabilities (T, E) and sums.
    pub fn add_prob_sums_host(&self, probs: &[f32], sums: &mut [f64]) -> Result<(), EngineError> {
        self.bind()?;
        let (probs, mut dev) = (self.upload(probs)?, self.upload_values(sums)?);
        self.add_prob_sums_on(&probs, &mut dev)?;
        self.download_values(&dev, sums)
    }
}
