//! Finite-difference checks of the language model's dense ops: rotary
//! embeddings, causal grouped-query attention and the embedding in f64
//! element by element; and the whole Mixtral-architecture network in f32,
//! tensor by tensor, along each tensor's gradient direction.

use strata::lm::{LmConfig, MoeLm, TokenBatch};
use strata::math::attention::*;
use strata::model::{Network, PlainKernels};
use strata::reference::{MemoryRunner, ReferenceTrainer};
use strata_optim::AdamWHyper;

mod common;
use common::{check, dot, values};

const SHAPE: AttnShape = AttnShape {
    seqs: 2,
    seq_len: 3,
    heads: 4,
    kv_heads: 2,
    head_dim: 4,
};

#[test]
fn rope_gradients_match_finite_differences() {
    let (t, heads, hd) = (SHAPE.tokens(), 3, 6);
    let table = RopeTable::<f64>::new(SHAPE.seq_len, hd, 10_000.0);
    let x = values(t * heads * hd, 1, 1.0);
    let c = values(x.len(), 2, 1.0);
    let mut dx = c.clone();
    rope_backward(&mut dx, &table, SHAPE.seq_len, heads);
    check("rope", &x, &dx, |x| {
        let mut y = x.to_vec();
        rope_forward(&mut y, &table, SHAPE.seq_len, heads);
        dot(&y, &c)
    });
    // Position 0 is not rotated; later positions are, and keep the norm.
    let mut y = x.clone();
    rope_forward(&mut y, &table, SHAPE.seq_len, heads);
    assert_eq!(&y[..heads * hd], &x[..heads * hd]);
    let norm = |v: &[f64]| v.iter().map(|a| a * a).sum::<f64>();
    assert!((norm(&y) - norm(&x)).abs() < 1e-9);
}

/// Documents packed apart: the second sequence holds two, the second of
/// which begins at position 3. The backward reads only the saved
/// probabilities (zero across documents), and is still the derivative.
#[test]
fn attention_within_documents_matches_finite_differences() {
    let shape = AttnShape {
        seq_len: 5,
        ..SHAPE
    };
    let t = shape.tokens();
    let starts: Vec<u32> = (0..t as u32)
        .map(|i| if i >= 5 + 3 { 3 } else { 0 })
        .collect();
    let q = values(t * shape.q_width(), 13, 1.0);
    let k = values(t * shape.kv_width(), 14, 1.0);
    let v = values(t * shape.kv_width(), 15, 1.0);
    let c = values(t * shape.q_width(), 16, 1.0);
    let run = |q: &[f64], k: &[f64], v: &[f64]| {
        let mut out = vec![0.0; t * shape.q_width()];
        let mut probs = vec![0.0; shape.probs_len()];
        attention_forward(&mut out, &mut probs, q, k, v, Some(&starts), &shape);
        (out, probs)
    };
    let (out, probs) = run(&q, &k, &v);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    attention_backward(&mut dq, &mut dk, &mut dv, &c, &probs, &q, &k, &v, &shape);
    check("attention dq, documents", &q, &dq, |q| {
        dot(&run(q, &k, &v).0, &c)
    });
    check("attention dk, documents", &k, &dk, |k| {
        dot(&run(&q, k, &v).0, &c)
    });
    check("attention dv, documents", &v, &dv, |v| {
        dot(&run(&q, &k, v).0, &c)
    });
    // The second document's first token attends to itself alone, as it
    // would at the start of a sequence of its own.
    let (s, qw) = (shape.seq_len, shape.q_width());
    for h in 0..shape.heads {
        let row = &probs[((shape.heads + h) * s + 3) * s..][..s];
        assert_eq!(row, &[0.0, 0.0, 0.0, 1.0, 0.0][..]);
    }
    let g = |h: usize| h / (shape.heads / shape.kv_heads) * shape.head_dim;
    for h in 0..shape.heads {
        let o = &out[(5 + 3) * qw + h * shape.head_dim..][..shape.head_dim];
        let kv = &v[(5 + 3) * shape.kv_width() + g(h)..][..shape.head_dim];
        assert_eq!(o, kv);
    }
}

#[test]
fn attention_gradients_match_finite_differences() {
    let t = SHAPE.tokens();
    let q = values(t * SHAPE.q_width(), 3, 1.0);
    let k = values(t * SHAPE.kv_width(), 4, 1.0);
    let v = values(t * SHAPE.kv_width(), 5, 1.0);
    let c = values(t * SHAPE.q_width(), 6, 1.0);
    let run = |q: &[f64], k: &[f64], v: &[f64]| {
        let mut out = vec![0.0; t * SHAPE.q_width()];
        let mut probs = vec![0.0; SHAPE.probs_len()];
        attention_forward(&mut out, &mut probs, q, k, v, None, &SHAPE);
        (out, probs)
    };
    let (_, probs) = run(&q, &k, &v);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    attention_backward(&mut dq, &mut dk, &mut dv, &c, &probs, &q, &k, &v, &SHAPE);
    check("attention dq", &q, &dq, |q| dot(&run(q, &k, &v).0, &c));
    check("attention dk", &k, &dk, |k| dot(&run(&q, k, &v).0, &c));
    check("attention dv", &v, &dv, |v| dot(&run(&q, &k, v).0, &c));
    // Causal: the first token of each sequence attends to itself only.
    let s = SHAPE.seq_len;
    for b in 0..SHAPE.seqs {
        for h in 0..SHAPE.heads {
            let row = &probs[((b * SHAPE.heads + h) * s) * s..][..s];
            assert_eq!(row[0], 1.0);
            assert!(row[1..].iter().all(|&p| p == 0.0));
        }
    }
}

#[test]
fn embedding_gradient_matches_finite_differences() {
    let (vocab, d) = (5, 3);
    let tokens = [1u32, 4, 1, 0];
    let table = values(vocab * d, 7, 1.0);
    let c = values(tokens.len() * d, 8, 1.0);
    let mut dt = vec![0.0; table.len()];
    embedding_backward(&mut dt, &c, &tokens, d);
    check("embedding", &table, &dt, |w| {
        let mut h = vec![0.0; tokens.len() * d];
        embedding_forward(&mut h, w, &tokens, d);
        dot(&h, &c)
    });
}

fn tiny_lm(tie: bool) -> MoeLm {
    MoeLm::new(LmConfig {
        vocab: 13,
        d_model: 8,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
        d_ff: 6,
        experts: 4,
        top_k: 2,
        tie_embeddings: tie,
        aux_loss_coef: 0.0, // forward_loss is the cross-entropy alone
        max_seq: 16,
        seed: 3,
        ..LmConfig::default()
    })
    .unwrap()
}

fn batch() -> TokenBatch {
    TokenBatch {
        seq_len: 6,
        tokens: (0..14).map(|i| (i * 7 + 3) % 13).collect(),
        loss_mask: None,
        doc_starts: None,
    }
}

/// The whole network in f32: per dense tensor, the directional derivative
/// along its analytic gradient g must equal |g|. The central difference
/// with step 1e-2 along the unit direction has truncation error ~1e-4·|L'''|
/// and rounding error ~(1e-6·L)/1e-2 ≈ 1e-4 at L ≈ 2.6, so 1% of |g|
/// (every tensor's |g| here exceeds 1e-2) leaves room while a wrong
/// gradient (a missing path or a transposed matrix) misses by far more.
fn whole_network(tie: bool) {
    let lm = tiny_lm(tie);
    let mut reference = ReferenceTrainer::new_network(&lm, AdamWHyper::default()).unwrap();
    let moe = lm.moe().clone();
    let dense = lm.init_dense();
    let b = batch();
    let mut grad = vec![0.0f32; dense.len()];
    {
        let mut runner = MemoryRunner::new(&moe, &mut reference.experts);
        lm.forward_backward(
            &dense,
            &mut grad,
            &b,
            12,
            1,
            true,
            &mut runner,
            &PlainKernels,
        )
        .unwrap();
    }
    let mut loss_at = |p: &[f32]| {
        let mut runner = MemoryRunner::new(&moe, &mut reference.experts);
        lm.forward_loss(p, &b, &mut runner, &PlainKernels).unwrap() as f64
    };
    for t in lm.tensors() {
        let g = &grad[t.range.clone()];
        let norm = g.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
        assert!(norm > 1e-2, "{}: |g| = {norm}", t.name);
        let h = 1e-2;
        let step = |sign: f64| {
            let mut p = dense.clone();
            for (x, gi) in p[t.range.clone()].iter_mut().zip(g) {
                *x += (sign * h * *gi as f64 / norm) as f32;
            }
            p
        };
        let numeric = (loss_at(&step(1.0)) - loss_at(&step(-1.0))) / (2.0 * h);
        let err = (numeric - norm).abs() / norm;
        eprintln!(
            "{}: |g| {norm:.4e} directional {numeric:.4e} rel err {err:.1e}",
            t.name
        );
        assert!(
            err < 0.01,
            "{}: |g| {norm} but the loss moves at {numeric}",
            t.name
        );
    }
}

#[test]
fn whole_network_gradients_match_finite_differences() {
    whole_network(false);
}

#[test]
fn tied_embedding_gradients_match_finite_differences() {
    whole_network(true);
}
