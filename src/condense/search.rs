//! The grouping of one expert's rows (see the module above): each row, in
//! order, joins the most similar representative at or above the threshold
//! among its candidates, or becomes a representative itself.

use std::collections::HashMap;

use crate::math::attention::dot;

/// Random hyperplanes for SimHash signatures of D-wide rows: `tables`
/// signatures of `bits` bits a row, bit j of table i set where the row's
/// dot product with plane (i, j) is not negative. Two rows at angle θ
/// agree on a bit with probability 1 − θ/π, so rows that are close share
/// some table's signature with high probability. The planes are drawn
/// from a fixed seed: the same on every device and every run.
#[derive(Clone, Debug)]
pub struct SignatureTables {
    pub tables: usize,
    pub bits: usize,
    d: usize,
    /// (tables · bits, D) row-major.
    planes: Vec<f32>,
}

impl SignatureTables {
    pub fn new(tables: usize, bits: usize, d: usize) -> Self {
        assert!(tables >= 1 && (1..=32).contains(&bits));
        let mut s: u64 = 0x0005_eedc_0de1_u64 ^ ((d as u64) << 32);
        let mut uniform = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        // Gaussian components (Box–Muller), so the planes' directions are
        // uniform on the sphere.
        let planes = (0..tables * bits * d)
            .map(|_| {
                let (u, v) = (uniform(), uniform());
                ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
            })
            .collect();
        Self {
            tables,
            bits,
            d,
            planes,
        }
    }

    /// Each of `t` rows of `x` (T, D): its `tables` signatures, row after
    /// row.
    pub fn sign(&self, x: &[f32], t: usize) -> Vec<u32> {
        let d = self.d;
        assert_eq!(x.len(), t * d, "rows of {d} values");
        let mut out = vec![0u32; t * self.tables];
        crate::parallel::for_row_blocks(&mut out, self.tables, self.tables * self.bits * d, {
            |first, block: &mut [u32]| {
                for (r, sigs) in block.chunks_mut(self.tables).enumerate() {
                    let row = &x[(first + r) * d..(first + r + 1) * d];
                    for (i, sig) in sigs.iter_mut().enumerate() {
                        *sig = (0..self.bits).fold(0u32, |acc, j| {
                            let plane = &self.planes[(i * self.bits + j) * d..][..d];
                            acc | (u32::from(dot(plane, row) >= 0.0) << j)
                        });
                    }
                }
            }
        });
        out
    }
}

/// The groups of one expert's rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowGroups {
    /// For each row (its index among the expert's rows), the index of its
    /// group's representative: itself for a representative, always an
    /// earlier row for a member.
    pub rep_of: Vec<u32>,
    /// How many rows are members (condensed into another).
    pub condensed: usize,
}

/// Groups the rows `tokens` (indices into `x`, (T, D)) of one expert:
/// a row joins the representative before it whose cosine similarity with
/// it is the highest at or above `threshold` (the first of equals), among
/// every representative (`signatures` `None`) or those that share one of
/// its signatures (`signatures`: [`SignatureTables::sign`]'s, T × tables);
/// else, or once `max_share` of the rows are condensed, it is a
/// representative. `inv_norm[t]`: 1 / ‖x_t‖ (0 for a zero row, which then
/// joins nothing).
pub fn condense_rows(
    tokens: &[u32],
    x: &[f32],
    d: usize,
    inv_norm: &[f32],
    signatures: Option<(&[u32], usize)>,
    threshold: f32,
    max_share: f32,
) -> RowGroups {
    let n = tokens.len();
    let cap = (max_share as f64 * n as f64).floor() as usize;
    let row = |r: usize| {
        let t = tokens[r] as usize;
        (&x[t * d..(t + 1) * d], inv_norm[t])
    };
    let mut rep_of = vec![0u32; n];
    let mut reps: Vec<u32> = Vec::new();
    let mut buckets: HashMap<(u32, u32), Vec<u32>> = HashMap::new();
    // seen[i] == r + 1: representative i is already a candidate of row r.
    let mut seen: Vec<u32> = Vec::new();
    let mut candidates: Vec<u32> = Vec::new();
    let mut condensed = 0usize;
    for r in 0..n {
        let (xr, ir) = row(r);
        let sig = signatures.map(|(s, tables)| {
            let t = tokens[r] as usize;
            &s[t * tables..(t + 1) * tables]
        });
        if condensed < cap && ir > 0.0 {
            candidates.clear();
            match sig {
                None => candidates.extend(0..reps.len() as u32),
                Some(sig) => {
                    for (table, &s) in sig.iter().enumerate() {
                        for &i in buckets.get(&(table as u32, s)).into_iter().flatten() {
                            if seen[i as usize] != r as u32 + 1 {
                                seen[i as usize] = r as u32 + 1;
                                candidates.push(i);
                            }
                        }
                    }
                    candidates.sort_unstable();
                }
            }
            let mut best: Option<(f32, u32)> = None;
            for &i in &candidates {
                let (xs, is) = row(reps[i as usize] as usize);
                let cos = dot(xr, xs) * ir * is;
                if cos >= threshold && best.is_none_or(|(b, _)| cos > b) {
                    best = Some((cos, reps[i as usize]));
                }
            }
            if let Some((_, rep)) = best {
                rep_of[r] = rep;
                condensed += 1;
                continue;
            }
        }
        rep_of[r] = r as u32;
        if let Some(sig) = sig {
            let i = reps.len() as u32;
            for (table, &s) in sig.iter().enumerate() {
                buckets.entry((table as u32, s)).or_default().push(i);
            }
            seen.push(0);
        }
        reps.push(r as u32);
    }
    RowGroups { rep_of, condensed }
}

/// 1 / ‖row‖ of each of `t` rows of `x` (T, D); 0 for a zero row.
pub fn inverse_norms(x: &[f32], t: usize, d: usize) -> Vec<f32> {
    (0..t)
        .map(|i| {
            let row = &x[i * d..(i + 1) * d];
            let n = dot(row, row).sqrt();
            if n > 0.0 && n.is_finite() {
                1.0 / n
            } else {
                0.0
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows in `clusters` tight clusters around random centres (each row a
    /// centre plus noise of `noise` relative size), interleaved.
    fn clustered(t: usize, d: usize, clusters: usize, noise: f32, seed: u64) -> Vec<f32> {
        let mut s = seed.max(1);
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let centres: Vec<f32> = (0..clusters * d).map(|_| next()).collect();
        (0..t)
            .flat_map(|i| {
                let c = &centres[(i % clusters) * d..][..d];
                c.iter().map(|&v| v + noise * next()).collect::<Vec<_>>()
            })
            .collect()
    }

    fn cos(x: &[f32], d: usize, a: usize, b: usize) -> f32 {
        let (u, v) = (&x[a * d..][..d], &x[b * d..][..d]);
        dot(u, v) / (dot(u, u).sqrt() * dot(v, v).sqrt())
    }

    #[test]
    fn every_member_is_within_the_threshold_of_its_representative() {
        let (t, d) = (200, 48);
        let x = clustered(t, d, 7, 0.3, 5);
        let inv = inverse_norms(&x, t, d);
        let tokens: Vec<u32> = (0..t as u32).collect();
        let tables = SignatureTables::new(8, 6, d);
        let sigs = tables.sign(&x, t);
        for threshold in [0.5f32, 0.75, 0.9, 0.99] {
            for search in [None, Some((&sigs[..], 8))] {
                let g = condense_rows(&tokens, &x, d, &inv, search, threshold, 1.0);
                let mut members = 0;
                for (r, &rep) in g.rep_of.iter().enumerate() {
                    let rep = rep as usize;
                    assert!(rep <= r);
                    assert_eq!(g.rep_of[rep] as usize, rep, "a representative is its own");
                    if rep != r {
                        members += 1;
                        assert!(cos(&x, d, r, rep) >= threshold - 1e-5);
                    }
                }
                assert_eq!(members, g.condensed);
            }
        }
    }

    #[test]
    fn each_row_s_signatures_are_its_own_whatever_the_rows_beside_it() {
        let (t, d) = (300, 40);
        let x = clustered(t, d, 5, 0.5, 13);
        let tables = SignatureTables::new(8, 6, d);
        let all = tables.sign(&x, t);
        for i in (0..t).step_by(7) {
            let alone = tables.sign(&x[i * d..(i + 1) * d], 1);
            assert_eq!(&all[i * 8..(i + 1) * 8], &alone[..], "row {i}");
        }
        // Opposite rows differ in every bit of every table.
        let neg: Vec<f32> = x[..d].iter().map(|v| -v).collect();
        let (a, b) = (tables.sign(&x[..d], 1), tables.sign(&neg, 1));
        assert!(a.iter().zip(&b).all(|(p, q)| p ^ q == 0x3f), "{a:?} {b:?}");
    }

    #[test]
    fn every_bit_of_the_signatures_comes_from_a_plane_of_its_own() {
        // Rows in every direction: two random planes' bits agree on about
        // half of them (1 − θ/π, θ their angle, near 90° in 256
        // dimensions), one plane used twice on all.
        let (t, d) = (2000, 256);
        let x = clustered(t, d, t, 1.0, 17);
        let (tables, bits) = (8, 6);
        let sigs = SignatureTables::new(tables, bits, d).sign(&x, t);
        let bit = |r: usize, k: usize| (sigs[r * tables + k / bits] >> (k % bits)) & 1;
        for a in 0..tables * bits {
            for b in a + 1..tables * bits {
                let agree = (0..t).filter(|&r| bit(r, a) == bit(r, b)).count();
                let share = agree as f64 / t as f64;
                assert!((0.35..0.65).contains(&share), "bits {a} and {b}: {share}");
            }
        }
    }

    #[test]
    fn the_exact_search_groups_each_tight_cluster_into_one() {
        let (t, d) = (140, 32);
        let x = clustered(t, d, 7, 0.02, 9);
        let inv = inverse_norms(&x, t, d);
        let tokens: Vec<u32> = (0..t as u32).collect();
        let g = condense_rows(&tokens, &x, d, &inv, None, 0.95, 1.0);
        assert_eq!(g.condensed, t - 7);
        for (r, &rep) in g.rep_of.iter().enumerate() {
            assert_eq!(rep as usize, r % 7, "row {r}");
        }
        // The signatures find most of them too.
        let tables = SignatureTables::new(8, 6, d);
        let sigs = tables.sign(&x, t);
        let lsh = condense_rows(&tokens, &x, d, &inv, Some((&sigs, 8)), 0.95, 1.0);
        assert!(lsh.condensed >= (t - 7) * 9 / 10, "{}", lsh.condensed);
    }

    #[test]
    fn the_cap_and_a_threshold_of_one_hold_back_what_they_should() {
        let (t, d) = (100, 16);
        let x = clustered(t, d, 4, 0.01, 3);
        let inv = inverse_norms(&x, t, d);
        let tokens: Vec<u32> = (0..t as u32).collect();
        let g = condense_rows(&tokens, &x, d, &inv, None, 0.9, 0.25);
        assert_eq!(g.condensed, 25);
        // Distinct rows at a threshold of 1 (only exact duplicates join).
        let g = condense_rows(&tokens, &x, d, &inv, None, 1.0, 1.0);
        assert_eq!(g.condensed, 0);
        // Exact duplicates (tokens listed twice, and a zero row) at 1.
        let mut dup = x.clone();
        dup[d..2 * d].copy_from_slice(&x[..d]);
        dup[2 * d..3 * d].fill(0.0);
        let inv = inverse_norms(&dup, t, d);
        let g = condense_rows(&tokens, &dup, d, &inv, None, 1.0, 1.0);
        assert_eq!((g.condensed, g.rep_of[1], g.rep_of[2]), (1, 0, 2));
    }

    #[test]
    fn a_row_joins_the_most_similar_representative() {
        // Unit rows at 0°, 30° and 20°: the first two are 0.866 apart, so
        // both represent at 0.9; the third is within 0.9 of both (0.940
        // and 0.985) and joins the second, the closer.
        let deg = |a: f32| [a.to_radians().cos(), a.to_radians().sin()];
        let x: Vec<f32> = [0.0, 30.0, 20.0].into_iter().flat_map(deg).collect();
        let inv = inverse_norms(&x, 3, 2);
        let g = condense_rows(&[0, 1, 2], &x, 2, &inv, None, 0.9, 1.0);
        assert_eq!(g.rep_of, vec![0, 1, 1]);
    }

    #[test]
    fn only_the_listed_tokens_are_grouped() {
        let (t, d) = (60, 16);
        let x = clustered(t, d, 3, 0.01, 11);
        let inv = inverse_norms(&x, t, d);
        // Every third token: one cluster's.
        let tokens: Vec<u32> = (0..t as u32).step_by(3).collect();
        let g = condense_rows(&tokens, &x, d, &inv, None, 0.9, 1.0);
        assert_eq!(g.condensed, tokens.len() - 1);
        assert!(g.rep_of.iter().all(|&r| r == 0));
    }
}
