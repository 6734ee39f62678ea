//! What the cases of ranks as processes share, whatever carries them
//! (`mpi_ranks.rs` over MPI, `nccl_ranks.rs` over NCCL): a script of
//! collectives whose bits depend on the rank, the round and the order of
//! float sums, and a training run compared bit for bit with the in-process
//! devices' run of as many devices.

use strata::comm::{Comm, InProcessComm};
use strata::engine::{Engine, EngineConfig};
use strata::model::Network;
use strata_tiers::Dtype;

/// Collectives whose results depend on the rank, the round and the order of
/// float sums, as bits: what one rank saw.
pub fn script<C: Comm>(c: &mut C) -> Vec<u32> {
    let (r, n) = (c.rank(), c.size());
    let mut seen = Vec::new();
    for round in 0..12usize {
        // To rank j: (r + j + round) % 4 values (empty ones included).
        let sends = (0..n)
            .map(|j| {
                (0..(r + j + round) % 4)
                    .map(|i| (1000 * r + 10 * j + i) as f32 * 0.5)
                    .collect()
            })
            .collect();
        for buf in c.all_to_all(sends).expect("all_to_all") {
            seen.push(buf.len() as u32);
            seen.extend(buf.iter().map(|x| x.to_bits()));
        }
        let gathered = c
            .all_gather_u32((0..(r + round) % 3).map(|i| (r * 100 + i) as u32).collect())
            .expect("all_gather");
        for g in gathered {
            seen.push(g.len() as u32);
            seen.extend(g);
        }
        // Values whose float sum depends on the order of addition (from
        // three ranks on): 1 + 1e8 − 1e8 is 0 in f32, −1e8 + 1e8 + 1 is 1.
        let mut buf: Vec<f32> = (0..5)
            .map(|i| match r % 3 {
                0 => (1 + i + round) as f32,
                1 => 1e8,
                _ => -1e8,
            })
            .collect();
        c.all_reduce_sum(&mut buf).expect("all_reduce");
        seen.extend(buf.iter().map(|x| x.to_bits()));
        c.barrier().expect("barrier");
    }
    seen
}

/// `script` as every rank of an in-process world of `n` sees it.
pub fn in_process(n: usize) -> Vec<Vec<u32>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = InProcessComm::endpoints(n)
            .into_iter()
            .map(|mut c| s.spawn(move || script(&mut c)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Steps each training case runs.
pub const STEPS: usize = 20;

/// What a run ends with, as bits: every step's loss, the dense params,
/// each expert's params (`None` where this process does not hold the
/// expert), and one more batch's gradients (dense; each expert's, `None`
/// where no token reached it or another rank computed it).
#[derive(PartialEq)]
pub struct Run {
    /// Held-out loss after training (not compared bit for bit: the ranks
    /// sum their parts in another order than one device).
    pub eval: Option<f32>,
    pub losses: Vec<u32>,
    pub dense: Vec<u32>,
    pub experts: Vec<Vec<Option<Vec<u32>>>>,
    pub grad_dense: Vec<u32>,
    pub grad_experts: Vec<Vec<Option<Vec<u32>>>>,
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `STEPS` steps of `net` under `config` (joining `comm`'s ranks where
/// given), then the gradients of one more batch.
pub fn train<N>(
    net: &N,
    config: EngineConfig,
    comm: Option<Box<dyn Comm>>,
    batch: impl Fn(usize) -> N::Batch,
) -> Run
where
    N: Network + Sync,
    N::Batch: Sync,
{
    let clip = config.clip_grad_norm;
    let mut engine = Engine::new_network(net, config).expect("the engine opens");
    if let Some(comm) = comm {
        engine.join_ranks(comm).expect("the ranks join");
    }
    let losses = (0..STEPS)
        .map(|s| {
            let m = engine.step_network(net, &batch(s)).expect("a step");
            if let Some(max) = clip {
                let norm = m.grad_norm.expect("a clipped step's norm");
                assert!(
                    norm > f64::from(max),
                    "step {s} was not clipped: norm {norm}"
                );
            }
            m.loss.to_bits()
        })
        .collect();
    let model = engine.model().clone();
    let experts = (0..model.layers)
        .map(|l| {
            (0..model.experts)
                .map(|e| {
                    engine
                        .owns_expert(l, e)
                        .then(|| bits(&engine.expert_params(l, e).expect("its params")))
                })
                .collect()
        })
        .collect();
    let dense = bits(engine.dense_params().expect("the dense params"));
    let eval = engine
        .evaluate(net, &batch(STEPS + 1))
        .expect("an evaluation");
    // Rank 0 alone asks: every rank hears it.
    let asked = engine.rank().is_none_or(|(r, _)| r == 0);
    assert!(engine.any_rank(asked).expect("the ranks agree"));
    assert!(!engine.any_rank(false).expect("the ranks agree"));
    let grads = engine.gradients(net, &batch(STEPS)).expect("gradients");
    let grad_experts = grads
        .experts
        .iter()
        .map(|layer| layer.iter().map(|g| g.as_deref().map(bits)).collect())
        .collect();
    Run {
        eval: Some(eval),
        losses,
        dense,
        experts,
        grad_dense: bits(&grads.dense),
        grad_experts,
    }
}

/// What a rank holds of an in-process run: its own experts' params and
/// gradients.
pub fn rank_share(run: &Run, owned: impl Fn(usize, usize) -> bool) -> Run {
    let keep = |table: &Vec<Vec<Option<Vec<u32>>>>| -> Vec<Vec<Option<Vec<u32>>>> {
        table
            .iter()
            .enumerate()
            .map(|(l, layer)| {
                layer
                    .iter()
                    .enumerate()
                    .map(|(e, v)| v.clone().filter(|_| owned(l, e)))
                    .collect()
            })
            .collect()
    };
    Run {
        eval: None,
        losses: run.losses.clone(),
        dense: run.dense.clone(),
        experts: keep(&run.experts),
        grad_dense: run.grad_dense.clone(),
        grad_experts: keep(&run.grad_experts),
    }
}

/// A config with every expert resident, as `multi_device` trains.
pub fn resident(
    layers: usize,
    experts: usize,
    record_bytes: u64,
    micro_batches: usize,
) -> EngineConfig {
    let all = (layers * experts) as u64;
    EngineConfig {
        hyper: super::hyper(),
        micro_batches,
        compute_dtype: Dtype::F32,
        optimizer_threads: 2,
        device_budget_bytes: all * record_bytes,
        host_budget_bytes: all * record_bytes,
        ..EngineConfig::default()
    }
}

/// One rank's side of a training case: the in-process run of as many
/// devices, then this rank's, compared bit for bit.
pub fn rank_trains_as_a_device<N>(
    net: &N,
    config: EngineConfig,
    comm: Box<dyn Comm>,
    batch: impl Fn(usize) -> N::Batch + Copy,
) where
    N: Network + Sync,
    N::Batch: Sync,
{
    let (r, n) = (comm.rank(), comm.size());
    let in_process = train(
        net,
        EngineConfig {
            devices: n,
            ..config.clone()
        },
        None,
        batch,
    );
    let mine = train(net, EngineConfig { ranks: n, ..config }, Some(comm), batch);
    let experts = net.moe().experts;
    let owned = |_l: usize, e: usize| e % n == r;
    let held = mine
        .experts
        .iter()
        .flatten()
        .filter(|v| v.is_some())
        .count();
    assert!(held > 0, "rank {r} of {n} holds no expert");
    assert!(
        mine.losses == in_process.losses,
        "rank {r} of {n}: other losses"
    );
    assert!(
        mine.dense == in_process.dense,
        "rank {r} of {n}: other dense params"
    );
    let (a, b) = (mine.eval.unwrap(), in_process.eval.unwrap());
    assert!(
        (a - b).abs() <= 1e-6 * b.abs(),
        "rank {r} of {n}: held-out loss {a} against {b} in one process"
    );
    let mine = Run { eval: None, ..mine };
    assert!(
        mine == rank_share(&in_process, owned),
        "rank {r} of {n}: other expert params or gradients than the in-process devices'"
    );
    println!(
        "rank {r} of {n}: {STEPS} steps, {held} experts of {}: the in-process bits",
        experts * net.moe().layers
    );
}
