//! Cross-entropy over a (T, V) block of logits: the loss alone
//! (evaluation), and the loss with d logits (training), the rows shared
//! over threads. Every row's log Σ exp is [`log_sum_exp`]'s: its largest
//! logit, then Σ exp(z − max) in the order of the vocabulary, then the
//! log. The training pass takes the exps in a loop of their own and sums
//! [`ROWS_SIDE_BY_SIDE`] rows at once, each row's sum one chain of adds in
//! vocabulary order beside the others', so that the adds of different
//! rows overlap rather than wait on each other; every row's sum has the
//! bits of the plain loop's.

use super::vector_isa::{multiversioned, VectorIsa};
use super::{log_sum_exp, Real};

/// A target that carries no loss (a prompt token of an instruction
/// example): its row adds nothing to the cross-entropy and its d logits
/// are zero. transformers writes it as -100.
pub const IGNORED_TARGET: u32 = u32::MAX;

/// Cross-entropy summed over rows and divided by `denominator`, forward
/// only (evaluation): the same value `cross_entropy_forward_backward`
/// returns, without its gradient.
pub fn cross_entropy_loss<R: Real>(
    logits: &[R],
    targets: &[u32],
    v: usize,
    denominator: usize,
) -> R {
    cross_entropy_loss_after(R::zero(), logits, targets, v, denominator)
}

/// [`cross_entropy_loss`] added onto `loss`, row after row: the loss of
/// rows taken a block at a time, each block continuing the last's sum, is
/// the whole's to the bit.
pub fn cross_entropy_loss_after<R: Real>(
    mut loss: R,
    logits: &[R],
    targets: &[u32],
    v: usize,
    denominator: usize,
) -> R {
    let scale = R::one() / R::from_f64(denominator as f64);
    for (i, &target) in targets.iter().enumerate() {
        if target == IGNORED_TARGET {
            continue;
        }
        let row = &logits[i * v..(i + 1) * v];
        loss += (log_sum_exp(row) - row[target as usize]) * scale;
    }
    loss
}

/// Cross-entropy summed over rows and divided by `denominator` (so
/// micro-batches add up to the full batch's mean); writes d logits.
pub fn cross_entropy_forward_backward<R: Real>(
    dlogits: &mut [R],
    logits: &[R],
    targets: &[u32],
    v: usize,
    denominator: usize,
) -> R {
    cross_entropy_forward_backward_split(dlogits, logits, targets, v, denominator, 1)
}

/// Below this many logits (about 30 µs of exps on one core)
/// cross-entropy is not split over threads.
pub(super) const CE_SPLIT_MIN_LOGITS: usize = 1 << 16;

/// [`cross_entropy_forward_backward`] with the rows split over up to
/// `threads` threads. Each row's share of the loss is computed as the
/// serial loop computes it and the shares are summed in row order, so
/// the result is the same bit for bit.
pub fn cross_entropy_forward_backward_split<R: Real>(
    dlogits: &mut [R],
    logits: &[R],
    targets: &[u32],
    v: usize,
    denominator: usize,
    threads: usize,
) -> R {
    let t = targets.len();
    assert!(dlogits.len() == t * v && logits.len() == t * v);
    let scale = R::one() / R::from_f64(denominator as f64);
    let mut shares = vec![R::zero(); t];
    let threads = if t * v < CE_SPLIT_MIN_LOGITS {
        1
    } else {
        threads.clamp(1, 8)
    };
    let rows = t.div_ceil(threads).max(1);
    let isa = VectorIsa::detected();
    let jobs: Vec<_> = dlogits
        .chunks_mut((rows * v).max(1))
        .zip(logits.chunks((rows * v).max(1)))
        .zip(targets.chunks(rows).zip(shares.chunks_mut(rows)))
        .map(|((dlogits, logits), (targets, shares))| {
            move || cross_entropy_rows(isa, dlogits, logits, targets, shares, v, scale)
        })
        .collect();
    crate::parallel::run_all(jobs);
    shares.iter().fold(R::zero(), |loss, &share| loss + share)
}

/// Rows whose sums of exps run side by side: enough independent chains to
/// keep the adders busy (an add's latency over its throughput, 4 × 2).
const ROWS_SIDE_BY_SIDE: usize = 8;

multiversioned! {
    /// Each row's share of the loss and its d logits, compiled for the
    /// widest vectors the CPU has (the same bits in each).
    fn cross_entropy_rows<R: Real>(
        dlogits: &mut [R],
        logits: &[R],
        targets: &[u32],
        shares: &mut [R],
        v: usize,
        scale: R,
    ) => cross_entropy_rows_body;
}

#[inline(always)]
fn cross_entropy_rows_body<R: Real>(
    dlogits: &mut [R],
    logits: &[R],
    targets: &[u32],
    shares: &mut [R],
    v: usize,
    scale: R,
) {
    let groups = dlogits
        .chunks_mut(ROWS_SIDE_BY_SIDE * v.max(1))
        .zip(logits.chunks(ROWS_SIDE_BY_SIDE * v.max(1)))
        .zip(targets.chunks(ROWS_SIDE_BY_SIDE))
        .zip(shares.chunks_mut(ROWS_SIDE_BY_SIDE));
    for (((dlogits, logits), targets), shares) in groups {
        // Each row's exps (shifted by its largest logit) into its d logits.
        let mut max = [R::zero(); ROWS_SIDE_BY_SIDE];
        for (r, (drow, row)) in dlogits.chunks_mut(v).zip(logits.chunks(v)).enumerate() {
            max[r] = lane_max(row);
            for (e, &z) in drow.iter_mut().zip(row) {
                *e = (z - max[r]).exp();
            }
        }
        let sums = match targets.len() {
            ROWS_SIDE_BY_SIDE => sums_side_by_side::<R, ROWS_SIDE_BY_SIDE>(dlogits, v),
            n => {
                let mut sums = [R::zero(); ROWS_SIDE_BY_SIDE];
                for (sum, drow) in sums[..n].iter_mut().zip(dlogits.chunks(v)) {
                    *sum = sums_side_by_side::<R, 1>(drow, v)[0];
                }
                sums
            }
        };
        let rows = dlogits.chunks_mut(v).zip(logits.chunks(v));
        for (r, ((drow, row), &target)) in rows.zip(targets).enumerate() {
            if target == IGNORED_TARGET {
                shares[r] = R::zero();
                drow.fill(R::zero());
                continue;
            }
            let lse = max[r] + sums[r].ln();
            let target = target as usize;
            shares[r] = (lse - row[target]) * scale;
            for (d, &z) in drow.iter_mut().zip(row) {
                *d = (z - lse).exp() * scale;
            }
            drow[target] = ((row[target] - lse).exp() - R::one()) * scale;
        }
    }
}

/// The sums of `N` rows of `v` values, each in order from +0, the rows'
/// adds interleaved.
#[inline(always)]
fn sums_side_by_side<R: Real, const N: usize>(rows: &[R], v: usize) -> [R; N] {
    let mut sums = [R::zero(); N];
    for j in 0..v {
        for (r, sum) in sums.iter_mut().enumerate() {
            *sum += rows[r * v + j];
        }
    }
    sums
}

/// The largest of `row` (−∞ for an empty one; NaNs skipped), 16 lanes at
/// a time, a row's maximum before its exps. Its value is a running
/// maximum's ([`log_sum_exp`]'s from `row[0]`): a set of numbers has one
/// largest, and +0 and −0, the one pair that compares
/// equal with different bits, give the same exp(x − max) for every x and
/// the same max + ln Σ but where that is zero. A NaN in `row[0]`, which
/// `log_sum_exp` keeps, makes every exp NaN either way.
#[inline(always)]
fn lane_max<R: Real>(row: &[R]) -> R {
    const LANES: usize = 16;
    let mut lanes = [R::from_f64(f64::NEG_INFINITY); LANES];
    let mut blocks = row.chunks_exact(LANES);
    for block in &mut blocks {
        for (m, &v) in lanes.iter_mut().zip(block) {
            if v > *m {
                *m = v;
            }
        }
    }
    for (m, &v) in lanes.iter_mut().zip(blocks.remainder()) {
        if v > *m {
            *m = v;
        }
    }
    // The lanes (no NaN among them) halved four times, rather than one
    // chain of 16 compares.
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            if lanes[l + width] > lanes[l] {
                lanes[l] = lanes[l + width];
            }
        }
    }
    lanes[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Splitting the rows over threads changes no bit of the loss or of
    /// d logits (a ragged last part; large enough to be split).
    #[test]
    fn split_cross_entropy_equals_the_serial_one_bit_for_bit() {
        let (t, v) = (1031, 1024);
        assert!(t * v >= CE_SPLIT_MIN_LOGITS);
        let logits: Vec<f32> = (0..t * v)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 9.0)
            .collect();
        let targets: Vec<u32> = (0..t).map(|i| (i * 31 % v) as u32).collect();
        let mut serial = vec![0.0f32; t * v];
        let loss = cross_entropy_forward_backward(&mut serial, &logits, &targets, v, 3 * t);
        for threads in [2, 3, 8] {
            let mut split = vec![0.0f32; t * v];
            let l = cross_entropy_forward_backward_split(
                &mut split,
                &logits,
                &targets,
                v,
                3 * t,
                threads,
            );
            assert_eq!(l.to_bits(), loss.to_bits(), "{threads} threads");
            assert!(split == serial, "{threads} threads");
        }
    }

    /// A row whose target is ignored adds nothing to the loss and gets
    /// zero d logits, whatever the buffer held before (d logits are
    /// written whole, so a caller may hand any buffer; today's hand zeroed
    /// ones, which hid a wrong range); the other rows are as a fresh
    /// buffer's.
    #[test]
    fn ignored_rows_get_zero_d_logits_whatever_the_buffer_held() {
        let (t, v) = (6, 7);
        let logits: Vec<f32> = (0..t * v)
            .map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.25)
            .collect();
        let mut targets: Vec<u32> = (0..t).map(|i| (i * 3 % v) as u32).collect();
        for i in [0, 2, 5] {
            targets[i] = IGNORED_TARGET;
        }
        let mut fresh = vec![0.0f32; t * v];
        let loss = cross_entropy_forward_backward(&mut fresh, &logits, &targets, v, t);
        let mut stale = vec![f32::NAN; t * v];
        let l = cross_entropy_forward_backward(&mut stale, &logits, &targets, v, t);
        assert_eq!(l.to_bits(), loss.to_bits());
        for i in 0..t {
            let row = &stale[i * v..(i + 1) * v];
            if targets[i] == IGNORED_TARGET {
                assert!(row.iter().all(|&g| g == 0.0), "row {i}: {row:?}");
            } else {
                assert!(row == &fresh[i * v..(i + 1) * v], "row {i}: {row:?}");
            }
        }
        let kept: Vec<u32> = targets
            .iter()
            .copied()
            .filter(|&t| t != IGNORED_TARGET)
            .collect();
        let kept_logits: Vec<f32> = (0..t)
            .filter(|&i| targets[i] != IGNORED_TARGET)
            .flat_map(|i| logits[i * v..(i + 1) * v].to_vec())
            .collect();
        let alone = cross_entropy_loss(&kept_logits, &kept, v, t);
        assert_eq!(
            alone.to_bits(),
            loss.to_bits(),
            "the ignored rows add nothing"
        );
    }

    /// Evaluation's loss is training's loss, to the bit.
    #[test]
    fn the_loss_alone_equals_the_loss_with_its_gradient() {
        let (t, v) = (9, 13);
        let logits: Vec<f32> = (0..t * v)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.3)
            .collect();
        let targets: Vec<u32> = (0..t).map(|i| (i * 5 % v) as u32).collect();
        let mut dlogits = vec![0.0f32; t * v];
        let with_grad = cross_entropy_forward_backward(&mut dlogits, &logits, &targets, v, 20);
        let alone = cross_entropy_loss(&logits, &targets, v, 20);
        assert_eq!(with_grad.to_bits(), alone.to_bits());
    }

    /// Rows summed side by side (full groups and a ragged one, a row
    /// length that is no multiple of the lanes, ignored rows among them)
    /// give each row the plain loop's bits: its loss share through the
    /// total, and every d logit.
    #[test]
    fn rows_side_by_side_give_the_plain_loop_s_bits() {
        let (t, v) = (21, 37);
        let mut logits: Vec<f32> = (0..t * v)
            .map(|i| ((i * 7919 % 101) as f32 / 101.0 - 0.5) * 12.0)
            .collect();
        logits[3 * v..4 * v].fill(0.25); // every logit equal
        logits[5 * v + v - 1] = 90.0; // past exp's range, last in its row
        logits[6 * v] = -0.0;
        let mut targets: Vec<u32> = (0..t).map(|i| (i * 11 % v) as u32).collect();
        for i in [1, 8, 20] {
            targets[i] = IGNORED_TARGET;
        }
        let denominator = 29;
        let mut got = vec![f32::NAN; t * v];
        let loss = cross_entropy_forward_backward(&mut got, &logits, &targets, v, denominator);
        let scale = 1.0 / denominator as f32;
        for (i, &target) in targets.iter().enumerate() {
            let (row, drow) = (&logits[i * v..(i + 1) * v], &got[i * v..(i + 1) * v]);
            if target == IGNORED_TARGET {
                assert!(drow.iter().all(|&d| d.to_bits() == 0), "row {i}");
                continue;
            }
            let lse = log_sum_exp(row);
            for (j, (&d, &z)) in drow.iter().zip(row).enumerate() {
                let onehot = if j == target as usize { 1.0 } else { 0.0 };
                // Real::exp, f32's polynomial (f32's own `exp` is libm's).
                let want = (Real::exp(z - lse) - onehot) * scale;
                assert_eq!(d.to_bits(), want.to_bits(), "row {i}, logit {j}");
            }
        }
        let alone = cross_entropy_loss(&logits, &targets, v, denominator);
        assert_eq!(loss.to_bits(), alone.to_bits());
    }
}
