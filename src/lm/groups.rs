//! The groups of tensors a fine-tune names to train (`--train`), and which
//! group each of the model's tensors belongs to.

use std::fmt;

/// A group of the model's tensors, by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorGroup {
    /// The routed experts (the store's records).
    Experts,
    /// The MoE blocks' routers (`gate.weight`).
    Router,
    /// q, k, v and o projections, with their biases.
    Attention,
    /// Dense MLPs: dense layers' and shared experts' (with a shared
    /// expert's gate).
    Mlp,
    /// The token embedding and the LM head.
    Embeddings,
    /// Every RMSNorm gain: the layers', the final one, q and k norms.
    Norms,
}

impl TensorGroup {
    pub const ALL: [TensorGroup; 6] = [
        TensorGroup::Experts,
        TensorGroup::Router,
        TensorGroup::Attention,
        TensorGroup::Mlp,
        TensorGroup::Embeddings,
        TensorGroup::Norms,
    ];

    pub fn name(self) -> &'static str {
        match self {
            TensorGroup::Experts => "experts",
            TensorGroup::Router => "router",
            TensorGroup::Attention => "attention",
            TensorGroup::Mlp => "mlp",
            TensorGroup::Embeddings => "embeddings",
            TensorGroup::Norms => "norms",
        }
    }

    /// Reads a group's name; the error names them all.
    pub fn parse(name: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|g| g.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|g| g.name()).collect();
                format!(
                    "`{name}` is not a group of tensors; the groups are {}",
                    names.join(", ")
                )
            })
    }

    /// The group of a dense tensor, by its Hugging Face name; `None` for a
    /// buffer no optimizer step changes (a router's correction bias).
    pub fn of_dense(name: &str) -> Option<Self> {
        let last = name.rsplit('.').nth(1).unwrap_or("");
        Some(if name.ends_with("e_score_correction_bias") {
            return None;
        } else if name.starts_with("model.embed_tokens.") || name.starts_with("lm_head.") {
            TensorGroup::Embeddings
        } else if last.ends_with("norm") || last.ends_with("layernorm") {
            TensorGroup::Norms
        } else if name.contains(".self_attn.") {
            TensorGroup::Attention
        } else if last == "gate" {
            TensorGroup::Router
        } else {
            TensorGroup::Mlp
        })
    }
}

impl fmt::Display for TensorGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
