//! What every strata crate agrees on: an expert's identity. The store
//! (`strata-tiers`) files records under it, the optimizer
//! (`strata-optim`) updates experts by it, and the engine (`strata`)
//! names them by it in its errors, metrics and timelines.
//!
//! ```
//! use strata_core::ExpertId;
//!
//! let id = ExpertId::new(2, 5);
//! assert_eq!(id.to_string(), "2.5");
//! // Layer-major order, 8 experts a layer: layer 2's expert 5 is 21st.
//! assert_eq!(id.dense_index(8), 21);
//! assert_eq!(ExpertId::from_dense_index(21, 8), id);
//! ```

/// An expert's address: its MoE layer and its index within the layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertId {
    pub layer: u32,
    pub index: u32,
}

impl ExpertId {
    pub fn new(layer: u32, index: u32) -> Self {
        Self { layer, index }
    }

    /// The expert's place in layer-major order, `experts_per_layer` a
    /// layer: `layer · experts_per_layer + index`. This and
    /// [`ExpertId::from_dense_index`] are the one conversion between an
    /// expert and a dense index (a store slot, a table row).
    pub fn dense_index(self, experts_per_layer: usize) -> usize {
        debug_assert!((self.index as usize) < experts_per_layer);
        self.layer as usize * experts_per_layer + self.index as usize
    }

    /// The expert at `dense_index` in layer-major order.
    pub fn from_dense_index(dense_index: usize, experts_per_layer: usize) -> Self {
        Self {
            layer: (dense_index / experts_per_layer) as u32,
            index: (dense_index % experts_per_layer) as u32,
        }
    }
}

impl std::fmt::Display for ExpertId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.layer, self.index)
    }
}
