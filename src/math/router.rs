//! The router: a linear layer d_model → E, softmax (or sigmoid scores with
//! a correction bias and group-limited choice), top-k (any k ≥ 1), the
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
    pub scoring: Scoring,
}

/// How the router scores experts and picks a token's k.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum Scoring {
    /// A softmax over the experts; the k most probable (Mixtral, Qwen,
    /// OLMoE).
    #[default]
    Softmax,
    /// σ(logit) for each expert (DeepSeek-V3, GLM-4.5). Experts are chosen
    /// by score plus a per-layer correction bias (a constant: no gradient
    /// reaches it), among the `kept_groups` of `groups` equal groups of
    /// experts whose two best biased scores sum highest; the weights are
    /// the chosen experts' scores (renormalized, plus 1e-20 in the sum,
    /// where `renormalize`) times `scale`. The router has no z-loss here.
    SigmoidGrouped {
        groups: usize,
        kept_groups: usize,
        scale: f32,
    },
}

impl RouterConfig {
    /// What is wrong with these settings, if anything.
    pub fn check(&self) -> Result<(), String> {
        let (e, k) = (self.experts, self.top_k);
        if !(1..=e).contains(&k) {
            return Err(format!(
                "top_k = {k} must be between 1 and the number of experts ({e})"
            ));
        }
        if let Scoring::SigmoidGrouped {
            groups,
            kept_groups,
            scale,
        } = self.scoring
        {
            if groups == 0 || !e.is_multiple_of(groups) || e / groups < 2 {
                return Err(format!(
                    "n_group = {groups} must divide the {e} experts into groups of at least 2"
                ));
            }
            if !(1..=groups).contains(&kept_groups) || kept_groups * (e / groups) < k {
                return Err(format!(
                    "topk_group = {kept_groups} must be between 1 and n_group = {groups} \
                     and keep at least top_k = {k} experts"
                ));
            }
            if !(scale.is_finite() && scale > 0.0) {
                return Err(format!(
                    "routed_scaling_factor = {scale} must be positive and finite"
                ));
            }
        }
        Ok(())
    }
}

/// What the router decided for a batch, and what its backward needs.
#[derive(Clone, Debug, Default)]
pub struct Routing<R> {
    /// (T, E) softmax probabilities (sigmoid scores under
    /// `Scoring::SigmoidGrouped`)
    pub probs: Vec<R>,
    /// (T) log-sum-exp of each token's router logits (0 under
    /// `Scoring::SigmoidGrouped`)
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

/// logits (T, E) = x (T, D) · wr (E, D)ᵀ; scores; top-k; losses.
/// `choice_bias` (E), the correction bias of `Scoring::SigmoidGrouped`
/// (`None`: zeros), is added to the scores for the choice alone.
pub fn router_forward<R: Real>(
    cfg: &RouterConfig,
    routing: &mut Routing<R>,
    x: &[R],
    wr: &[R],
    choice_bias: Option<&[R]>,
    t: usize,
    d: usize,
) {
    let mut logits = vec![R::zero(); t * cfg.experts];
    linear_forward(&mut logits, x, wr, t, d, cfg.experts);
    route_logits(cfg, routing, &logits, choice_bias, t);
}

/// [`router_forward`] from its logits (T, E), however they were computed:
/// scores, top-k, losses.
pub fn route_logits<R: Real>(
    cfg: &RouterConfig,
    routing: &mut Routing<R>,
    logits: &[R],
    choice_bias: Option<&[R]>,
    t: usize,
) {
    let (e, k) = (cfg.experts, cfg.top_k);
    if let Err(why) = cfg.check() {
        panic!("{why}");
    }
    assert!(
        choice_bias.is_none_or(|b| b.len() == e),
        "a correction bias for each of the {e} experts"
    );
    assert_eq!(logits.len(), t * e, "logits (T, E)");
    routing.probs.resize(t * e, R::zero());
    routing.lse.resize(t, R::zero());
    routing.experts.resize(t * k, 0);
    routing.weights.resize(t * k, R::zero());
    routing.counts.clear();
    routing.counts.resize(e, 0);
    let mut z = R::zero();
    for i in 0..t {
        let row = &logits[i * e..(i + 1) * e];
        let chosen = &mut routing.experts[i * k..(i + 1) * k];
        let probs = &mut routing.probs[i * e..(i + 1) * e];
        match cfg.scoring {
            Scoring::Softmax => {
                let lse = log_sum_exp(row);
                for j in 0..e {
                    probs[j] = (row[j] - lse).exp();
                }
                routing.lse[i] = lse;
                z += lse * lse;
                top_k(probs, chosen);
            }
            Scoring::SigmoidGrouped {
                groups,
                kept_groups,
                ..
            } => {
                for j in 0..e {
                    probs[j] = R::one() / (R::one() + (-row[j]).exp());
                }
                routing.lse[i] = R::zero();
                grouped_top_k(probs, choice_bias, groups, kept_groups, chosen);
            }
        }
        let mut total = R::zero();
        for s in 0..k {
            let ex = routing.experts[i * k + s] as usize;
            routing.counts[ex] += 1;
            let p = routing.probs[i * e + ex];
            routing.weights[i * k + s] = p;
            total += p;
        }
        let w = &mut routing.weights[i * k..(i + 1) * k];
        match cfg.scoring {
            Scoring::Softmax => {
                if cfg.renormalize {
                    w.iter_mut().for_each(|w| *w = *w / total);
                }
            }
            Scoring::SigmoidGrouped { scale, .. } => {
                let scale = R::from_f64(scale as f64);
                let total = total + R::from_f64(SIGMOID_RENORM_EPS);
                for w in w.iter_mut() {
                    if cfg.renormalize {
                        *w = *w / total;
                    }
                    *w *= scale;
                }
            }
        }
    }
    let tf = R::from_f64(t as f64);
    routing.z_loss = z / tf;
    let prob_sums: Vec<R> = (0..e)
        .map(|j| (0..t).fold(R::zero(), |sum, i| sum + routing.probs[i * e + j]))
        .collect();
    routing.aux_loss = balance_loss(&routing.counts, &prob_sums, t, k);
    routing.aux_grad = None;
}

/// The Switch/GShard load-balancing loss of one layer from its
/// assignments per expert and its probabilities summed over the T tokens
/// (each expert's column summed in token order):
/// E · Σ_e (count_e / (T·K)) · (sum_e / T).
pub fn balance_loss<R: Real>(counts: &[u32], prob_sums: &[R], t: usize, k: usize) -> R {
    assert_eq!(counts.len(), prob_sums.len(), "a count and a sum an expert");
    let tf = R::from_f64(t as f64);
    let mut aux = R::zero();
    for (&count, &sum) in counts.iter().zip(prob_sums) {
        let frac = R::from_f64(count as f64 / (t * k) as f64);
        aux += frac * (sum / tf);
    }
    R::from_f64(counts.len() as f64) * aux
}

/// `sums` (E) += each expert's probabilities (`probs`, (T, E)) over the
/// tokens, in f64 and token order: the load-balancing loss over several
/// layers at once (`lm::AuxLoss::AllLayers`) sums every layer's this way.
pub fn add_prob_sums<R: Real>(probs: &[R], sums: &mut [f64]) {
    let e = sums.len();
    assert!(
        e > 0 && !probs.is_empty() && probs.len().is_multiple_of(e),
        "probabilities (T, E) for E = {e}"
    );
    for row in probs.chunks_exact(e) {
        for (sum, &p) in sums.iter_mut().zip(row) {
            *sum += p.to_f64();
        }
    }
}

/// What the load-balancing loss (weighted `daux`) adds to ∂/∂p of each
/// expert, the same for every token: `daux · aux_grad` where the network
/// set it, else this layer's own, E · count_e / (T·K) / T.
pub fn aux_prob_grad<R: Real>(
    cfg: &RouterConfig,
    daux: R,
    routing: &Routing<R>,
    t: usize,
) -> Vec<R> {
    let (e, k) = (cfg.experts, cfg.top_k);
    match &routing.aux_grad {
        Some(grad) => grad.iter().map(|&g| daux * g).collect(),
        // aux = E Σ_e f_e (1/T) Σ_t p_te  ⇒  ∂/∂p_te = E f_e / T
        None => {
            let tf = R::from_f64(t as f64);
            (0..e)
                .map(|j| {
                    let frac = R::from_f64(routing.counts[j] as f64 / (t * k) as f64);
                    daux * R::from_f64(e as f64) * frac / tf
                })
                .collect()
        }
    }
}

/// What the sigmoid router adds to the chosen scores' sum before dividing
/// by it (DeepSeek-V3's and GLM-4.5's, in transformers).
const SIGMOID_RENORM_EPS: f64 = 1e-20;

/// The k experts of `Scoring::SigmoidGrouped`, best first by biased score:
/// the `kept` groups with the largest sums of their two best biased scores
/// (ties: the lower group), then the k best biased scores within them.
fn grouped_top_k<R: Real>(
    scores: &[R],
    bias: Option<&[R]>,
    groups: usize,
    kept: usize,
    out: &mut [u32],
) {
    let choice: Vec<R> = match bias {
        Some(b) => scores.iter().zip(b).map(|(&s, &b)| s + b).collect(),
        None => scores.to_vec(),
    };
    let size = choice.len() / groups;
    let group_scores: Vec<R> = choice
        .chunks_exact(size)
        .map(|g| {
            let mut best = [0u32; 2];
            top_k(g, &mut best);
            g[best[0] as usize] + g[best[1] as usize]
        })
        .collect();
    let mut kept_groups = vec![0u32; kept];
    top_k(&group_scores, &mut kept_groups);
    let excluded = R::from_f64(f64::NEG_INFINITY);
    let masked: Vec<R> = (0..choice.len())
        .map(|j| match kept_groups.contains(&((j / size) as u32)) {
            true => choice[j],
            false => excluded,
        })
        .collect();
    top_k(&masked, out);
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
    let dlogits = router_logits_grad(cfg, dweights, daux, dz, routing, t);
    linear_backward(dx, dwr, &dlogits, x, wr, t, d, cfg.experts);
}

/// d logits (T, E) of [`router_backward`], before the logits' GEMM takes
/// them back to dx and dwr.
pub fn router_logits_grad<R: Real>(
    cfg: &RouterConfig,
    dweights: &[R],
    daux: R,
    dz: R,
    routing: &Routing<R>,
    t: usize,
) -> Vec<R> {
    let (e, k) = (cfg.experts, cfg.top_k);
    let tf = R::from_f64(t as f64);
    let aux = aux_prob_grad(cfg, daux, routing, t);
    let mut dprobs = vec![R::zero(); t * e];
    for i in 0..t {
        let w = &routing.weights[i * k..(i + 1) * k];
        let dw = &dweights[i * k..(i + 1) * k];
        let (scale, eps) = match cfg.scoring {
            Scoring::Softmax => (None, R::zero()),
            Scoring::SigmoidGrouped { scale, .. } => (
                Some(R::from_f64(scale as f64)),
                R::from_f64(SIGMOID_RENORM_EPS),
            ),
        };
        if cfg.renormalize {
            // w_s = a · p_s / S  ⇒  dp_s = a · (dw_s − Σ_j dw_j w_j / a) / S
            let mut total = eps;
            let mut dot = R::zero();
            for s in 0..k {
                let ex = routing.experts[i * k + s] as usize;
                total += routing.probs[i * e + ex];
                dot += dw[s] * w[s];
            }
            for s in 0..k {
                let ex = routing.experts[i * k + s] as usize;
                dprobs[i * e + ex] += match scale {
                    None => (dw[s] - dot) / total,
                    Some(a) => a * (dw[s] - dot / a) / total,
                };
            }
        } else {
            for s in 0..k {
                let ex = routing.experts[i * k + s] as usize;
                dprobs[i * e + ex] += match scale {
                    None => dw[s],
                    Some(a) => a * dw[s],
                };
            }
        }
        for (dp, &a) in dprobs[i * e..(i + 1) * e].iter_mut().zip(&aux) {
            *dp += a;
        }
    }
    let mut dlogits = vec![R::zero(); t * e];
    for i in 0..t {
        let p = &routing.probs[i * e..(i + 1) * e];
        let dp = &dprobs[i * e..(i + 1) * e];
        if let Scoring::SigmoidGrouped { .. } = cfg.scoring {
            // p = σ(logit) ⇒ ∂p/∂logit = p (1 − p)
            for j in 0..e {
                dlogits[i * e + j] = dp[j] * p[j] * (R::one() - p[j]);
            }
            continue;
        }
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
    dlogits
}
