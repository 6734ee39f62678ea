//! The passes shared over the cores give the same bits as the one-thread
//! loops they replaced (kept here as the oracle), at shapes large enough
//! to be split on a machine of two cores or more.

use super::*;
use crate::parallel::{compute_threads, rows_per_job};

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0f32; n];
    crate::model::fill_uniform(&mut v, seed, 3, 1.0);
    v
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Whether `rows` rows of `work` elements are cut into several jobs here.
fn splits(rows: usize, work: usize) -> bool {
    rows_per_job(rows, work) < rows
}

#[test]
fn linear_passes_match_one_thread_loops_bit_for_bit() {
    let (m, k) = (700, 512);
    for n in [8, 13, 3] {
        assert!(
            compute_threads() < 2 || splits(m, k * n),
            "m {m} k {k} n {n} is not split"
        );
        let (x, w, dout) = (values(m * k, 1), values(n * k, 2), values(m * n, 3));
        let mut out = vec![0.0f32; m * n];
        linear_forward(&mut out, &x, &w, m, k, n);
        let mut want = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f32;
                for p in 0..k {
                    acc += x[i * k + p] * w[j * k + p];
                }
                want[i * n + j] = acc;
            }
        }
        assert_eq!(bits(&out), bits(&want), "forward, n {n}");

        let (mut dx, mut dw) = (values(m * k, 4), values(n * k, 5));
        let (mut want_dx, mut want_dw) = (dx.clone(), dw.clone());
        linear_backward(&mut dx, &mut dw, &dout, &x, &w, m, k, n);
        for i in 0..m {
            for j in 0..n {
                let g = dout[i * n + j];
                for p in 0..k {
                    want_dx[i * k + p] += g * w[j * k + p];
                    want_dw[j * k + p] += g * x[i * k + p];
                }
            }
        }
        assert_eq!(bits(&dx), bits(&want_dx), "backward dx, n {n}");
        assert_eq!(bits(&dw), bits(&want_dw), "backward dw, n {n}");
    }
}

#[test]
fn rmsnorm_matches_one_thread_loops_bit_for_bit() {
    let (t, d) = (900, 512);
    assert!(compute_threads() < 2 || (splits(t, d) && splits(d, t)));
    let (x, g, dout) = (values(t * d, 6), values(d, 7), values(t * d, 8));
    let (mut out, mut inv) = (vec![0.0f32; t * d], vec![0.0f32; t]);
    rmsnorm_forward(&mut out, &mut inv, &x, &g, t, d, 1e-5);
    let (mut want_out, mut want_inv) = (vec![0.0f32; t * d], vec![0.0f32; t]);
    for i in 0..t {
        let row = &x[i * d..(i + 1) * d];
        let mut ss = 0.0f32;
        for &v in row {
            ss += v * v;
        }
        let iv = 1.0 / (ss / d as f32 + 1e-5f64 as f32).sqrt();
        want_inv[i] = iv;
        for j in 0..d {
            want_out[i * d + j] = row[j] * iv * g[j];
        }
    }
    assert_eq!(bits(&out), bits(&want_out));
    assert_eq!(bits(&inv), bits(&want_inv));

    let (mut dx, mut dg) = (values(t * d, 9), values(d, 10));
    let (mut want_dx, mut want_dg) = (dx.clone(), dg.clone());
    rmsnorm_backward(&mut dx, &mut dg, &dout, &x, &g, &inv, t, d);
    for i in 0..t {
        let row = &x[i * d..(i + 1) * d];
        let dy = &dout[i * d..(i + 1) * d];
        let iv = inv[i];
        let mut dot = 0.0f32;
        for j in 0..d {
            dot += dy[j] * g[j] * row[j];
            want_dg[j] += dy[j] * row[j] * iv;
        }
        let coef = dot * iv * iv * iv / d as f32;
        for j in 0..d {
            want_dx[i * d + j] += dy[j] * g[j] * iv - row[j] * coef;
        }
    }
    assert_eq!(bits(&dx), bits(&want_dx));
    assert_eq!(bits(&dg), bits(&want_dg));
}

#[test]
fn permutation_passes_match_one_thread_loops_bit_for_bit() {
    let (t, k, d, experts) = (1600, 2, 512, 4);
    assert!(compute_threads() < 2 || splits(t, k * d));
    let choice: Vec<u32> = (0..t * k).map(|a| (a % experts) as u32).collect();
    let perm = Permutation::from_routing(&choice, experts);
    let (per, weights, dy) = (values(t * k * d, 11), values(t * k, 12), values(t * d, 13));
    // `per` is in assignment order; the passes read it in expert order.
    let by_expert: Vec<f32> = perm
        .order
        .iter()
        .flat_map(|&a| &per[a as usize * d..(a as usize + 1) * d])
        .copied()
        .collect();

    let mut y = vec![0.0f32; t * d];
    combine_forward(&mut y, &by_expert, &perm.position, &weights, t, k, d);
    let mut want_y = vec![0.0f32; t * d];
    for i in 0..t {
        for j in 0..d {
            let mut acc = 0.0f32;
            for s in 0..k {
                acc += weights[i * k + s] * per[(i * k + s) * d + j];
            }
            want_y[i * d + j] = acc;
        }
    }
    assert_eq!(bits(&y), bits(&want_y));

    let mut dweights = vec![0.0f32; t * k];
    combine_backward_weights(&mut dweights, &dy, &by_expert, &perm.position, t, k, d);
    // The assignments' output gradients, gathered expert by expert and put
    // back in assignment order.
    let grads = AssignmentGrads {
        dy: &dy,
        weights: &weights,
        k,
        d,
    };
    let mut dper = vec![0.0f32; t * k * d];
    for e in 0..experts {
        let rows = perm.rows(e);
        let mut dye = vec![0.0f32; rows.len() * d];
        grads.gather(&mut dye, rows);
        scatter_to_assignments(&mut dper, &dye, rows, d);
    }
    let (mut want_dper, mut want_dw) = (vec![0.0f32; t * k * d], vec![0.0f32; t * k]);
    for i in 0..t {
        for s in 0..k {
            let a = i * k + s;
            let mut dot = 0.0f32;
            for j in 0..d {
                want_dper[a * d + j] = weights[a] * dy[i * d + j];
                dot += dy[i * d + j] * per[a * d + j];
            }
            want_dw[a] = dot;
        }
    }
    assert_eq!(bits(&dper), bits(&want_dper));
    assert_eq!(bits(&dweights), bits(&want_dw));

    let mut dx = values(t * d, 14);
    let mut want_dx = dx.clone();
    gather_backward(&mut dx, &by_expert, &perm.position, t, k, d);
    for i in 0..t {
        for s in 0..k {
            for j in 0..d {
                want_dx[i * d + j] += per[(i * k + s) * d + j];
            }
        }
    }
    assert_eq!(bits(&dx), bits(&want_dx));

    // Each expert's rows out of token order and back: every assignment
    // lands where it came from, whether its rows are cut or not.
    let x = values(t * d, 15);
    let mut back = vec![0.0f32; t * k * d];
    for e in 0..experts {
        let rows = perm.rows(e);
        assert!(compute_threads() < 2 || splits(rows.len(), d), "expert {e}");
        let mut xe = vec![0.0f32; rows.len() * d];
        gather_forward(&mut xe, &x, rows, k, d);
        for (r, &a) in rows.iter().enumerate() {
            let tok = a as usize / k;
            assert_eq!(xe[r * d..(r + 1) * d], x[tok * d..(tok + 1) * d]);
        }
        let pe: Vec<f32> = rows
            .iter()
            .flat_map(|&a| &per[a as usize * d..(a as usize + 1) * d])
            .copied()
            .collect();
        scatter_to_assignments(&mut back, &pe, rows, d);
    }
    assert_eq!(bits(&back), bits(&per));
    // Rows that do not ascend take the one-thread path, with the same result.
    let rows: Vec<u32> = (0..(t * k) as u32).rev().collect();
    let mut reversed = vec![0.0f32; t * k * d];
    scatter_to_assignments(&mut reversed, &per, &rows, d);
    for (r, &a) in rows.iter().enumerate() {
        let a = a as usize;
        assert_eq!(reversed[a * d..(a + 1) * d], per[r * d..(r + 1) * d]);
    }
    // So do rows that repeat (ascending, not strictly, in pairs that a
    // cut into blocks at an even row would part): each assignment ends
    // with its last row.
    let n = t * k;
    let rows: Vec<u32> = (0..n)
        .map(|r| (r.div_ceil(2) * 2).min(n - 1) as u32)
        .collect();
    assert!(compute_threads() < 2 || splits(rows.len(), d));
    let mut repeated = vec![0.0f32; n * d];
    scatter_to_assignments(&mut repeated, &per, &rows, d);
    for (r, &a) in rows.iter().enumerate() {
        let a = a as usize;
        if rows.get(r + 1) != Some(&rows[r]) {
            assert_eq!(
                repeated[a * d..(a + 1) * d],
                per[r * d..(r + 1) * d],
                "row {r}"
            );
        }
    }
}
