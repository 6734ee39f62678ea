//! Checks a checkpoint without training from it: every expert record of
//! the store's committed checkpoint read back with its checksums, and the
//! dense-state file beside it. What is damaged is named, expert by expert.

use std::path::Path;

use strata_tiers::io::{AlignedBuf, FileOptions};
use strata_tiers::{ExpertId, ExpertStore, Parts};

use super::dense_state;
use crate::EngineError;

/// What [`verify_checkpoint`] found.
#[derive(Clone, Debug, Default)]
pub struct CheckpointReport {
    /// The step the store's committed checkpoint is at.
    pub step: u64,
    pub experts: usize,
    /// Each damaged expert record and why.
    pub damaged_experts: Vec<(ExpertId, String)>,
    /// Why the dense-state file cannot be used, if it cannot.
    pub damaged_dense: Option<String>,
    /// What the store said on opening (a superblock fallback, say).
    pub notes: Vec<String>,
}

impl CheckpointReport {
    pub fn intact(&self) -> bool {
        self.damaged_experts.is_empty() && self.damaged_dense.is_none()
    }
}

/// Reads every record of the store at `store` (whole, checksums checked)
/// and the dense-state file of its committed step, which must hold
/// `dense_params` parameters. An error only when the store cannot be
/// opened at all; damage within it is reported, not returned.
pub fn verify_checkpoint(
    store: &Path,
    dense_params: usize,
) -> Result<CheckpointReport, EngineError> {
    let opened = ExpertStore::open(store, None, &FileOptions::default())?;
    let layout = opened.layout();
    let mut report = CheckpointReport {
        step: opened.committed_step(),
        experts: layout.expert_count() as usize,
        notes: opened.notes().to_vec(),
        ..CheckpointReport::default()
    };
    let mut buf = AlignedBuf::zeroed(layout.record_bytes() as usize);
    for slot in 0..layout.expert_count() {
        let expert = layout.expert_at(slot);
        if let Err(e) = opened.read(expert, Parts::Full, buf.as_mut_slice()) {
            report.damaged_experts.push((expert, e.to_string()));
        }
    }
    if let Err(e) = dense_state::read(store, report.step, dense_params, None) {
        report.damaged_dense = Some(e.to_string());
    }
    Ok(report)
}
