//! Causal grouped-query attention as the engine runs it on the cpu, one
//! query row at a time, keeping for the backward either every probability
//! (B·H·S², as [`attention_forward`](super::attention::attention_forward)
//! does) or, where those would take more than
//! [`KEPT_PROBABILITIES_MAX_BYTES`], each query row's softmax max and sum
//! (2·B·H·S), from which the backward recomputes the probabilities row by
//! row: a long sequence then costs memory in proportion to its length,
//! not its square (at S = 2048 and 8 heads, 128 KiB a sequence rather
//! than 128 MiB), for one more q·kᵀ and exp in the backward.
//!
//! Either way the same bits as the plain functions, which stay as the
//! oracle: a row's scores are the same dot products, its probabilities the
//! same `exp(score − max) / sum`, and every gradient sums its terms in the
//! same order. The plain backward also adds, for the keys before a
//! token's document, zero-probability terms (±0), which change no sum that
//! starts from +0; here they are skipped. The loops (`unit.rs`) take a
//! row's dot products a block of keys at a time, a key a vector lane, and
//! are compiled for the widest vectors the CPU has ([`VectorIsa`]), the
//! same bits in each.

#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

mod unit;

use super::attention::AttnShape;
use super::vector_isa::VectorIsa;
use crate::math::Real;
use unit::{backward_unit, forward_unit, ForwardScratch, Scratch};

/// Above this many bytes of probabilities (B·H·S² f32, one call's) the
/// attention keeps each row's max and sum instead: below it, keeping them
/// spares the backward a q·kᵀ and an exp a probability (recomputing them
/// took the backward 1.44–1.47× the time on the development machine, at
/// 16 × 64 and 1 × 512 tokens of small's heads), at a cost
/// in memory that the rest of a layer's activations dwarf (small's
/// default batch); above it, the probabilities would grow with the square
/// of the sequence (64 MiB a layer for small's heads at 2048 tokens).
pub const KEPT_PROBABILITIES_MAX_BYTES: usize = 16 << 20;

/// What the attention keeps for its backward at a shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kept {
    /// Every probability, (B, H, S, S) (zero above the diagonal and
    /// outside a token's document, as written by the forward).
    Probabilities,
    /// Each query row's softmax max and sum, (B, H, S, 2).
    RowStats,
}

impl Kept {
    /// What the engine's attention keeps at `shape`.
    pub fn at(shape: &AttnShape) -> Self {
        match 4 * shape.probs_len() <= KEPT_PROBABILITIES_MAX_BYTES {
            true => Kept::Probabilities,
            false => Kept::RowStats,
        }
    }

    /// The values kept at `shape`.
    pub fn len(self, shape: &AttnShape) -> usize {
        match self {
            Kept::Probabilities => shape.probs_len(),
            Kept::RowStats => row_stats_len(shape),
        }
    }

    /// Values kept a sequence.
    fn per_seq(self, shape: &AttnShape) -> usize {
        self.len(&AttnShape { seqs: 1, ..*shape })
    }
}

/// The values the engine's attention keeps at `shape`.
pub fn saved_len(shape: &AttnShape) -> usize {
    Kept::at(shape).len(shape)
}

/// Each query row's softmax max and sum: (B, H, S, 2).
pub fn row_stats_len(shape: &AttnShape) -> usize {
    2 * shape.seqs * shape.heads * shape.seq_len
}

/// Below this many multiply-adds (about 1 ms on one core) attention is
/// not split over threads.
const SPLIT_MIN_MACS: usize = 2 << 20;

/// At most this many threads an attention call.
const MAX_ATTENTION_THREADS: usize = 8;

/// The jobs an attention call at `shape` runs as, on up to `threads`
/// threads: one where it is too small to be worth splitting, else at most
/// one a unit (a sequence's heads that share a kv head).
fn jobs(shape: &AttnShape, threads: usize) -> usize {
    let s = shape.seq_len;
    let macs = shape.seqs * shape.heads * s * s * shape.head_dim;
    let units = shape.seqs * shape.kv_heads;
    match macs < SPLIT_MIN_MACS {
        true => 1,
        false => threads.clamp(1, MAX_ATTENTION_THREADS).min(units).max(1),
    }
}

/// The read-only operands of a call, and its shape.
struct Operands<'a, R> {
    q: &'a [R],
    k: &'a [R],
    v: &'a [R],
    starts: Option<&'a [u32]>,
    shape: &'a AttnShape,
    kept: Kept,
    /// The vectors the units' loops are compiled for.
    isa: VectorIsa,
}

impl<R: Real> Operands<'_, R> {
    /// Query heads a kv head serves.
    #[inline(always)]
    fn group(&self) -> usize {
        self.shape.heads / self.shape.kv_heads
    }

    /// Where token j of sequence b's kv head g starts in k and v.
    #[inline(always)]
    fn key(&self, b: usize, g: usize, j: usize) -> usize {
        let s = self.shape;
        (b * s.seq_len + j) * s.kv_width() + g * s.head_dim
    }

    /// The first key token i of sequence b attends to.
    #[inline(always)]
    fn first(&self, b: usize, i: usize) -> usize {
        let ti = b * self.shape.seq_len + i;
        self.starts.map_or(0, |st| st[ti] as usize).min(i)
    }

    /// Values kept for one unit (a sequence's heads of one kv head).
    fn kept_per_unit(&self) -> usize {
        self.kept.per_seq(self.shape) / self.shape.kv_heads
    }
}

/// Runs `work(unit, slices, scratch)` for every unit (kv head g of
/// sequence b, sequence-major), the units shared out in order over `jobs`
/// jobs; each of `parts` (a buffer and its values a unit) is cut into one
/// slice a unit, and each job lends its units one `new_scratch()`.
fn for_units<R: Real, S>(
    shape: &AttnShape,
    jobs: usize,
    parts: Vec<(&mut [R], usize)>,
    new_scratch: impl Fn() -> S + Sync,
    work: impl Fn((usize, usize), &mut [&mut [R]], &mut S) + Sync,
) {
    let (units, kv) = (shape.seqs * shape.kv_heads, shape.kv_heads);
    let per = units.div_ceil(jobs.max(1)).max(1);
    let lens: Vec<usize> = parts.iter().map(|p| p.1).collect();
    assert!(
        parts
            .iter()
            .all(|(p, len)| *len > 0 && p.len() == units * len),
        "a slice a unit"
    );
    let mut chunks: Vec<_> = parts
        .into_iter()
        .map(|(p, len)| p.chunks_mut(per * len).collect::<Vec<_>>().into_iter())
        .collect();
    let work = &work;
    let job_list: Vec<_> = (0..units.div_ceil(per))
        .map(|j| {
            let mine: Vec<&mut [R]> = chunks
                .iter_mut()
                .map(|c| c.next().expect("a chunk a job"))
                .collect();
            let (lens, new_scratch) = (lens.clone(), &new_scratch);
            move || {
                let mut scratch = new_scratch();
                let mut slices: Vec<_> = mine
                    .into_iter()
                    .zip(&lens)
                    .map(|(c, &len)| c.chunks_mut(len))
                    .collect();
                for unit in j * per..((j + 1) * per).min(units) {
                    let mut mine: Vec<&mut [R]> = slices
                        .iter_mut()
                        .map(|c| c.next().expect("a slice a unit"))
                        .collect();
                    work((unit / kv, unit % kv), &mut mine, &mut scratch);
                }
            }
        })
        .collect();
    crate::parallel::run_all(job_list);
}

/// Moves between a (T, width) buffer and its units' column blocks, each
/// unit (b, g) the columns g·cols..(g + 1)·cols of sequence b's S rows,
/// laid out unit after unit: `to_units` copies them out, else back in.
fn unit_columns<R: Real>(
    full: &mut [R],
    units: &mut [R],
    shape: &AttnShape,
    cols: usize,
    to_units: bool,
) {
    let (s, kv) = (shape.seq_len, shape.kv_heads);
    let width = kv * cols;
    for (u, block) in units.chunks_mut(s * cols).enumerate() {
        let (b, g) = (u / kv, u % kv);
        for (i, row) in block.chunks_mut(cols).enumerate() {
            let at = (b * s + i) * width + g * cols;
            match to_units {
                true => row.copy_from_slice(&full[at..at + cols]),
                false => full[at..at + cols].copy_from_slice(row),
            }
        }
    }
}

/// out (T, H·hd) = softmax(q kᵀ / √hd, causal) v per sequence and head,
/// each token within its document where `starts` says where documents
/// begin; `saved` (`kept.len(shape)` values) receives what the backward
/// needs. The units (a sequence's heads that share a kv head) are shared
/// out over up to `threads` threads; each is computed as on one thread,
/// so the result is the same bits however they are shared.
pub fn attention_rows_forward<R: Real>(
    out: &mut [R],
    saved: &mut [R],
    kept: Kept,
    qkv: (&[R], &[R], &[R]),
    starts: Option<&[u32]>,
    shape: &AttnShape,
    threads: usize,
) {
    attention_rows_forward_on(
        VectorIsa::detected(),
        out,
        saved,
        kept,
        qkv,
        starts,
        shape,
        threads,
    )
}

/// [`attention_rows_forward`] in the loops compiled for `isa` (the same
/// bits in each; the baseline's where this CPU lacks it).
pub fn attention_rows_forward_on<R: Real>(
    isa: VectorIsa,
    out: &mut [R],
    saved: &mut [R],
    kept: Kept,
    (q, k, v): (&[R], &[R], &[R]),
    starts: Option<&[u32]>,
    shape: &AttnShape,
    threads: usize,
) {
    assert_eq!(saved.len(), kept.len(shape), "what the backward needs");
    assert_eq!(out.len(), shape.tokens() * shape.q_width(), "out (T, H·hd)");
    let x = Operands {
        q,
        k,
        v,
        starts,
        shape,
        kept,
        isa,
    };
    let (s, cols) = (shape.seq_len, x.group() * shape.head_dim);
    if kept == Kept::Probabilities {
        saved.fill(R::zero());
    }
    let mut outs = vec![R::zero(); out.len()];
    let parts = vec![(&mut outs[..], s * cols), (saved, x.kept_per_unit())];
    let new_scratch = || ForwardScratch::new(s, shape.head_dim);
    for_units(
        shape,
        jobs(shape, threads),
        parts,
        new_scratch,
        |unit, bufs, scratch| {
            let [out, saved] = bufs else {
                unreachable!("two parts")
            };
            forward_unit(x.isa, &x, unit, out, saved, scratch);
        },
    );
    unit_columns(out, &mut outs, shape, cols, false);
}

/// dq, dk, dv += the gradients of [`attention_rows_forward`] from dout,
/// given what it kept and the same `starts`; shared out as the forward.
pub fn attention_rows_backward<R: Real>(
    [dq, dk, dv]: [&mut [R]; 3],
    dout: &[R],
    saved: &[R],
    kept: Kept,
    qkv: (&[R], &[R], &[R]),
    starts: Option<&[u32]>,
    shape: &AttnShape,
    threads: usize,
) {
    attention_rows_backward_on(
        VectorIsa::detected(),
        [dq, dk, dv],
        dout,
        saved,
        kept,
        qkv,
        starts,
        shape,
        threads,
    )
}

/// [`attention_rows_backward`] in the loops compiled for `isa`.
pub fn attention_rows_backward_on<R: Real>(
    isa: VectorIsa,
    [dq, dk, dv]: [&mut [R]; 3],
    dout: &[R],
    saved: &[R],
    kept: Kept,
    (q, k, v): (&[R], &[R], &[R]),
    starts: Option<&[u32]>,
    shape: &AttnShape,
    threads: usize,
) {
    assert_eq!(saved.len(), kept.len(shape), "what the forward kept");
    let x = Operands {
        q,
        k,
        v,
        starts,
        shape,
        kept,
        isa,
    };
    let (s, hd) = (shape.seq_len, shape.head_dim);
    let cols = x.group() * hd;
    let per_unit = x.kept_per_unit();
    let mut grads = [(dq, cols), (dk, hd), (dv, hd)].map(|(full, cols)| {
        let mut units = vec![R::zero(); full.len()];
        unit_columns(full, &mut units, shape, cols, true);
        (full, units, cols)
    });
    let [gq, gk, gv] = &mut grads;
    let parts = vec![
        (&mut gq.1[..], s * gq.2),
        (&mut gk.1[..], s * hd),
        (&mut gv.1[..], s * hd),
    ];
    for_units(
        shape,
        jobs(shape, threads),
        parts,
        || Scratch::backward(s, hd, kept),
        |(b, g), bufs, scratch| {
            let [dq, dk, dv] = bufs else {
                unreachable!("three parts")
            };
            let unit = b * shape.kv_heads + g;
            let saved = &saved[unit * per_unit..(unit + 1) * per_unit];
            backward_unit(x.isa, &x, (b, g), dout, saved, [dq, dk, dv], scratch);
        },
    );
    for (full, mut units, cols) in grads {
        unit_columns(full, &mut units, shape, cols, false);
    }
}

#[cfg(test)]
mod tests;
