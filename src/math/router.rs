//! The router: a linear layer d_model → E, softmax, top-k (any k ≥ 1), the
//! optional renormalization of the top-k weights, and the load-balancing
//! and z losses, with its mirrored backward.

#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use super::{linear_backward, linear_forward, log_sum_exp, Real};

/// Router settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterConfig {
    pub experts: usize,
    pub top_k: usize,
    /// Divide the top-k weights by their sum (Mixtral) or not (Switch).
    pub renormalize: bool,
}

/// What the router decided for a batch, and what its backward needs.
#[derive(Clone, Debug, Default)]
pub struct Routing<R> {
    /// (T, E) softmax probabilities
    pub probs: Vec<R>,
    /// (T) log-sum-exp of each token's router logits
    pub lse: Vec<R>,
    /// (T, K) chosen experts, best first (ties: lower index first)
    pub experts: Vec<u32>,
    /// (T, K) combine weights
    pub weights: Vec<R>,
    /// (E) assignments per expert
    pub counts: Vec<u32>,
    /// Switch/GShard load-balancing loss: E · Σ_e (count_e / (T·K)) · mean_t p_te
    pub aux_loss: R,
    /// Router z-loss: mean_t lse_t²
    pub z_loss: R,
    /// ∂aux/∂p_te, the same for every token t, where the network takes the
    /// load-balancing loss over several layers at once (`lm::AuxLoss`);
    /// `None` (as `router_forward` leaves it): this layer's own `aux_loss`.
    pub aux_grad: Option<Vec<R>>,
}

/// logits (T, E) = x (T, D) · wr (E, D)ᵀ; softmax; top-k; losses.
pub fn router_forward<R: Real>(
    cfg: &RouterConfig,
    routing: &mut Routing<R>,
    x: &[R],
    wr: &[R],
    t: usize,
    d: usize,
) {
    let (e, k) = (cfg.experts, cfg.top_k);
    assert!(k >= 1 && k <= e, "top-k {k} of {e} experts");
    let mut logits = vec![R::zero(); t * e];
    linear_forward(&mut logits, x, wr, t, d, e);
    routing.probs.resize(t * e, R::zero());
    routing.lse.resize(t, R::zero());
    routing.experts.resize(t * k, 0);
    routing.weights.resize(t * k, R::zero());
    routing.counts.clear();
    routing.counts.resize(e, 0);
    let mut z = R::zero();
    for i in 0..t {
        let row = &logits[i * e..(i + 1) * e];
        let lse = log_sum_exp(row);
        for j in 0..e {
            routing.probs[i * e + j] = (row[j] - lse).exp();
        }
        routing.lse[i] = lse;
        z += lse * lse;
        top_k(
            &routing.probs[i * e..(i + 1) * e],
            &mut routing.experts[i * k..(i + 1) * k],
        );
        let mut total = R::zero();
        for s in 0..k {
            let ex = routing.experts[i * k + s] as usize;
            routing.counts[ex] += 1;
            let p = routing.probs[i * e + ex];
            routing.weights[i * k + s] = p;
            total += p;
        }
        if cfg.renormalize {
            for s in 0..k {
                routing.weights[i * k + s] = routing.weights[i * k + s] / total;
            }
        }
    }
    let tf = R::from_f64(t as f64);
    routing.z_loss = z / tf;
    let mut aux = R::zero();
    for j in 0..e {
        let mut mean_p = R::zero();
        for i in 0..t {
            mean_p += routing.probs[i * e + j];
        }
        let frac = R::from_f64(routing.counts[j] as f64 / (t * k) as f64);
        aux += frac * (mean_p / tf);
    }
    routing.aux_loss = R::from_f64(e as f64) * aux;
    routing.aux_grad = None;
}

/// The indices of the `out.len()` largest values, best first; ties go to
/// the lower index.
pub fn top_k<R: Real>(values: &[R], out: &mut [u32]) {
    let k = out.len();
    assert!(k <= values.len());
    for s in 0..k {
        let mut best: Option<usize> = None;
        for (j, &v) in values.iter().enumerate() {
            if out[..s].contains(&(j as u32)) {
                continue;
            }
            // Strictly greater replaces, so ties keep the lower index.
            let better = match best {
                None => true,
                Some(b) => v > values[b],
            };
            if better {
                best = Some(j);
            }
        }
        out[s] = best.expect("k ≤ E") as u32;
    }
}

/// dx (T, D) += …, dwr (E, D) += … from dweights (T, K) and the loss
/// coefficients' upstream gradients.
#[allow(clippy::too_many_arguments)]
pub fn router_backward<R: Real>(
    cfg: &RouterConfig,
    dx: &mut [R],
    dwr: &mut [R],
    dweights: &[R],
    daux: R,
    dz: R,
    routing: &Routing<R>,
    x: &[R],
    wr: &[R],
    t: usize,
    d: usize,
) {
    let (e, k) = (cfg.experts, cfg.top_k);
    let tf = R::from_f64(t as f64);
    let mut dprobs = vec![R::zero(); t * e];
    for i in 0..t {
        let w = &routing.weights[i * k..(i + 1) * k];
        let dw = &dweights[i * k..(i + 1) * k];
        if cfg.renormalize {
            // w_s = p_s / S  ⇒  dp_s = (dw_s − Σ_j dw_j w_j) / S
            let mut total = R::zero();
            let mut dot = R::zero();
            for s in 0..k {
                let ex = routing.experts[i * k + s] as usize;
                total += routing.probs[i * e + ex];
                dot += dw[s] * w[s];
            }
            for s in 0..k {
                let ex = routing.experts[i * k + s] as usize;
                dprobs[i * e + ex] += (dw[s] - dot) / total;
            }
        } else {
            for s in 0..k {
                let ex = routing.experts[i * k + s] as usize;
                dprobs[i * e + ex] += dw[s];
            }
        }
        match &routing.aux_grad {
            Some(grad) => {
                for j in 0..e {
                    dprobs[i * e + j] += daux * grad[j];
                }
            }
            // aux = E Σ_e f_e (1/T) Σ_t p_te  ⇒  ∂/∂p_te = E f_e / T
            None => {
                for j in 0..e {
                    let frac = R::from_f64(routing.counts[j] as f64 / (t * k) as f64);
                    dprobs[i * e + j] += daux * R::from_f64(e as f64) * frac / tf;
                }
            }
        }
    }
    let mut dlogits = vec![R::zero(); t * e];
    for i in 0..t {
        let p = &routing.probs[i * e..(i + 1) * e];
        let dp = &dprobs[i * e..(i + 1) * e];
        let mut dot = R::zero();
        for j in 0..e {
            dot += p[j] * dp[j];
        }
        // z = (1/T) Σ lse² ⇒ ∂z/∂logit_tj = (2/T) lse_t p_tj
        let zscale = dz * R::from_f64(2.0) * routing.lse[i] / tf;
        for j in 0..e {
            dlogits[i * e + j] = p[j] * (dp[j] - dot) + zscale * p[j];
        }
    }
    linear_backward(dx, dwr, &dlogits, x, wr, t, d, e);
}
