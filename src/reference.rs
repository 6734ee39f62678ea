//! The plain reference trainer: every parameter in memory, f32, no tiers,
//! no scheduler, no threads. Experts run through the plain loops of
//! `math`; AdamW is the scalar oracle of `strata-optim` (itself held to
//! an f64 evaluation of the formula). The engine must match it.
//!
//! An expert that received no token in a step has no gradient and is not
//! stepped (as `torch.optim.AdamW` skips parameters whose `.grad` is None),
//! so each expert keeps its own AdamW step count.

// Numeric kernels index rows and columns explicitly and take their shapes
// as arguments (T, D, F, …), as llm.c does; the iterator forms these lints
// suggest would hide the shapes.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use strata_optim::{adamw_step, AdamWHyper, CopyOut, GradRef, Kernel, StepScalars};

use crate::math::{expert_ffn_backward, expert_ffn_forward, ExpertSaved, Permutation};
use crate::model::{Batch, ExpertRunner, Losses, ModelConfig, Network, PlainKernels};
use crate::EngineError;

/// One expert's params, moments, gradient and step count.
#[derive(Clone, Debug)]
pub struct ExpertState {
    pub params: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub grad: Vec<f32>,
    pub step: u64,
    /// Received at least one token in the current step.
    pub touched: bool,
}

pub struct ReferenceTrainer {
    pub model: ModelConfig,
    pub hyper: AdamWHyper,
    pub dense: Vec<f32>,
    dense_m: Vec<f32>,
    dense_v: Vec<f32>,
    pub dense_step: u64,
    /// `[layer][expert]`
    pub experts: Vec<Vec<ExpertState>>,
}

/// Runs experts held in memory with the plain loops; the backward adds
/// each expert's gradient to its `grad` and marks it touched.
pub struct MemoryRunner<'a> {
    model: &'a ModelConfig,
    experts: &'a mut [Vec<ExpertState>],
    /// [layer][expert] what the forward saved, for the backward
    saved: Vec<Vec<ExpertSaved<f32>>>,
}

impl<'a> MemoryRunner<'a> {
    /// `experts[layer][expert]`, as `ReferenceTrainer::experts`.
    pub fn new(model: &'a ModelConfig, experts: &'a mut [Vec<ExpertState>]) -> Self {
        Self {
            saved: vec![vec![ExpertSaved::default(); model.experts]; model.layers],
            model,
            experts,
        }
    }
}

fn gather(x: &[f32], rows: &[u32], k: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows.len() * d];
    crate::math::gather_forward(&mut out, x, rows, k, d);
    out
}

impl ExpertRunner for MemoryRunner<'_> {
    fn forward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let (d, f, k) = (self.model.d_model, self.model.d_ff, self.model.top_k);
        for e in 0..self.model.experts {
            let rows = perm.rows(e);
            if rows.is_empty() {
                continue;
            }
            let xe = gather(x, rows, k, d);
            let ye = perm.block_mut(out, e, d);
            let expert = &self.experts[layer][e];
            let saved = &mut self.saved[layer][e];
            expert_ffn_forward(
                self.model.expert_kind,
                ye,
                saved,
                &xe,
                &expert.params,
                rows.len(),
                d,
                f,
            );
        }
        Ok(())
    }

    fn backward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        dout: crate::math::AssignmentGrads<'_, f32>,
        dx: &mut [f32],
        _last_micro_batch: bool,
    ) -> Result<(), EngineError> {
        let (d, f, k) = (self.model.d_model, self.model.d_ff, self.model.top_k);
        for e in 0..self.model.experts {
            let rows = perm.rows(e);
            if rows.is_empty() {
                continue;
            }
            let xe = gather(x, rows, k, d);
            let mut dye = vec![0.0f32; rows.len() * d];
            dout.gather(&mut dye, rows);
            // The plain backward adds to it.
            let dxe = perm.block_mut(dx, e, d);
            dxe.fill(0.0);
            let expert = &mut self.experts[layer][e];
            expert.touched = true;
            let saved = &self.saved[layer][e];
            expert_ffn_backward(
                self.model.expert_kind,
                dxe,
                &mut expert.grad,
                &dye,
                saved,
                &xe,
                &expert.params,
                rows.len(),
                d,
                f,
            );
        }
        Ok(())
    }
}

impl ReferenceTrainer {
    pub fn new(model: ModelConfig, hyper: AdamWHyper) -> Result<Self, EngineError> {
        Self::new_network(&model, hyper)
    }

    /// The reference for any [`Network`]: its dense params from
    /// `init_dense`, its MoE layers' experts in memory.
    pub fn new_network<N: Network>(net: &N, hyper: AdamWHyper) -> Result<Self, EngineError> {
        let model = net.moe().clone();
        model.validate()?;
        hyper
            .validate()
            .map_err(|e| EngineError::Config(e.to_string()))?;
        let n = model.expert_params();
        let experts = (0..model.layers)
            .map(|l| {
                (0..model.experts)
                    .map(|e| {
                        let mut params = vec![0.0f32; n];
                        model.init_expert(l, e, &mut params);
                        ExpertState {
                            params,
                            m: vec![0.0; n],
                            v: vec![0.0; n],
                            grad: vec![0.0; n],
                            step: 0,
                            touched: false,
                        }
                    })
                    .collect()
            })
            .collect();
        let dense = net.init_dense();
        let dn = dense.len();
        Ok(Self {
            model,
            hyper,
            dense,
            dense_m: vec![0.0; dn],
            dense_v: vec![0.0; dn],
            dense_step: 0,
            experts,
        })
    }

    /// One optimizer step over `batch`, split into `micro_batches`.
    pub fn step(&mut self, batch: &Batch, micro_batches: usize) -> Result<Losses, EngineError> {
        let model = self.model.clone();
        self.step_network(&model, batch, micro_batches)
    }

    /// One optimizer step of `net` (built with `new_network`).
    pub fn step_network<N: Network>(
        &mut self,
        net: &N,
        batch: &N::Batch,
        micro_batches: usize,
    ) -> Result<Losses, EngineError> {
        net.validate_batch(batch)?;
        let parts = net.split_batch(batch, micro_batches);
        let tokens_total = net.batch_tokens(batch);
        let count = parts.len();
        let mut dense_grad = vec![0.0f32; self.dense.len()];
        let mut losses = Losses::default();
        for (i, part) in parts.iter().enumerate() {
            let mut runner = MemoryRunner::new(&self.model, &mut self.experts);
            let l = net.forward_backward(
                &self.dense,
                &mut dense_grad,
                part,
                tokens_total,
                count,
                i + 1 == count,
                &mut runner,
                &PlainKernels,
            )?;
            losses.ce += l.ce;
            losses.aux += l.aux / count as f32;
            losses.z += l.z / count as f32;
            losses.total += l.total;
        }
        self.dense_step += 1;
        let s = StepScalars::new(&self.hyper, self.dense_step, 1.0);
        adamw_step(
            Kernel::Scalar,
            &s,
            &mut self.dense,
            &mut self.dense_m,
            &mut self.dense_v,
            GradRef::F32(&dense_grad),
            CopyOut::None,
        )
        .expect("dense buffers have equal lengths");
        for expert in self.experts.iter_mut().flatten() {
            if !expert.touched {
                continue;
            }
            expert.step += 1;
            let s = StepScalars::new(&self.hyper, expert.step, 1.0);
            adamw_step(
                Kernel::Scalar,
                &s,
                &mut expert.params,
                &mut expert.m,
                &mut expert.v,
                GradRef::F32(&expert.grad),
                CopyOut::None,
            )
            .expect("expert buffers have equal lengths");
            expert.grad.fill(0.0);
            expert.touched = false;
        }
        Ok(losses)
    }
}
