//! The expert FFN's activations between its GEMMs, shared by the f32 FFN
//! (`cpu.rs`) and the bf16 one (`cpu_bf16.rs`): SwiGLU's h = silu(a)·b
//! (keeping σ(a) for the backward where asked), GELU, and SwiGLU's input
//! gradients, each element computed alone and split over the compute
//! threads. The SwiGLU loops are compiled for the widest vectors the CPU
//! has ([`VectorIsa`]); their sigmoids take f32's exp, the polynomial of
//! `math::fast_exp`, which vectorizes. Every element has the bits of
//! `math::silu`, `math::sigmoid` and `math::silu_grad`, which the
//! reference trainer uses, at any split and in any vector set.

use crate::math::vector_isa::{multiversioned, VectorIsa};
use crate::math::{gelu, resize_exact, ExpertKind, ExpertSaved};
use crate::parallel::{for_row_block_pairs, for_row_blocks, MIN_JOB_WORK};

/// Below this many hidden elements an activation pass stays on the calling
/// thread (about ten microseconds of sigmoids, as `MIN_JOB_WORK` is of
/// streaming work).
pub(super) const PARALLEL_MIN_ELEMENTS: usize = 1 << 12;

/// An activation element (a sigmoid or a tanh) as elements of the
/// streaming work `parallel` shares out, so that a job holds at least
/// `PARALLEL_MIN_ELEMENTS` of them.
const ACTIVATION_WORK: usize = MIN_JOB_WORK / PARALLEL_MIN_ELEMENTS;

/// Runs `body(start, part)` on each part of `out` (`start`: the index of
/// its first element), each on its own thread. Each element is computed
/// alone, so the cut changes no bit of the result.
pub(super) fn for_parts(out: &mut [f32], body: impl Fn(usize, &mut [f32]) + Sync) {
    for_row_blocks(out, 1, ACTIVATION_WORK, body);
}

/// `for_parts` over two outputs of the same length, cut alike.
pub(super) fn for_part_pairs(
    out: &mut [f32],
    out2: &mut [f32],
    body: impl Fn(usize, &mut [f32], &mut [f32]) + Sync,
) {
    assert_eq!(out.len(), out2.len());
    for_row_block_pairs(out, 1, out2, 1, ACTIVATION_WORK, body);
}

/// `buf`'s first `len` values, for an output every element of which is
/// written. The buffer keeps its longest length: a call after a longer one
/// clears nothing (an expert's rows differ from the last's, and shrinking
/// then growing the vector would zero the difference every time). It
/// grows to exactly that length, so that it holds no more than the most
/// rows an expert had (the memory plan's count), not up to twice that.
pub(super) fn sized(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        resize_exact(buf, len, 0.0);
    }
    &mut buf[..len]
}

/// The hidden activation h = silu(a)·b (SwiGLU) or gelu(a) into `h`'s
/// first a.len() values ([`sized`]); with `sig`, also σ(a) (SwiGLU), which
/// the backward reuses for silu′.
pub(super) fn hidden_into(
    kind: ExpertKind,
    saved: &ExpertSaved<f32>,
    h: &mut Vec<f32>,
    sig: Option<&mut Vec<f32>>,
) {
    let n = saved.a.len();
    let (a, b) = (&saved.a, &saved.b);
    let h = sized(h, n);
    let isa = VectorIsa::detected();
    match (kind, sig) {
        (ExpertKind::SwiGlu, Some(sig)) => for_part_pairs(h, sized(sig, n), |at, h, sig| {
            let r = at..at + h.len();
            swiglu_saving_sigmoid(isa, h, sig, &a[r.clone()], &b[r]);
        }),
        (ExpertKind::SwiGlu, None) => for_parts(h, |at, h| {
            let r = at..at + h.len();
            swiglu(isa, h, &a[r.clone()], &b[r]);
        }),
        (ExpertKind::Gelu, _) => for_parts(h, |at, h| {
            for i in 0..h.len() {
                h[i] = gelu(a[at + i]);
            }
        }),
    }
}

/// SwiGLU's input gradients da, db (n × F each, written whole) from dh =
/// ∂L/∂h and what [`hidden_into`] kept: a, b and σ(a).
pub(super) fn swiglu_input_grads(
    da: &mut [f32],
    db: &mut [f32],
    dh: &[f32],
    saved: &ExpertSaved<f32>,
    sig: &[f32],
) {
    let (a, b) = (&saved.a, &saved.b);
    let isa = VectorIsa::detected();
    for_part_pairs(da, db, |at, da, db| {
        let r = at..at + da.len();
        let (dh, a, b, sig) = (&dh[r.clone()], &a[r.clone()], &b[r.clone()], &sig[r]);
        swiglu_grads(isa, da, db, dh, a, b, sig);
    });
}

multiversioned! {
    /// h = silu(a)·b and sig = σ(a), element by element.
    fn swiglu_saving_sigmoid(h: &mut [f32], sig: &mut [f32], a: &[f32], b: &[f32])
        => swiglu_saving_sigmoid_body;
}

#[inline(always)]
fn swiglu_saving_sigmoid_body(h: &mut [f32], sig: &mut [f32], a: &[f32], b: &[f32]) {
    for (((h, sig), &a), &b) in h.iter_mut().zip(sig).zip(a).zip(b) {
        let s = crate::math::sigmoid(a);
        *sig = s;
        // silu(a) = a·σ(a), the same operations.
        *h = a * s * b;
    }
}

multiversioned! {
    /// h = silu(a)·b, element by element.
    fn swiglu(h: &mut [f32], a: &[f32], b: &[f32]) => swiglu_body;
}

#[inline(always)]
fn swiglu_body(h: &mut [f32], a: &[f32], b: &[f32]) {
    for ((h, &a), &b) in h.iter_mut().zip(a).zip(b) {
        *h = crate::math::silu(a) * b;
    }
}

multiversioned! {
    /// SwiGLU's hidden gradients from dh = ∂L/∂h, h = silu(a)·b: db =
    /// dh·silu(a) and da = dh·b·silu′(a), from σ(a) with the operations of
    /// `math::silu` and `math::silu_grad` (so the same bits, for one
    /// sigmoid instead of two).
    fn swiglu_grads(
        da: &mut [f32],
        db: &mut [f32],
        dh: &[f32],
        a: &[f32],
        b: &[f32],
        sig: &[f32],
    ) => swiglu_grads_body;
}

#[inline(always)]
fn swiglu_grads_body(
    da: &mut [f32],
    db: &mut [f32],
    dh: &[f32],
    a: &[f32],
    b: &[f32],
    sig: &[f32],
) {
    for i in 0..da.len() {
        let s = sig[i];
        db[i] = dh[i] * (a[i] * s);
        da[i] = dh[i] * b[i] * (s * (1.0 + a[i] * (1.0 - s)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::math::{sigmoid, silu, silu_grad};

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// A buffer keeps its longest length, grown to exactly that: the
    /// memory plan counts it at an expert's most rows, not twice.
    #[test]
    fn a_sized_buffer_grows_to_exactly_its_longest_length() {
        let mut buf = Vec::new();
        assert_eq!(sized(&mut buf, 100).len(), 100);
        sized(&mut buf, 100).fill(2.0);
        assert_eq!(sized(&mut buf, 60).len(), 60);
        assert_eq!(sized(&mut buf, 150).len(), 150);
        assert_eq!((buf.len(), buf.capacity()), (150, 150));
        assert!(buf[..100].iter().all(|&v| v == 2.0));
    }

    #[test]
    fn ranges_cover_every_element_once() {
        for n in [
            0,
            1,
            7,
            PARALLEL_MIN_ELEMENTS - 1,
            PARALLEL_MIN_ELEMENTS + 3,
        ] {
            // Each visit adds the element's index + 1, as its part says.
            let visit = |at: usize, part: &mut [f32]| {
                part.iter_mut()
                    .enumerate()
                    .for_each(|(i, h)| *h += (at + i + 1) as f32)
            };
            let (mut hits, mut hits2) = (vec![0.0f32; n], vec![0.0f32; n]);
            for_parts(&mut hits, visit);
            assert!((0..n).all(|i| hits[i] == (i + 1) as f32));
            hits.fill(0.0);
            for_part_pairs(&mut hits, &mut hits2, |at, part, part2| {
                visit(at, part);
                visit(at, part2);
            });
            assert!((0..n).all(|i| hits[i] == (i + 1) as f32 && hits2[i] == (i + 1) as f32));
        }
    }

    /// The activations of a layer large enough to be split over threads,
    /// and the σ(a) the backward reuses, are bit for bit the formulas of
    /// `math` (which the reference trainer uses).
    #[test]
    fn split_activations_equal_the_math_formulas_bit_for_bit() {
        let n = PARALLEL_MIN_ELEMENTS * 2 + 5;
        let wave = |i: usize, k: usize| ((i * k % 1009) as f32 / 1009.0 - 0.5) * 12.0;
        let saved = ExpertSaved {
            a: (0..n).map(|i| wave(i, 37)).collect(),
            b: (0..n).map(|i| wave(i, 53)).collect(),
        };
        let (mut h, mut sig) = (Vec::new(), Vec::new());
        hidden_into(ExpertKind::SwiGlu, &saved, &mut h, Some(&mut sig));
        for i in 0..n {
            let (a, b) = (saved.a[i], saved.b[i]);
            assert_eq!(h[i].to_bits(), (silu(a) * b).to_bits());
            assert_eq!(sig[i].to_bits(), sigmoid(a).to_bits());
        }
        let dh: Vec<f32> = (0..n).map(|i| wave(i, 11)).collect();
        let (mut da, mut db) = (vec![0.0; n], vec![0.0; n]);
        swiglu_input_grads(&mut da, &mut db, &dh, &saved, &sig);
        for i in 0..n {
            let (a, b) = (saved.a[i], saved.b[i]);
            assert_eq!(db[i].to_bits(), (dh[i] * silu(a)).to_bits());
            assert_eq!(da[i].to_bits(), (dh[i] * b * silu_grad(a)).to_bits());
        }
        // A shorter call after a longer one: its values, the rest kept.
        let short = ExpertSaved {
            a: saved.a[..n / 2].to_vec(),
            b: saved.b[..n / 2].to_vec(),
        };
        let before = h.clone();
        hidden_into(ExpertKind::Gelu, &short, &mut h, None);
        assert_eq!(h.len(), n);
        assert!((0..n / 2).all(|i| h[i].to_bits() == gelu(short.a[i]).to_bits()));
        assert_eq!(h[n / 2..], before[n / 2..]);
        hidden_into(ExpertKind::SwiGlu, &saved, &mut h, None);
        assert!((0..n).all(|i| h[i].to_bits() == (silu(saved.a[i]) * saved.b[i]).to_bits()));
        hidden_into(ExpertKind::Gelu, &saved, &mut h, None);
        assert!((0..n).all(|i| h[i].to_bits() == gelu(saved.a[i]).to_bits()));
    }

    /// The SwiGLU loops give the baseline copy's bits in every vector set
    /// this CPU runs, over inputs past the exp's clamp, zeros and an odd
    /// length (a vector tail).
    #[test]
    fn the_swiglu_loops_give_the_same_bits_in_every_vector_set() {
        let n = 1001;
        let wave = |i: usize, k: f32| ((i as f32 * k).sin() * 120.0).clamp(-100.0, 100.0);
        let a: Vec<f32> = (0..n)
            .map(|i| wave(i, 0.37))
            .map(|x| if x.abs() < 0.5 { 0.0 } else { x })
            .collect();
        let b: Vec<f32> = (0..n).map(|i| wave(i, 0.11) / 30.0).collect();
        let dh: Vec<f32> = (0..n).map(|i| wave(i, 0.73) / 50.0).collect();
        let run = |isa: VectorIsa| {
            let (mut h, mut sig, mut h2) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            swiglu_saving_sigmoid(isa, &mut h, &mut sig, &a, &b);
            swiglu(isa, &mut h2, &a, &b);
            let (mut da, mut db) = (vec![0.0; n], vec![0.0; n]);
            swiglu_grads(isa, &mut da, &mut db, &dh, &a, &b, &sig);
            [h, sig, h2, da, db].map(|v| bits(&v))
        };
        let want = run(VectorIsa::Baseline);
        assert_eq!(want[0], want[2], "h with and without σ saved");
        for isa in VectorIsa::supported_here() {
            assert_eq!(run(isa), want, "{}", isa.name());
        }
    }
}
