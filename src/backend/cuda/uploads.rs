//! What a network's dense operations on the GPU upload once and read
//! again ([`CudaOps`]' caches): the rotary table and the documents'
//! starts every layer's attention reads, kept step after step while their
//! host values stay the same, and a load-balancing gradient every layer
//! shares within a step.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::ops::CudaOps;
use crate::math::attention::{AttnShape, RopeTable};
use crate::EngineError;

/// A load-balancing gradient on the GPU with the host values it came from.
pub(super) type AuxGrad = Uploaded<Vec<f32>, Arc<CudaSlice<f32>>>;

/// What every layer's attention reads alike, step after step, kept on the
/// GPU with the host values it was uploaded from (and uploaded again when
/// they differ): the rotary table, and every token's document start
/// (`starts`, or zeros for T tokens).
#[derive(Default)]
pub(super) struct AttentionInputs {
    rope: Option<Uploaded<RopeHost, [CudaSlice<f32>; 2]>>,
    starts: Option<Uploaded<StartsHost, CudaSlice<u32>>>,
}

/// A rotary table's cos and sin.
type RopeHost = (Vec<f32>, Vec<f32>);
/// Document starts (`None`: one document a sequence) for T tokens.
type StartsHost = (Option<Vec<u32>>, usize);

/// Values on the GPU with the host values they were uploaded from.
pub(super) struct Uploaded<H, D> {
    pub(super) host: H,
    pub(super) device: D,
}

impl CudaOps<'_> {
    /// `grad` (a router's load-balancing gradient of its probabilities)
    /// on the GPU, uploaded unless it is the last one's bits.
    pub(super) fn aux_grad(&self, grad: Vec<f32>) -> Result<Arc<CudaSlice<f32>>, EngineError> {
        let mut last = self.aux_grad.lock().unwrap_or_else(|p| p.into_inner());
        let bits = |x: &f32| x.to_bits();
        let same = |u: &&AuxGrad| u.host.iter().map(bits).eq(grad.iter().map(bits));
        if let Some(u) = last.as_ref().filter(same) {
            return Ok(Arc::clone(&u.device));
        }
        let device = Arc::new(self.gpu.upload(&grad)?);
        *last = Some(Uploaded {
            host: grad,
            device: Arc::clone(&device),
        });
        Ok(device)
    }

    /// Runs `f` on the document starts of `starts` at `shape`, uploaded
    /// once for every layer and step that asks for the same.
    pub(super) fn with_starts<R>(
        &self,
        starts: Option<&[u32]>,
        shape: &AttnShape,
        f: impl FnOnce(&CudaSlice<u32>) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        let mut inputs = self
            .gpu
            .attention_inputs
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let host = (starts.map(<[u32]>::to_vec), shape.tokens());
        if inputs.starts.as_ref().is_none_or(|u| u.host != host) {
            let device = self.gpu.attention_starts(starts, shape)?;
            inputs.starts = Some(Uploaded { host, device });
        }
        let uploaded = inputs
            .starts
            .as_ref()
            .expect("the starts were just uploaded");
        f(&uploaded.device)
    }

    /// Runs `f` on `table`'s cos and sin on the GPU, uploaded once for
    /// every layer and step that asks for the same.
    pub(super) fn with_rope<R>(
        &self,
        table: &RopeTable<f32>,
        f: impl FnOnce(&[CudaSlice<f32>; 2]) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        let mut inputs = self
            .gpu
            .attention_inputs
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let same =
            |u: &Uploaded<(Vec<f32>, Vec<f32>), _>| u.host.0 == table.cos && u.host.1 == table.sin;
        if !inputs.rope.as_ref().is_some_and(same) {
            let device = [self.gpu.upload(&table.cos)?, self.gpu.upload(&table.sin)?];
            let host = (table.cos.clone(), table.sin.clone());
            inputs.rope = Some(Uploaded { host, device });
        }
        let uploaded = inputs.rope.as_ref().expect("the table was just uploaded");
        f(&uploaded.device)
    }
}
