//! Sequence migration (LUFFY, `../shared/papers/004_…` §IV): after a MoE
//! layer's experts, each sequence is rebuilt on a device of its choosing
//! rather than always where it was, so that the expert outputs computed on
//! that device need not cross the link in the combine, and the next
//! layer's attention runs there.
//!
//! [`plan`] is the paper's two-step heuristic (Algorithm 1): for each
//! sequence, the `q` devices that would pull the fewest rows to rebuild it
//! are its candidates; then, sequences with the most to gain first, each
//! goes to the candidate whose attention cost (eq. 1, [`AttentionCost`])
//! grows least, among those with room under a cap on each device's
//! attention cost (its balanced share, plus a slack). Sequences of equal
//! length cost the same wherever they go, so for them the cap alone
//! balances the attention and the rows pulled decide. A move into a full
//! device can push off it a sequence that had nothing to gain; a plan
//! that so pulls more rows than staying would, and balances the attention
//! no better, is dropped for staying.
//!
//! What rebuilding moves ([`Accounting`]), forward and backward. The
//! paper counts the expert outputs that are not on the device (and, in the
//! backward, their gradients sent back to the experts). In a pre-norm
//! decoder layer the output is `h + Σ_k w_k · expert_k(RMSNorm(h))`: the
//! residual `h` (and the combine weights `w`) stay where the sequence was,
//! so a sequence that moves also pulls one row of `h` a token, and in the
//! backward sends one row of its gradient back, for the layer's attention
//! backward where the sequence was. [`Accounting::WithResidual`] counts
//! them, as the engine's layer is built (the experts receive `RMSNorm(h)`);
//! with top-k routing a token then gains only where more of its k outputs
//! are on the new device than on the old one by more than one.
//! [`Accounting::ResidualWithDispatch`] counts a layer that dispatches `h`
//! itself and normalizes it where the expert runs: a token's residual then
//! reaches every device holding one of its experts with the dispatch, and
//! only the others' is pulled (its gradient still goes back).
//!
//! The plan is deterministic: every device computes the same one from the
//! same counts, as placement does.

/// One sequence at one MoE layer: where it is, its length, and where its
/// tokens' expert outputs are computed.
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceRoutes {
    /// The device it is on (where its residual stream is).
    pub at: u16,
    /// Its tokens.
    pub len: usize,
    /// `[device]`: the assignments of its tokens (k a token) whose expert
    /// that device computes.
    pub rows_on: Vec<u32>,
    /// `[device]`: its tokens with at least one expert on that device.
    pub tokens_on: Vec<u32>,
}

/// What rebuilding a sequence on a device moves over the link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accounting {
    /// LUFFY's count: the expert outputs computed elsewhere, and their
    /// gradients.
    ExpertOutputs,
    /// Those, and when the sequence moves its residual stream's rows and
    /// their gradients (one each a token): what the engine's layer moves.
    WithResidual,
    /// Those of `WithResidual`, but the forward's residual rows only for
    /// tokens with no expert on the device: a layer that dispatches `h`.
    ResidualWithDispatch,
}

impl SequenceRoutes {
    /// The expert outputs rebuilding this sequence on `dest` pulls, in the
    /// forward (the backward sends as many gradients back).
    pub fn outputs_pulled(&self, dest: u16) -> u64 {
        self.rows_on
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != dest as usize)
            .map(|(_, &r)| r as u64)
            .sum()
    }

    /// The residual rows rebuilding on `dest` moves: [forward, backward].
    pub fn residual_moved(&self, dest: u16, accounting: Accounting) -> [u64; 2] {
        let len = self.len as u64;
        match accounting {
            _ if dest == self.at => [0, 0],
            Accounting::ExpertOutputs => [0, 0],
            Accounting::WithResidual => [len, len],
            Accounting::ResidualWithDispatch => [
                len.saturating_sub(self.tokens_on[dest as usize] as u64),
                len,
            ],
        }
    }

    /// The rows, forward and backward, rebuilding this sequence on `dest`
    /// moves, as `accounting` counts them.
    pub fn pulled_rows(&self, dest: u16, accounting: Accounting) -> u64 {
        let [forward, backward] = self.residual_moved(dest, accounting);
        2 * self.outputs_pulled(dest) + forward + backward
    }
}

/// LUFFY's attention cost (eq. 1), in multiply-adds: `B` sequences padded
/// to `L` tokens cost `3·B·L·d² + 2·B·L²·d` (the Q, K, V projections, then
/// the scores and the weighted values).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionCost {
    pub d_model: usize,
}

impl AttentionCost {
    pub fn of(&self, seqs: usize, len: usize) -> f64 {
        let (b, l, d) = (seqs as f64, len as f64, self.d_model as f64);
        3.0 * b * l * d * d + 2.0 * b * l * l * d
    }
}

/// How [`plan`] chooses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MigrationConfig {
    /// `q`: each sequence's candidate devices, those pulling the fewest
    /// rows (at least 1).
    pub candidates: usize,
    /// How far a device's attention cost may go over the balanced share
    /// (`⌈B / N⌉` sequences of the longest length): 0.25 is 25 %.
    pub slack: f64,
    pub accounting: Accounting,
}

impl Default for MigrationConfig {
    fn default() -> Self {
        Self {
            candidates: 2,
            slack: 0.0,
            accounting: Accounting::WithResidual,
        }
    }
}

/// Each device's sequences and their longest, as a plan fills them.
struct DeviceLoad {
    seqs: usize,
    longest: usize,
}

/// The device each sequence is rebuilt on (see the module).
///
/// # Panics
/// If `devices` is 0 or over 65 536, a sequence's `rows_on` or
/// `tokens_on` does not have one count per device, or a sequence is on a
/// device past the last.
pub fn plan(
    seqs: &[SequenceRoutes],
    devices: usize,
    cost: AttentionCost,
    cfg: &MigrationConfig,
) -> Vec<u16> {
    check(seqs, devices);
    let acc = cfg.accounting;
    let longest = seqs.iter().map(|s| s.len).max().unwrap_or(0);
    let cap = (1.0 + cfg.slack.max(0.0)) * cost.of(seqs.len().div_ceil(devices), longest);
    let pulled = |i: usize, j: usize| seqs[i].pulled_rows(j as u16, acc);
    // Most to gain first; then in order.
    let gain = |i: usize| {
        let best = (0..devices).map(|j| pulled(i, j)).min().unwrap_or(0);
        pulled(i, seqs[i].at as usize) - best
    };
    let mut order: Vec<usize> = (0..seqs.len()).collect();
    order.sort_by_cached_key(|&i| (std::cmp::Reverse(gain(i)), i));
    let mut loads: Vec<DeviceLoad> = (0..devices)
        .map(|_| DeviceLoad {
            seqs: 0,
            longest: 0,
        })
        .collect();
    let mut dest = vec![0u16; seqs.len()];
    for i in order {
        let s = &seqs[i];
        // Fewest rows first; staying before moving; then by index.
        let rank = |j: usize| (pulled(i, j), j != s.at as usize, j);
        let mut by_rows: Vec<usize> = (0..devices).collect();
        by_rows.sort_by_cached_key(|&j| rank(j));
        let after = |l: &DeviceLoad| cost.of(l.seqs + 1, l.longest.max(s.len));
        let growth = |j: usize| after(&loads[j]) - cost.of(loads[j].seqs, loads[j].longest);
        // The cap is met by some device: fewer than ⌈B / N⌉ are on one.
        let fits = |j: &usize| after(&loads[*j]) <= cap * (1.0 + 1e-12);
        let chosen = by_rows
            .iter()
            .take(cfg.candidates.max(1))
            .copied()
            .filter(fits)
            .min_by(|&a, &b| growth(a).total_cmp(&growth(b)).then(rank(a).cmp(&rank(b))))
            .or_else(|| by_rows.iter().copied().find(fits))
            .expect("a device below the balanced share has room");
        loads[chosen].seqs += 1;
        loads[chosen].longest = loads[chosen].longest.max(s.len);
        dest[i] = chosen as u16;
    }
    no_worse_than_staying(seqs, dest, devices, cost, acc)
}

fn check(seqs: &[SequenceRoutes], devices: usize) {
    assert!(
        (1..=1 << 16).contains(&devices),
        "{devices} devices: a plan needs 1 to 65536"
    );
    for (i, s) in seqs.iter().enumerate() {
        assert_eq!(s.rows_on.len(), devices, "sequence {i}: a count a device");
        assert_eq!(s.tokens_on.len(), devices, "sequence {i}: a count a device");
        assert!((s.at as usize) < devices, "sequence {i} is on no device");
    }
}

/// A move that fills a device can push a sequence that had nothing to gain
/// off it: where `dest` pulls more rows than staying would and balances the
/// attention no better, every sequence stays.
fn no_worse_than_staying(
    seqs: &[SequenceRoutes],
    dest: Vec<u16>,
    devices: usize,
    cost: AttentionCost,
    acc: Accounting,
) -> Vec<u16> {
    let stay: Vec<u16> = seqs.iter().map(|s| s.at).collect();
    let total = |to: &[u16]| -> u64 {
        seqs.iter()
            .zip(to)
            .map(|(s, &j)| s.pulled_rows(j, acc))
            .sum()
    };
    let busiest = |to: &[u16]| {
        attention_loads(seqs, to, devices, cost)
            .into_iter()
            .fold(0.0, f64::max)
    };
    if total(&stay) < total(&dest) && busiest(&stay) <= busiest(&dest) {
        return stay;
    }
    dest
}

/// Each device's attention cost once every sequence is on `dest`'s device.
pub fn attention_loads(
    seqs: &[SequenceRoutes],
    dest: &[u16],
    devices: usize,
    cost: AttentionCost,
) -> Vec<f64> {
    let mut count = vec![0usize; devices];
    let mut longest = vec![0usize; devices];
    for (s, &j) in seqs.iter().zip(dest) {
        count[j as usize] += 1;
        longest[j as usize] = longest[j as usize].max(s.len);
    }
    count
        .iter()
        .zip(&longest)
        .map(|(&b, &l)| cost.of(b, l))
        .collect()
}

#[cfg(test)]
mod tests;
