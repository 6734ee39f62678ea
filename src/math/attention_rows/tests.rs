use super::*;
use crate::math::attention::{attention_backward, attention_forward};

fn filled(len: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Against the plain functions, bit for bit, keeping either the
/// probabilities or each row's max and sum: seven sequences of 64
/// tokens and one of 300 (enough work to be split over units, a
/// ragged last job), 4 query heads over 2 kv heads, with and without
/// documents packed in a sequence, gradients added to what they held,
/// on one thread and on several, in the loops compiled for each vector
/// set this CPU runs (each called by name).
#[test]
fn the_engine_s_attention_gives_the_plain_one_s_bits() {
    for (seqs, seq_len) in [(7, 64), (1, 300)] {
        let shape = AttnShape {
            seqs,
            seq_len,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
        };
        assert!(jobs(&shape, 3) > 1, "big enough to split");
        same_bits_as_the_plain_one(&shape);
    }
}

/// Head widths the blocked loops take apart: not a multiple of the eight
/// partial sums (12: a padded column block), of 16 (40: a block of 32
/// columns and a one-by-one tail; 24: a block of 16 and a tail, too few
/// columns for a block of 32), and 16 and 48 (whole blocks of 16 and 32);
/// a group of one query head and of three; sequences shorter than a block
/// of keys and not a multiple of it.
#[test]
fn every_head_width_gives_the_plain_one_s_bits() {
    for (head_dim, heads, kv_heads, seq_len) in [
        (12, 2, 2, 37),
        (40, 3, 1, 21),
        (16, 4, 2, 9),
        (48, 2, 1, 50),
        (24, 2, 2, 19),
    ] {
        let shape = AttnShape {
            seqs: 2,
            seq_len,
            heads,
            kv_heads,
            head_dim,
        };
        same_bits_as_the_plain_one(&shape);
    }
}

fn same_bits_as_the_plain_one(shape: &AttnShape) {
    let (t, qw, kw) = (shape.tokens(), shape.q_width(), shape.kv_width());
    let (q, k, v) = (filled(t * qw, 1), filled(t * kw, 2), filled(t * kw, 3));
    let dout = filled(t * qw, 4);
    let grads = || (filled(t * qw, 5), filled(t * kw, 6), filled(t * kw, 7));
    // Documents packed, of 13, 20 or 27 tokens by sequence, so that each
    // sequence's starts are its own.
    let s = shape.seq_len;
    let starts: Vec<u32> = (0..t)
        .map(|i| {
            let doc = 13 + 7 * (i / s % 3);
            ((i % s) / doc * doc) as u32
        })
        .collect();
    let kept_threads = [1, 2, 3, 8]
        .map(|n| (Kept::RowStats, n))
        .into_iter()
        .chain([(Kept::Probabilities, 1), (Kept::Probabilities, 3)]);
    for starts in [None, Some(&starts[..])] {
        let mut want = vec![0.0f32; t * qw];
        let mut probs = vec![0.0f32; shape.probs_len()];
        attention_forward(&mut want, &mut probs, &q, &k, &v, starts, shape);
        let (mut wq, mut wk, mut wv) = grads();
        attention_backward(&mut wq, &mut wk, &mut wv, &dout, &probs, &q, &k, &v, shape);
        let isas = VectorIsa::supported_here().into_iter();
        for (isa, (kept, threads)) in
            isas.flat_map(|isa| kept_threads.clone().map(move |k| (isa, k)))
        {
            let what = format!("{}×{s}, {kept:?}, {threads} threads, {isa:?}", shape.seqs);
            let mut out = vec![7.0f32; t * qw];
            let mut saved = vec![3.0f32; kept.len(shape)];
            let qkv = (&q[..], &k[..], &v[..]);
            let forward = attention_rows_forward_on::<f32>;
            forward(isa, &mut out, &mut saved, kept, qkv, starts, shape, threads);
            assert_eq!(bits(&out), bits(&want), "out, {what}");
            if kept == Kept::Probabilities {
                assert_eq!(bits(&saved), bits(&probs), "probabilities, {what}");
            }
            let (mut gq, mut gk, mut gv) = grads();
            let grads = [&mut gq[..], &mut gk[..], &mut gv[..]];
            let backward = attention_rows_backward_on::<f32>;
            backward(isa, grads, &dout, &saved, kept, qkv, starts, shape, threads);
            assert_eq!(bits(&gq), bits(&wq), "dq, {what}");
            assert_eq!(bits(&gk), bits(&wk), "dk, {what}");
            assert_eq!(bits(&gv), bits(&wv), "dv, {what}");
        }
    }
}

/// The probabilities are kept up to the bound, each row's max and sum
/// past it.
#[test]
fn long_sequences_keep_two_values_a_row() {
    let shape = |seq_len| AttnShape {
        seqs: 1,
        seq_len,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
    };
    // 4 heads × S² × 4 bytes = 16 MiB at S = 1024.
    assert_eq!(Kept::at(&shape(1024)), Kept::Probabilities);
    assert_eq!(saved_len(&shape(1024)), 4 * 1024 * 1024);
    assert_eq!(Kept::at(&shape(1025)), Kept::RowStats);
    assert_eq!(saved_len(&shape(2048)), 2 * 4 * 2048);
}

/// A value that is not finite reaches only the rows that attend to its
/// token, as in the plain forward: the rows before it (and, with
/// documents, those of other documents) keep their bits.
#[test]
fn a_value_that_is_not_finite_reaches_only_the_rows_that_attend_to_it() {
    let shape = AttnShape {
        seqs: 2,
        seq_len: 40,
        heads: 2,
        kv_heads: 1,
        head_dim: 16,
    };
    let (t, qw, kw) = (shape.tokens(), shape.q_width(), shape.kv_width());
    let (q, k) = (filled(t * qw, 1), filled(t * kw, 2));
    let mut v = filled(t * kw, 3);
    // Token 21 of the first sequence: inside a block of query rows, after
    // some of its rows and in the second of two documents.
    v[21 * kw + 5] = f32::INFINITY;
    let starts: Vec<u32> = (0..t).map(|i| if i % 40 < 17 { 0 } else { 17 }).collect();
    for starts in [None, Some(&starts[..])] {
        let mut want = vec![0.0f32; t * qw];
        let mut probs = vec![0.0f32; shape.probs_len()];
        attention_forward(&mut want, &mut probs, &q, &k, &v, starts, &shape);
        for isa in VectorIsa::supported_here() {
            let kept = Kept::Probabilities;
            let mut out = vec![0.0f32; t * qw];
            let mut saved = vec![0.0f32; kept.len(&shape)];
            let qkv = (&q[..], &k[..], &v[..]);
            attention_rows_forward_on(isa, &mut out, &mut saved, kept, qkv, starts, &shape, 1);
            let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
            for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                assert!(
                    same(*got, *want),
                    "{isa:?} {starts:?}, element {i}: {got} vs {want}"
                );
            }
            assert!(
                out[..21 * qw].iter().all(|x| x.is_finite()),
                "rows before it"
            );
        }
    }
}
