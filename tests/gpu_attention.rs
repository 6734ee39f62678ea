//! The attention core on the GPU with bf16 GEMMs (`DenseGemm::Bf16`, the
//! default) against the cpu's plain attention. The f32 GEMMs are held to
//! the cpu at 1e-5 by `tests/backend.rs`' kernel checks; here the same
//! attention rounds what enters its products to bf16. Cases skip without
//! a CUDA device (fail under `STRATA_REQUIRE_CUDA=1`), and contain only
//! that skip without `--features cuda`.
//!
//! The bound, element by element. The reference is the cpu's attention
//! fed q, k, v and d out rounded to bf16, as the GPU rounds them before
//! its products: its scores, softmax, d probabilities and d scores are
//! the GPU's sums in another order, which the f32 check holds to 1e-5.
//! The GPU also rounds a block's probabilities before `P·v` and `Pᵀ·d out`
//! and its d scores before `dS·k` and `dSᵀ·q`, one operand of each product,
//! each by at most u = 2⁻⁸ relative: an output moves by at most
//! u·Σ|p||b|, b the product's other (rounded) operand. So each element is
//! within u·Σ|p||b| + 1e-5 of the reference, Σ|p||b| computed from the
//! cpu's probabilities and d scores. The bound is tight where a row sees
//! few keys of one sign (its first rows): 0.6–0.9 of it measured. Rounding q, k, v and d out moves the
//! results from the unrounded attention's by about 2⁻⁹ relative, which
//! the bf16 GPU's results must show (the GEMMs read bf16).

mod common;

#[cfg(feature = "cuda")]
mod bf16 {
    use strata::backend::cuda::{attention_stats_len, CudaBackend};
    use strata::backend::DenseGemm;
    use strata::math::attention::{attention_backward, attention_forward, AttnShape};

    const U: f64 = 1.0 / 256.0;

    fn f32s(n: usize, seed: u64) -> Vec<f32> {
        super::common::values(n, seed, 1.0)
            .into_iter()
            .map(|v| v as f32)
            .collect()
    }

    fn rounded(x: &[f32]) -> Vec<f32> {
        x.iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect()
    }

    /// The largest |got − want| over its bound `u·mag + 1e-5`.
    fn worst_of_bound(got: &[f32], want: &[f32], mag: &[f64]) -> f64 {
        assert_eq!(got.len(), want.len());
        assert_eq!(got.len(), mag.len());
        got.iter()
            .zip(want)
            .zip(mag)
            .map(|((&g, &w), &m)| (g as f64 - w as f64).abs() / (U * m + 1e-5))
            .fold(0.0, f64::max)
    }

    /// Largest |a − b| over the largest |b|.
    fn normwise(a: &[f32], b: &[f32]) -> f64 {
        let scale = b.iter().fold(0.0f64, |m, &x| m.max(x.abs() as f64));
        let diff = a
            .iter()
            .zip(b)
            .fold(0.0f64, |m, (&x, &y)| m.max((x as f64 - y as f64).abs()));
        diff / scale
    }

    /// The inputs, rounded to bf16 as the GPU reads them.
    struct Inputs {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        dout: Vec<f32>,
    }

    /// Σ|p||b| for each element of the output, dq, dk and dv, from the
    /// cpu's probabilities `p` and the d scores they give (each with the
    /// softmax's 1/√hd), over the rounded inputs.
    fn magnitudes(x: &Inputs, p: &[f32], shape: &AttnShape) -> [Vec<f64>; 4] {
        let (s, hd, h) = (shape.seq_len, shape.head_dim, shape.heads);
        let (qw, kw) = (shape.q_width(), shape.kv_width());
        let group = h / shape.kv_heads;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut out = vec![0.0; x.q.len()];
        let (mut dq, mut dk, mut dv) = (out.clone(), vec![0.0; x.k.len()], vec![0.0; x.v.len()]);
        let at = |rows: &[f32], t: usize, width: usize, head: usize| -> Vec<f64> {
            rows[t * width + head * hd..][..hd]
                .iter()
                .map(|&v| v as f64)
                .collect()
        };
        for b in 0..shape.seqs {
            for head in 0..h {
                let kv = head / group;
                for i in 0..s {
                    let ti = b * s + i;
                    let row = &p[((b * h + head) * s + i) * s..][..s];
                    let d_out = at(&x.dout, ti, qw, head);
                    let dp: Vec<f64> = (0..s)
                        .map(|j| {
                            let vj = at(&x.v, b * s + j, kw, kv);
                            d_out.iter().zip(&vj).map(|(a, b)| a * b).sum()
                        })
                        .collect();
                    let weighted: f64 = row.iter().zip(&dp).map(|(&p, d)| p as f64 * d).sum();
                    let qi = at(&x.q, ti, qw, head);
                    for j in 0..s {
                        let pj = row[j] as f64;
                        let ds = (pj * (dp[j] - weighted) * scale).abs();
                        let tj = b * s + j;
                        let (kj, vj) = (at(&x.k, tj, kw, kv), at(&x.v, tj, kw, kv));
                        for c in 0..hd {
                            out[ti * qw + head * hd + c] += pj * vj[c].abs();
                            dv[tj * kw + kv * hd + c] += pj * d_out[c].abs();
                            dq[ti * qw + head * hd + c] += ds * kj[c].abs();
                            dk[tj * kw + kv * hd + c] += ds * qi[c].abs();
                        }
                    }
                }
            }
        }
        [out, dq, dk, dv]
    }

    fn gpu(gemm: DenseGemm) -> Option<CudaBackend> {
        match CudaBackend::new(0, gemm) {
            Ok(g) => Some(g),
            Err(e) => {
                super::common::cuda_case_skipped(e);
                None
            }
        }
    }

    /// Two sequences, the second packing two documents; blocks of 5 query
    /// rows (the last one short), so the block copies are reused.
    #[test]
    fn attention_with_bf16_gemms_is_the_cpu_s_within_the_rounding_of_its_operands() {
        let Some(gpu16) = gpu(DenseGemm::Bf16) else {
            return;
        };
        let gpu32 = gpu(DenseGemm::F32).unwrap();
        for head_dim in [8, 16] {
            let shape = AttnShape {
                seqs: 2,
                seq_len: 13,
                heads: 4,
                kv_heads: 2,
                head_dim,
            };
            let t = shape.tokens();
            let block = 5 * shape.seqs * shape.heads * shape.seq_len * 4;
            let starts: Vec<u32> = (0..t).map(|i| if i >= 13 + 5 { 5 } else { 0 }).collect();
            let (q, k, v) = (
                f32s(t * shape.q_width(), 40),
                f32s(t * shape.kv_width(), 41),
                f32s(t * shape.kv_width(), 42),
            );
            let dout = f32s(t * shape.q_width(), 43);
            let x = Inputs {
                q: rounded(&q),
                k: rounded(&k),
                v: rounded(&v),
                dout: rounded(&dout),
            };

            let mut out = vec![0.0; q.len()];
            let mut probs = vec![0.0; shape.probs_len()];
            attention_forward(
                &mut out,
                &mut probs,
                &x.q,
                &x.k,
                &x.v,
                Some(&starts),
                &shape,
            );
            let (mut dq, mut dk, mut dv) =
                (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
            attention_backward(
                &mut dq, &mut dk, &mut dv, &x.dout, &probs, &x.q, &x.k, &x.v, &shape,
            );

            let run = |gpu: &CudaBackend| {
                let mut got = vec![0.0; q.len()];
                let mut stats = vec![0.0; attention_stats_len(&shape)];
                gpu.attention_forward_blocks(
                    &mut got,
                    &mut stats,
                    [&q, &k, &v],
                    Some(&starts),
                    &shape,
                    block,
                )
                .unwrap();
                let (mut gq, mut gk, mut gv) =
                    (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
                let inputs = [&dout[..], &stats, &q, &k, &v];
                gpu.attention_backward_blocks(
                    [&mut gq, &mut gk, &mut gv],
                    inputs,
                    Some(&starts),
                    &shape,
                    block,
                )
                .unwrap();
                [got, gq, gk, gv]
            };
            let got = run(&gpu16);
            let unrounded = run(&gpu32);
            let mags = magnitudes(&x, &probs, &shape);
            let names = ["out", "dq", "dk", "dv"];
            for (((name, g), want), (mag, f32_gpu)) in names
                .iter()
                .zip(&got)
                .zip([&out, &dq, &dk, &dv])
                .zip(mags.iter().zip(&unrounded))
            {
                let worst = worst_of_bound(g, want, mag);
                let moved = normwise(g, f32_gpu);
                eprintln!(
                    "bf16 attention, hd {head_dim}, {name}: worst error {worst:.2} of its bound, \
                     {moved:.1e} norm-wise from the f32 GEMMs"
                );
                assert!(worst <= 1.0, "hd {head_dim} {name}: {worst} of the bound");
                assert!(
                    moved > 1e-4,
                    "hd {head_dim} {name}: the GEMMs read f32 ({moved:.1e})"
                );
            }
        }
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn attention_with_bf16_gemms_is_the_cpu_s_within_the_rounding_of_its_operands() {
    common::cuda_case_skipped("built without --features cuda");
}
