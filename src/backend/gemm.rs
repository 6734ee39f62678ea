//! The cpu backend's GEMMs: `matrixmultiply`'s single-threaded sgemm,
//! split by output rows over scoped threads.
//!
//! matrixmultiply blocks the output, never the reduction: each output
//! element is the same sum in the same order whichever rows a call covers,
//! so splitting the rows changes no bit of the result (a test below holds
//! this), and results do not depend on the number of cores.
//!
//! Why not matrixmultiply's own threading: its pool waits for a worker's
//! half by calling `sched_yield` in a loop. On the 2-core development
//! machine, where the GEMMs share the cores with the optimizer, the
//! prefetcher and the checksums, a descheduled worker left the caller
//! spinning: 22 % of `strata bench step`'s samples were in `sched_yield`.
//! The parts go to strata's own pool (`parallel::run_all`), whose workers
//! poll briefly and then sleep, so the core goes to whoever has work.
//! Calls under `PARALLEL_MIN_MACS` multiply-adds stay on the calling
//! thread.

use crate::parallel::{compute_threads, run_all};

/// Below this many multiply-adds (about 20 µs on one core) a GEMM is not
/// split (8 << 20 before the pool polled; docs/performance.md, "The
/// pool's smallest job").
const PARALLEL_MIN_MACS: usize = 1 << 20;

/// At most this many threads a GEMM (beyond it the caller's other threads
/// need the cores more than one expert's GEMM does).
const MAX_GEMM_THREADS: usize = 4;

/// Threads for a GEMM of `macs` multiply-adds on a machine of `cores`.
pub(super) fn threads_for(macs: usize, cores: usize) -> usize {
    if macs < PARALLEL_MIN_MACS {
        1
    } else {
        cores.clamp(1, MAX_GEMM_THREADS)
    }
}

/// Rows per part when `rows` are split in `parts`, rounded up to a multiple
/// of 8 (whole register tiles of the sgemm kernel).
fn rows_per_part(rows: usize, parts: usize) -> usize {
    rows.div_ceil(parts.max(1)).next_multiple_of(8).max(1)
}

/// out (M, N) = x (M, K) · w (N, K)ᵀ
pub fn gemm_forward(out: &mut [f32], x: &[f32], w: &[f32], m: usize, k: usize, n: usize) {
    forward_in_parts(
        out,
        x,
        w,
        m,
        k,
        n,
        threads_for(m * k * n, compute_threads()),
    );
}

fn forward_in_parts(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    parts: usize,
) {
    assert!(out.len() == m * n && x.len() == m * k && w.len() == n * k);
    if m * n * k == 0 {
        // An empty sum (K = 0) or an empty output.
        out.fill(0.0);
        return;
    }
    if parts <= 1 {
        forward_rows(out, x, w, k, n);
        return;
    }
    let rows = rows_per_part(m, parts);
    run_all(
        out.chunks_mut(rows * n)
            .zip(x.chunks(rows * k))
            .map(|(out, x)| move || forward_rows(out, x, w, k, n))
            .collect(),
    );
}

/// out (rows, N) = x (rows, K) · w (N, K)ᵀ, rows = out.len() / N.
fn forward_rows(out: &mut [f32], x: &[f32], w: &[f32], k: usize, n: usize) {
    let m = out.len().checked_div(n).unwrap_or(0);
    assert!(out.len() == m * n && x.len() == m * k && w.len() == n * k);
    // SAFETY: the slices hold exactly the M×K, N×K and M×N elements the
    // strides below address (asserted above); `out` does not alias inputs.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            x.as_ptr(),
            k as isize,
            1,
            w.as_ptr(),
            1,
            k as isize,
            0.0,
            out.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// How a backward GEMM writes an output: adds the product to what is
/// there, or replaces it (the output's old values are never read, so it
/// needs no zeroing first). For the same product the two give the same
/// bits, but for the sign of a zero sum: matrixmultiply sums each element
/// in the same order either way, and 0 + s = s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Write {
    Add,
    Set,
}

impl Write {
    fn beta(self) -> f32 {
        match self {
            Write::Add => 1.0,
            Write::Set => 0.0,
        }
    }
}

/// dx (M, K) (+)= dout · w;  dw (N, K) (+)= doutᵀ · x, each added to or
/// set as `writes` = [dx's, dw's] says.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_backward(
    dx: &mut [f32],
    dw: &mut [f32],
    writes: [Write; 2],
    dout: &[f32],
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
) {
    let parts = threads_for(2 * m * k * n, compute_threads());
    backward_in_parts(dx, dw, writes, dout, x, w, m, k, n, parts);
}

/// One part of a backward GEMM pair.
enum BackwardPart<'a> {
    /// dx rows [`row0`, `row0` + len / K) (+)= dout rows · w
    Dx {
        dx: &'a mut [f32],
        row0: usize,
        write: Write,
    },
    /// dw rows [`row0`, `row0` + len / K) (+)= dout columns ᵀ · x
    Dw {
        dw: &'a mut [f32],
        row0: usize,
        write: Write,
    },
}

#[allow(clippy::too_many_arguments)]
fn backward_in_parts(
    dx: &mut [f32],
    dw: &mut [f32],
    writes: [Write; 2],
    dout: &[f32],
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    parts: usize,
) {
    assert!(dx.len() == m * k && dw.len() == n * k && dout.len() == m * n);
    assert!(x.len() == m * k && w.len() == n * k);
    if m * n * k == 0 {
        // An empty sum (no rows of dout, or N = 0) or an empty output.
        for (out, write) in [(dx, writes[0]), (dw, writes[1])] {
            if write == Write::Set {
                out.fill(0.0);
            }
        }
        return;
    }
    // The two GEMMs cost the same; each gets half the threads (one each
    // on two cores), and splits its output rows among them.
    let dx_parts = parts.div_ceil(2);
    let dw_parts = (parts - dx_parts).max(1);
    let dx_rows = rows_per_part(m, dx_parts);
    let dw_rows = rows_per_part(n, dw_parts);
    let mut jobs: Vec<BackwardPart> = dx
        .chunks_mut(dx_rows * k)
        .enumerate()
        .map(|(i, dx)| BackwardPart::Dx {
            dx,
            row0: i * dx_rows,
            write: writes[0],
        })
        .chain(
            dw.chunks_mut(dw_rows * k)
                .enumerate()
                .map(|(i, dw)| BackwardPart::Dw {
                    dw,
                    row0: i * dw_rows,
                    write: writes[1],
                }),
        )
        .collect();
    if parts <= 1 {
        for part in jobs.drain(..) {
            backward_part(part, dout, x, w, m, k, n);
        }
        return;
    }
    run_all(
        jobs.into_iter()
            .map(|part| move || backward_part(part, dout, x, w, m, k, n))
            .collect(),
    );
}

fn backward_part(
    part: BackwardPart,
    dout: &[f32],
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
) {
    match part {
        BackwardPart::Dx { dx, row0, write } => {
            let rows = dx.len() / k;
            assert!(row0 + rows <= m);
            let dout = &dout[row0 * n..(row0 + rows) * n];
            // SAFETY: `dx` holds rows × K elements and `dout` rows × N (the
            // slices above); `w` holds N × K (asserted by the caller). The
            // output does not alias the inputs.
            unsafe {
                matrixmultiply::sgemm(
                    rows,
                    n,
                    k,
                    1.0,
                    dout.as_ptr(),
                    n as isize,
                    1,
                    w.as_ptr(),
                    k as isize,
                    1,
                    write.beta(),
                    dx.as_mut_ptr(),
                    k as isize,
                    1,
                );
            }
        }
        BackwardPart::Dw { dw, row0, write } => {
            let rows = dw.len() / k;
            assert!(row0 + rows <= n);
            // Column j of dout (M, N) is row j of doutᵀ: it starts at
            // element j, with stride N between its M elements.
            let cols = &dout[row0..];
            // SAFETY: the last element read is (M − 1)·N + row0 + rows − 1
            // < M·N = dout.len(), i.e. within `cols` shifted by row0; `x`
            // holds M × K and `dw` rows × K elements. The output does not
            // alias the inputs.
            unsafe {
                matrixmultiply::sgemm(
                    rows,
                    m,
                    k,
                    1.0,
                    cols.as_ptr(),
                    1,
                    n as isize,
                    x.as_ptr(),
                    k as isize,
                    1,
                    write.beta(),
                    dw.as_mut_ptr(),
                    k as isize,
                    1,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fill_uniform;

    const ADD: [Write; 2] = [Write::Add; 2];

    fn filled(len: usize, seed: u64) -> Vec<f32> {
        let mut v = vec![0.0; len];
        fill_uniform(&mut v, seed, 0, 1.0);
        v
    }

    /// Splitting the output rows over threads changes no bit, for shapes
    /// with ragged last parts; and the result is the plain product.
    #[test]
    fn split_gemms_equal_the_unsplit_ones_bit_for_bit() {
        for (m, k, n) in [
            (37, 19, 53),
            (256, 64, 96),
            (9, 130, 7),
            (1, 5, 3),
            (4, 0, 3),
        ] {
            let x = filled(m * k, 1);
            let w = filled(n * k, 2);
            let dout = filled(m * n, 3);
            let mut whole = vec![0.0; m * n];
            forward_in_parts(&mut whole, &x, &w, m, k, n, 1);
            let mut plain = vec![0.0; m * n];
            crate::math::linear_forward(&mut plain, &x, &w, m, k, n);
            for (a, b) in whole.iter().zip(&plain) {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
            }
            let (dx0, dw0) = (filled(m * k, 4), filled(n * k, 5));
            let (mut dx_whole, mut dw_whole) = (dx0.clone(), dw0.clone());
            backward_in_parts(&mut dx_whole, &mut dw_whole, ADD, &dout, &x, &w, m, k, n, 1);
            for parts in [2, 3, 4] {
                let mut split = vec![0.0; m * n];
                forward_in_parts(&mut split, &x, &w, m, k, n, parts);
                assert_eq!(split, whole, "forward {m}×{k}×{n} in {parts}");
                let (mut dx, mut dw) = (dx0.clone(), dw0.clone());
                backward_in_parts(&mut dx, &mut dw, ADD, &dout, &x, &w, m, k, n, parts);
                assert_eq!(dx, dx_whole, "dx {m}×{k}×{n} in {parts}");
                assert_eq!(dw, dw_whole, "dw {m}×{k}×{n} in {parts}");
            }
            let (mut dx_plain, mut dw_plain) = (dx0.clone(), dw0.clone());
            crate::math::linear_backward(&mut dx_plain, &mut dw_plain, &dout, &x, &w, m, k, n);
            for (a, b) in dx_whole
                .iter()
                .chain(&dw_whole)
                .zip(dx_plain.iter().chain(&dw_plain))
            {
                assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
    }

    /// `Write::Set` never reads its output (NaN there does not leak) and
    /// gives the bits `Write::Add` gives on a zeroed output, split or not;
    /// an empty sum sets zeros.
    #[test]
    fn set_writes_equal_adds_onto_zeros() {
        for (m, k, n) in [(37, 19, 53), (256, 64, 96), (0, 5, 3), (4, 6, 0)] {
            let (x, w, dout) = (filled(m * k, 1), filled(n * k, 2), filled(m * n, 3));
            let (mut dx_add, mut dw_add) = (vec![0.0; m * k], vec![0.0; n * k]);
            backward_in_parts(&mut dx_add, &mut dw_add, ADD, &dout, &x, &w, m, k, n, 1);
            for parts in [1, 2, 3] {
                let (mut dx, mut dw) = (vec![f32::NAN; m * k], vec![f32::NAN; n * k]);
                let set = [Write::Set; 2];
                backward_in_parts(&mut dx, &mut dw, set, &dout, &x, &w, m, k, n, parts);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&dx), bits(&dx_add), "dx {m}×{k}×{n} in {parts}");
                assert_eq!(bits(&dw), bits(&dw_add), "dw {m}×{k}×{n} in {parts}");
            }
            // Mixed: dx added to, dw set.
            let (mut dx, mut dw) = (vec![1.0; m * k], vec![f32::NAN; n * k]);
            let mixed = [Write::Add, Write::Set];
            backward_in_parts(&mut dx, &mut dw, mixed, &dout, &x, &w, m, k, n, 2);
            assert_eq!(dw, dw_add);
            for (a, b) in dx.iter().zip(&dx_add) {
                assert_eq!(*a, 1.0 + b);
            }
        }
    }

    #[test]
    fn small_gemms_stay_on_the_calling_thread() {
        assert_eq!(threads_for(64 * 64 * 64, 8), 1);
        assert_eq!(threads_for(256 * 512 * 1024, 2), 2);
        assert_eq!(threads_for(256 * 512 * 1024, 64), MAX_GEMM_THREADS);
        assert_eq!(threads_for(256 * 512 * 1024, 1), 1);
    }
}
