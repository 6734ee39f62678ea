//! The language model's dense tensors by group: where each starts
//! (`MoeLm::init_params`), and frozen tensors (`MoeLm::with_trained`,
//! `EngineConfig::train_experts`): a step leaves them as they were and
//! steps every other tensor to the same bits as an engine that trains
//! everything.

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

/// Norm gains start at 1, buffers (correction biases) at 0, and every
/// matrix uniform within ±1/√fan_in, each from its own stream (no two
/// matrices alike), filling the whole dense vector.
#[test]
fn each_dense_tensor_starts_as_its_group_says() {
    let lm = MoeLm::new(LmConfig::preset("tiny").unwrap()).unwrap();
    let p = lm.init_params();
    assert_eq!(p.len(), lm.config().dense_params());
    let mut firsts = Vec::new();
    for t in lm.tensors() {
        let values = &p[t.range.clone()];
        match (TensorGroup::of_dense(&t.name), t.shape.len()) {
            (None, _) => assert!(values.iter().all(|&v| v == 0.0), "{}", t.name),
            (Some(_), 1) => assert!(values.iter().all(|&v| v == 1.0), "{}", t.name),
            (Some(_), _) => {
                let bound = (t.shape[1] as f32).sqrt().recip();
                assert!(values.iter().all(|v| v.abs() <= bound), "{}", t.name);
                let spread = values.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert!(spread > 0.5 * bound, "{}: {spread} of {bound}", t.name);
                firsts.push(values[..4].to_vec());
            }
        }
    }
    let count = firsts.len();
    firsts.sort_by(|a, b| a.partial_cmp(b).unwrap());
    firsts.dedup();
    assert_eq!(firsts.len(), count, "two matrices drew the same values");
}
