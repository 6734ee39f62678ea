//! Attention as `src/backend/cuda/attention.rs` runs it, on the emulator:
//! the same kernels launched with the same arguments, the same blocks of
//! query rows, and a plain strided-batched GEMM in cuBLAS's column-major
//! terms where the backend calls cublasGemmStridedBatchedEx — a change to
//! the backend's sequence is mirrored here.

use strata::backend::ROW_PARTS;
use strata::math::attention::AttnShape;

use super::{arg, KernelEmulator};

/// One operand of the batched GEMM: offset, leading dimension and stride
/// into a host buffer, in f32.
#[derive(Clone, Copy)]
struct Operand {
    offset: usize,
    ld: usize,
    stride: usize,
}

fn heads(shape: &AttnShape, row: usize) -> Operand {
    Operand {
        offset: row * shape.head_dim,
        ld: shape.head_dim,
        stride: shape.seq_len * shape.head_dim,
    }
}

fn scores(rows: usize, keys: usize) -> Operand {
    Operand {
        offset: 0,
        ld: keys,
        stride: rows * keys,
    }
}

/// Column-major c = op(a)·op(b) + beta·c for each of `batch` items
/// (transposes as cuBLAS's `CUBLAS_OP_T`), f32, summed over the inner
/// index in order.
#[allow(clippy::too_many_arguments)]
fn gemm_batched(
    batch: usize,
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    (a, oa): (&[f32], Operand),
    (b, ob): (&[f32], Operand),
    beta: f32,
    (c, oc): (&mut [f32], Operand),
) {
    for item in 0..batch {
        let (a0, b0, c0) = (
            oa.offset + item * oa.stride,
            ob.offset + item * ob.stride,
            oc.offset + item * oc.stride,
        );
        for j in 0..n {
            for i in 0..m {
                let mut acc = 0.0f32;
                for p in 0..k {
                    let ai = if ta { p + i * oa.ld } else { i + p * oa.ld };
                    let bi = if tb { j + p * ob.ld } else { p + j * ob.ld };
                    acc += a[a0 + ai] * b[b0 + bi];
                }
                let cij = &mut c[c0 + i + j * oc.ld];
                *cij = if beta == 0.0 { acc } else { acc + beta * *cij };
            }
        }
    }
}

/// The query rows [q0, q0 + rows) of one block.
#[derive(Clone, Copy)]
struct Block {
    q0: usize,
    rows: usize,
}

fn blocks(shape: &AttnShape, bytes: usize) -> Vec<Block> {
    let (s, rows) = (shape.seq_len, shape.query_block_rows(bytes));
    (0..s)
        .step_by(rows)
        .map(|q0| Block {
            q0,
            rows: rows.min(s - q0),
        })
        .collect()
}

impl KernelEmulator {
    fn tokens_to_heads(&self, x: &[f32], heads_in: usize, shape: &AttnShape) -> Vec<f32> {
        assert_eq!(x.len(), shape.tokens() * heads_in * shape.head_dim);
        let n = shape.tokens() * shape.heads * shape.head_dim;
        let mut dst = vec![0.0f32; n];
        let (px, pd) = (x.as_ptr(), dst.as_mut_ptr());
        let dims = [
            shape.seqs,
            shape.seq_len,
            shape.heads,
            heads_in,
            shape.head_dim,
        ];
        let dims = dims.map(|x| x as u32);
        let mut args = vec![arg(&px), arg(&pd)];
        args.extend(dims.iter().map(arg));
        self.launch("attn_to_heads", n, &args);
        dst
    }

    fn heads_to_tokens(&self, src: &[f32], dst: &mut [f32], heads_out: usize, shape: &AttnShape) {
        let n = shape.tokens() * heads_out * shape.head_dim;
        assert_eq!(dst.len(), n);
        let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
        let dims = [
            shape.seqs,
            shape.seq_len,
            shape.heads,
            heads_out,
            shape.head_dim,
        ];
        let dims = dims.map(|x| x as u32);
        let accumulate = 1u32;
        let mut args = vec![arg(&ps), arg(&pd)];
        args.extend(dims.iter().map(arg));
        args.push(arg(&accumulate));
        self.launch("attn_from_heads", n, &args);
    }

    #[allow(clippy::too_many_arguments)]
    fn softmax(
        &self,
        scores: &mut [f32],
        stats: &mut [f32],
        starts: &[u32],
        block: Block,
        shape: &AttnShape,
        from_stats: bool,
    ) {
        // As `CudaBackend::block_softmax`: the rows' parts (max, then
        // sum), their stats, then the probabilities from the stats.
        let rows = shape.seqs * shape.heads * block.rows;
        let keys = block.q0 + block.rows;
        let (pp, pst, ps) = (scores.as_mut_ptr(), stats.as_mut_ptr(), starts.as_ptr());
        let dims = [
            shape.seqs,
            shape.seq_len,
            shape.heads,
            shape.head_dim,
            block.q0,
            block.rows,
        ]
        .map(|x| x as u32);
        if !from_stats {
            let mut partials = vec![0.0f32; rows * 2 * ROW_PARTS];
            let ppart = partials.as_mut_ptr();
            for sums in [0u32, 1] {
                let mut args = vec![arg(&pp), arg(&ppart), arg(&ps)];
                args.extend(dims.iter().map(arg));
                args.push(arg(&sums));
                self.launch("attn_softmax_partials", rows * ROW_PARTS, &args);
            }
            let [seqs, s, heads, _, q0, block_rows] = &dims;
            let args = [
                arg(&ppart),
                arg(&pst),
                arg(seqs),
                arg(s),
                arg(heads),
                arg(q0),
                arg(block_rows),
            ];
            self.launch("attn_softmax_stats", rows, &args);
        }
        let mut args = vec![arg(&pp), arg(&pst), arg(&ps)];
        args.extend(dims.iter().map(arg));
        self.launch("attn_softmax", rows * keys, &args);
    }

    fn softmax_backward(&self, probs: &[f32], dprobs: &mut [f32], block: Block, shape: &AttnShape) {
        let rows = shape.seqs * shape.heads * block.rows;
        let keys = block.q0 + block.rows;
        let (pp, pd) = (probs.as_ptr(), dprobs.as_mut_ptr());
        let mut partials = vec![0.0f32; rows * ROW_PARTS];
        let ppart = partials.as_mut_ptr();
        let [seqs, heads, hd, q0, block_rows] = [
            shape.seqs,
            shape.heads,
            shape.head_dim,
            block.q0,
            block.rows,
        ]
        .map(|x| x as u32);
        // The same arguments, the head dimension (its scale) in the second.
        let (before_hd, after_hd) = (
            [arg(&pp), arg(&pd), arg(&ppart), arg(&seqs), arg(&heads)],
            [arg(&q0), arg(&block_rows)],
        );
        let args = [&before_hd[..], &after_hd].concat();
        self.launch("attn_softmax_backward_partials", rows * ROW_PARTS, &args);
        let args = [&before_hd[..], &[arg(&hd)], &after_hd].concat();
        self.launch("attn_softmax_backward", rows * keys, &args);
    }

    /// `CudaBackend::attention_forward_blocks`.
    pub fn attention_forward_blocks(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: &[u32],
        shape: &AttnShape,
        block_bytes: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        assert_eq!(starts.len(), shape.tokens());
        let (qh, kh) = (
            self.tokens_to_heads(q, shape.heads, shape),
            self.tokens_to_heads(k, shape.kv_heads, shape),
        );
        let vh = self.tokens_to_heads(v, shape.kv_heads, shape);
        let (batch, hd) = (shape.seqs * shape.heads, shape.head_dim);
        let mut out = vec![0.0f32; qh.len()];
        let mut stats = vec![0.0f32; 2 * batch * shape.seq_len];
        let rows = shape.query_block_rows(block_bytes);
        let mut probs = vec![0.0f32; batch * rows * shape.seq_len];
        for b in blocks(shape, block_bytes) {
            let (sc, keys) = (scores(b.rows, b.q0 + b.rows), b.q0 + b.rows);
            let dims = (keys, b.rows, hd);
            let (q_at, k_at) = ((&qh[..], heads(shape, b.q0)), (&kh[..], heads(shape, 0)));
            gemm_batched(
                batch,
                (true, false),
                dims,
                k_at,
                q_at,
                0.0,
                (&mut probs, sc),
            );
            self.softmax(&mut probs, &mut stats, starts, b, shape, false);
            let dims = (hd, b.rows, keys);
            let out_at = (&mut out[..], heads(shape, b.q0));
            let (v_at, p_at) = ((&vh[..], heads(shape, 0)), (&probs[..], sc));
            gemm_batched(batch, (false, false), dims, v_at, p_at, 0.0, out_at);
        }
        let mut token_out = vec![0.0f32; shape.tokens() * shape.q_width()];
        self.heads_to_tokens(&out, &mut token_out, shape.heads, shape);
        (token_out, stats)
    }

    /// `CudaBackend::attention_backward_blocks`: dq, dk and dv accumulate.
    pub fn attention_backward_blocks(
        &self,
        [dq, dk, dv]: [&mut [f32]; 3],
        [dout, stats, q, k, v]: [&[f32]; 5],
        starts: &[u32],
        shape: &AttnShape,
        block_bytes: usize,
    ) {
        assert_eq!(starts.len(), shape.tokens());
        let (qh, kh) = (
            self.tokens_to_heads(q, shape.heads, shape),
            self.tokens_to_heads(k, shape.kv_heads, shape),
        );
        let vh = self.tokens_to_heads(v, shape.kv_heads, shape);
        let doh = self.tokens_to_heads(dout, shape.heads, shape);
        let mut stats = stats.to_vec();
        let (batch, hd) = (shape.seqs * shape.heads, shape.head_dim);
        let (mut gq, mut gk, mut gv) = (
            vec![0.0f32; qh.len()],
            vec![0.0f32; qh.len()],
            vec![0.0f32; qh.len()],
        );
        let rows = shape.query_block_rows(block_bytes);
        let mut probs = vec![0.0f32; batch * rows * shape.seq_len];
        let mut dprobs = probs.clone();
        for b in blocks(shape, block_bytes) {
            let (sc, keys) = (scores(b.rows, b.q0 + b.rows), b.q0 + b.rows);
            let (rows_at, all) = (heads(shape, b.q0), heads(shape, 0));
            gemm_batched(
                batch,
                (true, false),
                (keys, b.rows, hd),
                (&kh, all),
                (&qh, rows_at),
                0.0,
                (&mut probs, sc),
            );
            self.softmax(&mut probs, &mut stats, starts, b, shape, true);
            gemm_batched(
                batch,
                (false, true),
                (hd, keys, b.rows),
                (&doh, rows_at),
                (&probs, sc),
                1.0,
                (&mut gv, all),
            );
            gemm_batched(
                batch,
                (true, false),
                (keys, b.rows, hd),
                (&vh, all),
                (&doh, rows_at),
                0.0,
                (&mut dprobs, sc),
            );
            self.softmax_backward(&probs, &mut dprobs, b, shape);
            gemm_batched(
                batch,
                (false, false),
                (hd, b.rows, keys),
                (&kh, all),
                (&dprobs, sc),
                0.0,
                (&mut gq, rows_at),
            );
            gemm_batched(
                batch,
                (false, true),
                (hd, keys, b.rows),
                (&qh, rows_at),
                (&dprobs, sc),
                1.0,
                (&mut gk, all),
            );
        }
        self.heads_to_tokens(&gq, dq, shape.heads, shape);
        self.heads_to_tokens(&gk, dk, shape.kv_heads, shape);
        self.heads_to_tokens(&gv, dv, shape.kv_heads, shape);
    }
}
