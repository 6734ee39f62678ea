//! The router's kernels against `math::router` and `math::permute`.

use strata::math::{RouterConfig, Routing, Scoring};

use super::{f32s, worst, KernelHost};

/// The router's kernels after the logits, every scoring, against
/// `math::route_logits`, `Permutation::from_routing` and
/// `math::router_logits_grad`: the choices, the permutation and the counts
/// exact (ties included: duplicated logits); scores, weights, sums and
/// gradients within 1e-5 of values of order one (expf within 2 ulps);
/// the f64 probability sums exact (the same f32 values added in the same
/// order).
pub fn router_kernels(h: &dyn KernelHost) {
    use strata::math::{
        add_prob_sums, aux_prob_grad, balance_loss, route_logits, router_logits_grad, Permutation,
    };
    // 111 to 333 assignments: chunks of the permutation's 64 with a
    // partial last one, so an expert's assignments span several chunks.
    let (t, e) = (111, 8);
    let mut logits = f32s(t * e, 41, 3.0);
    // Ties: a token whose experts all score alike, and one with two pairs.
    logits[5 * e..6 * e].fill(0.25);
    let (a, b) = (logits[9 * e + 1], logits[9 * e + 6]);
    logits[9 * e + 4] = a;
    logits[9 * e + 7] = b;
    let bias = f32s(e, 42, 0.3);
    let sigmoid = |groups, kept_groups| Scoring::SigmoidGrouped {
        groups,
        kept_groups,
        scale: 2.5,
    };
    let cases = [
        (Scoring::Softmax, 2, true, None),
        (Scoring::Softmax, 3, false, None),
        (sigmoid(4, 2), 2, true, Some(&bias[..])),
        (sigmoid(4, 2), 3, false, Some(&bias[..])),
        (sigmoid(2, 1), 2, true, None),
        (sigmoid(1, 1), 1, true, Some(&bias[..])),
    ];
    for (scoring, k, renormalize, bias) in cases {
        let name = format!(
            "{scoring:?}, top-{k}, renormalize {renormalize}, bias {}",
            bias.is_some()
        );
        let cfg = RouterConfig {
            experts: e,
            top_k: k,
            renormalize,
            scoring,
        };
        let mut want = Routing::default();
        route_logits(&cfg, &mut want, &logits, bias, t);
        let got = h.route(&cfg, &logits, bias, t);
        assert_eq!(got.experts, want.experts, "{name}");
        assert_eq!(got.counts, want.counts, "{name}");
        let perm = Permutation::from_routing(&want.experts, e);
        assert_eq!(
            (&got.order, &got.position),
            (&perm.order, &perm.position),
            "{name}"
        );
        assert!(worst(&got.probs, &want.probs) < 1e-5, "{name}");
        assert!(worst(&got.lse, &want.lse) < 1e-5, "{name}");
        assert!(worst(&got.weights, &want.weights) < 1e-5, "{name}");
        let aux = balance_loss(&got.counts, &got.sums[..e], t, k);
        let z = got.sums[e] / t as f32;
        // The sums are the device's own probabilities and lse added in
        // token order, to the bit (a real GPU's expf may move the values
        // themselves by ulps, not their sums' order).
        let mut column = vec![0.0f32; e + 1];
        for (i, row) in got.probs.chunks_exact(e).enumerate() {
            for (c, &p) in column.iter_mut().zip(row) {
                *c += p;
            }
            column[e] += got.lse[i] * got.lse[i];
        }
        assert_eq!(got.sums, column, "{name}: the sums' order");
        // The losses the GPU computes from its counts and sums: the host's
        // functions' bits on the same values.
        assert_eq!(
            got.losses.map(f32::to_bits),
            [aux, z].map(f32::to_bits),
            "{name}"
        );
        assert!(
            (aux - want.aux_loss).abs() < 1e-5 * want.aux_loss.abs().max(1.0),
            "{name}"
        );
        assert!(
            (z - want.z_loss).abs() < 1e-5 * want.z_loss.abs().max(1.0),
            "{name}"
        );

        // A layer's own load-balancing gradient, made from its counts on
        // the device: the host's bits.
        let own = aux_prob_grad(&cfg, 0.37, &want, t);
        let got_aux = h.aux_prob_grad(&want.counts, 0.37, t, k);
        assert_eq!(got_aux, own, "{name}: the load-balancing gradient");
        let dweights = f32s(t * k, 43, 1.0);
        for aux_grad in [None, Some(f32s(e, 44, 0.1))] {
            want.aux_grad = aux_grad;
            let dl = router_logits_grad(&cfg, &dweights, 0.3, 0.7, &want, t);
            let got = h.router_logits_grad(&cfg, &want, &dweights, (0.3, 0.7), t);
            assert!(worst(&got, &dl) < 1e-5, "{name}: {}", worst(&got, &dl));
        }

        let mut sums = vec![0.5f64; e];
        let mut want_sums = sums.clone();
        add_prob_sums(&want.probs, &mut want_sums);
        h.add_prob_sums(&want.probs, &mut sums);
        assert_eq!(sums, want_sums, "{name}");
    }
}
