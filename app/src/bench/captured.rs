//! One batch's MoE routing and expert inputs from the language model
//! trained on real text, for the benches that measure what crosses between
//! devices (`strata bench condense`, `strata bench migrate`): a preset
//! trained on the built-in corpus for some steps (exactly, tracing its
//! routing), then one more batch run forward with each MoE layer's expert
//! inputs and routing kept.

use strata::engine::{Engine, EngineConfig, RoutingTrace};
use strata::lm::data::{Corpus, DataConfig, Dataset, Tokenizer};
use strata::lm::{LmConfig, MoeLm, TokenBatch};
use strata::math::{AssignmentGrads, Permutation};
use strata::model::{ExpertRunner, Network, PlainKernels};
use strata::reference::{ExpertState, MemoryRunner};
use strata::EngineError;
use strata_optim::AdamWHyper;

/// What to train, and the batch to capture.
#[derive(Clone, Debug)]
pub struct CaptureSpec {
    pub preset: String,
    pub train_steps: u64,
    pub seq_len: usize,
    /// Sequences a step (and in the captured batch).
    pub batch: usize,
}

/// One MoE layer's inputs and routing, as the forward gave them.
pub(crate) struct Captured {
    pub x: Vec<f32>,
    pub perm: Permutation,
}

/// Keeps each layer's inputs and routing, and runs the experts from memory.
struct Recorder<'a> {
    inner: MemoryRunner<'a>,
    layers: Vec<Captured>,
}

impl ExpertRunner for Recorder<'_> {
    fn forward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        self.layers.push(Captured {
            x: x.to_vec(),
            perm: perm.clone(),
        });
        self.inner.forward_layer(layer, perm, x, out)
    }

    fn backward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        dout: AssignmentGrads<'_, f32>,
        dx: &mut [f32],
        last_micro_batch: bool,
    ) -> Result<(), EngineError> {
        self.inner
            .backward_layer(layer, perm, x, dout, dx, last_micro_batch)
    }
}

/// What training left: the captured layers, the losses, the step's time
/// and its expert compute.
pub(crate) struct Trained {
    pub lm: MoeLm,
    pub layers: Vec<Captured>,
    pub first_loss: f32,
    pub last_loss: f32,
    pub step_s: f64,
    pub expert_s: f64,
    /// The training steps' routing transitions.
    pub trace: RoutingTrace,
}

pub(crate) fn train_and_capture(cfg: &CaptureSpec) -> Result<Trained, String> {
    // As `strata train` builds a preset: its vocabulary the tokenizer's.
    let mut config = LmConfig::preset(&cfg.preset).map_err(|e| e.to_string())?;
    config.vocab = Tokenizer::Bytes.vocab_size();
    config.max_seq = config.max_seq.max(cfg.seq_len);
    let lm = MoeLm::new(config).map_err(|e| e.to_string())?;
    let mut data = Dataset::open(
        DataConfig {
            corpus: Corpus::Builtin { documents: 200_000 },
            seq_len: cfg.seq_len,
            batch_seqs: cfg.batch,
            ..DataConfig::default()
        },
        Tokenizer::Bytes,
    )
    .map_err(|e| e.to_string())?;
    let mut engine = Engine::new_network(
        &lm,
        EngineConfig {
            hyper: AdamWHyper {
                lr: 3e-3,
                ..AdamWHyper::default()
            },
            trace_routing: true,
            ..EngineConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let (mut first, mut last) = (None, f32::NAN);
    let (mut steps_s, mut expert_s) = (Vec::new(), Vec::new());
    for _ in 0..cfg.train_steps.max(1) {
        let batch = data.next_batch().map_err(|e| e.to_string())?;
        let m = engine
            .step_network(&lm, &batch)
            .map_err(|e| e.to_string())?;
        first.get_or_insert(m.loss);
        last = m.loss;
        steps_s.push(m.wall_s);
        expert_s.push(m.expert_compute_s_per_device.iter().sum::<f64>());
    }
    let batch: TokenBatch = data.next_batch().map_err(|e| e.to_string())?;
    let moe = lm.moe().clone();
    let mut experts: Vec<Vec<ExpertState>> = Vec::new();
    for l in 0..moe.layers {
        let mut row = Vec::new();
        for e in 0..moe.experts {
            let params = engine.expert_params(l, e).map_err(|e| e.to_string())?;
            let n = params.len();
            row.push(ExpertState {
                params,
                m: vec![0.0; n],
                v: vec![0.0; n],
                grad: vec![0.0; n],
                step: 0,
                touched: false,
            });
        }
        experts.push(row);
    }
    let dense = engine.dense_params().map_err(|e| e.to_string())?.to_vec();
    let mut recorder = Recorder {
        inner: MemoryRunner::new(&moe, &mut experts),
        layers: Vec::new(),
    };
    lm.forward_eval(&dense, &batch, &mut recorder, &PlainKernels)
        .map_err(|e| e.to_string())?;
    let layers = recorder.layers;
    let trace = engine
        .routing_trace()
        .cloned()
        .ok_or("the engine kept no routing trace")?;
    Ok(Trained {
        lm,
        layers,
        trace,
        first_loss: first.unwrap_or(f32::NAN),
        last_loss: last,
        step_s: super::median(steps_s),
        expert_s: super::median(expert_s),
    })
}
