//! Bad input to the engine gets a clear error, never a panic.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};

use common::hooked::{Hooked, Pass};
use strata::engine::{Engine, EngineConfig};
use strata::model::{Batch, ExpertRunner, Losses, ModelConfig};
use strata::EngineError;
use strata_optim::AdamWHyper;

fn model() -> ModelConfig {
    ModelConfig {
        layers: 1,
        d_model: 8,
        d_ff: 16,
        experts: 4,
        top_k: 2,
        classes: 5,
        ..ModelConfig::default()
    }
}

fn batch(t: usize, d: usize) -> Batch {
    Batch {
        inputs: (0..t * d).map(|i| (i % 5) as f32 * 0.1).collect(),
        targets: (0..t).map(|i| (i % 5) as u32).collect(),
    }
}

/// Each size alone at zero is refused (not only all of them together).
#[test]
fn a_zero_size_is_refused_naming_the_sizes() {
    for name in ["layers", "d_model", "d_ff", "classes"] {
        let mut m = model();
        *match name {
            "layers" => &mut m.layers,
            "d_model" => &mut m.d_model,
            "d_ff" => &mut m.d_ff,
            _ => &mut m.classes,
        } = 0;
        let err = Engine::new(m, EngineConfig::default()).err().unwrap();
        assert!(
            err.to_string()
                .contains("layers, d_model, d_ff and classes must be at least 1"),
            "{name} = 0: {err}"
        );
    }
}

/// Either loss coefficient alone not finite is refused; a z-loss is
/// refused for a sigmoid router, which has none, and its absence accepted.
#[test]
fn loss_coefficients_are_checked_one_by_one() {
    for (aux, z) in [(f32::NAN, 0.0), (0.01, f32::INFINITY)] {
        let m = ModelConfig {
            aux_loss_coef: aux,
            z_loss_coef: z,
            ..model()
        };
        let err = Engine::new(m, EngineConfig::default()).err().unwrap();
        assert!(
            err.to_string().contains("loss coefficients must be finite"),
            "aux {aux}, z {z}: {err}"
        );
    }
    let sigmoid = |z_loss_coef| ModelConfig {
        scoring: strata::math::Scoring::SigmoidGrouped {
            groups: 2,
            kept_groups: 1,
            scale: 1.0,
        },
        z_loss_coef,
        ..model()
    };
    assert!(Engine::new(sigmoid(0.0), EngineConfig::default()).is_ok());
    let err = Engine::new(sigmoid(0.01), EngineConfig::default())
        .err()
        .unwrap();
    assert!(
        err.to_string()
            .contains("the z-loss is a softmax router's; a sigmoid router has none"),
        "{err}"
    );
}

#[test]
fn top_k_above_the_expert_count_is_refused() {
    let err = Engine::new(
        ModelConfig {
            top_k: 5,
            ..model()
        },
        EngineConfig::default(),
    )
    .err()
    .unwrap();
    assert!(
        err.to_string()
            .contains("top_k = 5 must be between 1 and the number of experts (4)"),
        "{err}"
    );
}

#[test]
fn mismatched_shapes_and_empty_batches_are_refused() {
    let mut engine = Engine::new(model(), EngineConfig::default()).unwrap();
    let mut b = batch(6, 8);
    b.inputs.pop();
    let err = engine.step(&b).unwrap_err();
    assert!(
        err.to_string()
            .contains("6 tokens × d_model 8 = 48 expected"),
        "{err}"
    );
    let err = engine
        .step(&Batch {
            inputs: vec![],
            targets: vec![],
        })
        .unwrap_err();
    assert!(err.to_string().contains("the batch is empty"), "{err}");
    let mut b = batch(6, 8);
    b.targets[2] = 9;
    let err = engine.step(&b).unwrap_err();
    assert!(
        err.to_string().contains("target class 9 is out of range"),
        "{err}"
    );
    let mut b = batch(6, 8);
    b.inputs[3] = f32::NAN;
    assert!(matches!(engine.step(&b), Err(EngineError::Batch(_))));
    // The engine is still usable after refusing bad batches.
    engine.step(&batch(6, 8)).unwrap();
}

#[test]
fn a_diverging_loss_is_reported() {
    // A learning rate this large sends the params to infinity within steps.
    let config = EngineConfig {
        hyper: AdamWHyper {
            lr: 1e30,
            ..AdamWHyper::default()
        },
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(model(), config).unwrap();
    let mut err = None;
    for _ in 0..10 {
        if let Err(e) = engine.step(&batch(6, 8)) {
            err = Some(e);
            break;
        }
    }
    let err = err.expect("training with lr 1e30 diverges");
    assert!(matches!(err, EngineError::NonFiniteLoss { .. }), "{err}");
    assert!(err.to_string().contains("diverged"), "{err}");
}

#[test]
fn budgets_too_small_name_the_tier_and_the_need() {
    let config = EngineConfig {
        device_budget_bytes: 100,
        ..EngineConfig::default()
    };
    let err = Engine::new(model(), config).err().unwrap();
    assert!(
        err.to_string().contains("device budget of 100 bytes"),
        "{err}"
    );
    let config = EngineConfig {
        host_budget_bytes: 100,
        ..EngineConfig::default()
    };
    let err = Engine::new(model(), config).err().unwrap();
    assert!(
        err.to_string().contains("host budget of 100 bytes"),
        "{err}"
    );
}

#[test]
fn too_few_host_slots_to_stream_through_are_refused() {
    let config = EngineConfig {
        host_stream_slots: Some(2),
        ..EngineConfig::default()
    };
    let err = Engine::new(model(), config).err().unwrap();
    assert!(matches!(err, EngineError::Config(_)), "{err}");
    assert!(
        err.to_string()
            .contains("host_stream_slots = 2: at least 3 host slots must stream"),
        "{err}"
    );
}

/// Ranks as processes: what they do not combine with is refused when the
/// engine opens; a rank that steps before joining its world, one given a
/// communicator of another size, and a question about an expert another
/// rank holds are refused by name.
#[test]
fn ranks_as_processes_refuse_what_they_cannot_do() {
    let refused = [
        (
            EngineConfig {
                ranks: 2,
                devices: 2,
                ..EngineConfig::default()
            },
            "several devices per rank",
        ),
        (
            EngineConfig {
                ranks: 2,
                affinity_prefetch: true,
                ..EngineConfig::default()
            },
            "with affinity_prefetch",
        ),
        (
            EngineConfig {
                ranks: 0,
                ..EngineConfig::default()
            },
            "ranks = 0",
        ),
    ];
    for (config, says) in refused {
        let err = Engine::new(model(), config).err().unwrap();
        assert!(err.to_string().contains(says), "{err}");
    }
    let config = EngineConfig {
        ranks: 2,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(model(), config).unwrap();
    let err = engine.step(&batch(8, 8)).err().unwrap();
    assert!(
        err.to_string().contains("has not joined the others"),
        "{err}"
    );
    // A world of three for a config of two.
    let comm = strata::comm::InProcessComm::endpoints(3).swap_remove(0);
    let err = engine.join_ranks(Box::new(comm)).err().unwrap();
    assert!(
        err.to_string().contains("the communicator has 3 ranks"),
        "{err}"
    );
    assert_eq!(engine.rank(), None);
    assert!(
        engine.owns_expert(0, 1),
        "before joining, every expert is here"
    );
}

/// One rank of two, joined over the in-process `Comm` (its peer a thread):
/// it holds experts 0 and 2 of each layer; asking it for expert 1 names
/// the rank that holds it, a forward of the whole batch is refused, and a
/// collective whose peer has gone fails instead of waiting.
#[test]
fn a_rank_names_where_the_experts_it_lacks_live() {
    let mut ends = strata::comm::InProcessComm::endpoints(2);
    let (second, first) = (ends.pop().unwrap(), ends.pop().unwrap());
    let engines: Vec<Engine> = std::thread::scope(|s| {
        let handles: Vec<_> = [first, second]
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let config = EngineConfig {
                        ranks: 2,
                        ..EngineConfig::default()
                    };
                    let mut engine = Engine::new(model(), config).unwrap();
                    engine.join_ranks(Box::new(comm)).unwrap();
                    engine
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut rank0 = engines.into_iter().next().unwrap();
    assert_eq!(rank0.rank(), Some((0, 2)));
    assert!(rank0.owns_expert(0, 0) && rank0.owns_expert(0, 2));
    assert!(!rank0.owns_expert(0, 1) && !rank0.owns_expert(0, 3));
    assert!(rank0.expert_params(0, 2).is_ok());
    let err = rank0.expert_params(0, 1).err().unwrap();
    assert!(
        err.to_string()
            .contains("expert 1 of layer 0 lives on rank 1, not on rank 0"),
        "{err}"
    );
    let err = rank0.expert_step(0, 3).err().unwrap();
    assert!(err.to_string().contains("lives on rank 1"), "{err}");
    let err = rank0.forward(&model(), &batch(8, 8)).err().unwrap();
    assert!(err.to_string().contains("holds only its own"), "{err}");
    assert_eq!(
        rank0.any_rank(true).unwrap_err().to_string(),
        "device 1 stopped during a collective (its step failed)"
    );
}

/// On ranks a checkpoint returns only once every rank has committed, so
/// a rank never writes past a checkpoint another may lack: one whose peer
/// has gone fails. A resume of ranks whose checkpoints do not meet names
/// each rank's steps.
#[test]
fn rank_checkpoints_wait_for_every_rank_and_ranks_that_do_not_meet_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let config = |rank: usize| EngineConfig {
        ranks: 2,
        store_path: Some(dir.path().join(format!("rank-{rank}.strata"))),
        ..EngineConfig::default()
    };
    let each_rank = |f: &(dyn Fn(usize, strata::comm::InProcessComm) -> Option<Engine> + Sync)| {
        let ends = strata::comm::InProcessComm::endpoints(2);
        std::thread::scope(|s| {
            let handles: Vec<_> = ends
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| s.spawn(move || f(rank, comm)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        })
    };
    let mut engines = each_rank(&|rank, comm| {
        let mut engine = Engine::new(model(), config(rank)).unwrap();
        engine.join_ranks(Box::new(comm)).unwrap();
        Some(engine)
    });
    drop(engines.pop()); // rank 1 goes
    let mut rank0 = engines.pop().flatten().unwrap();
    let err = rank0.checkpoint().unwrap_err().to_string();
    assert!(
        err.contains("device 1 stopped during a collective"),
        "{err}"
    );
    drop(rank0);

    // Rank 0 two checkpoints on, rank 1 where it started.
    let store = strata_tiers::ExpertStore::open(
        &dir.path().join("rank-0.strata"),
        None,
        &Default::default(),
    )
    .unwrap();
    store.checkpoint(3).unwrap();
    store.checkpoint(5).unwrap();
    drop(store);
    let refused = each_rank(&|rank, comm| {
        let err = Engine::resume_rank(&model(), config(rank), Box::new(comm))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains(
                "the ranks hold no checkpoint at one step: rank 0 at step 5 (and 3), rank 1 at \
                 step 0"
            ),
            "rank {rank}: {err}"
        );
        None
    });
    assert_eq!(refused.len(), 2);
}

/// Budgets and a model that need more host memory than the machine has are
/// refused before anything is allocated, naming the parts and the fix.
#[test]
fn more_host_memory_than_the_machine_has_is_refused_up_front() {
    if strata::engine::available_host_memory().is_none() {
        return eprintln!("skipped: this OS does not say how much memory is available");
    }
    let huge = ModelConfig {
        d_model: 1 << 16,
        d_ff: 1 << 16, // 12.9 G params an expert, the store kept in memory
        ..model()
    };
    let err = Engine::new(huge, EngineConfig::default()).err().unwrap();
    let err = err.to_string();
    assert!(
        err.contains("SSD tier kept in memory (no store path)") && err.contains("--host-mem"),
        "{err}"
    );
}

#[test]
fn compute_cells_that_leave_too_few_record_slots_are_refused() {
    let model = model();
    let layout = strata_tiers::Layout {
        layers: model.layers as u32,
        experts_per_layer: model.experts as u32,
        params_per_expert: model.expert_params() as u64,
        compute_dtype: EngineConfig::default().compute_dtype,
        moments: true,
    };
    // 3 of the 4 records fit; one slot split into cells leaves 2.
    let config = EngineConfig {
        host_budget_bytes: 3 * layout.record_bytes(),
        host_cell_slots: 1,
        ..EngineConfig::default()
    };
    let err = Engine::new(model.clone(), config).err().unwrap();
    assert!(matches!(err, EngineError::Config(_)), "{err}");
    assert!(
        err.to_string().contains(
            "host_cell_slots = 1 leaves 2 of the host budget's 3 record slots; at least 3"
        ),
        "{err}"
    );
    // Where every record fits, there are no cells to refuse.
    let config = EngineConfig {
        host_budget_bytes: 4 * layout.record_bytes(),
        host_cell_slots: 1,
        ..EngineConfig::default()
    };
    let engine = Engine::new(model, config).unwrap();
    assert_eq!((engine.host_slots(), engine.host_cells()), (4, 0));
}

/// The plain stack, except that its last micro-batch fails (when armed)
/// before it runs: the earlier micro-batch has summed its experts'
/// gradients by then.
fn fails_its_last_micro_batch(
    stack: &ModelConfig,
    armed: &AtomicBool,
    pass: Pass<'_, Batch>,
    runner: &mut dyn ExpertRunner,
) -> Result<Losses, EngineError> {
    if pass.last_micro_batch && armed.swap(false, Ordering::SeqCst) {
        return Err(EngineError::Data("the second micro-batch failed".into()));
    }
    pass.run(stack, runner)
}

#[test]
fn a_step_that_fails_mid_batch_leaves_no_partial_gradient_behind() {
    let config = || EngineConfig {
        micro_batches: 2,
        ..EngineConfig::default()
    };
    let b = batch(12, 8);
    let mut fresh = Engine::new(model(), config()).unwrap();
    let expected = fresh.step(&b).unwrap();

    // The failed step, then the same batch again: it must see only its own
    // micro-batches' sums, through both a step and a gradient-only pass.
    let failing = Hooked::new(model(), fails_its_last_micro_batch);
    failing.armed.store(true, Ordering::SeqCst);
    let mut engine = Engine::new_network(&failing, config()).unwrap();
    let err = engine.gradients(&failing, &b).unwrap_err();
    assert!(err.to_string().contains("micro-batch failed"), "{err}");
    let grads = engine.gradients(&failing, &b).unwrap();
    let mut fresh_grads = Engine::new(model(), config()).unwrap();
    let expected_grads = fresh_grads.gradients(&model(), &b).unwrap();
    assert!(
        grads == expected_grads,
        "gradients differ from a fresh engine's"
    );

    failing.armed.store(true, Ordering::SeqCst);
    let err = engine.step_network(&failing, &b).unwrap_err();
    assert!(err.to_string().contains("micro-batch failed"), "{err}");
    let metrics = engine.step_network(&failing, &b).unwrap();
    assert_eq!(metrics.loss, expected.loss);
    assert_eq!(engine.steps(), 1);
    for e in 0..model().experts {
        assert_eq!(
            engine.expert_params(0, e).unwrap(),
            fresh.expert_params(0, e).unwrap(),
            "expert {e}"
        );
    }
    assert_eq!(
        engine.dense_params().unwrap(),
        fresh.dense_params().unwrap()
    );
}

/// A language model's batch that does not fit it is refused by name
/// before any work, and one that fits counts its sequences' tokens.
#[test]
fn a_language_model_batch_that_does_not_fit_is_refused_by_name() {
    use strata::lm::{LmConfig, MoeLm, TokenBatch};
    use strata::model::Network;

    let config = LmConfig::preset("tiny").unwrap();
    let (vocab, max_seq) = (config.vocab as u32, config.max_seq);
    let lm = MoeLm::new(config).unwrap();
    let good = TokenBatch {
        seq_len: 4,
        tokens: (0..10).map(|i| i % vocab).collect(), // 2 × (4 + 1)
        loss_mask: Some(vec![true; 10]),
        doc_starts: Some(vec![false; 10]),
    };
    lm.validate_batch(&good).unwrap();
    assert_eq!(lm.processed_tokens(&good), 8);
    let longest = TokenBatch {
        seq_len: max_seq,
        tokens: vec![1; max_seq + 1],
        loss_mask: None,
        doc_starts: None,
    };
    lm.validate_batch(&longest).unwrap();
    assert_eq!(lm.processed_tokens(&longest), max_seq);

    let refused = |batch: TokenBatch, says: &str| {
        let err = lm.validate_batch(&batch).unwrap_err();
        assert!(matches!(err, EngineError::Batch(_)), "{err}");
        assert!(err.to_string().contains(says), "{err}");
    };
    let with = |f: fn(&mut TokenBatch)| {
        let mut b = good.clone();
        f(&mut b);
        b
    };
    refused(with(|b| b.tokens.clear()), "the batch is empty");
    refused(with(|b| b.seq_len = 0), "the batch is empty");
    let too_long = TokenBatch {
        seq_len: max_seq + 1,
        tokens: vec![1; max_seq + 2],
        ..longest.clone()
    };
    refused(too_long, &format!("sequence length {}", max_seq + 1));
    refused(
        with(|b| b.tokens.push(1)),
        "11 tokens do not make whole sequences",
    );
    refused(
        with(|b| b.tokens[7] = 1 << 30),
        "token id 1073741824 is out of range",
    );
    let mut past_the_vocabulary = good.clone();
    past_the_vocabulary.tokens[3] = vocab;
    refused(
        past_the_vocabulary,
        &format!("token id {vocab} is out of range"),
    );
    refused(
        with(|b| b.loss_mask = Some(vec![true; 9])),
        "the loss mask has 9 entries",
    );
    refused(
        with(|b| b.doc_starts = Some(vec![false; 11])),
        "the document starts has 11 entries",
    );
}
