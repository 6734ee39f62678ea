//! An oracle for the language model that shares no code with the engine:
//! the Mixtral-architecture LM (token embedding; per layer RMSNorm, causal
//! grouped-query attention with rotary embeddings, RMSNorm, a top-k
//! routed MoE of SwiGLU experts; final RMSNorm; LM head; next-token
//! cross-entropy; the Switch load-balancing loss and the router z-loss)
//! written plainly in f64 from its definition, forward and backward.
//!
//! It takes the engine's parameters by their Hugging Face names and each
//! expert's flat vector in the documented `w1 | w3 | w2` layout, so the
//! only things it shares with strata are those two contracts. Its own
//! backward is held to central differences of its own forward in
//! `tests/oracle_lm.rs`.
//!
//! The loss of a step split into P parts (micro-batches × devices), as
//! strata defines it: Σ_parts CE_part / T + (1/P) Σ_parts Σ_layers
//! (aux_coef · aux + z_coef · z), where T counts the whole step's
//! predicted tokens and each part routes, counts and takes its own aux
//! and z over its own tokens.

// Shapes are taken as arguments and indexed explicitly.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments, dead_code)]

pub mod ops;

use ops::*;

/// The model's shape and loss settings.
#[derive(Clone, Debug)]
pub struct Shape {
    pub vocab: usize,
    pub d: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub hd: usize,
    pub ff: usize,
    pub experts: usize,
    pub top_k: usize,
    pub renormalize: bool,
    pub theta: f64,
    pub eps: f64,
    pub tied: bool,
    pub aux_coef: f64,
    /// transformers' load-balancing loss: one term over every layer's
    /// router probabilities concatenated, E · Σ_e (C_e / N) · (S_e / N), C_e
    /// the assignments to e and S_e its probabilities summed over the L
    /// layers and T tokens, N = L·T. Otherwise one Switch loss a layer,
    /// summed.
    pub aux_all_layers: bool,
    pub z_coef: f64,
}

#[derive(Clone, Debug)]
pub struct Expert {
    pub w1: Vec<f64>,
    pub w3: Vec<f64>,
    pub w2: Vec<f64>,
}

#[derive(Clone, Debug)]
pub struct Layer {
    pub attn_norm: Vec<f64>,
    pub wq: Vec<f64>,
    pub wk: Vec<f64>,
    pub wv: Vec<f64>,
    pub wo: Vec<f64>,
    pub moe_norm: Vec<f64>,
    pub router: Vec<f64>,
    pub experts: Vec<Expert>,
}

/// Every parameter (or every gradient) of the model.
#[derive(Clone, Debug)]
pub struct Params {
    pub embed: Vec<f64>,
    pub layers: Vec<Layer>,
    pub final_norm: Vec<f64>,
    /// Empty when the head is tied to the embedding.
    pub head: Vec<f64>,
}

impl Params {
    pub fn zeros(s: &Shape) -> Self {
        let z = |n: usize| vec![0.0; n];
        let (q, kv) = (s.heads * s.hd, s.kv_heads * s.hd);
        Params {
            embed: z(s.vocab * s.d),
            layers: (0..s.layers)
                .map(|_| Layer {
                    attn_norm: z(s.d),
                    wq: z(q * s.d),
                    wk: z(kv * s.d),
                    wv: z(kv * s.d),
                    wo: z(s.d * q),
                    moe_norm: z(s.d),
                    router: z(s.experts * s.d),
                    experts: (0..s.experts)
                        .map(|_| Expert {
                            w1: z(s.ff * s.d),
                            w3: z(s.ff * s.d),
                            w2: z(s.d * s.ff),
                        })
                        .collect(),
                })
                .collect(),
            final_norm: z(s.d),
            head: if s.tied { Vec::new() } else { z(s.vocab * s.d) },
        }
    }

    /// Every tensor with its Hugging Face name; experts' matrices are
    /// named `…experts.{e}.w1` etc.
    pub fn named_mut(&mut self) -> Vec<(String, &mut Vec<f64>)> {
        let mut out: Vec<(String, &mut Vec<f64>)> =
            vec![("model.embed_tokens.weight".into(), &mut self.embed)];
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let p = format!("model.layers.{l}");
            out.push((format!("{p}.input_layernorm.weight"), &mut layer.attn_norm));
            out.push((format!("{p}.self_attn.q_proj.weight"), &mut layer.wq));
            out.push((format!("{p}.self_attn.k_proj.weight"), &mut layer.wk));
            out.push((format!("{p}.self_attn.v_proj.weight"), &mut layer.wv));
            out.push((format!("{p}.self_attn.o_proj.weight"), &mut layer.wo));
            out.push((
                format!("{p}.post_attention_layernorm.weight"),
                &mut layer.moe_norm,
            ));
            out.push((
                format!("{p}.block_sparse_moe.gate.weight"),
                &mut layer.router,
            ));
            for (e, x) in layer.experts.iter_mut().enumerate() {
                let q = format!("{p}.block_sparse_moe.experts.{e}");
                out.push((format!("{q}.w1"), &mut x.w1));
                out.push((format!("{q}.w3"), &mut x.w3));
                out.push((format!("{q}.w2"), &mut x.w2));
            }
        }
        out.push(("model.norm.weight".into(), &mut self.final_norm));
        if !self.head.is_empty() {
            out.push(("lm_head.weight".into(), &mut self.head));
        }
        out
    }

    pub fn named(&self) -> Vec<(String, Vec<f64>)> {
        self.clone()
            .named_mut()
            .into_iter()
            .map(|(n, v)| (n, v.clone()))
            .collect()
    }
}

/// B sequences of S + 1 tokens: position i predicts i + 1.
#[derive(Clone, Debug)]
pub struct Part {
    pub seq_len: usize,
    pub tokens: Vec<u32>,
}

impl Part {
    fn seqs(&self) -> usize {
        self.tokens.len() / (self.seq_len + 1)
    }

    fn inputs_targets(&self) -> (Vec<u32>, Vec<u32>) {
        let s = self.seq_len;
        let rows = self.tokens.chunks(s + 1);
        let inputs = rows.clone().flat_map(|r| r[..s].to_vec()).collect();
        let targets = rows.flat_map(|r| r[1..].to_vec()).collect();
        (inputs, targets)
    }
}

/// A step's losses, summed over its parts as the engine reports them.
#[derive(Clone, Copy, Debug, Default)]
pub struct Losses {
    pub ce: f64,
    /// Σ over parts and layers of the load-balancing loss, / P.
    pub aux: f64,
    /// Σ over parts and layers of the z-loss, / P.
    pub z: f64,
    pub total: f64,
    /// The smallest gap between a row's k-th and (k+1)-th router
    /// probability: how far the routing is from a tie.
    pub routing_margin: f64,
}

/// The logits (T, V) of one part's forward, row i predicting token i + 1.
pub fn logits(s: &Shape, p: &Params, part: &Part) -> Vec<f64> {
    let t = part.seqs() * part.seq_len;
    forward(s, p, part, t).logits
}

/// The loss of a step of `parts` and, with `grads`, its gradient.
pub fn step(s: &Shape, p: &Params, parts: &[Part], mut grads: Option<&mut Params>) -> Losses {
    let t_total: usize = parts.iter().map(|x| x.seqs() * x.seq_len).sum();
    let share = 1.0 / parts.len() as f64;
    let mut sum = Losses {
        routing_margin: f64::INFINITY,
        ..Losses::default()
    };
    for part in parts {
        let tape = forward(s, p, part, t_total);
        sum.ce += tape.ce;
        sum.aux += share
            * match s.aux_all_layers {
                true => all_layers_aux(s, &tape),
                false => tape.layers.iter().map(|l| l.moe.aux).sum::<f64>(),
            };
        sum.z += share * tape.layers.iter().map(|l| l.moe.z).sum::<f64>();
        sum.routing_margin = sum.routing_margin.min(tape.margin);
        if let Some(g) = grads.as_deref_mut() {
            backward(s, p, part, &tape, t_total, share, g);
        }
    }
    sum.total = sum.ce + s.aux_coef * sum.aux + s.z_coef * sum.z;
    sum
}

/// transformers' `load_balancing_loss_func` on one part's concatenated
/// router probabilities (see `Shape::aux_all_layers`).
fn all_layers_aux(s: &Shape, tape: &Tape) -> f64 {
    let e = s.experts;
    let n = (tape.layers.len() * tape.inputs.len()) as f64;
    let mut total = 0.0;
    for c in 0..e {
        let assigned: f64 = tape.layers.iter().map(|l| l.moe.counts[c] as f64).sum();
        let prob: f64 = tape
            .layers
            .iter()
            .map(|l| l.moe.probs.iter().skip(c).step_by(e).sum::<f64>())
            .sum();
        total += (assigned / n) * (prob / n);
    }
    e as f64 * total
}

struct MoeTape {
    /// (T, E) router probabilities, and each row's log-sum-exp.
    probs: Vec<f64>,
    lse: Vec<f64>,
    /// (T, K) the chosen experts and their combine weights.
    chosen: Vec<usize>,
    weights: Vec<f64>,
    /// Per (T, K): the expert's output and pre-activations.
    outs: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)>,
    counts: Vec<usize>,
    aux: f64,
    z: f64,
}

struct LayerTape {
    h_in: Vec<f64>,
    n1: Vec<f64>,
    r1: Vec<f64>,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    probs: Vec<f64>,
    attn: Vec<f64>,
    h_mid: Vec<f64>,
    n2: Vec<f64>,
    r2: Vec<f64>,
    moe: MoeTape,
}

struct Tape {
    inputs: Vec<u32>,
    targets: Vec<u32>,
    layers: Vec<LayerTape>,
    h: Vec<f64>,
    nf: Vec<f64>,
    rf: Vec<f64>,
    logits: Vec<f64>,
    ce: f64,
    margin: f64,
}

fn head(s: &Shape, p: &Params) -> Vec<f64> {
    if s.tied {
        p.embed.clone()
    } else {
        p.head.clone()
    }
}

fn forward(s: &Shape, p: &Params, part: &Part, t_total: usize) -> Tape {
    let (d, v) = (s.d, s.vocab);
    let (inputs, targets) = part.inputs_targets();
    let t = inputs.len();
    let (qw, kw) = (s.heads * s.hd, s.kv_heads * s.hd);
    let mut h: Vec<f64> = inputs
        .iter()
        .flat_map(|&tok| p.embed[tok as usize * d..][..d].to_vec())
        .collect();
    let mut layers = Vec::new();
    let mut margin = f64::INFINITY;
    for lp in &p.layers {
        let h_in = h.clone();
        let (n1, r1) = rmsnorm(&h, &lp.attn_norm, t, d, s.eps);
        let mut q = linear(&n1, &lp.wq, t, d, qw);
        let mut k = linear(&n1, &lp.wk, t, d, kw);
        let vv = linear(&n1, &lp.wv, t, d, kw);
        rope(&mut q, part.seq_len, s.heads, s.hd, s.theta, false);
        rope(&mut k, part.seq_len, s.kv_heads, s.hd, s.theta, false);
        let (attn, probs) = attention(
            &q,
            &k,
            &vv,
            part.seqs(),
            part.seq_len,
            s.heads,
            s.kv_heads,
            s.hd,
        );
        let o = linear(&attn, &lp.wo, t, qw, d);
        h.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let h_mid = h.clone();
        let (n2, r2) = rmsnorm(&h, &lp.moe_norm, t, d, s.eps);
        let (y, moe, m) = moe_forward(s, lp, &n2, t);
        margin = margin.min(m);
        h.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
        layers.push(LayerTape {
            h_in,
            n1,
            r1,
            q,
            k,
            v: vv,
            probs,
            attn,
            h_mid,
            n2,
            r2,
            moe,
        });
    }
    let (nf, rf) = rmsnorm(&h, &p.final_norm, t, d, s.eps);
    let logits = linear(&nf, &head(s, p), t, d, v);
    let ce = (0..t)
        .map(|i| {
            let row = &logits[i * v..(i + 1) * v];
            log_sum_exp(row) - row[targets[i] as usize]
        })
        .sum::<f64>()
        / t_total as f64;
    Tape {
        inputs,
        targets,
        layers,
        h,
        nf,
        rf,
        logits,
        ce,
        margin,
    }
}

/// The MoE block on x (T, D): returns its output, tape and routing margin.
fn moe_forward(s: &Shape, lp: &Layer, x: &[f64], t: usize) -> (Vec<f64>, MoeTape, f64) {
    let (d, e, k) = (s.d, s.experts, s.top_k);
    let logits = linear(x, &lp.router, t, d, e);
    let mut tape = MoeTape {
        probs: Vec::new(),
        lse: Vec::new(),
        chosen: Vec::new(),
        weights: Vec::new(),
        outs: Vec::new(),
        counts: vec![0; e],
        aux: 0.0,
        z: 0.0,
    };
    let mut margin = f64::INFINITY;
    let mut y = vec![0.0; t * d];
    for i in 0..t {
        let row = &logits[i * e..(i + 1) * e];
        let p = softmax(row);
        tape.lse.push(log_sum_exp(row));
        // Highest probability first; equal ones in expert order.
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        if k < e {
            margin = margin.min(p[order[k - 1]] - p[order[k]]);
        }
        let chosen = &order[..k];
        let sum: f64 = chosen.iter().map(|&c| p[c]).sum();
        for &c in chosen {
            let w = if s.renormalize { p[c] / sum } else { p[c] };
            let ex = &lp.experts[c];
            let xi = &x[i * d..(i + 1) * d];
            let out = swiglu(xi, &ex.w1, &ex.w3, &ex.w2, d, s.ff);
            for j in 0..d {
                y[i * d + j] += w * out.0[j];
            }
            tape.counts[c] += 1;
            tape.chosen.push(c);
            tape.weights.push(w);
            tape.outs.push(out);
        }
        tape.probs.extend(p);
    }
    // Switch Transformer's load-balancing loss: E · Σ_e f_e · P_e, f_e the
    // share of the T·K assignments that went to e, P_e its mean probability.
    tape.aux = (0..e)
        .map(|c| {
            let f = tape.counts[c] as f64 / (t * k) as f64;
            let mean_p = (0..t).map(|i| tape.probs[i * e + c]).sum::<f64>() / t as f64;
            f * mean_p
        })
        .sum::<f64>()
        * e as f64;
    tape.z = tape.lse.iter().map(|l| l * l).sum::<f64>() / t as f64;
    (y, tape, margin)
}

fn backward(
    s: &Shape,
    p: &Params,
    part: &Part,
    tape: &Tape,
    t_total: usize,
    share: f64,
    g: &mut Params,
) {
    let (d, v) = (s.d, s.vocab);
    let t = tape.inputs.len();
    let (qw, kw) = (s.heads * s.hd, s.kv_heads * s.hd);
    // With the all-layers aux: ∂aux/∂p_{l,i,e} = E · C_e / N², for every
    // layer l and token i (C_e: assignments to e over all layers).
    let all_layers: Option<Vec<f64>> = s.aux_all_layers.then(|| {
        let n = (tape.layers.len() * t) as f64;
        (0..s.experts)
            .map(|c| {
                let assigned: f64 = tape.layers.iter().map(|l| l.moe.counts[c] as f64).sum();
                s.experts as f64 * assigned / (n * n)
            })
            .collect()
    });
    // CE = Σ_rows (lse − logit_target) / T_total
    let mut dlogits = vec![0.0; t * v];
    for i in 0..t {
        let pr = softmax(&tape.logits[i * v..(i + 1) * v]);
        for j in 0..v {
            let onehot = if j == tape.targets[i] as usize {
                1.0
            } else {
                0.0
            };
            dlogits[i * v + j] = (pr[j] - onehot) / t_total as f64;
        }
    }
    let mut dnf = vec![0.0; t * d];
    let mut dhead = vec![0.0; v * d];
    linear_back(
        &mut dnf,
        &mut dhead,
        &dlogits,
        &tape.nf,
        &head(s, p),
        t,
        d,
        v,
    );
    let target = if s.tied { &mut g.embed } else { &mut g.head };
    target.iter_mut().zip(&dhead).for_each(|(a, b)| *a += b);
    let mut dh = vec![0.0; t * d];
    rmsnorm_back(
        &mut dh,
        &mut g.final_norm,
        &dnf,
        &tape.h,
        &p.final_norm,
        &tape.rf,
        t,
        d,
    );
    for (l, lt) in tape.layers.iter().enumerate().rev() {
        let (lp, lg) = (&p.layers[l], &mut g.layers[l]);
        // h = h_mid + MoE(norm2(h_mid))
        let mut dn2 = vec![0.0; t * d];
        moe_backward(
            s,
            lp,
            lg,
            &mut dn2,
            &dh,
            &lt.n2,
            &lt.moe,
            t,
            share,
            &all_layers,
        );
        rmsnorm_back(
            &mut dh,
            &mut lg.moe_norm,
            &dn2,
            &lt.h_mid,
            &lp.moe_norm,
            &lt.r2,
            t,
            d,
        );
        // h_mid = h_in + Wo · attention(rope(Wq n1), rope(Wk n1), Wv n1)
        let mut dattn = vec![0.0; t * qw];
        linear_back(&mut dattn, &mut lg.wo, &dh, &lt.attn, &lp.wo, t, qw, d);
        let (mut dq, mut dk, mut dv) = (vec![0.0; t * qw], vec![0.0; t * kw], vec![0.0; t * kw]);
        attention_back(
            &mut dq,
            &mut dk,
            &mut dv,
            &dattn,
            &lt.probs,
            &lt.q,
            &lt.k,
            &lt.v,
            part.seqs(),
            part.seq_len,
            s.heads,
            s.kv_heads,
            s.hd,
        );
        rope(&mut dq, part.seq_len, s.heads, s.hd, s.theta, true);
        rope(&mut dk, part.seq_len, s.kv_heads, s.hd, s.theta, true);
        let mut dn1 = vec![0.0; t * d];
        linear_back(&mut dn1, &mut lg.wq, &dq, &lt.n1, &lp.wq, t, d, qw);
        linear_back(&mut dn1, &mut lg.wk, &dk, &lt.n1, &lp.wk, t, d, kw);
        linear_back(&mut dn1, &mut lg.wv, &dv, &lt.n1, &lp.wv, t, d, kw);
        rmsnorm_back(
            &mut dh,
            &mut lg.attn_norm,
            &dn1,
            &lt.h_in,
            &lp.attn_norm,
            &lt.r1,
            t,
            d,
        );
    }
    for (i, &tok) in tape.inputs.iter().enumerate() {
        for j in 0..d {
            g.embed[tok as usize * d + j] += dh[i * d + j];
        }
    }
}

/// dx += …, and the router's and experts' gradients, for [`moe_forward`]
/// given dy; `share` scales the aux and z terms (1 / parts).
fn moe_backward(
    s: &Shape,
    lp: &Layer,
    lg: &mut Layer,
    dx: &mut [f64],
    dy: &[f64],
    x: &[f64],
    tape: &MoeTape,
    t: usize,
    share: f64,
    all_layers: &Option<Vec<f64>>,
) {
    let (d, e, k, f) = (s.d, s.experts, s.top_k, s.ff);
    let mut dlogits = vec![0.0; t * e];
    for i in 0..t {
        let dyi = &dy[i * d..(i + 1) * d];
        let xi = &x[i * d..(i + 1) * d];
        // y_i = Σ_slots w · expert(x_i)
        let mut dw = vec![0.0; k];
        for slot in 0..k {
            let a = i * k + slot;
            let (c, w) = (tape.chosen[a], tape.weights[a]);
            let (out, pre_a, pre_b) = &tape.outs[a];
            dw[slot] = (0..d).map(|j| dyi[j] * out[j]).sum();
            let dout: Vec<f64> = dyi.iter().map(|g| w * g).collect();
            let (ex, eg) = (&lp.experts[c], &mut lg.experts[c]);
            swiglu_back(
                &mut dx[i * d..(i + 1) * d],
                [&mut eg.w1, &mut eg.w3, &mut eg.w2],
                &dout,
                xi,
                [&ex.w1, &ex.w3, &ex.w2],
                pre_a,
                pre_b,
                d,
                f,
            );
        }
        let pi = &tape.probs[i * e..(i + 1) * e];
        let mut dp = vec![0.0; e];
        let chosen = &tape.chosen[i * k..(i + 1) * k];
        if s.renormalize {
            // w_s = p_s / Σ_chosen p: ∂w_j/∂p_s = δ_js / Σ − w_j / Σ
            let sum: f64 = chosen.iter().map(|&c| pi[c]).sum();
            let dot: f64 = (0..k).map(|j| dw[j] * tape.weights[i * k + j]).sum();
            for slot in 0..k {
                dp[chosen[slot]] += (dw[slot] - dot) / sum;
            }
        } else {
            for slot in 0..k {
                dp[chosen[slot]] += dw[slot];
            }
        }
        // aux = E Σ_e f_e (1/T) Σ_i p_ie, with f_e held constant (or the
        // all-layers form's derivative)
        for c in 0..e {
            let daux = match all_layers {
                Some(g) => g[c],
                None => e as f64 * (tape.counts[c] as f64 / (t * k) as f64) / t as f64,
            };
            dp[c] += share * s.aux_coef * daux;
        }
        let dl = softmax_back(pi, &dp);
        for c in 0..e {
            // z = (1/T) Σ_i lse_i², ∂lse_i/∂logit_ic = p_ic
            let dz = share * s.z_coef * 2.0 * tape.lse[i] * pi[c] / t as f64;
            dlogits[i * e + c] = dl[c] + dz;
        }
    }
    linear_back(dx, &mut lg.router, &dlogits, x, &lp.router, t, d, e);
}
