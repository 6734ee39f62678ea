//! A decoder layer's second half, `h ← h + FFN(RMSNorm(h))`: the MoE
//! block (router, the engine's experts, and Qwen2-MoE's shared expert
//! beside them) in a sparse layer, a dense SwiGLU MLP in a dense one.

// Numeric code takes its shapes as arguments, as llm.c does.
#![allow(clippy::too_many_arguments)]

use std::ops::Range;

use super::config::LmConfig;
use super::mlp::{self, MlpRanges, MlpSaved};
use crate::model::{DenseOps, ExpertRunner, ModelConfig};
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

/// What the forward keeps for the backward, in buffers `B` of a
/// [`DenseOps`]; `M` is the MoE block's (a [`DenseOps::MoeSaved`]).
pub(super) enum FfnSaved<B, M> {
    Sparse {
        moe: Box<M>,
        shared: Option<MlpSaved<B>>,
    },
    Dense(MlpSaved<B>),
}

impl<B, M> FfnSaved<B, M> {
    /// The sparse layer's routing and experts' outputs.
    pub fn moe_mut(&mut self) -> Option<&mut M> {
        match self {
            FfnSaved::Sparse { moe, .. } => Some(moe),
            FfnSaved::Dense(_) => None,
        }
    }
}

/// The FFN of `n` (t, d), the layer's normed input, added to `h`, on
/// `ops`' activations.
pub(super) fn forward<O: DenseOps>(
    ops: &O,
    c: &LmConfig,
    moe_model: &ModelConfig,
    ranges: &FfnRanges,
    dense: &[f32],
    n: &O::Buf,
    h: &mut O::Buf,
    runner: &mut dyn ExpertRunner,
) -> Result<FfnSaved<O::Buf, O::MoeSaved>, EngineError> {
    let kernels = ops.kernels();
    let d = c.d_model;
    match ranges {
        FfnRanges::Sparse {
            moe_layer,
            router,
            choice_bias,
            shared,
        } => {
            let bias = choice_bias.as_ref().map(|b| &dense[b.clone()]);
            let router = &dense[router.clone()];
            let t = ops.rows(n, d);
            let (mut y, moe) =
                ops.moe_forward(moe_model, *moe_layer, (router, bias), n, t, runner)?;
            let shared = match shared {
                Some(sr) => Some(mlp::forward(
                    ops,
                    dense,
                    sr,
                    n,
                    &mut y,
                    (t, d, c.shared_expert_ff),
                )?),
                None => None,
            };
            let _span = kernels.host_span("residual");
            ops.add_assign(h, &y)?;
            ops.moe_output_done(y, runner);
            Ok(FfnSaved::Sparse {
                moe: Box::new(moe),
                shared,
            })
        }
        FfnRanges::Dense(r) => {
            let t = ops.rows(n, d);
            Ok(FfnSaved::Dense(mlp::forward(
                ops,
                dense,
                r,
                n,
                h,
                (t, d, c.dense_ff),
            )?))
        }
    }
}

/// Where the FFN's backward puts what it computes.
pub(super) struct FfnGrads<'a, B> {
    pub dense_grad: &'a mut [f32],
    pub dn: &'a mut B,
    /// The load-balancing and z-loss terms' weights in this micro-batch's
    /// loss.
    pub daux: f32,
    pub dz: f32,
    pub last_micro_batch: bool,
}

/// The backward of `forward` from `dh`, the gradient of its output:
/// `g.dn` receives the gradient of its input `n`, the router and dense
/// tensors theirs, and the experts' gradients go to the runner.
pub(super) fn backward<O: DenseOps>(
    ops: &O,
    c: &LmConfig,
    moe_model: &ModelConfig,
    (ranges, saved): (&FfnRanges, &FfnSaved<O::Buf, O::MoeSaved>),
    dense: &[f32],
    (n, dh): (&O::Buf, &O::Buf),
    g: FfnGrads<O::Buf>,
    runner: &mut dyn ExpertRunner,
) -> Result<(), EngineError> {
    let (t, d) = (ops.rows(n, c.d_model), c.d_model);
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
            let router = (&dense[router.clone()], &mut g.dense_grad[router.clone()]);
            let losses = (g.daux, g.dz);
            let grads = (&mut *g.dn, dh, n);
            let last = g.last_micro_batch;
            ops.moe_backward(
                moe_model, *moe_layer, router, grads, moe, losses, runner, last,
            )?;
            if let (Some(sr), Some(ss)) = (shared, shared_saved) {
                let shape = (t, d, c.shared_expert_ff);
                let (params, io) = ((dense, &mut *g.dense_grad), (n, &mut *g.dn, dh));
                mlp::backward(ops, params, sr, ss, io, shape)?;
            }
            Ok(())
        }
        (FfnRanges::Dense(r), FfnSaved::Dense(s)) => {
            let (params, io) = ((dense, g.dense_grad), (n, g.dn, dh));
            mlp::backward(ops, params, r, s, io, (t, d, c.dense_ff))
        }
        _ => unreachable!("a layer's saved FFN is of its own kind"),
    }
}
