//! A decoder layer's second half, `h ← h + FFN(RMSNorm(h))`: the MoE
//! block (router, the engine's experts, and Qwen2-MoE's shared expert
//! beside them) in a sparse layer, a dense SwiGLU MLP in a dense one.

// Numeric code takes its shapes as arguments, as llm.c does.
#![allow(clippy::too_many_arguments)]

use std::ops::Range;

use super::config::LmConfig;
use super::mlp::{self, MlpRanges, MlpSaved};
use crate::model::{moe_backward, moe_forward, DenseKernels, ExpertRunner, ModelConfig, MoeSaved};
use crate::EngineError;

/// Where one layer's FFN is in the dense vector.
#[derive(Clone, Debug)]
pub(super) enum FfnRanges {
    /// The router of the engine's MoE layer `moe_layer` (its experts are
    /// the engine's), and a shared expert where the family has one.
    Sparse {
        moe_layer: usize,
        router: Range<usize>,
        /// A sigmoid router's correction bias.
        choice_bias: Option<Range<usize>>,
        shared: Option<MlpRanges>,
    },
    /// A dense layer's MLP, of width `LmConfig::dense_ff`.
    Dense(MlpRanges),
}

/// What the forward keeps for the backward.
pub(super) enum FfnSaved {
    Sparse {
        moe: Box<MoeSaved>,
        shared: Option<MlpSaved>,
    },
    Dense(MlpSaved),
}

impl FfnSaved {
    /// The sparse layer's routing and experts' outputs.
    pub fn moe_mut(&mut self) -> Option<&mut MoeSaved> {
        match self {
            FfnSaved::Sparse { moe, .. } => Some(moe),
            FfnSaved::Dense(_) => None,
        }
    }

    /// Hands the experts' output buffer back to the runner (after the
    /// backward).
    pub fn release(&mut self, runner: &mut dyn ExpertRunner) {
        if let Some(moe) = self.moe_mut() {
            runner.give_buffer(std::mem::take(&mut moe.expert_out));
        }
    }
}

/// The FFN of `n` (t, d), the layer's normed input, added to `h`.
pub(super) fn forward(
    c: &LmConfig,
    moe_model: &ModelConfig,
    ranges: &FfnRanges,
    dense: &[f32],
    n: &[f32],
    h: &mut [f32],
    runner: &mut dyn ExpertRunner,
    kernels: &dyn DenseKernels,
) -> Result<FfnSaved, EngineError> {
    let (t, d) = (n.len() / c.d_model, c.d_model);
    match ranges {
        FfnRanges::Sparse {
            moe_layer,
            router,
            choice_bias,
            shared,
        } => {
            let bias = choice_bias.as_ref().map(|b| &dense[b.clone()]);
            let router = &dense[router.clone()];
            let (mut y, moe) =
                moe_forward(moe_model, *moe_layer, router, bias, n, t, runner, kernels)?;
            let shared = match shared {
                Some(sr) => {
                    let f = c.shared_expert_ff;
                    Some(mlp::forward(dense, sr, n, &mut y, t, d, f, kernels)?)
                }
                None => None,
            };
            let _span = kernels.host_span("residual");
            h.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
            runner.give_buffer(y);
            Ok(FfnSaved::Sparse {
                moe: Box::new(moe),
                shared,
            })
        }
        FfnRanges::Dense(r) => Ok(FfnSaved::Dense(mlp::forward(
            dense, r, n, h, t, d, c.dense_ff, kernels,
        )?)),
    }
}

/// Where the FFN's backward puts what it computes.
pub(super) struct FfnGrads<'a> {
    pub dense_grad: &'a mut [f32],
    pub dn: &'a mut [f32],
    /// The load-balancing and z-loss terms' weights in this micro-batch's
    /// loss.
    pub daux: f32,
    pub dz: f32,
    pub last_micro_batch: bool,
}

/// The backward of `forward` from `dh`, the gradient of its output:
/// `g.dn` receives the gradient of its input `n`, the router and dense
/// tensors theirs, and the experts' gradients go to the runner.
pub(super) fn backward(
    c: &LmConfig,
    moe_model: &ModelConfig,
    ranges: &FfnRanges,
    saved: &FfnSaved,
    dense: &[f32],
    n: &[f32],
    dh: &[f32],
    g: FfnGrads,
    runner: &mut dyn ExpertRunner,
    kernels: &dyn DenseKernels,
) -> Result<(), EngineError> {
    let (t, d) = (n.len() / c.d_model, c.d_model);
    match (ranges, saved) {
        (
            FfnRanges::Sparse {
                moe_layer,
                router,
                shared,
                ..
            },
            FfnSaved::Sparse {
                moe,
                shared: shared_saved,
            },
        ) => {
            moe_backward(
                moe_model,
                *moe_layer,
                &dense[router.clone()],
                &mut g.dense_grad[router.clone()],
                g.dn,
                dh,
                n,
                moe,
                t,
                g.daux,
                g.dz,
                runner,
                g.last_micro_batch,
                kernels,
            )?;
            if let (Some(sr), Some(ss)) = (shared, shared_saved) {
                let f = c.shared_expert_ff;
                mlp::backward(dense, g.dense_grad, sr, ss, n, g.dn, dh, t, d, f, kernels)?;
            }
            Ok(())
        }
        (FfnRanges::Dense(r), FfnSaved::Dense(s)) => {
            let f = c.dense_ff;
            mlp::backward(dense, g.dense_grad, r, s, n, g.dn, dh, t, d, f, kernels)
        }
        _ => unreachable!("a layer's saved FFN is of its own kind"),
    }
}
