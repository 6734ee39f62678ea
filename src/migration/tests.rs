use proptest::prelude::*;

use super::*;

const COST: AttentionCost = AttentionCost { d_model: 8 };

const ALL: [Accounting; 3] = [
    Accounting::ExpertOutputs,
    Accounting::WithResidual,
    Accounting::ResidualWithDispatch,
];

/// A sequence whose tokens each have at most one expert a device (so as
/// many of them have one on a device as it has rows, up to its length).
fn seq(at: u16, len: usize, rows_on: &[u32]) -> SequenceRoutes {
    SequenceRoutes {
        at,
        len,
        rows_on: rows_on.to_vec(),
        tokens_on: rows_on.iter().map(|&r| r.min(len as u32)).collect(),
    }
}

fn cfg(candidates: usize, slack: f64, accounting: Accounting) -> MigrationConfig {
    MigrationConfig {
        candidates,
        slack,
        accounting,
    }
}

#[test]
fn rebuilding_pulls_the_outputs_elsewhere_and_a_moved_residual() {
    let s = seq(0, 4, &[2, 5, 1]);
    assert_eq!(s.tokens_on, vec![2, 4, 1]);
    assert_eq!(s.outputs_pulled(1), 3);
    // Forward and backward: outputs and their gradients.
    assert_eq!(s.pulled_rows(0, Accounting::ExpertOutputs), 12);
    assert_eq!(s.pulled_rows(1, Accounting::ExpertOutputs), 6);
    assert_eq!(s.pulled_rows(2, Accounting::ExpertOutputs), 14);
    // And the residual rows and their gradients, when it moves.
    assert_eq!(s.pulled_rows(0, Accounting::WithResidual), 12);
    assert_eq!(s.pulled_rows(1, Accounting::WithResidual), 6 + 4 + 4);
    assert_eq!(s.pulled_rows(2, Accounting::WithResidual), 14 + 4 + 4);
    // Dispatching the residual: the forward pulls those of tokens with no
    // expert there (none on device 1, 3 on device 2).
    let dispatched = Accounting::ResidualWithDispatch;
    assert_eq!(s.residual_moved(0, dispatched), [0, 0]);
    assert_eq!(s.residual_moved(1, dispatched), [0, 4]);
    assert_eq!(s.residual_moved(2, dispatched), [3, 4]);
    assert_eq!(s.pulled_rows(2, dispatched), 14 + 3 + 4);
}

#[test]
fn the_attention_cost_is_eq_1() {
    let c = AttentionCost { d_model: 4 };
    assert_eq!(c.of(3, 5), 3.0 * 3.0 * 5.0 * 16.0 + 2.0 * 3.0 * 25.0 * 4.0);
    assert_eq!(c.of(0, 5), 0.0);
}

#[test]
fn a_sequence_moves_only_where_it_pulls_fewer_rows() {
    // Top-2, 4 tokens: 8 rows. Both of every token's outputs on device 1:
    // moving pulls the residual's 4 rows against staying's 8.
    let all_there = seq(0, 4, &[0, 8]);
    // Half there: moving pulls 2 outputs and 4 residual rows against 6.
    let half_there = seq(0, 4, &[2, 6]);
    let loose = cfg(1, 10.0, Accounting::WithResidual);
    assert_eq!(
        plan(std::slice::from_ref(&all_there), 2, COST, &loose),
        vec![1]
    );
    assert_eq!(
        plan(std::slice::from_ref(&half_there), 2, COST, &loose),
        vec![0]
    );
    // Dispatching the residual, the half's moves too: every token has an
    // expert on device 1, so only the residual's gradient goes back.
    let dispatched = cfg(1, 10.0, Accounting::ResidualWithDispatch);
    assert_eq!(
        plan(std::slice::from_ref(&half_there), 2, COST, &dispatched),
        vec![1]
    );
    // Counting only the outputs (LUFFY's count), both move.
    let outputs = cfg(1, 10.0, Accounting::ExpertOutputs);
    assert_eq!(
        plan(&[all_there, half_there], 2, COST, &outputs),
        vec![1, 1]
    );
}

#[test]
fn the_cap_keeps_attention_balanced_and_the_largest_gains_win() {
    // Four sequences on two devices, every one pulling fewest rows on
    // device 1; with no slack only two fit there: those that gain most.
    let seqs = [
        seq(0, 4, &[1, 7]),
        seq(0, 4, &[0, 8]),
        seq(1, 4, &[3, 5]),
        seq(1, 4, &[2, 6]),
    ];
    let dest = plan(&seqs, 2, COST, &cfg(2, 0.0, Accounting::ExpertOutputs));
    assert_eq!(dest, vec![1, 1, 0, 0]);
    let loads = attention_loads(&seqs, &dest, 2, COST);
    assert_eq!(loads[0], loads[1]);
    // A slack of 100 % lets all four go.
    let dest = plan(&seqs, 2, COST, &cfg(2, 1.0, Accounting::ExpertOutputs));
    assert_eq!(dest, vec![1, 1, 1, 1]);
}

#[test]
fn a_plan_that_pulls_more_than_staying_stays() {
    // The first gains 4 rows by moving to device 1, which then has room
    // for one of the two there: the other, with nothing to gain, would be
    // pushed to device 0 and pull 12 rows instead of none.
    let seqs = [
        seq(0, 4, &[0, 8]),
        seq(0, 4, &[4, 4]),
        seq(1, 4, &[0, 8]),
        seq(1, 4, &[0, 8]),
    ];
    let dest = plan(&seqs, 2, COST, &cfg(1, 0.0, Accounting::WithResidual));
    assert_eq!(dest, vec![0, 0, 1, 1]);
    // With room for three on a device, the first moves alone.
    let dest = plan(&seqs, 2, COST, &cfg(1, 0.5, Accounting::WithResidual));
    assert_eq!(dest, vec![1, 0, 1, 1]);
}

#[test]
fn among_candidates_the_least_attention_growth_wins() {
    let seqs = [
        // Goes to device 0 first (it gains most), then the short one to 1.
        seq(1, 16, &[32, 0]),
        seq(0, 2, &[0, 4]),
        // Pulls as many rows either way, and is on device 1: with one
        // candidate it stays; with two it joins the long sequence, where
        // the attention grows by one more sequence of 16, not by padding
        // the short one to 16.
        seq(1, 16, &[16, 16]),
    ];
    let loose = |q| cfg(q, 10.0, Accounting::ExpertOutputs);
    assert_eq!(plan(&seqs, 2, COST, &loose(1)), vec![0, 1, 1]);
    assert_eq!(plan(&seqs, 2, COST, &loose(2)), vec![0, 1, 0]);
}

#[test]
fn with_nothing_to_gain_every_sequence_stays() {
    let seqs: Vec<_> = (0..8u16).map(|i| seq(i / 2, 4, &[2, 2, 2, 2])).collect();
    for acc in ALL {
        for q in 1..=4 {
            let dest = plan(&seqs, 4, COST, &cfg(q, 0.0, acc));
            assert_eq!(dest, vec![0, 0, 1, 1, 2, 2, 3, 3], "q {q}, {acc:?}");
        }
    }
}

#[test]
#[should_panic(expected = "a count a device")]
fn a_count_missing_for_a_device_is_refused() {
    plan(&[seq(0, 4, &[8])], 2, COST, &MigrationConfig::default());
}

/// Random sequences over `devices`: each token's k outputs on random
/// devices.
fn sequences(devices: usize, k: usize) -> impl Strategy<Value = Vec<SequenceRoutes>> {
    let one = (0..devices as u16, 1usize..6).prop_flat_map(move |(at, len)| {
        prop::collection::vec(0..devices, len * k).prop_map(move |picks| {
            let mut rows_on = vec![0u32; devices];
            let mut tokens_on = vec![0u32; devices];
            for token in picks.chunks(k) {
                for (i, &j) in token.iter().enumerate() {
                    rows_on[j] += 1;
                    if !token[..i].contains(&j) {
                        tokens_on[j] += 1;
                    }
                }
            }
            SequenceRoutes {
                at,
                len,
                rows_on,
                tokens_on,
            }
        })
    });
    prop::collection::vec(one, 1..12)
}

fn total(seqs: &[SequenceRoutes], dest: &[u16], acc: Accounting) -> u64 {
    seqs.iter()
        .zip(dest)
        .map(|(s, &j)| s.pulled_rows(j, acc))
        .sum()
}

proptest! {
    #[test]
    fn no_device_goes_over_the_cap(
        seqs in sequences(3, 2),
        q in 1usize..4,
        slack in prop_oneof![Just(0.0), Just(0.25)],
    ) {
        for acc in ALL {
            let dest = plan(&seqs, 3, COST, &cfg(q, slack, acc));
            let longest = seqs.iter().map(|s| s.len).max().unwrap();
            let cap = (1.0 + slack) * COST.of(seqs.len().div_ceil(3), longest);
            for load in attention_loads(&seqs, &dest, 3, COST) {
                prop_assert!(load <= cap * (1.0 + 1e-12), "{load} over {cap}");
            }
        }
    }

    #[test]
    fn without_a_cap_each_sequence_takes_its_fewest_rows(seqs in sequences(4, 2)) {
        for acc in ALL {
            let dest = plan(&seqs, 4, COST, &cfg(1, 1e9, acc));
            for (s, &j) in seqs.iter().zip(&dest) {
                let best = (0..4).map(|d| s.pulled_rows(d, acc)).min().unwrap();
                prop_assert_eq!(s.pulled_rows(j, acc), best);
                if s.pulled_rows(s.at, acc) == best {
                    prop_assert_eq!(j, s.at, "a tie stays");
                }
            }
            let stay: Vec<u16> = seqs.iter().map(|s| s.at).collect();
            prop_assert!(total(&seqs, &dest, acc) <= total(&seqs, &stay, acc));
        }
    }

    /// With one expert a token, rebuilding elsewhere pulls a residual row
    /// for every output it saves: an exact plan that weighs rows alone
    /// (one candidate) never moves a sequence.
    #[test]
    fn top_1_routing_never_pays_for_a_move(seqs in sequences(4, 1)) {
        let dest = plan(&seqs, 4, COST, &cfg(1, 1e9, Accounting::WithResidual));
        for (s, &j) in seqs.iter().zip(&dest) {
            prop_assert_eq!(j, s.at);
        }
    }
}
