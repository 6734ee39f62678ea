//! The oracle's operations in f64, each forward beside its backward,
//! written from their definitions (Hugging Face's Mixtral modelling code
//! and the papers it cites), not from strata's `math`, `model` or `lm`.
//!
//! Matrices are row-major; a weight `w` of shape (n, k) maps a row of k
//! inputs to n outputs as `y = x · wᵀ`, as `torch.nn.Linear` does.

// Shapes are taken as arguments and indexed explicitly, so that each line
// reads as the formula it implements.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments, dead_code)]

/// y (m, n) = x (m, k) · w (n, k)ᵀ
pub fn linear(x: &[f64], w: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    assert_eq!((x.len(), w.len()), (m * k, n * k));
    let mut y = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            y[i * n + j] = (0..k).map(|p| x[i * k + p] * w[j * k + p]).sum();
        }
    }
    y
}

/// dx (m, k) += dy · w;  dw (n, k) += dyᵀ · x
pub fn linear_back(
    dx: &mut [f64],
    dw: &mut [f64],
    dy: &[f64],
    x: &[f64],
    w: &[f64],
    m: usize,
    k: usize,
    n: usize,
) {
    for i in 0..m {
        for j in 0..n {
            let g = dy[i * n + j];
            for p in 0..k {
                dx[i * k + p] += g * w[j * k + p];
                dw[j * k + p] += g * x[i * k + p];
            }
        }
    }
}

/// RMSNorm: y = x · r · g with r = (mean(x²) + ε)^-½ per row; returns y
/// and each row's r.
pub fn rmsnorm(x: &[f64], g: &[f64], t: usize, d: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; t * d];
    let mut r = vec![0.0; t];
    for i in 0..t {
        let row = &x[i * d..(i + 1) * d];
        let ms = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
        r[i] = 1.0 / (ms + eps).sqrt();
        for j in 0..d {
            y[i * d + j] = row[j] * r[i] * g[j];
        }
    }
    (y, r)
}

/// dx += …, dg += … for [`rmsnorm`]; ∂r/∂x_j = −r³ x_j / d.
pub fn rmsnorm_back(
    dx: &mut [f64],
    dg: &mut [f64],
    dy: &[f64],
    x: &[f64],
    g: &[f64],
    r: &[f64],
    t: usize,
    d: usize,
) {
    for i in 0..t {
        let (row, dyr) = (&x[i * d..(i + 1) * d], &dy[i * d..(i + 1) * d]);
        let dr: f64 = (0..d).map(|j| dyr[j] * row[j] * g[j]).sum();
        for j in 0..d {
            dx[i * d + j] += dyr[j] * r[i] * g[j] - dr * r[i].powi(3) * row[j] / d as f64;
            dg[j] += dyr[j] * row[j] * r[i];
        }
    }
}

/// Rotary embedding in Hugging Face's `rotate_half` form: within each
/// head, element i and element i + hd/2 turn by the angle
/// pos · θ^(−2i/hd), pos being the row's place in its sequence.
/// `inverse` turns the other way: the transpose, for the backward.
pub fn rope(x: &mut [f64], seq_len: usize, heads: usize, hd: usize, theta: f64, inverse: bool) {
    let half = hd / 2;
    let rows = x.len() / (heads * hd);
    for t in 0..rows {
        let pos = (t % seq_len) as f64;
        for h in 0..heads {
            let v = &mut x[(t * heads + h) * hd..(t * heads + h + 1) * hd];
            for i in 0..half {
                let angle = pos * theta.powf(-2.0 * i as f64 / hd as f64);
                let (c, s) = (
                    angle.cos(),
                    if inverse { -angle.sin() } else { angle.sin() },
                );
                let (a, b) = (v[i], v[i + half]);
                v[i] = a * c - b * s;
                v[i + half] = b * c + a * s;
            }
        }
    }
}

/// Causal attention over `seqs` sequences of `s` rows: query head h reads
/// key/value head h / (heads / kv_heads). Returns the output (T, heads·hd)
/// and the probabilities, [seq][head][i][j] (j ≤ i), for the backward.
pub fn attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    seqs: usize,
    s: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (qw, kw) = (heads * hd, kv_heads * hd);
    let scale = (hd as f64).sqrt().recip();
    let mut out = vec![0.0; seqs * s * qw];
    let mut probs = vec![0.0; seqs * heads * s * s];
    for b in 0..seqs {
        for h in 0..heads {
            let g = h / (heads / kv_heads);
            for i in 0..s {
                let qi = &q[(b * s + i) * qw + h * hd..][..hd];
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let kj = &k[(b * s + j) * kw + g * hd..][..hd];
                        scale * (0..hd).map(|c| qi[c] * kj[c]).sum::<f64>()
                    })
                    .collect();
                let p = softmax(&scores);
                for j in 0..=i {
                    probs[((b * heads + h) * s + i) * s + j] = p[j];
                    let vj = &v[(b * s + j) * kw + g * hd..][..hd];
                    for c in 0..hd {
                        out[(b * s + i) * qw + h * hd + c] += p[j] * vj[c];
                    }
                }
            }
        }
    }
    (out, probs)
}

/// dq, dk, dv += the gradients of [`attention`].
pub fn attention_back(
    dq: &mut [f64],
    dk: &mut [f64],
    dv: &mut [f64],
    dout: &[f64],
    probs: &[f64],
    q: &[f64],
    k: &[f64],
    v: &[f64],
    seqs: usize,
    s: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
) {
    let (qw, kw) = (heads * hd, kv_heads * hd);
    let scale = (hd as f64).sqrt().recip();
    for b in 0..seqs {
        for h in 0..heads {
            let g = h / (heads / kv_heads);
            for i in 0..s {
                let ti = b * s + i;
                let p = &probs[((b * heads + h) * s + i) * s..][..=i];
                let doi = &dout[ti * qw + h * hd..][..hd];
                // out_i = Σ_j p_ij v_j
                let mut dp = vec![0.0; i + 1];
                for j in 0..=i {
                    let vj = &v[(b * s + j) * kw + g * hd..][..hd];
                    dp[j] = (0..hd).map(|c| doi[c] * vj[c]).sum();
                    for c in 0..hd {
                        dv[(b * s + j) * kw + g * hd + c] += p[j] * doi[c];
                    }
                }
                let dscores = softmax_back(p, &dp);
                // score_ij = scale · q_i · k_j
                for j in 0..=i {
                    let tj = b * s + j;
                    for c in 0..hd {
                        dq[ti * qw + h * hd + c] += scale * dscores[j] * k[tj * kw + g * hd + c];
                        dk[tj * kw + g * hd + c] += scale * dscores[j] * q[ti * qw + h * hd + c];
                    }
                }
            }
        }
    }
}

/// log Σ exp(z).
pub fn log_sum_exp(z: &[f64]) -> f64 {
    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    max + z.iter().map(|v| (v - max).exp()).sum::<f64>().ln()
}

pub fn softmax(z: &[f64]) -> Vec<f64> {
    let lse = log_sum_exp(z);
    z.iter().map(|v| (v - lse).exp()).collect()
}

/// dz from dp for p = softmax(z): dz_j = p_j (dp_j − Σ_i p_i dp_i).
pub fn softmax_back(p: &[f64], dp: &[f64]) -> Vec<f64> {
    let dot: f64 = p.iter().zip(dp).map(|(a, b)| a * b).sum();
    p.iter().zip(dp).map(|(pj, dpj)| pj * (dpj - dot)).collect()
}

pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f64) -> f64 {
    x * sigmoid(x)
}

/// d silu / dx = σ(x) (1 + x (1 − σ(x))).
pub fn silu_grad(x: f64) -> f64 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

/// One Mixtral expert on one row: w2 · (silu(w1 x) ⊙ (w3 x)), w1 and w3
/// (f, d), w2 (d, f). Returns the output and the two pre-activations.
pub fn swiglu(
    x: &[f64],
    w1: &[f64],
    w3: &[f64],
    w2: &[f64],
    d: usize,
    f: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let a = linear(x, w1, 1, d, f);
    let b = linear(x, w3, 1, d, f);
    let hidden: Vec<f64> = (0..f).map(|i| silu(a[i]) * b[i]).collect();
    (linear(&hidden, w2, 1, f, d), a, b)
}

/// dx, dw1, dw3, dw2 += the gradients of [`swiglu`] on one row.
pub fn swiglu_back(
    dx: &mut [f64],
    dw: [&mut [f64]; 3],
    dy: &[f64],
    x: &[f64],
    w: [&[f64]; 3],
    a: &[f64],
    b: &[f64],
    d: usize,
    f: usize,
) {
    let [dw1, dw3, dw2] = dw;
    let [w1, w3, w2] = w;
    let hidden: Vec<f64> = (0..f).map(|i| silu(a[i]) * b[i]).collect();
    let mut dhidden = vec![0.0; f];
    linear_back(&mut dhidden, dw2, dy, &hidden, w2, 1, f, d);
    let da: Vec<f64> = (0..f)
        .map(|i| dhidden[i] * b[i] * silu_grad(a[i]))
        .collect();
    let db: Vec<f64> = (0..f).map(|i| dhidden[i] * silu(a[i])).collect();
    linear_back(dx, dw1, &da, x, w1, 1, d, f);
    linear_back(dx, dw3, &db, x, w3, 1, d, f);
}
