//! Frozen tensors (`MoeLm::with_trained`, `EngineConfig::train_experts`):
//! a step leaves them as they were and steps every other tensor to the
//! same bits as an engine that trains everything.

use strata::engine::{Engine, EngineConfig};
use strata::lm::{LmConfig, MoeLm, TensorGroup, TokenBatch};
use strata_optim::AdamWHyper;

fn config(train_experts: bool) -> EngineConfig {
    EngineConfig {
        optimizer_threads: 1,
        train_experts,
        // Decay would move a frozen tensor that merely got no gradient.
        hyper: AdamWHyper {
            weight_decay: 0.1,
            ..AdamWHyper::default()
        },
        ..EngineConfig::default()
    }
}

#[test]
fn a_step_moves_the_trained_groups_alone_and_to_the_same_bits() {
    let lm = MoeLm::new(LmConfig::preset("tiny").unwrap()).unwrap();
    let batch = TokenBatch {
        seq_len: 8,
        tokens: (0..18).map(|i| (i * 37 % 250) as u32).collect(),
        loss_mask: None,
        doc_starts: None,
    };
    let mut all = Engine::new_network(&lm, config(true)).unwrap();
    let init = all.dense_params().unwrap().to_vec();
    all.step_network(&lm, &batch).unwrap();

    let some = lm
        .clone()
        .with_trained(&[TensorGroup::Attention, TensorGroup::Norms]);
    let mut frozen = Engine::new_network(&some, config(false)).unwrap();
    let experts_before = frozen.expert_params(0, 0).unwrap();
    frozen.step_network(&some, &batch).unwrap();
    for t in some.tensors() {
        let r = t.range.clone();
        match TensorGroup::of_dense(&t.name) {
            Some(TensorGroup::Attention | TensorGroup::Norms) => {
                let same = frozen.dense_params().unwrap()[r.clone()]
                    == all.dense_params().unwrap()[r.clone()];
                assert!(
                    same && init[r] != all.dense_params().unwrap()[t.range.clone()],
                    "{}",
                    t.name
                )
            }
            _ => assert!(
                frozen.dense_params().unwrap()[r.clone()] == init[r],
                "{}",
                t.name
            ),
        }
    }
    assert!(frozen.expert_params(0, 0).unwrap() == experts_before);
    assert!(all.expert_params(0, 0).unwrap() != experts_before);

    // The network an engine steps must freeze what it was built with.
    let err = frozen.step_network(&lm, &batch).unwrap_err().to_string();
    assert!(err.contains("freezes other dense tensors"), "{err}");
}
