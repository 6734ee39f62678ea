//! The CUDA kernels (`src/backend/cuda/kernels.cu`) against the CPU
//! functions they mirror, written once over [`KernelHost`]: run on a GPU
//! through `CudaBackend`'s host-slice wrappers (`tests/backend.rs`, feature
//! `cuda`), and on the CPU through `emulator.rs`, which compiles kernels.cu
//! as C++ and launches it thread by thread (`tests/kernels_emulated.rs`,
//! every build).

// Each test binary uses its own subset.
#![allow(dead_code)]

pub mod emulator;
pub mod router;

/// Bytes of scores a block of attention's query rows may take in these
/// checks: 5 rows at `attention`'s shape (2 sequences × 4 heads × 13 keys
/// × 4 bytes a row), so that its 13 query rows run as blocks of 5, 5 and 3.
pub const ATTENTION_TEST_BLOCK: usize = 5 * 2 * 4 * 13 * 4;

use strata::math::attention::AttnShape;
use strata::math::{gelu, gelu_grad, silu, silu_grad, ExpertKind, RouterConfig, Routing, Scoring};
use strata::model::TokenRows;
use strata_optim::{adamw_step, AdamWHyper, CopyOut, GradRef, Kernel, StepScalars};

/// What the router's kernels fill: the fields of `math::Routing`, its
/// `Permutation`'s, and the sums its losses read (each expert's
/// probabilities over the tokens, then Σ lse²).
pub struct RouterResult {
    pub probs: Vec<f32>,
    pub lse: Vec<f32>,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
    pub order: Vec<u32>,
    pub position: Vec<u32>,
    pub counts: Vec<u32>,
    pub sums: Vec<f32>,
    /// The load-balancing loss and the z-loss, from the counts and sums.
    pub losses: [f32; 2],
}

/// What the MoE block's kernels give ([`KernelHost::moe_rows`]).
pub struct MoeRows {
    pub y: Vec<f32>,
    pub dweights: Vec<f32>,
    pub dout_rows: Vec<f32>,
}

/// The kernels on host slices (inputs in, results out), launched as the
/// CUDA backend launches them.
#[allow(clippy::too_many_arguments)]
pub trait KernelHost {
    fn name(&self) -> &'static str;
    /// swiglu/gelu forward (outputs\[0\] = h) or backward (da, db).
    fn activation(
        &self,
        kind: ExpertKind,
        forward: bool,
        a: &[f32],
        b: &[f32],
        dh: &[f32],
    ) -> Vec<Vec<f32>>;
    fn adamw(&self, s: &StepScalars, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]);
    fn rmsnorm_forward(
        &self,
        x: &[f32],
        g: &[f32],
        t: usize,
        d: usize,
        eps: f64,
    ) -> (Vec<f32>, Vec<f32>);
    fn rmsnorm_backward(
        &self,
        dx: &mut [f32],
        dg: &mut [f32],
        dout: &[f32],
        x: &[f32],
        g: &[f32],
        inv_rms: &[f32],
        t: usize,
        d: usize,
    );
    fn rope(
        &self,
        x: &mut [f32],
        cos: &[f32],
        sin: &[f32],
        seq_len: usize,
        heads: usize,
        half_and_head_dim: (usize, usize),
        transpose: bool,
    );
    fn cross_entropy(
        &self,
        dlogits: &mut [f32],
        logits: &[f32],
        targets: &[u32],
        v: usize,
        denominator: usize,
    ) -> f32;
    /// f32 sum of x in index order from 0 (a loss's row shares).
    fn sum_in_order(&self, x: &[f32]) -> f32;
    /// A batch's rows split into inputs and targets on the device.
    fn token_ids(&self, rows: TokenRows<'_>) -> (Vec<u32>, Vec<u32>);
    /// Every token's document start (`starts`, rows of `seq_len`) as the
    /// GPU rebuilds it from a bit a token.
    fn document_starts(&self, starts: &[u32], seq_len: usize) -> Vec<u32>;
    /// The tokens' stable order by id, as the GPU sorts them for the
    /// embedding's backward.
    fn token_order(&self, tokens: &[u32]) -> Vec<u32>;
    /// dtable (V, D) += dh's rows at their tokens, in token order.
    fn embedding_backward(&self, dtable: &mut [f32], dh: &[f32], tokens: &[u32], d: usize);
    /// The router after its logits (T, E): scores, top-k, permutation,
    /// sums (`bias`: a sigmoid router's correction bias).
    fn route(
        &self,
        cfg: &RouterConfig,
        logits: &[f32],
        bias: Option<&[f32]>,
        t: usize,
    ) -> RouterResult;
    /// `math::router_logits_grad` of `routing` (its probs, lse, experts,
    /// weights, and counts or aux_grad).
    fn router_logits_grad(
        &self,
        cfg: &RouterConfig,
        routing: &Routing<f32>,
        dweights: &[f32],
        losses: (f32, f32),
        t: usize,
    ) -> Vec<f32>;
    /// `math::add_prob_sums`.
    fn add_prob_sums(&self, probs: &[f32], sums: &mut [f64]);
    /// `math::aux_prob_grad` of a layer's own loss, from its counts.
    fn aux_prob_grad(&self, counts: &[u32], daux: f32, t: usize, k: usize) -> Vec<f32>;
    fn permute(
        &self,
        x: &[f32],
        assignments: &[u32],
        d: usize,
        k: usize,
        t: usize,
    ) -> (Vec<f32>, Vec<f32>);
    /// The MoE block's kernels on `rows` (T·K, D) in expert order: the
    /// combine (y), the weights' gradient, every row's output gradient,
    /// and the gather's backward into `dx` (accumulating).
    fn moe_rows(
        &self,
        rows: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        weights: &[f32],
        order: &[u32],
        position: &[u32],
        tkd: (usize, usize, usize),
    ) -> MoeRows;
    fn attention_forward(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: &[u32],
        shape: &AttnShape,
    ) -> (Vec<f32>, Vec<f32>);
    /// From the forward's row statistics and the same `starts`.
    fn attention_backward(
        &self,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        dout: &[f32],
        stats: &[f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: &[u32],
        shape: &AttnShape,
    );
}

fn f32s(n: usize, seed: u64, scale: f64) -> Vec<f32> {
    crate::common::values(n, seed, scale)
        .into_iter()
        .map(|v| v as f32)
        .collect()
}

/// Largest |a − b| / max(|b|, 1).
fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
        .fold(0.0f32, f32::max)
}

/// Each activation kernel against the CPU function it mirrors: expf and
/// tanhf are within 2 ulps on the GPU, so 1e-6 relative (floored at 1e-6
/// absolute) holds. 4099 elements: more than one block, a partial last.
pub fn activations(h: &dyn KernelHost) {
    let n = 4099;
    let (a, b, dh) = (f32s(n, 4, 6.0), f32s(n, 5, 2.0), f32s(n, 6, 1.0));
    let close = |what: &str, got: &[f32], want: &[f32]| {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{} {what}[{i}]: {g} vs {w}",
                h.name()
            );
        }
    };
    let out = h.activation(ExpertKind::SwiGlu, true, &a, &b, &dh);
    let want: Vec<f32> = (0..n).map(|i| silu(a[i]) * b[i]).collect();
    close("swiglu_forward", &out[0], &want);
    // strata_exp is the host's f32 exp (math::fast_exp) operation for
    // operation, and with no fused multiply-adds the sigmoid's division and
    // products round alike: the same bits, which a constant of the
    // polynomial copied wrong would break.
    for (i, (g, w)) in out[0].iter().zip(&want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{} swiglu_forward[{i}]", h.name());
    }
    let out = h.activation(ExpertKind::SwiGlu, false, &a, &b, &dh);
    let da: Vec<f32> = (0..n).map(|i| dh[i] * b[i] * silu_grad(a[i])).collect();
    let db: Vec<f32> = (0..n).map(|i| dh[i] * silu(a[i])).collect();
    close("swiglu_backward da", &out[0], &da);
    close("swiglu_backward db", &out[1], &db);
    let out = h.activation(ExpertKind::Gelu, true, &a, &b, &dh);
    let want: Vec<f32> = a.iter().map(|&x| gelu(x)).collect();
    close("gelu_forward", &out[0], &want);
    let out = h.activation(ExpertKind::Gelu, false, &a, &b, &dh);
    let want: Vec<f32> = (0..n).map(|i| dh[i] * gelu_grad(a[i])).collect();
    close("gelu_backward", &out[0], &want);
}

/// RMSNorm and RoPE sum and multiply in the cpu's order with IEEE sqrt
/// (fused multiply-adds off), so they agree to rounding of the last ulp at
/// most: 1e-6. The gain's gradient sums blocks of rows, then the blocks
/// (150 rows: several blocks), another order than the cpu's one pass: two
/// orders of 150 terms of order one differ by a few ulps of the terms'
/// sizes, 2.1e-6 here; 1e-5 bounds it, where a term missing or counted
/// twice moves a value by its size, O(1).
pub fn rmsnorm_and_rope(h: &dyn KernelHost) {
    use strata::math::attention::{rope_backward, rope_forward, RopeTable};
    use strata::math::{rmsnorm_backward, rmsnorm_forward};
    // 70 columns: a row's 32 parts (row_partials) of 3 or 2 columns.
    let (t, d) = (150, 70);
    let (x, g, dout) = (f32s(t * d, 20, 2.0), f32s(d, 21, 1.0), f32s(t * d, 22, 1.0));
    let (mut out, mut inv) = (vec![0.0; t * d], vec![0.0; t]);
    rmsnorm_forward(&mut out, &mut inv, &x, &g, t, d, 1e-5);
    let (hout, hinv) = h.rmsnorm_forward(&x, &g, t, d, 1e-5);
    assert!(worst(&hout, &out) < 1e-6 && worst(&hinv, &inv) < 1e-6);
    let (mut dx, mut dg) = (vec![0.25; t * d], vec![0.5; d]);
    let (mut hdx, mut hdg) = (dx.clone(), dg.clone());
    rmsnorm_backward(&mut dx, &mut dg, &dout, &x, &g, &inv, t, d);
    h.rmsnorm_backward(&mut hdx, &mut hdg, &dout, &x, &g, &inv, t, d);
    assert!(worst(&hdx, &dx) < 1e-6, "dx {}", worst(&hdx, &dx));
    assert!(worst(&hdg, &dg) < 1e-5, "dg {}", worst(&hdg, &dg));
    let (seq_len, heads, hd) = (11, 3, 16);
    let q = f32s(2 * seq_len * heads * hd, 23, 1.0);
    // Every dimension rotating, and the first 12 of 16 (a partial rotary).
    for (rotary, transpose) in [(hd, false), (hd, true), (12, false), (12, true)] {
        let table = RopeTable::<f32>::partial(seq_len, hd, rotary, 10_000.0);
        let mut want = q.clone();
        if transpose {
            rope_backward(&mut want, &table, seq_len, heads);
        } else {
            rope_forward(&mut want, &table, seq_len, heads);
        }
        let mut got = q.clone();
        h.rope(
            &mut got,
            &table.cos,
            &table.sin,
            seq_len,
            heads,
            (rotary / 2, hd),
            transpose,
        );
        assert!(
            worst(&got, &want) < 1e-6,
            "rope {rotary} of {hd}, transpose={transpose}"
        );
    }
}

/// Cross-entropy and the router's softmax use expf/logf (within 2 ulps of
/// the cpu's libm): 1e-5 on values of order one; the router's top-k
/// choices and the permutation are exact.
pub fn loss_router_and_permutation(h: &dyn KernelHost) {
    use strata::math::{
        cross_entropy_forward_backward, gather_forward, linear_forward, router_forward,
        scatter_to_assignments, Permutation, RouterConfig, Routing, IGNORED_TARGET,
    };
    let (t, v) = (29, 50);
    let logits = f32s(t * v, 30, 4.0);
    // Two rows carry no loss (prompt tokens): zero d logits, no share.
    let targets: Vec<u32> = (0..t)
        .map(|i| match i {
            3 | 10 => IGNORED_TARGET,
            _ => (i * 7 % v) as u32,
        })
        .collect();
    let mut dl = vec![0.0; t * v];
    let loss = cross_entropy_forward_backward(&mut dl, &logits, &targets, v, 40);
    assert!(dl[3 * v..4 * v].iter().all(|&g| g == 0.0));
    let mut hdl = vec![7.0; t * v];
    let hloss = h.cross_entropy(&mut hdl, &logits, &targets, v, 40);
    assert!(
        (hloss - loss).abs() < 1e-5 * loss.abs().max(1.0),
        "{hloss} vs {loss}"
    );
    assert!(worst(&hdl, &dl) < 1e-5);

    let (d, e) = (24, 8);
    for (k, renormalize) in [(1, false), (2, true), (3, false)] {
        let cfg = RouterConfig {
            experts: e,
            top_k: k,
            renormalize,
            scoring: Scoring::Softmax,
        };
        let (x, wr) = (f32s(t * d, 31, 1.0), f32s(e * d, 32, 0.5));
        let mut routing = Routing::default();
        router_forward(&cfg, &mut routing, &x, &wr, None, t, d);
        let mut logits = vec![0.0f32; t * e];
        linear_forward(&mut logits, &x, &wr, t, d, e);
        let got = h.route(&cfg, &logits, None, t);
        assert_eq!(got.experts, routing.experts, "top-{k}");
        assert!(worst(&got.probs, &routing.probs) < 1e-5);
        assert!(worst(&got.lse, &routing.lse) < 1e-5);
        assert!(worst(&got.weights, &routing.weights) < 1e-5);

        let perm = Permutation::from_routing(&routing.experts, e);
        assert_eq!(
            (&got.order, &got.position),
            (&perm.order, &perm.position),
            "top-{k}"
        );
        let (rows, scattered) = h.permute(&x, &perm.order, d, k, t);
        let mut want_rows = vec![0.0; perm.order.len() * d];
        gather_forward(&mut want_rows, &x, &perm.order, k, d);
        let mut want_scattered = vec![0.0; t * k * d];
        scatter_to_assignments(&mut want_scattered, &want_rows, &perm.order, d);
        assert_eq!(rows, want_rows);
        assert_eq!(scattered, want_scattered);
        moe_rows(h, &perm, &routing.weights, (t, k, d));
    }
}

/// A batch's ids split on the device as the host splits them (with and
/// without a loss mask, rows whose last target is masked and rows that
/// mask none); the embedding's backward with repeated ids, the same bits
/// as the cpu loop (both add each id's rows in token order, which on the
/// GPU holds only if its sort of the tokens by id is stable); a loss's
/// shares summed in row order, the same bits as the host's fold.
pub fn token_ids_embedding_and_loss_sum(h: &dyn KernelHost) {
    use strata::math::attention::embedding_backward;
    let (b, s, v, d) = (5, 7, 11, 6);
    let tokens: Vec<u32> = (0..b * (s + 1))
        .map(|i| (i * i * 7 % 13 % v) as u32)
        .collect();
    let mask: Vec<bool> = (0..b * (s + 1)).map(|p| p % 5 != 2 && p < 33).collect();
    for loss_mask in [None, Some(&mask[..])] {
        let rows = TokenRows {
            tokens: &tokens,
            seq_len: s,
            loss_mask,
        };
        let (inputs, targets) = h.token_ids(rows);
        assert_eq!(
            (inputs, targets),
            rows.inputs_targets(),
            "mask {loss_mask:?}"
        );
    }
    let (_, targets) = TokenRows {
        tokens: &tokens,
        seq_len: s,
        loss_mask: Some(&mask),
    }
    .inputs_targets();
    assert!(targets.contains(&strata::math::IGNORED_TARGET));

    // 35 tokens (one run of the GPU's merge sort), then 357: five runs of
    // 64 and a short one, joined by merges of every width up to 256.
    for (t, seed) in [(b * s, 33), (5 * 64 + 37, 36)] {
        let inputs: Vec<u32> = (0..t).map(|i| (i * 5 % 9) as u32).collect();
        let dh = f32s(inputs.len() * d, seed, 1.0);
        let start = f32s(v * d, seed + 1, 0.5);
        let mut want = start.clone();
        embedding_backward(&mut want, &dh, &inputs, d);
        let mut got = start.clone();
        h.embedding_backward(&mut got, &dh, &inputs, d);
        assert_eq!(got, want, "the embedding's gradient over {t} tokens");
        assert_eq!(
            got[10 * d..],
            start[10 * d..],
            "rows of unused ids untouched"
        );
    }
    // The order itself, which the gradient above cannot always tell from
    // a partial one: one token, one run, a run and one more, runs of 64
    // and a short one, 4 merges exactly, and 8 merges with a tail, over
    // ids with many repeats.
    for t in [1usize, 64, 65, 357, 1024, 16_411] {
        let tokens: Vec<u32> = (0..t).map(|i| (i * i * 31 % 97 % 23) as u32).collect();
        let mut want: Vec<u32> = (0..t as u32).collect();
        want.sort_by_key(|&i| tokens[i as usize]); // stable
        assert_eq!(h.token_order(&tokens), want, "the order of {t} tokens");
    }

    let shares = f32s(1000, 35, 3.0);
    let fold = shares.iter().fold(0.0f32, |a, &x| a + x);
    assert_eq!(h.sum_in_order(&shares).to_bits(), fold.to_bits());
}

/// Every token's document start, rebuilt on the device from a bit a
/// token, is the host's: rows of 45 (not a multiple of 32, so rows and
/// words do not align), documents of one token, of most of a row and
/// across a whole word of clear bits, and a row whose first token is
/// flagged nowhere but starts at 0 all the same.
pub fn document_starts(h: &dyn KernelHost) {
    let s = 45;
    let begins: Vec<Vec<usize>> = vec![vec![0, 3, 4, 40], vec![5, 44], vec![0, 1, 2, 38]];
    let mut starts = Vec::new();
    for row in &begins {
        let mut first = 0u32;
        for p in 0..s {
            if row.contains(&p) {
                first = p as u32;
            }
            starts.push(first);
        }
    }
    assert_eq!(h.document_starts(&starts, s), starts);
}

/// The MoE block's combine, its weights' gradient, the experts' output
/// gradients and the gather's backward, against `math::permute`: the same
/// products summed in the same order (fused multiply-adds off), so equal
/// to the last ulp at most (1e-6).
fn moe_rows(
    h: &dyn KernelHost,
    perm: &strata::math::Permutation,
    weights: &[f32],
    (t, k, d): (usize, usize, usize),
) {
    use strata::math::{
        combine_backward_weights, combine_forward, gather_backward, AssignmentGrads,
    };
    let rows = f32s(t * k * d, 33, 1.0);
    let dy = f32s(t * d, 34, 1.0);
    let dx0 = f32s(t * d, 35, 0.5); // the gather's backward adds to it
    let mut want_y = vec![0.0f32; t * d];
    combine_forward(&mut want_y, &rows, &perm.position, weights, t, k, d);
    let mut want_dw = vec![0.0f32; t * k];
    combine_backward_weights(&mut want_dw, &dy, &rows, &perm.position, t, k, d);
    let mut want_dout = vec![0.0f32; t * k * d];
    AssignmentGrads {
        dy: &dy,
        weights,
        k,
        d,
    }
    .gather(&mut want_dout, &perm.order);
    let mut want_dx = dx0.clone();
    gather_backward(&mut want_dx, &rows, &perm.position, t, k, d);
    let mut dx = dx0;
    let got = h.moe_rows(
        &rows,
        &dy,
        &mut dx,
        weights,
        &perm.order,
        &perm.position,
        (t, k, d),
    );
    assert!(worst(&got.y, &want_y) < 1e-6, "combine, top-{k}");
    assert!(
        worst(&got.dweights, &want_dw) < 1e-6,
        "combine's weights gradient, top-{k}"
    );
    assert!(
        worst(&got.dout_rows, &want_dout) < 1e-6,
        "experts' output gradients, top-{k}"
    );
    assert!(worst(&dx, &want_dx) < 1e-6, "gather backward, top-{k}");
}

/// Causal attention with grouped kv heads, in blocks of query rows (the
/// products through GEMMs, summed in another order than the cpu's, with
/// expf in the softmax): 1e-5. The forward keeps each row's softmax max
/// and sum, not the probabilities: the statistics are checked against the
/// cpu's probabilities (every p_ij recomputed from them), and the
/// backward, which recomputes them, against the cpu's.
pub fn attention(h: &dyn KernelHost) {
    use strata::math::attention::{attention_backward, attention_forward};
    // 45 keys: a row's softmax parts (32 of them) hold one or two keys.
    let shape = AttnShape {
        seqs: 2,
        seq_len: 45,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
    };
    let (t, s, hd) = (shape.tokens(), shape.seq_len, shape.head_dim);
    let q = f32s(t * shape.q_width(), 40, 1.0);
    let k = f32s(t * shape.kv_width(), 41, 1.0);
    let v = f32s(t * shape.kv_width(), 42, 1.0);
    let dout = f32s(t * shape.q_width(), 43, 1.0);
    // Two documents packed apart in the second sequence, one in the first;
    // the second starts at 37 (not a multiple of the 32 parts).
    let starts: Vec<u32> = (0..t).map(|i| if i >= 45 + 37 { 37 } else { 0 }).collect();
    for starts in [vec![0; t], starts] {
        let mut out = vec![0.0; t * shape.q_width()];
        let mut probs = vec![0.0; shape.probs_len()];
        attention_forward(&mut out, &mut probs, &q, &k, &v, Some(&starts), &shape);
        let (hout, stats) = h.attention_forward(&q, &k, &v, &starts, &shape);
        assert!(worst(&hout, &out) < 1e-5, "out {}", worst(&hout, &out));
        // p_ij = exp(q_i·k_j/√hd − max_i) / sum_i where j sees i, else 0.
        let group = shape.heads / shape.kv_heads;
        let mut recomputed = vec![0.0f32; probs.len()];
        for (row, p_row) in recomputed.chunks_exact_mut(s).enumerate() {
            let (i, head, b) = (row % s, (row / s) % shape.heads, row / (s * shape.heads));
            let ti = b * s + i;
            let qi = &q[ti * shape.q_width() + head * hd..][..hd];
            for (j, p) in p_row
                .iter_mut()
                .enumerate()
                .take(i + 1)
                .skip(starts[ti] as usize)
            {
                let kv = (b * s + j) * shape.kv_width() + head / group * hd;
                let dot: f32 = qi.iter().zip(&k[kv..kv + hd]).map(|(a, b)| a * b).sum();
                let score = dot / (hd as f32).sqrt();
                *p = (score - stats[2 * row]).exp() / stats[2 * row + 1];
            }
        }
        assert!(
            worst(&recomputed, &probs) < 1e-5,
            "probabilities {}",
            worst(&recomputed, &probs)
        );
        let (mut dq, mut dk, mut dv) = (vec![0.1; q.len()], vec![0.2; k.len()], vec![0.3; v.len()]);
        let (mut hdq, mut hdk, mut hdv) = (dq.clone(), dk.clone(), dv.clone());
        attention_backward(&mut dq, &mut dk, &mut dv, &dout, &probs, &q, &k, &v, &shape);
        h.attention_backward(
            &mut hdq, &mut hdk, &mut hdv, &dout, &stats, &q, &k, &v, &starts, &shape,
        );
        for (what, a, b) in [("dq", &hdq, &dq), ("dk", &hdk, &dk), ("dv", &hdv, &dv)] {
            assert!(worst(a, b) < 1e-5, "{what} {}", worst(a, b));
        }
    }
}

/// The kernel AdamW uses the scalar kernel's fused multiply-adds and IEEE
/// sqrt and division, so three steps agree bit for bit.
pub fn adamw_bit_for_bit(h: &dyn KernelHost) {
    let n = 10_007;
    let hyper = AdamWHyper {
        lr: 1e-3,
        weight_decay: 0.1,
        ..AdamWHyper::default()
    };
    let (mut p1, mut m1, mut v1) = (f32s(n, 7, 1.0), vec![0.0; n], vec![0.0; n]);
    let (mut p2, mut m2, mut v2) = (p1.clone(), m1.clone(), v1.clone());
    for t in 1..=3 {
        let g = f32s(n, 10 + t, 0.1);
        let s = StepScalars::new(&hyper, t, 1.0);
        h.adamw(&s, &mut p1, &mut m1, &mut v1, &g);
        adamw_step(
            Kernel::Scalar,
            &s,
            &mut p2,
            &mut m2,
            &mut v2,
            GradRef::F32(&g),
            CopyOut::None,
        )
        .unwrap();
    }
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&p1), bits(&p2));
    assert_eq!(bits(&m1), bits(&m2));
    assert_eq!(bits(&v1), bits(&v2));
}

#[cfg(feature = "cuda")]
impl KernelHost for strata::backend::cuda::CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn activation(
        &self,
        kind: ExpertKind,
        forward: bool,
        a: &[f32],
        b: &[f32],
        dh: &[f32],
    ) -> Vec<Vec<f32>> {
        self.activation_host(kind, forward, a, b, dh).unwrap()
    }

    fn adamw(&self, s: &StepScalars, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
        self.adamw_host(s, p, m, v, g).unwrap()
    }

    fn rmsnorm_forward(
        &self,
        x: &[f32],
        g: &[f32],
        t: usize,
        d: usize,
        eps: f64,
    ) -> (Vec<f32>, Vec<f32>) {
        self.rmsnorm_forward_host(x, g, t, d, eps).unwrap()
    }

    fn rmsnorm_backward(
        &self,
        dx: &mut [f32],
        dg: &mut [f32],
        dout: &[f32],
        x: &[f32],
        g: &[f32],
        inv_rms: &[f32],
        t: usize,
        d: usize,
    ) {
        self.rmsnorm_backward_host(dx, dg, dout, x, g, inv_rms, t, d)
            .unwrap()
    }

    fn rope(
        &self,
        x: &mut [f32],
        cos: &[f32],
        sin: &[f32],
        seq_len: usize,
        heads: usize,
        half_and_head_dim: (usize, usize),
        transpose: bool,
    ) {
        self.rope_host(x, cos, sin, seq_len, heads, half_and_head_dim, transpose)
            .unwrap()
    }

    fn cross_entropy(
        &self,
        dlogits: &mut [f32],
        logits: &[f32],
        targets: &[u32],
        v: usize,
        denominator: usize,
    ) -> f32 {
        self.cross_entropy_host(dlogits, logits, targets, v, denominator)
            .unwrap()
    }

    fn sum_in_order(&self, x: &[f32]) -> f32 {
        self.sum_in_order_host(x).unwrap()
    }

    fn token_ids(&self, rows: TokenRows<'_>) -> (Vec<u32>, Vec<u32>) {
        self.token_ids_host(rows).unwrap()
    }

    fn embedding_backward(&self, dtable: &mut [f32], dh: &[f32], tokens: &[u32], d: usize) {
        self.embedding_backward_host(dtable, dh, tokens, d).unwrap()
    }

    fn token_order(&self, tokens: &[u32]) -> Vec<u32> {
        self.token_order_host(tokens).unwrap()
    }

    fn document_starts(&self, starts: &[u32], seq_len: usize) -> Vec<u32> {
        let shape = AttnShape {
            seqs: starts.len() / seq_len,
            seq_len,
            heads: 1,
            kv_heads: 1,
            head_dim: 1,
        };
        self.attention_starts_host(starts, &shape).unwrap()
    }

    fn route(
        &self,
        cfg: &RouterConfig,
        logits: &[f32],
        bias: Option<&[f32]>,
        t: usize,
    ) -> RouterResult {
        let r = self.route_host(cfg, logits, bias, t).unwrap();
        RouterResult {
            probs: r.probs,
            lse: r.lse,
            experts: r.experts,
            weights: r.weights,
            order: r.order,
            position: r.position,
            counts: r.counts,
            sums: r.sums,
            losses: r.losses,
        }
    }

    fn router_logits_grad(
        &self,
        cfg: &RouterConfig,
        routing: &Routing<f32>,
        dweights: &[f32],
        losses: (f32, f32),
        t: usize,
    ) -> Vec<f32> {
        self.router_logits_grad_host(cfg, routing, dweights, losses, t)
            .unwrap()
    }

    fn aux_prob_grad(&self, counts: &[u32], daux: f32, t: usize, k: usize) -> Vec<f32> {
        self.aux_prob_grad_host(counts, daux, t, k).unwrap()
    }

    fn add_prob_sums(&self, probs: &[f32], sums: &mut [f64]) {
        self.add_prob_sums_host(probs, sums).unwrap()
    }

    fn moe_rows(
        &self,
        rows: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        weights: &[f32],
        order: &[u32],
        position: &[u32],
        tkd: (usize, usize, usize),
    ) -> MoeRows {
        let (y, dweights, dout_rows) = self
            .moe_rows_host(rows, dy, dx, weights, [order, position], tkd)
            .unwrap();
        MoeRows {
            y,
            dweights,
            dout_rows,
        }
    }

    fn permute(
        &self,
        x: &[f32],
        assignments: &[u32],
        d: usize,
        k: usize,
        t: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        self.permute_host(x, assignments, d, k, t).unwrap()
    }

    fn attention_forward(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: &[u32],
        shape: &AttnShape,
    ) -> (Vec<f32>, Vec<f32>) {
        let mut out = vec![0.0; shape.tokens() * shape.q_width()];
        let mut stats = vec![0.0; strata::backend::cuda::attention_stats_len(shape)];
        let block = ATTENTION_TEST_BLOCK;
        self.attention_forward_blocks(&mut out, &mut stats, [q, k, v], Some(starts), shape, block)
            .unwrap();
        (out, stats)
    }

    fn attention_backward(
        &self,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        dout: &[f32],
        stats: &[f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: &[u32],
        shape: &AttnShape,
    ) {
        let (grads, inputs) = ([dq, dk, dv], [dout, stats, q, k, v]);
        let block = ATTENTION_TEST_BLOCK;
        self.attention_backward_blocks(grads, inputs, Some(starts), shape, block)
            .unwrap()
    }
}
