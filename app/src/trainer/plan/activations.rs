//! The activations a micro-batch keeps for its backward and the largest
//! workspace a layer's pass holds, on the cpu and on a GPU: the device
//! share of the memory plan that grows with the batch and the sequence.

use strata::backend::{
    head_block_rows, ATTENTION_BLOCK_BYTES, BF16_GEMM_THREAD_B_BYTES, ROW_PARTS,
};
use strata::lm::{LmConfig, QkNorm};
use strata::math::attention::AttnShape;
use strata::math::attention_rows;

/// Bytes one micro-batch keeps for its backward (f32): per layer the
/// residual stream and norms (5·D), q/k/v and the attention output,
/// what the attention keeps (its probabilities, H·S² a sequence, up to
/// `KEPT_PROBABILITIES_MAX_BYTES`, else each query row's and head's
/// softmax max and sum, 2·H·S: `attention_rows::saved_len`); per sparse layer the
/// router's outputs, each assignment's expert output (K·D) and hidden
/// activations (2·K·F), and a shared expert's activations (3·F_s, and
/// D + 1 more for a gated one) where the family has them; per dense layer
/// its MLP's (3·F_d); q and
/// k before their norms and q/k/v before a clamp where the family has
/// them; then the logits and their gradient (2·V).
pub fn activation_bytes(m: &LmConfig, seq_len: usize, seqs: usize) -> u64 {
    let t = (seq_len * seqs) as u64;
    let shape = attention_shape(m, seq_len, seqs);
    let kept = attention_rows::saved_len(&shape) as u64;
    4 * (layer_values(m, t, kept) + 2 * t * m.vocab as u64)
}

/// The attention's shape at `seqs` sequences of `seq_len` tokens.
fn attention_shape(m: &LmConfig, seq_len: usize, seqs: usize) -> AttnShape {
    AttnShape {
        seqs,
        seq_len,
        heads: m.heads,
        kv_heads: m.kv_heads,
        head_dim: m.head_dim,
    }
}

/// [`activation_bytes`] on a GPU (`cuda/ops.rs`): the attention keeps
/// two values a query row and head whatever the sequence, and the head
/// computes its logits a block of rows at a time. Besides what it
/// keeps, a layer's pass holds a workspace, the largest of which counts:
/// the attention's scores and d probabilities (at most
/// [`ATTENTION_BLOCK_BYTES`] each, and a bf16 copy of one for bf16 GEMMs,
/// counted whatever the choice, and the softmax's [`ROW_PARTS`] maxes and
/// sums a block's row) with its operands laid out head by head
/// (q, k, v, the output and their gradients: 8 × T·H·hd f32, more than
/// their bf16 copies and the f32 head each is rounded from), a MoE
/// layer's rows gathered for its experts and their outputs (2·T·K·D) with
/// one group of experts' pass (`expert_pass_bytes`), and the head's logits and d
/// logits for a block of rows with its loss's parts. The batch's inputs
/// and targets stay on the GPU for the step (2·T u32), and every row's
/// loss share until they are summed (T f32); the embedding's backward
/// orders the tokens by id (T u32), less than any layer's workspace.
pub fn gpu_activation_bytes(m: &LmConfig, seq_len: usize, seqs: usize, group: usize) -> u64 {
    let t = (seq_len * seqs) as u64;
    let stats = (2 * seqs * m.heads * seq_len) as u64;
    let kept = 4 * (layer_values(m, t, stats) + 2 * t) + 4 * 2 * t;
    let scores = (4 * seqs * m.heads * seq_len * seq_len) as u64;
    let block = scores.min(ATTENTION_BLOCK_BYTES as u64);
    // The softmax's parts: a max and a sum for each of a block's rows.
    let shape = attention_shape(m, seq_len, seqs);
    let block_rows = shape.query_block_rows(ATTENTION_BLOCK_BYTES);
    let parts = (4 * 2 * ROW_PARTS * seqs * m.heads * block_rows) as u64;
    let attention = 2 * block + block / 2 + parts + 4 * 8 * t * (m.heads * m.head_dim) as u64;
    let experts = 4 * 2 * t * (m.top_k * m.d_model) as u64 + expert_pass_bytes(m, t, group);
    let head_rows = t.min(head_block_rows(m.vocab) as u64);
    // A block's logits and their gradient (f32), and, for bf16 GEMMs, the
    // head's input rows and the block's gradient rounded to bf16.
    let head = 4 * 2 * head_rows * m.vocab as u64
        + 2 * (t * m.d_model as u64 + head_rows * m.vocab as u64)
        + 4 * (2 * ROW_PARTS as u64 + 1) * head_rows // the loss's parts and lse
        + 4 * t; // every row's loss share
    let embedding = 4 * t; // the tokens' order by id
    let workspace = attention.max(experts).max(head).max(dense_gemm_bytes(m, t));
    kept + workspace.max(embedding)
}

/// The bf16 copies a dense GEMM's backward makes of its input rows and
/// output gradient (`DenseGemm::Bf16`, counted whatever the choice): at
/// most the model width plus the widest of the projections and MLPs.
fn dense_gemm_bytes(m: &LmConfig, t: u64) -> u64 {
    let widest = [
        m.heads * m.head_dim,
        m.dense_ff,
        m.shared_expert_ff,
        m.d_model,
    ]
    .into_iter()
    .max()
    .unwrap_or(0) as u64;
    2 * t * (m.d_model as u64 + widest)
}

/// What a group of `group` experts' backward holds on a GPU
/// (`cuda/expert_group.rs`; one expert's in `cuda/expert.rs` is a group of
/// one), its forward holding less: for each of its rows (at most the
/// batch's `t` tokens for each of min(group, top-k) experts: a dropless
/// router may send every token to the same experts), the hidden-size
/// values (a, b, h, their gradients: 6·F f32; h, da, db in bf16: 3·F) and
/// the row-size ones (dx in f32, x and dout in bf16); the weights'
/// gradients of two groups (12·D·F bytes an expert: one group's come down
/// while the next computes); and bf16 copies of the group's weights, made
/// where the compute params are f32.
fn expert_pass_bytes(m: &LmConfig, t: u64, group: usize) -> u64 {
    let (d, f) = (m.d_model as u64, m.d_ff as u64);
    let per_row = 4 * (6 * f + d) + 2 * (3 * f + 2 * d);
    let weights = m.expert_params() as u64;
    let (rows, g) = (t * group.min(m.top_k) as u64, group as u64);
    rows * per_row + 2 * g * 4 * weights + g * 2 * weights
}

/// f32 values the layers keep, `attention` a layer for its attention.
fn layer_values(m: &LmConfig, t: u64, attention: u64) -> u64 {
    let (d, k, f) = (m.d_model as u64, m.top_k as u64, m.d_ff as u64);
    let q = (m.heads * m.head_dim) as u64;
    let kv = (m.kv_heads * m.head_dim) as u64;
    let mut per_token = 5 * d + 2 * q + 2 * kv;
    if m.qk_norm != QkNorm::None {
        per_token += q + kv + m.heads as u64 + m.kv_heads as u64;
    }
    if m.clip_qkv.is_some() {
        per_token += q + 2 * kv;
    }
    let mut per_sparse_token = 2 * m.experts as u64 + k * d + 2 * k * f;
    if m.shared_expert_ff > 0 {
        per_sparse_token += 3 * m.shared_expert_ff as u64;
        if m.family.shared_expert().1 {
            per_sparse_token += d + 1; // its output and gate
        }
    }
    let per_dense_token = 3 * m.dense_ff as u64;
    let (dense, sparse) = (m.dense_layers.len() as u64, m.moe().layers as u64);
    m.layers as u64 * (t * per_token + attention)
        + sparse * t * per_sparse_token
        + dense * t * per_dense_token
}

/// The most values one GPU kernel runs over at `t` tokens a micro-batch
/// (one thread a value, indexed in 32 bits): a token's row of the widest
/// of the model width times top-k (the rows gathered for the experts),
/// an expert's or an MLP's hidden size (one expert may take every token),
/// the attention's q, k, v, and the router's scores.
pub fn gpu_widest_launch(m: &LmConfig, t: u64) -> u64 {
    let widest = [
        m.top_k * m.d_model,
        m.d_ff,
        m.dense_ff,
        m.shared_expert_ff,
        m.heads * m.head_dim,
        m.experts,
    ]
    .into_iter()
    .max()
    .unwrap_or(0) as u64;
    t * widest
}

/// What a cpu device computes with besides what its activations keep, at
/// `t` tokens a micro-batch on `threads` compute threads, at most: each
/// thread's buffers for an expert's FFN (its hidden-size values h, the
/// gate's sigmoid, dh, da and db for every row it may take, which is every
/// token), the largest left operand of an expert's GEMMs as the bf16
/// kernels read it (t × F pairs widened to f32) and its block of B's
/// packed panels, and the expert's params widened to f32 where its GEMMs
/// are f32 on bf16 params (`widened`); and once, the device's `scratch`
/// buffers of rows gathered for its experts and their output gradients
/// (`strata::engine::scratch_buffers_kept`, each at most t rows of D), and
/// the step's (T, D) and (T·K, D) buffers besides the ones kept (the
/// stack's output, the residual's gradient in and out, the experts' input
/// gradients). Each buffer is kept for the next step, grown to exactly the
/// most it held.
pub fn cpu_workspace_bytes(m: &LmConfig, t: u64, threads: u64, widened: bool, scratch: u64) -> u64 {
    let (d, f, k) = (m.d_model as u64, m.d_ff as u64, m.top_k as u64);
    let params = if widened {
        4 * m.expert_params() as u64
    } else {
        0
    };
    let per_thread = 4 * 5 * t * f + 4 * t * f.max(d) + BF16_GEMM_THREAD_B_BYTES as u64 + params;
    let rows = 4 * scratch * t * d + 4 * (3 + k) * t * d;
    threads.max(1) * per_thread + rows
}
