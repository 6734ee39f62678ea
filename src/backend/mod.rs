//! Compute backends. A backend owns the dense math of expert compute (the
//! GEMMs and activations of an expert FFN) on its device; the device tier
//! (`strata_tiers::DeviceArena`) owns its memory and copies. The `cpu`
//! backend runs everywhere and runs every test.

mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

pub use cpu::CpuBackend;

use crate::math::{ExpertKind, ExpertSaved};
use crate::EngineError;

/// The calls the engine makes on a device.
pub trait Backend: Send {
    fn name(&self) -> &'static str;

    /// out (n, D) = expert(x (n, D)); `saved` keeps what the backward needs.
    #[allow(clippy::too_many_arguments)]
    fn expert_ffn_forward(
        &self,
        kind: ExpertKind,
        out: &mut [f32],
        saved: &mut ExpertSaved<f32>,
        x: &[f32],
        params: &[f32],
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError>;

    /// dx (n, D) = …, dparams += … (dx is overwritten).
    #[allow(clippy::too_many_arguments)]
    fn expert_ffn_backward(
        &self,
        kind: ExpertKind,
        dx: &mut [f32],
        dparams: &mut [f32],
        dout: &[f32],
        saved: &ExpertSaved<f32>,
        x: &[f32],
        params: &[f32],
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError>;
}
