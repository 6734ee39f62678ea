//! The model as the engine sees it: the MoE stack's shape and losses
//! ([`ModelConfig`]), its batches, and the traits every network and every
//! expert runner meets ([`Network`], [`ExpertRunner`]), with the dense
//! layers' kernels and operations beside them.
//!
//! The dense part of a MoE layer (norms, routers, head, losses) is written
//! once (`stack.rs`) and shared by the plain reference trainer and the
//! engine; experts run through an [`ExpertRunner`]: all in memory for the
//! reference, through the three tiers and the expert-wise optimizer for
//! the engine.
//!
//! Legend: T tokens, D d_model, F d_ff, E experts, K top-k, V classes.

// Numeric kernels index rows and columns explicitly and take their shapes
// as arguments (T, D, F, …), as llm.c does; the iterator forms these lints
// suggest would hide the shapes.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use crate::backend::DeviceRows;
use crate::math::{AssignmentGrads, ExpertKind, Permutation, RouterConfig, Scoring};
use crate::EngineError;

mod buffer_pool;
mod dense_kernels;
mod dense_ops;
mod dense_residence;
mod host_ops;
mod stack;
mod timed_kernels;
mod token_ids;

pub(crate) use buffer_pool::{F32BufferPool, ScratchBuf, ScratchBuffers};
pub use dense_kernels::{DenseKernels, HeadShape, PlainKernels};
pub use dense_ops::{DenseOps, MoeRouting};
pub use dense_residence::{ranges_without, trainable_parts, DenseResidence};
pub use host_ops::{head_loss_forward_in_blocks, HostOps};
pub use stack::{forward_backward, moe_backward, moe_forward, MoeSaved};
pub use timed_kernels::TimedKernels;
pub use token_ids::{TokenIds, TokenRows};

/// The shape and losses of a MoE stack.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub layers: usize,
    pub d_model: usize,
    pub d_ff: usize,
    pub experts: usize,
    pub top_k: usize,
    /// Renormalize the top-k weights (Mixtral) or not (Switch).
    pub renormalize: bool,
    pub expert_kind: ExpertKind,
    /// Output classes of the head (the vocabulary, for a language model).
    pub classes: usize,
    /// Load-balancing loss coefficient (Switch/GShard form).
    pub aux_loss_coef: f32,
    /// Router z-loss coefficient (0 turns it off).
    pub z_loss_coef: f32,
    /// How the router scores experts (softmax, or sigmoid with group-limited
    /// choice).
    pub scoring: Scoring,
    pub rms_eps: f64,
    /// Seed of the deterministic initialization.
    pub seed: u64,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            layers: 2,
            d_model: 64,
            d_ff: 128,
            experts: 8,
            top_k: 2,
            renormalize: true,
            expert_kind: ExpertKind::SwiGlu,
            classes: 64,
            aux_loss_coef: 0.01,
            z_loss_coef: 0.0,
            scoring: Scoring::Softmax,
            rms_eps: 1e-5,
            seed: 0,
        }
    }
}

impl ModelConfig {
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |why: String| Err(EngineError::Config(why));
        if self.layers == 0 || self.d_model == 0 || self.d_ff == 0 || self.classes == 0 {
            return bad("layers, d_model, d_ff and classes must be at least 1".into());
        }
        if self.experts == 0 {
            return bad("a MoE layer needs at least one expert".into());
        }
        if !(self.aux_loss_coef.is_finite() && self.z_loss_coef.is_finite()) {
            return bad("loss coefficients must be finite".into());
        }
        if self.scoring != Scoring::Softmax && self.z_loss_coef != 0.0 {
            return bad(format!(
                "router_z_loss_coef = {}: the z-loss is a softmax router's; a sigmoid router has none",
                self.z_loss_coef
            ));
        }
        // top_k and the router's own settings.
        self.router().check().or_else(bad)
    }

    pub fn router(&self) -> RouterConfig {
        RouterConfig {
            experts: self.experts,
            top_k: self.top_k,
            renormalize: self.renormalize,
            scoring: self.scoring,
        }
    }

    pub fn expert_params(&self) -> usize {
        self.expert_kind.params(self.d_model, self.d_ff)
    }

    /// Per layer: RMSNorm gain (D), router (E, D); then the head (V, D).
    pub fn dense_params(&self) -> usize {
        self.layers * (self.d_model + self.experts * self.d_model) + self.classes * self.d_model
    }

    fn layer_offset(&self, layer: usize) -> usize {
        layer * (self.d_model + self.experts * self.d_model)
    }

    pub fn norm_range(&self, layer: usize) -> std::ops::Range<usize> {
        let at = self.layer_offset(layer);
        at..at + self.d_model
    }

    pub fn router_range(&self, layer: usize) -> std::ops::Range<usize> {
        let at = self.layer_offset(layer) + self.d_model;
        at..at + self.experts * self.d_model
    }

    pub fn head_range(&self) -> std::ops::Range<usize> {
        let at = self.layer_offset(self.layers);
        at..at + self.classes * self.d_model
    }

    /// The initial dense params: gains 1, routers and head uniform(±1/√D).
    pub fn init_dense(&self) -> Vec<f32> {
        let mut p = vec![0.0f32; self.dense_params()];
        let scale = 1.0 / (self.d_model as f32).sqrt();
        for l in 0..self.layers {
            p[self.norm_range(l)].fill(1.0);
            fill_uniform(&mut p[self.router_range(l)], self.seed, tag(1, l, 0), scale);
        }
        let head = self.head_range();
        fill_uniform(&mut p[head], self.seed, tag(2, 0, 0), scale);
        p
    }

    /// The initial params of one expert, independent of every other expert:
    /// each matrix uniform(±1/√fan_in).
    pub fn init_expert(&self, layer: usize, expert: usize, out: &mut [f32]) {
        let (d, f) = (self.d_model, self.d_ff);
        assert_eq!(out.len(), self.expert_params());
        let in_d = 1.0 / (d as f32).sqrt();
        let in_f = 1.0 / (f as f32).sqrt();
        let (w_in, w2) = out.split_at_mut(out.len() - d * f);
        fill_uniform(w_in, self.seed, tag(3, layer, expert), in_d);
        fill_uniform(w2, self.seed, tag(4, layer, expert), in_f);
    }
}

fn tag(kind: u64, layer: usize, expert: usize) -> u64 {
    (kind << 56) ^ ((layer as u64) << 32) ^ expert as u64
}

/// SplitMix64 stream keyed by (seed, tag): uniform in (−scale, scale).
pub fn fill_uniform(out: &mut [f32], seed: u64, tag: u64, scale: f32) {
    let mut state = seed ^ tag.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491_4f6c_dd1d;
    for x in out.iter_mut() {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let unit = (z >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
        *x = (unit * 2.0 - 1.0) * scale;
    }
}

/// A batch: input rows (T, D) and a target class per row.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub inputs: Vec<f32>,
    pub targets: Vec<u32>,
}

impl Batch {
    pub fn tokens(&self) -> usize {
        self.targets.len()
    }

    /// Checks the batch against the model.
    pub fn validate(&self, model: &ModelConfig) -> Result<(), EngineError> {
        let t = self.targets.len();
        if t == 0 {
            return Err(EngineError::Batch("the batch is empty".into()));
        }
        if self.inputs.len() != t * model.d_model {
            return Err(EngineError::Batch(format!(
                "inputs hold {} values; {t} tokens × d_model {} = {} expected",
                self.inputs.len(),
                model.d_model,
                t * model.d_model
            )));
        }
        if let Some(&bad) = self.targets.iter().find(|&&c| c as usize >= model.classes) {
            return Err(EngineError::Batch(format!(
                "target class {bad} is out of range (the head has {} classes)",
                model.classes
            )));
        }
        if self.inputs.iter().any(|x| !x.is_finite()) {
            return Err(EngineError::Batch("inputs hold a NaN or infinity".into()));
        }
        Ok(())
    }

    /// Splits into `n` micro-batches of (nearly) equal token counts.
    pub fn split(&self, n: usize, d: usize) -> Vec<Batch> {
        let t = self.tokens();
        let n = n.clamp(1, t);
        (0..n)
            .map(|i| {
                let (a, b) = (i * t / n, (i + 1) * t / n);
                Batch {
                    inputs: self.inputs[a * d..b * d].to_vec(),
                    targets: self.targets[a..b].to_vec(),
                }
            })
            .collect()
    }
}

/// Runs a layer's experts. Rows of assignment a = t·K + k are `x[t]`.
pub trait ExpertRunner {
    /// Writes every expert's outputs into `out` (T·K, D) in expert order:
    /// row i is assignment `perm.order[i]`'s, so expert e's rows are the
    /// block `perm.span(e)`, where it can write them in place.
    fn forward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError>;

    /// From the gradient of every assignment's output, `dout` (row a of
    /// (T·K, D), formed as an expert gathers its rows), writes the
    /// gradients of the experts' inputs into `dx` (T·K, D) in expert order,
    /// as `forward_layer` its outputs, and accumulates the experts'
    /// parameter gradients;
    /// `last_micro_batch` says the step's gradients are complete after
    /// this call.
    fn backward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        dout: AssignmentGrads<'_, f32>,
        dx: &mut [f32],
        last_micro_batch: bool,
    ) -> Result<(), EngineError>;

    /// `len` floats for one of a layer's (T·K, D) or (T, D) buffers, each
    /// of which its user writes whole before reading (the experts'
    /// outputs, one row an assignment; the gradients of the experts'
    /// inputs; a norm's input and output, the MoE output, the residual
    /// stream, their gradients): a runner that keeps
    /// buffers between uses hands back one given to `give_buffer`, as it
    /// was left.
    fn take_buffer(&mut self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    /// A buffer from `take_buffer` its user is done with.
    fn give_buffer(&mut self, buf: Vec<f32>) {
        drop(buf);
    }

    /// Says that `range` of the dense gradient `grad` holds its sum for
    /// the whole step: the step's last micro-batch's backward has passed
    /// every tensor in it, and nothing adds to it again. A runner of
    /// several devices may start reducing it over them while the backward
    /// goes on; a range never said final is reduced after the backward,
    /// so saying nothing is always right, only later.
    fn dense_grad_final(&mut self, _grad: &[f32], _range: std::ops::Range<usize>) {}

    /// Whether [`Self::forward_layer_rows`] and
    /// [`Self::backward_layer_rows`] may be called: the experts compute on
    /// the one device whose memory holds a network's activations (a GPU
    /// whose `CudaOps` made them).
    fn takes_device_rows(&self) -> bool {
        false
    }

    /// Whether [`Self::forward_layer_rows`] reads the permutation's
    /// assignments (`order`, `position`: the routing traced, or the next
    /// layer predicted from token pairs), or only each expert's span,
    /// which `Permutation::from_counts` gives without the assignments
    /// leaving the GPU.
    fn needs_assignments(&self) -> bool {
        true
    }

    /// [`Self::forward_layer`] on rows in the device's memory: `rows`
    /// (T·K, D) are the experts' inputs already in expert order (row i is
    /// assignment `perm.order[i]`'s token), and `out` (T·K, D) receives
    /// their outputs in the same order.
    ///
    /// # Safety
    /// Only where [`Self::takes_device_rows`]; `rows` and `out` address
    /// T·K·D f32 each of that device's memory, alive until the call
    /// returns and used by nothing else meanwhile.
    unsafe fn forward_layer_rows(
        &mut self,
        layer: usize,
        perm: &Permutation,
        rows: DeviceRows,
        out: DeviceRows,
    ) -> Result<(), EngineError> {
        let _ = (layer, perm, rows, out);
        Err(host_rows_only())
    }

    /// [`Self::backward_layer`] on rows in the device's memory, each
    /// (T·K, D) in expert order: the experts' inputs `rows`, the gradients
    /// of their outputs `dout`, and `dx`, which receives the gradients of
    /// their inputs.
    ///
    /// # Safety
    /// As [`Self::forward_layer_rows`], for the three rows.
    unsafe fn backward_layer_rows(
        &mut self,
        layer: usize,
        perm: &Permutation,
        [rows, dout, dx]: [DeviceRows; 3],
        last_micro_batch: bool,
    ) -> Result<(), EngineError> {
        let _ = (layer, perm, rows, dout, dx, last_micro_batch);
        Err(host_rows_only())
    }
}

/// The error of a runner asked for rows in device memory that computes
/// from host rows only.
fn host_rows_only() -> EngineError {
    EngineError::Device {
        device: 0,
        why: "these experts compute from host rows only".into(),
    }
}

/// The losses of one micro-batch.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Losses {
    /// Cross-entropy, as this micro-batch's share of the batch mean.
    pub ce: f32,
    pub aux: f32,
    pub z: f32,
    /// ce + aux_coef·aux + z_coef·z, each scaled to its micro-batch share.
    pub total: f32,
}

/// A network whose MoE layers the engine runs: the dense part (everything
/// but the experts) is the network's own, one flat f32 vector; the experts
/// of its `moe()` layers go through an [`ExpertRunner`].
pub trait Network {
    type Batch;
    /// The MoE layers: count, experts, their shape, routing and losses.
    fn moe(&self) -> &ModelConfig;
    /// Length of the flat dense parameter vector.
    fn dense_params(&self) -> usize;
    /// The initial dense parameters.
    fn init_dense(&self) -> Vec<f32>;
    fn validate_batch(&self, batch: &Self::Batch) -> Result<(), EngineError>;
    /// Tokens that carry a loss (the cross-entropy's denominator).
    fn batch_tokens(&self, batch: &Self::Batch) -> usize;
    /// Tokens the batch runs through the model (what throughput counts);
    /// more than `batch_tokens` where some targets carry no loss.
    fn processed_tokens(&self, batch: &Self::Batch) -> usize {
        self.batch_tokens(batch)
    }
    /// Splits into (at most) `n` micro-batches.
    fn split_batch(&self, batch: &Self::Batch, n: usize) -> Vec<Self::Batch>;
    /// Ranges of the dense vector that no optimizer step changes (buffers,
    /// such as a sigmoid router's correction bias), ascending and
    /// disjoint.
    fn frozen_dense(&self) -> Vec<std::ops::Range<usize>> {
        Vec::new()
    }
    /// Forward, loss and backward of one micro-batch: `dense_grad`
    /// accumulates; `tokens_total` and `micro_batches` scale the losses so
    /// micro-batches add up to the full batch.
    fn forward_backward(
        &self,
        dense: &[f32],
        dense_grad: &mut [f32],
        batch: &Self::Batch,
        tokens_total: usize,
        micro_batches: usize,
        last_micro_batch: bool,
        runner: &mut dyn ExpertRunner,
        kernels: &dyn DenseKernels,
    ) -> Result<Losses, EngineError>;
    /// The forward pass alone (evaluation): every token's logits and
    /// target, and their mean cross-entropy.
    fn forward_eval(
        &self,
        dense: &[f32],
        batch: &Self::Batch,
        runner: &mut dyn ExpertRunner,
        kernels: &dyn DenseKernels,
    ) -> Result<Evaluation, EngineError>;

    /// The mean cross-entropy of `batch`, forward only.
    fn forward_loss(
        &self,
        dense: &[f32],
        batch: &Self::Batch,
        runner: &mut dyn ExpertRunner,
        kernels: &dyn DenseKernels,
    ) -> Result<f32, EngineError> {
        Ok(self.forward_eval(dense, batch, runner, kernels)?.loss)
    }
}

/// What a forward pass gives back: for each of its `tokens` (rows in the
/// batch's order), `width` logits and the target, the mean cross-entropy,
/// and the load-balancing loss.
#[derive(Clone, Debug, PartialEq)]
pub struct Evaluation {
    /// (tokens, width), row-major.
    pub logits: Vec<f32>,
    pub targets: Vec<u32>,
    pub width: usize,
    /// The mean cross-entropy.
    pub loss: f32,
    /// The load-balancing loss of the batch, before its coefficient (the
    /// training loss adds `aux_loss_coef` times it).
    pub aux_loss: f32,
}

impl Evaluation {
    pub fn tokens(&self) -> usize {
        self.targets.len()
    }

    /// Each token's log-probability of its target: `log_softmax(logits)[target]`,
    /// in f64 and rounded once; NaN for a target that carries no loss
    /// ([`IGNORED_TARGET`](crate::math::IGNORED_TARGET)).
    pub fn target_log_probs(&self) -> Vec<f32> {
        self.logits
            .chunks_exact(self.width)
            .zip(&self.targets)
            .map(|(row, &target)| {
                if target == crate::math::IGNORED_TARGET {
                    return f32::NAN;
                }
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
                let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
                (row[target as usize] as f64 - max - sum.ln()) as f32
            })
            .collect()
    }
}
