//! [`NarrowCpuKernels`]: the host's GEMMs for a narrow output (N ≤
//! [`NARROW_MAX_N`]: a router's logits over a handful of experts), whose
//! backward matrixmultiply does poorly: dx = dout · w has an inner
//! dimension of N, and dw = doutᵀ · x has N output rows and a reduction
//! over every token, which it packs and runs on one thread.
//!
//! Here dx goes a row at a time (each element its old value, then the N
//! products in order), split over rows; dw sums fixed blocks of
//! [`DW_BLOCKS`] token ranges in token order, then the blocks in order.
//! Neither order depends on the threads, so any split gives the same bits.
//! The forward, and any wider output, is the cpu backend's GEMM.

use super::gemm::{gemm_backward, gemm_forward, threads_for, Write};
use crate::model::DenseKernels;
use crate::parallel::{compute_threads, run_all};
use crate::EngineError;

/// The GEMMs of a narrow output on the host's cores, whichever device
/// computes the rest (see the module).
pub struct NarrowCpuKernels;

impl DenseKernels for NarrowCpuKernels {
    fn narrow_kernels(&self) -> &dyn DenseKernels {
        self
    }

    fn forward(
        &self,
        out: &mut [f32],
        x: &[f32],
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        gemm_forward(out, x, w, m, k, n);
        Ok(())
    }

    fn backward(
        &self,
        dx: &mut [f32],
        dw: &mut [f32],
        dout: &[f32],
        x: &[f32],
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        let add = [Write::Add; 2];
        if (1..=NARROW_MAX_N).contains(&n) {
            let parts = threads_for(2 * m * k * n, compute_threads());
            narrow_backward(dx, dw, add, dout, x, w, (m, k, n), parts);
        } else {
            gemm_backward(dx, dw, add, dout, x, w, m, k, n);
        }
        Ok(())
    }
}

/// The widest output this path takes.
pub const NARROW_MAX_N: usize = 16;

/// dw's reduction over tokens is cut into at most this many ranges of
/// rows, summed apart (each on a thread of its own) and then in order: the
/// partial sums take DW_BLOCKS × N × K f32.
const DW_BLOCKS: usize = 16;

/// dx (M, K) (+)= dout · w;  dw (N, K) (+)= doutᵀ · x, as
/// `gemm::gemm_backward` defines them, over up to `parts` threads.
#[allow(clippy::too_many_arguments)]
fn narrow_backward(
    dx: &mut [f32],
    dw: &mut [f32],
    writes: [Write; 2],
    dout: &[f32],
    x: &[f32],
    w: &[f32],
    (m, k, n): (usize, usize, usize),
    parts: usize,
) {
    assert!(dx.len() == m * k && dw.len() == n * k && dout.len() == m * n);
    assert!(x.len() == m * k && w.len() == n * k);
    let block_rows = m.div_ceil(DW_BLOCKS).max(1);
    let mut partial = vec![0.0f32; m.div_ceil(block_rows) * n * k];
    let dx_rows = m.div_ceil(parts.max(1)).max(1);
    let mut jobs: Vec<Box<dyn FnOnce() + Send + '_>> = Vec::new();
    for (i, dx) in dx.chunks_mut(dx_rows * k.max(1)).enumerate() {
        let dout = &dout[i * dx_rows * n..];
        jobs.push(Box::new(move || dx_rows_of(dx, writes[0], dout, w, k, n)));
    }
    for (b, part) in partial.chunks_mut((n * k).max(1)).enumerate() {
        let rows = b * block_rows..((b + 1) * block_rows).min(m);
        let (dout, x) = (
            &dout[rows.start * n..rows.end * n],
            &x[rows.start * k..rows.end * k],
        );
        jobs.push(Box::new(move || dw_block(part, dout, x, k, n)));
    }
    if parts <= 1 {
        jobs.into_iter().for_each(|job| job());
    } else {
        run_all(jobs);
    }
    if writes[1] == Write::Set {
        dw.fill(0.0);
    }
    for part in partial.chunks((n * k).max(1)) {
        dw.iter_mut().zip(part).for_each(|(d, p)| *d += p);
    }
}

/// dx's rows (+)= their rows of dout · w.
fn dx_rows_of(dx: &mut [f32], write: Write, dout: &[f32], w: &[f32], k: usize, n: usize) {
    for (row, g) in dx.chunks_exact_mut(k).zip(dout.chunks_exact(n)) {
        if write == Write::Set {
            row.fill(0.0);
        }
        for (gj, wj) in g.iter().zip(w.chunks_exact(k)) {
            row.iter_mut().zip(wj).for_each(|(d, w)| *d += gj * w);
        }
    }
}

/// part (N, K) = the block's rows of doutᵀ · x, summed in row order.
fn dw_block(part: &mut [f32], dout: &[f32], x: &[f32], k: usize, n: usize) {
    for (g, xr) in dout.chunks_exact(n).zip(x.chunks_exact(k)) {
        for (gj, pj) in g.iter().zip(part.chunks_exact_mut(k)) {
            pj.iter_mut().zip(xr).for_each(|(p, x)| *p += gj * x);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::math::linear_backward;
    use crate::model::fill_uniform;

    fn filled(len: usize, seed: u64) -> Vec<f32> {
        let mut v = vec![0.0; len];
        fill_uniform(&mut v, seed, 0, 1.0);
        v
    }

    fn worst(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn the_narrow_backward_matches_the_plain_one_and_any_split_gives_its_bits() {
        for (m, k, n) in [
            (8192, 96, 8),
            (37, 19, 3),
            (5, 7, 16),
            (1, 4, 1),
            (33, 8, 2),
            (3, 0, 2),
        ] {
            let (x, w, dout) = (filled(m * k, 1), filled(n * k, 2), filled(m * n, 3));
            let (mut dx, mut dw) = (filled(m * k, 4), filled(n * k, 5));
            let (mut want_dx, mut want_dw) = (dx.clone(), dw.clone());
            linear_backward(&mut want_dx, &mut want_dw, &dout, &x, &w, m, k, n);
            let (start_dx, start_dw) = (dx.clone(), dw.clone());
            let add = [Write::Add; 2];
            narrow_backward(&mut dx, &mut dw, add, &dout, &x, &w, (m, k, n), 1);
            // dw sums up to 8192 products of values in [-1, 1]: its f32
            // rounding is within ~m·2⁻²⁴ of the largest partial sums.
            assert!(worst(&dx, &want_dx) < 1e-5, "dx {}", worst(&dx, &want_dx));
            let bound = 1e-6 * m as f32;
            assert!(worst(&dw, &want_dw) < bound, "dw {}", worst(&dw, &want_dw));
            for parts in [2, 3, 8] {
                let (mut dx2, mut dw2) = (start_dx.clone(), start_dw.clone());
                narrow_backward(&mut dx2, &mut dw2, add, &dout, &x, &w, (m, k, n), parts);
                assert!(dx2 == dx && dw2 == dw, "{parts} parts at {m}×{k}×{n}");
            }
            let (mut dx3, mut dw3) = (filled(m * k, 9), filled(n * k, 9));
            let set = [Write::Set; 2];
            narrow_backward(&mut dx3, &mut dw3, set, &dout, &x, &w, (m, k, n), 2);
            let (mut dx0, mut dw0) = (vec![0.0; m * k], vec![0.0; n * k]);
            narrow_backward(&mut dx0, &mut dw0, add, &dout, &x, &w, (m, k, n), 1);
            assert!(dx3 == dx0 && dw3 == dw0, "Set writes equal adds onto zeros");
        }
    }
}
