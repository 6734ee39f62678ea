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

/// What the forward keeps for the backward; `M` is the MoE block's (a
/// [`DenseOps::MoeSaved`]).
pub(super) enum FfnSaved<M> {
    Sparse {
        moe: Box<M>,
        shared: Option<MlpSaved>,
    },
    Dense(MlpSaved),
}

impl<M> FfnSaved<M> {
    /// The sparse layer's routing and experts' outputs.
    pub fn moe_mut(&mut self) -> Option<&mut M> {
        match self {
            FfnSaved::Sparse { moe, .. } => Some(moe),
            FfnSaved::Dense(_) => None,
        }
    }
}

/// The FFN of `n` (t, d), the layer's normed input, added to `h`. The MoE
/// block runs on `ops`' activations; a shared expert and a dense layer's
/// MLP on the host's (their input and output copied where `ops` keeps
/// activations on a device).
pub(super) fn forward<O: DenseOps>(
    ops: &O,
    c: &LmConfig,
    moe_model: &ModelConfig,
    ranges: &FfnRanges,
    dense: &[f32],
    n: &O::Buf,
    h: &mut O::Buf,
    runner: &mut dyn ExpertRunner,
) -> Result<FfnSaved<O::MoeSaved>, EngineError> {
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
                Some(sr) => {
                    let (n, f) = (ops.read(n)?, c.shared_expert_ff);
                    let run = |y: &mut [f32]| mlp::forward(dense, sr, &n, y, t, d, f, kernels);
                    Some(ops.on_host(&mut y, run)?)
                }
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
            let (n, t) = (ops.read(n)?, ops.rows(n, d));
            let run = |h: &mut [f32]| mlp::forward(dense, r, &n, h, t, d, c.dense_ff, kernels);
            Ok(FfnSaved::Dense(ops.on_host(h, run)?))
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
    (ranges, saved): (&FfnRanges, &FfnSaved<O::MoeSaved>),
    dense: &[f32],
    (n, dh): (&O::Buf, &O::Buf),
    g: FfnGrads<O::Buf>,
    runner: &mut dyn ExpertRunner,
) -> Result<(), EngineError> {
    let kernels = ops.kernels();
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
                let f = c.shared_expert_ff;
                let (n, dh) = (ops.read(n)?, ops.read(dh)?);
                let dense_grad = &mut *g.dense_grad;
                ops.on_host(g.dn, |dn| {
                    mlp::backward(dense, dense_grad, sr, ss, &n, dn, &dh, t, d, f, kernels)
                })?;
            }
            Ok(())
        }
        (FfnRanges::Dense(r), FfnSaved::Dense(s)) => {
            let f = c.dense_ff;
            let (n, dh) = (ops.read(n)?, ops.read(dh)?);
            let dense_grad = g.dense_grad;
            ops.on_host(g.dn, |dn| {
                mlp::backward(dense, dense_grad, r, s, &n, dn, &dh, t, d, f, kernels)
            })
        }
        _ => unreachable!("a layer's saved FFN is of its own kind"),
    }
}
