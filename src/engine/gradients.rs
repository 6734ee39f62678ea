//! A gradient-only pass: one batch's forward and backward through the
//! same tiers, devices and schedule as a step, with every parameter's
//! gradient handed back instead of applied. Nothing is updated: no
//! parameter, moment or step count changes.

use super::Engine;
use crate::model::Network;
use crate::EngineError;

/// Every parameter's gradient of one batch's loss, as a step would apply
/// it (summed over micro-batches and devices).
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients {
    /// The batch's loss (cross-entropy plus the weighted router terms).
    pub loss: f32,
    /// The dense parameters' gradient, laid out as
    /// [`Engine::dense_params`] (for the language model, tensor by tensor
    /// as [`MoeLm::tensors`](crate::lm::MoeLm::tensors) names them).
    pub dense: Vec<f32>,
    /// `[layer][expert]`: each expert's gradient in its params' layout
    /// (w1 | w3 | w2, as [`Engine::expert_params`]), `None` for an expert
    /// no token reached.
    pub experts: Vec<Vec<Option<Vec<f32>>>>,
}

impl Gradients {
    /// The gradient of the dense tensor `name` of `lm` (a Hugging Face name,
    /// `model.layers.0.self_attn.q_proj.weight`), if it has one so named.
    pub fn dense_tensor(&self, lm: &crate::lm::MoeLm, name: &str) -> Option<&[f32]> {
        let t = lm.tensors().iter().find(|t| t.name == name)?;
        self.dense.get(t.range.clone())
    }
}

impl Engine {
    /// The gradients of `batch`'s loss with respect to every parameter,
    /// computed as [`Engine::step_network`] computes them, without applying
    /// them.
    ///
    /// ```
    /// use strata::engine::{Engine, EngineConfig};
    /// use strata::lm::{LmConfig, MoeLm, TokenBatch};
    ///
    /// let lm = MoeLm::new(LmConfig::preset("tiny").unwrap()).unwrap();
    /// let mut engine = Engine::new_network(&lm, EngineConfig::default()).unwrap();
    /// let batch = TokenBatch { seq_len: 4, tokens: vec![5, 6, 7, 8, 9], loss_mask: None, doc_starts: None };
    /// let before = engine.dense_params().unwrap().to_vec();
    /// let grads = engine.gradients(&lm, &batch).unwrap();
    /// let wq = grads.dense_tensor(&lm, "model.layers.0.self_attn.q_proj.weight").unwrap();
    /// assert!(wq.iter().any(|&g| g != 0.0));
    /// assert_eq!(engine.dense_params().unwrap(), &before[..]); // nothing was applied
    /// ```
    pub fn gradients<N>(&mut self, net: &N, batch: &N::Batch) -> Result<Gradients, EngineError>
    where
        N: Network + Sync,
        N::Batch: Sync,
    {
        self.check_network(net)?;
        net.validate_batch(batch)?;
        self.shared.cache.take_stats();
        self.shared.cache.store().take_busy();
        self.reset_counters();
        let tokens_total = net.batch_tokens(batch);
        self.shared.collect_gradients();
        let result = self.passes(net, batch, tokens_total, None);
        // The gradients of experts only earlier micro-batches reached.
        let result = result.and_then(|r| self.shared.finish_step(None).map(|_| r));
        let (loss, dense, _) = match result {
            Ok(r) => r,
            Err(e) => {
                self.shared.discard_partial();
                return Err(e);
            }
        };
        let mut collected = self.shared.take_collected().into_iter();
        let experts = (0..self.model.layers)
            .map(|_| collected.by_ref().take(self.model.experts).collect())
            .collect();
        Ok(Gradients {
            loss,
            dense,
            experts,
        })
    }
}
