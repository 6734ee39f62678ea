//! The plain MoE stack, whole, in f32: per dense tensor (each layer's norm
//! gain, the head), the directional derivative of the training loss along
//! its analytic gradient g must equal |g|, in one micro-batch and in two.
//! The router losses are weighted up (aux 0.1, z 0.05) so that their paths
//! carry a good share of the gradient that reaches each norm gain through
//! its router: a coefficient or a micro-batch share applied wrongly to
//! them shows there.
//!
//! The routers themselves are left out: a step along a router's gradient
//! moves tokens between experts (top-k is not continuous), and at any step
//! that f32 resolves the difference quotient misses (measured: 2.0 of |g|
//! off with no router loss at all). Their math is checked in f64 by
//! `gradcheck.rs`, and against the independent oracle by `oracle_lm.rs`.

use strata::math::ExpertKind;
use strata::model::{Batch, ModelConfig, Network, PlainKernels};
use strata::reference::{MemoryRunner, ReferenceTrainer};

mod common;

fn stack() -> ModelConfig {
    ModelConfig {
        aux_loss_coef: 0.1,
        z_loss_coef: 0.05,
        ..common::model(2, ExpertKind::SwiGlu)
    }
}

/// The training loss of `batch` in `micro_batches` and its dense gradient.
fn loss_and_grad(
    model: &ModelConfig,
    reference: &mut ReferenceTrainer,
    dense: &[f32],
    batch: &Batch,
    micro_batches: usize,
) -> (f64, Vec<f32>) {
    let parts = model.split_batch(batch, micro_batches);
    let mut grad = vec![0.0f32; dense.len()];
    let mut loss = 0.0f64;
    for (i, part) in parts.iter().enumerate() {
        let mut runner = MemoryRunner::new(model, &mut reference.experts);
        let l = model
            .forward_backward(
                dense,
                &mut grad,
                part,
                batch.tokens(),
                parts.len(),
                i + 1 == parts.len(),
                &mut runner,
                &PlainKernels,
            )
            .unwrap();
        loss += l.total as f64;
    }
    (loss, grad)
}

/// As `gradcheck_lm`'s whole network: a central difference of step 1e-2
/// along the unit direction, within 1 % of |g|.
fn whole_stack(micro_batches: usize) {
    let model = stack();
    let mut reference = ReferenceTrainer::new(model.clone(), common::hyper()).unwrap();
    let dense = model.init_dense();
    let batch = common::batch(&model, 0);
    let (_, grad) = loss_and_grad(&model, &mut reference, &dense, &batch, micro_batches);
    let tensors = (0..model.layers)
        .map(|l| (format!("norm {l}"), model.norm_range(l)))
        .chain([("head".to_string(), model.head_range())]);
    for (name, range) in tensors {
        let g = &grad[range.clone()];
        let norm = g.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
        assert!(norm > 1e-3, "{name}: |g| = {norm}");
        let h = 1e-2;
        let mut at = |sign: f64| {
            let mut p = dense.clone();
            for (x, gi) in p[range.clone()].iter_mut().zip(g) {
                *x += (sign * h * *gi as f64 / norm) as f32;
            }
            loss_and_grad(&model, &mut reference, &p, &batch, micro_batches).0
        };
        let numeric = (at(1.0) - at(-1.0)) / (2.0 * h);
        let err = (numeric - norm).abs() / norm;
        eprintln!("{name}, {micro_batches} micro-batches: |g| {norm:.4e} rel err {err:.1e}");
        assert!(
            err < 0.01,
            "{name}, {micro_batches} micro-batches: |g| {norm} but the loss moves at {numeric}"
        );
    }
}

#[test]
fn the_whole_stack_matches_finite_differences() {
    whole_stack(1);
}

#[test]
fn the_whole_stack_in_two_micro_batches_matches_finite_differences() {
    whole_stack(2);
}
