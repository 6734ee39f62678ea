//! Dropless token permutation: a token's K assignments grouped into
//! contiguous per-expert rows in a stable order (no capacity, no padding),
//! and the gathers, scatters and weighted combine that move rows between
//! token order and expert order.

#![allow(clippy::needless_range_loop)]

use super::Real;

/// Assignments (t, k) grouped by expert in a stable order: `order` lists
/// assignment indices (t·K + k) expert by expert, token order within each;
/// expert e's are `order[offsets[e]..offsets[e + 1]]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Permutation {
    pub order: Vec<u32>,
    pub offsets: Vec<u32>,
}

impl Permutation {
    /// A counting sort of the routing's (T, K) expert choices.
    pub fn from_routing(experts_per_token: &[u32], experts: usize) -> Self {
        let mut offsets = vec![0u32; experts + 1];
        for &e in experts_per_token {
            offsets[e as usize + 1] += 1;
        }
        for e in 0..experts {
            offsets[e + 1] += offsets[e];
        }
        let mut cursor = offsets.clone();
        let mut order = vec![0u32; experts_per_token.len()];
        for (a, &e) in experts_per_token.iter().enumerate() {
            order[cursor[e as usize] as usize] = a as u32;
            cursor[e as usize] += 1;
        }
        Self { order, offsets }
    }

    pub fn rows(&self, expert: usize) -> &[u32] {
        &self.order[self.offsets[expert] as usize..self.offsets[expert + 1] as usize]
    }
}

/// rows (n, D) = x[token of each assignment]
pub fn gather_forward<R: Real>(rows: &mut [R], x: &[R], assignments: &[u32], k: usize, d: usize) {
    for (r, &a) in assignments.iter().enumerate() {
        let t = a as usize / k;
        rows[r * d..(r + 1) * d].copy_from_slice(&x[t * d..(t + 1) * d]);
    }
}

/// y (T, D) = Σ_k w_tk · per_assignment[(t, k)], summed in k order.
pub fn combine_forward<R: Real>(
    y: &mut [R],
    per_assignment: &[R],
    weights: &[R],
    t: usize,
    k: usize,
    d: usize,
) {
    for i in 0..t {
        for j in 0..d {
            let mut acc = R::zero();
            for s in 0..k {
                acc += weights[i * k + s] * per_assignment[(i * k + s) * d + j];
            }
            y[i * d + j] = acc;
        }
    }
}

/// d per_assignment = w · dy; dweights = dy · per_assignment.
pub fn combine_backward<R: Real>(
    dper_assignment: &mut [R],
    dweights: &mut [R],
    dy: &[R],
    per_assignment: &[R],
    weights: &[R],
    t: usize,
    k: usize,
    d: usize,
) {
    for i in 0..t {
        for s in 0..k {
            let a = i * k + s;
            let mut dot = R::zero();
            for j in 0..d {
                dper_assignment[a * d + j] = weights[a] * dy[i * d + j];
                dot += dy[i * d + j] * per_assignment[a * d + j];
            }
            dweights[a] = dot;
        }
    }
}

/// dx (T, D) += Σ_k d per_assignment_input[(t, k)], in k order.
pub fn gather_backward<R: Real>(
    dx: &mut [R],
    dper_assignment_input: &[R],
    t: usize,
    k: usize,
    d: usize,
) {
    for i in 0..t {
        for s in 0..k {
            let a = i * k + s;
            for j in 0..d {
                dx[i * d + j] += dper_assignment_input[a * d + j];
            }
        }
    }
}

/// `dst[a]` (T·K, D) = `src[r]` (n, D) for each r-th assignment a of `rows`.
pub fn scatter_to_assignments<R: Real>(dst: &mut [R], src: &[R], rows: &[u32], d: usize) {
    for (r, &a) in rows.iter().enumerate() {
        let a = a as usize;
        dst[a * d..(a + 1) * d].copy_from_slice(&src[r * d..(r + 1) * d]);
    }
}

/// `dst[r]` (n, D) = `src[a]` (T·K, D) for each r-th assignment a of `rows`.
pub fn gather_from_assignments<R: Real>(dst: &mut [R], src: &[R], rows: &[u32], d: usize) {
    for (r, &a) in rows.iter().enumerate() {
        let a = a as usize;
        dst[r * d..(r + 1) * d].copy_from_slice(&src[a * d..(a + 1) * d]);
    }
}
