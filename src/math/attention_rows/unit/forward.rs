//! One unit's forward, a head's query rows [`LANES`] at a time, each row a
//! vector lane: for each key, the block's scores side by side (the
//! query's columns taken from the rows transposed, the key's broadcast),
//! then each lane's running maximum, exps and sum, and its output columns
//! accumulated key after key. Every lane sums exactly what the plain
//! forward sums for its row, in the same order — the score's eight partial
//! sums of [`dot`](crate::math::attention::dot), the softmax's sum and the
//! output's, key after key — so the same bits, while the block's sixteen
//! chains of adds run in one vector rather than one row's chain after
//! another. A key a lane does not attend to (past the diagonal, or before
//! its document) changes nothing of that lane: its probability is +0 and
//! its product is not added (a select, so that not even a non-finite value
//! there reaches the lane).

#![allow(clippy::needless_range_loop)]

use super::{add_product, eight_sums, KEYS, SUMS};
use crate::math::attention_rows::{Kept, Operands};
use crate::math::vector_isa::multiversioned;
use crate::math::Real;

/// Query rows a block takes side by side (a 512-bit register of f32: the
/// backward's block of keys).
pub(super) const LANES: usize = KEYS;

/// Output columns accumulated at once (each a register of lanes).
const COLUMNS: usize = 8;

/// A row of lanes.
type Lanes<R> = [R; LANES];

/// The forward's working space for a job: a block's probabilities (key
/// j's lanes at j·LANES), its query rows transposed (column c's lanes at
/// c·LANES), and the unit's keys and values as rows of `width` columns,
/// hd's padded with zeros to a multiple of [`SUMS`] (a zero column adds
/// +0 to a sum from +0, which leaves it as it was).
pub(in crate::math::attention_rows) struct ForwardScratch<R> {
    probs: Vec<R>,
    qt: Vec<R>,
    keys: Vec<R>,
    values: Vec<R>,
    width: usize,
}

impl<R: Real> ForwardScratch<R> {
    pub(in crate::math::attention_rows) fn new(seq_len: usize, head_dim: usize) -> Self {
        let width = head_dim.div_ceil(SUMS) * SUMS;
        Self {
            probs: vec![R::zero(); LANES * seq_len],
            qt: vec![R::zero(); width * LANES],
            keys: vec![R::zero(); seq_len * width],
            values: vec![R::zero(); seq_len * width],
            width,
        }
    }
}

multiversioned! {
    /// The forward of one unit, kv head g of sequence b: `out` (S,
    /// group·hd) its heads' outputs, `saved` what they keep.
    pub(in crate::math::attention_rows) fn forward_unit<R: Real>(
        x: &Operands<'_, R>,
        unit: (usize, usize),
        out: &mut [R],
        saved: &mut [R],
        scratch: &mut ForwardScratch<R>,
    ) => forward_unit_body;
}

#[inline(always)]
fn forward_unit_body<R: Real>(
    x: &Operands<'_, R>,
    (b, g): (usize, usize),
    out: &mut [R],
    saved: &mut [R],
    scratch: &mut ForwardScratch<R>,
) {
    let width = scratch.width;
    pad_rows(x, (b, g), x.k, &mut scratch.keys, width);
    pad_rows(x, (b, g), x.v, &mut scratch.values, width);
    for n in 0..x.group() {
        for i0 in (0..x.shape.seq_len).step_by(LANES) {
            forward_block(x, (b, g, n), i0, out, saved, scratch);
        }
    }
}

/// `to[j·width + c]` = token j's column c of kv head g of sequence b in
/// `from` (k or v), the columns from hd to `width` zero.
fn pad_rows<R: Real>(
    x: &Operands<'_, R>,
    (b, g): (usize, usize),
    from: &[R],
    to: &mut [R],
    width: usize,
) {
    let hd = x.shape.head_dim;
    for (j, row) in to.chunks_exact_mut(width).take(x.shape.seq_len).enumerate() {
        let at = x.key(b, g, j);
        row[..hd].copy_from_slice(&from[at..at + hd]);
    }
}

/// The keys each lane of the block from query row i0 attends to:
/// `first[r]..=last[r]`, none for a lane past the sequence.
struct Span {
    first: [usize; LANES],
    last: [usize; LANES],
    /// The keys every lane attends to (empty where the block is ragged).
    shared: std::ops::Range<usize>,
    /// The keys some lane attends to.
    all: std::ops::Range<usize>,
}

impl Span {
    fn new<R: Real>(x: &Operands<'_, R>, b: usize, i0: usize) -> Self {
        let rows = (x.shape.seq_len - i0).min(LANES);
        let (mut first, mut last) = ([1; LANES], [0; LANES]);
        for r in 0..rows {
            (first[r], last[r]) = (x.first(b, i0 + r), i0 + r);
        }
        let lowest = first[..rows].iter().copied().min().unwrap_or(0);
        let shared = match rows == LANES {
            true => first.iter().copied().max().unwrap_or(0)..i0 + 1,
            false => 0..0,
        };
        Self {
            first,
            last,
            shared,
            all: lowest..i0 + rows,
        }
    }

    /// Whether lane r attends to key j.
    #[inline(always)]
    fn holds(&self, j: usize) -> [bool; LANES] {
        let mut held = [false; LANES];
        for r in 0..LANES {
            held[r] = self.first[r] <= j && j <= self.last[r];
        }
        held
    }
}

/// Query rows i0..i0 + [`LANES`] of the unit's head n: their scores,
/// softmax, output and what they keep.
#[inline(always)]
fn forward_block<R: Real>(
    x: &Operands<'_, R>,
    (b, g, n): (usize, usize, usize),
    i0: usize,
    out: &mut [R],
    saved: &mut [R],
    scratch: &mut ForwardScratch<R>,
) {
    let shape = x.shape;
    let (s, hd, qw) = (shape.seq_len, shape.head_dim, shape.q_width());
    let span = Span::new(x, b, i0);
    let ForwardScratch {
        probs,
        qt,
        keys,
        values,
        width,
    } = scratch;
    let width = *width;
    // The block's query rows transposed (column c's lanes at c·LANES),
    // zero past the rows and past hd.
    qt.fill(R::zero());
    let h = g * x.group() + n;
    for r in 0..(s - i0).min(LANES) {
        let at = (b * s + i0 + r) * qw + h * hd;
        for (c, &q) in x.q[at..at + hd].iter().enumerate() {
            qt[c * LANES + r] = q;
        }
    }
    let scale = R::one() / R::from_f64(hd as f64).sqrt();
    let (max, sum) = softmax_lanes(&span, qt, (keys, width), scale, probs);
    let ow = x.group() * hd;
    for c0 in (0..hd).step_by(COLUMNS) {
        let acc = weighted_values(&span, probs, (values, width), c0);
        for r in 0..(s - i0).min(LANES) {
            let at = (i0 + r) * ow + n * hd + c0;
            for c in 0..COLUMNS.min(hd - c0) {
                out[at + c] = acc[c][r];
            }
        }
    }
    keep(x, (n, i0), &span, probs, (max, sum), saved);
}

/// Each lane's probabilities into `probs` (key j's lanes at j·LANES; +0
/// where the lane does not attend to j), and its max and sum.
#[inline(always)]
fn softmax_lanes<R: Real>(
    span: &Span,
    qt: &[R],
    (keys, width): (&[R], usize),
    scale: R,
    probs: &mut [R],
) -> (Lanes<R>, Lanes<R>) {
    let mut max = [R::from_f64(f64::NEG_INFINITY); LANES];
    for j in span.all.clone() {
        // Key j's score for every lane: `dot`'s sums and order, a row a lane.
        let score = eight_sums(&keys[j * width..(j + 1) * width], (qt, LANES), scale);
        let held = span.holds(j);
        for r in 0..LANES {
            // Selects rather than branches, so that the lanes vectorize.
            let larger = held[r] && score[r] > max[r];
            max[r] = if larger { score[r] } else { max[r] };
        }
        probs[j * LANES..(j + 1) * LANES].copy_from_slice(&score);
    }
    let mut sum = [R::zero(); LANES];
    for j in span.all.clone() {
        let held = span.holds(j);
        let p: &mut Lanes<R> = (&mut probs[j * LANES..(j + 1) * LANES])
            .try_into()
            .expect("a key's lanes");
        for r in 0..LANES {
            let e = (p[r] - max[r]).exp();
            p[r] = if held[r] { e } else { R::zero() };
            // +0 where not held: a sum from +0 is never −0, so unchanged.
            sum[r] += p[r];
        }
    }
    for j in span.all.clone() {
        let held = span.holds(j);
        for (r, p) in probs[j * LANES..(j + 1) * LANES].iter_mut().enumerate() {
            *p = if held[r] { *p / sum[r] } else { R::zero() };
        }
    }
    (max, sum)
}

/// Output columns c0..c0 + [`COLUMNS`] of every lane: Σ_j P_rj · v_j[c]
/// from +0, key after key, the keys every lane attends to as plain
/// products, the others a product where the lane attends and nothing
/// where not. Each column a variable of its own (so a register: an array
/// of them ends on the stack).
#[inline(always)]
fn weighted_values<R: Real>(
    span: &Span,
    probs: &[R],
    (values, width): (&[R], usize),
    c0: usize,
) -> [Lanes<R>; COLUMNS] {
    let zero = [R::zero(); LANES];
    let (mut a0, mut a1, mut a2, mut a3) = (zero, zero, zero, zero);
    let (mut a4, mut a5, mut a6, mut a7) = (zero, zero, zero, zero);
    for j in span.all.clone() {
        let (p, v) = (&probs[j * LANES..], &values[j * width + c0..]);
        if span.shared.contains(&j) {
            add_product(&mut a0, v[0], p);
            add_product(&mut a1, v[1], p);
            add_product(&mut a2, v[2], p);
            add_product(&mut a3, v[3], p);
            add_product(&mut a4, v[4], p);
            add_product(&mut a5, v[5], p);
            add_product(&mut a6, v[6], p);
            add_product(&mut a7, v[7], p);
        } else {
            let held = span.holds(j);
            add_held(&mut a0, v[0], p, held);
            add_held(&mut a1, v[1], p, held);
            add_held(&mut a2, v[2], p, held);
            add_held(&mut a3, v[3], p, held);
            add_held(&mut a4, v[4], p, held);
            add_held(&mut a5, v[5], p, held);
            add_held(&mut a6, v[6], p, held);
            add_held(&mut a7, v[7], p, held);
        }
    }
    [a0, a1, a2, a3, a4, a5, a6, a7]
}

/// `acc[r]` += `lanes[r]` · `w` for the lanes `held`; the others are left
/// as they are (a select of the sum, not a branch, so that it vectorizes).
#[inline(always)]
fn add_held<R: Real>(acc: &mut Lanes<R>, w: R, lanes: &[R], held: [bool; LANES]) {
    let lanes: &Lanes<R> = lanes[..LANES].try_into().expect("a column's lanes");
    for r in 0..LANES {
        let added = acc[r] + w * lanes[r];
        acc[r] = if held[r] { added } else { acc[r] };
    }
}

/// What the block keeps for the backward: its rows' probabilities (the
/// keys each attends to; the caller zeroed the rest), or each row's max
/// and sum.
#[inline(always)]
fn keep<R: Real>(
    x: &Operands<'_, R>,
    (n, i0): (usize, usize),
    span: &Span,
    probs: &[R],
    (max, sum): (Lanes<R>, Lanes<R>),
    saved: &mut [R],
) {
    let s = x.shape.seq_len;
    let rows = (s - i0).min(LANES);
    let keys = span.all.clone();
    let block = &probs[keys.start * LANES..keys.end * LANES];
    for r in 0..LANES {
        if r == rows {
            break;
        }
        let row = n * s + i0 + r;
        match x.kept {
            // Every key some lane attends to: the lane's probability, +0
            // where it does not attend.
            Kept::Probabilities => {
                let kept = &mut saved[row * s + keys.start..row * s + keys.end];
                for (kept, lanes) in kept.iter_mut().zip(block.chunks_exact(LANES)) {
                    *kept = lanes[r];
                }
            }
            Kept::RowStats => (saved[2 * row], saved[2 * row + 1]) = (max[r], sum[r]),
        }
    }
}
