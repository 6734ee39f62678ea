//! ExFlow's context-coherent exchange (§III), counted on the captured
//! routing of the language model trained on real text, beside the
//! two-exchange one the engine runs (`strata bench migrate`'s `stay`).
//!
//! Two exchanges: a token lives on its home device; each layer dispatches
//! its rows to its experts' devices and combines their outputs back home.
//! Context-coherent: a token is rebuilt after each layer's experts on a
//! device chosen for it alone (where its outputs are, or its next layer's
//! experts), runs its next attention there, and dispatches from there; it
//! never goes home. The choice is greedy with one layer's look-ahead: the
//! device that sends the fewest rows for this combine, the token's
//! residual and the next layer's dispatch (where it was on a tie, then the
//! lowest). The accounting is the one most favourable to the mode: the
//! dispatch carries the residual `h` (normalized where the expert runs,
//! `migrate`'s `dispatch-h`), so a residual row crosses only to a device
//! that holds none of the token's experts; the gate weights (k scalars)
//! are not counted.
//!
//! What coherence costs: a token's attention needs the keys and values of
//! every earlier token of its sequence, which now sit on other devices.
//! Each token's K and V (2 · kv_heads · head_dim values) go to each other
//! device holding one of its sequence's later tokens, at every layer (a
//! targeted gather, the least an all-gather could send); the backward
//! sends their gradients back, as it sends every forward row back.

use super::captured::Captured;

/// Where each token is rebuilt after a layer's experts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rebuild {
    /// Home, every layer: the two exchanges the engine runs.
    Home,
    /// ExFlow's context-coherent exchange, choosing by the rows alone.
    Coherent,
    /// The same, also weighing the K and V rows a move adds to the next
    /// attention, each `kv_over_row` of a token row (2 · d_kv / d_model).
    CoherentKv { kv_over_row: f64 },
}

/// Rows a forward step sends between devices, summed over the layers.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenCounts {
    /// Token rows (d_model values) to experts on other devices.
    pub dispatch: u64,
    /// Expert outputs (d_model) to the device a token is rebuilt on.
    pub combine: u64,
    /// Residual rows (d_model) to a device holding none of the token's
    /// experts.
    pub residual: u64,
    /// K and V rows (2 · d_kv values) to devices holding later tokens of
    /// the same sequence.
    pub kv: u64,
    /// Tokens rebuilt away from where they were, summed over layers.
    pub moved: u64,
    /// The worst layer's busiest device's attention (a query at position
    /// p costs p + 1) over the mean.
    pub attention_max_over_mean: f64,
}

/// `[layer][assignment]`: the device computing each assignment (token t's
/// j-th is `t · k + j`), from the captured routing and a placement
/// (`[layer][expert]` → device).
pub(crate) fn assignment_devices(layers: &[Captured], placement: &[Vec<u16>]) -> Vec<Vec<u16>> {
    layers
        .iter()
        .zip(placement)
        .map(|(c, owner)| {
            let mut dev = vec![0u16; c.perm.order.len()];
            for (e, &d) in owner.iter().enumerate() {
                for &a in c.perm.rows(e) {
                    dev[a as usize] = d;
                }
            }
            dev
        })
        .collect()
}

/// Follows every token of `home.len()` sequences of `seq_len` through the
/// layers (`devices[l]` from `assignment_devices`, top-`k`, `n` devices),
/// each sequence starting on `home[s]`.
pub fn follow_tokens(
    devices: &[Vec<u16>],
    k: usize,
    seq_len: usize,
    home: &[u16],
    n: usize,
    rebuild: Rebuild,
) -> TokenCounts {
    let tokens = home.len() * seq_len;
    let mut at: Vec<u16> = (0..tokens).map(|t| home[t / seq_len]).collect();
    let mut counts = TokenCounts {
        attention_max_over_mean: 1.0,
        ..TokenCounts::default()
    };
    for (l, dev) in devices.iter().enumerate() {
        counts.kv += kv_rows(&at, seq_len);
        counts.attention_max_over_mean = counts
            .attention_max_over_mean
            .max(attention_balance(&at, seq_len, n));
        let next = devices.get(l + 1);
        for (s, seq) in at.chunks_mut(seq_len).enumerate() {
            let mut kv = SequenceKv::new(seq, n);
            for (p, slot) in seq.iter_mut().enumerate() {
                let t = s * seq_len + p;
                let mine = &dev[t * k..(t + 1) * k];
                let after = next.map(|next| &next[t * k..(t + 1) * k]);
                let was = *slot;
                kv.enter(was);
                counts.dispatch += mine.iter().filter(|&&d| d != was).count() as u64;
                let to = choose(rebuild, was, (&kv, p), mine, after, n);
                counts.combine += mine.iter().filter(|&&d| d != to).count() as u64;
                counts.residual += u64::from(to != was && !mine.contains(&to));
                counts.moved += u64::from(to != was);
                *slot = to;
                kv.leave(p, to);
            }
        }
    }
    counts
}

/// Where token `p` of its sequence, at `was`, is rebuilt: the least cost,
/// then where it was, then the lowest device.
fn choose(
    rebuild: Rebuild,
    was: u16,
    (kv, p): (&SequenceKv, usize),
    mine: &[u16],
    after: Option<&[u16]>,
    n: usize,
) -> u16 {
    // K and V are needed only where another attention follows.
    let kv_over_row = match (rebuild, after) {
        (Rebuild::Home, _) => return was,
        (Rebuild::CoherentKv { kv_over_row }, Some(_)) => kv_over_row,
        _ => 0.0,
    };
    let mut best = (f64::INFINITY, was);
    for c in 0..n as u16 {
        let mut cost = rebuild_cost(c, was, mine, after) as f64;
        if kv_over_row > 0.0 {
            cost += kv_over_row * kv.added(p, c) as f64;
        }
        if cost < best.0 || (cost == best.0 && c == was) {
            best = (cost, c);
        }
    }
    best.1
}

/// A sequence's devices as its tokens are rebuilt in order: how many of
/// the tokens after the current one sit on each device (where they were),
/// and the last token rebuilt on each.
struct SequenceKv {
    after: Vec<u32>,
    last: Vec<Option<usize>>,
}

impl SequenceKv {
    fn new(seq: &[u16], n: usize) -> Self {
        let mut after = vec![0u32; n];
        for &d in seq {
            after[d as usize] += 1;
        }
        Self {
            after,
            last: vec![None; n],
        }
    }

    /// The next token, on `was`, is no longer one of those after it.
    fn enter(&mut self, was: u16) {
        self.after[was as usize] -= 1;
    }

    /// The token at position `p` was rebuilt on `to`.
    fn leave(&mut self, p: usize, to: u16) {
        self.last[to as usize] = Some(p);
    }

    /// The K and V rows the next attention sends (`kv_rows`) with token
    /// `p` on `c`, less an amount the same for every `c`: none where a
    /// later token already sits on `c`; else its own K and V there, and
    /// each earlier token's since the last one on `c`.
    fn added(&self, p: usize, c: u16) -> usize {
        match (self.after[c as usize], self.last[c as usize]) {
            (0, Some(q)) => p - q,
            (0, None) => p + 1,
            _ => 0,
        }
    }
}

/// Rows crossing if a token at `at`, whose experts sit on `mine` (and at
/// the next layer on `after`), is rebuilt on `c`.
fn rebuild_cost(c: u16, at: u16, mine: &[u16], after: Option<&[u16]>) -> usize {
    let combine = mine.iter().filter(|&&d| d != c).count();
    let residual = usize::from(c != at && !mine.contains(&c));
    let dispatch = after.map_or(0, |a| a.iter().filter(|&&d| d != c).count());
    combine + residual + dispatch
}

/// K and V rows sent for one layer's attention: each token's to every
/// other device holding a later token of its sequence.
fn kv_rows(at: &[u16], seq_len: usize) -> u64 {
    let mut rows = 0u64;
    // Devices holding a token at or after this one, and how many.
    let mut later: Vec<u16> = Vec::new();
    for seq in at.chunks(seq_len) {
        later.clear();
        for &d in seq.iter().rev() {
            if !later.contains(&d) {
                later.push(d);
            }
            rows += later.len() as u64 - 1;
        }
    }
    rows
}

/// The busiest device's causal attention over the mean.
fn attention_balance(at: &[u16], seq_len: usize, n: usize) -> f64 {
    let mut load = vec![0u64; n];
    for (t, &d) in at.iter().enumerate() {
        load[d as usize] += (t % seq_len + 1) as u64;
    }
    let mean = load.iter().sum::<u64>() as f64 / n as f64;
    let max = load.iter().copied().max().unwrap_or(0) as f64;
    if mean > 0.0 {
        max / mean
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One sequence of three tokens, top-1, two devices, home 0:
    /// layer 0's experts on devices [1, 1, 0], layer 1's on [1, 0, 0].
    fn three_tokens() -> Vec<Vec<u16>> {
        vec![vec![1, 1, 0], vec![1, 0, 0]]
    }

    #[test]
    fn two_exchanges_send_every_row_away_from_home_and_back() {
        let c = follow_tokens(&three_tokens(), 1, 3, &[0], 2, Rebuild::Home);
        assert_eq!(
            (c.dispatch, c.combine, c.residual, c.kv, c.moved),
            (3, 3, 0, 0, 0)
        );
        assert_eq!(c.attention_max_over_mean, 2.0);
    }

    #[test]
    fn a_coherent_token_goes_from_expert_to_expert_and_its_keys_follow() {
        let c = follow_tokens(&three_tokens(), 1, 3, &[0], 2, Rebuild::Coherent);
        // Token 0 stays on device 1 for both layers (its output is there,
        // so is its next expert); token 1's output comes home, where its
        // next expert is; token 2 never leaves. At layer 1's attention,
        // token 0's K and V go to device 0, which holds tokens 1 and 2.
        assert_eq!(
            (c.dispatch, c.combine, c.residual, c.kv, c.moved),
            (2, 1, 0, 1, 1)
        );
        // Layer 0's attention all at home is the worst: 6 against 0.
        assert_eq!(c.attention_max_over_mean, 2.0);
        // Layer 1's: device 0 holds positions 1 and 2 (2 + 3), device 1
        // position 0 (1): 5 / 3.
        assert!((attention_balance(&[1, 0, 0], 3, 2) - 5.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn a_residual_crosses_only_to_a_device_without_the_tokens_experts() {
        // Top-2 on three devices: the token's layer-0 experts on 1 and 2,
        // its layer-1 experts both on 0 (where it is): staying costs the
        // two outputs, moving to 1 or 2 costs one output and two rows
        // dispatched back.
        let c = follow_tokens(&[vec![1, 2], vec![0, 0]], 2, 1, &[0], 3, Rebuild::Coherent);
        assert_eq!((c.dispatch, c.combine, c.residual, c.moved), (2, 2, 0, 0));
        // Its next experts on 2 and 2: device 2 costs one output in.
        let c = follow_tokens(&[vec![1, 2], vec![2, 2]], 2, 1, &[0], 3, Rebuild::Coherent);
        assert_eq!((c.dispatch, c.combine, c.residual, c.moved), (2, 1, 0, 1));
        // A device holding none of its experts takes its residual too.
        assert_eq!(rebuild_cost(0, 1, &[1, 2], Some(&[0, 0])), 3);
        assert_eq!(rebuild_cost(2, 0, &[1, 2], None), 1);
    }

    #[test]
    fn weighing_keys_and_values_keeps_a_token_with_its_sequence() {
        // Four tokens at home on device 0, top-1, two devices. Layer 0's
        // experts all on 1, layer 1's: token 3's on 1, the others' on 0.
        let devices = vec![vec![1, 1, 1, 1], vec![0, 0, 0, 1]];
        let rows_only = follow_tokens(&devices, 1, 4, &[0], 2, Rebuild::Coherent);
        // By rows alone token 3 stays on 1 (its output and next expert
        // are there), and every earlier token's K and V follow it; the
        // others' outputs come home.
        assert_eq!(
            (rows_only.combine, rows_only.kv, rows_only.moved),
            (3, 3, 1)
        );
        // Weighing a K and V row as a token row, the three rows token 3's
        // move adds to the attention outweigh the two it saves: it comes
        // home too, and moves only after the last layer, where no
        // attention follows.
        let weighed = Rebuild::CoherentKv { kv_over_row: 1.0 };
        let c = follow_tokens(&devices, 1, 4, &[0], 2, weighed);
        assert_eq!((c.dispatch, c.combine, c.kv, c.moved), (5, 4, 0, 1));
        // Weighing them at a tenth, the move pays again.
        let light = Rebuild::CoherentKv { kv_over_row: 0.1 };
        assert_eq!(follow_tokens(&devices, 1, 4, &[0], 2, light), rows_only);
    }

    /// `SequenceKv::added` is `kv_rows` of the sequence with the token
    /// moved, less the same amount for every device, wherever the token
    /// and the others sit.
    #[test]
    fn a_move_s_keys_and_values_are_counted_without_recounting_the_sequence() {
        let n = 4;
        let mut x = 12345u64;
        for _ in 0..50 {
            let seq: Vec<u16> = (0..9)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((x >> 33) % n as u64) as u16
                })
                .collect();
            let mut kv = SequenceKv::new(&seq, n);
            for p in 0..seq.len() {
                kv.enter(seq[p]);
                let rows_on = |c: u16| {
                    let mut moved = seq.clone();
                    moved[p] = c;
                    kv_rows(&moved, moved.len()) as i64 - kv.added(p, c) as i64
                };
                let base = rows_on(0);
                for c in 1..n as u16 {
                    assert_eq!(rows_on(c), base, "{seq:?}, token {p} on {c}");
                }
                kv.leave(p, seq[p]);
            }
        }
    }

    #[test]
    fn keys_and_values_go_to_each_other_device_with_a_later_token() {
        // Positions on devices 0, 1, 0, 2: token 0's go to 1 and 2, token
        // 1's to 0 and 2, token 2's to 2, token 3's nowhere.
        assert_eq!(kv_rows(&[0, 1, 0, 2], 4), 5);
        // Two sequences are counted apart.
        assert_eq!(kv_rows(&[0, 1, 1, 0], 2), 2);
        assert_eq!(kv_rows(&[3, 3, 3], 3), 0);
    }
}
