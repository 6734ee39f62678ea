//! A training step and the forward passes: each device's (or rank's)
//! micro-batches, the dense gradient clipped and stepped, and the step's
//! metrics.

use std::sync::Arc;

use super::access::Phase;
use super::build::step_schedule;
use super::condensing::{condensed_pass, StepCondense};
use super::pipeline::DeviceRunner;
use super::updates::ClipInput;
use super::{metrics, routed_io, trainable_runs, Engine, EngineConfig, StepMetrics};
use crate::model::{DenseKernels, Evaluation, Network};
use crate::EngineError;

impl Engine {
    /// The mean loss of `batch`, forward only: nothing is updated. It runs
    /// on the first device, or on ranks as processes each rank's part of
    /// the batch. The prefetch schedule restarts at the next step's
    /// forward.
    pub fn evaluate<N: Network>(&mut self, net: &N, batch: &N::Batch) -> Result<f32, EngineError> {
        if self.ranks.is_some() {
            self.check_network(net)?;
            net.validate_batch(batch)?;
            return self.evaluate_rank(net, batch);
        }
        self.forward_pass(
            net,
            batch,
            "Engine::evaluate",
            |net, dense, runner, kernels| net.forward_loss(dense, batch, runner, kernels),
        )
    }

    /// The forward pass of `batch` alone: every token's logits (and its
    /// target, and their mean cross-entropy); nothing is updated. For a
    /// language model, token i of sequence s is row `s · seq_len + i`, its
    /// logits predicting token i + 1.
    ///
    /// ```
    /// use strata::engine::{Engine, EngineConfig};
    /// use strata::lm::{LmConfig, MoeLm, TokenBatch};
    ///
    /// let lm = MoeLm::new(LmConfig::preset("tiny").unwrap()).unwrap();
    /// let mut engine = Engine::new_network(&lm, EngineConfig::default()).unwrap();
    /// let batch = TokenBatch { seq_len: 4, tokens: vec![1, 2, 3, 4, 5], loss_mask: None, doc_starts: None };
    /// let out = engine.forward(&lm, &batch).unwrap();
    /// assert_eq!((out.tokens(), out.width), (4, lm.config().vocab));
    /// let log_probs = out.target_log_probs();
    /// let mean = -log_probs.iter().map(|&l| l as f64).sum::<f64>() / 4.0;
    /// assert!((mean as f32 - out.loss).abs() < 1e-4);
    /// ```
    pub fn forward<N: Network>(
        &mut self,
        net: &N,
        batch: &N::Batch,
    ) -> Result<Evaluation, EngineError> {
        let what = "Engine::forward (every token's logits)";
        self.forward_pass(net, batch, what, |net, dense, runner, kernels| {
            net.forward_eval(dense, batch, runner, kernels)
        })
    }

    /// `pass` (a forward of `batch` alone) on the first device, `what`
    /// naming it where ranks as processes cannot run it.
    fn forward_pass<N: Network, R>(
        &mut self,
        net: &N,
        batch: &N::Batch,
        what: &str,
        pass: impl FnOnce(
            &N,
            &[f32],
            &mut DeviceRunner<'_>,
            &dyn DenseKernels,
        ) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        self.check_network(net)?;
        net.validate_batch(batch)?;
        self.whole_world(what)?;
        self.reset_counters();
        let options = self.pass_options();
        let mut runner =
            DeviceRunner::new(&self.model, &self.shared, &mut self.devices[0], options);
        let out = pass(net, &self.dense, &mut runner, &*self.dense_kernels[0]);
        // The next step starts from its forward again.
        let order = match self.devices.len() {
            1 => {
                let overlapped = self.config.schedule.overlaps(self.device_slots());
                let from = Phase::Forward(0);
                let device = &self.devices[0];
                let (slots, staging) = (&device.slots, (overlapped, device.group));
                device
                    .io
                    .schedule(&self.model, &self.shared, staging, from, slots)
            }
            _ => step_schedule(
                &self.model,
                &self.config,
                self.device_slots(),
                &self.shared.cache,
            ),
        };
        self.shared.cache.set_schedule(order);
        out
    }

    /// One training step of any [`Network`] built on this engine's MoE
    /// layers (see [`Engine::new_network`]).
    pub fn step_network<N>(&mut self, net: &N, batch: &N::Batch) -> Result<StepMetrics, EngineError>
    where
        N: Network + Sync,
        N::Batch: Sync,
    {
        self.check_network(net)?;
        net.validate_batch(batch)?;
        let timeline = self.config.timeline.clone();
        let _span = strata_tiers::TimelineSpan::start(timeline.as_deref(), "step", "step")
            .with_detail(|| format!("step {}", self.step + 1));
        let start = std::time::Instant::now();
        self.shared.cache.take_stats(); // this step's counters start now
        self.shared.cache.store().take_busy();
        self.reset_counters();
        let pcie_before = self.pcie_other_bytes();
        let tokens_total = net.batch_tokens(batch);
        let keep_norm = self
            .residence()
            .map(|_| self.config.clip_grad_norm.is_some());
        let result = self.passes(net, batch, tokens_total, keep_norm);
        let (loss, mut dense_grad, held_norm_sq) = match result {
            Ok(r) => r,
            Err(e) => {
                self.shared.discard_partial();
                return Err(e);
            }
        };
        let ranks = self
            .ranks
            .as_mut()
            .map(|r| &mut *r.comm as &mut dyn crate::comm::Comm);
        let clip = self.config.clip_grad_norm.map(|max_norm| ClipInput {
            max_norm,
            // Frozen tensors have no gradient, as in torch.
            dense_norm_sq: held_norm_sq
                + trainable_runs(dense_grad.len(), &self.frozen)
                    .flat_map(|r| &dense_grad[r])
                    .map(|&g| g as f64 * g as f64)
                    .sum::<f64>(),
            ranks,
        });
        let (finish_stall, clipped) = self.shared.finish_step(clip)?;
        let scale = clipped.map_or(1.0, |c| c.scale.min(1.0));
        if scale < 1.0 {
            dense_grad.iter_mut().for_each(|g| *g *= scale);
        }
        self.devices[0].acc.stall_optimizer_s += finish_stall;
        self.step_dense(&dense_grad, scale)?;
        self.step += 1;
        let processed = net.processed_tokens(batch);
        let mut metrics = self.gather_metrics(processed, loss, start, pcie_before);
        metrics.grad_norm = clipped.map(|c| c.norm);
        self.learn_from_step(&metrics)?;
        Ok(metrics)
    }

    /// The step's metrics from its counters, the condensation's losses
    /// moved on by `loss`.
    fn gather_metrics(
        &mut self,
        processed_tokens: usize,
        loss: f32,
        start: std::time::Instant,
        pcie_before: u64,
    ) -> StepMetrics {
        let stats = self.shared.cache.take_stats();
        let ssd_busy_s = self.shared.cache.store().take_busy().as_secs_f64();
        let mut metrics = metrics::gather(
            self.step,
            processed_tokens,
            loss,
            start.elapsed().as_secs_f64(),
            &stats,
            ssd_busy_s,
            self.devices.iter().map(|d| &d.acc),
        );
        metrics.condense_threshold =
            step_condense(&self.config, None, self.condense_losses).map(|c| c.threshold);
        if loss.is_finite() {
            self.condense_losses = (self.condense_losses.0.or(Some(loss)), Some(loss));
        }
        metrics.bytes_pcie_other = self.pcie_other_bytes() - pcie_before;
        metrics.bytes_ssd_min = routed_io::min_ssd_bytes(
            &self.shared.cache,
            &self.shared.layout,
            &self.model,
            self.shared.train,
            &metrics.tokens_per_expert,
        );
        metrics
    }

    /// What the next steps take from this one's metrics: the placement's
    /// cost model, the exchange's part search, the load pinning reads,
    /// and the routing trace.
    fn learn_from_step(&mut self, metrics: &StepMetrics) -> Result<(), EngineError> {
        if self.devices.len() > 1 {
            // LPT's cost model; ranks' experts stay with their owners.
            self.recalibrate(metrics);
        }
        self.share_cost_over_ranks(metrics)?;
        self.advance_part_search(metrics)?;
        self.prev_load = Some(metrics.tokens_per_expert.clone());
        if let Some(trace) = self.routing_trace.as_mut() {
            for dev in &mut self.devices {
                if let Some(counter) = dev.routing.as_mut() {
                    counter.drain_into(trace);
                }
            }
            trace.steps += 1;
        }
        Ok(())
    }

    /// The step's passes on this engine's devices, or its rank's share;
    /// returns the loss, the dense gradient and (one device) what
    /// [`Engine::end_dense_grad`] returns.
    pub(super) fn passes<N>(
        &mut self,
        net: &N,
        batch: &N::Batch,
        tokens_total: usize,
        keep_norm: Option<bool>,
    ) -> Result<(f32, Vec<f32>, f64), EngineError>
    where
        N: Network + Sync,
        N::Batch: Sync,
    {
        let passes = if self.ranks.is_some() {
            self.passes_rank(net, batch, tokens_total)
        } else if self.config.ranks > 1 {
            return Err(EngineError::Config(format!(
                "EngineConfig::ranks is {}, and this rank has not joined the others: call \
                 Engine::join_ranks with its communicator before the first step",
                self.config.ranks
            )));
        } else if self.devices.len() == 1 {
            return self.passes_one_device(net, batch, tokens_total, keep_norm);
        } else {
            self.passes_devices(net, batch, tokens_total)
        };
        passes.map(|(loss, grad)| (loss, grad, 0.0))
    }

    /// Every micro-batch on the only device; returns the loss and the dense
    /// gradient.
    /// `keep_norm`: see [`Engine::end_dense_grad`]; the third value is
    /// what that returns.
    fn passes_one_device<N: Network>(
        &mut self,
        net: &N,
        batch: &N::Batch,
        tokens_total: usize,
        keep_norm: Option<bool>,
    ) -> Result<(f32, Vec<f32>, f64), EngineError> {
        let parts = net.split_batch(batch, self.config.micro_batches);
        let count = parts.len();
        let mut dense_grad = vec![0.0f32; self.dense.len()];
        let kernels = Arc::clone(&self.dense_kernels[0]);
        kernels.grads_begin(&dense_grad);
        let mut loss = 0.0f32;
        let options = self.pass_options();
        let condense = step_condense(&self.config, self.signatures.as_ref(), self.condense_losses);
        let mut runner =
            DeviceRunner::new(&self.model, &self.shared, &mut self.devices[0], options);
        let mut condensed = 0;
        for (i, part) in parts.iter().enumerate() {
            let (losses, n) = condensed_pass(&mut runner, condense, &self.model, |runner| {
                net.forward_backward(
                    &self.dense,
                    &mut dense_grad,
                    part,
                    tokens_total,
                    count,
                    i + 1 == count,
                    runner,
                    &*kernels,
                )
            })?;
            loss += losses.total;
            condensed += n;
        }
        self.devices[0].acc.condensed += condensed;
        let held_norm_sq = self.end_dense_grad(&*kernels, &mut dense_grad, keep_norm)?;
        Ok((loss, dense_grad, held_norm_sq))
    }
}

/// This step's condensation, where the engine condenses: its threshold
/// from the losses so far.
pub(super) fn step_condense<'a>(
    config: &EngineConfig,
    signatures: Option<&'a crate::condense::SignatureTables>,
    (first, last): (Option<f32>, Option<f32>),
) -> Option<StepCondense<'a>> {
    config.condense.map(|c| StepCondense {
        threshold: c.threshold.at(first, last),
        max_share: c.max_share,
        signatures,
    })
}
