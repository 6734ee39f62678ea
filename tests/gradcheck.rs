//! Finite-difference checks (f64) of every backward in `math`: router
//! (softmax, top-k, renormalization, load-balancing and z losses), the
//! permutation (gather / combine), both expert kinds, RMSNorm and the
//! cross-entropy. Each test takes L = Σ c·out for random c, runs the
//! backward with dout = c, and compares with central differences.

use strata::math::*;

mod common;
use common::{check, dot, values};

fn expert_case(kind: ExpertKind) {
    let (n, d, f) = (3, 4, 5);
    let x = values(n * d, 1, 1.0);
    let params = values(kind.params(d, f), 2, 0.5);
    let c = values(n * d, 3, 1.0);
    let run = |x: &[f64], p: &[f64]| {
        let mut out = vec![0.0; n * d];
        let mut saved = ExpertSaved::default();
        expert_ffn_forward(kind, &mut out, &mut saved, x, p, n, d, f);
        (out, saved)
    };
    let (_, saved) = run(&x, &params);
    let mut dx = vec![0.0; n * d];
    let mut dp = vec![0.0; params.len()];
    expert_ffn_backward(kind, &mut dx, &mut dp, &c, &saved, &x, &params, n, d, f);
    check(&format!("{} dx", kind.name()), &x, &dx, |x| {
        dot(&run(x, &params).0, &c)
    });
    check(&format!("{} dparams", kind.name()), &params, &dp, |p| {
        dot(&run(&x, p).0, &c)
    });
}

#[test]
fn swiglu_expert_gradients_match_finite_differences() {
    expert_case(ExpertKind::SwiGlu);
}

#[test]
fn gelu_expert_gradients_match_finite_differences() {
    expert_case(ExpertKind::Gelu);
}

fn router_case(top_k: usize, renormalize: bool, scoring: Scoring) {
    let (t, d, e) = (5, 4, 6);
    let cfg = RouterConfig {
        experts: e,
        top_k,
        renormalize,
        scoring,
    };
    let x = values(t * d, 11, 1.0);
    let wr = values(e * d, 12, 1.0);
    let bias = values(e, 14, 0.5);
    let bias = (scoring != Scoring::Softmax).then_some(&bias[..]);
    let c = values(t * top_k, 13, 1.0);
    let (alpha, beta) = match scoring {
        Scoring::Softmax => (0.3, 0.05),
        _ => (0.3, 0.0),
    };
    let loss = |x: &[f64], wr: &[f64]| {
        let mut r = Routing::default();
        router_forward(&cfg, &mut r, x, wr, bias, t, d);
        dot(&r.weights, &c) + alpha * r.aux_loss + beta * r.z_loss
    };
    let mut r = Routing::default();
    router_forward(&cfg, &mut r, &x, &wr, bias, t, d);
    let mut dx = vec![0.0; t * d];
    let mut dwr = vec![0.0; e * d];
    router_backward(&cfg, &mut dx, &mut dwr, &c, alpha, beta, &r, &x, &wr, t, d);
    let name = format!("router k={top_k} renorm={renormalize} {scoring:?}");
    check(&format!("{name} dx"), &x, &dx, |x| loss(x, &wr));
    check(&format!("{name} dwr"), &wr, &dwr, |w| loss(&x, w));
}

#[test]
fn router_gradients_match_finite_differences() {
    for (k, renorm) in [(1, false), (2, true), (2, false), (3, true)] {
        router_case(k, renorm, Scoring::Softmax);
    }
}

#[test]
fn sigmoid_router_gradients_match_finite_differences() {
    let grouped = |groups, kept_groups, scale| Scoring::SigmoidGrouped {
        groups,
        kept_groups,
        scale,
    };
    for (k, renorm, scoring) in [
        (2, true, grouped(1, 1, 1.0)),
        (2, true, grouped(3, 2, 2.5)),
        (1, false, grouped(2, 1, 1.5)),
        (3, false, grouped(3, 2, 1.0)),
    ] {
        router_case(k, renorm, scoring);
    }
}

/// The choice of `Scoring::SigmoidGrouped`, worked by hand: biased scores
/// pick the groups and the experts, the unbiased scores weigh them.
#[test]
fn the_sigmoid_router_chooses_by_biased_scores_within_the_best_groups() {
    let logit = |p: f64| (p / (1.0 - p)).ln();
    // Six experts in three groups of two; scores σ(logit) as written.
    let scores = [0.9, 0.1, 0.6, 0.55, 0.7, 0.2];
    let x = [1.0];
    let wr: Vec<f64> = scores.iter().map(|&p| logit(p)).collect();
    let bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.6];
    let cfg = RouterConfig {
        experts: 6,
        top_k: 2,
        renormalize: true,
        scoring: Scoring::SigmoidGrouped {
            groups: 3,
            kept_groups: 1,
            scale: 2.0,
        },
    };
    let mut r = Routing::default();
    // Group sums of two best biased scores: 1.0, 1.15, 1.5: group 2 wins
    // by its bias, and within it expert 5 (0.8 biased) then 4 (0.7).
    router_forward(&cfg, &mut r, &x, &wr, Some(&bias), 1, 1);
    assert_eq!(r.experts, [5, 4]);
    let want = [2.0 * 0.2 / 0.9, 2.0 * 0.7 / 0.9];
    for (w, want) in r.weights.iter().zip(want) {
        assert!((w - want).abs() < 1e-12, "{:?}", r.weights);
    }
    // Without the bias, group 1 (1.15) beats group 0 (1.0) and group 2 (0.9).
    router_forward(&cfg, &mut r, &x, &wr, None, 1, 1);
    assert_eq!(r.experts, [2, 3]);
}

#[test]
fn top_k_is_stable_and_dropless_routing_counts_every_assignment() {
    let mut out = [0u32; 3];
    top_k(&[0.1f64, 0.3, 0.3, 0.2], &mut out);
    assert_eq!(out, [1, 2, 3], "ties go to the lower index");
    let experts_per_token = [2u32, 0, 2, 1, 0, 2];
    let p = Permutation::from_routing(&experts_per_token, 4);
    assert_eq!(p.offsets, vec![0, 2, 3, 6, 6]);
    assert_eq!(p.rows(0), &[1, 4]);
    assert_eq!(p.rows(2), &[0, 2, 5], "token order within an expert");
    assert!(p.rows(3).is_empty());
    assert_eq!(
        p.span(2),
        3..6,
        "an expert's rows of an expert-ordered buffer"
    );
    assert_eq!(
        p.position,
        vec![3, 0, 4, 2, 1, 5],
        "where each assignment's row is"
    );
    for (i, &a) in p.order.iter().enumerate() {
        assert_eq!(p.position[a as usize] as usize, i);
    }
}

#[test]
fn permutation_and_combine_gradients_match() {
    let (t, k, d) = (4, 2, 3);
    // The experts' outputs in expert order, as the combine reads them.
    let experts_per_token = [1u32, 0, 0, 2, 1, 1, 2, 0];
    let perm = Permutation::from_routing(&experts_per_token, 3);
    let per = values(t * k * d, 21, 1.0);
    let w = values(t * k, 22, 1.0);
    let c = values(t * d, 23, 1.0);
    let y_of = |per: &[f64], w: &[f64]| {
        let mut y = vec![0.0; t * d];
        combine_forward(&mut y, per, &perm.position, w, t, k, d);
        dot(&y, &c)
    };
    let mut dw = vec![0.0; t * k];
    combine_backward_weights(&mut dw, &c, &per, &perm.position, t, k, d);
    // Every assignment's output gradient, gathered in expert order.
    let mut dper = vec![0.0; t * k * d];
    AssignmentGrads {
        dy: &c,
        weights: &w,
        k,
        d,
    }
    .gather(&mut dper, &perm.order);
    check("combine dper", &per, &dper, |p| y_of(p, &w));
    check("combine dweights", &w, &dw, |w| y_of(&per, w));

    // gather is linear: its backward must be its adjoint,
    // <gather(x), u> = <x, gatherᵀ(u)>, over a real permutation.
    let x = values(t * d, 24, 1.0);
    let mut rows = vec![0.0; t * k * d];
    gather_forward(&mut rows, &x, &perm.order, k, d);
    // u, the gradient of the gathered rows, in the same (expert) order.
    let u = values(t * k * d, 25, 1.0);
    let mut gx = vec![0.0; t * d];
    gather_backward(&mut gx, &u, &perm.position, t, k, d);
    assert!((dot(&rows, &u) - dot(&x, &gx)).abs() < 1e-12);
}

#[test]
fn rmsnorm_gradients_match_finite_differences() {
    let (t, d) = (3, 5);
    let x = values(t * d, 31, 1.0);
    let g = values(d, 32, 1.0);
    let c = values(t * d, 33, 1.0);
    let run = |x: &[f64], g: &[f64]| {
        let mut out = vec![0.0; t * d];
        let mut inv = vec![0.0; t];
        rmsnorm_forward(&mut out, &mut inv, x, g, t, d, 1e-5);
        (out, inv)
    };
    let (_, inv) = run(&x, &g);
    let mut dx = vec![0.0; t * d];
    let mut dg = vec![0.0; d];
    rmsnorm_backward(&mut dx, &mut dg, &c, &x, &g, &inv, t, d);
    check("rmsnorm dx", &x, &dx, |x| dot(&run(x, &g).0, &c));
    check("rmsnorm dg", &g, &dg, |g| dot(&run(&x, g).0, &c));
}

#[test]
fn cross_entropy_gradient_matches_finite_differences() {
    let (t, v) = (3, 7);
    let logits = values(t * v, 41, 2.0);
    let targets = [0u32, 6, 3];
    let mut dl = vec![0.0; t * v];
    cross_entropy_forward_backward(&mut dl, &logits, &targets, v, 5);
    check("cross-entropy dlogits", &logits, &dl, |z| {
        let mut scratch = vec![0.0; t * v];
        cross_entropy_forward_backward(&mut scratch, z, &targets, v, 5)
    });
}

/// The plain stack reports its router losses as the sums of its layers'
/// (each a mean of squares or of positive products, so above zero: a sum
/// that subtracts a layer shows), and its total as the cross-entropy plus
/// both, each times its coefficient, in one micro-batch or in two.
#[test]
fn the_stack_adds_every_layers_router_losses() {
    let model = common::model(2, ExpertKind::SwiGlu);
    assert_eq!(model.layers, 2);
    // In micro-batches, each adds its share of the router losses.
    for micro_batches in [1, 2] {
        let mut trainer =
            strata::reference::ReferenceTrainer::new(model.clone(), common::hyper()).unwrap();
        let l = trainer
            .step(&common::batch(&model, 0), micro_batches)
            .unwrap();
        assert!(l.z > 0.0 && l.aux > 0.0, "aux {} and z {}", l.aux, l.z);
        let total = l.ce + model.aux_loss_coef * l.aux + model.z_loss_coef * l.z;
        assert!(
            (l.total - total).abs() <= 1e-6 * total,
            "{micro_batches} micro-batches: {} against {total}",
            l.total
        );
    }
}
